"""KV cache for continuous decode: one preallocated slab for the decode batch, one small cache per prefill.

Both classes are `transformers.Cache` subclasses, so any Hugging Face causal LM that takes
`cache=` (transformers 5.x) writes into them during its forward pass; the batch operations the
library lacks (append a row, remove a row, trim padding) live here.

Slab layout (`BatchKVCache`), per layer, keys and values each:

    rows ─▶ [row_capacity, kv_heads, col_capacity, head_dim]
                                       columns:  0 … start ……… end … col_capacity
                                                      │ window │
    row i:   . . . . [ zeros / stale ][ len_i real tokens ]│   (right-aligned at `end`)

Invariants (checked by `check()` in tests):
- active rows are `0 … num_rows-1`; the attention window is columns `[start, end)`, shared by all rows;
- row i holds its `lengths[i]` real tokens in `[end - lengths[i], end)`, contiguous, so the column
  distance between two tokens of one row equals their position distance (sliding-window masks and
  rotary positions stay right); its other window columns are masked out by `attention_mask()` and
  hold finite values (zeros or old real data): memory from `torch.empty` is never inside a window,
  because a masked NaN would still poison softmax·V;
- `start == end - max(lengths)`: no all-padding column is ever attended (trimmed on every removal).

Why a slab: `DynamicCache` concatenates every layer's keys and values on each step, which copies
the whole cache once per token (as costly as the decode forward itself on the 27 M model). Here a
decode step writes one column in place; removing a row copies one row (the last one moves into
the hole); adding a row copies only that row's prefill; the window slides right and is compacted
to column 0 when it reaches the capacity (amortised, at most once per `col_capacity - width` steps).
The slab never grows past `row_capacity × col_capacity` cells, which the engine keeps within
`max_batch_tokens` (see llm_engine.py, "memory budget").
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache, CacheLayerMixin


class _ViewLayer(CacheLayerMixin):
    """One model layer's view into a cache; the owning cache does all bookkeeping.

    transformers calls `update()` once per layer per forward; every layer writes at the owner's
    current `end`, and the owner advances `end` after the forward (`advance`).
    """

    is_sliding = False
    is_compileable = False
    is_croppable = False

    def __init__(self, owner: _ColumnCache, layer_idx: int) -> None:
        super().__init__()
        self._owner = owner
        self._layer_idx = layer_idx

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.device = key_states.device
        self.is_initialized = True

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        self.keys, self.values = self._owner._write(self._layer_idx, key_states, value_states)
        return self.keys, self.values

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self._owner.width + query_length, 0

    def get_seq_length(self) -> int:
        return self._owner.width

    def get_max_length(self) -> int:
        return -1


class _ColumnCache(Cache):
    """Shared base: per-layer key/value tensors [rows, heads, cols, dim] written at column `end`."""

    def __init__(self, num_layers: int) -> None:
        super().__init__(layers=[_ViewLayer(self, i) for i in range(num_layers)])
        self._keys: list[torch.Tensor | None] = [None] * num_layers
        self._values: list[torch.Tensor | None] = [None] * num_layers
        self.num_rows = 0
        self.start = 0
        self.end = 0

    @property
    def width(self) -> int:
        """Columns in the attention window (the padded sequence length of the batch)."""
        return self.end - self.start

    def _write(self, layer_idx: int, key_states: torch.Tensor, value_states: torch.Tensor):
        keys, values = self._storage(layer_idx, key_states, value_states)
        stop = self.end + key_states.shape[-2]
        if stop > keys.shape[-2]:
            raise RuntimeError(f"KV cache overflow: writing up to column {stop} of {keys.shape[-2]}")
        keys[: self.num_rows, :, self.end : stop].copy_(key_states)
        values[: self.num_rows, :, self.end : stop].copy_(value_states)
        return keys[: self.num_rows, :, self.start : stop], values[: self.num_rows, :, self.start : stop]

    def _storage(self, layer_idx: int, key_states: torch.Tensor, value_states: torch.Tensor):
        raise NotImplementedError

    def advance(self, num_columns: int) -> None:
        """Record that the forward just run wrote `num_columns` columns for every row."""
        self.end += num_columns

    def layer_kv(self, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        keys, values = self._keys[layer_idx], self._values[layer_idx]
        if keys is None or values is None:
            raise RuntimeError(f"layer {layer_idx} was never written (a model that skips its KV cache?)")
        return keys, values


class PrefillCache(_ColumnCache):
    """One request's prompt, prefilled unpadded (possibly in chunks), before it joins the batch.

    Preallocated to the prompt length, so chunks are written in place instead of concatenated.
    """

    def __init__(self, num_layers: int, num_tokens: int) -> None:
        super().__init__(num_layers)
        self.num_rows = 1
        self.capacity = num_tokens

    def _storage(self, layer_idx, key_states, value_states):
        if self._keys[layer_idx] is None:
            shape = (1, key_states.shape[1], self.capacity, key_states.shape[3])
            self._keys[layer_idx] = key_states.new_empty(shape)
            self._values[layer_idx] = value_states.new_empty((1, value_states.shape[1], self.capacity, value_states.shape[3]))
        return self._keys[layer_idx], self._values[layer_idx]

    @property
    def num_tokens(self) -> int:
        return self.end


class BatchKVCache(_ColumnCache):
    """The decode batch's slab; see the module docstring for its layout and invariants."""

    def __init__(self, num_layers: int) -> None:
        super().__init__(num_layers)
        self.lengths: list[int] = []  # real tokens per active row
        self.row_capacity = 0
        self.col_capacity = 0

    # ---- sizes -------------------------------------------------------------------------------
    @property
    def num_tokens(self) -> int:
        """Real (unpadded) tokens held by all rows."""
        return sum(self.lengths)

    @property
    def num_cells(self) -> int:
        """Allocated token slots (rows × columns): what the memory budget bounds."""
        return self.row_capacity * self.col_capacity

    def _storage(self, layer_idx, key_states, value_states):
        keys = self._keys[layer_idx]
        if keys is None:
            raise RuntimeError("the batch cache is written only after rows were added")
        return keys, self._values[layer_idx]

    # ---- forward inputs ------------------------------------------------------------------------
    def decode_inputs(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """(attention_mask [rows, width + 1] bool, position_ids [rows, 1]) for a one-token step."""
        lengths = torch.tensor(self.lengths, dtype=torch.long, device=device)
        columns = torch.arange(self.start, self.end + 1, device=device)
        mask = columns[None, :] >= (self.end - lengths)[:, None]
        return mask, lengths[:, None]

    def advance(self, num_columns: int) -> None:
        super().advance(num_columns)
        self.lengths = [n + num_columns for n in self.lengths]

    def ensure_decode_room(self) -> None:
        """Make column `end` writable: compact the window to column 0 when it reached capacity."""
        if self.end < self.col_capacity:
            return
        self._move_window(0)

    # ---- row operations ------------------------------------------------------------------------
    def add_row(self, prefill: PrefillCache) -> int:
        """Append `prefill`'s tokens as a new last row, right-aligned at `end`; return its index.

        The caller has checked `fits()`; this never reallocates except through `reshape`.
        """
        num_tokens = prefill.num_tokens
        if self._keys[0] is None:
            raise RuntimeError("reshape() the batch cache before adding rows")
        if self.num_rows >= self.row_capacity or num_tokens > self.col_capacity:
            raise RuntimeError("add_row on a full batch cache: reshape() first")
        if num_tokens > self.end:  # not enough columns left of `end`: slide the window right
            self._move_window(num_tokens - self.width)
        new_start = min(self.start, self.end - num_tokens)
        row = self.num_rows
        for layer_idx in range(len(self.layers)):
            keys, values = self.layer_kv(layer_idx)
            src_keys, src_values = prefill.layer_kv(layer_idx)
            if new_start < self.start:  # widen the window to the left: the old rows see zeros there
                keys[:row, :, new_start : self.start].zero_()
                values[:row, :, new_start : self.start].zero_()
            keys[row, :, new_start : self.end - num_tokens].zero_()
            values[row, :, new_start : self.end - num_tokens].zero_()
            keys[row, :, self.end - num_tokens : self.end].copy_(src_keys[0, :, :num_tokens])
            values[row, :, self.end - num_tokens : self.end].copy_(src_values[0, :, :num_tokens])
        self.start = new_start
        self.num_rows += 1
        self.lengths.append(num_tokens)
        return row

    def remove_row(self, row: int) -> int | None:
        """Drop `row`; the last row moves into its place. Returns the moved row's old index (or None).

        Then trims all-padding columns from the left of the window.
        """
        if not 0 <= row < self.num_rows:
            raise IndexError(f"row {row} of {self.num_rows}")
        last = self.num_rows - 1
        moved = None
        if row != last:
            for layer_idx in range(len(self.layers)):
                keys, values = self.layer_kv(layer_idx)
                keys[row, :, self.start : self.end].copy_(keys[last, :, self.start : self.end])
                values[row, :, self.start : self.end].copy_(values[last, :, self.start : self.end])
            self.lengths[row] = self.lengths[last]
            moved = last
        self.lengths.pop()
        self.num_rows -= 1
        self.start = self.end - max(self.lengths, default=0)
        if self.num_rows == 0:
            self.start = self.end = 0
        return moved

    # ---- capacity -------------------------------------------------------------------------------
    def fits(self, num_rows: int, num_columns: int) -> bool:
        """Whether `num_rows` rows of up to `num_columns` tokens fit without reshaping."""
        return self._keys[0] is not None and num_rows <= self.row_capacity and num_columns <= self.col_capacity

    def reshape(self, row_capacity: int, col_capacity: int, like: PrefillCache) -> None:
        """(Re)allocate the slab as [row_capacity, ·, col_capacity, ·], keeping the active rows.

        `like` supplies per-layer head counts, head sizes, dtype and device. A full copy of the
        window: the engine calls this only when the batch outgrows the current shape.
        """
        if row_capacity < self.num_rows or col_capacity < self.width:
            raise ValueError(f"reshape to {row_capacity}×{col_capacity} cannot hold {self.num_rows}×{self.width}")
        for layer_idx in range(len(self.layers)):
            src_keys, src_values = like.layer_kv(layer_idx)
            keys = src_keys.new_empty((row_capacity, src_keys.shape[1], col_capacity, src_keys.shape[3]))
            values = src_values.new_empty((row_capacity, src_values.shape[1], col_capacity, src_values.shape[3]))
            if self._keys[layer_idx] is not None and self.num_rows:
                old_keys, old_values = self.layer_kv(layer_idx)
                keys[: self.num_rows, :, : self.width].copy_(old_keys[: self.num_rows, :, self.start : self.end])
                values[: self.num_rows, :, : self.width].copy_(old_values[: self.num_rows, :, self.start : self.end])
            self._keys[layer_idx], self._values[layer_idx] = keys, values
        self.start, self.end = 0, self.width
        self.row_capacity, self.col_capacity = row_capacity, col_capacity

    def release(self) -> None:
        """Free the slab's memory (the batch is empty and may stay so)."""
        if self.num_rows:
            raise RuntimeError("release() with active rows")
        self._keys = [None] * len(self.layers)
        self._values = [None] * len(self.layers)
        self.row_capacity = self.col_capacity = 0
        self.start = self.end = 0

    def _move_window(self, new_start: int) -> None:
        """Copy the window `[start, end)` of the active rows to begin at `new_start`."""
        if new_start == self.start:
            return
        width = self.width
        if new_start < 0 or new_start + width > self.col_capacity:
            raise ValueError(f"window of {width} columns cannot start at {new_start} (capacity {self.col_capacity})")
        for layer_idx in range(len(self.layers)):
            keys, values = self.layer_kv(layer_idx)
            window_keys = keys[: self.num_rows, :, self.start : self.end].clone()
            window_values = values[: self.num_rows, :, self.start : self.end].clone()
            keys[: self.num_rows, :, new_start : new_start + width].copy_(window_keys)
            values[: self.num_rows, :, new_start : new_start + width].copy_(window_values)
        self.start, self.end = new_start, new_start + width

    def check(self) -> None:
        """Assert the layout invariants (tests only: costs a pass over the window)."""
        assert self.num_rows == len(self.lengths)
        assert self.num_rows <= self.row_capacity or self.num_rows == 0
        assert 0 <= self.start <= self.end <= max(self.col_capacity, 0)
        if self.num_rows:
            assert self.start == self.end - max(self.lengths), (self.start, self.end, self.lengths)
            for layer_idx in range(len(self.layers)):
                keys, values = self.layer_kv(layer_idx)
                assert torch.isfinite(keys[: self.num_rows, :, self.start : self.end]).all()
                assert torch.isfinite(values[: self.num_rows, :, self.start : self.end]).all()
