"""Choose the next token of every row from one step's logits.

Greedy rows (temperature 0) take the argmax in one vectorised call — the same `torch.argmax`
tie-breaking (first maximum) as `generate(do_sample=False)`. Sampling rows are processed one by
one, each with its own `torch.Generator`, so a seeded request draws the same tokens whoever its
batch mates are: nothing random is shared between rows. Warpers run in `generate`'s order:
temperature, then top-k, then top-p.
"""

from __future__ import annotations

import secrets
from collections.abc import Sequence

import torch

from handlers.llm_requests import GenerationParams


def make_generator(seed: int | None, device: torch.device | str = "cpu") -> torch.Generator:
    """A private generator for one request: seeded when asked, else from the OS's entropy."""
    generator = torch.Generator(device=device)
    generator.manual_seed(seed if seed is not None else secrets.randbits(63))
    return generator


def sample_next_tokens(
    logits: torch.Tensor,
    params: Sequence[GenerationParams],
    generators: Sequence[torch.Generator | None],
) -> list[int]:
    """Next token id per row of `logits` [rows, vocab] (float32 preferred)."""
    if logits.shape[0] != len(params):
        raise ValueError(f"{logits.shape[0]} rows of logits for {len(params)} requests")
    tokens = logits.argmax(dim=-1).tolist()
    for row, row_params in enumerate(params):
        if not row_params.greedy:
            generator = generators[row]
            if generator is None:
                raise ValueError("a sampling request needs its generator")
            tokens[row] = _sample_row(logits[row], row_params, generator)
    return tokens


def _sample_row(logits: torch.Tensor, params: GenerationParams, generator: torch.Generator) -> int:
    scores = logits.float() / params.temperature
    if 0 < params.top_k < scores.shape[-1]:
        kth_best = torch.topk(scores, params.top_k).values[-1]
        scores = scores.masked_fill(scores < kth_best, float("-inf"))
    if params.top_p < 1.0:
        sorted_scores, order = torch.sort(scores, descending=True)
        cumulative = sorted_scores.softmax(dim=-1).cumsum(dim=-1)
        # Drop a token when the tokens strictly before it already reach top_p; the best always stays.
        drop_sorted = (cumulative - sorted_scores.softmax(dim=-1)) >= params.top_p
        drop_sorted[0] = False
        scores = scores.masked_fill(torch.zeros_like(drop_sorted).scatter(0, order, drop_sorted), float("-inf"))
    probs = scores.softmax(dim=-1)
    return int(torch.multinomial(probs, 1, generator=generator).item())
