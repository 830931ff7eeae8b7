"""The prefill continuation through the turn machine (sans-IO): what the strategy reads
back is what the machine released, fast-path runs included, and the client's bytes
over any chunking and any cuts form one valid stream with the uncut text."""

from __future__ import annotations

import itertools
import json
import random
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from turnfix import Report, Timers
from unbroken.core.admission.policy import Failure, FailureClass, RetryPolicy, RetryState
from unbroken.core.turn.continuation import ContinuationMemory, Resume
from unbroken.core.turn.ledger import Hold
from unbroken.core.turn.machine import End, EndKind, Open, Stream, TurnMachine, set_testing
from unbroken.core.turn.prefill_continue import PrefillContinue
from unbroken.core.wire.protocols import ANTHROPIC
from unbroken.core.wire.protocols.prefill import echo_tails
from unbroken.core.wire.sse import SSESplitter

RESET = Failure(FailureClass.RESET, "reset")
OVERLOADED = (
    b'event: error\ndata: {"type": "error", "error": {"type": "overloaded_error", '
    b'"message": "Overloaded"}}\n\n'
)
REQUEST: dict[str, Any] = {
    "model": "m",
    "stream": True,
    "max_tokens": 100,
    "messages": [{"role": "user", "content": "q"}],
}


class ContinuationReport(Report):
    def continuation(self, result: str, splices: int, saved_frames: int) -> None:
        self.calls.append(("continuation", result, splices))


def frame(name: str, payload: dict[str, Any]) -> bytes:
    return f"event: {name}\ndata: {json.dumps(payload)}\n\n".encode()


def stream(pieces: list[str], input_tokens: int, tool: bool = False) -> list[bytes]:
    usage = {"input_tokens": input_tokens, "output_tokens": 1}
    out = [frame("message_start", {"type": "message_start", "message": {"usage": usage}})]
    block = {"type": "text", "text": ""}
    out.append(
        frame(
            "content_block_start",
            {"type": "content_block_start", "index": 0, "content_block": block},
        )
    )
    out.append(frame("ping", {"type": "ping"}))
    for p in pieces:
        delta = {"type": "text_delta", "text": p}
        out.append(
            frame(
                "content_block_delta", {"type": "content_block_delta", "index": 0, "delta": delta}
            )
        )
    out.append(frame("content_block_stop", {"type": "content_block_stop", "index": 0}))
    if tool:
        call = {"type": "tool_use", "id": "t1", "name": "bash", "input": {}}
        start = {"type": "content_block_start", "index": 1, "content_block": call}
        out.append(frame("content_block_start", start))
        for part in ('{"comm', 'and": "ls', '"}'):
            delta = {"type": "input_json_delta", "partial_json": part}
            out.append(
                frame(
                    "content_block_delta",
                    {"type": "content_block_delta", "index": 1, "delta": delta},
                )
            )
        out.append(frame("content_block_stop", {"type": "content_block_stop", "index": 1}))
    end = {
        "type": "message_delta",
        "delta": {"stop_reason": "end_turn"},
        "usage": {"output_tokens": len(pieces)},
    }
    out.append(frame("message_delta", end))
    out.append(frame("message_stop", {"type": "message_stop"}))
    return out


def shown_text(raw: bytes) -> str:
    """The text of every text delta in a client's stream."""
    out = []
    for e in SSESplitter().feed(raw):
        if e.name != "content_block_delta" or not e.data:
            continue
        delta = json.loads(e.data)["delta"]
        if delta.get("type") == "text_delta":
            out.append(delta["text"])
    return "".join(out)


def repeats(prefill: str, rest: str) -> bool:
    """Whether a continuation whose text is ``rest`` repeats the end of ``prefill``
    (`prefill.echo_tails`): refused, the model's own words or an echo alike."""
    tails = echo_tails(prefill)
    return any(rest.startswith(t) for t in tails) or (
        bool(rest.strip()) and any(t.startswith(rest) for t in tails)
    )


def pieces_of(text: str, cuts: list[int]) -> list[str]:
    points = sorted({c % (len(text) + 1) for c in cuts} | {0, len(text)})
    return [text[a:b] for a, b in itertools.pairwise(points) if b > a] or [""]


def chunks_of(data: bytes, rng: random.Random) -> list[bytes]:
    out, pos = [], 0
    while pos < len(data):
        n = rng.choice([1, 7, 40, 200, 5000])
        out.append(data[pos : pos + n])
        pos += n
    return out


def client_text(raw: bytes, tool: bool = False) -> str:
    """The client's text; its framing checked: one start, delta and stop, blocks in
    order, every delta in its open block, the tool call (if any) once and whole."""
    names: list[str | None] = []
    text: list[str] = []
    args: list[str] = []
    starts: list[str] = []
    open_block: tuple[int, str] | None = None
    for e in SSESplitter().feed(raw):
        if e.data is None:
            continue
        names.append(e.name)
        obj = json.loads(e.data)
        if e.name == "content_block_start":
            assert open_block is None and obj["index"] == len(starts)
            open_block = (obj["index"], obj["content_block"]["type"])
            starts.append(open_block[1])
        elif e.name == "content_block_delta":
            assert open_block is not None and obj["index"] == open_block[0]
            if obj["delta"]["type"] == "text_delta":
                assert open_block[1] == "text"
                text.append(obj["delta"]["text"])
            else:
                assert open_block[1] == "tool_use"
                args.append(obj["delta"]["partial_json"])
        elif e.name == "content_block_stop":
            assert open_block is not None and obj["index"] == open_block[0]
            open_block = None
    assert names.count("message_start") == 1 and names.count("message_delta") == 1
    assert names[-1] == "message_stop" and names.count("message_stop") == 1
    assert starts[0] == "text" and starts.count("tool_use") == (1 if tool else 0)
    if tool:  # the call once, whole, last: never a partial one held at a cut
        assert starts[-1] == "tool_use"
        assert json.loads("".join(args)) == {"command": "ls"}
    return "".join(text)


@settings(max_examples=150, deadline=None)
@given(
    text=st.text(alphabet="ab c\n.", min_size=1, max_size=60),
    split=st.lists(st.integers(0, 80), max_size=12),
    cuts=st.lists(st.integers(4, 60), min_size=1, max_size=4),
    seed=st.integers(0, 1000),
    tool=st.booleans(),
    by_error=st.lists(st.booleans(), min_size=4, max_size=4),
)
def test_cuts_through_the_machine_give_the_uncut_text(
    text: str, split: list[int], cuts: list[int], seed: int, tool: bool, by_error: list[bool]
) -> None:
    """A cut is a reset, or Anthropic's own ``overloaded_error`` event (a cut too, for a
    prefill continuation)."""
    set_testing(True)
    try:
        rng = random.Random(seed)
        report = ContinuationReport()
        retry = RetryState(RetryPolicy(delay_ms=1, backoff="fixed"), 1, rng=random.Random(0))
        strategy = PrefillContinue(
            path="v1/messages",
            request=REQUEST,
            keys=("up",),
            memory=ContinuationMemory(),
            max_splices=8,
        )
        m = TurnMachine(
            protocol=ANTHROPIC,
            hold=Hold(),
            timers=Timers(),
            retry=retry,
            stream=True,
            now=0.0,
            report=report,
        )
        m.continuation = strategy
        client: list[bytes] = []
        refusing = False
        frames = stream(pieces_of(text, split), 100, tool)
        action = m.start(0.0)
        assert isinstance(action, Open)
        plan_for: list[int | None] = [*cuts, None]
        for n, cut in enumerate(plan_for):
            assert m.answered(0.0, 200, sse=True) == Stream()
            take = frames if cut is None else frames[: min(cut, len(frames) - 3)]
            error = cut is not None and by_error[n]
            if error:
                take = [*take, OVERLOADED]
            over = None
            for chunk in chunks_of(b"".join(take), rng):
                out, over = m.feed_verbatim(0.0, chunk)
                client.append(chunk if out is None else out)
                if over is not None:
                    break
            if refusing and isinstance(over, End) and over.kind is EndKind.ERROR:
                # the continuation repeats the end of the prefill: refused, never shown
                # twice; the client has a prefix of the text and the native error
                client.append(over.data)
                assert text.startswith(shown_text(b"".join(client)))
                return
            assert (over is not None) == error
            if cut is None:
                end = m.body_ended(0.0)
                assert isinstance(end, End) and end.kind is EndKind.CLEAN
                client.append(end.data)
                break
            action = over if over is not None else m.transport_failed(0.0, RESET)
            if not isinstance(action, Resume):
                # Nothing was released yet (a cut before the first delta): a replay.
                assert b"".join(client) == b""
                assert isinstance(action, Open)
                continue
            # what the strategy read back is exactly what the machine released
            assert b"".join(strategy._released) == b"".join(client)
            prefill = json.loads(action.body)["messages"][-1]
            start = prefill["content"] if prefill["role"] == "assistant" else ""
            assert text.startswith(start)
            rest = text[len(start) :]
            refusing = repeats(start, rest)
            frames = stream(pieces_of(rest, split[n:] or [3]), 100 + len(start), tool)
        assert client_text(b"".join(client), tool) == text
    finally:
        set_testing(False)
