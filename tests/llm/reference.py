"""Unbatched references from `model.generate(do_sample=False)`, and prompts that make equality sound.

DESIGN.md §10: batched and unbatched fp32 forwards differ by ~1e-7–1e-6, so exact token equality
is a sound test only where the reference's top-two logit gap is >= 1e-4 at every step.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

MIN_TOP2_GAP = 1e-4

PROMPT_POOL = [
    "The cat",
    "Hello there, how are you today?",
    "The river runs through the old town, past the market, the library and the church.",
    "A",
    "Numbers such as 1, 2, 3 and 42",
    "At the café we ordered two crème brûlées",
    "The scheduler decides which requests run together in the next step of the batch. Each request has a "
    "prompt, a limit on the number of new tokens and a few sampling settings.",
    "Water boils",
    "She opened the window to let in the cool air and listened to the birds in the garden. The morning "
    "train left the station a few minutes late, and most of the passengers did not seem to mind. A small "
    "bakery on the corner sells fresh bread every day before the sun comes up.",
    "Good software is tested",
    "日本語のテキスト and some English",
    "On clear nights you can see thousands of stars",
    "The baker taught his son how to shape the dough",
    "When a client goes away, the server should stop working on its request and free the memory.",
    "Our neighbour grows tomatoes",
    "The football match ended in a draw",
]


@dataclass(frozen=True)
class Reference:
    prompt: str
    prompt_ids: list[int]
    max_new_tokens: int
    token_ids: list[int]
    min_gap: float


def generate_reference(model: Any, tokenizer: Any, prompt: str, max_new_tokens: int, **kwargs: Any) -> Reference:
    prompt_ids = tokenizer(prompt)["input_ids"]
    input_ids = torch.tensor([prompt_ids])
    with torch.inference_mode():
        out = model.generate(
            input_ids,
            attention_mask=torch.ones_like(input_ids),
            do_sample=False,
            max_new_tokens=max_new_tokens,
            output_logits=True,
            return_dict_in_generate=True,
            **kwargs,
        )
    gaps = [float(step[0].topk(2).values[0] - step[0].topk(2).values[1]) for step in out.logits]
    return Reference(prompt, prompt_ids, max_new_tokens, out.sequences[0, len(prompt_ids) :].tolist(), min(gaps))


def sound_references(model: Any, tokenizer: Any, lengths: list[int]) -> list[Reference]:
    """One reference per entry of `lengths` (its max_new_tokens), each from a distinct prompt with
    a top-two gap >= MIN_TOP2_GAP at every step."""
    chosen: list[Reference] = []
    pool = iter(PROMPT_POOL)
    for max_new_tokens in lengths:
        for prompt in pool:
            ref = generate_reference(model, tokenizer, prompt, max_new_tokens)
            if ref.min_gap >= MIN_TOP2_GAP:
                chosen.append(ref)
                break
        else:
            raise AssertionError("the prompt pool ran out of prompts with a sound top-2 gap")
    return chosen
