"""BatchConfig.validate: errors name the key as the user writes it, the value and the file."""

import pytest

from frontend.batching.base import BatchConfig
from frontend.batching.model_batcher import ModelBatcher
from frontend.errors import InvalidConfig
from tests.batching.helpers import FakeClock

SRC = "/store/lm/model-config.yaml"


@pytest.mark.parametrize(
    "config, expected",
    [
        (BatchConfig(sequence=True, sequence_max_idle=0.0), "invalid sequenceMaxIdleMSec: 0 in " + SRC),
        (BatchConfig(batch_size=0), "invalid batchSize: 0 in " + SRC),
        (BatchConfig(max_batch_delay=-0.005), "invalid maxBatchDelay: -5 in " + SRC),
        (BatchConfig(job_queue_size=0), "invalid jobQueueSize: 0"),
        (BatchConfig(sequence=True, sequence_max_idle=1.0, sequence_timeout=0.0), "invalid sequenceTimeoutMSec: 0"),
        (BatchConfig(max_num_sequence=0), "invalid maxNumSequence: 0"),
        (BatchConfig(max_sequence_job_queue_size=0), "invalid maxSequenceJobQueueSize: 0"),
        (BatchConfig(batch_size=True), "invalid batchSize: True"),
        (BatchConfig(max_batch_delay=float("nan")), "invalid maxBatchDelay"),
        (BatchConfig(sequence=True, sequence_max_idle=1.0, sequence_end_header=""), "invalid ts_header_key_sequence_end"),
    ],
)
def test_invalid_values_name_key_value_and_file(config, expected):
    with pytest.raises(InvalidConfig) as err:
        config.validate(SRC)
    assert expected in err.value.message and SRC in err.value.message


def test_the_torchserve_trap_is_explained():
    with pytest.raises(InvalidConfig, match="must be > 0 when sequenceBatching is true"):
        BatchConfig(sequence=True).validate(SRC)


def test_valid_configs_pass():
    BatchConfig().validate(SRC)
    BatchConfig(continuous=True, batch_size=8, max_batch_delay=0).validate(SRC)
    BatchConfig(sequence=True, continuous=True, sequence_max_idle=0.001, sequence_timeout=60.0).validate(SRC)
    BatchConfig(sequence_max_idle=0.0).validate(SRC)  # no sequences: the idle timeout is unused


def test_model_batcher_refuses_an_invalid_config_at_registration():
    with pytest.raises(InvalidConfig, match="register parameters"):
        ModelBatcher("lm", BatchConfig(batch_size=0), FakeClock(), source="register parameters")


def test_policy_names():
    assert BatchConfig().policy == "dynamic"
    assert BatchConfig(continuous=True).policy == "continuous"
    assert BatchConfig(sequence=True).policy == "sequence"
    assert BatchConfig(sequence=True, continuous=True).policy == "sequence_continuous"
