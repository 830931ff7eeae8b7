"""What OpenCode will use: its config files (global, ``OPENCODE_CONFIG``, the
project's, ``OPENCODE_CONFIG_CONTENT``; JSONC tolerated), merged as OpenCode merges
them, and every provider in use with its real base URL.

`unbroken.opencode.run` relays those providers for one run, and
`unbroken.opencode.setup` points them at a running ``unbroken serve`` for good.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import json
import logging
import re
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final
from urllib.parse import urlsplit

from unbroken.agents.plan import private_token, route_name
from unbroken.config import Config, ConfigError, Route, with_upstream
from unbroken.config_values import validate_url
from unbroken.opencode import jsonc
from unbroken.opencode.providers import OPENCODE_PROVIDERS, UNPLACEABLE

__all__ = [
    "ConfigFile",
    "Provider",
    "config_dir",
    "content_with_relay",
    "data_dir",
    "discover",
    "find_config_files",
    "load_merged",
    "merge",
    "opencode_relay_config",
    "route_for",
    "route_name",
]

log = logging.getLogger("unbroken.opencode.discovery")

#: SDK packages whose requests unbroken cannot relay (signed for a host, or URL from a name).
UNPLACEABLE_NPM: Final[dict[str, str]] = {
    "@ai-sdk/amazon-bedrock": "requests are signed for the AWS host",
    "@ai-sdk/azure": "the URL is built from the Azure resource name",
    "@ai-sdk/google-vertex": "the URL is built from the Vertex project and location",
    "@ai-sdk/google-vertex/anthropic": "the URL is built from the Vertex project and location",
}


def home_dir(env: Mapping[str, str]) -> Path:
    return Path(env.get("HOME") or Path.home())


def config_dir(env: Mapping[str, str]) -> Path:
    """OpenCode's global config directory (``$XDG_CONFIG_HOME/opencode``)."""
    base = env.get("XDG_CONFIG_HOME") or str(home_dir(env) / ".config")
    return Path(base) / "opencode"


def data_dir(env: Mapping[str, str]) -> Path:
    base = env.get("XDG_DATA_HOME") or str(home_dir(env) / ".local" / "share")
    return Path(base) / "opencode"


@dataclass(frozen=True)
class ConfigFile:
    """One config source: ``label`` is a path, or ``OPENCODE_CONFIG_CONTENT``."""

    label: str
    path: Path | None
    data: dict[str, Any]


def _worktree(start: Path) -> Path | None:
    for d in (start, *start.parents):
        if (d / ".git").exists():
            return d
    return None


def _project_dirs(project: Path) -> list[Path]:
    """From the project directory up to its git worktree root (or ``/``), nearest first."""
    stop = _worktree(project)
    dirs: list[Path] = []
    for d in (project, *project.parents):
        dirs.append(d)
        if stop is not None and d == stop:
            break
    return dirs


def find_config_files(project: Path | None, env: Mapping[str, str]) -> list[Path]:
    """Config files in OpenCode's merge order (later ones win), global first;
    ``project=None``: the global ones only."""
    files: list[Path] = []
    gdir = config_dir(env)
    for name in ("config.json", "opencode.json", "opencode.jsonc"):
        if (gdir / name).is_file():
            files.append(gdir / name)
    custom = env.get("OPENCODE_CONFIG")
    if custom and Path(custom).is_file():
        files.append(Path(custom))
    if project is None:
        return files
    home = home_dir(env).resolve()
    dirs = [d for d in _project_dirs(project.resolve()) if d != home]
    for name in ("opencode.jsonc", "opencode.json"):
        for d in reversed(dirs):  # root-most first: the nearest file wins
            if (d / name).is_file() and (d / name) not in files:
                files.append(d / name)
    for d in reversed(dirs):
        for name in ("opencode.jsonc", "opencode.json"):
            p = d / ".opencode" / name
            if p.is_file():
                files.append(p)
    return files


def _read_config(path: Path) -> dict[str, Any]:
    try:
        data = jsonc.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, jsonc.JsoncError) as exc:
        log.warning("opencode: cannot read %s (%s); ignored", path, exc)
        return {}
    return data if isinstance(data, dict) else {}


def merge(base: Mapping[str, Any], over: Mapping[str, Any]) -> dict[str, Any]:
    """Deep merge like OpenCode's: objects merge key by key, anything else is replaced."""
    out = dict(base)
    for key, value in over.items():
        if isinstance(value, Mapping) and isinstance(out.get(key), Mapping):
            out[key] = merge(out[key], value)
        else:
            out[key] = value
    return out


def load_merged(
    project: Path | None, env: Mapping[str, str]
) -> tuple[dict[str, Any], list[ConfigFile]]:
    """The merged OpenCode config and its sources (``project=None``: global only)."""
    sources = [ConfigFile(str(p), p, _read_config(p)) for p in find_config_files(project, env)]
    content = env.get("OPENCODE_CONFIG_CONTENT")
    if content:
        try:
            data = jsonc.loads(content)
        except jsonc.JsoncError as exc:
            log.warning("opencode: OPENCODE_CONFIG_CONTENT is not JSON (%s); ignored", exc)
            data = {}
        if isinstance(data, dict):
            sources.append(ConfigFile("OPENCODE_CONFIG_CONTENT", None, data))
    merged: dict[str, Any] = {}
    for src in sources:
        merged = merge(merged, src.data)
    return merged, sources


_ENV_REF = re.compile(r"\{env:([A-Za-z_][A-Za-z0-9_]*)\}")
_DOLLAR_REF = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)\}")


def _expand(value: str, env: Mapping[str, str], pattern: re.Pattern[str]) -> str | None:
    """Fill ``{env:VAR}`` (or ``${VAR}``) references; None when one is unset."""
    missing = [m.group(1) for m in pattern.finditer(value) if not env.get(m.group(1))]
    if missing:
        return None
    return pattern.sub(lambda m: env[m.group(1)], value)


# -- which providers, and where they really go --------------------------------------------


@dataclass(frozen=True)
class Provider:
    """A provider OpenCode will use: ``url`` is its real base URL, or None with ``problem``."""

    id: str
    url: str | None
    why: str  # how it was found: config, env, auth, model
    problem: str = ""


def _model_providers(config: Mapping[str, Any], model_arg: str | None) -> list[str]:
    refs: list[Any] = [config.get("model"), config.get("small_model"), model_arg]
    for section in ("agent", "mode"):
        table = config.get(section)
        if isinstance(table, Mapping):
            refs.extend(v.get("model") for v in table.values() if isinstance(v, Mapping))
    out: list[str] = []
    for ref in refs:
        if isinstance(ref, str) and "/" in ref:
            pid = ref.split("/", 1)[0]
            if pid and pid not in out:
                out.append(pid)
    return out


def _auth(env: Mapping[str, str]) -> dict[str, str]:
    """Provider id -> auth type from OpenCode's ``auth.json`` (keys are never read out)."""
    path = data_dir(env) / "auth.json"
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    if not isinstance(data, dict):
        return {}
    return {
        str(k): str(v.get("type", "api")) if isinstance(v, Mapping) else "api"
        for k, v in data.items()
    }


def _is_loopback(url: str) -> bool:
    host = urlsplit(url).hostname or ""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def is_unbroken(url: str, timeout: float = 0.5) -> bool:
    """Whether a loopback base URL already goes through a running unbroken relay."""
    parts = urlsplit(url)
    try:
        with urllib.request.urlopen(
            f"{parts.scheme}://{parts.netloc}/healthz", timeout=timeout
        ) as r:
            data = json.loads(r.read(65536))
    except (OSError, ValueError):
        return False
    return isinstance(data, dict) and "routes" in data and "inflight" in data


def discover(
    config: Mapping[str, Any],
    env: Mapping[str, str],
    *,
    model_arg: str | None = None,
    probe: Callable[[str], bool] = is_unbroken,
) -> list[Provider]:
    """Every provider in use (configured, enabled by a key in the environment or in
    ``auth.json``, or named by a model), with its real base URL when unbroken can
    place it."""
    section = config.get("provider")
    providers: dict[str, Any] = dict(section) if isinstance(section, Mapping) else {}
    auth = _auth(env)
    found: dict[str, str] = {}
    for pid in providers:
        found.setdefault(pid, "config")
    for pid in _model_providers(config, model_arg):
        found.setdefault(pid, "model")
    for pid, (_, env_vars) in OPENCODE_PROVIDERS.items():
        if any(env.get(v) for v in env_vars):
            found.setdefault(pid, "env")
    for pid in auth:
        found.setdefault(pid, "auth")
    disabled = config.get("disabled_providers")
    enabled = config.get("enabled_providers")
    out: list[Provider] = []
    for pid, why in found.items():
        if isinstance(disabled, list) and pid in disabled:
            continue
        if isinstance(enabled, list) and pid not in enabled:
            continue
        entry = providers.get(pid)
        entry = entry if isinstance(entry, Mapping) else {}
        out.append(_place(pid, why, entry, env, auth.get(pid), probe))
    return out


def _place(
    pid: str,
    why: str,
    entry: Mapping[str, Any],
    env: Mapping[str, str],
    auth_type: str | None,
    probe: Callable[[str], bool],
) -> Provider:
    options = entry.get("options") if isinstance(entry.get("options"), Mapping) else {}
    assert isinstance(options, Mapping)
    npm = entry.get("npm")
    if pid in UNPLACEABLE and not options.get("baseURL"):
        return Provider(pid, None, why, UNPLACEABLE[pid])
    if isinstance(npm, str) and npm in UNPLACEABLE_NPM:
        return Provider(pid, None, why, UNPLACEABLE_NPM[npm])
    if pid == "openai" and auth_type == "oauth" and not options.get("baseURL"):
        return Provider(pid, None, why, "the ChatGPT login sends requests to its own URL")
    raw: Any = options.get("baseURL") or entry.get("api")
    pattern = _ENV_REF
    if not raw and pid in OPENCODE_PROVIDERS:
        raw, pattern = OPENCODE_PROVIDERS[pid][0], _DOLLAR_REF
    if not isinstance(raw, str) or not raw:
        return Provider(pid, None, why, "no baseURL in its config and not a known built-in")
    url = _expand(raw, env, pattern)
    if url is None:
        return Provider(pid, None, why, f"its base URL {raw!r} needs an unset variable")
    try:
        url = validate_url(f"provider.{pid}.options.baseURL", url)
    except ConfigError as exc:
        return Provider(pid, None, why, str(exc))
    if _is_loopback(url) and probe(url):
        return Provider(pid, None, why, f"it already goes through unbroken at {url}")
    return Provider(pid, url, why)


def opencode_relay_config(
    base: Config, providers: Sequence[Provider]
) -> tuple[Config, dict[str, str]]:
    """A relay config for ``unbroken run``: one route per placed provider (loopback,
    a free port).  Returns it with provider id -> route name."""
    routes: dict[str, Route] = dict(base.routes)
    names: dict[str, str] = {}
    taken: set[str] = set()
    for p in providers:
        if p.url is None:
            continue
        name = route_name(p.id, taken)
        existing = routes.get(name)
        if existing is not None and not existing.builtin:
            log.info(
                "opencode: provider %s goes through your route %r for this run "
                "(its upstreams replaced by the provider's URL, its settings kept)",
                p.id,
                name,
            )
        routes[name] = with_upstream(existing, name, p.url)
        names[p.id] = name
    # A private loopback relay for this one agent: when a route injects a key, a token
    # of its own that route needs (given to OpenCode in its base URLs), else none.
    config = dataclasses.replace(
        base,
        routes=routes,
        host="127.0.0.1",
        port=0,
        token=None,
        token_env=None,
        key_token=private_token(routes),
    )
    return config, names


def content_with_relay(
    existing: str | None, base_urls: Mapping[str, str], headers: Mapping[str, str] | None = None
) -> str:
    """``OPENCODE_CONFIG_CONTENT``: the user's own (if any) with each ``baseURL`` replaced,
    and ``headers`` added to each relayed provider's ``options.headers`` (the relay's
    token: in a header, not in the base URL)."""
    data: dict[str, Any] = {}
    if existing:
        try:
            parsed = jsonc.loads(existing)
            if isinstance(parsed, dict):
                data = parsed
        except jsonc.JsoncError:
            pass
    options: dict[str, dict[str, Any]] = {
        pid: {"baseURL": url, **({"headers": dict(headers)} if headers else {})}
        for pid, url in base_urls.items()
    }
    patch = {"provider": {pid: {"options": o} for pid, o in options.items()}}
    return json.dumps(merge(data, patch), separators=(",", ":"))


def route_for(url: str, routes: Mapping[str, Route]) -> tuple[str, str] | None:
    """(route, path suffix) of a relay route whose upstream is a prefix of ``url``."""
    best: tuple[int, str, str] | None = None
    for name, route in routes.items():
        for up in route.upstreams:
            base = up.url.rstrip("/")
            if url == base or url.startswith(base + "/"):
                score = len(base) * 2 + (0 if route.builtin else 1)
                if best is None or score > best[0]:
                    best = (score, name, url[len(base) :])
    return None if best is None else (best[1], best[2])
