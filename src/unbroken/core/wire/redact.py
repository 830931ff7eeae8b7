"""Secrets in configured URLs, redacted for display (pure, no I/O).

A URL the relay is configured with may carry a secret in three places:

* userinfo (``redis://:password@host``): dropped;
* a path token (an upstream that chains to another unbroken's ``/t/<token>/``): the
  segment after a ``t`` segment becomes ``REDACTED``;
* a query parameter that names a credential (``?password=``, ``?token=``, ...):
  its value becomes ``REDACTED``.

`redact_url` is what `/status`, metric labels, the journal, the logs and ``unbroken
status`` show of such a URL (an upstream's ``name``, the health store's ``url``).

The secrets the relay itself holds (the keys it injects, its token: ``Config.secrets``)
never reach a client in what an upstream answers, whatever the upstream echoes:

* a body: `redact` (whole) and `Redactor` (as it streams, a secret may straddle two
  chunks) replace each with `REDACTED`; the transports apply them to error bodies
  (every secret) and to any body of a request that carried a key (that key);
* the headers: `redacted_headers` replaces each secret in any header value
  (``Location``, ``Set-Cookie``, ``WWW-Authenticate``, ``x-*``: headers are small,
  so every secret is looked for in every header of every answer, whatever its
  status) with `REDACTED_PART` (ASCII: a header value).
"""

from __future__ import annotations

from collections.abc import Iterable
from urllib.parse import urlsplit

__all__ = [
    "MIN_SECRET",
    "REDACTED",
    "REDACTED_PART",
    "SECRET_PARAMS",
    "Redactor",
    "redact",
    "redact_url",
    "redacted_headers",
]

#: what a secret part of a URL, or a secret in a header value, is replaced with
REDACTED_PART = "REDACTED"
#: what a known secret is replaced with in an upstream answer's body
REDACTED = "sk-…REDACTED"
_REDACTED = REDACTED.encode()
#: secrets shorter than this are not searched for (they would match ordinary text)
MIN_SECRET = 8
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


# -- the relay's own secrets in what an upstream answers --------------------------------


def _needles(secrets: Iterable[str]) -> list[bytes]:
    found = {s.encode() for s in secrets if s and len(s) >= MIN_SECRET}
    return sorted(found, key=len, reverse=True)  # a longer secret containing a shorter first


def redact(body: bytes, secrets: Iterable[str]) -> bytes:
    """``body`` with every known secret (injected keys, the token) replaced by
    ``sk-…REDACTED``.  Pure; ``config.secrets()`` lists the secrets."""
    for needle in _needles(secrets):
        if needle in body:
            body = body.replace(needle, _REDACTED)
    return body


class Redactor:
    """`redact` for a body that arrives in chunks (a secret may straddle two).

    ``feed`` returns what can be sent now; it holds back only the end of the data
    that could be the start of a secret (the longest suffix that is a prefix of
    one), until the next chunk or ``flush``: an SSE chunk that ends its event with a
    blank line is sent whole.  With no secret it returns every chunk unchanged.
    """

    __slots__ = ("_bytes", "_needles", "_tail")

    def __init__(self, secrets: Iterable[str]) -> None:
        self._needles = _needles(secrets)
        #: every byte value of every secret: data that ends in another byte (an SSE
        #: chunk ends in a newline) cannot end with the start of one
        self._bytes = frozenset(b for n in self._needles for b in n)
        self._tail = b""

    @property
    def active(self) -> bool:
        """Whether it may change the bytes (then a Content-Length cannot be kept)."""
        return bool(self._needles)

    def feed(self, chunk: bytes) -> bytes:
        if not self._needles:
            return chunk
        data = self._tail + chunk if self._tail else chunk
        cut = self._cut(data) if data and data[-1] in self._bytes else len(data)
        if cut < len(data):
            self._tail = data[cut:]
            data = data[:cut]
        else:
            self._tail = b""
        for needle in self._needles:
            if needle in data:
                data = data.replace(needle, _REDACTED)
        return data

    def _cut(self, data: bytes) -> int:
        """Where what may be sent now ends: before the longest end of ``data`` that could
        begin a secret, and before any secret that would straddle that point."""
        n = len(data)
        cut = n
        for needle in self._needles:  # the longest end that is the start of a secret
            # A candidate of 3 bytes or more starts with the secret's first 3 (rare in
            # text: one search); one of 1 or 2 bytes is the very end of the data.
            head = needle[:3]
            i = data.find(head, max(0, n - len(needle) + 1))
            while 0 <= i < cut:
                if needle.startswith(data[i:]):
                    cut = i
                    break
                i = data.find(head, i + 1)
            if cut > n - 2 and data.endswith(needle[:2]):
                cut = n - 2
            elif cut > n - 1 and data.endswith(needle[:1]):
                cut = n - 1
        moved = cut < n
        while moved:  # a whole secret across the cut: hold it back whole
            moved = False
            for needle in self._needles:
                i = data.find(needle, max(0, cut - len(needle) + 1))
                if 0 <= i < cut:
                    cut, moved = i, True
        return cut

    def flush(self) -> bytes:
        tail, self._tail = self._tail, b""
        for needle in self._needles:
            if needle in tail:
                tail = tail.replace(needle, _REDACTED)
        return tail


def redacted_headers(
    headers: Iterable[tuple[str, str]], secrets: Iterable[str]
) -> list[tuple[str, str]] | None:
    """``headers`` with every secret (of at least `MIN_SECRET` characters) in a value
    replaced by `REDACTED_PART`, or None when none holds one (the common case: the
    caller keeps its headers as they are).  Names are kept; order and repeats too."""
    needles = sorted({s for s in secrets if s and len(s) >= MIN_SECRET}, key=len, reverse=True)
    if not needles:
        return None
    pairs = list(headers)
    changed = False
    for i, (name, value) in enumerate(pairs):
        clean = value
        for needle in needles:  # a longer secret containing a shorter one first
            if needle in clean:
                clean = clean.replace(needle, REDACTED_PART)
        if clean is not value:
            pairs[i] = (name, clean)
            changed = True
    return pairs if changed else None
