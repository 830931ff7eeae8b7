"""Tests for the byte-exact SSE splitter (``unbroken.core.wire.sse``).

The splitter must (1) never lose, duplicate or reorder a byte, whatever the
chunking of the upstream stream, and (2) find the same events, with the same
``event:`` names and joined ``data:``, as a straightforward reading of the SSE
spec (HTML Living Standard 9.2.6) applied to the whole stream at once.
"""

from __future__ import annotations

import itertools
import re
from dataclasses import dataclass

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from unbroken.core.wire.sse import Event, SSESplitter

# ---------------------------------------------------------------------------
# Reference parser: the whole stream at once, straight from the spec.

_EOL = re.compile(rb"\r\n|\r|\n")


def reference_split(stream: bytes) -> tuple[list[bytes], bytes]:
    """Split ``stream`` into event blocks (each with its terminating blank line).

    Returns (blocks, unterminated tail).  A CR as the very last byte is
    undecided (it may be the first half of a CRLF), so it does not end a line.
    """
    blocks: list[bytes] = []
    start = pos = 0
    n = len(stream)
    while pos < n:
        m = _EOL.search(stream, pos)
        if m is None:
            break
        if m.group() == b"\r" and m.end() == n:
            break  # undecided trailing CR
        if m.start() == pos:  # empty line: dispatch
            blocks.append(stream[start : m.end()])
            start = m.end()
        pos = m.end()
    return blocks, stream[start:]


def reference_fields(block: bytes) -> tuple[str | None, str | None]:
    """(event name, joined data) of one block, per the spec's field rules."""
    name: str | None = None
    data: list[str] = []
    saw_data = False
    for line in _EOL.split(block):
        if not line or line.startswith(b":"):
            continue
        if b":" in line:
            field, value = line.split(b":", 1)
            if value.startswith(b" "):
                value = value[1:]
        else:
            field, value = line, b""
        if field == b"data":
            saw_data = True
            data.append(value.decode("utf-8"))
        elif field == b"event":
            name = value.decode("utf-8")
    return name, ("\n".join(data) if saw_data else None)


def significant(raw: bytes) -> bool:
    """An event block that holds at least one non-blank line.

    Runs of blank lines between events carry nothing; the splitter may report
    them as their own (empty) events or fold them into the next event's raw
    bytes.  Either is fine as long as no byte is lost.
    """
    return raw.strip(b"\r\n") != b""


def feed_chunks(chunks: list[bytes]) -> tuple[list[Event], SSESplitter]:
    splitter = SSESplitter()
    events: list[Event] = []
    for chunk in chunks:
        events.extend(splitter.feed(chunk))
    return events, splitter


def cut(stream: bytes, points: list[int]) -> list[bytes]:
    bounds = [0, *sorted(set(points)), len(stream)]
    return [stream[a:b] for a, b in itertools.pairwise(bounds)]


def check_against_reference(stream: bytes, events: list[Event], splitter: SSESplitter) -> None:
    """Byte conservation plus event-by-event agreement with the reference parse."""
    blocks, tail = reference_split(stream)
    # (1) byte-exact: every byte either in an event or still pending, in order
    assert b"".join(e.raw for e in events) + splitter.pending == stream
    assert splitter.pending == tail
    # (2) the same significant events, ending at the same offsets, same fields
    got: list[tuple[int, str | None, str | None]] = []
    offset = 0
    for e in events:
        offset += len(e.raw)
        if significant(e.raw):
            got.append((offset, e.name, e.data))
    want: list[tuple[int, str | None, str | None]] = []
    offset = 0
    for block in blocks:
        offset += len(block)
        if significant(block):
            want.append((offset, *reference_fields(block)))
    assert got == want
    # insignificant events carry no field
    for e in events:
        if not significant(e.raw):
            assert e.name is None and e.data is None


# ---------------------------------------------------------------------------
# Random well-formed streams

EOLS = (b"\n", b"\r\n", b"\r")

field_text = st.text(
    alphabet=st.characters(
        blacklist_categories=["Cs"],
        blacklist_characters="\r\n",
    ),
    max_size=12,
)


@st.composite
def sse_line(draw: st.DrawFn) -> tuple[bytes, tuple[str, str] | None]:
    """One non-empty line and its meaning: ("data"|"event", value) or None."""
    kind = draw(
        st.sampled_from(["data", "data", "data", "event", "id", "retry", "comment", "other"])
    )
    value = draw(field_text)
    if kind in ("data", "event"):
        style = draw(st.sampled_from(["space", "nospace", "bare"]))
        if style == "bare" or (style == "nospace" and not value):
            # "data" alone is the field with an empty value
            if style == "bare":
                value = ""
            return kind.encode(), (kind, value)
        if style == "space":
            return f"{kind}: {value}".encode(), (kind, value)
        # "data:<value>": a single leading space of the value is the optional one
        return f"{kind}:{value}".encode(), (kind, value[1:] if value[:1] == " " else value)
    if kind == "id":
        return f"id: {value}".encode(), None
    if kind == "retry":
        return f"retry: {draw(st.integers(0, 10_000))}".encode(), None
    if kind == "comment":
        return f":{value}".encode(), None
    name = draw(st.sampled_from(["foo", "Data", "EVENT", "x-y"]))
    return f"{name}: {value}".encode(), None


@dataclass
class Built:
    stream: bytes
    events: list[tuple[str | None, str | None]]  # intended (name, data) per event
    terminated_by_final_cr: bool  # last complete event ends the stream with a bare CR
    has_tail: bool


@st.composite
def sse_stream(draw: st.DrawFn) -> Built:
    parts: list[bytes] = []
    prev_eol = b""
    intended: list[tuple[str | None, str | None]] = []

    def eol() -> bytes:
        nonlocal prev_eol
        e = draw(st.sampled_from(EOLS))
        if prev_eol == b"\r" and e == b"\n":
            e = b"\r\n"  # a lone LF after a CR would merge into one CRLF line end
        prev_eol = e
        return e

    n_events = draw(st.integers(0, 6))
    for _ in range(n_events):
        for _ in range(draw(st.integers(0, 2))):  # blank lines between events
            parts.append(eol())
        name: str | None = None
        data: list[str] | None = None
        for _ in range(draw(st.integers(1, 4))):
            line, meaning = draw(sse_line())
            parts.append(line)
            prev_eol = b""
            parts.append(eol())
            if meaning is not None:
                field, value = meaning
                if field == "data":
                    data = [*(data or []), value]
                else:
                    name = value
        parts.append(eol())  # the blank line that ends the event
        intended.append((name, None if data is None else "\n".join(data)))
    has_tail = draw(st.booleans())
    if has_tail:  # an unterminated event: complete lines then maybe a partial one
        complete_lines = draw(st.integers(0, 2))
        for _ in range(complete_lines):
            line, _meaning = draw(sse_line())
            parts.append(line)
            prev_eol = b""
            parts.append(eol())
        if complete_lines == 0 or draw(st.booleans()):
            line, _meaning = draw(sse_line())
            parts.append(line[: draw(st.integers(1, len(line)))])
    stream = b"".join(parts)
    final_cr = not has_tail and n_events > 0 and stream.endswith(b"\r")
    return Built(stream, intended, final_cr, has_tail)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(built=sse_stream())
def test_reference_parser_agrees_with_generator(built: Built) -> None:
    """Sanity check of the oracle itself against the generator's intent."""
    blocks, tail = reference_split(built.stream)
    parsed = [reference_fields(b) for b in blocks if significant(b)]
    intended = list(built.events)
    if built.terminated_by_final_cr:
        intended = intended[:-1]  # its blank line is an undecided trailing CR
    assert parsed == intended
    if built.has_tail or built.terminated_by_final_cr:
        assert tail != b""
    else:
        assert tail == b""


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(built=sse_stream(), data=st.data())
def test_any_chunking_matches_reference(built: Built, data: st.DataObject) -> None:
    stream = built.stream
    points = data.draw(
        st.lists(st.integers(0, max(len(stream), 0)), max_size=12), label="cut points"
    )
    chunks = cut(stream, points)
    # empty chunks are legal and change nothing
    if data.draw(st.booleans(), label="empty chunks"):
        chunks = [c for chunk in chunks for c in (chunk, b"")]
    events, splitter = feed_chunks(chunks)
    check_against_reference(stream, events, splitter)


@settings(max_examples=150, deadline=None)
@given(built=sse_stream())
def test_byte_by_byte_matches_one_shot(built: Built) -> None:
    stream = built.stream
    one, s1 = feed_chunks([stream])
    check_against_reference(stream, one, s1)
    many, s2 = feed_chunks([stream[i : i + 1] for i in range(len(stream))])
    check_against_reference(stream, many, s2)
    assert [(e.name, e.data) for e in one if significant(e.raw)] == [
        (e.name, e.data) for e in many if significant(e.raw)
    ]


@settings(max_examples=150, deadline=None)
@given(built=sse_stream())
def test_frame_by_frame_matches_one_shot(built: Built) -> None:
    """Cut at every blank line, as the HTTP transport peels a turn's first frames (each
    whole frame on its own, the splitter idle before it: its one-frame fast path)."""
    stream = built.stream
    chunks = [part + b"\n\n" for part in stream.split(b"\n\n")]
    chunks[-1] = chunks[-1][:-2]
    events, splitter = feed_chunks([c for c in chunks if c])
    check_against_reference(stream, events, splitter)


# ---------------------------------------------------------------------------
# A fixed, realistic stream: every cut point, and byte by byte

REALISTIC_LF = (
    b": keepalive\n\n"
    b'data: {"id":"chatcmpl-1","object":"chat.completion.chunk","choices":[{"index":0,'
    b'"delta":{"role":"assistant","content":""},"finish_reason":null}]}\n\n'
    b'data: {"choices":[{"index":0,"delta":{"content":'
    b'"h\xc3\xa9llo \xe2\x9c\x93 \xf0\x9f\x98\x80"}}]}\n\n'
    b"event: content_block_delta\n"
    b'data: {"type":"content_block_delta","index":0,"delta":{"type":"text_delta","text":"x"}}\n\n'
    b'event: ping\nid: 7\nretry: 3000\ndata: {"type": "ping"}\n\n'
    b"data: line one\ndata:line two\ndata\ndata: \n\n"
    b"event: empty\ndata:\n\n"
    b"event:\n\n"
    b":comment only\n:another\n\n"
    b"data: [DONE]\n\n"
    b"data: unterminated tail"
)


def _variants() -> list[tuple[str, bytes]]:
    lf = REALISTIC_LF
    crlf = lf.replace(b"\n", b"\r\n")
    cr = lf.replace(b"\n", b"\r")
    # mixed: alternate line endings event by event
    mixed_parts = []
    for i, block in enumerate(lf.split(b"\n\n")):
        eol = EOLS[i % 3]
        mixed_parts.append(block.replace(b"\n", eol))
    mixed = (b"\r\n\r\n").join(mixed_parts)
    return [("lf", lf), ("crlf", crlf), ("cr", cr), ("mixed", mixed)]


VARIANTS = _variants()


@pytest.mark.parametrize(("label", "stream"), VARIANTS, ids=[v[0] for v in VARIANTS])
def test_realistic_stream_every_single_cut(label: str, stream: bytes) -> None:
    for i in range(len(stream) + 1):
        events, splitter = feed_chunks([stream[:i], stream[i:]])
        check_against_reference(stream, events, splitter)


@pytest.mark.parametrize(("label", "stream"), VARIANTS, ids=[v[0] for v in VARIANTS])
def test_realistic_stream_byte_by_byte(label: str, stream: bytes) -> None:
    splitter = SSESplitter()
    events: list[Event] = []
    for i in range(len(stream)):
        events.extend(splitter.feed(stream[i : i + 1]))
    check_against_reference(stream, events, splitter)
    assert splitter.pending == b"data: unterminated tail"


def test_realistic_stream_fields() -> None:
    events, splitter = feed_chunks([REALISTIC_LF])
    got = [(e.name, e.data) for e in events]
    assert got == [
        (None, None),  # ": keepalive"
        (
            None,
            '{"id":"chatcmpl-1","object":"chat.completion.chunk","choices":[{"index":0,'
            '"delta":{"role":"assistant","content":""},"finish_reason":null}]}',
        ),
        (None, '{"choices":[{"index":0,"delta":{"content":"héllo ✓ 😀"}}]}'),
        (
            "content_block_delta",
            '{"type":"content_block_delta","index":0,"delta":{"type":"text_delta","text":"x"}}',
        ),
        ("ping", '{"type": "ping"}'),
        (None, "line one\nline two\n\n"),
        ("empty", ""),
        ("", None),
        (None, None),
        (None, "[DONE]"),
    ]
    assert events[0].is_comment and events[-3].is_comment is False
    assert events[-2].is_comment
    assert splitter.pending == b"data: unterminated tail"
    # each raw ends with its terminating blank line
    assert all(e.raw.endswith(b"\n\n") for e in events)


# ---------------------------------------------------------------------------
# CR / CRLF edge cases across chunk boundaries


def test_cr_at_chunk_end_then_lf_in_next_chunk_is_one_crlf() -> None:
    splitter = SSESplitter()
    assert splitter.feed(b"data: a\r") == []
    assert splitter.feed(b"\n\r") == []  # "\r" could still be half of "\r\n"
    (event,) = splitter.feed(b"\n")
    assert event.raw == b"data: a\r\n\r\n"
    assert event.data == "a"
    assert splitter.pending == b""


def test_blank_line_cr_at_chunk_end_waits_for_next_byte() -> None:
    splitter = SSESplitter()
    assert splitter.feed(b"data: a\r\n\r") == []
    assert splitter.pending == b"data: a\r\n\r"
    (event,) = splitter.feed(b"\n")
    assert event.raw == b"data: a\r\n\r\n"
    assert splitter.pending == b""


def test_cr_only_event_completes_when_next_byte_is_not_lf() -> None:
    splitter = SSESplitter()
    assert splitter.feed(b"data: a\r\r") == []
    (event,) = splitter.feed(b"d")
    assert event.raw == b"data: a\r\r"
    assert event.data == "a"
    assert splitter.pending == b"d"


def test_crlf_split_between_every_pair_of_chunks() -> None:
    stream = b"event: x\r\ndata: 1\r\n\r\ndata: 2\r\n\r\n"
    for i in range(len(stream) + 1):
        for j in range(i, len(stream) + 1):
            events, splitter = feed_chunks([stream[:i], stream[i:j], stream[j:]])
            assert [e.raw for e in events] == [b"event: x\r\ndata: 1\r\n\r\n", b"data: 2\r\n\r\n"]
            assert [(e.name, e.data) for e in events] == [("x", "1"), (None, "2")]
            assert splitter.pending == b""


def test_lf_stream_after_a_crlf_chunk() -> None:
    """Mixed endings across chunks: a CRLF chunk, then the fast LF path."""
    splitter = SSESplitter()
    first = splitter.feed(b"data: a\r\n\r\ndata: b\n")
    assert [e.data for e in first] == ["a"]
    second = splitter.feed(b"\ndata: c\n\n")
    assert [e.data for e in second] == ["b", "c"]
    assert b"".join(e.raw for e in [*first, *second]) == (b"data: a\r\n\r\ndata: b\n\ndata: c\n\n")


# ---------------------------------------------------------------------------
# Field parsing details


@pytest.mark.parametrize(
    ("block", "name", "data"),
    [
        (b"data: x\n\n", None, "x"),
        (b"data:x\n\n", None, "x"),
        (b"data:  x\n\n", None, " x"),  # only one leading space is removed
        (b"data\n\n", None, ""),
        (b"data:\n\n", None, ""),
        (b"data: a\ndata: b\n\n", None, "a\nb"),
        (b"data: a:b:c\n\n", None, "a:b:c"),
        (b"event: x\nevent: y\ndata: 1\n\n", "y", "1"),  # last event: wins
        (b"event: only\n\n", "only", None),
        (b": comment\n\n", None, None),
        (b"id: 1\nretry: 5\n\n", None, None),
        (b"Data: nope\n\n", None, None),  # field names are case-sensitive
        (b" data: nope\n\n", None, None),
        (b"data: \xe2\x82\xac\n\n", None, "€"),
        (b'data: {"a": "\\u00e9"}\n\n', None, '{"a": "\\u00e9"}'),
    ],
)
def test_field_parsing(block: bytes, name: str | None, data: str | None) -> None:
    (event,) = SSESplitter().feed(block)
    assert (event.name, event.data) == (name, data)
    assert event.raw == block
    assert event.is_comment == (name is None and data is None)


def test_invalid_utf8_is_replaced_not_raised() -> None:
    (event,) = SSESplitter().feed(b"data: \xff\xfe\n\n")
    assert event.data == "\ufffd\ufffd"
    assert event.raw == b"data: \xff\xfe\n\n"


def test_multibyte_char_split_across_chunks() -> None:
    stream = "data: 😀é\n\n".encode()
    for i in range(len(stream) + 1):
        events, _ = feed_chunks([stream[:i], stream[i:]])
        assert [e.data for e in events] == ["😀é"]


@pytest.mark.parametrize("cut_at", range(0, 12))
def test_utf8_bom_is_kept_in_raw_and_ignored_in_fields(cut_at: int) -> None:
    stream = b"\xef\xbb\xbfevent: e\ndata: 1\n\ndata: 2\n\n"
    events, splitter = feed_chunks([stream[:cut_at], stream[cut_at:]])
    assert b"".join(e.raw for e in events) == stream
    assert [(e.name, e.data) for e in events] == [("e", "1"), (None, "2")]
    assert splitter.pending == b""


def test_bom_byte_by_byte() -> None:
    stream = b"\xef\xbb\xbfdata: 1\r\n\r\n"
    events, _ = feed_chunks([stream[i : i + 1] for i in range(len(stream))])
    assert [e.raw for e in events] == [stream]
    assert events[0].data == "1"


def test_pending_and_empty_feeds() -> None:
    splitter = SSESplitter()
    assert splitter.pending == b""
    assert splitter.feed(b"") == []
    assert splitter.feed(b"data: par") == []
    assert splitter.pending == b"data: par"
    assert splitter.feed(b"") == []
    assert splitter.pending == b"data: par"
    (event,) = splitter.feed(b"tial\n\n")
    assert event.data == "partial"
    assert splitter.pending == b""


def test_many_events_in_one_chunk_keep_order() -> None:
    stream = b"".join(f"data: {i}\n\n".encode() for i in range(500))
    events, splitter = feed_chunks([stream])
    assert [e.data for e in events] == [str(i) for i in range(500)]
    assert splitter.pending == b""


@pytest.mark.parametrize(
    "stream",
    [
        b"data: a\n\n\n",
        b"data: a\n\n\n\n\n",
        b"data: a\r\n\r\n\r\n",
        b"data: a\r\n\r\n\n",
        b"\n",
        b"\n\n\n",
    ],
)
def test_trailing_blank_lines_are_not_an_unterminated_event(stream: bytes) -> None:
    """Regression: the LF fast path left trailing blank lines in ``pending``.

    The relay hands ``pending`` to ``Ledger.ended(leftover)``, so a generic SSE
    stream ending with an extra blank line was reported as truncated.
    """
    for i in range(len(stream) + 1):
        events, splitter = feed_chunks([stream[:i], stream[i:]])
        assert splitter.pending == b""
        assert b"".join(e.raw for e in events) == stream
        assert [e.data for e in events if significant(e.raw)] == (["a"] if b"a" in stream else [])


# ---------------------------------------------------------------------------
# Cost: linear in the event size (issue 10: a 50 MB line cost 14.8 s)


def _split_seconds(size: int, tries: int = 3) -> float:
    import time

    body = b"y" * size
    best = float("inf")
    for _ in range(tries):
        splitter = SSESplitter(max_event_bytes=size + 64)
        # this process's CPU time, not the wall clock: on a loaded machine the wall
        # clock counts other processes' turns (a CI run measured 0.01 s against 0.28 s)
        t0 = time.process_time()
        splitter.feed(b"data: ")
        for i in range(0, size, 65536):
            splitter.feed(body[i : i + 65536])
        (event,) = splitter.feed(b"\r\n\r\n")
        best = min(best, time.process_time() - t0)
        assert len(event.raw) == size + 10
    return best


def test_one_huge_event_costs_linear_time() -> None:
    """8x the bytes may cost about 8x the time, never the 64x of a quadratic scan.

    The bound sits between the two (a CI run under load measured 25x: a large body's
    copies miss the caches more, and the small run's few milliseconds are the noisier
    figure, so it takes the best of more tries)."""
    small, large = _split_seconds(4 << 20, tries=7), _split_seconds(32 << 20)
    assert large / small < 40, (small, large)
    assert large < 5.0  # the old splitter needed ~10 s for 32 MB here
