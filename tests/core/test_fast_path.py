"""The per-chunk fast path releases exactly what the frame-by-frame path releases.

After commit, `TurnMachine.feed_chunk` may release a whole chunk verbatim when the
protocol's classifier proves every frame in it plain (`plain_run`).  For random
streams and random chunkings, the bytes released and the decisions must be
identical with the fast path on and off.
"""

from __future__ import annotations

import random
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st
from test_ledger import (
    FATAL_ERROR,
    MALFORMED,
    RETRYABLE_ERROR,
    Shape,
    anthropic_frames,
    chat_frames,
    responses_frames,
)

from turnfix import Report, Timers
from unbroken.core.ledger import Hold
from unbroken.core.policy import RetryPolicy, RetryState
from unbroken.core.protocols import ANTHROPIC, CHAT, RESPONSES
from unbroken.core.turn import TurnMachine

PROTOCOLS = {"chat": CHAT, "responses": RESPONSES, "anthropic": ANTHROPIC}
FRAMES = {"chat": chat_frames, "responses": responses_frames, "anthropic": anthropic_frames}


def machine(proto: str, verbatim: bool) -> TurnMachine:
    m = TurnMachine(
        protocol=PROTOCOLS[proto],
        hold=Hold(),
        timers=Timers(),
        retry=RetryState(RetryPolicy(max_attempts=1), 1, rng=random.Random(0)),
        stream=True,
        now=0.0,
        report=Report(),
    )
    m.verbatim = verbatim
    m.start(0.0)
    m.answered(0.0, 200, sse=True)
    return m


def run(proto: str, chunks: list[bytes], verbatim: bool) -> tuple[list[Any], int]:
    """What a client would see chunk by chunk, and how many chunks took the fast path."""
    m = machine(proto, verbatim)
    seen: list[Any] = []
    fast = 0
    for i, c in enumerate(chunks):
        out = m.feed_chunk(float(i), c)
        if len(out) == 1 and out[0].raw == c and out[0].data is None and out[0].name is None:
            fast += 1
        over = m.attempt_over
        seen.append((b"".join(e.raw for e in out), over))
        if over is not None:
            return seen, fast
    seen.append(("end", m.body_ended(float(len(chunks)))))
    seen.append(("outcome", m.outcome))
    return seen, fast


@st.composite
def streams(draw: st.DrawFn) -> tuple[str, list[bytes]]:
    proto = draw(st.sampled_from(sorted(PROTOCOLS)))
    shape = Shape(
        reasoning=draw(st.integers(0, 3)),
        text=draw(st.integers(1, 12)),
        tools=tuple(draw(st.lists(st.integers(1, 4), max_size=2))),
        interleave=draw(st.booleans()),
    )
    frames = FRAMES[proto]("t", shape)
    # sometimes a fault or an extra frame somewhere in the stream
    extra = draw(st.sampled_from([None, "retryable", "fatal", "malformed", "comment"]))
    if extra is not None:
        at = draw(st.integers(0, len(frames)))
        frame = {
            "retryable": RETRYABLE_ERROR[proto],
            "fatal": FATAL_ERROR[proto],
            "malformed": MALFORMED[proto],
            "comment": b": ping\n\n",
        }[extra]
        frames = [*frames[:at], frame, *frames[at:]]
    if draw(st.booleans()):
        frames = frames[: draw(st.integers(1, len(frames)))]  # cut short: truncated
    # chunks: groups of whole frames (the fast path's case) or arbitrary byte cuts
    body = b"".join(frames)
    if draw(st.booleans()):
        chunks: list[bytes] = []
        i = 0
        while i < len(frames):
            n = draw(st.integers(1, 6))
            chunks.append(b"".join(frames[i : i + n]))
            i += n
    else:
        cuts = sorted(set(draw(st.lists(st.integers(1, max(1, len(body) - 1)), max_size=12))))
        chunks = [body[a:b] for a, b in zip([0, *cuts], [*cuts, len(body)], strict=True)]
        chunks = [c for c in chunks if c]
    return proto, chunks


@settings(max_examples=600, deadline=None)
@given(streams())
def test_fast_path_releases_the_same_bytes_and_decides_the_same(
    stream: tuple[str, list[bytes]],
) -> None:
    proto, chunks = stream
    slow, _ = run(proto, chunks, verbatim=False)
    fast, _ = run(proto, chunks, verbatim=True)
    assert fast == slow


def test_the_fast_path_is_taken_for_plain_output_after_commit() -> None:
    for proto in PROTOCOLS:
        frames = FRAMES[proto]("t", Shape(text=12))
        chunks = [b"".join(frames[i : i + 3]) for i in range(0, len(frames), 3)]
        slow, _ = run(proto, chunks, verbatim=False)
        fast, taken = run(proto, chunks, verbatim=True)
        assert fast == slow
        assert taken >= 2, proto  # the middle chunks are plain text deltas


def test_no_fast_path_while_a_tool_call_is_open_or_before_commit() -> None:
    for proto in PROTOCOLS:
        frames = FRAMES[proto]("t", Shape(text=0, tools=(6,)))
        chunks = [b"".join(frames[i : i + 2]) for i in range(0, len(frames), 2)]
        _, taken = run(proto, chunks, verbatim=True)
        assert taken == 0, proto
