"""The OpenAI-compatible routes against a real server and the real `openai` client, on the tiny LLM.

Unit tests of the request mapping run without a server; the rest share one server (the tiny model
archived with the project's archiver, continuous batching, batchSize 4).
"""

from __future__ import annotations

import json
import re
import socket
import sys
import threading
from pathlib import Path
from typing import Any
from collections.abc import Iterator

import pytest
import requests
from prometheus_client.parser import text_string_to_metric_families

from frontend.openai.protocol import Endpoint, OpenAIError, parse_request
from tests.integration.server import EXAMPLES, ConveyorProcess, wait_until

TIMEOUT = 60  # seconds for any one HTTP call


def build_tiny_checkpoint(out: Path) -> Path:
    """The tiny random Llama (docs/llm.md), built locally in a few seconds."""
    sys.path.insert(0, str(EXAMPLES / "tiny_llm"))
    import build_tiny_llm

    return build_tiny_llm.build(out)


# ---- request mapping (no server) ------------------------------------------------------------------


def test_openai_parameters_map_to_the_handler_body() -> None:
    request = parse_request(Endpoint.CHAT, {
        "model": "m", "messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
        ],
        "max_completion_tokens": 7, "max_tokens": 99, "temperature": 0.5, "top_p": 0.9, "seed": 3, "stop": ["\n"],
        "n": 1, "stream": True, "stream_options": {"include_usage": True}, "user": "ignored", "top_k": 5,
    })
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "a\nb"}]
    assert request.body == {"messages": messages, "max_new_tokens": 7, "temperature": 0.5, "top_p": 0.9,
                            "top_k": 5, "seed": 3, "stop": ["\n"]}
    assert request.stream and request.include_usage and request.model == "m"
    completion = parse_request(Endpoint.COMPLETIONS, {"model": "m", "prompt": ["once"], "max_tokens": 3})
    assert completion.body == {"prompt": "once", "max_new_tokens": 3} and not completion.stream
    # No max_tokens: the handler's default applies (generation_config, else the server default).
    assert "max_new_tokens" not in parse_request(Endpoint.COMPLETIONS, {"model": "m", "prompt": "x"}).body


@pytest.mark.parametrize("body, param", [
    ({"n": 2}, "n"), ({"logprobs": 2}, "logprobs"), ({"echo": True}, "echo"), ({"best_of": 3}, "best_of"),
    ({"presence_penalty": 0.5}, "presence_penalty"), ({"prompt": ["a", "b"]}, "prompt"), ({"prompt": [1, 2]}, "prompt"),
    ({"stream_options": {"include_usage": True}}, "stream_options"), ({"model": None}, "model"),
])
def test_unsupported_parameters_are_refused_with_the_param_named(body: dict, param: str) -> None:
    with pytest.raises(OpenAIError) as info:
        parse_request(Endpoint.COMPLETIONS, {"model": "m", "prompt": "x", **body})
    assert info.value.status == 400 and info.value.param == param
    assert set(info.value.to_json()["error"]) == {"message", "type", "param", "code"}


def test_llm_load_sums_worker_reports_and_counts_idle_workers_as_empty() -> None:
    from types import SimpleNamespace

    from backend.protocol import WireResult
    from frontend.openai.llm_load import STATS_HEADER, LLMLoad, WorkerLoad

    assert WorkerLoad.parse("kv_tokens=5;kv_capacity=100;running=2;waiting=1") == WorkerLoad(5, 100, 2, 1)
    assert WorkerLoad.parse("garbage") is None
    stats = {"w1": {"num_active": 3}, "w2": {"num_active": 0}}
    model = SimpleNamespace(name="llm", version="1.0", archive=SimpleNamespace(handler="text_generation"),
                            batcher=SimpleNamespace(stats=lambda: stats, queue_depth=4))
    echo = SimpleNamespace(name="echo", version="1.0", archive=SimpleNamespace(handler="echo.py"),
                           batcher=SimpleNamespace(stats=lambda: {"w3": {"num_active": 1}}, queue_depth=0))
    load = LLMLoad(SimpleNamespace(all_versions=lambda: [model, echo]))  # type: ignore[arg-type]
    assert list(load.sample()) == [("llm", 0, 4, 0, 0)]  # listed before any report; echo is not an LLM
    for worker, value in (("w1", "kv_tokens=30;kv_capacity=100;running=3;waiting=2"),
                          ("w2", "kv_tokens=99;kv_capacity=100;running=9;waiting=9")):  # w2's report is stale
        load.observe("llm", "1.0", worker, WireResult("r", headers=((STATS_HEADER, value),)))
    assert list(load.sample()) == [("llm", 3, 4 + 2, 30, 200)]


# ---- against a server ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def llm_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ConveyorProcess]:
    sys.path.insert(0, str(EXAMPLES / "tiny_llm"))
    import build_tiny_llm

    root = tmp_path_factory.mktemp("llm")
    checkpoint = build_tiny_checkpoint(root / "tiny_llm")
    config = checkpoint / "model-config.yaml"
    config.write_text(config.read_text().replace("batchSize: 8", "batchSize: 4"))
    store = root / "store"
    store.mkdir()
    assert build_tiny_llm.archive(checkpoint, store, "tiny_llm") is not None
    with ConveyorProcess(root / "server", model_store=store, models=["tiny_llm=tiny_llm.mar"]) as proc:
        yield proc


@pytest.fixture
def client(llm_server: ConveyorProcess) -> Iterator[Any]:
    from openai import OpenAI

    with OpenAI(base_url=f"{llm_server.inference}/v1", api_key="unused", max_retries=0, timeout=TIMEOUT) as c:
        yield c


def scrape(server: ConveyorProcess) -> dict[tuple[str, str], float]:
    """{(sample name, model label): value} for the LLM block."""
    text = requests.get(f"{server.metrics}/metrics", timeout=TIMEOUT).text
    out: dict[tuple[str, str], float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            model = sample.labels.get("model") or sample.labels.get("model_name") or ""
            if "llm" in sample.name or sample.name.startswith("vllm:"):
                out[(sample.name, model)] = out.get((sample.name, model), 0.0) + sample.value
    return out


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_models_and_completions_with_the_openai_client(client: Any, llm_server: ConveyorProcess) -> None:
    assert "tiny_llm" in [m.id for m in client.models.list().data]
    result = client.completions.create(model="tiny_llm", prompt="The cat", max_tokens=12)
    choice = result.choices[0]
    assert choice.finish_reason == "length" and choice.text and result.object == "text_completion"
    assert result.usage.completion_tokens == 12 and result.usage.total_tokens == result.usage.prompt_tokens + 12
    # Streaming gives the same greedy text, piece by piece, then [DONE] (the client stops on it).
    pieces = list(client.completions.create(model="tiny_llm", prompt="The cat", max_tokens=12, stream=True))
    assert "".join(p.choices[0].text for p in pieces) == choice.text
    assert [p.choices[0].finish_reason for p in pieces][-1] == "length"
    assert all(p.choices[0].finish_reason is None for p in pieces[:-1]) and all(p.usage is None for p in pieces)
    # The TorchServe route streams the handler's own chunks: same tokens, same text.
    response = requests.post(f"{llm_server.inference}/predictions/tiny_llm",
                             json={"prompt": "The cat", "max_new_tokens": 12},
                             headers={"Accept": "text/event-stream"}, timeout=TIMEOUT)
    events = [json.loads("\n".join(line.removeprefix("data: ") for line in event.splitlines()))
              for event in response.text.split("\n\n") if event.strip()]
    assert "".join(e["text"] for e in events) == choice.text and events[-1]["finish_reason"] == "length"
    assert sum(len(e["token_ids"]) for e in events) == 12
    # No max_tokens: the checkpoint's generation_config default (64), never an error.
    assert client.completions.create(model="tiny_llm", prompt="Hi").usage.completion_tokens == 64


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_chat_completions_streaming_and_not(client: Any) -> None:
    messages = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hello there"}]
    result = client.chat.completions.create(model="tiny_llm", messages=messages, max_tokens=10)
    message = result.choices[0].message
    assert message.role == "assistant" and message.content and result.object == "chat.completion"
    assert result.usage.completion_tokens == 10 and result.choices[0].finish_reason == "length"
    chunks = list(client.chat.completions.create(model="tiny_llm", messages=messages, max_completion_tokens=10,
                                                 stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == message.content
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 10
    assert chunks[-1].usage.prompt_tokens == result.usage.prompt_tokens
    assert chunks[-2].choices[0].finish_reason == "length"
    assert all(c.object == "chat.completion.chunk" and c.id == chunks[0].id for c in chunks)


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_errors_come_in_openai_shape(client: Any, llm_server: ConveyorProcess) -> None:
    import openai

    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model="tiny_llm", prompt="x", n=2)
    assert info.value.status_code == 400 and info.value.param == "n"
    with pytest.raises(openai.NotFoundError) as missing:
        client.chat.completions.create(model="nope", messages=[{"role": "user", "content": "x"}])
    assert missing.value.code == "model_not_found"
    with pytest.raises(openai.BadRequestError) as handler_error:  # the handler's own check, its message
        client.completions.create(model="tiny_llm", prompt="x", temperature=-1)
    assert '"temperature"' in handler_error.value.message
    url = llm_server.inference
    for method, path, body, status in (("POST", "/v1/completions", b"{not json", 400), ("GET", "/v1/nothing", b"", 404),
                                       ("POST", "/v1/chat/completions", b'{"model": "tiny_llm"}', 400)):
        response = requests.request(method, url + path, data=body, timeout=TIMEOUT)
        assert response.status_code == status
        assert set(response.json()["error"]) == {"message", "type", "param", "code"}, response.text


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_prompt_over_the_context_is_400_while_others_complete(client: Any) -> None:
    import openai

    results: dict[str, Any] = {}

    def run(name: str, prompt: str, stream: bool) -> None:
        try:
            if stream:
                chunks = list(client.completions.create(model="tiny_llm", prompt=prompt, max_tokens=40, stream=True,
                                                        stream_options={"include_usage": True}))
                results[name] = (chunks[-1].usage.completion_tokens, chunks[-2].choices[0].finish_reason)
            else:
                result = client.completions.create(model="tiny_llm", prompt=prompt, max_tokens=40)
                results[name] = (result.usage.completion_tokens, result.choices[0].finish_reason)
        except openai.APIStatusError as exc:
            results[name] = exc

    threads = [threading.Thread(target=run, args=(f"ok{i}", f"Request number {i} says", i % 2 == 0)) for i in range(3)]
    threads.append(threading.Thread(target=run, args=("long", "the cat sat on the mat " * 150, False)))
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(TIMEOUT)
    error = results["long"]
    assert isinstance(error, openai.BadRequestError) and "context length is 512 tokens" in error.message
    assert error.body["type"] == "invalid_request_error"
    assert [results[f"ok{i}"] for i in range(3)] == [(40, "length")] * 3


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_disconnect_mid_stream_frees_the_handler_state(llm_server: ConveyorProcess, client: Any) -> None:
    body = json.dumps({"model": "tiny_llm", "prompt": "Once", "max_tokens": 480, "ignore_eos": True,
                       "stream": True}).encode()
    with socket.create_connection(("127.0.0.1", llm_server.ports["inference"]), timeout=TIMEOUT) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"x-request-id: llm-gone\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
        received = b""
        while received.count(b"data: ") < 2:  # two tokens streamed, then the client hangs up
            data = sock.recv(65536)
            assert data, received
            received += data
        assert b"HTTP/1.1 200" in received and b"text/event-stream" in received
    # The handler logs the cancel with what it still holds: nothing, as this was the only request.
    freed = re.compile(r"request llm-gone cancelled: its state is freed \(0 live requests, 0 KV tokens held\)")
    assert wait_until(lambda: freed.search(llm_server.log_tail(400)) is not None, timeout=30), llm_server.log_tail(40)
    assert "llm-gone is live but absent" not in llm_server.log_tail(2000)  # not freed by the leak guard
    # The gauges agree, and the model keeps serving.
    assert wait_until(lambda: scrape(llm_server).get(("vllm:num_requests_running", "tiny_llm")) == 0, timeout=10)
    metrics = scrape(llm_server)
    assert metrics[("vllm:kv_cache_usage_perc", "tiny_llm")] == 0
    assert metrics[("conveyor_llm_kv_cache_tokens", "tiny_llm")] == 0
    assert metrics[("conveyor_llm_kv_cache_budget_tokens", "tiny_llm")] == 8192
    assert client.completions.create(model="tiny_llm", prompt="again", max_tokens=3).usage.completion_tokens == 3


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_llm_metrics_are_exported(llm_server: ConveyorProcess, client: Any) -> None:
    before = scrape(llm_server)
    client.completions.create(model="tiny_llm", prompt="Count with me", max_tokens=9)
    after = scrape(llm_server)
    key = "tiny_llm"

    def grew(name: str) -> float:
        return after.get((name, key), 0.0) - before.get((name, key), 0.0)

    assert grew("conveyor_llm_generation_tokens_total") == 9
    assert grew("conveyor_llm_time_to_first_token_seconds_count") == 1
    assert grew("conveyor_llm_inter_token_latency_seconds_count") == 8
    assert grew("conveyor_llm_prompt_tokens_total") > 0
    assert after[("conveyor_llm_active_sequences", key)] == 0
    for gauge in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc"):
        assert (gauge, key) in after
