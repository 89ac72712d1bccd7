"""The handler's contract: loading, per-request errors that spare the batch, cancellation, defaults."""

from __future__ import annotations

import pytest
import yaml

from backend.context import RequestEntry
from handlers.text_generation import HandlerConfig, TextGenerationHandler
from tests.llm.driver import FrameDriver, make_context, make_handler
from tests.llm.reference import generate_reference

GOOD = ["The cat", "Hello there, how are you today?", "Water boils"]


@pytest.fixture
def handler(tiny_model_dir, tiny_model, tiny_tokenizer):
    return make_handler(tiny_model_dir, {"prefill_chunk_size": 8}, 4, tiny_model, tiny_tokenizer)


def test_initialize_loads_the_checkpoint_with_its_model_config(tiny_model_dir, tiny_model, tiny_tokenizer):
    yaml_config = yaml.safe_load((tiny_model_dir / "model-config.yaml").read_text())
    assert yaml_config["continuousBatching"] is True and yaml_config["handler"]["model_path"] == "."
    context = make_context(tiny_model_dir, yaml_config["handler"])
    handler = TextGenerationHandler()
    handler.initialize(context)  # AutoModelForCausalLM / AutoTokenizer.from_pretrained(model_dir)
    assert handler.initialized and handler.limits.context_length == 512
    assert handler.limits.default_max_new_tokens == 64  # the checkpoint's generation_config
    assert handler.engine.config.eos_token_ids == {tiny_tokenizer.eos_token_id}
    driver = FrameDriver(handler, context, batch_size=2)
    driver.submit("a", "The cat")  # a plain-text body is a prompt; no max_new_tokens → 64
    record = driver.run()["a"]
    assert record.token_ids == generate_reference(tiny_model, tiny_tokenizer, "The cat", 64).token_ids
    assert record.final["finish_reason"] == "length" and record.final["completion_tokens"] == 64


def test_prompt_over_the_context_gets_400_and_the_others_continue(handler, tiny_model, tiny_tokenizer):
    h, context = handler
    driver = FrameDriver(h, context, batch_size=4)
    driver.submit("g0", {"prompt": GOOD[0], "max_new_tokens": 12})
    driver.step()  # g0 is running when the bad requests arrive
    driver.submit("long", {"prompt": "the cat sat on the mat " * 120, "max_new_tokens": 4})
    driver.submit("bad", {"prompt": "x", "temperature": -1})
    driver.submit("g1", {"prompt": GOOD[1], "max_new_tokens": 10})
    driver.step()
    assert driver.records["long"].done and driver.records["long"].status == 400
    assert "context length is 512 tokens" in driver.records["long"].final["error"]
    assert driver.records["bad"].status == 400 and '"temperature"' in driver.records["bad"].final["error"]
    assert h.num_active_requests == 2
    driver.submit("g2", {"prompt": GOOD[2], "max_new_tokens": 7})
    records = driver.run()
    for request_id, prompt, n in (("g0", GOOD[0], 12), ("g1", GOOD[1], 10), ("g2", GOOD[2], 7)):
        assert records[request_id].status == 200
        assert records[request_id].token_ids == generate_reference(tiny_model, tiny_tokenizer, prompt, n).token_ids


@pytest.mark.parametrize("state", ["waiting", "prefilling", "running"])
def test_cancel_frees_the_request_at_once(tiny_model_dir, tiny_model, tiny_tokenizer, state):
    config = {"prefill_chunk_size": 4, "max_batch_tokens": 130}
    h, context = make_handler(tiny_model_dir, config, 4, tiny_model, tiny_tokenizer)
    driver = FrameDriver(h, context, batch_size=4)
    driver.submit("a", {"prompt": GOOD[1], "max_new_tokens": 50})  # reserves 62 of 130 columns
    driver.step()
    long_prompt = "The scheduler decides which requests run together in the next step of the batch."
    driver.submit("b", {"prompt": long_prompt, "max_new_tokens": 4 if state != "waiting" else 100})
    driver.step()
    driver.step()
    engine = h.engine
    status = {"waiting": engine.num_waiting_requests, "prefilling": engine.num_prefilling_requests,
              "running": engine.num_running_requests - 1}[state]  # fmt: skip
    if state == "running":
        while engine.num_prefilling_requests:
            driver.step()
        status = engine.num_running_requests - 1
    assert status == 1, (state, engine.num_waiting_requests, engine.num_prefilling_requests)
    tokens, active = h.kv_cache_tokens, h.num_active_requests
    finals = h.cancel(["b"])
    assert finals["b"]["finish_reason"] == "cancelled"
    assert h.num_active_requests == active - 1
    assert h.kv_cache_tokens < tokens or state == "waiting"
    engine.batch_cache.check()
    driver.cancel("b")
    driver.run()
    assert h.num_active_requests == 0 and h.kv_cache_tokens == 0 and h.kv_cache_capacity == 0
    assert driver.records["a"].token_ids == generate_reference(tiny_model, tiny_tokenizer, GOOD[1], 50).token_ids


def test_cancel_of_every_request_frees_everything(handler):
    h, context = handler
    driver = FrameDriver(h, context, batch_size=4)
    for i, prompt in enumerate(GOOD):
        driver.submit(f"r{i}", {"prompt": prompt, "max_new_tokens": 30})
    for _ in range(3):
        driver.step()
    assert h.num_active_requests == 3 and h.kv_cache_tokens > 0
    assert set(h.cancel(["r0", "r1", "r2", "unknown"])) == {"r0", "r1", "r2"}
    assert h.num_active_requests == 0 and h.kv_cache_tokens == 0 and h.kv_cache_capacity == 0


def test_frame_edge_cases(handler):
    h, context = handler
    # A CONTINUE for an id the handler does not know: 500 for it alone.
    context.begin_frame([RequestEntry("ghost", {}, "", False), RequestEntry("n", {}, "", True)])
    results = h.handle([{"body": {}}, {"body": {"prompt": "The cat", "max_new_tokens": 3}}], context)
    assert results[0]["error"].startswith("request 'ghost' is not active")
    assert context.get_response_status(0)[0] == 500 and context.is_done(0)
    assert results[1]["finish_reason"] is None and not context.is_done(1)
    # A frame that still carries a request cancelled in it: finish_reason "cancelled", done.
    context.begin_frame([RequestEntry("n", {}, "", False)], ["n"])
    results = h.handle([{"body": {}}], context)
    assert results[0]["finish_reason"] == "cancelled" and context.is_done(0)
    assert h.num_active_requests == 0
    # A live request missing from a frame without a cancel is freed.
    context.begin_frame([RequestEntry("m", {}, "", True)])
    h.handle([{"body": {"prompt": "The cat", "max_new_tokens": 5}}], context)
    context.begin_frame([RequestEntry("k", {}, "", True)])
    h.handle([{"body": {"prompt": "Water boils", "max_new_tokens": 5}}], context)
    assert h.engine.request_ids() == ["k"]
    # A NEW for a live id restarts it from its new body.
    context.begin_frame([RequestEntry("k", {}, "", True)])
    results = h.handle([{"body": {"prompt": "The cat", "max_new_tokens": 5}}], context)
    assert results[0]["prompt_tokens"] == 3 and results[0]["completion_tokens"] == 1
    assert h.engine.request_ids() == ["k"]


def test_chat_messages(handler, tiny_model, tiny_tokenizer):
    h, context = handler
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is the capital of France?"}]
    driver = FrameDriver(h, context)
    driver.submit("c", {"messages": messages, "max_new_tokens": 8})
    record = driver.run()["c"]
    prompt = tiny_tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    ids = tiny_tokenizer(prompt, add_special_tokens=False)["input_ids"]
    assert record.final["prompt_tokens"] == len(ids)
    import torch

    expected = tiny_model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                   do_sample=False, max_new_tokens=8)[0, len(ids):].tolist()  # fmt: skip
    assert record.token_ids == expected


@pytest.mark.parametrize(
    ("section", "fragment"),
    [
        ({"max_batch_token": 5}, "unknown key(s) handler.max_batch_token"),
        ({"dtype": "float64"}, "handler.dtype must be one of"),
        ({"max_batch_tokens": 0}, "handler.max_batch_tokens must be an integer >= 1"),
        ({"prefill_chunk_size": "big"}, "handler.prefill_chunk_size must be an integer"),
        ({"trust_remote_code": "yes"}, "handler.trust_remote_code must be true or false"),
    ],
)
def test_config_errors_name_the_key_and_file(tiny_model_dir, section, fragment):
    with pytest.raises(ValueError) as info:
        HandlerConfig.from_context(make_context(tiny_model_dir, section))
    assert fragment in str(info.value) and "model-config.yaml" in str(info.value)


def test_model_path_is_relative_to_the_model_dir(tmp_path):
    context = make_context(tmp_path, {"model_path": "weights"})
    assert HandlerConfig.from_context(context).model_path == str(tmp_path / "weights")
    context.model_yaml_config.pop("handler")
    assert HandlerConfig.from_context(context).model_path == str(tmp_path)


def test_bfloat16_loads_and_generates(tiny_model_dir):
    import torch

    h, context = make_handler(tiny_model_dir, {"dtype": "bfloat16"}, 2)
    assert h.model.dtype == torch.bfloat16
    driver = FrameDriver(h, context, batch_size=2)
    driver.submit("a", {"prompt": "The cat", "max_new_tokens": 6})
    driver.submit("b", {"prompt": "Hello there, how are you today?", "max_new_tokens": 9})
    records = driver.run()
    assert len(records["a"].token_ids) == 6 and len(records["b"].token_ids) == 9  # bf16: not compared exactly
