"""Incremental, byte-exact Server-Sent Events splitter (sans-IO).

Feed it upstream chunks cut at arbitrary boundaries; it yields one `Event` per
complete SSE event, holding the event's exact raw bytes (including the blank
line that ends it) so the relay can forward them unchanged.

Per the SSE spec (HTML Living Standard, 9.2.6) a line ends with CRLF, LF or CR
and an event ends at an empty line.  Lines starting with ``:`` are comments.
A trailing CR at the end of a chunk is ambiguous (it may be the first half of
CRLF), so the splitter waits for the next byte before deciding.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Event", "SSESplitter"]


@dataclass(slots=True)
class Event:
    """One SSE event: its exact bytes, its ``event:`` name and joined ``data:``."""

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
    """

    __slots__ = ("_bom_checked", "_buf")

    def __init__(self) -> None:
        self._buf = b""
        self._bom_checked = False

    @property
    def pending(self) -> bytes:
        return self._buf

    def feed(self, chunk: bytes) -> list[Event]:
        buf = self._buf + chunk if self._buf else chunk
        if not self._bom_checked and buf:
            # A UTF-8 BOM may precede the first field; keep it in the raw bytes.
            if len(buf) < 3 and b"\xef\xbb\xbf".startswith(buf):
                self._buf = buf
                return []
            self._bom_checked = True
        events: list[Event] = []
        if b"\r" not in buf:
            # Fast path: LF-only line endings, the overwhelmingly common case.
            start = 0
            while True:
                end = buf.find(b"\n\n", start)
                if end < 0:
                    break
                # Leading blank lines between events belong to the next event's raw
                # bytes only if they are not the terminator; "\n\n" at start means an
                # empty line preceded by nothing: skip empty blocks as separators.
                stop = end + 2
                block = buf[start:end]
                events.append(self._event(buf[start:stop], block))
                start = stop
            rest = buf[start:]
            if rest and not rest.strip(b"\n"):
                # Only blank lines: each one dispatches an empty event (no fields).
                events.append(Event(rest, None, None))
                rest = b""
            self._buf = rest
            return events
        return self._feed_general(buf, events)

    def _feed_general(self, buf: bytes, events: list[Event]) -> list[Event]:
        """Line-by-line scan that handles CRLF, CR and LF endings."""
        start = 0  # start of the current event
        pos = 0  # start of the current line
        n = len(buf)
        while pos < n:
            # find end of the line starting at pos
            i = pos
            while i < n and buf[i] != 0x0A and buf[i] != 0x0D:
                i += 1
            if i >= n:
                break  # incomplete line
            if buf[i] == 0x0D:
                if i + 1 >= n:
                    break  # lone CR at the end: could be half of CRLF; wait
                nxt = i + 2 if buf[i + 1] == 0x0A else i + 1
            else:
                nxt = i + 1
            if i == pos:  # empty line: the event ends here
                events.append(self._event(buf[start:nxt], buf[start:pos]))
                start = nxt
            pos = nxt
        self._buf = buf[start:]
        return events

    @staticmethod
    def _event(raw: bytes, block: bytes) -> Event:
        # Fast paths for the two shapes providers send: one `data:` line (Chat
        # Completions), and `event:` + `data:` (Responses, Anthropic).
        if block.startswith(b"data: ") and b"\n" not in block and b"\r" not in block:
            return Event(raw, None, block[6:].decode("utf-8", "replace"))
        if block.startswith(b"event: "):
            nl = block.find(b"\n")
            if (
                nl > 0
                and block.startswith(b"data: ", nl + 1)
                and b"\n" not in block[nl + 1 :]
                and b"\r" not in block
            ):
                return Event(
                    raw,
                    block[7:nl].decode("utf-8", "replace"),
                    block[nl + 7 :].decode("utf-8", "replace"),
                )
        if block.startswith(b"\xef\xbb\xbf"):
            block = block[3:]
        name, data = _parse_fields(block)
        return Event(raw, name, data)
