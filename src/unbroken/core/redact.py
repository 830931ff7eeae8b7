"""Secrets in configured URLs, redacted for display (pure, no I/O).

A URL the relay is configured with may carry a secret in three places:

* userinfo (``redis://:password@host``): dropped;
* a path token (an upstream that chains to another unbroken's ``/t/<token>/``): the
  segment after a ``t`` segment becomes ``REDACTED``;
* a query parameter that names a credential (``?password=``, ``?token=``, ...):
  its value becomes ``REDACTED``.

`redact_url` is what `/status`, metric labels, the journal, the logs and ``unbroken
status`` show of such a URL (an upstream's ``name``, the health store's ``url``).
"""

from __future__ import annotations

from urllib.parse import urlsplit

__all__ = ["REDACTED_PART", "SECRET_PARAMS", "redact_url"]

#: what a secret part of a URL is replaced with
REDACTED_PART = "REDACTED"
#: query parameters (lower case) whose value is a secret
SECRET_PARAMS = frozenset(
    {
        "password",
        "passwd",
        "pass",
        "pwd",
        "secret",
        "token",
        "access_token",
        "auth",
        "key",
        "api_key",
        "apikey",
        "api-key",
    }
)


def redact_url(url: str) -> str:
    """``url`` with its userinfo dropped, a ``/t/<token>`` path segment and the values of
    credential query parameters replaced by ``REDACTED``, and any fragment dropped.

    Never raises: text that does not parse as a URL is shown only up to its first
    character that could begin a secret (``@``, ``/``, ``?``, ``#``) after the scheme.
    """
    try:
        parts = urlsplit(url)
    except ValueError:
        scheme, sep, rest = url.partition("://")
        cut = min((i for i in (rest.find(c) for c in "@/?#") if i >= 0), default=len(rest))
        return f"{scheme}{sep}{rest[:cut]}" if sep else REDACTED_PART
    netloc = parts.netloc.rpartition("@")[2]
    path = parts.path
    if "/t/" in path or path.startswith("t/"):
        segments = path.split("/")
        for i in range(len(segments) - 1):
            if segments[i] == "t" and segments[i + 1]:
                segments[i + 1] = REDACTED_PART
        path = "/".join(segments)
    query = parts.query
    if query:
        kept = []
        for pair in query.split("&"):
            name, eq, _ = pair.partition("=")
            if eq and name.lower() in SECRET_PARAMS:
                pair = f"{name}={REDACTED_PART}"
            kept.append(pair)
        query = "&".join(kept)
    out = f"{parts.scheme}://{netloc}{path}" if parts.scheme else f"{netloc}{path}"
    return f"{out}?{query}" if query else out
