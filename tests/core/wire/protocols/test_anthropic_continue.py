"""The user-message continuation (Claude 4.6 and later refuse prefill): the request it
builds, the anchor it quotes, and its join check, through the turn machine."""

from __future__ import annotations

import json
import random
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from core.turn.test_prefill_continue import (
    REQUEST,
    RESET,
    ContinuationReport,
    chunks_of,
    client_text,
    pieces_of,
    shown_text,
    stream,
)
from turnfix import Timers
from unbroken.core.admission.policy import RetryPolicy, RetryState
from unbroken.core.turn.continuation import ContinuationMemory, Resume
from unbroken.core.turn.ledger import Hold
from unbroken.core.turn.machine import End, Open, Stream, TurnMachine, set_testing
from unbroken.core.turn.prefill_continue import ANTHROPIC_USER_MESSAGE, PrefillContinue
from unbroken.core.wire.protocols import ANTHROPIC
from unbroken.core.wire.protocols.anthropic_continue import (
    ANCHOR_TAG,
    ANCHOR_WORDS,
    MAX_ANCHOR_CHARS,
    AnthropicContinue,
    anchor_of,
    continue_instruction,
    plan_user_message,
    user_message_refusal,
)
from unbroken.core.wire.protocols.anthropic_prefill import Committed
from unbroken.core.wire.protocols.prefill import PrefillRefusal


@pytest.mark.parametrize(
    ("text", "anchor"),
    [
        ("Hello wor", "Hello wor"),
        (
            "one two three four five six seven eight nine ten",
            "three four five six seven eight nine ten",
        ),
        ("para one.\n\nThe end of it", "para one.\n\nThe end of it"),
        ("x" * 300, "x" * MAX_ANCHOR_CHARS),
        ("a " + "y" * 119, "y" * 119),  # the long last word alone fits
        ("a " + "y" * 200, "y" * MAX_ANCHOR_CHARS),  # it does not: its last characters
        ("ab " * 60 + "cd", ("ab " * 7 + "cd")),
    ],
)
def test_the_anchor_is_the_ends_last_words(text: str, anchor: str) -> None:
    got = anchor_of(text)
    assert got == anchor and text.endswith(got)
    assert len(got) <= MAX_ANCHOR_CHARS and len(got.split()) <= ANCHOR_WORDS


def _committed(text: str) -> Committed:
    return Committed(text, 0, 1)


def test_the_request_quotes_the_anchor_after_the_interrupted_turn() -> None:
    plan = plan_user_message(REQUEST, _committed("It was the best of times, it "))
    assert not isinstance(plan, PrefillRefusal)
    messages = plan.body["messages"]
    assert messages[:-2] == REQUEST["messages"]
    assert messages[-2] == {"role": "assistant", "content": "It was the best of times, it"}
    assert messages[-1]["role"] == "user"
    quoted = f"<{ANCHOR_TAG}>\nIt was the best of times, it\n</{ANCHOR_TAG}>"
    assert quoted in messages[-1]["content"]
    assert messages[-1]["content"] == continue_instruction("It was the best of times, it")
    assert plan.echo == "It was the best of times, it" and plan.shown_ws == " "
    assert {k: v for k, v in plan.body.items() if k != "messages"} == {
        k: v for k, v in REQUEST.items() if k != "messages"
    }


def test_whitespace_only_asks_nothing() -> None:
    plan = plan_user_message(REQUEST, _committed("\n "))
    assert not isinstance(plan, PrefillRefusal)
    assert plan.body == REQUEST and plan.echo == "" and plan.shown_ws == "\n "


@pytest.mark.parametrize(
    ("patch", "refusal"),
    [
        ({"thinking": {"type": "adaptive"}}, PrefillRefusal.THINKING_ENABLED),
        ({"tool_choice": {"type": "tool", "name": "x"}}, PrefillRefusal.FORCED_TOOL),
        ({"stream": False}, PrefillRefusal.NOT_STREAMED),
        (
            {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "A"}]},
            PrefillRefusal.CLIENT_PREFILL,
        ),
    ],
)
def test_the_requests_it_refuses(patch: dict[str, Any], refusal: PrefillRefusal) -> None:
    request = {**REQUEST, **patch}
    assert user_message_refusal(request) is refusal
    assert plan_user_message(request, _committed("x")) is refusal


def _machine(report: ContinuationReport) -> tuple[TurnMachine, PrefillContinue]:
    strategy = PrefillContinue(
        path="v1/messages",
        request=REQUEST,
        keys=("up",),
        memory=ContinuationMemory(),
        max_splices=8,
        anthropic_mode=AnthropicContinue.USER_MESSAGE,
    )
    assert strategy.name == ANTHROPIC_USER_MESSAGE
    retry = RetryState(RetryPolicy(delay_ms=1, backoff="fixed"), 1, rng=random.Random(0))
    m = TurnMachine(
        protocol=ANTHROPIC,
        hold=Hold(),
        timers=Timers(),
        retry=retry,
        stream=True,
        now=0.0,
        report=report,
        continuation=strategy,
    )
    return m, strategy


def _run(
    text: str,
    split: list[int],
    cuts: list[int],
    seed: int,
    answer: Any,
) -> tuple[bytes, ContinuationReport]:
    """The turn through the machine: cut at each of ``cuts``; each continuation is
    ``answer(anchor, committed, rest)``'s text, streamed."""
    rng = random.Random(seed)
    report = ContinuationReport()
    m, _ = _machine(report)
    client: list[bytes] = []
    frames = stream(pieces_of(text, split), 100)
    assert isinstance(m.start(0.0), Open)
    for n, cut in enumerate([*cuts, None]):
        assert m.answered(0.0, 200, sse=True) == Stream()
        take = frames if cut is None else frames[: min(cut, len(frames) - 3)]
        over = None
        for chunk in chunks_of(b"".join(take), rng):
            out, over = m.feed_verbatim(0.0, chunk)
            client.append(chunk if out is None else out)
            if over is not None:
                break
        if isinstance(over, End):
            client.append(over.data)
            return b"".join(client), report
        if cut is None:
            end = m.body_ended(0.0)
            assert isinstance(end, End)
            client.append(end.data)
            return b"".join(client), report
        action = m.transport_failed(0.0, RESET)
        if isinstance(action, End):
            client.append(action.data)
            return b"".join(client), report
        if not isinstance(action, Resume):
            assert isinstance(action, Open) and b"".join(client) == b""
            continue
        messages = json.loads(action.body)["messages"]
        if messages == REQUEST["messages"]:
            committed, anchor = "", ""  # whitespace only was released: asked as it was
        else:
            committed, asked = messages[-2]["content"], messages[-1]["content"]
            anchor = asked.split(f"<{ANCHOR_TAG}>\n")[1].split(f"\n</{ANCHOR_TAG}>")[0]
            assert text.startswith(committed) and committed.endswith(anchor)
        rest = text[len(committed) :]
        reply = answer(anchor, committed, rest)
        frames = stream(pieces_of(reply, split[n:] or [3]), 100 + len(committed))
    raise AssertionError("unreachable")


_TEXT = st.text(alphabet="ab c\n.", min_size=1, max_size=60)
_SPLIT = st.lists(st.integers(0, 80), max_size=12)
_CUTS = st.lists(st.integers(4, 60), min_size=1, max_size=4)


@settings(max_examples=150, deadline=None)
@given(text=_TEXT, split=_SPLIT, cuts=_CUTS, seed=st.integers(0, 1000))
def test_a_model_that_repeats_the_anchor_then_goes_on_gives_the_uncut_text(
    text: str, split: list[int], cuts: list[int], seed: int
) -> None:
    """Cut up to four times anywhere; each continuation starts with exactly the quoted
    anchor, then the rest: the client gets the uncut text, one start, one stop.  A rest
    that happens to start with the end of what the client has is refused (never shown
    twice): the client then has a prefix of the text and the native error."""
    set_testing(True)
    try:
        raw, report = _run(text, split, cuts, seed, lambda anchor, _c, rest: anchor + rest)
    finally:
        set_testing(False)
    if any(c[1] == "refused_join" for c in report.of("continuation")):
        assert text.startswith(shown_text(raw))
        assert b"event: error" in raw
        return
    assert client_text(raw) == text


@settings(max_examples=100, deadline=None)
@given(
    text=st.text(alphabet="abc d.", max_size=60).map(lambda t: "Lo" + t),
    split=_SPLIT,
    seed=st.integers(0, 1000),
    bad=st.sampled_from(["preamble", "restart", "no_anchor", "echo"]),
)
def test_anything_but_a_clean_continuation_is_refused(
    text: str, split: list[int], seed: int, bad: str
) -> None:
    """A preamble before the anchor, a restart from the beginning, an answer without
    the anchor, or the anchor followed by the end of the text again: never spliced;
    the client has a prefix of the text, once, and the native error.  (A restart is a
    clean continuation when the anchor is all the client has: then it is spliced.)"""

    def answer(anchor: str, committed: str, rest: str) -> str:
        if bad == "preamble":
            return "Sure, continuing: " + anchor + rest
        if bad == "restart":
            return text
        if bad == "no_anchor":
            return "Z" + rest
        return anchor + anchor + rest

    set_testing(True)
    try:
        raw, report = _run(text, split, [8], seed, answer)
    finally:
        set_testing(False)
    results = [c[1] for c in report.of("continuation")]
    if not results or results[-1] == "spliced":
        # the cut came before any text (a replay), or a restart that was a clean
        # continuation after all (the anchor was all the client had)
        assert not results or bad == "restart"
        assert client_text(raw) == text
        return
    assert results[-1] == "refused_join"
    assert text.startswith(shown_text(raw))
    assert b"event: error" in raw and b"message_stop" not in raw


@pytest.mark.parametrize("open_block", [True, False])
def test_a_tool_call_before_the_anchor_breaks_the_join(open_block: bool) -> None:
    """The answer opens with a tool call (no text, so no anchor): refused, whether the
    client's text block was still open at the cut or closed."""
    from unbroken.core.wire.protocols.anthropic_prefill import FrameSplicer
    from unbroken.core.wire.protocols.prefill import JoinError
    from unbroken.core.wire.sse import Event

    committed = Committed("Hello there, general", 0 if open_block else None, 1)
    plan = plan_user_message(REQUEST, committed)
    assert not isinstance(plan, PrefillRefusal)
    splicer = FrameSplicer(plan)
    start = {"type": "message_start", "message": {"usage": {"input_tokens": 9}}}
    assert splicer.feed(Event(b"", "message_start", json.dumps(start))) == []
    call = {"type": "tool_use", "id": "t", "name": "bash", "input": {}}
    block = {"type": "content_block_start", "index": 0, "content_block": call}
    with pytest.raises(JoinError):
        splicer.feed(Event(b"", "content_block_start", json.dumps(block)))


def test_a_turn_continue_mode_cannot_cover_is_recorded_when_it_starts() -> None:
    """The machine is told why (``refusal``): the observer records it at once."""
    from turnfix import Report

    report = Report()
    retry = RetryState(RetryPolicy(delay_ms=1, backoff="fixed"), 1, rng=random.Random(0))
    TurnMachine(
        protocol=ANTHROPIC,
        hold=Hold(),
        timers=Timers(),
        retry=retry,
        stream=True,
        now=0.0,
        report=report,
        refusal=PrefillRefusal.THINKING_ENABLED,
    )
    assert report.of("uncovered") == [("uncovered", "refused_thinking_enabled")]
