"""Configuration: one TOML file, environment overrides, built-in routes.

Every error names the offending key (``retry.delay_ms``,
``routes.backup.upstreams[1].url``) so ``unbroken serve`` can exit 2 before
anything starts.  Secrets are read from the environment and never appear in
any repr, message or log.
"""

from __future__ import annotations

import functools
import math
import os
import re
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from unbroken.config_values import (
    ConfigError,
    check_host,
    check_host_pattern,
    check_origin,
    is_loopback_host,
    validate_url,
)
from unbroken.core.admission.health import HealthSettings
from unbroken.core.admission.policy import RetryPolicy
from unbroken.core.admission.ratelimit import RateSettings
from unbroken.core.profiles import check_overrides
from unbroken.core.turn.continuation import (
    AFTER_COMMIT_CHOICES,
    DEFAULT_MAX_SPLICES,
    DEFAULT_QUEUED_S,
)
from unbroken.core.turn.ledger import HOLD_CHOICES
from unbroken.core.wire.protocols.anthropic_continue import AnthropicContinue
from unbroken.core.wire.protocols.chat_prefix import ChatPrefix
from unbroken.core.wire.redact import redact_url

__all__ = [
    "BUILTIN_ROUTES",
    "TOKEN_ENV",
    "Config",
    "ConfigError",
    "JournalSettings",
    "Route",
    "Upstream",
    "bind_problem",
    "load_config",
]

BUILTIN_ROUTES: dict[str, str] = {
    "openai": "https://api.openai.com",
    "anthropic": "https://api.anthropic.com",
    "openrouter": "https://openrouter.ai/api",
    "groq": "https://api.groq.com/openai",
    "deepseek": "https://api.deepseek.com",
    "mistral": "https://api.mistral.ai",
    "gemini": "https://generativelanguage.googleapis.com",
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


#: The token clients must send (``x-unbroken-token``) when ``[server] token_env`` is unset.
TOKEN_ENV = "UNBROKEN_TOKEN"
#: A route name: one plain path segment.
_ROUTE_NAME = re.compile(r"[A-Za-z0-9._-]+")
#: Route names the relay itself answers on (``/t/<token>/...``, ``/healthz``, ...).
RESERVED_ROUTES = frozenset({"t", "healthz", "status", "metrics", "ui"})
_TOKEN = re.compile(r"[A-Za-z0-9._~-]{16,512}")
_HEADER_NAME = re.compile(r"[!#$%&'*+.^_`|~0-9A-Za-z-]+")  # RFC 9110 token


@dataclass(frozen=True)
class Upstream:
    url: str  # no trailing slash
    api_key_env: str | None = None
    models: Mapping[str, str] = field(default_factory=dict)
    api_key: str | None = field(default=None, repr=False, compare=False)
    #: further headers that carry a credential for this provider (lower case): with
    #: ``api_key_env`` set, the client's values are dropped like ``authorization``'s
    key_headers: tuple[str, ...] = ()

    @property
    def name(self) -> str:
        """A log-safe label: scheme://host[:port][/path], a ``/t/<token>`` segment of the
        path redacted (a chain to another unbroken); URLs never carry credentials."""
        return redact_url(self.url)


@dataclass(frozen=True)
class Route:
    name: str
    upstreams: tuple[Upstream, ...]
    builtin: bool = False
    #: ``[routes.NAME] after_commit``: overrides ``[stream] after_commit`` (None: it)
    after_commit: str | None = None
    #: ``[routes.NAME] chat_prefix``: the upstream's documented Chat Completions prefix
    #: mode (``prefix``, ``prefix_echo``, ``partial``; `core.wire.protocols.chat_prefix`),
    #: which a Chat turn cut after commit is continued with; None: it ends as today
    chat_prefix: str | None = None
    #: ``[routes.NAME] anthropic_continue``: how a Messages turn cut after commit is
    #: continued: ``prefill`` (None: the default) or ``user_message`` (for models that
    #: refuse prefill, Claude 4.6 and later; `core.wire.protocols.anthropic_continue`)
    anthropic_continue: str | None = None

    @property
    def injects_key(self) -> bool:
        """Whether a request on this route may go upstream with a key of the relay's
        (``api_key_env``): then it needs the relay's token (`relay.access`)."""
        return any(u.api_key is not None for u in self.upstreams)


def with_upstream(existing: Route | None, name: str, url: str) -> Route:
    """The route ``name`` going to ``url`` alone (``unbroken run`` points a route at the
    agent's own base URL): a user's own route of that name keeps its settings
    (``after_commit``, ``chat_prefix``, ``anthropic_continue``); only its upstreams are
    replaced."""
    if existing is None or existing.builtin:
        return Route(name, (Upstream(url=url),))
    return replace(existing, upstreams=(Upstream(url=url),))


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
    #: an upstream SSE event larger than this fails the attempt (`EventTooLarge`)
    max_event_bytes: int = 16 * 1024 * 1024
    #: a cut after commit: ``error`` (the native retryable error) or ``continue``
    #: (finish the turn in place where a mechanism allows, `core.turn.continuation`)
    after_commit: str = "error"
    #: the continuations one turn may make (``after_commit = "continue"``)
    max_splices: int = DEFAULT_MAX_SPLICES
    #: a continuation with no progress this long (stuck in ``queued``) is given up
    resume_queued_s: float = DEFAULT_QUEUED_S

    def after_commit_for(self, route: Route) -> str:
        """The route's ``after_commit`` (its own, else this section's)."""
        return route.after_commit or self.after_commit


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
    #: client messages a WebSocket connection may have queued, unprocessed (then 1008)
    websocket_max_queued_messages: int = 16
    journal: JournalSettings = field(default_factory=JournalSettings)
    #: ``[clients.<name>]``: overrides of a client profile (`core.profiles`), validated
    clients: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    health: HealthSettings = field(default_factory=HealthSettings)
    #: ``[ratelimit]``: admission by the providers' rate limits (`core.admission.ratelimit`)
    ratelimit: RateSettings = field(default_factory=RateSettings)
    #: the secret every request must carry (``x-unbroken-token`` or ``/t/<token>/``);
    #: None: no token (loopback only)
    token: str | None = field(default=None, repr=False, compare=False)
    #: where the token came from (an environment variable name), for messages
    token_env: str | None = None
    #: with no ``token``: the secret a route that injects a key needs (`unbroken serve`
    #: keeps it in a 0600 file, `relay.tokenfile`); other routes stay open on loopback
    key_token: str | None = field(default=None, repr=False, compare=False)
    #: extra ``Host`` values accepted (``name`` matches any port, ``name:port`` only
    #: that port, ``*`` any host); the bound address, localhost and 127.0.0.1 always are
    allowed_hosts: tuple[str, ...] = ()
    #: ``Origin`` values accepted (``scheme://host[:port]``); any other Origin gets 403
    allowed_origins: tuple[str, ...] = ()
    #: a client must send a request's complete headers within this time
    header_read_timeout_s: float = 10.0
    #: an idle keep-alive client connection is closed after this long
    keepalive_timeout_s: float = 75.0
    #: client connections served at once; beyond, new connections get 503
    max_connections: int = 1024

    @functools.cached_property
    def max_body_bytes(self) -> int:
        # (cached: read twice a turn; a frozen dataclass's __dict__ takes it all the same)
        return int(self.max_body_mb * 1024 * 1024)

    def secrets(self) -> tuple[str, ...]:
        """Every secret the relay knows (injected keys, the token): never echoed or logged."""
        found = {u.api_key for r in self.routes.values() for u in r.upstreams if u.api_key}
        found.update(t for t in (self.token, self.key_token) if t)
        return tuple(sorted(found, key=len, reverse=True))

    @property
    def injects_keys(self) -> bool:
        """Whether any route injects a key of the relay's (`Route.injects_key`)."""
        return any(r.injects_key for r in self.routes.values())


# -- schema ----------------------------------------------------------------------
_INT, _FLOAT, _BOOL, _STR = "an integer", "a number", "a boolean", "a string"

_STRS = "a list of strings"
SERVER_KEYS: dict[str, str] = {
    "host": _STR,
    "port": _INT,
    "grace_s": _FLOAT,
    "token_env": _STR,
    "allowed_hosts": _STRS,
    "allowed_origins": _STRS,
    "header_read_timeout_s": _FLOAT,
    "keepalive_timeout_s": _FLOAT,
    "max_connections": _INT,
}
RETRY_KEYS: dict[str, str] = {
    "delay_ms": _INT,
    "backoff": _STR,
    "max_delay_ms": _INT,
    "max_attempts": _INT,
    "honor_retry_after": _BOOL,
    "max_retry_after_ms": _INT,
    "pace_floor_per_s": _FLOAT,
    "pace_ratio": _FLOAT,
    "pace_burst": _FLOAT,
    "verbose": _BOOL,
    "max_body_mb": _FLOAT,
}
#: keys from before the retry pacer, still accepted: ``budget_percent`` sets
#: ``pace_ratio`` (its share / 100); ``min_retry_concurrency`` is ignored (the
#: pacer's floor keeps retries going)
RETIRED_RETRY_KEYS: dict[str, str] = {"budget_percent": _FLOAT, "min_retry_concurrency": _INT}
STREAM_KEYS: dict[str, str] = {
    "hold": "a list of strings",
    "max_hold_bytes": _INT,
    "connect_timeout_s": _FLOAT,
    "header_timeout_s": _FLOAT,
    "first_frame_timeout_s": _FLOAT,
    "idle_timeout_s": _FLOAT,
    "keepalive_s": _FLOAT,
    "early_headers_s": _FLOAT,
    "max_event_bytes": _INT,
    "after_commit": _STR,
    "max_splices": _INT,
    "resume_queued_s": _FLOAT,
}
WEBSOCKET_KEYS: dict[str, str] = {"fallback_cooldown_s": _FLOAT, "max_queued_messages": _INT}
JOURNAL_KEYS: dict[str, str] = {"enabled": _BOOL, "path": _STR, "retention_days": _FLOAT}
HEALTH_KEYS: dict[str, str] = {
    "breakers": _BOOL,
    "failures_to_open": _INT,
    "failure_rate_to_open": _FLOAT,
    "window_s": _FLOAT,
    "min_window_attempts": _INT,
    "open_s": _FLOAT,
    "max_open_s": _FLOAT,
    "quota_cooloff_s": _FLOAT,
    "probe_timeout_s": _FLOAT,
    "park_check_s": _FLOAT,
    "store": _STR,
}
RATELIMIT_KEYS: dict[str, str] = {
    "enabled": _BOOL,
    "max_wait_s": _FLOAT,
    "max_concurrency": _INT,
    "decrease": _FLOAT,
    "cold_start": _INT,
}
UPSTREAM_KEYS = {"url", "api_key_env", "models", "key_headers"}
SECTIONS = {
    "server",
    "retry",
    "stream",
    "websocket",
    "journal",
    "clients",
    "health",
    "ratelimit",
    "routes",
}


def _check(key: str, value: Any, kind: str) -> Any:
    ok = {
        _INT: isinstance(value, int) and not isinstance(value, bool),
        _FLOAT: isinstance(value, (int, float)) and not isinstance(value, bool),
        _BOOL: isinstance(value, bool),
        _STR: isinstance(value, str),
        _STRS: isinstance(value, list) and all(isinstance(v, str) for v in value),
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


def bind_problem(config: Config) -> str | None:
    """Why ``config`` must not be served, or None: off loopback, a token is required."""
    if is_loopback_host(config.host) or config.token:
        return None
    return (
        f"refusing to listen on {config.host!r} (not loopback) without a token: set "
        f"{TOKEN_ENV} (or [server] token_env) to a random string of 16+ characters "
        "[A-Za-z0-9._~-], e.g. $(python3 -c 'import secrets; print(secrets.token_urlsafe(32))'),"
        " and have clients send it as the x-unbroken-token header"
    )


def _token(server: dict[str, Any], env: Mapping[str, str]) -> tuple[str | None, str | None]:
    name = server.get("token_env")
    if name is not None:
        if not name.strip():
            raise ConfigError("server.token_env", "must name an environment variable")
        value = env.get(name)
        if not value:
            raise ConfigError("server.token_env", f"environment variable {name} is not set")
        key = f"server.token_env ({name})"
    else:
        name = TOKEN_ENV
        value = env.get(name) or None
        if value is None:
            return None, None
        key = name
    if not _TOKEN.fullmatch(value):
        # Never echo the value: it is a secret.
        raise ConfigError(
            key,
            "the token must be 16 to 512 characters from [A-Za-z0-9._~-] "
            "(it travels in a header and in /t/<token>/ URLs)",
        )
    return value, name


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
    headers = _check(f"{key}.key_headers", table.get("key_headers", []), _STRS)
    for h in headers:
        if not _HEADER_NAME.fullmatch(h):
            raise ConfigError(f"{key}.key_headers", f"not a header name: {h!r}")
    return Upstream(
        url=url,
        api_key_env=key_env,
        models=dict(models),
        api_key=api_key,
        key_headers=tuple(h.lower() for h in headers),
    )


def _routes(data: dict[str, Any], env: Mapping[str, str]) -> dict[str, Route]:
    routes = {
        name: Route(name, (Upstream(url=url),), builtin=True)
        for name, url in BUILTIN_ROUTES.items()
    }
    for name, raw in _table("routes", data.get("routes", {})).items():
        key = f"routes.{name}"
        if not _ROUTE_NAME.fullmatch(name) or name in (".", "..") or name.startswith("_"):
            raise ConfigError(
                key,
                "a route name is made of A-Z a-z 0-9 . _ - (not '.' or '..', "
                "not starting with '_')",
            )
        if name in RESERVED_ROUTES:
            raise ConfigError(
                key, f"{name!r} is reserved (/t/<token>/, /healthz, /status, /metrics)"
            )
        table = _table(key, raw)
        for k in table:
            if k not in ("upstreams", "after_commit", "chat_prefix", "anthropic_continue"):
                raise ConfigError(
                    f"{key}.{k}",
                    "unknown key (known: after_commit, anthropic_continue, chat_prefix, upstreams)",
                )
        after_commit = None
        if "after_commit" in table:
            after_commit = _after_commit(f"{key}.after_commit", table["after_commit"])
        chat_prefix = None
        if "chat_prefix" in table:
            chat_prefix = _chat_prefix(f"{key}.chat_prefix", table["chat_prefix"])
        anthropic_continue = None
        if "anthropic_continue" in table:
            anthropic_continue = _anthropic_continue(
                f"{key}.anthropic_continue", table["anthropic_continue"]
            )
        ups = table.get("upstreams")
        if not isinstance(ups, list) or not ups:
            raise ConfigError(f"{key}.upstreams", "expected a non-empty list of upstreams")
        routes[name] = Route(
            name,
            tuple(_upstream(f"{key}.upstreams[{i}]", u, env) for i, u in enumerate(ups)),
            after_commit=after_commit,
            chat_prefix=chat_prefix,
            anthropic_continue=anthropic_continue,
        )
    return routes


def _chat_prefix(key: str, value: Any) -> str:
    choices = tuple(m.value for m in ChatPrefix)
    if value not in choices:
        raise ConfigError(key, f"expected {' or '.join(repr(c) for c in choices)}, got {value!r}")
    return str(value)


def _anthropic_continue(key: str, value: Any) -> str:
    choices = tuple(m.value for m in AnthropicContinue)
    if value not in choices:
        raise ConfigError(key, f"expected {' or '.join(repr(c) for c in choices)}, got {value!r}")
    return str(value)


def _after_commit(key: str, value: Any) -> str:
    if value not in AFTER_COMMIT_CHOICES:
        known = " or ".join(repr(c) for c in AFTER_COMMIT_CHOICES)
        raise ConfigError(key, f"expected {known}, got {value!r}")
    return str(value)


def _clients(data: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """``[clients.<name>]`` tables: each overrides fields of that client's profile."""
    out: dict[str, dict[str, Any]] = {}
    for name, table in _table("clients", data.get("clients", {})).items():
        key = f"clients.{name}"
        try:
            out[name] = check_overrides(name, _table(key, table))
        except ValueError as exc:
            raise ConfigError(key, str(exc)) from None
    return out


def parse_config(data: dict[str, Any], env: Mapping[str, str] | None = None) -> Config:
    """Build a `Config` from parsed TOML data plus environment overrides."""
    env = os.environ if env is None else env
    for section in data:
        if section not in SECTIONS:
            raise ConfigError(section, f"unknown section (known: {', '.join(sorted(SECTIONS))})")
    server = _section(data, "server", SERVER_KEYS)
    retry = _section(data, "retry", {**RETRY_KEYS, **RETIRED_RETRY_KEYS})
    stream = _section(data, "stream", STREAM_KEYS)
    websocket = _section(data, "websocket", WEBSOCKET_KEYS)
    journal = _section(data, "journal", JOURNAL_KEYS)
    health = _health(_section(data, "health", HEALTH_KEYS))
    ratelimit = _ratelimit(_section(data, "ratelimit", RATELIMIT_KEYS))
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
    for k in (
        "connect_timeout_s",
        "header_timeout_s",
        "first_frame_timeout_s",
        "idle_timeout_s",
        "keepalive_s",
    ):
        if k in stream and stream[k] <= 0:
            raise ConfigError(f"stream.{k}", "must be greater than 0")
    if "after_commit" in stream:
        _after_commit("stream.after_commit", stream["after_commit"])
    if stream.get("max_splices", 1) < 1:
        raise ConfigError("stream.max_splices", "must be at least 1")
    if stream.get("resume_queued_s", 1.0) <= 0:
        raise ConfigError("stream.resume_queued_s", "must be greater than 0")
    if stream.get("max_event_bytes", 1024) < 1024:
        raise ConfigError("stream.max_event_bytes", "must be at least 1024")
    for k in ("header_read_timeout_s", "keepalive_timeout_s"):
        if k in server and server[k] <= 0:
            raise ConfigError(f"server.{k}", "must be greater than 0")
    if server.get("max_connections", 1) < 1:
        raise ConfigError("server.max_connections", "must be at least 1")
    if websocket.get("max_queued_messages", 1) < 1:
        raise ConfigError("websocket.max_queued_messages", "must be at least 1")
    host = check_host("server.host", server.get("host", "127.0.0.1"))
    token, token_env = _token(server, env)
    allowed_hosts = tuple(
        check_host_pattern(f"server.allowed_hosts[{i}]", h)
        for i, h in enumerate(server.get("allowed_hosts", []))
    )
    allowed_origins = tuple(
        check_origin(f"server.allowed_origins[{i}]", o)
        for i, o in enumerate(server.get("allowed_origins", []))
    )
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
        pace_floor_per_s=float(retry.get("pace_floor_per_s", 0.0)),
        pace_ratio=float(retry.get("pace_ratio", _ratio_of_budget(retry))),
        pace_burst=float(retry.get("pace_burst", 10.0)),
    )
    if policy.delay_ms < 0:
        raise ConfigError("retry.delay_ms", "must be 0 or more")
    if policy.pace_floor_per_s < 0:
        raise ConfigError("retry.pace_floor_per_s", "must be 0 (1000 / delay_ms) or more")
    if policy.pace_ratio < 0:
        raise ConfigError("retry.pace_ratio", "must be 0 or more")
    if policy.pace_burst < 1:
        raise ConfigError("retry.pace_burst", "must be at least 1")
    if retry.get("min_retry_concurrency", 0) < 0:
        raise ConfigError("retry.min_retry_concurrency", "must be 0 or more")
    stream_settings = StreamSettings(**{**stream, "hold": tuple(hold)})
    return Config(
        host=host,  # an empty host means loopback, never "all interfaces"
        port=port,
        grace_s=float(server.get("grace_s", 30.0)),
        token=token,
        token_env=token_env,
        allowed_hosts=allowed_hosts,
        allowed_origins=allowed_origins,
        header_read_timeout_s=float(server.get("header_read_timeout_s", 10.0)),
        keepalive_timeout_s=float(server.get("keepalive_timeout_s", 75.0)),
        max_connections=server.get("max_connections", 1024),
        retry=policy,
        verbose=retry.get("verbose", True),
        max_body_mb=retry.get("max_body_mb", 32),
        stream=stream_settings,
        routes=_routes(data, env),
        clients=_clients(data),
        websocket_fallback_cooldown_s=float(websocket.get("fallback_cooldown_s", 300.0)),
        websocket_max_queued_messages=websocket.get("max_queued_messages", 16),
        journal=JournalSettings(
            enabled=journal.get("enabled", True),
            path=None if journal_path is None else os.path.expanduser(journal_path),
            retention_days=float(journal.get("retention_days", 14.0)),
        ),
        health=health,
        ratelimit=ratelimit,
    )


def _ratelimit(rl: dict[str, Any]) -> RateSettings:
    """The ``[ratelimit]`` section (see docs/fleet.md)."""
    if rl.get("max_wait_s", 1.0) <= 0:
        raise ConfigError("ratelimit.max_wait_s", "must be greater than 0")
    if rl.get("max_concurrency", 1) < 1:
        raise ConfigError("ratelimit.max_concurrency", "must be at least 1")
    if rl.get("cold_start", 1) < 1:
        raise ConfigError("ratelimit.cold_start", "must be at least 1")
    decrease = rl.get("decrease", 0.5)
    if not 0 < decrease < 1:
        raise ConfigError("ratelimit.decrease", f"expected a share in (0, 1), got {decrease!r}")
    return RateSettings(
        enabled=rl.get("enabled", True),
        max_wait_s=float(rl.get("max_wait_s", 60.0)),
        max_concurrency=rl.get("max_concurrency", 512),
        decrease=float(decrease),
        cold_start=rl.get("cold_start", 4),
    )


def _ratio_of_budget(retry: dict[str, Any]) -> float:
    """``pace_ratio`` from a config written before the pacer (``budget_percent``)."""
    percent = float(retry.get("budget_percent", 0.0))
    if not 0 <= percent <= 100:
        raise ConfigError("retry.budget_percent", "expected 0..100 (0 = no budget)")
    return percent / 100.0 if percent > 0 else 1.0


def _health(health: dict[str, Any]) -> HealthSettings:
    """The ``[health]`` section (see docs/configuration.md)."""
    for k in ("failures_to_open", "min_window_attempts"):
        if health.get(k, 1) < 1:
            raise ConfigError(f"health.{k}", "must be at least 1")
    for k in ("window_s", "open_s", "max_open_s", "probe_timeout_s", "park_check_s"):
        if k in health and health[k] <= 0:
            raise ConfigError(f"health.{k}", "must be greater than 0")
    if health.get("quota_cooloff_s", 0) < 0:
        raise ConfigError("health.quota_cooloff_s", "must be 0 or more")
    rate = health.get("failure_rate_to_open", 0.5)
    if not 0 < rate <= 1:
        raise ConfigError("health.failure_rate_to_open", "expected a share in (0, 1]")
    store = health.get("store", "").strip()
    if store not in ("", "memory") and not store.startswith(("redis://", "rediss://", "unix://")):
        raise ConfigError("health.store", f'expected "memory" or a redis:// URL, got {store!r}')
    floats = {k: float(v) for k, v in health.items() if HEALTH_KEYS[k] == _FLOAT}
    return HealthSettings(**{**health, **floats, "store": store})


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
            text = p.read_bytes().decode("utf-8")
        except OSError as exc:
            raise ConfigError("--config", f"cannot read {p}: {exc.strerror}") from None
        except UnicodeDecodeError as exc:
            raise ConfigError(
                "--config", f"{p} is not UTF-8 text (bad byte at offset {exc.start})"
            ) from None
        try:
            data = tomllib.loads(text)
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(str(p), f"invalid TOML: {exc}") from None
    return parse_config(data, env)
