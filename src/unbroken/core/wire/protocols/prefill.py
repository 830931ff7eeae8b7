"""Continuation by prefill: what both prefill strategies share (sans-IO).

A stream cut after commit can be finished in place when the provider continues a
text from an assistant prefix (Anthropic Messages: an assistant message last;
Chat Completions: an assistant message with ``prefix: true`` or ``partial: true``,
where a provider documents it).  Each protocol's module (`anthropic_prefill`,
`chat_prefix`) reads what the client has from the bytes unbroken *released* (never
from what it received), refuses with a typed `PrefillRefusal` when the join cannot be
proved, builds the continuation request, and splices the continuation's frames
into the client's stream.  This module holds what they share: the refusals, the
bound on what is read back, and the text join (`TextJoin`).

The join rule
=============
The prefill is the committed text with its trailing whitespace ``W`` trimmed (the
Messages API refuses a final assistant message that ends in whitespace, and a
model continues a word better without it).  The client has already seen ``W``.
The continuation begins with some whitespace ``K`` (maybe none), then the rest:

* leading whitespace-only deltas are held until the first non-whitespace
  character (or the end of the join: a non-text frame, the stream's stop);
* the longest common prefix of ``W`` and ``K`` is dropped (the model wrote again
  the whitespace that was trimmed: the client already has it), the rest of ``K``
  is sent, then the text;
* so ``W`` is never sent twice, nothing of the continuation but whitespace the
  client already has at that position is dropped, and a continuation that adds
  whitespace (a paragraph break after a trimmed space) keeps it.

With an *echo* (``echo``: the prefix sent, for a provider whose answer starts with
the prefix), the answer must begin with exactly that prefix, which is dropped
first; an answer that does not raises `JoinError` (never a guess: the turn then
ends with the native error).

An unwanted echo (``tail``: the text the continuation continues) is refused, never
guessed away: a continuation whose text begins, glued to the client's, with the
whole prefill or with its end from a word's start, with or without the whitespace
before that word (``Hello wor`` continued by ``world``, `` wor…`` or ``Hello
world``), would show that text twice.  Whether it is an echo or the model's own
words cannot be proved, so the splice is refused (`JoinError`: the native,
retryable error), not stripped.  The continuation's text is held while it may
still be such a repeat (at most the prefill's length, usually a few characters); a
continuation that starts with anything else is no repeat.  A legitimate
continuation refused this way (``no`` then `` no``) costs the native retryable
error, never a duplicate.  The candidates (`echo_tails`) are the whole prefill and
its suffixes from its last `TAIL_WORDS` word starts.
"""

from __future__ import annotations

import enum

from unbroken.core.wire.sse import Event, EventTooLarge, SSESplitter

__all__ = [
    "MAX_COMMITTED_BYTES",
    "TAIL_WORDS",
    "JoinError",
    "PrefillRefusal",
    "TextJoin",
    "echo_tails",
    "reconcile",
    "released_events",
    "split_trailing_ws",
]

#: Released bytes read back to build a continuation, at most (beyond: refused)
MAX_COMMITTED_BYTES = 8 * 1024 * 1024
#: word starts from the prefill's end whose suffix, repeated, is an unwanted echo
TAIL_WORDS = 64


class JoinError(ValueError):
    """A continuation does not continue what the client has (the join is broken)."""


class PrefillRefusal(enum.StrEnum):
    """Why a turn cut after commit is not continued by prefill (it ends as today)."""

    NOT_STREAMED = "not_streamed"  # a non-streamed request: its body has no frames to splice
    BAD_REQUEST = "bad_request"  # the request is not a JSON object with a list of messages
    THINKING_ENABLED = "thinking_enabled"  # the request enables thinking: no prefill with it
    CLIENT_PREFILL = "client_prefill"  # the client's own last assistant message is not plain text
    FORCED_TOOL = "forced_tool"  # the request forces a tool call (the provider prefills it)
    TOOL_CALL = "tool_call"  # a tool call was started: its arguments cannot be continued
    THINKING = "thinking"  # thinking or reasoning was released: it cannot be prefilled
    SERVER_TOOL = "server_tool"  # a server-side tool block was released
    OTHER_CONTENT = "other_content"  # a block, delta or field the rule does not know
    STOP_RELEASED = "stop_released"  # the stop reason already reached the client
    CHOICES = "choices"  # Chat: more than one choice
    MALFORMED = "malformed"  # the released bytes do not read back as the protocol's frames
    TOO_LARGE = "too_large"  # more than MAX_COMMITTED_BYTES were released
    NO_OPTION = "no_option"  # Chat: the route names no documented prefix mechanism


def split_trailing_ws(text: str) -> tuple[str, str]:
    """``(text without its trailing whitespace, that whitespace)``."""
    stripped = text.rstrip()
    return stripped, text[len(stripped) :]


def reconcile(shown: str, leading: str) -> str:
    """The part of a continuation's leading whitespace ``leading`` to send after the
    client has seen ``shown`` (the trimmed whitespace): without their common prefix."""
    n = 0
    limit = min(len(shown), len(leading))
    while n < limit and shown[n] == leading[n]:
        n += 1
    return leading[n:]


def echo_tails(prefill: str) -> tuple[str, ...]:
    """The texts whose repeat at the join is an unwanted echo: the whole prefill and
    its suffixes from its last `TAIL_WORDS` word starts, each with and without the
    whitespace before it (longest first).  A continuation whose text starts with one
    of them, or is a start of one and ends there, is refused."""
    if not prefill:
        return ()
    starts: list[int] = []
    words = 0
    i = len(prefill) - 1
    while i >= 0 and words < TAIL_WORDS:
        if not prefill[i].isspace() and (i == 0 or prefill[i - 1].isspace()):
            words += 1
            starts.append(i)
            j = i
            while j > 0 and prefill[j - 1].isspace():
                j -= 1
            if j < i:
                starts.append(j)
        i -= 1
    tails = [prefill[k:] for k in sorted(set(starts))]
    if not tails or tails[0] != prefill:
        tails.insert(0, prefill)
    return tuple(tails)


class TextJoin:
    """The text at the join, piece by piece: `text` returns what to send now (maybe
    ""); `flush` decides with what is held when no more text comes at the join."""

    __slots__ = ("_buf", "_echo", "_tails", "done", "shown")

    def __init__(self, shown: str, echo: str = "", tail: str = "") -> None:
        #: the trailing whitespace the client has already seen
        self.shown = shown
        self._echo = echo
        #: what a repeat of is an unwanted echo (checked until ruled out)
        self._tails = echo_tails(tail)
        self._buf = ""
        #: the join is decided: text passes as it is
        self.done = False

    def _repeat(self, buf: str) -> bool:
        """Whether ``buf`` may still be a repeat of the prefill's end (hold it); raises
        `JoinError` when it is one."""
        if not self._tails:
            return False
        if not buf:
            return True
        may = False
        for tail in self._tails:
            if buf.startswith(tail):
                raise JoinError("the continuation repeats the end of the text the client has")
            if tail.startswith(buf):
                may = True
        if not may:
            self._tails = ()  # ruled out: no repeat
        return may

    def text(self, piece: str) -> str:
        if self.done:
            return piece
        buf = self._buf + piece
        echo = self._echo
        if echo:
            if len(buf) < len(echo) and echo.startswith(buf):
                self._buf = buf
                return ""  # the echoed prefix, so far
            if not buf.startswith(echo):
                raise JoinError("the answer does not begin with the prefix it must repeat")
            buf = buf[len(echo) :]
            self._echo = ""
        if self._repeat(buf):
            self._buf = buf
            return ""  # maybe the prefill's end again: held until decided
        rest = buf.lstrip()
        if not rest:
            self._buf = buf
            return ""  # whitespace only so far: held until decided
        self.done = True
        self._buf = ""
        return reconcile(self.shown, buf[: len(buf) - len(rest)]) + rest

    def flush(self) -> str:
        if self.done:
            return ""
        buf, self._buf = self._buf, ""
        self.done = True
        if self._echo:
            raise JoinError("the answer ended before it repeated the prefix")
        if buf.strip() and self._tails:
            # (held: the start of a repeat the continuation did not finish)
            raise JoinError("the continuation's text ends inside a repeat of the client's")
        rest = buf.lstrip()
        return reconcile(self.shown, buf[: len(buf) - len(rest)]) + rest


def released_events(released: bytes) -> list[Event] | PrefillRefusal:
    """The frames released to the client, read back (bounded): what a continuation is
    built from.  Released bytes always end with a whole frame."""
    if len(released) > MAX_COMMITTED_BYTES:
        return PrefillRefusal.TOO_LARGE
    splitter = SSESplitter(MAX_COMMITTED_BYTES + 1)
    try:
        events = splitter.feed(released)
    except EventTooLarge:
        return PrefillRefusal.TOO_LARGE
    if splitter.pending.strip():
        return PrefillRefusal.MALFORMED
    return events
