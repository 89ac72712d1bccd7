from backend.protocol import InferReply, RequestState, WireResult
from frontend.errors import QueueFull
from frontend.jobs import JobState
import pytest

from tests.batching.helpers import FakeClock, make_batcher, make_jobs, reply


def test_batch_size_one_sends_at_once():
    clock = FakeClock()
    batcher = make_batcher(clock, batch_size=1, max_batch_delay=0.1)
    agg = batcher.add_worker("w1")
    assert agg.next_frame() is None
    for job in make_jobs(2):
        batcher.submit(job)
    frame = agg.next_frame()
    assert [j.request_id for j in frame.new_jobs] == ["r0"]
    assert frame.to_wire().requests[0].state == RequestState.NEW


def test_waits_max_batch_delay_then_sends_partial_batch():
    clock = FakeClock()
    batcher = make_batcher(clock, batch_size=4, max_batch_delay=0.005)
    agg = batcher.add_worker("w1")
    for job in make_jobs(2):
        batcher.submit(job)
    assert agg.next_frame() is None
    assert agg.wake_at() == pytest.approx(clock.now + 0.005)
    clock.advance(0.004)
    assert agg.next_frame() is None
    clock.advance(0.001)
    frame = agg.next_frame()
    assert [j.request_id for j in frame.new_jobs] == ["r0", "r1"]
    assert agg.wake_at() is None


def test_full_batch_goes_without_waiting_and_respects_batch_size():
    clock = FakeClock()
    batcher = make_batcher(clock, batch_size=3, max_batch_delay=10)
    agg = batcher.add_worker("w1")
    for job in make_jobs(7):
        batcher.submit(job)
    frame = agg.next_frame()
    assert len(frame.new_jobs) == 3
    deliveries = agg.on_reply(reply(frame))
    assert [j.state for j, _ in deliveries] == [JobState.DONE] * 3
    assert len(agg.next_frame().new_jobs) == 3
    assert batcher.queue_depth == 1


def test_no_wake_time_when_idle():
    agg = make_batcher(FakeClock(), batch_size=8).add_worker("w1")
    assert agg.next_frame() is None and agg.wake_at() is None


def test_intermediate_replies_stream_then_final():
    clock = FakeClock()
    batcher = make_batcher(clock, batch_size=1)
    agg = batcher.add_worker("w1")
    batcher.submit(make_jobs(1)[0])
    frame = agg.next_frame()
    out = agg.on_reply(reply(frame, done=False, final=False))
    assert out[0][0].state == JobState.RUNNING and not out[0][1].done
    out = agg.on_reply(reply(frame, done=True, final=True))
    assert out[0][0].state == JobState.DONE and agg.num_active == 0


def test_missing_result_is_failed_not_lost():
    batcher = make_batcher(FakeClock(), batch_size=2, max_batch_delay=0)
    agg = batcher.add_worker("w1")
    for job in make_jobs(2):
        batcher.submit(job)
    frame = agg.next_frame()
    out = agg.on_reply(InferReply(frame.frame_id, True, [WireResult("r0")]))
    assert sorted((j.request_id, r.status) for j, r in out) == [("r0", 200), ("r1", 500)]


def test_queue_full_and_cancelled_jobs_dropped():
    clock = FakeClock()
    batcher = make_batcher(clock, batch_size=2, job_queue_size=2, max_batch_delay=0)
    jobs = make_jobs(3)
    batcher.submit(jobs[0])
    batcher.submit(jobs[1])
    with pytest.raises(QueueFull):
        batcher.submit(jobs[2])
    batcher.cancel(jobs[0])
    agg = batcher.add_worker("w1")
    frame = agg.next_frame()
    assert [j.request_id for j in frame.new_jobs] == ["r1"]
    assert jobs[0].state == JobState.CANCELLED


def test_worker_lost_fails_in_flight_and_requeues_gathered():
    clock = FakeClock()
    batcher = make_batcher(clock, batch_size=2, max_batch_delay=1)
    agg = batcher.add_worker("w1")
    for job in make_jobs(3):
        batcher.submit(job)
    frame = agg.next_frame()
    agg.next_frame()  # gathers r2, waits for more
    lost = batcher.worker_lost("w1")
    assert [j.request_id for j in lost] == [j.request_id for j in frame.new_jobs]
    assert batcher.queue_depth == 1
    agg2 = batcher.add_worker("w2")
    assert agg2.next_frame() is None  # gathers r2, waits for the batch delay
    clock.advance(1)
    assert [j.request_id for j in agg2.next_frame().new_jobs] == ["r2"]


def test_listeners_wake_on_submit():
    calls = []
    batcher = make_batcher(FakeClock())
    batcher.add_listener(lambda: calls.append(1))
    batcher.submit(make_jobs(1)[0])
    assert calls == [1]
