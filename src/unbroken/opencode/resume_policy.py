"""What auto-resume decides for OpenCode, with no I/O: its settings, `decide` (whether
a session's failed turn is resumed: a pure function over the events of that turn, plain
dicts as OpenCode sends them) and `resume_body` (the prompt to re-send).
`unbroken.opencode.resume` is the I/O around it.
"""

from __future__ import annotations

import fnmatch
import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Final

__all__ = [
    "Decision",
    "ResumeSession",
    "ResumeSettings",
    "Skip",
    "decide",
    "event_props",
    "is_retryable",
    "resume_body",
    "settings_from_env",
    "shorten",
    "turn_events",
]

# -- settings ----------------------------------------------------------------------


@dataclass(frozen=True)
class ResumeSettings:
    provider: str = "*"  # a glob on the provider id
    model: str = "*"  # a prefix of the model id; "*" (or "") matches every model
    delay_ms: int = 3000
    max_attempts: int = 0  # consecutive resumes of one session; 0 = unlimited

    def covers(self, provider: str | None, model: str | None) -> bool:
        if not fnmatch.fnmatchcase(provider or "", self.provider or "*"):
            return False
        prefix = self.model.rstrip("*")
        return not prefix or (model or "").startswith(prefix)


#: (setting, UNBROKEN_ name, opencode-retry-forever alias)
ENV_SETTINGS: Final = (
    ("provider", "UNBROKEN_RESUME_PROVIDER", "OPENCODE_RESUME_PROVIDER"),
    ("model", "UNBROKEN_RESUME_MODEL", "OPENCODE_RESUME_MODEL"),
    ("delay_ms", "UNBROKEN_RESUME_DELAY_MS", "OPENCODE_RESUME_DELAY_MS"),
    ("max_attempts", "UNBROKEN_RESUME_MAX_ATTEMPTS", "OPENCODE_RESUME_MAX_ATTEMPTS"),
)


def settings_from_env(env: Mapping[str, str] | None = None) -> ResumeSettings:
    """Settings from ``UNBROKEN_RESUME_*`` (or the plugin's ``OPENCODE_RESUME_*``).

    The ``UNBROKEN_`` name wins when both are set.  Raises ValueError naming the
    variable on a bad number.
    """
    env = os.environ if env is None else env
    values: dict[str, Any] = {}
    for key, name, alias in ENV_SETTINGS:
        for var in (alias, name):
            raw = env.get(var)
            if raw is None or raw.strip() == "":
                continue
            if key in ("delay_ms", "max_attempts"):
                try:
                    number = int(raw.strip())
                except ValueError:
                    raise ValueError(f"{var}: expected an integer, got {raw!r}") from None
                if number < 0:
                    raise ValueError(f"{var}: must not be negative, got {raw!r}")
                values[key] = number
            else:
                values[key] = raw.strip()
    return ResumeSettings(**values)


# -- the decision -------------------------------------------------------------------


@dataclass(frozen=True)
class ResumeSession:
    reason: str


@dataclass(frozen=True)
class Skip:
    reason: str


Decision = ResumeSession | Skip

#: OpenCode 1.18's own "is this transient" patterns (session/retry.ts), so a turn is
#: resumed exactly when OpenCode would have retried it but ran out of retries.
RETRYABLE_PATTERNS: Final = tuple(
    re.compile(p, re.IGNORECASE)
    for p in (
        r"429|500|502|503|504|524",
        r"rate increased too quickly|rate limit|rate-limit|rate_limit|too many requests",
        r"overloaded|service unavailable|service_unavailable|service-unavailable|"
        r"internal error|internal_error|internal server error|server error|server_error|"
        r"server-error|provider returned error|provider_returned_error|provider-returned-error",
        r"terminated|fetch failed|failed to fetch|network[-_\s]error|upstream connect|"
        r"connection error|connection refused|connection lost|socket connection was closed|"
        r"socket hang up|reset before headers|getaddrinfo|enotfound|eai_again|econnrefused|"
        r"econnreset|etimedout",
        r"^timeout$|\b(?:request|response|connection|network|stream|read) "
        r"(?:timeout|timed out|time out)\b",
        r"try your request again|retry your request|resource exhausted|resource_exhausted",
        r"\btry again (?:later|in\b)|\b(?:currently|temporarily) at capacity\b",
    )
)
CONTEXT_OVERFLOW: Final = re.compile(
    r"context_length_exceeded|context window|context length|maximum context|"
    r"prompt is too long|too many tokens|input is too long|exceeds the context",
    re.IGNORECASE,
)
AUTH_FAILURE: Final = re.compile(
    r"invalid_api_key|invalid api key|incorrect api key|invalid x-api-key|unauthorized|"
    r"authentication_error|authentication failed|permission_denied|\b401\b|\b403\b",
    re.IGNORECASE,
)
#: Session errors that are never transient.
NEVER: Final[dict[str, str]] = {
    "MessageAbortedError": "the user aborted the turn (MessageAbortedError)",
    "ProviderAuthError": "an auth error (ProviderAuthError)",
    "ContextOverflowError": "the context overflowed (ContextOverflowError)",
    "MessageOutputLengthError": "the reply hit the output length limit",
    "ContentFilterError": "the provider's content filter stopped the reply",
    "StructuredOutputError": "the structured output was invalid",
}
#: Parts that are output the user saw (step-start/step-finish/snapshot/patch are not).
OUTPUT_PARTS: Final = frozenset({"text", "reasoning", "tool", "file"})


def _matches(text: Any) -> bool:
    return isinstance(text, str) and any(p.search(text) for p in RETRYABLE_PATTERNS)


def shorten(text: Any, limit: int = 120) -> str:
    s = " ".join(str(text).split())
    return s if len(s) <= limit else s[: limit - 1] + "…"


def is_retryable(error: Mapping[str, Any]) -> tuple[bool, str]:
    """Classify an OpenCode error object ``{"name", "data"}``: (transient?, why)."""
    name = str(error.get("name") or "UnknownError")
    data = error.get("data") if isinstance(error.get("data"), Mapping) else {}
    assert isinstance(data, Mapping)
    message = data.get("message")
    body = data.get("responseBody")
    status = data.get("statusCode")
    if name in NEVER:
        return False, NEVER[name]
    texts = [t for t in (message, body) if isinstance(t, str)]
    if isinstance(status, int) and status in (401, 403):
        return False, f"an auth error ({name} {status})"
    if any(CONTEXT_OVERFLOW.search(t) for t in texts):
        return False, f"the context overflowed ({name}: {shorten(message)})"
    if any(AUTH_FAILURE.search(t) for t in texts):
        return False, f"an auth error ({name}: {shorten(message)})"
    if name == "APIError":
        label = f"APIError {status}" if status else "APIError"
        if (
            data.get("isRetryable") is True
            or (isinstance(status, int) and status >= 500)
            or _matches(message)
            or _matches(body)
        ):
            return True, f"retryable {label}: {shorten(message)}"
        return False, f"{label} is not retryable: {shorten(message)}"
    if name == "UnknownError":
        low = str(message or "").lower()
        if "too_many_requests" in low or "exhausted" in low or "unavailable" in low:
            return True, f"retryable UnknownError: {shorten(message)}"
        if _matches(message):
            return True, f"retryable UnknownError: {shorten(message)}"
        return False, f"UnknownError is not transient: {shorten(message)}"
    return False, f"{name} is not a transient failure"


@dataclass
class _Turn:
    """What one turn's events say (see `decide`)."""

    session_error: Mapping[str, Any] | None = None
    retried: bool = False
    assistant: dict[str, dict[str, Any]] = field(default_factory=dict)  # id -> info
    order: list[str] = field(default_factory=list)  # assistant ids, first seen
    output: set[str] = field(default_factory=set)  # assistant ids with output
    user: Mapping[str, Any] | None = None


def event_props(event: Mapping[str, Any]) -> Mapping[str, Any]:
    props = event.get("properties")
    return props if isinstance(props, Mapping) else {}


def turn_events(events: Sequence[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    """The events of the latest turn: from the first sight of the newest user message."""
    seen: set[str] = set()
    start = 0
    for i, event in enumerate(events):
        if event.get("type") != "message.updated":
            continue
        info = event_props(event).get("info")
        if isinstance(info, Mapping) and info.get("role") == "user":
            mid = str(info.get("id"))
            if mid not in seen:
                seen.add(mid)
                start = i
    return list(events[start:])


def _summarise(events: Sequence[Mapping[str, Any]]) -> _Turn:
    turn = _Turn()
    for event in events:
        kind = event.get("type")
        props = event_props(event)
        if kind == "session.error":
            error = props.get("error")
            turn.session_error = error if isinstance(error, Mapping) else {"name": "UnknownError"}
        elif kind == "session.status":
            status = props.get("status")
            if isinstance(status, Mapping) and status.get("type") == "retry":
                turn.retried = True
        elif kind == "message.updated":
            info = props.get("info")
            if not isinstance(info, Mapping):
                continue
            if info.get("role") == "user":
                turn.user = info
            elif info.get("role") == "assistant":
                mid = str(info.get("id"))
                if mid not in turn.assistant:
                    turn.order.append(mid)
                turn.assistant[mid] = dict(info)
        elif kind == "message.part.updated":
            part = props.get("part")
            if isinstance(part, Mapping) and part.get("type") in OUTPUT_PARTS:
                text = part.get("text")
                if part.get("type") in ("tool", "file") or (isinstance(text, str) and text):
                    turn.output.add(str(part.get("messageID")))
        elif kind == "message.part.delta":
            if props.get("delta"):
                turn.output.add(str(props.get("messageID")))
    return turn


def decide(events: Sequence[Mapping[str, Any]], settings: ResumeSettings | None = None) -> Decision:
    """Should the session's last turn be resumed?  Call it when the session went idle.

    ``events`` are OpenCode ``/event`` payloads (``{"type", "properties"}``) of one
    session; only the latest turn counts (see `turn_events`).  Resume when the
    turn failed once OpenCode's own retries were spent: a ``session.error`` that is
    transient by OpenCode's own rules (a retryable ``APIError`` or ``UnknownError``),
    or a last assistant message that ended with finish ``unknown`` or an error
    after producing output.  Never after an abort, an abort during a retry (idle
    with no error), a zero-output ``unknown`` finish, a context overflow or an
    auth error.
    """
    settings = settings or ResumeSettings()
    turn = _summarise(turn_events(events))
    last = turn.assistant[turn.order[-1]] if turn.order else None
    provider = (last or {}).get("providerID") or _user_model(turn.user)[0]
    model = (last or {}).get("modelID") or _user_model(turn.user)[1]
    decision = _decide(turn, last)
    if isinstance(decision, ResumeSession) and not settings.covers(provider, model):
        return Skip(
            f"{provider}/{model} is not covered by the resume filter "
            f"(provider {settings.provider!r}, model {settings.model!r})"
        )
    return decision


def _user_model(user: Mapping[str, Any] | None) -> tuple[str | None, str | None]:
    model = (user or {}).get("model")
    if isinstance(model, Mapping):
        return model.get("providerID"), model.get("modelID")
    return None, None


def _decide(turn: _Turn, last: Mapping[str, Any] | None) -> Decision:
    if turn.session_error is not None:
        ok, why = is_retryable(turn.session_error)
        if ok:
            return ResumeSession(f"the turn failed after OpenCode's retries: {why}")
        return Skip(why)
    if last is None:
        return Skip("no assistant reply in this turn")
    error = last.get("error")
    finish = last.get("finish")
    produced = str(last.get("id")) in turn.output
    if isinstance(error, Mapping):
        ok, why = is_retryable(error)
        if not ok:
            return Skip(why)
        if not produced:
            return Skip(f"the reply failed before any output ({why})")
        return ResumeSession(f"the reply ended with an error after output: {why}")
    if finish == "unknown":
        if produced:
            return ResumeSession("the reply ended with finish 'unknown' after output")
        return Skip(
            "zero-output 'unknown' finish: a deliberate abort, a denied permission or a compaction"
        )
    if finish is None:
        if turn.retried:
            return Skip("aborted during a retry: idle with no session.error")
        return Skip("interrupted: idle with neither a finish nor an error")
    return Skip(f"the turn completed (finish {finish!r})")


# -- re-sending the prompt ------------------------------------------------------------

_PART_KEYS: Final[dict[str, tuple[str, ...]]] = {
    "text": ("type", "text"),
    "file": ("type", "mime", "url", "filename", "source"),
    "agent": ("type", "name", "source"),
    "subtask": ("type", "prompt", "description", "agent", "model", "command"),
}


def resume_body(message: Mapping[str, Any]) -> dict[str, Any] | None:
    """The ``prompt_async`` body that re-sends a user message ``{info, parts}``.

    Synthetic parts (OpenCode's own file-read notes) are left out: OpenCode adds
    them again for the file parts.  None when nothing can be re-sent.
    """
    info = message.get("info") if isinstance(message.get("info"), Mapping) else {}
    assert isinstance(info, Mapping)
    parts: list[dict[str, Any]] = []
    for part in message.get("parts") or []:
        if not isinstance(part, Mapping) or part.get("synthetic") or part.get("ignored"):
            continue
        keys = _PART_KEYS.get(str(part.get("type")))
        if keys is None:
            continue
        parts.append({k: part[k] for k in keys if k in part and part[k] is not None})
    if not parts:
        return None
    body: dict[str, Any] = {"parts": parts}
    model = info.get("model")
    if isinstance(model, Mapping) and model.get("providerID") and model.get("modelID"):
        body["model"] = {"providerID": model["providerID"], "modelID": model["modelID"]}
        if model.get("variant"):
            body["variant"] = model["variant"]
    for key in ("agent", "system", "tools", "format"):
        if info.get(key):
            body[key] = info[key]
    return body
