"""`conveyor serve MODEL_DIR` end to end, and the handler's static-batching mode (continuousBatching off)."""

from __future__ import annotations

import json
import re
import signal
import sys
import threading
from pathlib import Path
from typing import Any
from collections.abc import Iterator

import pytest
import requests
import yaml

from backend.context import Context
from backend.handler_loader import load_handler
from backend.protocol import InferReply, InferRequest, InputParameter, RequestState, WireRequest
from backend.service import Service
from tests.integration.server import ConveyorProcess, pid_alive, wait_until
from tests.integration.test_openai import build_tiny_checkpoint

TIMEOUT = 60


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A Hugging Face checkpoint directory; its basename is the served model's default name."""
    return build_tiny_checkpoint(tmp_path_factory.mktemp("ckpt") / "tiny-chat")


def serve(workdir: Path, checkpoint: Path, *flags: str, token_auth: bool = False) -> ConveyorProcess:
    """`conveyor serve` in the foreground, on free ports, through the shared process fixture."""
    server = ConveyorProcess(workdir)
    ports = server.ports
    server.argv = [sys.executable, "-m", "frontend.cli", "serve", str(checkpoint), "--port", str(ports["inference"]),
                   "--management-port", str(ports["management"]), "--metrics-port", str(ports["metrics"]),
                   "--pid-file", str(server.pid_file), *flags]
    if not token_auth:
        server.argv.append("--disable-token-auth")
    return server


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_serve_answers_chat_and_stops_cleanly_on_sigterm(checkpoint: Path, tmp_path: Path) -> None:
    from openai import OpenAI

    server = serve(tmp_path, checkpoint, "--batch-size", "4", token_auth=True).start()
    try:
        # Token authorization is on, as for `conveyor start`: the client's api_key is the inference key.
        keys = json.loads((tmp_path / "key_file.json").read_text())
        key = keys["inference"]["key"]
        with OpenAI(base_url=f"{server.inference}/v1", api_key=key, max_retries=0, timeout=TIMEOUT) as client:
            assert [m.id for m in client.models.list().data] == ["tiny-chat"]  # the directory's basename
            result = client.chat.completions.create(model="tiny-chat", messages=[{"role": "user", "content": "Hi!"}])
            # No max_tokens: generation_config.json's max_new_tokens (64), not an error.
            assert result.usage.completion_tokens == 64 and result.choices[0].message.content
        assert requests.get(f"{server.inference}/v1/models", timeout=TIMEOUT).status_code == 401  # no key
        described = requests.get(f"{server.management}/models/tiny-chat", timeout=TIMEOUT,
                                 headers={"Authorization": f"Bearer {keys['management']['key']}"}).json()[0]
        assert described["batchSize"] == 4 and described["continuousBatching"] is True
        pids = [w["pid"] for w in described["workers"]]
        synthesized = re.search(r"registered from (\S+)", server.log_tail(200))
        assert pids and synthesized is not None and Path(synthesized.group(1)).is_dir()
        assert server.proc is not None
        server.proc.send_signal(signal.SIGTERM)
        assert server.proc.wait(30) == 0
        assert wait_until(lambda: not any(pid_alive(p) for p in pids), timeout=10)
        assert not Path(synthesized.group(1)).exists()  # the synthesized model directory is removed
        assert not server.pid_file.exists() and "Model server stopped." in server.log_tail()
        assert (checkpoint / "config.json").is_file()  # the checkpoint itself is untouched
    finally:
        server.stop()


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_serve_without_continuous_batching_streams_static_batches(checkpoint: Path, tmp_path: Path) -> None:
    server = serve(tmp_path, checkpoint, "--no-continuous-batching", "--batch-size", "4", "--max-batch-delay", "50",
                   "--served-model-name", "static").start()
    try:
        assert server.describe("static")["continuousBatching"] is False
        results: dict[int, list[dict[str, Any]]] = {}

        def run(i: int) -> None:
            body = {"model": "static", "prompt": f"Request {i}", "max_tokens": 6 + 4 * i, "stream": True}
            with requests.post(f"{server.inference}/v1/completions", json=body, stream=True, timeout=TIMEOUT) as r:
                events = [line[len("data: "):] for line in r.iter_lines(decode_unicode=True) if line]
            assert events[-1] == "[DONE]"
            results[i] = [json.loads(e) for e in events[:-1]]

        threads = [threading.Thread(target=run, args=(i,)) for i in range(4)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(TIMEOUT)
        for i in range(4):
            chunks = results[i]
            assert len(chunks) > 1 and chunks[-1]["choices"][0]["finish_reason"] == "length"  # streamed, then ended
        # The batch-mates' state was freed in the frame: nothing is left in the handler.
        assert wait_until(lambda: "vllm:num_requests_running{model_name=\"static\"} 0.0"
                          in requests.get(f"{server.metrics}/metrics", timeout=TIMEOUT).text, timeout=10)
    finally:
        server.stop()


# ---- the handler's static mode through the real worker logic (no process) ---------------------------


@pytest.fixture(scope="module")
def tiny(checkpoint: Path) -> Iterator[tuple[Any, Any]]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    yield AutoModelForCausalLM.from_pretrained(checkpoint).eval(), AutoTokenizer.from_pretrained(checkpoint)


def _new(request_id: str, body: dict) -> WireRequest:
    return WireRequest(request_id, RequestState.NEW,
                       parameters=(InputParameter("body", "application/json", json.dumps(body).encode()),))


@pytest.mark.timeout(120)
def test_static_batching_runs_the_frame_to_the_end_with_intermediate_replies(checkpoint: Path, tiny: tuple) -> None:
    from tests.llm.reference import sound_references

    model, tokenizer = tiny
    references = sound_references(model, tokenizer, [5, 17, 9])
    yaml_config = {**yaml.safe_load((checkpoint / "model-config.yaml").read_text()), "continuousBatching": False}
    context = Context("tiny", str(checkpoint), {}, 4, None, model_yaml_config=yaml_config)
    loaded = load_handler("text_generation", checkpoint, context)
    sent: list[InferReply] = []
    service = Service(loaded, context, max_response_size=1 << 20, send=sent.append)
    requests_ = [_new(f"r{i}", {"prompt": r.prompt, "max_new_tokens": r.max_new_tokens})
                 for i, r in enumerate(references)]
    requests_.append(_new("bad", {"prompt": "x", "top_p": 7}))
    final = service.predict(InferRequest(1, tuple(requests_)))

    assert final.final and all(not reply.final for reply in sent)
    assert len(sent) == 16  # one intermediate reply per step until the longest (17 tokens) ends
    assert all(not r.done for reply in sent for r in reply.results)
    by_id = {r.request_id: r for r in final.results}
    assert by_id["bad"].status == 400 and all(r.done for r in final.results)
    for i, ref in enumerate(references):
        chunks = [json.loads(r.body) for reply in sent for r in reply.results if r.request_id == f"r{i}"]
        chunks.append(json.loads(by_id[f"r{i}"].body))
        assert [t for c in chunks for t in c["token_ids"]] == ref.token_ids  # == unbatched generate
        assert chunks[-1]["finish_reason"] == "length" and chunks[-1]["completion_tokens"] == ref.max_new_tokens
    assert loaded.instance.num_active_requests == 0 and loaded.instance.kv_cache_tokens == 0
