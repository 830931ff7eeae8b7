"""Client profiles: each agent's own timers, honoured (sans-IO).

Clients differ in what keeps their stream alive, in how long they wait, and in
how they treat an error inside a stream, so one relay setting cannot suit them
all.  The rule for every timer is *never wait longer, or cut sooner, than the
client itself would*: each profile carries the client's own known timers as data
(``client_idle_timeout_s``, ``client_nonstream_wait_s``), and the relay's waits
follow them (`Profile.stall_timeouts`, `Profile.nonstream_wait`).

* **Codex CLI** counts only parsed SSE events (or WebSocket messages) toward its
  ``stream_idle_timeout_ms`` (300 s by default): an SSE comment does not reset
  it.  So it gets a keepalive *event*, ``event: keepalive`` with
  ``{"type": "keepalive"}``, an event type its parser (and the openai SDK's)
  accepts and ignores (checked with the real Codex 0.169.0: before
  ``response.created`` and between frames alike).  Its idle timer starts only once
  response headers arrive (it waited 130 s for headers with a 2 s idle timeout), so
  it never gets early headers either: a long retry storm is absorbed with no timer
  running, and a final ``400`` stays a status.  With no early headers its own idle
  timer never runs while unbroken waits for a first frame, so unbroken's stall
  timers stand in for it: they are never longer than its idle timeout
  (``unbroken run -- codex`` reads the active provider's ``stream_idle_timeout_ms``).
  A cut after output ends with ``error`` + ``response.failed``: Codex shows the
  message and retries the turn once (one of its ``stream_max_retries``), as it does
  after a reset, but at once and with the reason in words.
* **Claude Code** turns any in-stream error, a final one too, into an immediate
  non-streamed retry (``stream: false``, ``max_tokens`` unchanged, 300 s timeout
  or ``API_TIMEOUT_MS``), and waits at least 300 s for response headers from a
  custom base URL.  So it never gets early headers (a final ``400`` stays a
  status), its keepalive is Anthropic's own ``ping`` event, and unbroken waits for
  a non-streamed answer at least as long as Claude Code does (300 s), so a slow
  answer is never dropped and asked for again while Claude Code would still have
  taken it.  A cut after output ends by aborting the connection
  (``after_commit_end = "reset"``): Claude Code then re-sends the request
  *streamed* (~0.6 s later), so a long answer still streams, stalls are still
  caught, and the relay can still replay before commit; an in-stream
  ``overloaded_error`` would have made it re-send without streaming, where an
  answer longer than its non-streamed timeout can never arrive (measured; see
  docs/gate.md, "The ending after commit, per client").
* **Gemini CLI** retries the turn after an in-stream error and prints the text it
  already showed a second time (measured with 0.61.0: ``HelloHello, world!``); a
  connection reset after output ends its turn with the partial text and no
  duplicate.  So after commit its stream is ended by a reset
  (``after_commit_end = "reset"``).  It gives up on response headers after about
  60 s, so early headers (20 s) keep a long storm inside one request; once they
  came it waits about 300 s for the next event (``client_idle_timeout_s``), then
  retries silently and shows the prefix again.  Its keepalive is a blank line (the
  Gemini protocol's, for every client: an SSE comment stops the genai SDK's
  parser).
* **OpenCode** (the AI SDK), the openai and anthropic SDKs, and anything unknown
  keep today's conservative defaults: SSE comments, early headers after
  ``[stream] early_headers_s``, the native error event after commit.

Codex and OpenCode start a tool as soon as its call is complete, and retry the
step after the error that ends a cut stream: a cut between the call's end and
its message's end made the model call the tool again, and it ran twice (Codex
5 of 5 runs, OpenCode 7 of 10, measured with the real binaries).  Their profiles
add the hold rule ``tool_tail`` (``Profile.tool_tail``): the complete call waits
for its message's end, so such a cut is replayed, or after text drops the call
with the error; once in 20 of 20 runs each (docs/gate.md, "tool_tail").

A profile is chosen from the request's ``User-Agent`` and a few headers
(`identify`); ``[clients.<name>]`` config sections override its fields
(`profile_for`).  The turn machine reads the chosen `Profile`.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

__all__ = [
    "CLIENT_KEYS",
    "DEFAULT",
    "PROFILES",
    "CommitEnd",
    "KeepaliveForm",
    "Profile",
    "check_overrides",
    "identify",
    "identify_by",
    "identity_headers",
    "profile_for",
    "profile_named",
]


class KeepaliveForm(enum.StrEnum):
    COMMENT = "comment"  # ``: keepalive``: every SSE parser ignores it
    EVENT = "event"  # the protocol's keepalive event (Responses, Anthropic); a comment else


class CommitEnd(enum.StrEnum):
    """How a stream cut after commit ends (never cleanly: the client must retry)."""

    ERROR = "error"  # the protocol's native, retryable error event, then the end
    RESET = "reset"  # abort the client connection: no error event, no clean end


@dataclass(frozen=True, slots=True)
class Profile:
    """What one kind of client needs.  ``None`` means: the ``[stream]`` setting."""

    name: str
    #: send ``200`` and SSE headers while still retrying (then a final answer becomes
    #: an in-stream error); False keeps every status a status
    early_headers: bool = True
    early_headers_s: float | None = None
    keepalive: KeepaliveForm = KeepaliveForm.COMMENT
    keepalive_s: float | None = None
    #: how long an attempt of a non-streamed request may wait for its answer
    #: (default: ``client_nonstream_wait_s`` when known, else
    #: ``max(header_timeout_s, first_frame_timeout_s)``)
    nonstream_wait_s: float | None = None
    #: the relay's stall timers for this client (default: the ``[stream]`` setting,
    #: capped at ``client_idle_timeout_s``)
    first_frame_timeout_s: float | None = None
    idle_timeout_s: float | None = None
    #: how a stream cut after commit ends; a WebSocket turn always gets the error
    #: message (the socket is the client's whole session)
    after_commit_end: CommitEnd = CommitEnd.ERROR
    #: the client's own timers, as measured (None: unknown).  How long it waits for
    #: the next event of a stream before it gives up on it
    client_idle_timeout_s: float | None = None
    #: how long it waits for the response headers of a streamed request
    client_header_timeout_s: float | None = None
    #: how long it waits for a non-streamed answer before it gives up on it
    client_nonstream_wait_s: float | None = None
    #: while nothing was released, hold a complete tool call until the end of its
    #: message (the hold rule ``tool_tail``): for a client that starts a tool at the
    #: call's end and retries the turn after a cut, which makes the model call it
    #: again.  None: as ``[stream] hold`` says; True adds it, False removes it
    tool_tail: bool | None = None

    def header_timeout(self, header_s: float) -> float:
        """How long an attempt of a streamed request waits for the upstream's headers,
        from ``[stream] header_timeout_s``: the client's own header wait where it is
        known.  A client that gets no early headers waits on its own timer: the relay
        waits as long (a shorter wait cuts answers the client would have taken, and
        asks again).  A client whose timer early headers disarm would have given up
        and asked again at its own time: the relay asks again no later."""
        client = self.client_header_timeout_s
        if client is None:
            return header_s
        return min(header_s, client) if self.early_headers else client

    def stall_timeouts(self, first_frame_s: float, idle_s: float) -> tuple[float, float]:
        """The relay's first-frame and idle timeouts for this client, from the
        ``[stream]`` ones: a stall is caught no later than the client would catch
        it, so it can still be replayed before commit (and, after commit, the client
        is not kept waiting past its own patience by keepalives)."""
        cap = self.client_idle_timeout_s
        if self.first_frame_timeout_s is not None:
            first_frame_s = self.first_frame_timeout_s
        elif cap is not None:
            first_frame_s = min(first_frame_s, cap)
        if self.idle_timeout_s is not None:
            idle_s = self.idle_timeout_s
        elif cap is not None:
            idle_s = min(idle_s, cap)
        return first_frame_s, idle_s

    def hold_names(self, names: Iterable[str]) -> tuple[str, ...]:
        """The hold rules for this client's turns, from ``[stream] hold``: ``tool_tail``
        added or removed as the profile says (it takes effect only with ``tool_calls``
        or ``all``)."""
        out = tuple(n for n in names if n != "tool_tail")
        wanted = ("tool_tail" in names) if self.tool_tail is None else self.tool_tail
        return (*out, "tool_tail") if wanted else out

    def nonstream_wait(self, header_s: float, first_frame_s: float) -> float:
        """How long an attempt of a non-streamed request waits for its answer: as long
        as the client itself waits, when that is known (a non-streamed answer shows
        nothing until it is whole, so a shorter wait drops slow answers the client
        would have taken, and asks again, forever)."""
        if self.nonstream_wait_s is not None:
            return self.nonstream_wait_s
        if self.client_nonstream_wait_s is not None:
            return self.client_nonstream_wait_s
        return max(header_s, first_frame_s)


#: The profiles, as data.  ``unknown`` is today's conservative behaviour.
PROFILES: dict[str, Profile] = {
    # Codex 0.169: stream_idle_timeout_ms = 300000 by default (`agents.codex` reads
    # the user's); it makes no non-streamed requests of its own.
    # It starts a tool at the call's ``response.output_item.done`` and, after a cut
    # before ``response.completed``, retries the turn: the model's call ran twice in 5
    # of 5 runs (HTTP and WebSocket each) without ``tool_tail``, once in 20 of 20 with it.
    "codex": Profile(
        "codex",
        early_headers=False,
        keepalive=KeepaliveForm.EVENT,
        client_idle_timeout_s=300.0,
        tool_tail=True,
    ),
    # Claude Code 2.1.328: 300 s for the next stream event (CLAUDE_STREAM_IDLE_TIMEOUT_MS
    # raises it, never below 300 s) and for a non-streamed answer (API_TIMEOUT_MS); it
    # abandons a streamed request with no response headers after 360 s (measured).
    "claude-code": Profile(
        "claude-code",
        early_headers=False,
        keepalive=KeepaliveForm.EVENT,
        after_commit_end=CommitEnd.RESET,
        client_idle_timeout_s=300.0,
        client_header_timeout_s=360.0,
        client_nonstream_wait_s=300.0,
    ),
    # Gemini CLI 0.61.0: about 60 s for response headers (early headers disarm it: the
    # relay asks again by then), about 300 s for the next stream event.
    "gemini-cli": Profile(
        "gemini-cli",
        keepalive=KeepaliveForm.EVENT,
        after_commit_end=CommitEnd.RESET,
        client_idle_timeout_s=300.0,
        client_header_timeout_s=60.0,
    ),
    # OpenCode 1.18.33 (the AI SDK) starts a tool at the call's end too, and retries the
    # step after the error event that follows: ``tool_tail`` (see docs/gate.md).
    "opencode": Profile("opencode", tool_tail=True),
    "openai-sdk": Profile("openai-sdk"),
    "anthropic-sdk": Profile("anthropic-sdk"),
    "unknown": Profile("unknown"),
}
DEFAULT = PROFILES["unknown"]

#: ``[clients.<name>]`` keys and their types.
CLIENT_KEYS: dict[str, tuple[type, ...]] = {
    "early_headers": (bool,),
    "early_headers_s": (int, float),
    "keepalive": (str,),
    "keepalive_s": (int, float),
    "nonstream_wait_s": (int, float),
    "first_frame_timeout_s": (int, float),
    "idle_timeout_s": (int, float),
    "after_commit_end": (str,),
    "client_idle_timeout_s": (int, float),
    "client_header_timeout_s": (int, float),
    "client_nonstream_wait_s": (int, float),
    "tool_tail": (bool,),
}

#: ``[clients.<name>]`` keys whose value is one of an enum's values
_CHOICES: dict[str, type[enum.StrEnum]] = {
    "keepalive": KeepaliveForm,
    "after_commit_end": CommitEnd,
}


def identify(headers: Mapping[str, str]) -> str:
    """The profile name for a request's headers (case-insensitive mapping)."""
    return identify_by(*identity_headers(headers))


def identity_headers(headers: Mapping[str, str]) -> tuple[str | None, str | None, bool]:
    """What `identify` reads of the headers: the user agent, the originator, and
    whether a Claude Code session id is set (a cache key for `identify_by`)."""
    return (
        headers.get("user-agent"),
        headers.get("originator"),
        bool(headers.get("x-claude-code-session-id")),
    )


def identify_by(user_agent: str | None, originator: str | None, claude_session: bool) -> str:
    """`identify`, from what it reads of the headers (`identity_headers`)."""
    ua = (user_agent or "").lower()
    originator = (originator or "").lower()
    # Codex: codex_cli_rs/... (the TUI), codex_exec/... (codex exec), originator alike.
    if ua.startswith("codex_") or originator.startswith("codex"):
        return "codex"
    if ua.startswith("claude-cli/") or claude_session:
        return "claude-code"
    # Gemini CLI: GeminiCLI-tui/0.61.0/<model> (...), GeminiCLI/<version>/... headless.
    if ua.startswith("geminicli"):
        return "gemini-cli"
    if ua.startswith("opencode/") or "opencode" in ua.split(" ", 1)[0]:
        return "opencode"
    if ua.startswith("openai/"):
        return "openai-sdk"
    if ua.startswith("anthropic/"):
        return "anthropic-sdk"
    return "unknown"


def check_overrides(name: str, table: Mapping[str, Any]) -> dict[str, Any]:
    """Validate one ``[clients.<name>]`` table; returns it (raises ValueError)."""
    if name not in PROFILES:
        raise ValueError(f"unknown client {name!r} (known: {', '.join(sorted(PROFILES))})")
    out: dict[str, Any] = {}
    for key, raw in table.items():
        value: Any = raw
        kinds = CLIENT_KEYS.get(key)
        if kinds is None:
            raise ValueError(f"unknown key {key!r} (known: {', '.join(sorted(CLIENT_KEYS))})")
        if (isinstance(raw, bool) and bool not in kinds) or not isinstance(raw, kinds):
            raise ValueError(f"{key}: expected {kinds[0].__name__}, got {value!r}")
        choices = _CHOICES.get(key)
        if choices is not None:
            try:
                value = choices(value)
            except ValueError:
                known = " or ".join(repr(c.value) for c in choices)
                raise ValueError(f"{key}: expected {known}, got {value!r}") from None
        elif kinds[0] is not bool:
            if value <= 0:
                raise ValueError(f"{key}: must be greater than 0")
            value = float(value)
        out[key] = value
    return out


def profile_for(
    headers: Mapping[str, str], overrides: Mapping[str, Mapping[str, Any]] | None = None
) -> Profile:
    """The profile for a request, with its ``[clients.<name>]`` overrides applied
    (``overrides`` as `check_overrides` returned them)."""
    return profile_named(identify(headers), overrides)


def profile_named(name: str, overrides: Mapping[str, Mapping[str, Any]] | None = None) -> Profile:
    """The profile ``name`` (as `identify` says), with its overrides applied."""
    profile = PROFILES[name]
    if overrides:
        table = overrides.get(profile.name)
        if table:
            profile = dataclasses.replace(profile, **table)
    return profile
