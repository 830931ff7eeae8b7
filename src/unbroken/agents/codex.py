"""Codex CLI: read its providers from ``$CODEX_HOME/config.toml``, relay each one.

Measured with the real Codex 0.169.0:

* a custom provider's ``base_url`` is overridden per run with
  ``-c model_providers.<id>.base_url="..."``; the override merges into the user's
  table, so ``supports_websockets``, ``env_key``, the retry knobs and every other
  key stay as they were;
* the built-in ``openai`` provider ignores ``OPENAI_BASE_URL`` and refuses a
  ``model_providers.openai`` table ("Built-in providers cannot be overridden"); it
  honours the top-level ``openai_base_url`` key, so it gets ``-c openai_base_url=...``;
* ``-c`` flags before the subcommand (``codex -c ... exec ...``) reach it.

Codex counts only parsed events toward ``stream_idle_timeout_ms``, so the codex
client profile's keepalive interval is kept below a third of it.  The relay sends
Codex no early headers, so Codex's idle timer never runs while the relay waits for
an upstream's first frame: the active provider's ``stream_idle_timeout_ms`` goes to
the profile as ``client_idle_timeout_s``, and the relay's stall timers
(``first_frame_timeout_s``, ``idle_timeout_s``) are capped at it, so a silent
upstream is cut, and replayed, no later than Codex would have cut it.
"""

from __future__ import annotations

import json
import os
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from unbroken.agents.plan import RELAY, Launch, route_name, split_version
from unbroken.config_values import ConfigError, validate_url

__all__ = ["OPENAI_DEFAULT", "codex_home", "plan", "read_config"]

#: the openai SDKs' and Codex's base URL when none is set (`unbroken run` relays it)
OPENAI_DEFAULT = "https://api.openai.com/v1"
#: Codex's default ``stream_idle_timeout_ms``
IDLE_DEFAULT_MS = 300_000
#: unbroken's default keepalive interval (``[stream] keepalive_s``)
KEEPALIVE_DEFAULT_S = 15.0


def codex_home(env: Mapping[str, str]) -> Path:
    home = env.get("CODEX_HOME")
    if home:
        return Path(home)
    return Path(env.get("HOME") or os.path.expanduser("~")) / ".codex"


def read_config(env: Mapping[str, str]) -> tuple[dict[str, Any], str | None]:
    """Codex's config.toml as data, and a problem reading it (None: fine or absent)."""
    path = codex_home(env) / "config.toml"
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return {}, None
    except (OSError, UnicodeDecodeError) as exc:
        return {}, f"cannot read {path}: {exc}"
    try:
        return tomllib.loads(text), None
    except tomllib.TOMLDecodeError as exc:
        return {}, f"{path} is not valid TOML ({exc}); only the built-in openai provider is relayed"


def _toml_string(value: str) -> str:
    return json.dumps(value)  # a TOML basic string for any URL


def plan(env: Mapping[str, str]) -> Launch:
    config, problem = read_config(env)
    notes: list[str] = [problem] if problem else []
    routes: dict[str, str] = {}
    args: list[str] = []
    taken: set[str] = set()
    active = config.get("model_provider")
    active = active if isinstance(active, str) else "openai"

    raw_openai = config.get("openai_base_url")
    openai_url = raw_openai if isinstance(raw_openai, str) and raw_openai else OPENAI_DEFAULT
    try:
        openai_url = validate_url("openai_base_url", openai_url).rstrip("/")
    except ConfigError as exc:
        notes.append(f"codex: not relaying the built-in openai provider: {exc}")
    else:
        name = route_name("openai", taken)
        routes[name], version = split_version(openai_url)
        args += ["-c", f"openai_base_url={_toml_string(f'{RELAY}/{name}{version}')}"]

    providers = config.get("model_providers")
    idle_ms: float = IDLE_DEFAULT_MS
    if isinstance(providers, dict):
        for pid, table in providers.items():
            if not isinstance(table, dict):
                continue
            base = table.get("base_url")
            if not isinstance(base, str) or not base:
                notes.append(f"codex: not relaying provider {pid!r}: it has no base_url")
                continue
            try:
                url = validate_url(f"model_providers.{pid}.base_url", base).rstrip("/")
            except ConfigError as exc:
                notes.append(f"codex: not relaying provider {pid!r}: {exc}")
                continue
            name = route_name(pid, taken)
            routes[name], version = split_version(url)
            key = f"model_providers.{pid}.base_url"
            args += ["-c", f"{key}={_toml_string(f'{RELAY}/{name}{version}')}"]
            idle = table.get("stream_idle_timeout_ms")
            if pid == active and isinstance(idle, int | float) and not isinstance(idle, bool):
                idle_ms = float(idle)
    clients: dict[str, dict[str, object]] = {}
    tuned: dict[str, object] = {}
    keepalive_s = idle_ms / 1000.0 / 3.0
    if keepalive_s < KEEPALIVE_DEFAULT_S:
        # A keepalive event at least three times per Codex idle timeout.
        tuned["keepalive_s"] = max(keepalive_s, 0.2)
    if idle_ms != IDLE_DEFAULT_MS and idle_ms > 0:
        # The relay's stall timers follow Codex's own (`Profile.stall_timeouts`).
        tuned["client_idle_timeout_s"] = idle_ms / 1000.0
    if tuned:
        clients["codex"] = tuned
    relayed = ", ".join(f"{n} -> {u}" for n, u in routes.items()) or "none"
    notes.append(f"codex: relaying {relayed} (active provider: {active})")
    return Launch("codex", routes=routes, args=tuple(args), clients=clients, notes=tuple(notes))
