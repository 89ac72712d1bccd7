"""Not only Llama: the same equality on other Hugging Face causal-LM families, including sliding
windows shorter than the prompts (Mistral) and hybrid sliding/full layers (Gemma 2)."""

from __future__ import annotations

import pytest
import torch

from tests.llm.driver import FrameDriver, make_handler
from tests.llm.reference import MIN_TOP2_GAP, PROMPT_POOL, generate_reference


def build(name: str, vocab_size: int):
    import transformers as tf

    common = dict(vocab_size=vocab_size, bos_token_id=0, eos_token_id=1, pad_token_id=2, initializer_range=0.2)
    small = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                 max_position_embeddings=512)  # fmt: skip
    torch.manual_seed(0)
    if name == "gpt2":
        return tf.GPT2LMHeadModel(tf.GPT2Config(n_layer=2, n_embd=64, n_head=4, n_positions=512, **common))
    if name == "mistral-window8":
        config = tf.MistralConfig(num_hidden_layers=2, sliding_window=8, tie_word_embeddings=False, **small, **common)
        return tf.MistralForCausalLM(config)
    if name == "gemma2-hybrid-window8":
        config = tf.Gemma2Config(num_hidden_layers=4, head_dim=16, sliding_window=8, **small, **common)
        return tf.Gemma2ForCausalLM(config)
    raise ValueError(name)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("name", ["gpt2", "mistral-window8", "gemma2-hybrid-window8"])
def test_other_families_match_generate(name, tiny_model_dir, tiny_tokenizer):
    model = build(name, len(tiny_tokenizer)).eval()
    with torch.no_grad():
        model.get_output_embeddings().weight[[0, 1, 2]] = 0.0  # specials silent, as in the tiny Llama
    handler, context = make_handler(tiny_model_dir, {"prefill_chunk_size": 8}, 3, model, tiny_tokenizer)
    driver = FrameDriver(handler, context, batch_size=3)
    refs = {}
    for i, prompt in enumerate(PROMPT_POOL[:9]):
        ref = generate_reference(model, tiny_tokenizer, prompt, 6 + 3 * i)
        if ref.min_gap >= MIN_TOP2_GAP:
            refs[f"r{i}"] = ref
            driver.submit(f"r{i}", {"prompt": prompt, "max_new_tokens": ref.max_new_tokens})
    assert len(refs) >= 6
    records = driver.run()
    for request_id, ref in refs.items():
        assert records[request_id].token_ids == ref.token_ids, (name, ref.prompt)
    assert handler.num_active_requests == 0 and handler.kv_cache_tokens == 0
