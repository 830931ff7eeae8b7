"""Continuation after commit in the turn machine (sans-IO): Responses background resume.

The property test cuts random Responses streams at random byte offsets, as often as
it likes, and resumes each cut from ``starting_after`` as the provider would: the
client's bytes must equal the uncut stream, with valid framing.  On the code before
issue 23 the first cut after output ended the turn with the native error.
"""

from __future__ import annotations

import json
import random
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from turnfix import Report, Timers
from unbroken.core.admission.policy import Failure, FailureClass, RetryPolicy, RetryState
from unbroken.core.turn.background import BackgroundResume, SequenceSplicer
from unbroken.core.turn.continuation import ContinuationMemory, JoinBroken, Refusal, Resume
from unbroken.core.turn.ledger import Hold
from unbroken.core.turn.machine import (
    AbortUpstream,
    End,
    EndKind,
    Open,
    Outcome,
    PassThrough,
    Stream,
    TurnError,
    TurnMachine,
    Wait,
)
from unbroken.core.wire.protocols import RESPONSES
from unbroken.core.wire.sse import Event, SSESplitter

RID = "resp_abc"
RESET = Failure(FailureClass.RESET, "reset")


class ContReport(Report):
    def continuation(self, result: str, splices: int, saved_frames: int) -> None:
        self.calls.append(("continuation", result, splices))


def make(
    memory: ContinuationMemory | None = None,
    max_splices: int = 64,
    *,
    timers: Any = None,
    queued_s: float = 5.0,
) -> tuple[TurnMachine, ContReport, BackgroundResume]:
    report = ContReport()
    retry = RetryState(RetryPolicy(delay_ms=0, backoff="fixed"), 1, rng=random.Random(0))
    strategy = BackgroundResume(
        path="v1/responses",
        keys=("r|u",),
        memory=memory or ContinuationMemory(),
        max_splices=max_splices,
    )
    m = TurnMachine(
        protocol=RESPONSES,
        hold=Hold(),
        timers=timers if timers is not None else Timers(),
        retry=retry,
        stream=True,
        now=0.0,
        report=report,
        continuation=strategy,
        queued_s=queued_s,
    )
    return m, report, strategy


def sse(name: str, seq: int, **fields: Any) -> bytes:
    obj = {"type": name, "sequence_number": seq, **fields}
    return f"event: {name}\ndata: {json.dumps(obj)}\n\n".encode()


def responses_stream(items: list[tuple[str, int]]) -> list[bytes]:
    """A Responses stream: ``items`` are (kind, deltas) with kind text | tool | reasoning."""
    frames: list[bytes] = []
    seq = 0

    def ev(name: str, **fields: Any) -> None:
        nonlocal seq
        frames.append(sse(name, seq, **fields))
        seq += 1

    resp = {"id": RID, "object": "response", "status": "in_progress", "output": []}
    ev("response.created", response=resp)
    ev("response.in_progress", response=resp)
    for i, (kind, n) in enumerate(items):
        iid = f"item_{i}"
        if kind == "tool":
            item: dict[str, Any] = {
                "id": iid,
                "type": "function_call",
                "call_id": f"c{i}",
                "name": "f",
            }
            ev("response.output_item.added", output_index=i, item=item)
            for k in range(n):
                ev("response.function_call_arguments.delta", item_id=iid, delta=f"a{k}")
            ev("response.output_item.done", output_index=i, item={**item, "arguments": "x"})
        elif kind == "reasoning":
            item = {"id": iid, "type": "reasoning", "summary": []}
            ev("response.output_item.added", output_index=i, item=item)
            for k in range(n):
                ev("response.reasoning_summary_text.delta", item_id=iid, delta=f"r{k}")
            done = {**item, "summary": [{"type": "summary_text", "text": "r"}]}
            ev("response.output_item.done", output_index=i, item=done)
        else:
            item = {"id": iid, "type": "message", "role": "assistant", "content": []}
            ev("response.output_item.added", output_index=i, item=item)
            ev("response.content_part.added", item_id=iid, output_index=i, content_index=0)
            for k in range(n):
                ev("response.output_text.delta", item_id=iid, output_index=i, delta=f"t{k} ")
            ev("response.output_text.done", item_id=iid, output_index=i, text="...")
            ev("response.output_item.done", output_index=i, item={**item, "status": "done"})
    ev("response.completed", response={**resp, "status": "completed"})
    return frames


def run_with_cuts(frames: list[bytes], cuts: list[int], chunk: int) -> tuple[bytes, TurnMachine]:
    """Serve the stream; connection j dies after ``cuts[j]`` bytes of what it sends;
    a resume serves the frames after ``starting_after``.  Returns the client's bytes."""
    m, _, _ = make()
    now = 0.0
    out: list[bytes] = []
    action: Any = m.start(now)
    conn = 0
    while True:
        now += 0.01
        if isinstance(action, Wait):
            action = m.next_attempt(now)
            continue
        if isinstance(action, End):
            out.append(action.data)
            assert action.kind is EndKind.CLEAN, action
            return b"".join(out), m
        if isinstance(action, Open):
            assert dict(action.body_patch) == {"background": True, "store": True}
            body = b"".join(frames)
        elif isinstance(action, Resume):
            assert action.method == "GET" and action.path == f"v1/responses/{RID}"
            after = int(action.query.rsplit("=", 1)[1])
            body = b"".join(frames[after + 1 :])
        else:
            raise AssertionError(action)
        assert isinstance(m.answered(now, 200, sse=True), Stream)
        limit = cuts[conn] if conn < len(cuts) else len(body)
        conn += 1
        sent = body[:limit]
        action = None
        for pos in range(0, len(sent), chunk):
            data, over = m.feed_verbatim(now, sent[pos : pos + chunk])
            out.append(sent[pos : pos + chunk] if data is None else data)
            if over is not None:
                action = over
                break
        if action is None:
            action = m.body_ended(now) if limit >= len(body) else m.transport_failed(now, RESET)


items_st = st.lists(
    st.tuples(st.sampled_from(["text", "tool", "reasoning"]), st.integers(1, 6)),
    min_size=1,
    max_size=4,
)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(items=items_st, data=st.data())
def test_resumed_stream_equals_the_uncut_stream(
    items: list[tuple[str, int]], data: st.DataObject
) -> None:
    frames = responses_stream(items)
    total = sum(len(f) for f in frames)
    cuts = data.draw(st.lists(st.integers(0, total), max_size=8), label="cuts")
    chunk = data.draw(st.integers(1, 400), label="chunk")
    got, m = run_with_cuts(frames, cuts, chunk)
    assert got == b"".join(frames)
    # valid framing: every frame whole, numbers strictly increasing, one terminal
    events = SSESplitter().feed(got)
    assert b"".join(e.raw for e in events) == got
    seqs = [json.loads(e.data or "")["sequence_number"] for e in events]
    assert seqs == list(range(len(frames)))
    assert [e.name for e in events].count("response.completed") == 1
    assert m.outcome in (Outcome.OK, Outcome.RECOVERED, Outcome.RESUMED)


def test_cut_after_output_resumes_after_the_last_number_fed() -> None:
    frames = responses_stream([("text", 4)])
    k = 6  # created, in_progress, added, part, two deltas
    got, m = run_with_cuts(frames, [sum(len(f) for f in frames[:k])], 50)
    assert got == b"".join(frames)
    assert m.outcome is Outcome.RESUMED and m.splices == 1


def _cut_turn() -> tuple[TurnMachine, ContReport, Resume, list[bytes]]:
    frames = responses_stream([("text", 4)])
    m, report, _ = make()
    m.start(0.0)
    m.answered(0.0, 200, sse=True)
    for f in frames[:6]:
        m.feed_verbatim(0.1, f)
    action = m.transport_failed(0.2, RESET)
    if isinstance(action, Wait):
        action = m.next_attempt(0.3)
    assert isinstance(action, Resume)
    assert action.query == "stream=true&starting_after=5"
    return m, report, action, frames


@pytest.mark.parametrize("status", [404, 400, 422])
def test_a_resume_answered_with_an_error_ends_with_the_native_error(status: int) -> None:
    m, _, _, _ = _cut_turn()
    action = m.answered(0.4, status, sse=False)
    assert isinstance(action, End) and action.kind is EndKind.ERROR
    assert b"event: error" in action.data
    assert m.outcome is Outcome.ENDED_WITH_ERROR
    assert m.refusal is Refusal.JOIN
    assert [c.path for c in m.take_cancels()] == [f"v1/responses/{RID}/cancel"]


@pytest.mark.parametrize(
    "first",
    [
        sse("response.output_text.delta", 5, item_id="item_0", delta="x"),  # backwards
        sse("response.output_text.delta", 7, item_id="item_0", delta="x"),  # a gap
        sse("response.output_text.delta", 6, item_id="other", delta="x"),  # another item
        sse("response.in_progress", 6, response={"id": "resp_other"}),  # another response
        b"event: response.output_text.delta\ndata: [1]\n\n",  # not an object
    ],
)
def test_a_continuation_that_does_not_join_is_never_spliced(first: bytes) -> None:
    m, _, _, _ = _cut_turn()
    assert isinstance(m.answered(0.4, 200, sse=True), Stream)
    released, over = m.feed_verbatim(0.5, first)
    assert released == b""  # nothing of it reaches the client
    assert isinstance(over, End) and over.kind is EndKind.ERROR
    assert over.data.startswith(b"event: error")  # only the native error
    assert m.outcome is Outcome.ENDED_WITH_ERROR


def test_a_retryable_answer_to_a_resume_is_another_cut() -> None:
    m, _, _, _ = _cut_turn()
    action = m.answered(0.4, 503, sse=False)
    if isinstance(action, Wait):
        action = m.next_attempt(0.5)
    assert isinstance(action, Resume) and action.query.endswith("starting_after=5")
    assert m.splices == 2


def test_splices_are_bounded() -> None:
    frames = responses_stream([("text", 6)])
    m, _, _ = make(max_splices=2)
    m.start(0.0)
    m.answered(0.0, 200, sse=True)
    for f in frames[:6]:
        m.feed_verbatim(0.1, f)
    for _ in range(2):
        action = m.transport_failed(0.2, RESET)
        if isinstance(action, Wait):
            action = m.next_attempt(0.2)
        assert isinstance(action, Resume)
        m.answered(0.3, 200, sse=True)
    action = m.transport_failed(0.4, RESET)
    assert isinstance(action, End) and action.kind is EndKind.ERROR
    assert m.refusal is Refusal.LIMIT


def test_a_continuation_stuck_in_queued_is_given_up() -> None:
    m, _, _, _ = _cut_turn()
    assert isinstance(m.answered(1.0, 200, sse=True), Stream)
    due = m.deadline()
    assert due is not None and due <= 1.0 + 5.0
    tick = m.tick(6.5)
    assert isinstance(tick, AbortUpstream)
    action = m.transport_failed(6.6, tick.failure)
    assert isinstance(action, End) and action.kind is EndKind.ERROR  # committed: no replay
    assert m.refusal is Refusal.QUEUED
    assert m.take_cancels()


def test_a_cut_before_the_response_has_an_id_is_a_replay() -> None:
    m, _, _ = make()
    m.start(0.0)
    m.answered(0.0, 200, sse=True)
    action = m.transport_failed(0.1, RESET)
    if isinstance(action, Wait):
        action = m.next_attempt(0.2)
    assert isinstance(action, Open)


def test_a_refusal_of_background_mode_is_remembered_and_the_turn_retried() -> None:
    memory = ContinuationMemory()
    m, _, _ = make(memory)
    first = m.start(0.0)
    assert isinstance(first, Open) and first.body_patch
    action = m.answered(0.1, 400, sse=False)
    again = m.error_body(0.1, b'{"error": {"message": "background is not supported"}}')
    assert memory.refused("responses_background", "r|u")
    if isinstance(again, Wait):
        again = m.next_attempt(0.2)
    assert isinstance(again, Open) and again.body_patch == ()
    del action
    # the next turn to that upstream goes as the client sent it
    m2, _, _ = make(memory)
    assert m2.start(0.0) == Open(0, Timers().header_timeout_s)


def test_another_4xx_to_a_background_request_is_the_providers_answer() -> None:
    """Issue 33: a 400 that names neither ``background`` nor ``store`` may still refuse
    background mode: the turn asks once more as the client sent it; a 400 again is
    the provider's answer (passed through) and nothing is remembered."""
    memory = ContinuationMemory()
    m, _, _ = make(memory)
    m.start(0.0)
    m.answered(0.1, 400, sse=False)
    action = m.error_body(0.1, b'{"error": {"message": "bad model"}}')
    if isinstance(action, Wait):
        action = m.next_attempt(0.2)
    assert isinstance(action, Open) and action.body_patch == ()
    assert isinstance(m.answered(0.3, 400, sse=False), PassThrough)  # as without a relay
    assert not memory.refused("responses_background", "r|u")


def test_a_400_in_other_words_is_a_refusal_when_the_plain_request_succeeds() -> None:
    """Issue 33: "Unsupported parameter." (no ``param``) to the background request, then
    a 200 to the client's own request: the 400 was the refusal, remembered, and later
    turns go as the client sent them."""
    memory = ContinuationMemory()
    m, _, _ = make(memory)
    m.start(0.0)
    m.answered(0.1, 400, sse=False)
    action = m.error_body(0.1, b'{"error": {"message": "Unsupported parameter.", "param": null}}')
    if isinstance(action, Wait):
        action = m.next_attempt(0.2)
    assert isinstance(action, Open) and action.body_patch == ()
    assert isinstance(m.answered(0.3, 200, sse=True), Stream)
    assert memory.refused("responses_background", "r|u")
    m2, _, _ = make(memory)
    assert m2.start(0.0) == Open(0, Timers().header_timeout_s)


def test_feeding_a_resume_before_its_answer_is_illegal() -> None:
    m, _, _, frames = _cut_turn()
    with pytest.raises(TurnError):
        m.feed_chunk(0.4, frames[6])


def test_the_splicer_passes_comments_and_errors() -> None:
    s = SequenceSplicer(RID, 3, "item_0")
    comment = Event(b": keepalive\n\n", None, None)
    assert s.splice(comment) is None  # (held: nothing named the response yet)
    s.verified = True
    assert s.splice(comment) is comment
    err = Event(b"x", "error", json.dumps({"type": "error", "code": "server_error"}))
    assert s.splice(err) is err
    with pytest.raises(JoinBroken):
        s.splice(Event(b"x", "response.output_text.delta", json.dumps({"type": "t"})))


def _resumed_before_commit(m: TurnMachine) -> list[bytes]:
    """A cut right after ``response.created`` (held: nothing released): the turn resumes
    the response (its frames returned)."""
    frames = responses_stream([("text", 3)])
    m.start(0.0)
    m.answered(0.0, 200, sse=True)
    m.feed_verbatim(0.1, frames[0])
    action = m.transport_failed(0.2, RESET)
    if isinstance(action, Wait):
        action = m.next_attempt(0.3)
    assert isinstance(action, Resume)
    return frames


def test_after_a_queued_continuation_is_given_up_the_replay_may_resume_again() -> None:
    """Before commit, a continuation stuck in queued is cancelled and the turn replayed;
    the replay's own cut is continued again (the queued state was the old response's)."""
    m, _, _ = make()
    frames = _resumed_before_commit(m)
    m.answered(1.0, 200, sse=True)
    tick = m.tick(7.0)
    assert isinstance(tick, AbortUpstream)
    action = m.transport_failed(7.1, tick.failure)
    if isinstance(action, Wait):
        action = m.next_attempt(7.2)
    assert isinstance(action, Open)  # the replay
    assert [c.path for c in m.take_cancels()] == [f"v1/responses/{RID}/cancel"]
    m.answered(7.3, 200, sse=True)
    m.feed_verbatim(7.4, frames[0])
    action = m.transport_failed(7.5, RESET)
    if isinstance(action, Wait):
        action = m.next_attempt(7.6)
    assert isinstance(action, Resume)


def test_a_late_tick_gives_up_a_queued_continuation_before_its_later_stall() -> None:
    """The queued deadline (0.5 s after the resume) comes before the first-frame stall
    (2 s): a tick that runs late, past both (a loaded machine), acts on the earlier.
    It read the stall first, and the turn resumed the stuck response again instead of
    cancelling it and replaying (tests/relay/test_continuation_relay.py, flaky under a
    loaded clean-clone run)."""
    m, _, _ = make(timers=Timers(first_frame_timeout_s=2.0, idle_timeout_s=2.0), queued_s=0.5)
    _resumed_before_commit(m)
    m.answered(0.4, 200, sse=True)
    assert m.deadline() == pytest.approx(0.3 + 0.5, abs=0.11)
    tick = m.tick(3.5)  # late: past both deadlines
    assert isinstance(tick, AbortUpstream)
    action = m.transport_failed(3.6, tick.failure)
    if isinstance(action, Wait):
        action = m.next_attempt(3.7)
    assert isinstance(action, Open)  # given up and replayed, not resumed again
    assert [c.path for c in m.take_cancels()] == [f"v1/responses/{RID}/cancel"]


@pytest.mark.parametrize(
    ("status", "body", "refused"),
    [
        (400, b'{"error": {"message": "x", "param": "background"}}', True),
        (400, b'{"error": {"message": "store must be true", "param": "store"}}', True),
        (422, b'{"error": {"message": "Background mode is not supported"}}', True),
        (400, b"background is not supported", True),
        (400, b'{"error": {"message": "vector store vs_1 not found", "param": "tools"}}', False),
        (404, b'{"error": {"message": "model not found"}}', False),
        (429, b'{"error": {"message": "background", "param": "background"}}', False),
        (500, b'{"error": {"message": "background", "param": "background"}}', False),
    ],
)
def test_what_counts_as_a_refusal_of_background_mode(
    status: int, body: bytes, refused: bool
) -> None:
    from unbroken.core.turn.background import refuses_background

    assert refuses_background(status, body) is refused


def test_a_resume_naming_another_response_releases_nothing_of_it() -> None:
    """Issue 33: the resume keeps numbers and item ids but is another response, named
    only by its ``response.completed``: nothing of it (text, a complete tool call) is
    released before that frame refuses the splice."""
    m, _, _, frames = _cut_turn()
    assert isinstance(m.answered(0.4, 200, sse=True), Stream)
    other = b"".join(frames[6:]).replace(RID.encode(), b"resp_other")
    released, over = m.feed_verbatim(0.5, other)
    assert released is not None
    assert b"output_text.delta" not in released and b"output_item.done" not in released
    assert isinstance(over, End) and over.kind is EndKind.ERROR
    assert m.refusal is Refusal.JOIN


def test_a_cut_while_the_resume_is_unverified_resumes_from_the_same_cursor() -> None:
    """Held frames are never fed: a cut before a frame named the response resumes
    after the last number fed, and the held frames come again (nothing lost, nothing
    doubled)."""
    m, _, _, frames = _cut_turn()
    assert isinstance(m.answered(0.4, 200, sse=True), Stream)
    released, over = m.feed_verbatim(0.5, b"".join(frames[6:8]))
    assert released == b"" and over is None  # held: no frame named the response yet
    action = m.transport_failed(0.6, RESET)
    if isinstance(action, Wait):
        action = m.next_attempt(0.7)
    assert isinstance(action, Resume) and action.query.endswith("starting_after=5")
    assert isinstance(m.answered(0.8, 200, sse=True), Stream)
    released, over = m.feed_verbatim(0.9, b"".join(frames[6:]))
    assert released == b"".join(frames[6:])  # all of it, once verified by its end
    if over is None:
        over = m.body_ended(1.0)
    assert isinstance(over, End) and over.kind is EndKind.CLEAN
    assert m.outcome is Outcome.RESUMED


def test_a_keepalive_comment_while_holding_keeps_the_cursor() -> None:
    """A comment in a resume that has named no response yet is not fed: the next
    resume still knows where to continue from."""
    m, _, _, frames = _cut_turn()
    assert isinstance(m.answered(0.4, 200, sse=True), Stream)
    released, over = m.feed_verbatim(0.5, frames[6] + b": keepalive\n\n")
    assert released == b"" and over is None
    action = m.transport_failed(0.6, RESET)
    if isinstance(action, Wait):
        action = m.next_attempt(0.7)
    assert isinstance(action, Resume) and action.query.endswith("starting_after=5")


def test_held_frames_are_bounded() -> None:
    s = SequenceSplicer(RID, 5, "item_0", max_held_bytes=200)
    delta = sse("response.output_text.delta", 6, item_id="item_0", delta="x" * 50)
    assert s.splice(Event(delta, None, delta.split(b"data: ")[1].decode())) is None
    big = sse("response.output_text.delta", 7, item_id="item_0", delta="x" * 200)
    with pytest.raises(JoinBroken):
        s.splice(Event(big, None, big.split(b"data: ")[1].decode()))


@pytest.mark.parametrize(
    "rid", ["..", "resp_..", "a#frag", "resp_%2F..", "a/b", "r?x", "", "x" * 200]
)
def test_a_response_id_that_is_no_plain_token_is_never_put_in_a_url(rid: str) -> None:
    """Issue 33: the upstream's response id goes into the resume GET and the cancel POST
    only if it is a plain token; else the cut is not continued (no handle)."""
    frames = [
        f.replace(RID.encode(), json.dumps(rid)[1:-1].encode())
        for f in responses_stream([("text", 4)])
    ]
    m, _, _ = make()
    m.start(0.0)
    m.answered(0.0, 200, sse=True)
    for f in frames[:6]:
        m.feed_verbatim(0.1, f)
    action = m.transport_failed(0.2, RESET)
    assert isinstance(action, End) and action.kind is EndKind.ERROR
    assert m.refusal is Refusal.NO_HANDLE
    assert m.take_cancels() == []
