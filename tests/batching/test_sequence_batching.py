"""SequenceBatching and the SequenceTable with a fake clock: affinity, order, limits, ending,
timeouts, tombstones, worker loss."""

import pytest

from backend.protocol import WireResult
from frontend.batching.sequence_batching import SequenceBatching
from frontend.batching.sequence_table import SequenceAlreadyOpen, SequenceState
from frontend.errors import (
    QueueFull, RequestTimeout, SequenceClosed, SequenceError, SequenceExpired, SequenceLimit,
    SequenceUnknown, SequenceWorkerLost,
)
from frontend.jobs import JobState
from tests.batching.helpers import FakeClock, ids, make_batcher, reply, results, seq_job

IDLE = 5.0


def seqb(clock=None, workers=("w1",), **config):
    clock = clock or FakeClock()
    config.setdefault("batch_size", 4)
    config.setdefault("max_batch_delay", 0.0)
    config.setdefault("sequence_max_idle", IDLE)
    config.setdefault("max_num_sequence", 8)
    config.setdefault("max_sequence_job_queue_size", 4)
    batcher = make_batcher(clock, sequence=True, **config)
    aggs = [batcher.add_worker(w) for w in workers]
    return clock, batcher, aggs


def step(agg, done=True):
    """Send the next frame and answer it; returns the frame (None when there was nothing to send)."""
    frame = agg.next_frame()
    if frame is not None:
        agg.on_reply(reply(frame, done=done))
    return frame


def test_policy_is_sequence():
    _, batcher, (agg,) = seqb()
    assert isinstance(agg, SequenceBatching) and batcher.policy == "sequence"


def test_affinity_across_two_workers():
    _, batcher, (w1, w2) = seqb(workers=("w1", "w2"))
    batcher.submit(seq_job("a0", "A"))
    batcher.submit(seq_job("b0", "B"))  # fewest open sequences: w2
    assert ids(step(w1).new_jobs) == ["a0"]
    assert ids(step(w2).new_jobs) == ["b0"]
    for i in range(1, 4):
        batcher.submit(seq_job(f"a{i}", "A"))
        batcher.submit(seq_job(f"b{i}", "B"))
        assert step(w2).new_jobs[0].request_id == f"b{i}"  # w2 never gets A's jobs
        assert step(w1).new_jobs[0].request_id == f"a{i}"
    assert batcher.describe_sequences()["open_by_worker"] == {"w1": 1, "w2": 1}


def test_jobs_of_a_sequence_go_in_arrival_order_one_at_a_time():
    _, batcher, (agg,) = seqb(batch_size=4)
    for i in range(3):
        batcher.submit(seq_job(f"a{i}", "A"))
    batcher.submit(seq_job("b0", "B"))
    frame = agg.next_frame()
    assert ids(frame.new_jobs) == ["a0", "b0"]  # one job of A in flight, never two
    agg.on_reply(reply(frame))
    assert ids(step(agg).new_jobs) == ["a1"]
    assert ids(step(agg).new_jobs) == ["a2"]
    assert step(agg) is None


def test_a_worker_serves_up_to_batch_size_sequences_in_turn():
    _, batcher, (agg,) = seqb(batch_size=2)
    for sid in "ABC":
        batcher.submit(seq_job(f"{sid.lower()}0", sid))
    assert ids(step(agg).new_jobs) == ["a0", "b0"]
    batcher.submit(seq_job("a1", "A"))
    assert ids(step(agg).new_jobs) == ["c0", "a1"]  # C waited longest; A went to the back


def test_a_stream_of_intermediate_replies_then_final():
    _, batcher, (agg,) = seqb()
    batcher.submit(seq_job("a0", "A"))
    frame = agg.next_frame()
    out = agg.on_reply(reply(frame, done=False, final=False))
    assert not out[0][1].done and agg.num_active == 1
    out = agg.on_reply(reply(frame, done=True, final=True))
    assert out[0][0].state == JobState.DONE and agg.num_active == 0


def test_idle_timeout_expires_the_sequence_and_rejects_its_id():
    clock, batcher, (agg,) = seqb()
    batcher.submit(seq_job("a0", "A"))
    step(agg)
    assert agg.wake_at() == pytest.approx(clock.now + IDLE)  # the worker loop wakes for the deadline
    clock.advance(IDLE - 0.001)
    assert batcher.tick() == [] and batcher.sequences.state_of("A") == SequenceState.OPEN
    clock.advance(0.001)
    assert batcher.tick() == []  # nothing was waiting
    assert batcher.sequences.state_of("A") == SequenceState.EXPIRED
    assert agg.wake_at() is None  # no spin on a passed deadline
    with pytest.raises(SequenceExpired) as err:
        batcher.submit(seq_job("a1", "A"))
    assert err.value.status == 410
    assert "sequence 'A' of model 'm' expired" in err.value.message and "sequenceMaxIdleMSec" in err.value.message
    assert batcher.describe_sequences()["num_expired"] == 1


def test_a_queued_or_running_sequence_is_not_idle():
    clock, batcher, (agg,) = seqb()
    batcher.submit(seq_job("a0", "A"))
    frame = agg.next_frame()
    clock.advance(IDLE * 3)  # a long request is not idleness
    batcher.tick()
    agg.on_reply(reply(frame))
    assert batcher.sequences.state_of("A") == SequenceState.OPEN
    clock.advance(IDLE)
    agg.next_frame()  # the worker loop's own step also reaps
    assert batcher.sequences.state_of("A") == SequenceState.EXPIRED


def test_absolute_timeout_fails_waiting_jobs_and_tombstones():
    clock, batcher, (agg,) = seqb(sequence_timeout=2.0, max_sequence_job_queue_size=2)
    batcher.submit(seq_job("a0", "A"))
    frame = agg.next_frame()
    batcher.submit(seq_job("a1", "A"))
    batcher.submit(seq_job("a2", "A"))
    assert agg.wake_at() == pytest.approx(clock.now + 2.0)
    clock.advance(2.0)
    failures = batcher.tick()
    assert sorted(j.request_id for j, _ in failures) == ["a0", "a1", "a2"]  # a0 was still running
    assert all(isinstance(e, SequenceExpired) and "sequenceTimeoutMSec" in e.message for _, e in failures)
    assert all(j.state == JobState.FAILED for j, _ in failures)
    assert agg.on_reply(reply(frame)) == []  # a0's late result is dropped: its client has its error
    with pytest.raises(SequenceExpired):
        batcher.submit(seq_job("a3", "A"))


def test_client_end_flag_closes_after_the_job_and_frees_capacity():
    _, batcher, (agg,) = seqb(max_num_sequence=1)
    batcher.submit(seq_job("a0", "A"))
    with pytest.raises(SequenceLimit) as err:
        batcher.submit(seq_job("b0", "B"))
    assert err.value.status == 503 and err.value.retry_after and "maxNumSequence=1" in err.value.message
    step(agg)
    batcher.submit(seq_job("a1", "A", end=True))
    with pytest.raises(SequenceClosed, match="is ending"):
        batcher.submit(seq_job("a2", "A"))
    frame = agg.next_frame()
    assert batcher.sequences.state_of("A") == SequenceState.ENDING
    agg.on_reply(reply(frame))
    assert batcher.sequences.state_of("A") == SequenceState.CLOSED
    batcher.submit(seq_job("b0", "B"))  # capacity freed
    with pytest.raises(SequenceClosed) as err:
        batcher.submit(seq_job("a3", "A"))
    assert err.value.status == 410
    assert "sequence 'A' of model 'm' was closed (ended by the client's end flag)" in err.value.message


def test_handler_end_header_closes_at_once_and_fails_queued_jobs():
    _, batcher, (agg,) = seqb(max_num_sequence=2)
    batcher.submit(seq_job("a0", "A"))
    batcher.submit(seq_job("c0", "C"))
    frame = agg.next_frame()
    batcher.submit(seq_job("a1", "A"))  # queued behind a0
    with pytest.raises(SequenceLimit):
        batcher.submit(seq_job("b0", "B"))
    out = agg.on_reply(results(
        frame.frame_id,
        WireResult("a0", headers=[("TS_Request_Sequence_End", "A; C")]),  # name matched case-insensitively
        WireResult("c0"),
    ))
    assert ids(j for j, _ in out) == ["a0", "c0"]  # the closing result itself is delivered
    assert batcher.sequences.state_of("A") == SequenceState.CLOSED
    assert batcher.sequences.state_of("C") == SequenceState.CLOSED
    failures = batcher.tick()
    assert [(j.request_id, type(e)) for j, e in failures] == [("a1", SequenceClosed)]
    assert "ended by the handler" in failures[0][1].message
    batcher.submit(seq_job("b0", "B"))  # capacity freed at once
    assert batcher.describe_sequences()["num_closed"] == 2


def test_a_handler_cannot_end_another_workers_sequence():
    _, batcher, (w1, w2) = seqb(workers=("w1", "w2"))
    batcher.submit(seq_job("a0", "A"))
    batcher.submit(seq_job("b0", "B"))
    step(w2)
    frame = w1.next_frame()
    w1.on_reply(results(frame.frame_id, WireResult("a0", headers=[("ts_request_sequence_end", "B")])))
    assert batcher.sequences.state_of("B") == SequenceState.OPEN


def test_tombstones_are_bounded():
    _, batcher, (agg,) = seqb(max_tombstones=2)
    for sid in "ABC":
        batcher.submit(seq_job(f"{sid}0", sid, end=True))
        step(agg)
    assert batcher.describe_sequences()["num_tombstones"] == 2
    batcher.submit(seq_job("A1", "A"))  # the oldest tombstone was dropped: A is a new sequence
    for sid in "BC":
        with pytest.raises(SequenceClosed):
            batcher.submit(seq_job(f"{sid}1", sid))


def test_tombstones_expire_after_their_ttl():
    clock, batcher, (agg,) = seqb(tombstone_ttl=60.0)
    batcher.submit(seq_job("a0", "A", end=True))
    step(agg)
    clock.advance(59.0)
    with pytest.raises(SequenceClosed):
        batcher.submit(seq_job("a1", "A"))
    clock.advance(1.0)
    batcher.tick()
    assert batcher.describe_sequences()["num_tombstones"] == 0
    batcher.submit(seq_job("a2", "A"))
    assert batcher.sequences.state_of("A") == SequenceState.OPEN


def test_per_sequence_queue_limit_and_model_queue_limit():
    _, batcher, (agg,) = seqb(max_sequence_job_queue_size=1, job_queue_size=2)
    batcher.submit(seq_job("a0", "A"))
    agg.next_frame()  # a0 in flight: A's queue is empty
    batcher.submit(seq_job("a1", "A"))
    with pytest.raises(SequenceLimit) as err:
        batcher.submit(seq_job("a2", "A"))
    assert "maxSequenceJobQueueSize=1" in err.value.message and err.value.status == 503
    batcher.submit(seq_job("b0", "B"))
    with pytest.raises(QueueFull):
        batcher.submit(seq_job("c0", "C"))
    assert batcher.queue_depth == 2
    assert batcher.sequences.state_of("C") is None  # a refused first request opens nothing


def test_strict_start():
    _, batcher, (agg,) = seqb(sequence_strict_start=True)
    with pytest.raises(SequenceUnknown) as err:
        batcher.submit(seq_job("a0", "A"))
    assert err.value.status == 404 and "sequenceStrictStart" in err.value.message
    batcher.submit(seq_job("a1", "A", start=True))
    batcher.submit(seq_job("a2", "A"))


def test_a_repeated_start_for_an_open_sequence_is_refused():
    _, batcher, (agg,) = seqb()
    batcher.submit(seq_job("a0", "A", start=True))
    with pytest.raises(SequenceAlreadyOpen) as err:
        batcher.submit(seq_job("a1", "A", start=True))
    assert err.value.status == 409 and "already open" in err.value.message


def test_a_job_without_sequence_id_is_a_programming_error():
    _, batcher, _ = seqb()
    with pytest.raises(SequenceError, match="carries no sequence id"):
        batcher.submit(seq_job("x", ""))


def test_worker_lost_fails_only_that_workers_sequences():
    clock, batcher, (w1, w2) = seqb(workers=("w1", "w2"))
    batcher.submit(seq_job("a0", "A"))
    batcher.submit(seq_job("b0", "B"))
    w1.next_frame()
    fb = w2.next_frame()
    batcher.submit(seq_job("a1", "A"))
    batcher.submit(seq_job("b1", "B"))
    lost = batcher.worker_lost("w1")
    assert ids(lost) == ["a0"]  # in flight: the caller fails it with the worker's cause
    failures = batcher.tick()
    assert [(j.request_id, type(e)) for j, e in failures] == [("a1", SequenceWorkerLost)]
    assert "its worker 'w1' died" in failures[0][1].message
    with pytest.raises(SequenceWorkerLost):
        batcher.submit(seq_job("a2", "A"))
    # B on w2 is untouched.
    w2.on_reply(reply(fb))
    assert ids(step(w2).new_jobs) == ["b1"]
    assert batcher.describe_sequences() == {
        "num_open": 1, "open_by_worker": {"w2": 1}, "num_unpinned": 0, "num_waiting": 0,
        "num_tombstones": 1, "num_opened": 2, "num_closed": 0, "num_expired": 0, "num_lost": 1,
    }


def test_new_sequences_go_to_the_worker_with_fewest_open_sequences():
    _, batcher, (w1, w2) = seqb(workers=("w1", "w2"))
    for sid in "ABCD":
        batcher.submit(seq_job(f"{sid}0", sid))
    assert batcher.describe_sequences()["open_by_worker"] == {"w1": 2, "w2": 2}
    batcher.submit(seq_job("A1", "A", end=True))
    step(w1)
    step(w1)  # A closed: w1 has 1
    batcher.submit(seq_job("E0", "E"))
    assert batcher.sequences.get("E").worker_id == "w1"


def test_sequences_opened_without_workers_are_claimed_by_the_first_with_room():
    clock, batcher, _ = seqb(workers=(), batch_size=1)
    batcher.submit(seq_job("a0", "A"))
    batcher.submit(seq_job("b0", "B"))
    assert batcher.describe_sequences()["num_unpinned"] == 2
    w1 = batcher.add_worker("w1")
    w2 = batcher.add_worker("w2")
    assert ids(step(w1).new_jobs) == ["a0"]
    assert ids(step(w2).new_jobs) == ["b0"]
    batcher.submit(seq_job("a1", "A"))
    assert w2.next_frame() is None  # A is w1's now
    assert ids(step(w1).new_jobs) == ["a1"]


def test_scale_down_ends_the_workers_sequences_as_lost():
    _, batcher, (w1, w2) = seqb(workers=("w1", "w2"))
    batcher.submit(seq_job("a0", "A"))
    step(w1)
    batcher.submit(seq_job("a1", "A"))
    batcher.remove_worker("w1")
    failures = batcher.tick()
    assert [(j.request_id, type(e)) for j, e in failures] == [("a1", SequenceWorkerLost)]
    assert "was stopped" in failures[0][1].message


def test_cancel_of_a_waiting_job_leaves_the_sequence_and_a_withdrawn_end_does_not_end_it():
    _, batcher, (agg,) = seqb()
    batcher.submit(seq_job("a0", "A"))
    frame = agg.next_frame()
    end = seq_job("a1", "A", end=True)
    batcher.submit(end)
    batcher.cancel(end)
    assert end.state == JobState.CANCELLED and batcher.queue_depth == 0
    assert batcher.sequences.state_of("A") == SequenceState.OPEN
    agg.on_reply(reply(frame))
    assert agg.next_frame() is None
    batcher.submit(seq_job("a2", "A"))  # still open


def test_client_deadline_of_a_waiting_sequence_job():
    clock, batcher, (agg,) = seqb()
    batcher.submit(seq_job("a0", "A"))
    agg.next_frame()
    batcher.submit(seq_job("a1", "A", deadline=clock.now + 1.0))
    clock.advance(1.0)
    failures = batcher.tick()
    assert [(j.request_id, type(e), j.state) for j, e in failures] == [("a1", RequestTimeout, JobState.EXPIRED)]


def test_idle_worker_waits_for_the_batch_delay():
    clock, batcher, (agg,) = seqb(batch_size=2, max_batch_delay=0.05)
    batcher.submit(seq_job("a0", "A"))
    assert agg.next_frame() is None
    assert agg.wake_at() == pytest.approx(clock.now + 0.05)
    batcher.submit(seq_job("b0", "B"))
    assert ids(agg.next_frame().new_jobs) == ["a0", "b0"]  # full: no more waiting


def test_listeners_fire_on_submit_and_on_failures():
    calls = []
    clock, batcher, (agg,) = seqb()
    batcher.add_listener(lambda: calls.append(1))
    batcher.submit(seq_job("a0", "A"))
    assert len(calls) == 1
    step(agg)
    batcher.submit(seq_job("a1", "A"))
    n = len(calls)
    batcher.worker_lost("w1")
    assert len(calls) > n  # a1 waits in the outbox: the loops are woken to tick()


def test_a_failed_request_keeps_its_sequence_open_but_a_failed_end_request_closes_it():
    _, batcher, (agg,) = seqb()
    batcher.submit(seq_job("a0", "A"))
    frame = agg.next_frame()
    out = agg.on_reply(results(frame.frame_id, WireResult("a0", 500, done=False, message="bad input")))
    assert out[0][0].state == JobState.FAILED and out[0][1].done
    assert batcher.sequences.state_of("A") == SequenceState.OPEN
    batcher.submit(seq_job("a1", "A", end=True))
    frame = agg.next_frame()
    agg.on_reply(results(frame.frame_id, WireResult("a1", 500, message="boom")))
    assert batcher.sequences.state_of("A") == SequenceState.CLOSED


def test_a_missing_result_fails_the_request_not_the_sequence():
    _, batcher, (agg,) = seqb()
    batcher.submit(seq_job("a0", "A"))
    batcher.submit(seq_job("b0", "B"))
    frame = agg.next_frame()
    out = agg.on_reply(results(frame.frame_id, WireResult("a0")))
    assert [(j.request_id, r.status) for j, r in out] == [("a0", 200), ("b0", 500)]
    assert batcher.sequences.state_of("B") == SequenceState.OPEN
    batcher.submit(seq_job("b1", "B"))
    assert ids(step(agg).new_jobs) == ["b1"]
