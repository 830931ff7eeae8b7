"""Finishing a turn in place after commit: the generic continuation interface (sans-IO).

Theory of operation
===================
After output reached the client a turn is never replayed (`core.turn.ledger`).  With
``[stream] after_commit = "continue"`` (globally, or per route) a cut stream may
still be *finished in place*, by a mechanism that provably adds no duplicate and
loses nothing: a provider's own resume cursor (`core.turn.background`: OpenAI
Responses background mode and ``starting_after``), or a continuation whose join
is checked (the Anthropic prefill continuation plugs in here the same way).

A protocol offers this through a `Strategy`, one per turn.  The turn machine
(`core.turn`) asks it at every point where a failure would end the turn (a cut
body, a reset, a stall; never a provider's own error event, never a malformed
frame): `Strategy.plan` answers a `Resume` (the request that continues the
stream) or a typed `Refusal` (why it cannot; the turn then ends exactly as it
would with the default setting).  The machine paces the `Resume` like any retry
and feeds the new attempt's frames through the strategy's `Splicer` before the
turn's one ledger: the splicer checks the join (and may absorb or rewrite frames)
and raises `JoinBroken` when the continuation is not the continuation of what
the client saw.  A broken join ends the turn with the native error: never
spliced garbage.

The number of splices a turn may make is bounded (``[stream] max_splices``).
Resources the provider keeps for a continuation (a background response) and
that nobody will read are named by `Strategy.abandon` as `Cancel` requests the
transport sends (best effort) when the turn is over or gives the response up.

`ContinuationMemory` remembers, per upstream, that it refused the mechanism (a
backend or proxy that rejects ``background``): later turns to it end as today.  A
refusal is known by its wording (an error naming ``background``), or structurally: a
400/422 to the patched request is retried once as the client sent it, and if that
succeeds the 400 was the refusal (`Strategy.answered`).
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol as TypingProtocol

from unbroken.core.turn.ledger import Ledger
from unbroken.core.wire.protocols.prefill import PrefillRefusal
from unbroken.core.wire.sse import Event

__all__ = [
    "AFTER_COMMIT_CHOICES",
    "DEFAULT_MAX_SPLICES",
    "DEFAULT_QUEUED_S",
    "AfterCommit",
    "Cancel",
    "ContinuationMemory",
    "JoinBroken",
    "Refusal",
    "Resume",
    "Splicer",
    "Strategy",
]


class AfterCommit(enum.StrEnum):
    """``[stream] after_commit``: what a cut after commit does."""

    ERROR = "error"  # the native retryable error (or the profile's reset): the default
    CONTINUE = "continue"  # finish the turn in place when a Strategy can


AFTER_COMMIT_CHOICES: tuple[str, ...] = tuple(a.value for a in AfterCommit)
#: ``[stream] max_splices``: the continuations one turn may make
DEFAULT_MAX_SPLICES = 32
#: ``[stream] resume_queued_s``: a continuation that shows no progress this long
#: (a background response stuck in ``queued``) is given up (and cancelled)
DEFAULT_QUEUED_S = 30.0


class Refusal(enum.StrEnum):
    """Why a cut turn is not finished in place (docs/gate.md, "Continuation")."""

    #: the cut was a provider's own error or a malformed frame: the response failed
    NOT_A_CUT = "not_a_cut"
    #: nothing identifies what to continue (a cut before ``response.created``)
    NO_HANDLE = "no_handle"
    #: no sequence number to continue after (the frames fed carried none)
    NO_CURSOR = "no_cursor"
    #: the first request was not made resumable (the upstream refused it before)
    NOT_RESUMABLE = "not_resumable"
    #: the turn made ``max_splices`` continuations already
    LIMIT = "limit"
    #: the continuation did not join (404/400, another id, events going backwards)
    JOIN = "join"
    #: the continuation made no progress within the bound (stuck in ``queued``)
    QUEUED = "queued"
    #: the turn's protocol (or body) has no continuation the relay can check: Gemini, a
    #: Responses body the relay cannot patch (encoded, or background asked by the client)
    UNSUPPORTED = "unsupported"


class JoinBroken(Exception):
    """A continuation's frame does not continue what the client saw."""


@dataclass(frozen=True, slots=True)
class Resume:
    """Open a continuation on ``upstream``: ``method`` ``path`` (relative to the
    upstream's base URL) ``?query``, ``body``; the original request's headers with
    ``set_headers`` set and ``drop_headers`` removed (credentials as for any attempt)."""

    upstream: int
    method: str
    path: str
    query: str
    body: bytes
    set_headers: tuple[tuple[str, str], ...]
    drop_headers: tuple[str, ...]
    timeout_s: float


@dataclass(frozen=True, slots=True)
class Cancel:
    """Best effort: ``method`` ``path`` on ``upstream`` frees what nobody will read."""

    upstream: int
    method: str
    path: str


class Splicer(TypingProtocol):
    """Checks one continuation attempt's frames before the turn's ledger."""

    @property
    def progressed(self) -> bool:
        """A frame that moves the response on arrived (not only ``queued``/keepalives)."""

    def splice(self, event: Event) -> Event | Sequence[Event] | None:
        """The frame to feed the ledger (``event`` or a rewrite), None to absorb it, or
        the frames to feed in its place, in order (a prefill splice closes a block and
        opens the next, or sends held whitespace before a stop); raises `JoinBroken`
        when the continuation does not join."""


class Strategy(TypingProtocol):
    """A protocol's way to finish a cut turn in place (one object per turn)."""

    #: the mechanism's name (metrics, `ContinuationMemory`)
    name: str
    #: the continuations made so far (`plan` counts them; at most ``max_splices``)
    splices: int
    #: the strategy reads back what the turn released (`released`): a prefill
    #: continuation builds its request from what the client has
    wants_released: bool
    #: a provider's retryable error event after commit (``overloaded_error``) is a cut
    #: it may continue: a prefill continuation is a new request for the rest; a resume
    #: of the same response (background mode) would only replay the failure
    continues_errors: bool

    def released(self, data: bytes) -> None:
        """Bytes the turn released to the client, in order (only if ``wants_released``)."""

    def rewind(self) -> Sequence[Event] | None:
        """The continuation `plan` just returned restarts from what the client has (a
        prefill): the frames released so far, which the ledger reads back (dropping
        what it held); None: the stream goes on exactly where it was cut."""

    def refused(self, upstream: int, status: int, body: bytes) -> bool:
        """A final 4xx answer to a rewritten request: whether it refuses the mechanism
        (then remembered; the turn retries with the client's request)."""

    def answered(self, upstream: int, status: int) -> None:
        """A fresh attempt on ``upstream`` that went as the client sent it was answered
        2xx (after a 4xx to the patched request: that 4xx refused the mechanism)."""

    def plan(
        self, upstream: int, ledger: Ledger, timeout_s: float
    ) -> Resume | Refusal | PrefillRefusal:
        """The attempt on ``upstream`` was cut: how to continue it, or why not (a prefill
        continuation's refusals are `protocols.prefill.PrefillRefusal`)."""

    def body_patch(self, upstream: int) -> tuple[tuple[str, object], ...]:
        """Top-level JSON keys a fresh attempt on ``upstream`` sets in the request body
        (empty: the client's bytes go as they are)."""

    def splicer(self) -> Splicer:
        """The join check for the continuation `plan` just returned."""

    def abandon(self, upstream: int, ledger: Ledger) -> Sequence[Cancel]:
        """The attempt on ``upstream`` is given up (a replay, an end, the client gone):
        the provider resources nobody will read now (each named once)."""

    @property
    def saved_frames(self) -> int:
        """Output frames a redo would have sampled again (about a token each)."""


class ContinuationMemory:
    """Upstreams (health keys) that refused a continuation mechanism, per mechanism.

    Shared by every turn of a relay (in memory: a restart asks again once).
    """

    __slots__ = ("_refused",)

    def __init__(self) -> None:
        self._refused: dict[str, set[str]] = {}

    def refused(self, mechanism: str, key: str) -> bool:
        found = self._refused.get(mechanism)
        return found is not None and key in found

    def remember(self, mechanism: str, key: str) -> None:
        self._refused.setdefault(mechanism, set()).add(key)

    def view(self) -> dict[str, list[str]]:
        """For /status: each mechanism's refusing upstreams."""
        return {m: sorted(keys) for m, keys in self._refused.items() if keys}
