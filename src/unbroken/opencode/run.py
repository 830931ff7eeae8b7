"""``unbroken run -- <agent> [args...]``, and what it does for OpenCode.

``unbroken run -- opencode [args...]`` reads the user's OpenCode config
(`unbroken.opencode.discovery`), starts a relay on a free loopback port with one
route per provider in use, and launches OpenCode with ``OPENCODE_CONFIG_CONTENT``
pointing each provider's ``baseURL`` at that route.  When OpenCode exposes its
server (the TUI, ``serve``, ``web``) the auto-resumer watches it too.  OpenCode's
exit code is returned; the relay stops afterwards.  Every other command goes to
`unbroken.agents.launcher`.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import logging
import os
import shlex
import socket
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final, TextIO

from unbroken.agents.child import cannot_start, log_to, run_child, setup_run_logging
from unbroken.agents.plan import TokenWay, token_note
from unbroken.config import Config, ConfigError, load_config
from unbroken.opencode.discovery import (
    content_with_relay,
    discover,
    load_merged,
    opencode_relay_config,
    route_for,
    route_name,
)
from unbroken.relay.access import TOKEN_HEADER

__all__ = ["OpenCodeArgs", "parse_opencode_args", "register", "run_opencode", "server_args"]

log = logging.getLogger("unbroken.opencode.run")

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
        # The token, if any, in a header of each provider (``options.headers``), not in
        # the base URLs: a tool that puts one on its command line shows no token.
        token = server.config.key_token
        base_urls = {pid: f"{server.url}/{name}" for pid, name in names.items()}
        headers = {TOKEN_HEADER: token} if token is not None else None
        argv = list(command)
        watch: str | None = None
        why = "disabled (--no-resume)"
        if resume:
            rest, watch, why = server_args(argv[1:], parsed)
            argv = [argv[0], *rest]
        relayed = ", ".join(f"{pid} -> {server.url}/{n}" for pid, n in names.items()) or "none"
        log.info("opencode: relay on %s; providers: %s", server.url, relayed)
        if server.config.key_token is not None:
            log.info("opencode: %s", token_note(TokenWay.HEADER))
        if watch is None:
            log.info("opencode: auto-resume off: %s", why)
        if ready is not None:
            ready(server.url)
        return await run_child(
            argv,
            env=_child_env(env, cwd, base_urls, headers),
            cwd=cwd,
            beside=None if watch is None else lambda proc: _follow(watch, env, proc),
        )
    finally:
        await server.stop()


def print_opencode_env(
    command: Sequence[str],
    base: Config,
    env: Mapping[str, str],
    cwd: Path,
    out: TextIO | None = None,
) -> None:
    """What OpenCode needs to go through ``unbroken serve`` (the config's host and port):
    ``OPENCODE_CONFIG_CONTENT`` with each provider it uses pointed at the relay's route
    to that provider's real URL, and the routes to add for those the relay lacks."""
    out = out or sys.stdout
    host = base.host or "127.0.0.1"
    relay = f"http://{f'[{host}]' if ':' in host else host}:{base.port}"
    parsed = parse_opencode_args(command[1:])
    project = cwd / parsed.project if parsed.project else cwd
    user_config, _ = load_merged(project if project.is_dir() else cwd, env)
    providers = discover(user_config, env, model_arg=parsed.model)
    out.write(f"# unbroken run -- {command[0]}: point it at unbroken serve ({relay})\n")
    base_urls: dict[str, str] = {}
    missing: list[tuple[str, str]] = []
    for p in providers:
        if p.url is None:
            out.write(f"# not relayed: {p.id} ({p.problem})\n")
            continue
        match = route_for(p.url, base.routes)
        if match is None:
            missing.append((p.id, p.url))
            continue
        name, suffix = match
        base_urls[p.id] = f"{relay}/{name}{suffix}"
    if missing:
        out.write("# routes to add to your unbroken config (--config / $UNBROKEN_CONFIG):\n")
        taken = set(base.routes)
        for pid, url in missing:
            name = route_name(pid, taken)
            out.write(f'#   [routes.{name}]\n#   upstreams = [{{ url = "{url}" }}]\n')
            base_urls[pid] = f"{relay}/{name}"
    if not providers:
        out.write("# OpenCode's config names no provider in use: nothing to point\n")
        return
    content = content_with_relay(env.get("OPENCODE_CONFIG_CONTENT"), base_urls)
    out.write(f"export OPENCODE_CONFIG_CONTENT={shlex.quote(content)}\n")
    out.write(shlex.join(list(command)) + "\n")
    out.write("# or for good, in opencode.json (with a backup): unbroken opencode setup\n")


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
    return opencode_relay_config(base, [p for p in providers if p.url is not None])


def _child_env(
    env: Mapping[str, str],
    cwd: Path,
    base_urls: Mapping[str, str],
    headers: Mapping[str, str] | None = None,
) -> dict[str, str]:
    child_env = dict(env)
    child_env["PWD"] = str(cwd)  # OpenCode takes its directory from PWD, not the cwd
    if base_urls:
        child_env["OPENCODE_CONFIG_CONTENT"] = content_with_relay(
            env.get("OPENCODE_CONFIG_CONTENT"), base_urls, headers
        )
    return child_env


class _Follower:
    """Auto-resume beside a running OpenCode: started with it, stopped when it exits."""

    def __init__(
        self, watch: str, env: Mapping[str, str], proc: asyncio.subprocess.Process
    ) -> None:
        from unbroken.opencode.resume import Resumer
        from unbroken.opencode.resume_policy import settings_from_env

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
    from unbroken.opencode.resume_policy import settings_from_env

    env = dict(os.environ)
    if args.print_env:
        try:
            base = load_config(args.config)
        except (ConfigError, ValueError) as exc:
            print(f"unbroken: invalid config: {exc}", file=sys.stderr)
            return 2
        print_opencode_env(command, base, env, Path.cwd())
        return 0
    try:
        base = load_config(args.config)
        settings_from_env(env)
    except (ConfigError, ValueError) as exc:
        print(f"unbroken: invalid config: {exc}", file=sys.stderr)
        return 2
    problem = cannot_start(command[0], env)
    if problem is not None:
        return problem
    base = dataclasses.replace(base, grace_s=min(base.grace_s, 2.0))
    parsed = parse_opencode_args(command[1:])
    interactive = parsed.subcommand is None and sys.stdout.isatty()
    log_file = log_to(args.log, interactive, env)
    setup_run_logging(log_file)
    if log_file is not None:
        print(f"unbroken: relaying OpenCode's providers; log: {log_file}", file=sys.stderr)
    cwd = Path.cwd()
    return asyncio.run(
        run_opencode(command, base=base, env=env, cwd=cwd, resume=not args.no_resume)
    )


# -- registration ----------------------------------------------------------------------


def register(sub: Any) -> None:
    p_run = sub.add_parser(
        "run",
        help="run an agent (OpenCode, Codex, Claude Code, Gemini CLI, any command) through a "
        "private relay",
        description="Launch an agent through a private relay: `unbroken run -- opencode|codex|"
        "claude|gemini|<command> [args...]`. No unbroken config needed. A command that "
        "cannot be run is one line and exit 127 (not found) or 126 (not executable), "
        "before anything starts.",
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
