"""ContinuousBatching with a fake clock: admission between steps, idle waiting, cancel, fairness."""

import random

import pytest

from backend.protocol import RequestState, WireResult
from frontend.batching.continuous_batching import ContinuousBatching
from frontend.jobs import JobState
from tests.batching.helpers import FakeClock, ids, make_batcher, make_jobs, reply, results, wire

NEW, CONTINUE, CANCEL = RequestState.NEW, RequestState.CONTINUE, RequestState.CANCEL


def cb(clock=None, **config):
    clock = clock or FakeClock()
    config.setdefault("batch_size", 4)
    config.setdefault("max_batch_delay", 0.0)
    batcher = make_batcher(clock, continuous=True, **config)
    return clock, batcher, batcher.add_worker("w1")


def test_policy_is_continuous():
    _, batcher, agg = cb()
    assert isinstance(agg, ContinuousBatching) and batcher.policy == "continuous"


def test_admits_new_jobs_between_steps_without_waiting():
    clock, batcher, agg = cb(max_batch_delay=1.0)
    a, b = make_jobs(2)
    batcher.submit(a)
    assert agg.next_frame() is None  # idle: waits for the batch to fill
    clock.advance(1.0)
    first = agg.next_frame()
    assert wire(first) == [("r0", NEW)]
    agg.on_reply(reply(first, done=False))
    batcher.submit(b)
    second = agg.next_frame()  # busy: no wait at all, although max_batch_delay is 1 s
    assert second is not None and agg.wake_at() is None
    assert wire(second) == [("r1", NEW), ("r0", CONTINUE)]
    cont = second.to_wire().requests[1]
    assert cont.parameters == () and cont.headers == ()  # id only


def test_blocks_only_when_idle():
    clock, batcher, agg = cb(max_batch_delay=0.5)
    assert agg.next_frame() is None and agg.wake_at() is None  # nothing at all: wait for a listener
    job = make_jobs(1)[0]
    batcher.submit(job)
    assert agg.next_frame() is None
    assert agg.wake_at() == pytest.approx(clock.now + 0.5)
    clock.advance(0.2)
    assert agg.next_frame() is None  # still inside the delay
    clock.advance(0.3)
    frame = agg.next_frame()
    agg.on_reply(reply(frame, done=True))
    assert agg.next_frame() is None and agg.wake_at() is None


def test_idle_worker_sends_at_once_when_batch_fills():
    _, batcher, agg = cb(batch_size=2, max_batch_delay=10.0)
    for job in make_jobs(3):
        batcher.submit(job)
    assert ids(agg.next_frame().new_jobs) == ["r0", "r1"]


def test_capacity_never_exceeded_and_every_job_finishes():
    rng = random.Random(7)
    _, batcher, agg = cb(batch_size=3, job_queue_size=100)
    jobs = make_jobs(40)
    for job in jobs[:10]:
        batcher.submit(job)
    pending = jobs[10:]
    steps = 0
    while True:
        if pending and rng.random() < 0.5:
            batcher.submit(pending.pop(0))
        frame = agg.next_frame()
        if frame is None:
            if not pending:
                break
            continue
        steps += 1
        assert len(frame.new_jobs) + len(frame.continuing_jobs) <= 3
        assert agg.num_active <= 3
        agg.on_reply(reply(frame, done={j.request_id: rng.random() < 0.3 for j in frame.new_jobs + frame.continuing_jobs}))
    assert all(job.state == JobState.DONE for job in jobs)
    assert agg.num_steps == steps and steps > 40


def test_done_job_leaves_and_others_continue():
    _, batcher, agg = cb()
    for job in make_jobs(2):
        batcher.submit(job)
    frame = agg.next_frame()
    out = agg.on_reply(reply(frame, done={"r0": True, "r1": False}))
    assert [(j.request_id, r.done) for j, r in out] == [("r0", True), ("r1", False)]
    assert out[0][0].state == JobState.DONE
    assert wire(agg.next_frame()) == [("r1", CONTINUE)]


def test_cancelled_running_job_gets_exactly_one_cancel_then_never_appears():
    _, batcher, agg = cb()
    r0, r1 = make_jobs(2)
    batcher.submit(r0)
    batcher.submit(r1)
    frame = agg.next_frame()
    agg.on_reply(reply(frame, done=False))
    batcher.cancel(r0)
    frame = agg.next_frame()
    assert wire(frame) == [("r1", CONTINUE), ("r0", CANCEL)]
    assert r0.state == JobState.CANCELLED and agg.num_active == 1
    # A late result for the cancelled id (the backend had started the step) is ignored.
    out = agg.on_reply(results(frame.frame_id, WireResult("r0", done=False), WireResult("r1", done=False)))
    assert ids(j for j, _ in out) == ["r1"]
    for _ in range(3):
        frame = agg.next_frame()
        assert "r0" not in [rid for rid, _ in wire(frame)]
        agg.on_reply(reply(frame, done=False))
    assert agg.num_cancels_sent == 1


def test_frame_of_cancels_only_then_idle():
    _, batcher, agg = cb()
    job = make_jobs(1)[0]
    batcher.submit(job)
    agg.on_reply(reply(agg.next_frame(), done=False))
    batcher.cancel(job)
    frame = agg.next_frame()
    assert wire(frame) == [("r0", CANCEL)]
    assert agg.on_reply(results(frame.frame_id)) == []  # the backend answers a CANCEL-only frame with no results
    assert agg.next_frame() is None and agg.wake_at() is None


def test_cancel_of_a_queued_job_never_reaches_the_backend():
    clock, batcher, agg = cb(batch_size=1)
    r0, r1, r2 = make_jobs(3)
    for job in (r0, r1, r2):
        batcher.submit(job)
    frame = agg.next_frame()
    batcher.cancel(r1)
    agg.on_reply(reply(frame, done=True))
    sent = []
    while (frame := agg.next_frame()) is not None:
        sent += [rid for rid, _ in wire(frame)]
        agg.on_reply(reply(frame, done=True))
    assert sent == ["r2"] and r1.state == JobState.CANCELLED


def test_cancel_while_gathering_during_the_idle_delay():
    clock, batcher, agg = cb(max_batch_delay=1.0)
    job = make_jobs(1)[0]
    batcher.submit(job)
    assert agg.next_frame() is None  # taken, gathering
    batcher.cancel(job)
    assert agg.next_frame() is None and agg.wake_at() is None
    assert job.state == JobState.CANCELLED and agg.num_cancels_sent == 0


def test_result_done_wins_over_a_late_cancel():
    _, batcher, agg = cb()
    job = make_jobs(1)[0]
    batcher.submit(job)
    frame = agg.next_frame()
    batcher.cancel(job)  # while the frame is in the backend
    agg.on_reply(reply(frame, done=True))
    assert job.state == JobState.DONE
    assert agg.next_frame() is None and agg.num_cancels_sent == 0  # the backend already freed it


def test_failed_result_is_terminal_whatever_done_says():
    _, batcher, agg = cb()
    for job in make_jobs(2):
        batcher.submit(job)
    frame = agg.next_frame()
    out = agg.on_reply(results(frame.frame_id, WireResult("r0", 500, done=False, message="boom"), WireResult("r1", done=False)))
    job, result = out[0]
    assert result.status == 500 and result.done  # delivered as the stream's end
    assert job.state == JobState.FAILED
    # Gone; the backend was not told it is done (done=False), so it gets one CANCEL to free it.
    assert wire(agg.next_frame()) == [("r1", CONTINUE), ("r0", CANCEL)]
    agg.on_reply(results(2, WireResult("r1", done=True)))
    assert agg.next_frame() is None


def test_missing_result_fails_the_job_and_cancels_it():
    _, batcher, agg = cb()
    for job in make_jobs(2):
        batcher.submit(job)
    frame = agg.next_frame()
    out = agg.on_reply(results(frame.frame_id, WireResult("r0", done=False)))
    assert [(j.request_id, r.status, r.done) for j, r in out] == [("r0", 200, False), ("r1", 500, True)]
    assert wire(agg.next_frame()) == [("r0", CONTINUE), ("r1", CANCEL)]


def test_a_long_stream_does_not_starve_queued_jobs():
    _, batcher, agg = cb(batch_size=2)
    long, short, c, d = make_jobs(4)
    for job in (long, short, c, d):
        batcher.submit(job)
    frame = agg.next_frame()
    assert ids(frame.new_jobs) == ["r0", "r1"]
    agg.on_reply(reply(frame, done={"r0": False, "r1": True}))  # the short one finishes
    frame = agg.next_frame()
    assert wire(frame) == [("r2", NEW), ("r0", CONTINUE)]  # the queue head takes the freed slot at once
    agg.on_reply(reply(frame, done={"r0": False, "r2": True}))
    frame = agg.next_frame()
    assert wire(frame) == [("r3", NEW), ("r0", CONTINUE)]
    assert long.state == JobState.RUNNING


def test_admission_is_fifo():
    _, batcher, agg = cb(batch_size=1)
    for job in make_jobs(4):
        batcher.submit(job)
    order = []
    while (frame := agg.next_frame()) is not None:
        order += ids(frame.new_jobs)
        agg.on_reply(reply(frame, done=True))
    assert order == ["r0", "r1", "r2", "r3"]


def test_worker_lost_returns_every_running_job_and_requeues_unsent():
    clock, batcher, agg = cb(batch_size=2, max_batch_delay=1.0)
    jobs = make_jobs(3)
    for job in jobs[:2]:
        batcher.submit(job)
    frame = agg.next_frame()
    agg.on_reply(reply(frame, done=False))
    lost = batcher.worker_lost("w1")
    assert ids(lost) == ["r0", "r1"]
    assert all(job.state == JobState.RUNNING for job in lost)  # the caller fails them
    # A second worker, idle, gathering r2 when it dies: r2 goes back to the queue.
    agg2 = batcher.add_worker("w2")
    batcher.submit(jobs[2])
    assert agg2.next_frame() is None
    assert batcher.worker_lost("w2") == [] and batcher.queue_depth == 1


def test_close_returns_gathered_jobs_and_running_ones_drain():
    clock, batcher, agg = cb(batch_size=2, max_batch_delay=1.0)
    r0, r1 = make_jobs(2)
    batcher.submit(r0)
    frame = agg.next_frame()
    assert frame is None  # gathering r0
    assert agg.close() == [r0]
    assert agg.next_frame() is None


def test_counters_for_metrics():
    _, batcher, agg = cb(batch_size=4)
    for job in make_jobs(3):
        batcher.submit(job)
    agg.on_reply(reply(agg.next_frame(), done={"r0": True}))
    agg.next_frame()
    assert agg.stats() == {"num_steps": 2, "last_batch_size": 2, "num_cancels_sent": 0, "num_active": 2}
    assert batcher.stats()["w1"]["num_steps"] == 2
