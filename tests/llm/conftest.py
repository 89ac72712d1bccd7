"""Fixtures for the LLM handler tests: one tiny model built per session, loaded like any checkpoint."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "examples" / "tiny_llm"))

import build_tiny_llm  # noqa: E402  (examples/ is not a package)

# Two cores shared by the frontend and other test runs: the model tests stay on one thread.
torch.set_num_threads(1)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """hidden 64, 2 layers, 4 heads / 2 KV heads (GQA), context 512, vocab ~1.4k, untied, seeded."""
    return build_tiny_llm.build(tmp_path_factory.mktemp("tiny-llm"), hidden=64, layers=2, heads=4, kv_heads=2)


@pytest.fixture(scope="session")
def tiny_model(tiny_model_dir: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()


@pytest.fixture(scope="session")
def tiny_tokenizer(tiny_model_dir: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)
