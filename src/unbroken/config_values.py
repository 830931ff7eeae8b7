"""Single values in settings, checked: URLs, hosts, ports, origins; and `ConfigError`,
what every check of the configuration raises (``unbroken.config`` re-exports it)."""

from __future__ import annotations

import argparse
import ipaddress
import re
import unicodedata
from typing import Any
from urllib.parse import urlsplit

__all__ = [
    "ConfigError",
    "check_host",
    "check_host_pattern",
    "check_origin",
    "is_loopback_host",
    "normalise_origin",
    "port_number",
    "validate_http_url",
    "validate_url",
]

_HOST_NAME = re.compile(r"[A-Za-z0-9._~-]+")
_URL_PATH = re.compile(r"(?:[A-Za-z0-9._~!$&'()*+,;=:@/-]|%[0-9A-Fa-f]{2})*")


class ConfigError(ValueError):
    """Invalid configuration; ``key`` names the offending setting."""

    def __init__(self, key: str, message: str) -> None:
        super().__init__(f"{key}: {message}")
        self.key = key


def _bad_char(text: str) -> str | None:
    """The first whitespace, control or invisible format character of ``text``, if any."""
    for ch in text:
        if ch.isspace() or unicodedata.category(ch) in ("Cc", "Cf", "Zl", "Zp", "Zs"):
            return ch
    return None


def validate_url(
    key: str, url: Any, *, schemes: tuple[str, ...] = ("http", "https", "ws", "wss")
) -> str:
    """A base URL, parsed strictly; returned without its trailing slashes.

    One of ``schemes``, a host, an optional port and path; no credentials, query,
    fragment, whitespace or control character.  The path must already be in its
    percent-encoded form: it is joined to request paths byte for byte.
    """
    if not isinstance(url, str):
        raise ConfigError(key, f"expected a URL string, got {url!r}")
    wanted = " or ".join(f"{s}://" for s in schemes)
    bad = _bad_char(url)
    if bad is not None:
        raise ConfigError(
            key,
            f"a URL may not contain whitespace or control characters (found {bad!r} in {url!r})",
        )
    try:
        parts = urlsplit(url)
        host = parts.hostname
        port = parts.port
    except ValueError as exc:
        raise ConfigError(key, f"not a valid URL ({exc}): {url!r}") from None
    if parts.scheme.lower() not in schemes or not host:
        raise ConfigError(key, f"expected an {wanted} URL, got {url!r}")
    if "@" in parts.netloc:
        # Credentials in a URL would leak into logs and status: keys go in api_key_env.
        raise ConfigError(key, "credentials in the URL are not allowed; use api_key_env")
    if parts.query or parts.fragment or "?" in url or "#" in url:
        raise ConfigError(key, "a base URL may not carry a query or fragment")
    if parts.netloc.startswith("["):
        try:
            ipaddress.IPv6Address(host.split("%", 1)[0])
        except ValueError:
            raise ConfigError(key, f"bad IPv6 address in {url!r}") from None
    elif not _HOST_NAME.fullmatch(host):
        raise ConfigError(key, f"bad host name {host!r} (use its ASCII/punycode form)")
    if port is None and parts.netloc.endswith(":"):
        raise ConfigError(key, f"empty port in {url!r}")
    if port == 0:
        raise ConfigError(key, f"bad port in {url!r}")
    if not _URL_PATH.fullmatch(parts.path):
        raise ConfigError(key, f"the path of {url!r} must be percent-encoded")
    return url.rstrip("/")


def validate_http_url(key: str, url: Any) -> str:
    """`validate_url` for an http:// or https:// URL (where clients reach the relay)."""
    return validate_url(key, url, schemes=("http", "https"))


def port_number(text: str) -> int:
    """An argparse ``type``: a TCP port, 0-65535 (0: any free port)."""
    try:
        value = int(text.strip(), 10)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a port number 0-65535, got {text!r}") from None
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"expected a port number 0-65535, got {text!r}")
    return value


def check_host(key: str, host: str) -> str:
    """A listen address: no whitespace or URL syntax; ``""`` means loopback."""
    value = host.strip()
    if _bad_char(value) is not None or any(c in value for c in "/?#@"):
        raise ConfigError(key, f"expected an address or host name, got {host!r}")
    return value or "127.0.0.1"


def is_loopback_host(host: str) -> bool:
    """Whether a listen address is loopback only (``""`` counts: it means loopback here)."""
    h = host.strip().strip("[]").lower()
    if h in ("", "localhost", "localhost."):
        return True
    try:
        return ipaddress.ip_address(h.split("%", 1)[0]).is_loopback
    except ValueError:
        return False


def check_host_pattern(key: str, raw: str) -> str:
    value = raw.strip().lower()
    if value == "*":
        return value
    bad = _bad_char(raw)
    if not value or bad is not None or any(c in value for c in "/?#@\\"):
        raise ConfigError(key, f"expected a host name, host:port or '*', got {raw!r}")
    try:
        parts = urlsplit(f"http://{value}")
        host = parts.hostname
        parts.port  # noqa: B018 - raises on a bad port
    except ValueError:
        host = None
    if not host:
        raise ConfigError(key, f"expected a host name, host:port or '*', got {raw!r}")
    return value


def normalise_origin(raw: str) -> str | None:
    """``scheme://host[:port]`` in canonical form (lower case, no default port), or None."""
    try:
        parts = urlsplit(raw.strip())
        host, port = parts.hostname, parts.port
    except ValueError:
        return None
    scheme = parts.scheme.lower()
    if not scheme or not host or parts.path or parts.query or parts.fragment:
        return None
    if "@" in parts.netloc or _bad_char(raw.strip()) is not None:
        return None
    if (scheme, port) in (("http", 80), ("https", 443)):
        port = None
    shown = f"[{host}]" if ":" in host else host
    return f"{scheme}://{shown}" + (f":{port}" if port is not None else "")


def check_origin(key: str, raw: str) -> str:
    value = normalise_origin(raw)
    if value is None:
        raise ConfigError(key, f"expected an origin like https://app.example.com, got {raw!r}")
    return value
