"""What a client's request says of itself, sans-IO: whether it asks for a stream, the
session it belongs to, and the credential each upstream's rate limits count.

The transports read the request (its path, raw query, headers, parsed body) and pass
it here; they decide none of it:

* **Streamed or not** (`is_streamed`): a Gemini API request by its method and
  ``alt=sse``; any other by its body's ``"stream": true``, or, when the body is not
  JSON, by an ``Accept: text/event-stream``.  A streamed turn may send early headers
  and keepalives, and may be continued after a cut (`core.turn.continuation_choice`).
* **Its session** (`session_id_of`, the journal's key; `sticky_key`, the key that keeps a
  session on one upstream): the first session header the client sets, else the body's
  ``prompt_cache_key``.
* **Its credential** (`credentials_of`): per upstream, the key the relay injects for it,
  else the client's own (a credential header, else a Gemini API ``key=`` parameter);
  the rate limiters count each by its hash (`core.admission.ratelimit.credential_hash`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from unbroken.core.wire.protocols import GEMINI, Protocol
from unbroken.core.wire.protocols.gemini import is_stream_path

__all__ = [
    "CREDENTIAL_HEADERS",
    "SESSION_HEADERS",
    "STICKY_HEADERS",
    "client_credential",
    "credentials_of",
    "is_streamed",
    "session_id_of",
    "session_keys",
    "sticky_key",
]

#: Headers that carry a provider key: on a route that injects its own key, the client's
#: values of all of them are removed (plus any an upstream entry lists in ``key_headers``).
CREDENTIAL_HEADERS: tuple[str, ...] = ("authorization", "x-api-key", "api-key", "x-goog-api-key")

#: the request headers that name a client session, in order of preference
SESSION_HEADERS = ("x-session-id", "x-session-affinity", "session-id", "x-claude-code-session-id")
#: the headers that keep a session on one upstream: the session's, and Codex's ``thread-id``
STICKY_HEADERS = (*SESSION_HEADERS, "thread-id")
_STICKY_ONLY = STICKY_HEADERS[len(SESSION_HEADERS) :]


def is_streamed(
    protocol: Protocol,
    path: str,
    query: str,
    parsed: dict[str, Any] | None,
    headers: Mapping[str, str],
) -> bool:
    """Whether the request asks for a streamed (SSE) answer.

    A Gemini API request: its method says it (``:streamGenerateContent``), and the
    answer is SSE only with ``alt=sse`` in the raw ``query`` (else a JSON array, relayed
    as a plain body).  Any other: its ``parsed`` body's ``"stream": true``; a body that
    is not a JSON object, its ``Accept: text/event-stream``."""
    if protocol is GEMINI:
        return is_stream_path(path) and "alt=sse" in query.split("&")
    if parsed is not None:
        return parsed.get("stream") is True
    return "text/event-stream" in headers.get("accept", "")


def session_id_of(headers: Mapping[str, str], body: dict[str, Any] | None = None) -> str | None:
    """The client's session key, for the journal: ``x-session-id``,
    ``x-session-affinity`` (OpenCode), ``session-id`` (Codex),
    ``x-claude-code-session-id`` (Claude Code), else the body's ``prompt_cache_key``."""
    return session_keys(headers, body)[0]


def sticky_key(headers: Mapping[str, str], body: dict[str, Any] | None = None) -> str | None:
    """A turn's session key for stickiness: a session header (or Codex's
    ``thread-id``), else the parsed body's ``prompt_cache_key``."""
    return session_keys(headers, body)[1]


def session_keys(
    headers: Mapping[str, str], body: dict[str, Any] | None = None
) -> tuple[str | None, str | None]:
    """``(session_id_of(...), sticky_key(...))`` in one look at the headers: the first
    of `SESSION_HEADERS` set is both; else the body's ``prompt_cache_key`` is the
    session's, and stickiness takes the rest of `STICKY_HEADERS` (``thread-id``) first."""
    for name in SESSION_HEADERS:
        value = headers.get(name)
        if value:
            found = str(value)
            return found, found
    key: str | None = None
    if body is not None:
        cache = body.get("prompt_cache_key")
        if isinstance(cache, str) and cache:
            key = cache
    for name in _STICKY_ONLY:
        value = headers.get(name)
        if value:
            return key, str(value)
    return key, key


def client_credential(headers: Mapping[str, str], query: str = "") -> str:
    """The client's own credential: its first credential header set
    (`CREDENTIAL_HEADERS`), else a Gemini API ``key=`` in the raw ``query``; ``""``:
    none."""
    for name in CREDENTIAL_HEADERS:
        value = headers.get(name)
        if value:
            return value
    if "key=" in query:
        for part in query.split("&"):
            name, _, value = part.partition("=")
            if name == "key" and value:
                return value
    return ""


def credentials_of(
    injected: Sequence[str | None], headers: Mapping[str, str], query: str = ""
) -> tuple[str, ...]:
    """The credential each upstream's rate limits count, in the route's order:
    ``injected`` names the key the relay injects for each upstream (None: it injects
    none, the client's own goes: `client_credential`)."""
    client = client_credential(headers, query)
    return tuple(key or client for key in injected)
