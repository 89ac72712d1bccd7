"""Configuration parsing: config.properties (+ CLI + env precedence) and model-config.yaml layers."""

from __future__ import annotations

from pathlib import Path

import pytest

from frontend.config import load_server_config, locate_config_file, parse_properties, resolve_model_config
from frontend.errors import InvalidConfig

pytestmark = pytest.mark.timeout(10)


def write(tmp_path: Path, text: str, name: str = "config.properties") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


# config.properties syntax -----------------------------------------------------------------------


def test_properties_syntax_separators_comments_and_continuations() -> None:
    props = parse_properties(
        "# comment\n! also a comment\n"
        "a=1\nb : two\nc three\n"
        'models={\\\n  "m": {"1.0": {"batchSize": 4}}\\\n}\n'
        "path=C\\:\\\\dir\n"
        "empty=\n"
    )
    assert props["a"] == "1" and props["b"] == "two" and props["c"] == "three"
    assert props["models"] == '{"m": {"1.0": {"batchSize": 4}}}'
    assert props["path"] == "C:\\dir"
    assert props["empty"] == ""


def test_defaults_without_a_file() -> None:
    cfg = load_server_config(None, cpu_count=3)
    assert cfg.inference_address.url == "http://127.0.0.1:8080"
    assert cfg.management_address.port == 8081 and cfg.metrics_address.port == 8082
    assert cfg.job_queue_size == 100 and cfg.max_request_size == 6553500
    assert cfg.default_workers_per_model == 3 and cfg.configured_workers_per_model == 0
    assert cfg.enable_model_api is False
    assert cfg.sequence_id_header == "ts_request_sequence_id"


def test_torchserve_file_with_unknown_and_ignored_keys(tmp_path: Path) -> None:
    store = tmp_path / "store"
    store.mkdir()
    path = write(tmp_path, (
        "inference_address=http://0.0.0.0:9080\nmanagement_address=http://127.0.0.1:9081\n"
        f"model_store={store}\nload_models=all\nnumber_of_netty_threads=32\nvmargs=-Xmx4g\n"
        "job_queue_size=7\ndefault_workers_per_model=2\nenable_model_api=TRUE\n"
        "ts_header_key_sequence_id=X-Seq-Id\nsomething_new=1\n"
    ))
    cfg = load_server_config(path)
    assert cfg.inference_address.host == "0.0.0.0" and cfg.inference_address.port == 9080
    assert cfg.model_store == store.resolve() and cfg.load_models == ("all",)
    assert cfg.job_queue_size == 7 and cfg.default_workers_per_model == 2 and cfg.enable_model_api
    assert cfg.sequence_id_header == "x-seq-id"
    assert cfg.extra["something_new"] == "1"


def test_precedence_cli_over_file_and_env_over_both_when_enabled(tmp_path: Path) -> None:
    path = write(tmp_path, "job_queue_size=5\nmax_request_size=10\nenable_envvars_config=true\n")
    env = {"TS_JOB_QUEUE_SIZE": "9"}
    cfg = load_server_config(path, overrides={"job_queue_size": "6", "max_request_size": "11"}, environ=env)
    assert cfg.job_queue_size == 9  # env (enabled) > CLI > file
    assert cfg.max_request_size == 11  # CLI > file


def test_env_ignored_unless_enabled(tmp_path: Path) -> None:
    path = write(tmp_path, "job_queue_size=5\n")
    cfg = load_server_config(path, environ={"TS_JOB_QUEUE_SIZE": "9"})
    assert cfg.job_queue_size == 5


def test_env_references_in_values(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CONVEYOR_TEST_PORT", "9999")
    cfg = load_server_config(write(tmp_path, "inference_address=http://127.0.0.1:$$CONVEYOR_TEST_PORT$$\n"))
    assert cfg.inference_address.port == 9999


def test_locate_config_file_order(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cwd_file = write(tmp_path, "a=1\n")
    cli_file = write(tmp_path, "a=2\n", "cli.properties")
    env_file = write(tmp_path, "a=3\n", "env.properties")
    monkeypatch.delenv("TS_CONFIG_FILE", raising=False)
    assert locate_config_file(None, tmp_path) == cwd_file
    assert locate_config_file(str(cli_file), tmp_path) == cli_file
    monkeypatch.setenv("TS_CONFIG_FILE", str(env_file))
    assert locate_config_file(str(cli_file), tmp_path) == env_file
    monkeypatch.setenv("TS_CONFIG_FILE", str(tmp_path / "missing"))
    with pytest.raises(InvalidConfig, match="TS_CONFIG_FILE"):
        locate_config_file(None, tmp_path)


@pytest.mark.parametrize("text, key, fragment", [
    ("job_queue_size=lots\n", "job_queue_size", "must be an integer"),
    ("job_queue_size=0\n", "job_queue_size", "must be >= 1"),
    ("max_request_size=-5\n", "max_request_size", "must be >= 1"),
    ("enable_model_api=maybe\n", "enable_model_api", "must be true or false"),
    ("inference_address=https://127.0.0.1:8443\n", "inference_address", "https"),
    ("inference_address=http://127.0.0.1\n", "inference_address", "port is missing"),
    ("management_address=ftp://x:1\n", "management_address", "http://HOST:PORT"),
    ("metrics_address=http://127.0.0.1:99999\n", "metrics_address", "port"),
    ("models={not json\n", "models", "not valid JSON"),
    ('models={"m": 1}\n', "models", "expected"),
    ("allowed_urls=([\n", "allowed_urls", "regular expression"),
    ("model_store=/does/not/exist\n", "model_store", "not a directory"),
    ("ts_header_key_sequence_id=bad header\n", "ts_header_key_sequence_id", "header name"),
    ("inference_address=$$CONVEYOR_SURELY_UNSET$$\n", "inference_address", "CONVEYOR_SURELY_UNSET"),
])
def test_invalid_server_values_name_key_value_and_file(tmp_path: Path, text: str, key: str, fragment: str) -> None:
    path = write(tmp_path, text)
    with pytest.raises(InvalidConfig) as info:
        load_server_config(path)
    message = info.value.message
    assert f"'{key}'" in message and str(path) in message and fragment in message


def test_invalid_cli_value_names_the_command_line() -> None:
    with pytest.raises(InvalidConfig, match="command line"):
        load_server_config(None, overrides={"job_queue_size": "x"})


# model-config.yaml ------------------------------------------------------------------------------


def server(**overrides: str):
    return load_server_config(None, overrides={k: str(v) for k, v in overrides.items()}, cpu_count=4)


def test_model_config_from_yaml_and_batch_config() -> None:
    yaml = {"minWorkers": 2, "maxWorkers": 3, "batchSize": 8, "maxBatchDelay": 5, "responseTimeout": 30,
            "startupTimeout": 60, "jobQueueSize": 50, "clientTimeoutInMills": 1000, "handler": {"k": "v"},
            "deviceType": "cpu", "torchrun": {"nproc-per-node": 1}}
    cfg = resolve_model_config(server(), "m", "1.0", yaml, "model-config.yaml of m.mar")
    assert (cfg.min_workers, cfg.max_workers, cfg.batch_size, cfg.max_batch_delay_ms) == (2, 3, 8, 5)
    assert cfg.response_timeout_s == 30 and cfg.startup_timeout_s == 60 and cfg.client_timeout_ms == 1000
    assert cfg.handler == {"k": "v"} and cfg.raw["deviceType"] == "cpu"  # unknown keys kept, not errors
    batch = cfg.to_batch_config()
    assert batch.batch_size == 8 and batch.max_batch_delay == pytest.approx(0.005) and batch.job_queue_size == 50
    assert not batch.continuous and not batch.sequence


def test_model_config_defaults_come_from_the_server() -> None:
    cfg = resolve_model_config(server(job_queue_size=7, default_response_timeout=9, default_startup_timeout=8),
                               "m", "1.0", {}, "f")
    assert cfg.job_queue_size == 7 and cfg.response_timeout_s == 9 and cfg.startup_timeout_s == 8
    assert cfg.batch_size == 1 and cfg.max_batch_delay_ms == 100
    assert cfg.min_workers == cfg.max_workers == 4  # default_workers_per_model: the CPU count here


def test_model_config_precedence_yaml_over_models_json_over_api() -> None:
    srv = server(models='{"m": {"1.0": {"batchSize": 4, "maxBatchDelay": 50, "responseTimeout": 11}}}')
    api = {"batchSize": 2, "maxBatchDelay": 20, "responseTimeout": 12, "startupTimeout": 13}
    cfg = resolve_model_config(srv, "m", "1.0", {"batchSize": 8}, "f", api_params=api)
    assert cfg.batch_size == 8  # yaml
    assert cfg.max_batch_delay_ms == 50 and cfg.response_timeout_s == 11  # models JSON
    assert cfg.startup_timeout_s == 13  # register parameter


def test_workers_initial_workers_wins_and_register_default_is_zero() -> None:
    srv = server()
    assert resolve_model_config(srv, "m", "1", {"minWorkers": 2}, "f", initial_workers=3).min_workers == 3
    cfg = resolve_model_config(srv, "m", "1", {}, "f", default_workers=srv.configured_workers_per_model)
    assert cfg.min_workers == 0 and cfg.max_workers == 0
    assert resolve_model_config(srv, "m", "1", {"minWorkers": 3}, "f", default_workers=0).max_workers == 3


def test_sequence_and_continuous_keys_reach_the_batch_config() -> None:
    yaml = {"sequenceBatching": True, "continuousBatching": "true", "sequenceMaxIdleMSec": 2500,
            "sequenceTimeoutMSec": 10000, "maxNumSequence": 4, "maxSequenceJobQueueSize": 3}
    batch = resolve_model_config(server(), "m", "1", yaml, "f").to_batch_config("x-end")
    assert batch.sequence and batch.continuous
    assert batch.sequence_max_idle == pytest.approx(2.5) and batch.sequence_timeout == pytest.approx(10.0)
    assert batch.max_num_sequence == 4 and batch.max_sequence_job_queue_size == 3
    assert batch.sequence_end_header == "x-end"


@pytest.mark.parametrize("yaml, key, fragment", [
    ({"batchSize": "eight"}, "batchSize", "must be an integer"),
    ({"batchSize": 0}, "batchSize", "must be >= 1"),
    ({"batchSize": True}, "batchSize", "must be an integer"),
    ({"maxBatchDelay": -1}, "maxBatchDelay", "must be >= 0"),
    ({"responseTimeout": 0}, "responseTimeout", "must be >= 1"),
    ({"minWorkers": 1.5}, "minWorkers", "must be an integer"),
    ({"jobQueueSize": 0}, "jobQueueSize", "must be >= 1"),
    ({"continuousBatching": "sometimes"}, "continuousBatching", "true or false"),
    ({"minWorkers": 3, "maxWorkers": 2}, "maxWorkers", "must be >= minWorkers"),
    ({"sequenceBatching": True}, "sequenceMaxIdleMSec", "must be > 0"),
    ({"handler": ["not", "a", "mapping"]}, "handler", "must be a mapping"),
])
def test_invalid_model_values_name_key_value_and_file(yaml: dict, key: str, fragment: str) -> None:
    with pytest.raises(InvalidConfig) as info:
        resolve_model_config(server(), "m", "1.0", yaml, "model-config.yaml of m.mar")
    message = info.value.message
    assert f"'{key}'" in message and "model-config.yaml of m.mar" in message and fragment in message


def test_yaml_that_is_not_a_mapping_is_refused() -> None:
    with pytest.raises(InvalidConfig, match="must be a mapping"):
        resolve_model_config(server(), "m", "1.0", ["a"], "f")  # type: ignore[arg-type]


def test_invalid_models_json_entry_names_its_origin() -> None:
    srv = server(models='{"m": {"1.0": {"batchSize": "x"}}}')
    with pytest.raises(InvalidConfig, match="`models` entry for m 1.0"):
        resolve_model_config(srv, "m", "1.0", {}, "f")
