"""Instrumentation hooks: the relay reports what happens, observers decide what to do.

The relay calls these methods; nothing in the relay prints.  `Hooks` is a
no-op base; `LogHooks` writes the retry log; later observers (metrics,
journal, live status) subclass `Hooks` and are combined with `MultiHooks`.
No hook ever receives a header value, a key or a body.
"""

from __future__ import annotations

import itertools
import logging
import time
import weakref
from collections.abc import Callable
from typing import Any

import msgspec

from unbroken.core.admission.policy import Failure

__all__ = [
    "HOOK_NAMES",
    "AttemptInfo",
    "Hooks",
    "LogHooks",
    "MultiHooks",
    "TurnRecord",
    "implements",
]

log = logging.getLogger("unbroken")
_ids = itertools.count(1)


# `AttemptInfo` and `TurnRecord` are msgspec Structs, not dataclasses: the same
# fields, defaults, equality (a `TurnRecord` is itself only, as with ``eq=False``) and
# repr (``held`` shown too), made by a C ``__init__``: about 1,500 and 2,500
# instructions a turn, against 4,000 and 5,900 for the dataclasses' Python ones.
class AttemptInfo(msgspec.Struct, gc=False):
    """Structural facts about one upstream attempt (no content, no keys)."""

    number: int
    upstream: str
    started: float = msgspec.field(default_factory=time.time)
    ended: float | None = None
    status: int | None = None  # upstream HTTP status, when one arrived
    reason: str = ""  # "ok", or the failure label: 503, connection_reset, stall, ...
    phase: str = ""  # failures: connect | headers | pending | committed | stall | tail
    #: how the upstream was chosen: first | sticky | rotated | breaker_skip | parked
    choice: str = ""
    frames_received: int = 0
    bytes_received: int = 0
    frames_released: int = 0
    bytes_released: int = 0
    hold_seconds: float = 0.0
    input_tokens: int | None = None  # as reported by the provider
    output_tokens: int | None = None
    #: output frames this attempt generated (about one token each): the waste of a replay
    est_output_tokens: int = 0
    #: the model the answer named (its first frame or body), "" when none
    response_model: str = ""
    #: why the turn waited in an upstream's line before this attempt (``parked_for``)
    parked_for: str | None = None
    #: seconds of that wait spent on the provider's rate limit (part of ``queued_s``)
    queued_s: float = 0.0
    #: the wait planned after this attempt failed, before the next; None: none followed
    wait_s: float | None = None


class TurnRecord(msgspec.Struct, eq=False):
    """Live, log-safe facts about one client turn (also what /status will show)."""

    route: str
    path: str
    protocol: str
    stream: bool
    session_id: str | None = None
    #: the client profile the turn runs with (`core.profiles`): codex, claude-code, ...
    client: str = ""
    #: the model the request names ("" when none): `core.wire.protocols.model_asked`
    model: str = ""
    id: int = msgspec.field(default_factory=_ids.__next__)
    started: float = msgspec.field(default_factory=time.time)
    attempts: int = 0
    upstream: str = ""
    state: str = "waiting"  # waiting | holding | streaming | done
    last_failure: str | None = None
    next_retry_at: float | None = None  # wall clock
    #: why a parked turn waits in its upstream's line: pacer | breaker | cooloff | probe
    #: | ratelimit
    parked_for: str | None = None
    #: seconds the turn waited at the relay for the provider's rate limit
    queued_s: float = 0.0
    #: seconds the turn really waited between attempts: a wait cut short (the client
    #: went away, the relay stopped) counts what elapsed, never the wait that was planned
    waited_s: float = 0.0
    # ok | recovered | ended_with_error | passed_through_error | aborted_by_client
    outcome: str | None = None
    ended: float | None = None
    first_byte_at: float | None = None  # wall clock of the first byte sent to the client
    attempt_log: list[AttemptInfo] = msgspec.field(default_factory=list)
    #: bytes held back right now (live, for status and metrics): a reader, never the ledger
    held: Callable[[], int] | None = None
    #: continuations made after cuts (``after_commit = "continue"``, `core.turn.continuation`)
    splices: int = 0
    #: output frames (about a token each) a redo would have sampled again
    saved_tokens: int = 0
    #: the continuation mechanism used or refused, and the last result (``spliced``,
    #: ``refused_<reason>``); None: no cut asked for one
    continuation: str | None = None


class Hooks:
    """Observer interface.  Every method is optional; the default does nothing."""

    def turn_started(self, turn: TurnRecord) -> None:
        pass

    def attempt_started(self, turn: TurnRecord, upstream: str) -> None:
        pass

    def attempt_failed(
        self, turn: TurnRecord, upstream: str, failure: Failure, *, phase: str, wait_s: float | None
    ) -> None:
        """``wait_s`` is the wait before the next attempt, or None when none follows."""

    def attempt_ended(self, turn: TurnRecord, attempt: AttemptInfo) -> None:
        """Every attempt, successful or not, once its outcome is known."""

    def hold_overflow(self, turn: TurnRecord, held_bytes: int) -> None:
        pass

    def turn_ended(self, turn: TurnRecord) -> None:
        """``turn.outcome`` and ``turn.attempt_log`` are final."""

    def continuation(self, turn: TurnRecord, result: str) -> None:
        """A cut turn was continued in place (``spliced``) or not (``refused_<reason>``)."""

    def upstream_changed(
        self, route: str, upstream: str, kind: str, *, reason: str, ttl_s: float, remote: bool
    ) -> None:
        """A breaker transition (``open``, ``half_open``, ``close``) of an upstream;
        ``remote`` when another instance learned it first."""


#: every hook, read off `Hooks` itself: adding a method there adds an event everywhere
HOOK_NAMES: tuple[str, ...] = tuple(
    name for name, value in vars(Hooks).items() if callable(value) and not name.startswith("_")
)


def implements(hook: Hooks, name: str) -> bool:
    """Whether ``hook`` does anything on event ``name`` (its class overrides the no-op)."""
    own = getattr(hook, "_implements", None)
    if own is not None:
        return bool(own(name))
    return getattr(type(hook), name) is not getattr(Hooks, name)


#: a hook's method as the fan-out calls it, and what its failure is handed to (None:
#: the failure propagates)
_Bound = tuple[Callable[..., None], Callable[[str], None] | None]


def _fan_out(name: str) -> Callable[..., None]:
    def call(self: MultiHooks, *args: Any, **kwargs: Any) -> None:
        bound = self._bound
        if bound is None:
            bound = self._bind()
        for method, on_error in bound[name]:
            try:
                method(*args, **kwargs)
            except Exception:
                if on_error is None:
                    raise
                on_error(name)

    call.__name__ = name
    return call


#: `_fan_out_by_position`'s "no second argument"
_ONE = object()


def _fan_out_by_position(name: str) -> Callable[..., None]:
    """`_fan_out` for an event of every turn (its start and end: the turn; an
    attempt's start and end: the turn and one more), its arguments by position: no
    ``*args``/``**kwargs`` packed and unpacked per observer."""

    def call(self: MultiHooks, turn: TurnRecord, other: Any = _ONE) -> None:
        bound = self._bound
        if bound is None:
            bound = self._bind()
        for method, on_error in bound[name]:
            try:
                if other is _ONE:
                    method(turn)
                else:
                    method(turn, other)
            except Exception:
                if on_error is None:
                    raise
                on_error(name)

    call.__name__ = name
    return call


#: the events of every turn, called with their arguments by position (`HooksObserver`)
_POSITIONAL = frozenset({"turn_started", "turn_ended", "attempt_started", "attempt_ended"})


class MultiHooks(Hooks):
    """Calls every hook of ``hooks`` in order (its methods are made from `HOOK_NAMES`).

    Per event, only the hooks that implement it are called, through methods bound
    once: the fan-out runs on every turn.  A nested `MultiHooks` is flattened into
    the methods it would call.  ``hooks`` is a tuple: `add` and `remove` change it,
    and re-bind this fan-out and every one it is nested in (on their next event).
    """

    def __init__(self, *hooks: Hooks) -> None:
        self._hooks: tuple[Hooks, ...] = hooks
        #: the fan-outs this one is nested in (they bind through it)
        self._outer: weakref.WeakSet[MultiHooks] = weakref.WeakSet()
        self._bound: dict[str, tuple[_Bound, ...]] | None = None

    @property
    def hooks(self) -> tuple[Hooks, ...]:
        return self._hooks

    def add(self, hook: Hooks) -> None:
        """Call ``hook`` too, after the others."""
        self._hooks = (*self._hooks, hook)
        self._changed()

    def remove(self, hook: Hooks) -> None:
        """Stop calling ``hook`` (ValueError if it is not one of these)."""
        hooks = list(self._hooks)
        hooks.remove(hook)
        self._hooks = tuple(hooks)
        self._changed()

    def _changed(self) -> None:
        self._bound = None
        for outer in list(self._outer):
            outer._changed()

    def _bind(self) -> dict[str, tuple[_Bound, ...]]:
        bound = self._bound = {name: tuple(self._methods(name, self)) for name in HOOK_NAMES}
        return bound

    def _methods(self, name: str, outer: MultiHooks) -> list[_Bound]:
        out: list[_Bound] = []
        for h in self._hooks:
            if isinstance(h, MultiHooks):
                h._outer.add(outer)
                out.extend(h._methods(name, outer))
            elif implements(h, name):
                # A guarded observer (`observe.guard.Guarded`) is called directly, its
                # failure handed to its guard: no wrapper call per event.
                unguarded = getattr(h, "unguarded", None)
                if unguarded is not None:
                    out.append(unguarded(name))
                else:
                    out.append((getattr(h, name), None))
        return out

    def _implements(self, name: str) -> bool:
        return any(implements(h, name) for h in self._hooks)


for _name in HOOK_NAMES:
    setattr(
        MultiHooks,
        _name,
        _fan_out_by_position(_name) if _name in _POSITIONAL else _fan_out(_name),
    )


#: why continue mode (``after_commit = "continue"``) did not cover a turn or finish a
#: cut one, as the log says it (``refused_<reason>``; docs/gate.md, "Continuation")
REFUSAL_WORDS: dict[str, str] = {
    "thinking_enabled": "the request enables thinking (Claude Code's default adaptive thinking "
    "does): a continuation cannot join a thinking turn",
    "forced_tool": "the request forces a tool call (tool_choice any or tool)",
    "client_prefill": "the client's own last assistant message is not plain text",
    "bad_request": "the request body is not a JSON object with a list of messages",
    "no_option": "a Chat route without chat_prefix: Chat Completions has no continuation",
    "unsupported": "this protocol or body has no continuation the relay can check",
    "not_resumable": "the upstream refused the continuation for this model or backend "
    '(Claude 4.6 and later refuse prefill: anthropic_continue = "user_message"; '
    "a Responses backend that refuses background mode)",
    "tool_call": "a tool call had started",
    "thinking": "thinking had reached the client",
    "server_tool": "a server-side tool block had reached the client",
    "join": "the continuation did not continue what the client had (an echo, another "
    "response, a rephrased start)",
    "limit": "the turn made max_splices continuations already",
    "stop_released": "the stop reason had reached the client",
    "other_content": "a block, delta or field the join rule does not know had reached the client",
    "too_large": "more than 8 MiB had been released",
    "not_a_cut": "the provider's own error or a malformed frame ended the response",
    "queued": "the continuation made no progress (stuck in queued)",
}


class LogHooks(Hooks):
    """One log line per retry (when verbose) and per turn that did not end ``ok``; each
    reason continue mode refused a turn for, once per route."""

    def __init__(self, *, verbose: bool = True) -> None:
        self.verbose = verbose
        #: (route, reason) pairs logged already (bounded: routes times reasons)
        self._refusals: set[tuple[str, str]] = set()

    def attempt_failed(
        self, turn: TurnRecord, upstream: str, failure: Failure, *, phase: str, wait_s: float | None
    ) -> None:
        if phase == "tail":
            log.info(
                "stream cut after its terminal frame route=%s upstream=%s reason=%s: "
                "the turn was complete; the relay finished the protocol's ending",
                turn.route,
                upstream,
                failure.label,
            )
        elif wait_s is None and phase == "committed":
            log.warning(
                "stream cut after output route=%s upstream=%s attempt=%d reason=%s: "
                "not replayable, ended with a native error (a reset for some clients)",
                turn.route,
                upstream,
                turn.attempts,
                failure.label,
            )
        elif wait_s is None:
            log.warning(
                "giving up route=%s upstream=%s attempt=%d reason=%s phase=%s",
                turn.route,
                upstream,
                turn.attempts,
                failure.label,
                phase,
            )
        elif phase == "committed":  # continued in place (after_commit = "continue")
            log.warning(
                "stream cut after output route=%s upstream=%s attempt=%d reason=%s: "
                "continuing in place (continuation %d) wait_ms=%d",
                turn.route,
                upstream,
                turn.attempts,
                failure.label,
                turn.splices,
                round(wait_s * 1000),
            )
        elif self.verbose:
            log.warning(
                "retry route=%s upstream=%s attempt=%d reason=%s phase=%s wait_ms=%d",
                turn.route,
                upstream,
                turn.attempts,
                failure.label,
                phase,
                round(wait_s * 1000),
            )

    def hold_overflow(self, turn: TurnRecord, held_bytes: int) -> None:
        log.warning(
            "hold limit reached route=%s turn=%d held_bytes=%d: released and committed",
            turn.route,
            turn.id,
            held_bytes,
        )

    def turn_ended(self, turn: TurnRecord) -> None:
        result = turn.continuation
        if result is not None and result.startswith("refused_"):
            self._refused(turn, result[len("refused_") :])
        if turn.outcome not in (None, "ok"):
            log.info(
                "turn route=%s turn=%d outcome=%s attempts=%d",
                turn.route,
                turn.id,
                turn.outcome,
                turn.attempts,
            )

    def _refused(self, turn: TurnRecord, reason: str) -> None:
        """Continue mode refused the turn: said once per route and reason (every one is
        counted in the journal, ``unbroken stats``, and the metrics for a cut)."""
        key = (turn.route, reason)
        if key in self._refusals:
            return
        self._refusals.add(key)
        log.warning(
            "continue mode refused a turn route=%s reason=%s: %s; a cut after output ends "
            "with the native error as without it (said once per route and reason; "
            "unbroken stats counts them)",
            turn.route,
            reason,
            REFUSAL_WORDS.get(reason, "see docs/gate.md"),
        )
