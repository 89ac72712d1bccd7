"""The KV slab alone: random joins, decode writes, leaves, window slides and compactions keep every
row's keys/values intact, right-aligned, and the mask / positions right."""

from __future__ import annotations

import random

import torch

from handlers.llm_kv_cache import BatchKVCache, PrefillCache

LAYERS, HEADS, DIM = 2, 2, 3


def prefill(tokens: torch.Tensor) -> PrefillCache:
    """A PrefillCache holding `tokens` [heads, n, dim] as keys (values = -keys), written in 2 chunks."""
    n = tokens.shape[1]
    cache = PrefillCache(LAYERS, n)
    for begin, end in ((0, n // 2), (n // 2, n)):
        if end > begin:
            for layer in range(LAYERS):
                chunk = tokens[None, :, begin:end] + layer
                cache.update(chunk, -chunk, layer)
            cache.advance(end - begin)
    return cache


def test_random_operations_keep_rows_intact():
    rng = random.Random(0)
    torch.manual_seed(0)
    with torch.inference_mode():
        slab = BatchKVCache(LAYERS)
        rows: list[torch.Tensor] = []  # expected keys per row: [heads, len, dim]
        for _ in range(400):
            op = rng.random()
            if op < 0.25 and len(rows) < 6:
                new = torch.randn(HEADS, rng.randrange(1, 12), DIM)
                longest = max([r.shape[1] for r in rows] + [new.shape[1]]) + 4
                if not slab.fits(len(rows) + 1, longest):
                    slab.reshape(len(rows) + 2, longest + rng.randrange(0, 6), like=prefill(new))
                assert slab.add_row(prefill(new)) == len(rows)
                rows.append(new)
            elif op < 0.4 and rows:
                row = rng.randrange(len(rows))
                moved = slab.remove_row(row)
                if moved is not None:
                    rows[row] = rows[moved]
                rows.pop()
            elif rows:
                if max(r.shape[1] for r in rows) + 1 > slab.col_capacity:
                    continue  # the engine never lets a row outgrow the slab (admission reserves it)
                slab.ensure_decode_room()
                mask, positions = slab.decode_inputs(torch.device("cpu"))
                assert positions[:, 0].tolist() == [r.shape[1] for r in rows]
                assert mask.shape == (len(rows), slab.width + 1)
                assert mask.sum(dim=1).tolist() == [r.shape[1] + 1 for r in rows]
                column = torch.randn(len(rows), HEADS, 1, DIM)
                for layer in range(LAYERS):
                    keys, values = slab.update(column + layer, -(column + layer), layer)
                    assert keys.shape == (len(rows), HEADS, slab.width + 1, DIM)
                slab.advance(1)
                rows = [torch.cat([r, column[i]], dim=1) for i, r in enumerate(rows)]
            slab.check()
            assert slab.num_tokens == sum(r.shape[1] for r in rows)
            for i, expected in enumerate(rows):
                n = expected.shape[1]
                for layer in range(LAYERS):
                    keys, values = slab.layer_kv(layer)
                    assert torch.equal(keys[i, :, slab.end - n : slab.end], expected + layer)
                    assert torch.equal(values[i, :, slab.end - n : slab.end], -(expected + layer))
        for row in reversed(range(len(rows))):
            slab.remove_row(row)
        assert slab.num_rows == 0 and slab.width == 0
        slab.release()
        assert slab.num_cells == 0
