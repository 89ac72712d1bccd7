"""SequenceContinuousBatching with a fake clock: streams stay in the batch, a control request of
the same sequence joins the running stream's step, closes cancel running streams."""

from backend.protocol import RequestState, WireResult
from frontend.batching.sequence_continuous_batching import SequenceContinuousBatching
from frontend.batching.sequence_table import SequenceState
from frontend.errors import SequenceClosed, SequenceExpired
from frontend.jobs import JobState
from tests.batching.helpers import FakeClock, ids, make_batcher, reply, results, seq_job, wire

NEW, CONTINUE, CANCEL = RequestState.NEW, RequestState.CONTINUE, RequestState.CANCEL


def scb(clock=None, workers=("w1",), **config):
    clock = clock or FakeClock()
    config.setdefault("batch_size", 1)
    config.setdefault("max_batch_delay", 0.0)
    config.setdefault("sequence_max_idle", 5.0)
    config.setdefault("max_num_sequence", 8)
    config.setdefault("max_sequence_job_queue_size", 4)
    batcher = make_batcher(clock, sequence=True, continuous=True, **config)
    aggs = [batcher.add_worker(w) for w in workers]
    return clock, batcher, aggs


def test_policy():
    _, batcher, (agg,) = scb()
    assert isinstance(agg, SequenceContinuousBatching) and batcher.policy == "sequence_continuous"


def test_a_control_request_joins_the_running_stream_in_the_next_step():
    _, batcher, (agg,) = scb(batch_size=1)  # the batch is full with A's stream
    batcher.submit(seq_job("s", "A"))
    agg.on_reply(reply(agg.next_frame(), done=False))
    batcher.submit(seq_job("cancel", "A"))  # e.g. body -1: "stop my stream"
    frame = agg.next_frame()
    assert wire(frame) == [("s", CONTINUE), ("cancel", NEW)]  # same frame, arrival order
    # The handler stops the stream and answers the control request in the same step.
    out = agg.on_reply(results(frame.frame_id, WireResult("s", done=True), WireResult("cancel", done=True)))
    assert [(j.request_id, j.state) for j, _ in out] == [("s", JobState.DONE), ("cancel", JobState.DONE)]
    assert agg.next_frame() is None


def test_another_sequence_waits_for_a_slot():
    _, batcher, (agg,) = scb(batch_size=1)
    batcher.submit(seq_job("a0", "A"))
    agg.on_reply(reply(agg.next_frame(), done=False))
    batcher.submit(seq_job("b0", "B"))
    frame = agg.next_frame()
    assert wire(frame) == [("a0", CONTINUE)]  # B takes a new slot: none free
    agg.on_reply(reply(frame, done=True))
    assert wire(agg.next_frame()) == [("b0", NEW)]


def test_later_jobs_of_a_sequence_join_one_per_step_in_arrival_order():
    _, batcher, (agg,) = scb(batch_size=2)
    batcher.submit(seq_job("s", "A"))
    agg.on_reply(reply(agg.next_frame(), done=False))
    batcher.submit(seq_job("c1", "A"))
    batcher.submit(seq_job("c2", "A"))
    frame = agg.next_frame()
    assert wire(frame) == [("s", CONTINUE), ("c1", NEW)]
    agg.on_reply(reply(frame, done={"c1": True}))
    assert wire(agg.next_frame()) == [("s", CONTINUE), ("c2", NEW)]


def test_interleaving_groups_each_sequence_in_arrival_order():
    _, batcher, (agg,) = scb(batch_size=2)
    batcher.submit(seq_job("a0", "A"))
    batcher.submit(seq_job("b0", "B"))
    agg.on_reply(reply(agg.next_frame(), done=False))
    batcher.submit(seq_job("b1", "B"))
    batcher.submit(seq_job("a1", "A"))
    frame = agg.next_frame()
    entries = wire(frame)
    assert sorted(entries) == sorted([("a0", CONTINUE), ("a1", NEW), ("b0", CONTINUE), ("b1", NEW)])
    for sid in "ab":
        mine = [rid for rid, _ in entries if rid.startswith(sid)]
        assert mine == [f"{sid}0", f"{sid}1"]  # within a sequence: arrival order
        first = [rid for rid, _ in entries].index(f"{sid}0")
        assert entries[first + 1][0] == f"{sid}1"  # and adjacent


def test_client_disconnect_of_a_stream_sends_one_cancel_and_the_sequence_stays_open():
    _, batcher, (agg,) = scb(batch_size=1)
    stream = seq_job("s", "A")
    batcher.submit(stream)
    agg.on_reply(reply(agg.next_frame(), done=False))
    batcher.cancel(stream)
    frame = agg.next_frame()
    assert wire(frame) == [("s", CANCEL)]
    assert stream.state == JobState.CANCELLED
    agg.on_reply(results(frame.frame_id))
    assert batcher.sequences.state_of("A") == SequenceState.OPEN
    batcher.submit(seq_job("next", "A"))
    assert wire(agg.next_frame()) == [("next", NEW)]


def test_end_header_closes_the_sequence_and_cancels_its_running_stream():
    _, batcher, (agg,) = scb(batch_size=1, max_num_sequence=1)
    stream = seq_job("s", "A")
    batcher.submit(stream)
    agg.on_reply(reply(agg.next_frame(), done=False))
    batcher.submit(seq_job("end", "A"))  # body 0: "end the sequence"
    frame = agg.next_frame()
    out = agg.on_reply(results(
        frame.frame_id,
        WireResult("s", done=False, body=b"partial"),  # delivered before the close applies
        WireResult("end", headers=[("ts_request_sequence_end", "A")]),
    ))
    assert ids(j for j, _ in out) == ["s", "end"]
    failures = batcher.tick()
    assert [(j.request_id, type(e)) for j, e in failures] == [("s", SequenceClosed)]
    assert wire(agg.next_frame()) == [("s", CANCEL)]  # the backend frees the stream
    batcher.submit(seq_job("b0", "B"))  # capacity freed at once
    assert agg.num_cancels_sent == 1


def test_client_end_flag_closes_when_its_job_leaves_and_cancels_the_stream():
    _, batcher, (agg,) = scb(batch_size=1)
    batcher.submit(seq_job("s", "A"))
    agg.on_reply(reply(agg.next_frame(), done=False))
    batcher.submit(seq_job("bye", "A", end=True))
    frame = agg.next_frame()
    agg.on_reply(reply(frame, done={"bye": True}))
    assert batcher.sequences.state_of("A") == SequenceState.CLOSED
    assert [(j.request_id, type(e)) for j, e in batcher.tick()] == [("s", SequenceClosed)]
    assert wire(agg.next_frame()) == [("s", CANCEL)]


def test_absolute_timeout_cuts_a_running_stream():
    clock, batcher, (agg,) = scb(batch_size=1, sequence_timeout=1.0)
    batcher.submit(seq_job("s", "A"))
    agg.on_reply(reply(agg.next_frame(), done=False))
    clock.advance(1.0)
    failures = batcher.tick()
    assert [(j.request_id, type(e)) for j, e in failures] == [("s", SequenceExpired)]
    frame = agg.next_frame()
    assert wire(frame) == [("s", CANCEL)]
    agg.on_reply(results(frame.frame_id))
    assert agg.next_frame() is None and agg.wake_at() is None


def test_a_done_result_after_the_close_needs_no_cancel():
    clock, batcher, (agg,) = scb(batch_size=1, sequence_timeout=1.0)
    batcher.submit(seq_job("s", "A"))
    frame = agg.next_frame()
    clock.advance(1.0)
    batcher.tick()  # expired while the step was in the backend
    assert agg.on_reply(reply(frame, done=True)) == []  # its client already has the error
    assert agg.next_frame() is None and agg.num_cancels_sent == 0


def test_worker_lost_returns_only_its_streams():
    _, batcher, (w1, w2) = scb(workers=("w1", "w2"), batch_size=2)
    batcher.submit(seq_job("a0", "A"))
    batcher.submit(seq_job("b0", "B"))
    w1.on_reply(reply(w1.next_frame(), done=False))
    w2.on_reply(reply(w2.next_frame(), done=False))
    assert ids(batcher.worker_lost("w1")) == ["a0"]
    assert batcher.sequences.state_of("A") == SequenceState.LOST
    assert wire(w2.next_frame()) == [("b0", CONTINUE)]
