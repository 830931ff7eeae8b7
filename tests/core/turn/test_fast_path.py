"""The fast path releases exactly what the frame-by-frame path releases.

After commit, `TurnMachine.feed_verbatim` releases a run of frames as it is, in one
piece, when the protocol's classifier proves each of them plain (`plain_prefix`,
through `Ledger.release_run`); the rest goes frame by frame.  For random streams and
random chunkings (whole frames, arbitrary cuts, the whole turn in one chunk), the
bytes released and the decisions must be identical with the fast path on
(`feed_verbatim`) and off (`feed_chunk`).
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any
from unittest import mock

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from core.turn.ledgerfix import (
    FATAL_ERROR,
    MALFORMED,
    RETRYABLE_ERROR,
    Shape,
    anthropic_frames,
    chat_frames,
    responses_frames,
)
from turnfix import Report, Timers
from unbroken.core.admission.policy import RetryPolicy, RetryState
from unbroken.core.turn.ledger import Hold, Ledger
from unbroken.core.turn.machine import TurnMachine
from unbroken.core.wire.protocols import ANTHROPIC, CHAT, RESPONSES
from unbroken.core.wire.sse import SSESplitter

PROTOCOLS = {"chat": CHAT, "responses": RESPONSES, "anthropic": ANTHROPIC}
FRAMES = {"chat": chat_frames, "responses": responses_frames, "anthropic": anthropic_frames}


def machine(proto: str) -> TurnMachine:
    m = TurnMachine(
        protocol=PROTOCOLS[proto],
        hold=Hold(),
        timers=Timers(),
        retry=RetryState(RetryPolicy(max_attempts=1), 1, rng=random.Random(0)),
        stream=True,
        now=0.0,
        report=Report(),
    )
    m.start(0.0)
    m.answered(0.0, 200, sse=True)
    return m


@contextmanager
def runs_counted() -> Iterator[list[bytes]]:
    """The runs `Ledger.release_run` released, in order."""
    runs: list[bytes] = []
    release_run = Ledger.release_run

    def counted(self: Ledger, chunk: bytes, start: int = 0) -> int:
        end = release_run(self, chunk, start)
        if end > start:
            runs.append(chunk[start:end])
        return end

    with mock.patch.object(Ledger, "release_run", counted):
        yield runs


def run(proto: str, chunks: list[bytes], verbatim: bool) -> tuple[list[Any], int]:
    """What a client would see chunk by chunk, and how many frames went out in runs."""
    m = machine(proto)
    seen: list[Any] = []
    with runs_counted() as runs:
        for i, c in enumerate(chunks):
            if verbatim:
                data, over = m.feed_verbatim(float(i), c)
                if data is None:  # released whole, as it is: the attempt goes on
                    assert over is None
                    data = c
                out = data
            else:
                events, over = m.feed_chunk(float(i), c)
                out = b"".join(e.raw for e in events)
            seen.append((out, over))
            if over is not None:
                break
        else:
            seen.append(("end", m.body_ended(float(len(chunks)))))
            seen.append(("outcome", m.outcome))
    assert verbatim or not runs
    return seen, sum(r.count(b"\n\n") for r in runs)


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
    # chunks: groups of whole frames, arbitrary byte cuts, or the whole turn at once
    body = b"".join(frames)
    cut = draw(st.sampled_from(["frames", "bytes", "one"]))
    if cut == "one":
        return proto, [body]
    if cut == "frames":
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
        assert taken >= 6, proto  # the middle chunks are plain text deltas


def test_a_turn_in_one_chunk_takes_the_run_from_its_first_output_on() -> None:
    # A fast model, or a busy relay: the whole turn arrives in one read.  Before commit
    # its frames go one at a time; after the first text delta the deltas are one run.
    for proto in PROTOCOLS:
        frames = FRAMES[proto]("t", Shape(text=12))
        slow, _ = run(proto, [b"".join(frames)], verbatim=False)
        fast, taken = run(proto, [b"".join(frames)], verbatim=True)
        assert fast == slow
        assert fast[0][0] == b"".join(frames)
        assert taken >= 10, (proto, taken)


def test_a_chunk_that_finishes_a_frame_then_takes_the_run() -> None:
    # Reads cut frames anywhere: the frame an earlier chunk began is finished through
    # the splitter, and the whole frames after it are one run.
    for proto in PROTOCOLS:
        frames = FRAMES[proto]("t", Shape(text=12))
        body = b"".join(frames)
        half = len(b"".join(frames[:6])) + len(frames[6]) // 2
        chunks = [body[:half], body[half:]]
        slow, _ = run(proto, chunks, verbatim=False)
        fast, taken = run(proto, chunks, verbatim=True)
        assert fast == slow
        assert taken >= 4, (proto, taken)


def test_an_empty_chunk_releases_nothing_before_or_after_commit() -> None:
    frames = FRAMES["chat"]("t", Shape(text=2))
    m = machine("chat")
    assert m.feed_verbatim(0.0, b"") == (b"", None)  # not None: "write the chunk"
    assert m.feed_verbatim(0.0, frames[0]) == (b"", None)  # the role chunk: held
    assert m.feed_verbatim(0.0, frames[1]) == (frames[0] + frames[1], None)  # commits
    assert m.feed_verbatim(0.0, b"") == (b"", None)
    assert m.feed_verbatim(0.0, frames[2]) == (None, None)  # plain, whole


def test_no_fast_path_while_a_tool_call_is_open_or_before_commit() -> None:
    for proto in PROTOCOLS:
        frames = FRAMES[proto]("t", Shape(text=0, tools=(6,)))
        for chunks in (
            [b"".join(frames[i : i + 2]) for i in range(0, len(frames), 2)],
            [b"".join(frames)],
        ):
            slow, _ = run(proto, chunks, verbatim=False)
            fast, taken = run(proto, chunks, verbatim=True)
            assert fast == slow
            assert taken == 0, proto


def test_text_while_a_tool_call_is_open_is_held_not_run() -> None:
    # Some providers stream text beside an open tool call; the ledger holds it with the
    # call (the dispatch gate), so no run may release it, whatever the chunking.
    frames = chat_frames("t", Shape(text=2, tools=(6,)))
    text = frames[1:3]  # after the role chunk
    assert all(b"text t" in f for f in text)
    at = frames.index(next(f for f in frames if b'"tool_calls"' in f)) + 3
    frames = [*frames[:at], *text, *frames[at:]]
    for chunks in (frames, [b"".join(frames[:at]), b"".join(frames[at:])], [b"".join(frames)]):
        slow, _ = run("chat", chunks, verbatim=False)
        fast, _ = run("chat", chunks, verbatim=True)
        assert fast == slow
    slow, _ = run("chat", frames, verbatim=False)
    assert slow[at][0] == b""  # the first text frame inside the call: held


# -- the typed proof of a plain Chat Completions chunk (`ChatClassifier.plain_prefix`) ---
_OPENAI_CHUNK = (
    b'data: {"id":"chatcmpl-1","object":"chat.completion.chunk","created":1700000000,'
    b'"model":"gpt-4o","service_tier":"default","system_fingerprint":"fp_1","choices":[{'
    b'"index":0,"delta":{"content":"hello"},"logprobs":null,"finish_reason":null}],'
    b'"usage":null,"obfuscation":"Xk2"}\n\n'
)
_FINISH_CHUNK = _OPENAI_CHUNK.replace(b'"finish_reason":null', b'"finish_reason":"stop"')


def test_the_typed_proof_takes_openai_chunks_and_steps_aside_for_other_shapes() -> None:
    from unbroken.core.wire.protocols.chat import ChatClassifier

    n = len(_OPENAI_CHUNK)
    c = ChatClassifier()
    assert c.plain_prefix(_OPENAI_CHUNK) == (1, n) and c.typed  # one frame
    assert c.plain_prefix(_OPENAI_CHUNK * 3) == (3, 3 * n) and c.typed
    assert c.plain_prefix(b"xx" + _OPENAI_CHUNK * 2, 2) == (2, 2 + 2 * n)  # from an offset
    assert c.plain_prefix(_OPENAI_CHUNK + _OPENAI_CHUNK[:20]) == (1, n)  # not the cut one
    assert c.plain_prefix(b": ping\n\n" + _OPENAI_CHUNK) == (0, 0) and c.typed
    other = _OPENAI_CHUNK.replace(b'"usage":null', b'"provider":"x"')
    assert c.plain_prefix(other) == (1, len(other))  # proved by the bytes instead
    assert not c.typed  # and the typed proof is not tried again in this attempt
    assert c.plain_prefix(_OPENAI_CHUNK) == (1, n)
    assert c.plain_prefix(_OPENAI_CHUNK + _FINISH_CHUNK) == (0, 0)  # bytes: all or nothing


def test_the_typed_run_ends_where_the_frames_stop_being_whole_one_line_frames() -> None:
    """The run's frames are found with one split at the blank lines: it ends before a
    frame of two lines, a frame after an extra blank line, and what follows the last
    blank line (cut, or ending in one LF), as the frame-by-frame search did."""
    from unbroken.core.wire.protocols.chat import ChatClassifier

    n = len(_OPENAI_CHUNK)
    two_lines = _OPENAI_CHUNK.replace(b"data: {", b"data: {\n", 1)
    for chunk, expected in (
        (_OPENAI_CHUNK * 2 + two_lines, (2, 2 * n)),
        (_OPENAI_CHUNK + b"\n" + _OPENAI_CHUNK, (1, n)),  # "\n\n\n": an empty line first
        (_OPENAI_CHUNK + _OPENAI_CHUNK[:-1], (1, n)),  # the second ends in one LF
        (_OPENAI_CHUNK + _OPENAI_CHUNK[:-2], (1, n)),
        (_OPENAI_CHUNK[:-2], (0, 0)),
        (b"", (0, 0)),
        (_OPENAI_CHUNK + b"data: [DONE]\n\n", (1, n)),
    ):
        c = ChatClassifier()
        assert c.plain_prefix(chunk) == expected and c.typed, chunk
        assert c.plain_prefix(b"xyz" + chunk, 3) == (expected[0], expected[1] + 3)


def test_the_typed_run_ends_before_the_first_frame_that_does_not_fit() -> None:
    from unbroken.core.wire.protocols.chat import ChatClassifier

    n = len(_OPENAI_CHUNK)
    c = ChatClassifier()
    chunk = _OPENAI_CHUNK * 2 + _FINISH_CHUNK + b"data: [DONE]\n\n"
    assert c.plain_prefix(chunk) == (2, 2 * n)
    assert not c.typed  # the finish did not fit: the typed proof is off for the attempt


def test_a_finish_in_a_run_is_refused_without_its_decode(monkeypatch: pytest.MonkeyPatch) -> None:
    """A frame with ``"finish_reason":"..."`` cannot fit the typed proof: it ends the run
    as a failed decode would, without the decode; text that only quotes those bytes
    (escaped, inside a string) is still proved plain."""
    from unbroken.core.wire.protocols import chat

    decoded: list[bytes] = []
    real = chat._plain_chunk

    def counting(data: bytes) -> object:
        decoded.append(bytes(data))
        return real(data)

    monkeypatch.setattr(chat, "_plain_chunk", counting)
    n = len(_OPENAI_CHUNK)
    c = chat.ChatClassifier()
    assert c.plain_prefix(_OPENAI_CHUNK * 2 + _FINISH_CHUNK + b"data: [DONE]\n\n") == (2, 2 * n)
    assert not c.typed and len(decoded) == 2  # the finish frame was not decoded
    quoting = _OPENAI_CHUNK.replace(b'"hello"', b'"say \\"finish_reason\\":\\"stop\\""')
    c = chat.ChatClassifier()
    assert c.plain_prefix(quoting * 2) == (2, 2 * len(quoting)) and c.typed


def test_the_typed_proof_takes_a_chunk_s_keys_in_any_order() -> None:
    """`_PlainChunk` declares its fields in the order OpenAI sends them (a lookup
    finds each key at once); the order is not part of the proof: other orders of the
    same keys are taken, and a chunk without ``choices`` is refused in any order."""
    import json

    from unbroken.core.wire.protocols.chat import _NOT_PLAIN_CHUNK, ChatClassifier, _plain_chunk

    keys = list(json.loads(_OPENAI_CHUNK[6:-2]))
    fields = json.loads(_OPENAI_CHUNK[6:-2])
    orders = [keys[i:] + keys[:i] for i in range(len(keys))]
    orders += [order[::-1] for order in orders]
    orders += [random.Random(seed).sample(keys, len(keys)) for seed in range(20)]
    for order in orders:
        payload = json.dumps({k: fields[k] for k in order}, separators=(",", ":")).encode()
        chunk = b"data: " + payload + b"\n\n"
        c = ChatClassifier()
        assert c.plain_prefix(chunk * 2) == (2, 2 * len(chunk)) and c.typed, order
        rest = {k: fields[k] for k in order if k != "choices"}
        with pytest.raises(_NOT_PLAIN_CHUNK):
            _plain_chunk(json.dumps(rest).encode())


_TEXT = {"index": 0, "delta": {"content": "t"}, "finish_reason": None}
# Payloads the typed proof must decide exactly as `classify`'s parse does: duplicate keys
# (each copy is checked), numbers out of range, strings either parser refuses, types
# out of the declared ones, fields it does not know.
EDGE_PAYLOADS = {
    "dup choices, the last a tool call": (
        b'{"choices":[{"delta":{"content":"h"}}],"choices":[{"index":0,"delta":{"tool_calls":'
        b'[{"index":0,"id":"c","type":"function","function":{"name":"bash","arguments":"{}"}}]}}]}'
    ),
    "dup finish_reason, the last stop": (
        b'{"choices":[{"delta":{"content":"h"},"finish_reason":null,"finish_reason":"stop"}]}'
    ),
    "dup finish_reason, the first stop": (
        b'{"choices":[{"delta":{"content":"h"},"finish_reason":"stop","finish_reason":null}]}'
    ),
    "dup error": b'{"error":null,"error":{"message":"x","type":"server_error"},"choices":[]}',
    "huge exponent in created": b'{"created":1e400,"choices":[{"delta":{"content":"h"}}]}',
    "huge exponent unknown": b'{"x":1e400,"choices":[{"delta":{"content":"h"}}]}',
    "big int created": (
        b'{"created":123456789012345678901234567890,"choices":[{"delta":{"content":"h"}}]}'
    ),
    "float created": b'{"created":1.5,"choices":[{"delta":{"content":"h"}}]}',
    "invalid utf-8 in content": b'{"choices":[{"delta":{"content":"h\xff\xfe"}}]}',
    "invalid utf-8 in id": b'{"id":"\xc0\xaf","choices":[{"delta":{"content":"h"}}]}',
    "lone surrogate": b'{"choices":[{"delta":{"content":"\\ud800"}}]}',
    "escaped nul": b'{"choices":[{"delta":{"content":"a\\u0000b"}}]}',
    "raw control char": b'{"choices":[{"delta":{"content":"a\x01b"}}]}',
    "unknown field": b'{"provider":"x","choices":[{"delta":{"content":"h"}}]}',
    "usage object": b'{"choices":[],"usage":{"prompt_tokens":1,"completion_tokens":2}}',
    "logprobs object": b'{"choices":[{"delta":{"content":"h"},"logprobs":{"content":[]}}]}',
    "content as a list": b'{"choices":[{"delta":{"content":["h"]}}]}',
    "choices an object": b'{"choices":{"0":{"delta":{"content":"h"}}}}',
    "choices of numbers": b'{"choices":[1]}',
    "empty finish_reason": b'{"choices":[{"delta":{"content":"h"},"finish_reason":""}]}',
    "function_call delta": b'{"choices":[{"delta":{"function_call":{"name":"f"}}}]}',
    "trailing spaces": b'{"choices":[{"delta":{"content":"h"}}]}   ',
    "trailing garbage": b'{"choices":[{"delta":{"content":"h"}}]} x',
    "deep nesting": b'{"x":' + b"[" * 3000 + b"]" * 3000 + b',"choices":[]}',
    "array at the top": b'[{"choices":[]}]',
    "role only": b'{"choices":[{"index":0,"delta":{"role":"assistant"}}]}',
}


@pytest.mark.parametrize("name", sorted(EDGE_PAYLOADS))
def test_the_typed_proof_decides_as_the_slow_path(name: str) -> None:
    frames = chat_frames("t", Shape(text=3))
    edge = b"data: " + EDGE_PAYLOADS[name] + b"\n\n"
    for at in (2, 3):  # right after commit, and after a plain chunk went the typed way
        stream = [*frames[:at], edge, *frames[at:]]
        for chunks in ([*stream], [stream[0], stream[1], b"".join(stream[2:])]):
            slow, _ = run("chat", chunks, verbatim=False)
            fast, _ = run("chat", chunks, verbatim=True)
            assert fast == slow, (name, at)


PLAIN_PAYLOADS = {
    "role and empty content": (
        b'{"choices":[{"index":0,"delta":{"role":"assistant","content":""}}]}'
    ),
    "content": _OPENAI_CHUNK[6:-2],
    "refusal": b'{"choices":[{"delta":{"refusal":"no"},"finish_reason":null}]}',
    "reasoning_content": b'{"choices":[{"delta":{"reasoning_content":"hm"}}]}',
    "reasoning": b'{"choices":[{"delta":{"reasoning":"hm"}}]}',
    "content null": b'{"choices":[{"delta":{"content":null}}]}',
    "two choices": (
        b'{"choices":[{"index":0,"delta":{"reasoning":"a"}},{"index":1,"delta":{"content":"b"}}]}'
    ),
    "empty choices": b'{"choices":[],"usage":null}',
    "delta null": b'{"choices":[{"index":0,"delta":null}]}',
    "error null": b'{"error":null,"choices":[{"delta":{"content":"x"}}]}',
    "dup content, the last empty": b'{"choices":[{"delta":{"content":"a","content":""}}]}',
}


@pytest.mark.parametrize("name", sorted(EDGE_PAYLOADS) + sorted(PLAIN_PAYLOADS))
def test_the_typed_classification_matches_the_dict_walk(name: str) -> None:
    from unbroken.core.wire.protocols.chat import ChatClassifier
    from unbroken.core.wire.sse import Event

    payload = EDGE_PAYLOADS.get(name) or PLAIN_PAYLOADS[name]
    event = Event(b"data: " + payload + b"\n\n", None, payload.decode("utf-8", "replace"))
    typed, walk = ChatClassifier(), ChatClassifier()
    walk.typed = False
    for tools_open in (False, True):
        if tools_open:  # a tool call already open: the count comes back unchanged
            typed.open_indices.add(0)
            walk.open_indices.add(0)
            typed.typed = True
        assert typed.classify(event) == walk.classify(event), name
        assert typed.open_indices == walk.open_indices and typed.finished == walk.finished
    if name in PLAIN_PAYLOADS:
        assert typed.typed, f"{name}: the typed decode should have taken it"


# -- the guards of the fast path, each shown to matter ---------------------------------


@pytest.mark.parametrize("proto", sorted(PROTOCOLS))
def test_a_chunk_holding_a_cr_goes_frame_by_frame(proto: str) -> None:
    """A CR ends a line in SSE, and `plain_prefix` looks only for ``\\n\\n``: a CR where
    JSON allows white space makes a frame that a run would prove plain and release,
    while the splitter cuts it there and finds a malformed frame.  So a chunk holding
    a CR takes no run (without that guard, the garbage went out as plain output)."""
    frames = FRAMES[proto]("t", Shape(reasoning=0, text=4, tools=(), interleave=False))
    first = next(i for i, f in enumerate(frames) if b"text t 0" in f)
    text = frames[first + 1]
    assert b', "' in text
    cut = text.replace(b', "', b',\r"', 1)  # valid JSON; to SSE, two lines
    chunks = [b"".join(frames[: first + 1]), cut + frames[first + 2], *frames[first + 3 :]]
    fast, _ = run(proto, chunks, verbatim=True)
    slow, _ = run(proto, chunks, verbatim=False)
    assert fast == slow
    out, over = slow[1]
    assert b"malformed frame" in out and b"text t 1" not in out
    assert over is not None  # the turn ends there, with the protocol's error


def test_no_run_while_a_tool_call_is_open_even_with_nothing_held() -> None:
    """After a tool call overflowed the hold (released, still open), the ledger holds
    again what follows while it is open; a run must not release it instead."""
    frames = chat_frames("t", Shape(reasoning=0, text=2, tools=(1,), interleave=False))
    role, text, more, start = frames[:4]
    big_start = start.replace(b'"arguments": ""', b'"arguments": "' + b"x" * 400 + b'"')

    def ledger() -> Ledger:
        led = Ledger(CHAT, max_hold_bytes=300)
        for raw in (role, text, big_start):
            for event in SSESplitter().feed(raw):
                led.feed(event)
        assert led.open_tools == 1 and not led.held_bytes and led.hold_overflowed
        return led

    slow = ledger()
    (event,) = SSESplitter().feed(more)
    assert slow.feed(event) == ()  # held: a tool call is open
    assert slow.held_bytes == len(more)
    fast = ledger()
    assert fast.release_run(more) == 0  # no run: frame by frame, so held the same way
    assert fast.stats.released_frames == slow.stats.released_frames
