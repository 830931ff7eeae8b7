"""Client profiles: each agent's own timers, honoured (sans-IO).

Clients differ in what keeps their stream alive and in how they treat an error
inside a stream, so one relay setting cannot suit them all:

* **Codex CLI** counts only parsed SSE events (or WebSocket messages) toward its
  ``stream_idle_timeout_ms``: an SSE comment does not reset it.  So it gets a
  keepalive *event*, ``event: keepalive`` with ``{"type": "keepalive"}``, an event
  type its parser (and the openai SDK's) accepts and ignores (checked with the real
  Codex 0.169.0: before ``response.created`` and between frames alike).  Its idle
  timer starts only once response headers arrive (it waited 130 s for headers with a
  2 s idle timeout), so it never gets early headers either: a long retry storm is
  absorbed with no timer running, and a final ``400`` stays a status.
* **Claude Code** turns any in-stream error, a final one too, into an immediate
  non-streamed retry, and waits at least 300 s for response headers from a custom
  base URL.  So it never gets early headers (a final ``400`` stays a status), its
  keepalive is Anthropic's own ``ping`` event, and unbroken's wait for a
  non-streamed answer stays well inside its 300 s, so a stalled attempt can still
  be retried before Claude Code gives up.
* **Gemini CLI** retries the turn after an in-stream error and prints the text it
  already showed a second time (measured with 0.61.0: ``HelloHello, world!``); a
  connection reset after output ends its turn with the partial text and no
  duplicate.  So after commit its stream is ended by a reset
  (``after_commit_end = "reset"``).  Its header timer is about 60 s, so early
  headers (20 s) keep a long storm inside one request; its keepalive is a blank line
  (the Gemini protocol's, for every client: an SSE comment stops the genai SDK's
  parser).
* **OpenCode** (the AI SDK), the openai and anthropic SDKs, and anything unknown
  keep today's conservative defaults: SSE comments, early headers after
  ``[stream] early_headers_s``.

A profile is chosen from the request's ``User-Agent`` and a few headers
(`identify`); ``[clients.<name>]`` config sections override its fields
(`profile_for`).  The turn machine reads the chosen `Profile`.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

__all__ = [
    "AFTER_COMMIT_ENDS",
    "CLIENT_KEYS",
    "DEFAULT",
    "PROFILES",
    "KeepaliveForm",
    "Profile",
    "check_overrides",
    "identify",
    "profile_for",
    "profile_named",
]


#: ``after_commit_end`` values: how a stream cut after commit ends for the client
AFTER_COMMIT_ENDS = ("error", "reset")


class KeepaliveForm(enum.StrEnum):
    COMMENT = "comment"  # ``: keepalive``: every SSE parser ignores it
    EVENT = "event"  # the protocol's keepalive event (Responses, Anthropic); a comment else


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
    #: (default ``max(header_timeout_s, first_frame_timeout_s)``)
    nonstream_wait_s: float | None = None
    #: how a stream that fails after commit ends: ``"error"``, the protocol's
    #: retryable in-stream error event; ``"reset"``, the client connection is aborted
    #: (for a client that would retry an error and show the text twice)
    after_commit_end: str = "error"


#: The profiles, as data.  ``unknown`` is today's conservative behaviour.
PROFILES: dict[str, Profile] = {
    "codex": Profile("codex", early_headers=False, keepalive=KeepaliveForm.EVENT),
    "claude-code": Profile(
        "claude-code", early_headers=False, keepalive=KeepaliveForm.EVENT, nonstream_wait_s=150.0
    ),
    "gemini-cli": Profile(
        "gemini-cli", keepalive=KeepaliveForm.EVENT, after_commit_end="reset"
    ),
    "opencode": Profile("opencode"),
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
    "after_commit_end": (str,),
}


def identify(headers: Mapping[str, str]) -> str:
    """The profile name for a request's headers (case-insensitive mapping)."""
    ua = (headers.get("user-agent") or "").lower()
    originator = (headers.get("originator") or "").lower()
    # Codex: codex_cli_rs/... (the TUI), codex_exec/... (codex exec), originator alike.
    if ua.startswith("codex_") or originator.startswith("codex"):
        return "codex"
    if ua.startswith("claude-cli/") or headers.get("x-claude-code-session-id"):
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
        if key == "keepalive":
            try:
                value = KeepaliveForm(value)
            except ValueError:
                raise ValueError(
                    f"keepalive: expected 'comment' or 'event', got {value!r}"
                ) from None
        elif key == "after_commit_end":
            if value not in AFTER_COMMIT_ENDS:
                raise ValueError(f"after_commit_end: expected 'error' or 'reset', got {value!r}")
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


def profile_named(
    name: str, overrides: Mapping[str, Mapping[str, Any]] | None = None
) -> Profile:
    """The profile ``name`` (as `identify` says), with its overrides applied."""
    profile = PROFILES[name]
    if overrides:
        table = overrides.get(profile.name)
        if table:
            profile = dataclasses.replace(profile, **table)
    return profile
