"""Codex CLI: read its providers from ``$CODEX_HOME/config.toml``, relay each one.

Measured with the real Codex 0.169.0:

* a custom provider's ``base_url`` is overridden per run with
  ``-c model_providers.<id>.base_url="..."``; the override merges into the user's
  table, so ``supports_websockets``, ``env_key``, the retry knobs and every other
  key stay as they were;
* the built-in ``openai`` provider ignores ``OPENAI_BASE_URL`` and refuses a
  ``model_providers.openai`` table ("Built-in providers cannot be overridden"); it
  honours the top-level ``openai_base_url`` key, so it gets ``-c openai_base_url=...``;
* ``-c`` flags before the subcommand (``codex -c ... exec ...``) reach it;
* a custom provider sends the headers of its ``env_http_headers`` table (header ->
  the variable that holds its value): when the private relay has a token, each gets
  ``x-unbroken-token`` from ``UNBROKEN_RUN_TOKEN`` (only the variable's name is on
  the command line).  The built-in ``openai`` provider takes no headers: its base
  URL, on the command line, carries no token.

What the user's own command line says counts as Codex counts it: ``-c key=value``
(``--config``; a dotted path, the value TOML or else a string) over ``-p NAME``
(``--profile``: ``$CODEX_HOME/NAME.config.toml`` layered on the base config) over
``config.toml`` (left out with ``--ignore-user-config``).  So the active provider,
its ``stream_idle_timeout_ms`` and the base URLs are the ones that Codex will use;
a base URL the user sets with ``-c`` is relayed, and that ``-c`` is replaced by the
relay's own (it would otherwise win over it, and bypass the relay).

Codex counts only parsed events toward ``stream_idle_timeout_ms``, so the codex
client profile's keepalive interval is kept below a third of it.  The relay sends
Codex no early headers, so Codex's idle timer never runs while the relay waits for
an upstream's first frame: the active provider's ``stream_idle_timeout_ms`` goes to
the profile as ``client_idle_timeout_s``, and the relay's stall timers
(``first_frame_timeout_s``, ``idle_timeout_s``) are capped at it, so a silent
upstream is cut, and replayed, no later than Codex would have cut it.
"""

from __future__ import annotations

import copy
import json
import os
import re
import tomllib
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from unbroken.agents.plan import RELAY, RUN_TOKEN_ENV, TOKEN, Launch, route_name, split_version
from unbroken.config_values import ConfigError, validate_url
from unbroken.relay.access import TOKEN_HEADER

__all__ = ["OPENAI_DEFAULT", "CommandLine", "codex_home", "command_line", "plan", "read_config"]

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


#: a ``-c`` that sets a base URL the relay takes over (its argument is replaced)
_BASE_URL_KEY = re.compile(r"^(openai_base_url|model_providers\.[^.]+\.base_url)$")


class CommandLine:
    """What a Codex command line says of its configuration (see the module docstring)."""

    def __init__(self) -> None:
        #: ``-c`` overrides in order: (dotted key, value)
        self.overrides: list[tuple[str, object]] = []
        self.profile: str | None = None
        self.ignore_user_config = False
        #: indexes (into the arguments after the program) of the ``-c`` that set a base
        #: URL: they are left out when the agent is started (the relay's own replace them)
        self.base_url_args: set[int] = set()


def _toml_value(text: str) -> object:
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text  # Codex: "the raw string is used as a literal"


def command_line(argv: Sequence[str]) -> CommandLine:
    """The configuration a Codex command line (the arguments after ``codex``) gives."""
    out = CommandLine()
    i = 0
    while i < len(argv):
        arg = argv[i]
        if arg == "--":
            break
        value: str | None = None
        used = [i]
        if arg in ("-c", "--config", "-p", "--profile") and i + 1 < len(argv):
            value = argv[i + 1]
            used.append(i + 1)
            flag = arg
            i += 2
        elif arg.startswith(("--config=", "--profile=")):
            flag, value = arg.split("=", 1)
            i += 1
        else:
            if arg == "--ignore-user-config":
                out.ignore_user_config = True
            i += 1
            continue
        if flag in ("-p", "--profile"):
            out.profile = value
            continue
        key, sep, raw = value.partition("=")
        key = key.strip()
        if not sep or not key:
            continue
        out.overrides.append((key, _toml_value(raw.strip())))
        if _BASE_URL_KEY.match(key):
            out.base_url_args.update(used)
    return out


def _set_dotted(config: dict[str, Any], key: str, value: object) -> None:
    parts = key.split(".")
    table = config
    for part in parts[:-1]:
        nxt = table.get(part)
        if not isinstance(nxt, dict):
            nxt = table[part] = {}
        table = nxt
    table[parts[-1]] = value


def _layer(base: dict[str, Any], top: Mapping[str, Any]) -> dict[str, Any]:
    """``top`` deep-merged over ``base`` (tables merge, anything else replaces)."""
    out = dict(base)
    for k, v in top.items():
        old = out.get(k)
        out[k] = _layer(old, v) if isinstance(old, dict) and isinstance(v, dict) else v
    return out


def effective_config(env: Mapping[str, str], cli: CommandLine) -> tuple[dict[str, Any], list[str]]:
    """Codex's configuration as this run will see it, and problems reading it."""
    notes: list[str] = []
    config: dict[str, Any] = {}
    if not cli.ignore_user_config:
        config, problem = read_config(env)
        if problem:
            notes.append(problem)
    if cli.profile:
        if not re.fullmatch(r"[A-Za-z0-9._-]+", cli.profile) or cli.profile.startswith("."):
            notes.append(f"codex: profile {cli.profile!r} is not a plain name; not read")
        else:
            path = codex_home(env) / f"{cli.profile}.config.toml"
            try:
                layer = tomllib.loads(path.read_text(encoding="utf-8"))
            except FileNotFoundError:
                notes.append(f"codex: profile {cli.profile!r}: no {path}")
            except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as exc:
                notes.append(f"codex: profile {cli.profile!r}: cannot read {path}: {exc}")
            else:
                config = _layer(config, layer)
    config = copy.deepcopy(config)
    for key, value in cli.overrides:
        _set_dotted(config, key, value)
    return config, notes


def _toml_string(value: str) -> str:
    return json.dumps(value)  # a TOML basic string for any URL


def plan(env: Mapping[str, str], argv: Sequence[str] = ()) -> Launch:
    """How to run Codex with ``argv`` (the arguments after ``codex``) through a relay."""
    cli = command_line(argv)
    config, notes = effective_config(env, cli)
    routes: dict[str, str] = {}
    args: list[str] = []
    token_args: list[str] = []
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
            # the token's header, from a variable: only its name is on the command line
            header = f"model_providers.{pid}.env_http_headers.{TOKEN_HEADER}"
            token_args += ["-c", f"{header}={_toml_string(RUN_TOKEN_ENV)}"]
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
    user_args = None
    if cli.base_url_args:
        user_args = tuple(a for i, a in enumerate(argv) if i not in cli.base_url_args)
    return Launch(
        "codex",
        routes=routes,
        args=tuple(args),
        clients=clients,
        notes=tuple(notes),
        user_args=user_args,
        token_env={RUN_TOKEN_ENV: TOKEN} if token_args else {},
        token_args=tuple(token_args),
    )
