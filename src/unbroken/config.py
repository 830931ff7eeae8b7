"""Configuration: one TOML file, environment overrides, built-in routes.

Every error names the offending key (``retry.delay_ms``,
``routes.backup.upstreams[1].url``) so ``unbroken serve`` can exit 2 before
anything starts.  Secrets are read from the environment and never appear in
any repr, message or log.
"""

from __future__ import annotations

import math
import os
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from unbroken.core.ledger import HOLD_CHOICES
from unbroken.core.policy import RetryPolicy

__all__ = [
    "BUILTIN_ROUTES",
    "Config",
    "ConfigError",
    "JournalSettings",
    "Route",
    "Upstream",
    "load_config",
]

BUILTIN_ROUTES: dict[str, str] = {
    "openai": "https://api.openai.com",
    "anthropic": "https://api.anthropic.com",
    "openrouter": "https://openrouter.ai/api",
    "groq": "https://api.groq.com/openai",
    "deepseek": "https://api.deepseek.com",
    "mistral": "https://api.mistral.ai",
}

# Environment overrides: (config key, UNBROKEN_ name, opencode-retry-forever alias)
ENV_OVERRIDES: tuple[tuple[str, str, str], ...] = (
    ("delay_ms", "UNBROKEN_RETRY_DELAY_MS", "OPENCODE_RETRY_DELAY_MS"),
    ("max_attempts", "UNBROKEN_RETRY_MAX_ATTEMPTS", "OPENCODE_RETRY_MAX_ATTEMPTS"),
    ("honor_retry_after", "UNBROKEN_RETRY_HONOR_RETRY_AFTER", "OPENCODE_RETRY_HONOR_RETRY_AFTER"),
    (
        "max_retry_after_ms",
        "UNBROKEN_RETRY_MAX_RETRY_AFTER_MS",
        "OPENCODE_RETRY_MAX_RETRY_AFTER_MS",
    ),
    ("verbose", "UNBROKEN_RETRY_VERBOSE", "OPENCODE_RETRY_VERBOSE"),
)


class ConfigError(ValueError):
    """Invalid configuration; ``key`` names the offending setting."""

    def __init__(self, key: str, message: str) -> None:
        super().__init__(f"{key}: {message}")
        self.key = key


@dataclass(frozen=True)
class Upstream:
    url: str  # no trailing slash
    api_key_env: str | None = None
    models: Mapping[str, str] = field(default_factory=dict)
    api_key: str | None = field(default=None, repr=False, compare=False)

    @property
    def name(self) -> str:
        """A log-safe label: scheme://host[:port][/path] (URLs never carry credentials)."""
        return self.url


@dataclass(frozen=True)
class Route:
    name: str
    upstreams: tuple[Upstream, ...]
    builtin: bool = False


@dataclass(frozen=True)
class StreamSettings:
    hold: tuple[str, ...] = ("control", "tool_calls")
    max_hold_bytes: int = 8 * 1024 * 1024
    connect_timeout_s: float = 10.0
    header_timeout_s: float = 120.0
    first_frame_timeout_s: float = 300.0
    idle_timeout_s: float = 120.0
    keepalive_s: float = 15.0
    early_headers_s: float = 20.0


@dataclass(frozen=True)
class JournalSettings:
    enabled: bool = True
    #: None: ``$XDG_STATE_HOME/unbroken/journal.sqlite3``, resolved when the journal opens
    path: str | None = None
    retention_days: float = 14.0  # 0 keeps every row


@dataclass(frozen=True)
class Config:
    host: str = "127.0.0.1"
    port: int = 4780
    grace_s: float = 30.0
    retry: RetryPolicy = field(default_factory=RetryPolicy)
    verbose: bool = True
    max_body_mb: float = 32
    stream: StreamSettings = field(default_factory=StreamSettings)
    routes: Mapping[str, Route] = field(default_factory=dict)
    #: after an upstream refuses WebSocket, serve its turns over HTTP this long
    websocket_fallback_cooldown_s: float = 300.0
    journal: JournalSettings = field(default_factory=JournalSettings)

    @property
    def max_body_bytes(self) -> int:
        return int(self.max_body_mb * 1024 * 1024)


# -- schema ----------------------------------------------------------------------
_INT, _FLOAT, _BOOL, _STR = "an integer", "a number", "a boolean", "a string"

SERVER_KEYS: dict[str, str] = {"host": _STR, "port": _INT, "grace_s": _FLOAT}
RETRY_KEYS: dict[str, str] = {
    "delay_ms": _INT,
    "backoff": _STR,
    "max_delay_ms": _INT,
    "max_attempts": _INT,
    "honor_retry_after": _BOOL,
    "max_retry_after_ms": _INT,
    "verbose": _BOOL,
    "max_body_mb": _FLOAT,
}
STREAM_KEYS: dict[str, str] = {
    "hold": "a list of strings",
    "max_hold_bytes": _INT,
    "connect_timeout_s": _FLOAT,
    "header_timeout_s": _FLOAT,
    "first_frame_timeout_s": _FLOAT,
    "idle_timeout_s": _FLOAT,
    "keepalive_s": _FLOAT,
    "early_headers_s": _FLOAT,
}
WEBSOCKET_KEYS: dict[str, str] = {"fallback_cooldown_s": _FLOAT}
JOURNAL_KEYS: dict[str, str] = {"enabled": _BOOL, "path": _STR, "retention_days": _FLOAT}
UPSTREAM_KEYS = {"url", "api_key_env", "models"}
SECTIONS = {"server", "retry", "stream", "websocket", "journal", "routes"}


def _check(key: str, value: Any, kind: str) -> Any:
    ok = {
        _INT: isinstance(value, int) and not isinstance(value, bool),
        _FLOAT: isinstance(value, (int, float)) and not isinstance(value, bool),
        _BOOL: isinstance(value, bool),
        _STR: isinstance(value, str),
    }.get(kind, True)
    if not ok:
        raise ConfigError(key, f"expected {kind}, got {value!r}")
    if kind in (_INT, _FLOAT) and not math.isfinite(value):
        raise ConfigError(key, f"must be a finite number, got {value!r}")
    if kind in (_INT, _FLOAT) and value < 0:
        raise ConfigError(key, f"must not be negative, got {value!r}")
    return value


def _table(key: str, value: Any) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise ConfigError(key, f"expected a table, got {value!r}")
    return value


def _section(data: dict[str, Any], name: str, schema: dict[str, str]) -> dict[str, Any]:
    table = _table(name, data.get(name, {}))
    out: dict[str, Any] = {}
    for k, v in table.items():
        if k not in schema:
            known = ", ".join(sorted(schema))
            raise ConfigError(f"{name}.{k}", f"unknown key (known: {known})")
        out[k] = _check(f"{name}.{k}", v, schema[k])
    return out


def _parse_bool(key: str, raw: str) -> bool:
    low = raw.strip().lower()
    if low in ("1", "true", "yes", "on"):
        return True
    if low in ("0", "false", "no", "off"):
        return False
    raise ConfigError(key, f"expected true/false, got {raw!r}")


def _parse_int(key: str, raw: str) -> int:
    try:
        value = int(raw.strip())
    except ValueError:
        raise ConfigError(key, f"expected an integer, got {raw!r}") from None
    if value < 0:
        raise ConfigError(key, f"must not be negative, got {raw!r}")
    return value


def _env_overrides(retry: dict[str, Any], env: Mapping[str, str]) -> None:
    for key, name, alias in ENV_OVERRIDES:
        for var in (alias, name):  # UNBROKEN_ wins: applied last
            raw = env.get(var)
            if raw is None or raw == "":
                continue
            kind = RETRY_KEYS[key]
            retry[key] = _parse_bool(var, raw) if kind == _BOOL else _parse_int(var, raw)


def validate_url(key: str, url: Any) -> str:
    if not isinstance(url, str):
        raise ConfigError(key, f"expected a URL string, got {url!r}")
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ConfigError(key, f"expected an http:// or https:// URL, got {url!r}")
    if parts.query or parts.fragment:
        raise ConfigError(key, "a base URL may not carry a query or fragment")
    if parts.username is not None or parts.password is not None:
        # Credentials in a URL would leak into logs and status: keys go in api_key_env.
        raise ConfigError(key, "credentials in the URL are not allowed; use api_key_env")
    try:
        parts.port  # noqa: B018 - raises on a bad port
    except ValueError:
        raise ConfigError(key, f"bad port in {url!r}") from None
    return url.rstrip("/")


def _upstream(key: str, raw: Any, env: Mapping[str, str]) -> Upstream:
    if isinstance(raw, str):
        raw = {"url": raw}
    table = _table(key, raw)
    for k in table:
        if k not in UPSTREAM_KEYS:
            known = ", ".join(sorted(UPSTREAM_KEYS))
            raise ConfigError(f"{key}.{k}", f"unknown key (known: {known})")
    if "url" not in table:
        raise ConfigError(f"{key}.url", "missing")
    url = validate_url(f"{key}.url", table["url"])
    key_env = table.get("api_key_env")
    api_key = None
    if key_env is not None:
        _check(f"{key}.api_key_env", key_env, _STR)
        api_key = env.get(key_env)
        if not api_key:
            raise ConfigError(f"{key}.api_key_env", f"environment variable {key_env} is not set")
    models = _table(f"{key}.models", table.get("models", {}))
    for m, target in models.items():
        _check(f"{key}.models.{m}", target, _STR)
    return Upstream(url=url, api_key_env=key_env, models=dict(models), api_key=api_key)


def _routes(data: dict[str, Any], env: Mapping[str, str]) -> dict[str, Route]:
    routes = {
        name: Route(name, (Upstream(url=url),), builtin=True)
        for name, url in BUILTIN_ROUTES.items()
    }
    for name, raw in _table("routes", data.get("routes", {})).items():
        key = f"routes.{name}"
        if not name or "/" in name or name.startswith("_"):
            raise ConfigError(key, "a route name is one path segment, not starting with '_'")
        table = _table(key, raw)
        for k in table:
            if k != "upstreams":
                raise ConfigError(f"{key}.{k}", "unknown key (known: upstreams)")
        ups = table.get("upstreams")
        if not isinstance(ups, list) or not ups:
            raise ConfigError(f"{key}.upstreams", "expected a non-empty list of upstreams")
        routes[name] = Route(
            name, tuple(_upstream(f"{key}.upstreams[{i}]", u, env) for i, u in enumerate(ups))
        )
    return routes


def parse_config(data: dict[str, Any], env: Mapping[str, str] | None = None) -> Config:
    """Build a `Config` from parsed TOML data plus environment overrides."""
    env = os.environ if env is None else env
    for section in data:
        if section not in SECTIONS:
            raise ConfigError(section, f"unknown section (known: {', '.join(sorted(SECTIONS))})")
    server = _section(data, "server", SERVER_KEYS)
    retry = _section(data, "retry", RETRY_KEYS)
    stream = _section(data, "stream", STREAM_KEYS)
    websocket = _section(data, "websocket", WEBSOCKET_KEYS)
    journal = _section(data, "journal", JOURNAL_KEYS)
    _env_overrides(retry, env)

    backoff = retry.get("backoff", "fixed")
    if backoff not in ("fixed", "exponential"):
        raise ConfigError("retry.backoff", f"expected 'fixed' or 'exponential', got {backoff!r}")
    hold = stream.get("hold", ["control", "tool_calls"])
    if not isinstance(hold, list) or not all(isinstance(h, str) for h in hold):
        raise ConfigError("stream.hold", f"expected a list of strings, got {hold!r}")
    bad = [h for h in hold if h not in HOLD_CHOICES]
    if bad:
        known = sorted(HOLD_CHOICES)
        raise ConfigError("stream.hold", f"unknown choice {bad[0]!r} (known: {known})")
    for k in ("connect_timeout_s", "header_timeout_s", "first_frame_timeout_s", "idle_timeout_s",
              "keepalive_s"):
        if k in stream and stream[k] <= 0:
            raise ConfigError(f"stream.{k}", "must be greater than 0")
    journal_path = journal.get("path")
    if journal_path is not None and not journal_path.strip():
        raise ConfigError("journal.path", "must not be empty")
    port = server.get("port", 4780)
    if not 0 <= port <= 65535:
        raise ConfigError("server.port", f"expected 0..65535, got {port}")
    policy = RetryPolicy(
        delay_ms=retry.get("delay_ms", 250),
        backoff=backoff,
        max_delay_ms=retry.get("max_delay_ms", 30_000),
        max_attempts=retry.get("max_attempts", 0),
        honor_retry_after=retry.get("honor_retry_after", True),
        max_retry_after_ms=retry.get("max_retry_after_ms", 60_000),
    )
    stream_settings = StreamSettings(**{**stream, "hold": tuple(hold)})
    return Config(
        host=server.get("host", "127.0.0.1"),
        port=port,
        grace_s=float(server.get("grace_s", 30.0)),
        retry=policy,
        verbose=retry.get("verbose", True),
        max_body_mb=retry.get("max_body_mb", 32),
        stream=stream_settings,
        routes=_routes(data, env),
        websocket_fallback_cooldown_s=float(websocket.get("fallback_cooldown_s", 300.0)),
        journal=JournalSettings(
            enabled=journal.get("enabled", True),
            path=None if journal_path is None else os.path.expanduser(journal_path),
            retention_days=float(journal.get("retention_days", 14.0)),
        ),
    )


def load_config(
    path: str | os.PathLike[str] | None = None, env: Mapping[str, str] | None = None
) -> Config:
    """Load the config file (``--config`` or ``UNBROKEN_CONFIG``), or the defaults."""
    env = os.environ if env is None else env
    if path is None:
        path = env.get("UNBROKEN_CONFIG") or None
    data: dict[str, Any] = {}
    if path is not None:
        p = Path(path)
        try:
            text = p.read_text(encoding="utf-8")
        except OSError as exc:
            raise ConfigError("--config", f"cannot read {p}: {exc.strerror}") from None
        try:
            data = tomllib.loads(text)
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(str(p), f"invalid TOML: {exc}") from None
    return parse_config(data, env)
