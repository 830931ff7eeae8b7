"""OpenCode integration: ``unbroken run -- opencode``, and ``unbroken opencode setup|undo``.

``unbroken run -- opencode [args...]`` reads the user's OpenCode config (global,
``OPENCODE_CONFIG``, project files and ``OPENCODE_CONFIG_CONTENT``, JSONC
tolerated), finds every provider in use with its real base URL, starts a relay on
a free loopback port with one route per provider, and launches OpenCode with
``OPENCODE_CONFIG_CONTENT`` pointing each provider's ``baseURL`` at that route.
When OpenCode exposes its server (the TUI, ``serve``, ``web``) the auto-resumer
watches it too.  OpenCode's exit code is returned; the relay stops afterwards.

``unbroken opencode setup`` makes the same change persistent for a running
``unbroken serve``: it patches ``opencode.json`` (keeping comments), keeps a
backup, and ``unbroken opencode undo`` puts the original bytes back.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import ipaddress
import json
import logging
import os
import re
import signal
import socket
import sys
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final
from urllib.parse import urlsplit

from unbroken.config import (
    Config,
    ConfigError,
    Route,
    load_config,
    validate_url,
    with_upstream,
)
from unbroken.opencode import jsonc
from unbroken.opencode.providers import OPENCODE_PROVIDERS, UNPLACEABLE

__all__ = [
    "ConfigFile",
    "OpenCodeArgs",
    "Provider",
    "UndoResult",
    "discover",
    "find_config_files",
    "load_merged",
    "merge",
    "parse_opencode_args",
    "register",
    "relay_config",
    "run_opencode",
    "setup",
    "undo",
]

log = logging.getLogger("unbroken.opencode.launcher")

SCHEMA_URL: Final = "https://opencode.ai/config.json"
BACKUP_SUFFIX: Final = ".unbroken-backup"
CREATED_SUFFIX: Final = ".unbroken-created"
#: SDK packages whose requests unbroken cannot relay (signed for a host, or URL from a name).
UNPLACEABLE_NPM: Final[dict[str, str]] = {
    "@ai-sdk/amazon-bedrock": "requests are signed for the AWS host",
    "@ai-sdk/azure": "the URL is built from the Azure resource name",
    "@ai-sdk/google-vertex": "the URL is built from the Vertex project and location",
    "@ai-sdk/google-vertex/anthropic": "the URL is built from the Vertex project and location",
}
#: OpenCode subcommands (yargs); anything else in first position is the TUI's project.
SUBCOMMANDS: Final = frozenset(
    {
        "completion",
        "acp",
        "mcp",
        "attach",
        "run",
        "debug",
        "providers",
        "auth",
        "agent",
        "upgrade",
        "uninstall",
        "serve",
        "web",
        "models",
        "stats",
        "export",
        "import",
        "github",
        "pr",
        "session",
        "plugin",
        "plug",
        "db",
        "help",
    }
)
#: OpenCode options that take a value (so the value is not taken for a subcommand).
VALUE_OPTIONS: Final = frozenset(
    {
        "--log-level",
        "--port",
        "--hostname",
        "--mdns-domain",
        "--cors",
        "-m",
        "--model",
        "-s",
        "--session",
        "--prompt",
        "--agent",
        "--format",
        "--title",
        "--attach",
        "-p",
        "--password",
        "-u",
        "--username",
        "--dir",
        "--variant",
        "--command",
        "-f",
        "--file",
    }
)

# -- reading OpenCode's config -----------------------------------------------------------


def _home(env: Mapping[str, str]) -> Path:
    return Path(env.get("HOME") or Path.home())


def config_dir(env: Mapping[str, str]) -> Path:
    """OpenCode's global config directory (``$XDG_CONFIG_HOME/opencode``)."""
    base = env.get("XDG_CONFIG_HOME") or str(_home(env) / ".config")
    return Path(base) / "opencode"


def data_dir(env: Mapping[str, str]) -> Path:
    base = env.get("XDG_DATA_HOME") or str(_home(env) / ".local" / "share")
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
    home = _home(env).resolve()
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


def _is_unbroken(url: str, timeout: float = 0.5) -> bool:
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
    probe: Callable[[str], bool] = _is_unbroken,
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


def route_name(pid: str, taken: set[str]) -> str:
    """A route name for a provider id: one path segment, not starting with ``_``."""
    name = re.sub(r"[^A-Za-z0-9._~-]", "-", pid).lstrip("_") or "provider"
    candidate, n = name, 2
    while candidate in taken:
        candidate, n = f"{name}-{n}", n + 1
    taken.add(candidate)
    return candidate


def relay_config(base: Config, providers: Sequence[Provider]) -> tuple[Config, dict[str, str]]:
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
    # A private loopback relay for this one agent: no token (OpenCode could not send it).
    config = dataclasses.replace(base, routes=routes, host="127.0.0.1", port=0, token=None)
    return config, names


def content_with_relay(existing: str | None, base_urls: Mapping[str, str]) -> str:
    """``OPENCODE_CONFIG_CONTENT``: the user's own (if any) with each ``baseURL`` replaced."""
    data: dict[str, Any] = {}
    if existing:
        try:
            parsed = jsonc.loads(existing)
            if isinstance(parsed, dict):
                data = parsed
        except jsonc.JsoncError:
            pass
    patch = {"provider": {pid: {"options": {"baseURL": url}} for pid, url in base_urls.items()}}
    return json.dumps(merge(data, patch), separators=(",", ":"))


# -- OpenCode's command line -----------------------------------------------------------------


@dataclass(frozen=True)
class OpenCodeArgs:
    """What unbroken needs from an OpenCode command line."""

    subcommand: str | None  # None: the TUI
    project: str | None
    model: str | None
    port: int | None
    hostname: str | None
    attach: str | None


def _option(args: Sequence[str], names: Sequence[str]) -> str | None:
    value: str | None = None
    for i, a in enumerate(args):
        if a == "--":
            break
        for n in names:
            if a == n and i + 1 < len(args):
                value = args[i + 1]
            elif a.startswith(n + "="):
                value = a[len(n) + 1 :]
    return value


def parse_opencode_args(args: Sequence[str]) -> OpenCodeArgs:
    """Find the subcommand, project and the options unbroken cares about (argv[1:])."""
    positional: list[str] = []
    skip = False
    for a in args:
        if skip:
            skip = False
            continue
        if a == "--":
            break
        if a.startswith("-"):
            if a in VALUE_OPTIONS:
                skip = True
            continue
        positional.append(a)
    sub = positional[0] if positional and positional[0] in SUBCOMMANDS else None
    project = positional[0] if positional and sub is None else None
    port_raw = _option(args, ["--port"])
    try:
        port = int(port_raw) if port_raw is not None else None
    except ValueError:
        port = None
    return OpenCodeArgs(
        subcommand=sub,
        project=project,
        model=_option(args, ["-m", "--model"]),
        port=port,
        hostname=_option(args, ["--hostname"]),
        attach=_option(args, ["--attach"]),
    )


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        port: int = s.getsockname()[1]
        return port


def server_args(argv: Sequence[str], parsed: OpenCodeArgs) -> tuple[list[str], str | None, str]:
    """OpenCode's argv with ``--port`` added when needed, the server URL auto-resume
    should watch (None: OpenCode exposes no server), and why."""
    args = list(argv)
    sub = parsed.subcommand
    if sub is not None and sub not in ("serve", "web"):
        if sub == "run":
            return args, None, "`opencode run` exposes no server (its turns get the relay only)"
        return args, None, f"`opencode {sub}` runs no session server"
    port = parsed.port
    if not port:
        port = free_port()
        end = args.index("--") if "--" in args else len(args)
        for i, a in enumerate(args[:end]):
            if a == "--port" and i + 1 < end:  # an explicit --port 0: fill it in
                args[i + 1] = str(port)
                break
            if a.startswith("--port="):
                args[i] = f"--port={port}"
                break
        else:
            args[end:end] = ["--port", str(port)]
    host = parsed.hostname or "127.0.0.1"
    if host in ("0.0.0.0", "::", ""):
        host = "127.0.0.1"
    shown = f"[{host}]" if ":" in host else host
    return args, f"http://{shown}:{port}", ""


# -- unbroken run -- opencode ----------------------------------------------------------------


def _exit_code(code: int | None) -> int:
    if code is None:
        return 1
    return 128 - code if code < 0 else code


def _log_to(path: str | None, interactive: bool, env: Mapping[str, str]) -> Path | None:
    """Where the relay and resume logs go: ``--log``, or a file when OpenCode owns the
    terminal (its TUI), else stderr (None)."""
    if path:
        return Path(path)
    if not interactive:
        return None
    state = env.get("XDG_STATE_HOME") or str(_home(env) / ".local" / "state")
    return Path(state) / "unbroken" / "run.log"


def _setup_run_logging(log_file: Path | None) -> None:
    from unbroken.cli import setup_logging

    if log_file is None:
        setup_logging()
        return
    log_file.parent.mkdir(parents=True, exist_ok=True)
    handler = logging.FileHandler(log_file, encoding="utf-8")
    handler.setFormatter(logging.Formatter("%(asctime)s %(name)s %(levelname)s %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(logging.INFO)
    logging.getLogger("aiohttp.access").setLevel(logging.WARNING)


async def run_opencode(
    command: Sequence[str],
    *,
    base: Config,
    env: Mapping[str, str],
    cwd: Path,
    resume: bool = True,
    ready: Callable[[str], None] | None = None,
) -> int:
    """Relay OpenCode's providers, launch ``command`` (an OpenCode command line), resume
    its dead turns when it exposes a server, and return its exit code."""
    from unbroken.relay.server import RelayServer

    parsed = parse_opencode_args(command[1:])
    config, names = _relay_for(parsed, base=base, env=env, cwd=cwd)
    server = RelayServer(config)
    await server.start()
    try:
        base_urls = {pid: f"{server.url}/{name}" for pid, name in names.items()}
        argv = list(command)
        watch: str | None = None
        why = "disabled (--no-resume)"
        if resume:
            rest, watch, why = server_args(argv[1:], parsed)
            argv = [argv[0], *rest]
        relayed = ", ".join(f"{pid} -> {url}" for pid, url in base_urls.items()) or "none"
        log.info("opencode: relay on %s; providers: %s", server.url, relayed)
        if watch is None:
            log.info("opencode: auto-resume off: %s", why)
        if ready is not None:
            ready(server.url)
        return await run_child(
            argv,
            env=_child_env(env, cwd, base_urls),
            cwd=cwd,
            beside=None if watch is None else lambda proc: _follow(watch, env, proc),
        )
    finally:
        await server.stop()


def _relay_for(
    parsed: OpenCodeArgs, *, base: Config, env: Mapping[str, str], cwd: Path
) -> tuple[Config, dict[str, str]]:
    """The relay config for the providers OpenCode will use (and their route names)."""
    project = cwd / parsed.project if parsed.project else cwd
    user_config, _ = load_merged(project if project.is_dir() else cwd, env)
    providers = discover(user_config, env, model_arg=parsed.model)
    unplaced = [p for p in providers if p.url is None]
    if unplaced:
        log.warning(
            "opencode: not relaying %s",
            "; ".join(f"{p.id} ({p.problem})" for p in unplaced),
        )
    return relay_config(base, [p for p in providers if p.url is not None])


def _child_env(env: Mapping[str, str], cwd: Path, base_urls: Mapping[str, str]) -> dict[str, str]:
    child_env = dict(env)
    child_env["PWD"] = str(cwd)  # OpenCode takes its directory from PWD, not the cwd
    if base_urls:
        child_env["OPENCODE_CONFIG_CONTENT"] = content_with_relay(
            env.get("OPENCODE_CONFIG_CONTENT"), base_urls
        )
    return child_env


class _Follower:
    """Auto-resume beside a running OpenCode: started with it, stopped when it exits."""

    def __init__(
        self, watch: str, env: Mapping[str, str], proc: asyncio.subprocess.Process
    ) -> None:
        from unbroken.opencode.resume import Resumer, settings_from_env

        self.watch, self.proc = watch, proc
        self.resumer = Resumer(
            watch,
            settings_from_env(env),
            password=env.get("OPENCODE_SERVER_PASSWORD"),
            username=env.get("OPENCODE_SERVER_USERNAME"),
        )
        self.task = asyncio.create_task(self._follow())

    async def _follow(self) -> None:
        from unbroken.opencode.resume import wait_healthy

        proc = self.proc
        if await wait_healthy(
            self.watch,
            timeout=120,
            headers=dict(self.resumer.headers),
            alive=lambda: proc.returncode is None,
        ):
            await self.resumer.run()
        elif proc.returncode is None:
            log.warning(
                "opencode: auto-resume off: %s/global/health did not answer in 120 s", self.watch
            )

    async def stop(self) -> None:
        self.resumer.stop()
        # stop() ends the resumer's own tasks; cancel only if that hangs.
        done, _ = await asyncio.wait({self.task}, timeout=5)
        if not done:
            self.task.cancel()
        result = await asyncio.gather(self.task, return_exceptions=True)
        if isinstance(result[0], Exception):
            log.warning("opencode: auto-resume failed: %s: %s", type(result[0]).__name__, result[0])


def _follow(watch: str, env: Mapping[str, str], proc: asyncio.subprocess.Process) -> _Follower:
    return _Follower(watch, env, proc)


async def run_child(
    argv: Sequence[str],
    *,
    env: Mapping[str, str],
    cwd: Path,
    beside: Callable[[asyncio.subprocess.Process], _Follower] | None = None,
) -> int:
    """Run an agent as a child process and return its exit code.

    SIGTERM and SIGHUP are forwarded to it; Ctrl-C reaches it from the terminal and
    unbroken waits for it to exit.  ``beside`` starts a helper that runs as long as
    the child does (auto-resume) and is stopped when it exits.
    """
    try:
        proc = await asyncio.create_subprocess_exec(*argv, env=dict(env), cwd=str(cwd))
    except OSError as exc:
        print(f"unbroken: cannot start {argv[0]}: {exc.strerror}", file=sys.stderr)
        return 127
    loop = asyncio.get_running_loop()

    def forward(sig: int) -> None:
        with contextlib.suppress(ProcessLookupError):
            proc.send_signal(sig)

    installed: list[int] = []
    for sig in (signal.SIGTERM, signal.SIGHUP):
        with contextlib.suppress(NotImplementedError, RuntimeError, ValueError):
            loop.add_signal_handler(sig, forward, sig)
            installed.append(sig)
    with contextlib.suppress(NotImplementedError, RuntimeError, ValueError):
        loop.add_signal_handler(signal.SIGINT, lambda: None)
        installed.append(signal.SIGINT)
    helper = beside(proc) if beside is not None else None
    try:
        code = await proc.wait()
    finally:
        for signum in installed:
            with contextlib.suppress(NotImplementedError, RuntimeError, ValueError):
                loop.remove_signal_handler(signum)
        if helper is not None:
            await helper.stop()
    return _exit_code(code)


def _run_cmd(args: argparse.Namespace) -> int:
    command = list(args.command)
    if command and command[0] == "--":
        command = command[1:]
    if not command:
        print(
            "usage: unbroken run [--print-env] -- opencode|codex|claude|gemini|<command> [args...]",
            file=sys.stderr,
        )
        return 2
    if "opencode" not in Path(command[0]).name:
        # Codex, Claude Code, or any other command: unbroken.agents.
        from unbroken.agents.launcher import run_cmd

        return run_cmd(command, config=args.config, log_path=args.log, print_only=args.print_env)
    if args.print_env:
        print(
            "# unbroken run -- opencode sets OPENCODE_CONFIG_CONTENT for one run; to wire "
            "OpenCode to `unbroken serve` for good: unbroken opencode setup"
        )
        return 0
    from unbroken.opencode.resume import settings_from_env

    env = dict(os.environ)
    try:
        base = load_config(args.config)
        settings_from_env(env)
    except (ConfigError, ValueError) as exc:
        print(f"unbroken: invalid config: {exc}", file=sys.stderr)
        return 2
    base = dataclasses.replace(base, grace_s=min(base.grace_s, 2.0))
    parsed = parse_opencode_args(command[1:])
    interactive = parsed.subcommand is None and sys.stdout.isatty()
    log_file = _log_to(args.log, interactive, env)
    _setup_run_logging(log_file)
    if log_file is not None:
        print(f"unbroken: relaying OpenCode's providers; log: {log_file}", file=sys.stderr)
    cwd = Path.cwd()
    return asyncio.run(
        run_opencode(command, base=base, env=env, cwd=cwd, resume=not args.no_resume)
    )


# -- unbroken opencode setup | undo ----------------------------------------------------------


def target_file(scope: str, project: Path, env: Mapping[str, str]) -> Path:
    """The file ``setup`` patches: an existing config of that scope, else ``opencode.json``."""
    names: tuple[str, ...]
    if scope == "global":
        d = config_dir(env)
        names = ("opencode.jsonc", "opencode.json", "config.json")
    else:
        d = project
        names = ("opencode.jsonc", "opencode.json")
    for name in names:
        if (d / name).is_file():
            return d / name
    return d / "opencode.json"


def _route_for(url: str, routes: Mapping[str, Route]) -> tuple[str, str] | None:
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


@dataclass
class SetupResult:
    path: Path
    changed: bool
    routed: dict[str, str]  # provider id -> new baseURL
    already: list[str]
    missing: list[Provider]  # in use, but no route on the relay


def setup(
    scope: str,
    *,
    relay_url: str,
    routes: Mapping[str, Route],
    project: Path,
    env: Mapping[str, str],
    probe: Callable[[str], bool] = lambda url: False,
) -> SetupResult:
    """Point every provider in use at ``relay_url``; keep a backup of the file first."""
    relay_url = relay_url.rstrip("/")
    path = target_file(scope, project, env)
    # The global file applies to every project: only providers visible everywhere.
    merged, _ = load_merged(project if scope == "project" else None, env)
    providers = discover(merged, env, probe=probe)
    original = path.read_bytes() if path.exists() else None
    text = original.decode("utf-8") if original is not None else ""
    routed: dict[str, str] = {}
    already: list[str] = []
    missing: list[Provider] = []
    for p in providers:
        current = _current_base(merged, p.id)
        if current and current.rstrip("/").startswith(relay_url + "/"):
            already.append(p.id)
            continue
        if p.url is None:
            missing.append(p)
            continue
        match = _route_for(p.url, routes)
        if match is None:
            missing.append(dataclasses.replace(p, problem="no route on the relay reaches it"))
            continue
        name, suffix = match
        new = f"{relay_url}/{name}{suffix}"
        routed[p.id] = new
        if not text.strip():
            text = json.dumps({"$schema": SCHEMA_URL}, indent=2) + "\n"
        text = jsonc.set_path(text, ["provider", p.id, "options", "baseURL"], new)
    if original is None:
        changed = bool(routed)
    else:
        changed = text.encode("utf-8") != original
    if changed:
        new_dirs = [d for d in (path.parent, *path.parent.parents) if not d.exists()]
        path.parent.mkdir(parents=True, exist_ok=True)
        backup = path.with_name(path.name + BACKUP_SUFFIX)
        created = path.with_name(path.name + CREATED_SUFFIX)
        if not backup.exists() and not created.exists():
            if original is None:
                # The directories setup created, innermost first: undo removes them
                # again when they are empty.
                marker = {"created_dirs": [str(d) for d in new_dirs]}
                created.write_text(json.dumps(marker) + "\n", encoding="utf-8")
            else:
                backup.write_bytes(original)
        tmp = path.with_name(path.name + ".unbroken-tmp")
        tmp.write_bytes(text.encode("utf-8"))
        os.replace(tmp, path)
    return SetupResult(path, changed, routed, already, missing)


def _current_base(config: Mapping[str, Any], pid: str) -> str | None:
    section = config.get("provider")
    entry = section.get(pid) if isinstance(section, Mapping) else None
    options = entry.get("options") if isinstance(entry, Mapping) else None
    url = options.get("baseURL") if isinstance(options, Mapping) else None
    return url if isinstance(url, str) else None


@dataclass(frozen=True)
class UndoResult:
    """What `undo` did: ``action`` is ``restored``, ``removed`` or ``nothing``."""

    path: Path
    action: str
    removed_dirs: tuple[Path, ...] = ()

    def lines(self) -> list[str]:
        """What to tell the user, one line per thing done."""
        if self.action == "restored":
            return [
                f"restored {self.path} from {self.path.name}{BACKUP_SUFFIX}, the copy setup kept"
            ]
        if self.action == "removed":
            out = [f"removed {self.path}, which setup had created"]
            out += [
                f"removed the directory {d}, which setup had created and which is empty again"
                for d in self.removed_dirs
            ]
            return out
        return [
            f"{self.path}: nothing to undo (no {self.path.name}{BACKUP_SUFFIX} or "
            f"{self.path.name}{CREATED_SUFFIX} next to it)"
        ]


def undo(scope: str, *, project: Path, env: Mapping[str, str]) -> UndoResult:
    """Put back what ``setup`` changed: the original bytes of the file from its backup,
    or, when setup created the file, no file (and no directory setup created for it,
    once that is empty again)."""
    path = target_file(scope, project, env)
    backup = path.with_name(path.name + BACKUP_SUFFIX)
    created = path.with_name(path.name + CREATED_SUFFIX)
    if backup.exists():
        os.replace(backup, path)
        return UndoResult(path, "restored")
    if not created.exists():
        return UndoResult(path, "nothing")
    made = [d for d in _created_dirs(created) if d in path.parents]  # nothing else, ever
    with contextlib.suppress(FileNotFoundError):
        path.unlink()
    created.unlink()
    removed: list[Path] = []
    for d in made:  # innermost first
        try:
            d.rmdir()
        except OSError:  # not empty (or gone): leave it, and everything above it
            break
        removed.append(d)
    return UndoResult(path, "removed", tuple(removed))


def _created_dirs(marker: Path) -> list[Path]:
    """The directories setup recorded as created (an empty marker, from an older
    version, records none)."""
    try:
        data = json.loads(marker.read_text(encoding="utf-8") or "{}")
    except (OSError, ValueError):
        return []
    dirs = data.get("created_dirs") if isinstance(data, dict) else None
    if not isinstance(dirs, list):
        return []
    return [Path(d) for d in dirs if isinstance(d, str)]


def _relay_routes(url: str) -> list[str] | None:
    try:
        with urllib.request.urlopen(f"{url.rstrip('/')}/healthz", timeout=1.0) as r:
            data = json.loads(r.read(1 << 20))
    except (OSError, ValueError):
        return None
    routes = data.get("routes") if isinstance(data, dict) else None
    return [str(r) for r in routes] if isinstance(routes, list) else None


def _setup_cmd(args: argparse.Namespace) -> int:
    try:
        config = load_config(args.config)
    except ConfigError as exc:
        print(f"unbroken: invalid config: {exc}", file=sys.stderr)
        return 2
    host = f"[{config.host}]" if ":" in config.host else config.host
    relay_url = (args.relay or f"http://{host}:{config.port}").rstrip("/")
    if args.relay is not None:
        from unbroken.config import validate_http_url

        try:
            relay_url = validate_http_url("--relay", args.relay)
        except ConfigError as exc:
            print(f"unbroken opencode setup: {exc}", file=sys.stderr)
            return 2
    scope = "project" if args.project else "global"
    env = dict(os.environ)
    project = Path(env.get("PWD") or Path.cwd())
    if not project.is_dir() or project.resolve() != Path.cwd().resolve():
        project = Path.cwd()
    result = setup(
        scope,
        relay_url=relay_url,
        routes=config.routes,
        project=project,
        env=env,
        probe=_is_unbroken,
    )
    for pid, url in result.routed.items():
        print(f"{pid}: baseURL -> {url}")
    for pid in result.already:
        print(f"{pid}: already routed through {relay_url}")
    for p in result.missing:
        print(f"{p.id}: left alone ({p.problem})")
        if p.url is not None:
            print(
                f"  to relay it, add to your unbroken config:\n"
                f"  [routes.{route_name(p.id, set())}]\n"
                f'  upstreams = [{{ url = "{p.url}" }}]'
            )
    if result.changed:
        print(
            f"patched {result.path} (backup kept; `unbroken opencode undo"
            f"{' --project' if args.project else ''}` restores it)"
        )
    else:
        print(f"{result.path}: nothing to change")
    live = _relay_routes(relay_url)
    if live is None:
        print(f"note: no unbroken relay answers at {relay_url}; start it with `unbroken serve`")
    else:
        needed = {u.removeprefix(relay_url + "/").split("/", 1)[0] for u in result.routed.values()}
        absent = sorted(needed - set(live))
        if absent:
            print(
                f"warning: the running relay has no route {', '.join(absent)}; "
                "restart `unbroken serve` with the same config"
            )
    return 0


def _undo_cmd(args: argparse.Namespace) -> int:
    scope = "project" if args.project else "global"
    result = undo(scope, project=Path.cwd(), env=dict(os.environ))
    for line in result.lines():
        print(line)
    return 1 if result.action == "nothing" else 0


# -- registration ----------------------------------------------------------------------


def register(sub: Any) -> None:
    p_run = sub.add_parser(
        "run",
        help="run an agent (OpenCode, Codex, Claude Code, any command) through a private relay",
        description="Launch an agent through a private relay: `unbroken run -- opencode|codex|"
        "claude|<command> [args...]`. No unbroken config needed.",
    )
    p_run.add_argument(
        "--config",
        metavar="FILE",
        help="unbroken TOML config for the retry settings (default: "
        "$UNBROKEN_CONFIG, else the built-in defaults)",
    )
    p_run.add_argument(
        "--no-resume", action="store_true", help="do not re-send turns that die after output"
    )
    p_run.add_argument(
        "--log",
        metavar="FILE",
        help="write the relay's log here (default: stderr; under the TUI, "
        "$XDG_STATE_HOME/unbroken/run.log)",
    )
    p_run.add_argument(
        "--print-env",
        action="store_true",
        help="print the environment and arguments it would set, and exit",
    )
    p_run.add_argument(
        "command",
        nargs=argparse.REMAINDER,
        help="-- opencode|codex|claude|gemini|<command> [args...]",
    )
    p_run.set_defaults(func=_run_cmd)

    p_oc = sub.add_parser(
        "opencode",
        help="install unbroken into OpenCode's config (setup, undo)",
        description="Make the relay permanent in OpenCode's config for a running "
        "`unbroken serve` (setup), or put the config back (undo).",
    )
    oc_sub = p_oc.add_subparsers(dest="opencode_command", metavar="{setup,undo}")

    def usage(args: argparse.Namespace) -> int:
        p_oc.print_help(sys.stderr)
        return 2

    p_oc.set_defaults(func=usage)
    for name, helptext in (
        ("setup", "point OpenCode's providers at a running `unbroken serve` (keeps a backup)"),
        ("undo", "restore opencode.json byte for byte from the backup"),
    ):
        p = oc_sub.add_parser(name, help=helptext, description=helptext)
        scope = p.add_mutually_exclusive_group()
        scope.add_argument(
            "--global",
            dest="global_",
            action="store_true",
            help="the global config, $XDG_CONFIG_HOME/opencode (the default)",
        )
        scope.add_argument(
            "--project", action="store_true", help="./opencode.json in the current directory"
        )
        if name == "setup":
            p.add_argument(
                "--config",
                metavar="FILE",
                help="the unbroken config `unbroken serve` runs with (default: "
                "$UNBROKEN_CONFIG, else the built-in routes)",
            )
            p.add_argument(
                "--relay",
                metavar="URL",
                help="the relay's URL (default: from the config, http://127.0.0.1:4780)",
            )
            p.set_defaults(func=_setup_cmd)
        else:
            p.set_defaults(func=_undo_cmd)
