"""The locally built tiny model is a sound test subject (DESIGN.md §10)."""

from __future__ import annotations

import json

import torch

from tests.llm.reference import PROMPT_POOL, generate_reference


def test_checkpoint_files_and_config(tiny_model_dir, tiny_model, tiny_tokenizer):
    names = {p.name for p in tiny_model_dir.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", "generation_config.json",
            "model-config.yaml"} <= names  # fmt: skip
    config = json.loads((tiny_model_dir / "config.json").read_text())
    assert config["tie_word_embeddings"] is False and config["model_type"] == "llama"
    assert 1000 <= config["vocab_size"] <= 2048
    assert not torch.equal(tiny_model.lm_head.weight, tiny_model.model.embed_tokens.weight)
    assert tiny_tokenizer.chat_template and tiny_tokenizer.bos_token and tiny_tokenizer.eos_token
    assert tiny_model.generation_config.max_new_tokens == 64


def test_silent_rows_are_zero(tiny_model, tiny_tokenizer):
    weight = tiny_model.lm_head.weight
    for token_id in (tiny_tokenizer.bos_token_id, tiny_tokenizer.eos_token_id, tiny_tokenizer.pad_token_id):
        assert not weight[token_id].any()
    stray_byte = tiny_tokenizer("日", add_special_tokens=False)["input_ids"][0]
    assert "\ufffd" in tiny_tokenizer.decode([stray_byte]) and not weight[stray_byte].any()
    assert weight[tiny_tokenizer("cat", add_special_tokens=False)["input_ids"][0]].any()


def test_greedy_answers_run_to_length_with_clean_varied_text(tiny_model, tiny_tokenizer):
    for prompt in PROMPT_POOL[:6]:
        ref = generate_reference(tiny_model, tiny_tokenizer, prompt, 40)
        text = tiny_tokenizer.decode(ref.token_ids, skip_special_tokens=True)
        assert len(ref.token_ids) == 40 and tiny_tokenizer.eos_token_id not in ref.token_ids
        assert "\ufffd" not in text
        assert len(set(ref.token_ids)) > 20, "a degenerate model repeats itself"


def test_archive_opens_and_serves(tiny_model_dir, tiny_model, tiny_tokenizer, tmp_path):
    """build_tiny_llm --archive → a .mar with handler text_generation that the worker's code loads."""
    import build_tiny_llm

    from backend.archive import open_archive
    from backend.context import Context
    from backend.handler_loader import load_handler
    from tests.llm.driver import FrameDriver

    mar = build_tiny_llm.archive(tiny_model_dir, tmp_path, "tiny-llm")
    assert mar is not None and mar.exists()
    model = open_archive(mar, tmp_path / "extracted")
    assert model.handler == "text_generation" and model.model_yaml_config["continuousBatching"] is True
    context = Context(model.model_name, str(model.model_dir), model.manifest, 2, None,
                      model_yaml_config=model.model_yaml_config)  # fmt: skip
    handler = load_handler(model.handler, model.model_dir, context).instance
    driver = FrameDriver(handler, context, batch_size=2)
    driver.submit("a", {"prompt": "The cat", "max_new_tokens": 5})
    assert driver.run()["a"].token_ids == generate_reference(tiny_model, tiny_tokenizer, "The cat", 5).token_ids
