"""Incremental, byte-exact Server-Sent Events splitter (sans-IO).

Feed it upstream chunks cut at arbitrary boundaries; it yields one `Event` per
complete SSE event, holding the event's exact raw bytes (including the blank
line that ends it) so the relay can forward them unchanged.

Per the SSE spec (HTML Living Standard, 9.2.6) a line ends with CRLF, LF or CR
and an event ends at an empty line.  Lines starting with ``:`` are comments.
A trailing CR at the end of a chunk is ambiguous (it may be the first half of
CRLF), so the splitter waits for the next byte before deciding.

Cost is linear in the bytes fed, however the stream is chunked: the pending
bytes live in one growing buffer, and the search for the end of an event
resumes where the previous chunk's search stopped.  An event that grows past
``max_event_bytes`` raises `EventTooLarge`.
"""

from __future__ import annotations

import msgspec

__all__ = ["DEFAULT_MAX_EVENT_BYTES", "Event", "EventTooLarge", "SSESplitter"]

#: ``[stream] max_event_bytes`` by default: 16 MiB.
DEFAULT_MAX_EVENT_BYTES = 16 * 1024 * 1024
_BOM = b"\xef\xbb\xbf"
# Single bytes are looked for as ints (``CR in data``): CPython's ``bytes in bytes``
# first tries the needle as an int and builds (then drops) a TypeError for a bytes
# one, about 7x the cost of the search itself on a frame-sized chunk.
CR = 0x0D
LF = 0x0A


class EventTooLarge(ValueError):
    """One SSE event (terminated or still pending) is larger than the limit.

    ``events`` are the complete events the same ``feed`` call found before the
    oversized one: they are valid and come first.  The splitter is unusable
    afterwards (every later ``feed`` raises again); the attempt has failed.
    """

    def __init__(self, size: int, limit: int, events: list[Event] | None = None) -> None:
        super().__init__(f"an SSE event exceeds stream.max_event_bytes ({size} > {limit} bytes)")
        self.size = size
        self.limit = limit
        self.events: list[Event] = events if events is not None else []


class Event(msgspec.Struct, gc=False):
    """One SSE event: its exact bytes, its ``event:`` name and joined ``data:``.

    A msgspec Struct, not a dataclass: the same fields, equality and repr, made by a C
    ``__init__`` (about 800 instructions, against 2,000 for a slotted dataclass's
    Python one; a splitter makes one a frame).  Its fields hold no container.
    """

    raw: bytes
    name: str | None
    data: str | None

    @property
    def is_comment(self) -> bool:
        """True when the event carries no field at all (only comments)."""
        return self.name is None and self.data is None


def _parse_fields(block: bytes) -> tuple[str | None, str | None]:
    """Return (event name, joined data) of one event block (without its terminator)."""
    name: str | None = None
    data: list[str] | None = None
    for line in block.splitlines():
        if not line or line[0] == 0x3A:  # ':' comment
            continue
        field, sep, value = line.partition(b":")
        if sep and value[:1] == b" ":
            value = value[1:]
        if field == b"data":
            if data is None:
                data = []
            data.append(value.decode("utf-8", "replace"))
        elif field == b"event":
            name = value.decode("utf-8", "replace")
    return name, None if data is None else "\n".join(data)


class SSESplitter:
    """Split a byte stream into SSE events, preserving every byte.

    ``feed`` returns the events completed by the chunk.  ``pending`` holds the
    bytes of an event not yet terminated; a stream that ends while
    ``pending`` is non-empty was cut mid-event.

    An event ends at its first empty line.  Blank lines between events are
    events of their own, with no field (``is_comment``).  A line ends where a
    terminator byte (CR or LF) is followed by the next line, so an empty line
    starts wherever a terminator byte follows the end of a line: right after
    LF (``\\n\\n``, ``\\n\\r``), right after a lone CR (``\\r\\r``), or at
    the very start of an event.
    """

    __slots__ = (
        "_bom_checked",
        "_buf",
        "_cr",
        "_failed",
        "_line0",
        "_scan",
        "idle",
        "max_event_bytes",
    )

    def __init__(self, max_event_bytes: int = DEFAULT_MAX_EVENT_BYTES) -> None:
        self._buf = bytearray()  # the pending event's bytes (everything before is emitted)
        self._scan = 0  # where the search for the pending event's end resumes
        self._line0 = 0  # where its first line starts (3 after a stream-start BOM, else 0)
        self._cr = False  # the pending bytes may hold a CR
        self._bom_checked = False
        self._failed = False
        #: at an event boundary, past the stream start: the next byte starts an event
        #: (kept as a field, not computed: the per-chunk fast path reads it every chunk)
        self.idle = False
        self.max_event_bytes = max_event_bytes

    @property
    def pending(self) -> bytes:
        return bytes(self._buf)

    def feed(self, chunk: bytes) -> list[Event]:
        if self.idle or (
            # the stream's start, no BOM: as idle once the BOM check below is done
            not self._bom_checked and not self._buf and chunk[:3] != _BOM[: len(chunk)]
        ):
            # Nothing pending, at an event boundary: a chunk that is one whole event
            # (its first blank line is its end; no CR; no leading blank line) is that
            # event, as the loop below would find it, and leaves the state as it was
            # (the HTTP transport feeds a turn's first frames one at a time).
            n = len(chunk)
            if (
                n > 2
                and chunk.find(b"\n\n") == n - 2
                and n <= self.max_event_bytes
                and chunk[0] != LF
                and CR not in chunk
            ):
                self._bom_checked = self.idle = True
                return [self._parse(chunk, chunk[:-2])]
        if self._failed:
            raise EventTooLarge(len(self._buf), self.max_event_bytes)
        buf = self._buf
        data: bytes | bytearray
        if buf:
            buf += chunk
            data = buf
            has_cr = self._cr or CR in chunk
        else:
            data = chunk  # nothing pending: work on the chunk itself, no copy
            has_cr = CR in chunk
        if not self._bom_checked and data:
            # A UTF-8 BOM may precede the first field; keep it in the raw bytes.
            if len(data) < 3 and _BOM.startswith(data):
                self._buf = bytearray(data)
                return []
            self._bom_checked = True
            if data.startswith(_BOM):
                self._line0 = self._scan = 3
        events: list[Event] = []
        n = len(data)
        start = 0  # start of the current event in data
        line0, scan = self._line0, self._scan
        limit = self.max_event_bytes
        parse = self._parse
        while line0 < n:
            # An empty line ends the event.  It starts at the event's first line
            # (line0), or right after a line's end: after LF ("\n\n", "\n\r"), or
            # after a lone CR ("\r\r").  ``block_end``: end of the last field line.
            first = data[line0]
            if first == 0x0A:
                end, block_end = line0 + 1, line0
            elif first == 0x0D:
                if line0 + 1 >= n:
                    break  # a CR as the last byte: CR or the first half of CRLF?
                block_end = line0
                end = line0 + 2 if data[line0 + 1] == 0x0A else line0 + 1
            else:
                if scan < line0:
                    scan = line0
                hit = data.find(b"\n\n", scan)
                if has_cr:
                    # Bound the other searches by the earliest hit so far: every
                    # byte is looked at a fixed number of times per event.
                    bound = n if hit < 0 else hit + 1
                    other = data.find(b"\n\r", scan, bound)
                    if other >= 0:
                        hit = bound = other
                    other = data.find(b"\r\r", scan, bound)
                    if other >= 0:
                        hit = other
                if hit < 0:
                    scan = n - 1 if n > scan else scan  # the last byte may start a pattern
                    break
                block_end = hit
                if has_cr and hit > line0 and data[hit - 1] == 0x0D:
                    block_end = hit - 1  # the last field line ended with CRLF
                p = hit + 1  # the empty line
                if data[p] == 0x0A:
                    end = p + 1
                elif p + 1 >= n:
                    scan = hit  # undecided CR: look again once the next byte is in
                    break
                else:
                    end = p + 2 if data[p + 1] == 0x0A else p + 1
            if end - start > limit:
                self._fail(end - start, events)
            if data is chunk:
                raw = chunk[start:end] if start or end < n else chunk
            else:
                raw = bytes(buf) if not start and end == n else bytes(buf[start:end])
            events.append(parse(raw, raw[line0 - start : block_end - start]))
            start = line0 = scan = end
        # Keep what is left: the start of the next event.
        if data is buf:
            if start:
                del buf[:start]
        else:
            self._buf = bytearray(data[start:]) if start < n else bytearray()
            buf = self._buf
        self._line0, self._scan = line0 - start, scan - start
        if start:
            self._cr = has_cr and CR in buf  # a short tail: a cheap look
        else:
            self._cr = has_cr
        if len(buf) > limit:
            self._fail(len(buf), events)
        self.idle = not buf and self._bom_checked and not self._cr
        return events

    def _fail(self, size: int, events: list[Event]) -> None:
        self._failed = True
        self.idle = False
        self._buf = bytearray()
        raise EventTooLarge(size, self.max_event_bytes, events)

    @staticmethod
    def _parse(raw: bytes, block: bytes) -> Event:
        # Fast paths for the two shapes providers send: one `data:` line (Chat
        # Completions), and `event:` + `data:` (Responses, Anthropic).
        if block.startswith(b"data: ") and LF not in block and CR not in block:
            return Event(raw, None, block[6:].decode("utf-8", "replace"))
        if block.startswith(b"event: "):
            nl = block.find(b"\n")
            if (
                nl > 0
                and block.startswith(b"data: ", nl + 1)
                and LF not in block[nl + 1 :]
                and CR not in block
            ):
                return Event(
                    raw,
                    block[7:nl].decode("utf-8", "replace"),
                    block[nl + 7 :].decode("utf-8", "replace"),
                )
        name, data = _parse_fields(block)
        return Event(raw, name, data)
