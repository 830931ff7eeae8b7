"""`unbroken run -- codex|claude|gemini|<any command> [args...]`: a private relay, then the agent.

Zero config, like the OpenCode launcher: a relay starts on a free loopback port
with one route per provider the agent uses, the agent is launched pointed at it
(environment and arguments only: no file of the user's is touched), keys pass
through, the agent's exit code is returned and the relay stops with it.

* ``codex``: every provider of ``$CODEX_HOME/config.toml`` plus the built-in
  ``openai`` (`unbroken.agents.codex`);
* ``claude``: ``ANTHROPIC_BASE_URL`` (`unbroken.agents.claude`);
* ``gemini``: ``GOOGLE_GEMINI_BASE_URL`` (and ``GOOGLE_VERTEX_BASE_URL`` for Vertex
  AI), keeping Gemini CLI's auth choice (`unbroken.agents.gemini_cli`);
* anything else: ``OPENAI_BASE_URL``, ``OPENAI_API_BASE`` and ``ANTHROPIC_BASE_URL``
  for SDK-based scripts and tools (aider and friends).

``unbroken run --print-env -- <agent>`` prints what it would set, for people who
wire the agent to their own ``unbroken serve``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import shlex
import sys
import tempfile
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, TextIO

from unbroken.agents import claude, codex, gemini_cli
from unbroken.agents.child import cannot_start, log_to, run_child, setup_run_logging
from unbroken.agents.plan import (
    FILES,
    RELAY,
    Launch,
    TokenWay,
    private_token,
    relay_base,
    split_version,
    token_note,
)
from unbroken.config import (
    TOKEN_ENV,
    Config,
    ConfigError,
    Route,
    load_config,
    with_upstream,
)
from unbroken.config_values import validate_url

__all__ = ["agent_of", "generic_plan", "plan_for", "print_env", "relay_config", "run_agent"]

log = logging.getLogger("unbroken")


def agent_of(command: Sequence[str]) -> str:
    """``codex``, ``claude``, ``gemini`` or ``generic``, from the program's name."""
    name = Path(command[0]).name.lower()
    if name.endswith((".js", ".cmd", ".exe")):
        name = name.rsplit(".", 1)[0]
    if name == "codex" or name.startswith("codex-"):
        return "codex"
    if name == "claude" or name.startswith("claude-code"):
        return "claude"
    if name == "gemini" or name.startswith("gemini-cli"):
        return "gemini"
    return "generic"


def generic_plan(env: Mapping[str, str]) -> Launch:
    """Any other command: the base-URL variables the openai/anthropic SDKs (and the
    tools built on them) read."""
    routes: dict[str, str] = {}
    out_env: dict[str, str] = {}
    notes: list[str] = []
    openai = env.get("OPENAI_BASE_URL") or env.get("OPENAI_API_BASE") or codex.OPENAI_DEFAULT
    anthropic = env.get("ANTHROPIC_BASE_URL") or claude.ANTHROPIC_DEFAULT
    for name, url, names in (
        ("openai", openai, ("OPENAI_BASE_URL", "OPENAI_API_BASE")),
        ("anthropic", anthropic, ("ANTHROPIC_BASE_URL",)),
    ):
        try:
            routes[name], version = split_version(validate_url(names[0], url))
        except ConfigError as exc:
            notes.append(f"run: not relaying {name}: {exc}")
            continue
        for var in names:
            out_env[var] = f"{RELAY}/{name}{version}"
    notes.append(
        "run: not a known agent; setting "
        + ", ".join(out_env)
        + " for the openai/anthropic SDKs and the tools built on them ("
        + ", ".join(f"{n} -> {u}" for n, u in routes.items())
        + ")"
    )
    return Launch("generic", routes=routes, env=out_env, notes=tuple(notes))


def plan_for(command: Sequence[str], env: Mapping[str, str]) -> Launch:
    agent = agent_of(command)
    if agent == "codex":
        return codex.plan(env, command[1:])
    if agent == "claude":
        return claude.plan(env)
    if agent == "gemini":
        return gemini_cli.plan(env)
    return generic_plan(env)


def relay_config(base: Config, launch: Launch) -> Config:
    """The private relay's config: the launch's routes (over the built-in ones), on a
    free loopback port, with the agent's client tuning under the user's own."""
    routes: dict[str, Route] = dict(base.routes)
    for name, url in launch.routes.items():
        routes[name] = with_upstream(routes.get(name), name, url)
    clients: dict[str, Mapping[str, Any]] = {k: dict(v) for k, v in launch.clients.items()}
    for name, table in base.clients.items():
        clients[name] = {**clients.get(name, {}), **table}
    # A private loopback relay for this one agent: when a route injects a key, a token
    # of its own that route needs (given to the agent in its base URLs), else none.
    return dataclasses.replace(
        base,
        routes=routes,
        clients=clients,
        host="127.0.0.1",
        port=0,
        token=None,
        token_env=None,
        key_token=private_token(routes),
    )


def print_env(
    command: Sequence[str], base: Config, env: Mapping[str, str], out: TextIO | None = None
) -> None:
    """What `run` would set, pointed at ``unbroken serve`` (the config's host and port)."""
    out = out or sys.stdout
    # The user's own header variables stay theirs: printed as a shell expansion, never
    # their value (a gateway's credentials may be in them).
    own = {v: f"UNBROKEN-OWN-{v}-MARK" for v in _HEADER_VARS if (env.get(v) or "").strip()}
    launch = plan_for(command, {**env, **own})
    host = base.host or "127.0.0.1"
    shown = f"[{host}]" if ":" in host else host
    plain = f"http://{shown}:{base.port}"
    out.write(f"# unbroken run -- {command[0]}: point it at unbroken serve ({plain})\n")
    # The relay's token, when it needs one, as a shell expansion (never its value):
    # the variable it is read from, or the file `unbroken serve` keeps it in.
    # An agent whose base URLs are all in its environment and that has a header setting
    # gets it in a header, as `run` gives it; otherwise in the base URLs (Codex: on its
    # command line, the one way its built-in openai provider can send it).
    ref = _token_ref(base, launch, env)
    in_args = any(RELAY in a for a in launch.args)
    header = ref is not None and not in_args and launch.token_way(_TOKEN_MARK) is TokenWay.HEADER
    mark = _TOKEN_MARK if header else None
    relay = f"{plain}/t/{_TOKEN_MARK}" if ref and not header else plain

    marks = {m: "${" + v + "}" for v, m in own.items()}
    if ref is not None:
        marks[_TOKEN_MARK] = ref

    def quote(value: str) -> str:
        quoted = shlex.quote(value)
        present = [(m, r) for m, r in marks.items() if m in quoted]
        if not present:
            return quoted
        if quoted[0] != "'":
            for m, r in present:
                quoted = quoted.replace(m, f'"{r}"')
            return quoted
        out = quoted
        for m, r in present:
            out = out.replace(m, f"'\"{r}\"'")
        if any(quoted.startswith(f"'{m}") for m, _ in present):
            out = out[2:]  # no '' at the start
        if any(quoted.endswith(f"{m}'") for m, _ in present):
            out = out[:-2]  # nor at the end
        return out.replace("\n", "'$'\\n''")  # one line (bash, zsh: $'\n')

    missing = [
        n
        for n, u in launch.routes.items()
        if n not in base.routes or base.routes[n].upstreams[0].url != u
    ]
    if missing:
        out.write("# routes to add to your unbroken config (--config / $UNBROKEN_CONFIG):\n")
        for name in missing:
            url = launch.routes[name]
            out.write(f'#   [routes.{name}]\n#   upstreams = [{{ url = "{url}" }}]\n')
    for key, value in launch.resolved_env(relay, token=mark).items():
        if FILES not in launch.env.get(key, ""):  # a file `run` writes: shown below instead
            out.write(f"export {key}={quote(value)}\n")
    if launch.args:
        out.write(" ".join(quote(a) for a in launch.argv(command, relay, mark)) + "\n")
    for table, values in launch.clients.items():
        out.write(
            f"# optional, for this agent's timers: [clients.{table}] "
            + ", ".join(f"{k} = {v}" for k, v in values.items())
            + "\n"
        )
    for name, text in launch.files.items():
        var = next((k for k, v in launch.env.items() if FILES in v and name in v), None)
        out.write(
            f"# `unbroken run` points {var} at a private file (keep yours if it has "
            "this; Gemini CLI: or put it in ~/.gemini/settings.json):\n"
        )
        out.writelines(f"#   {line}\n" for line in text.splitlines())


#: stands for the token in `print_env`'s URLs until they are quoted for the shell
_TOKEN_MARK = "UNBROKEN-TOKEN-MARK"
#: the agents' header variables `print_env` may add the token to (the user's own kept)
_HEADER_VARS = ("ANTHROPIC_CUSTOM_HEADERS", "GEMINI_CLI_CUSTOM_HEADERS")


def _token_ref(base: Config, launch: Launch, env: Mapping[str, str]) -> str | None:
    """How the printed commands get ``unbroken serve``'s token: ``${UNBROKEN_TOKEN}`` (or
    the ``[server] token_env`` variable), ``$(cat <token file>)`` when a route the agent
    uses injects a key and no token is set (`relay.tokenfile`), else None."""
    if base.token is not None:
        return "${" + (base.token_env or TOKEN_ENV) + "}"
    keyed = [n for n in launch.routes if n in base.routes and base.routes[n].injects_key]
    if keyed:
        from unbroken.relay.tokenfile import default_token_path

        return f"$(cat {shlex.quote(str(default_token_path(env)))})"
    return None


async def run_agent(
    command: Sequence[str],
    *,
    base: Config,
    env: Mapping[str, str],
    cwd: Path,
    ready: Callable[[str], None] | None = None,
) -> int:
    """Relay the agent's providers, launch ``command``, return its exit code."""
    from unbroken.relay.server import RelayServer

    launch = plan_for(command, env)
    server = RelayServer(relay_config(base, launch))
    await server.start()
    files = tempfile.TemporaryDirectory(prefix="unbroken-run-") if launch.files else None
    try:
        token = server.config.key_token
        # A base URL is readable by other users wherever a process puts it on its command
        # line (/proc/<pid>/cmdline): the agent's own (Codex's -c), or a tool it runs.  So
        # the token goes in a header where the agent has a setting for one, in the base
        # URLs (its environment) where not, and nowhere when they are on its command line.
        way = launch.token_way(token)
        relay = relay_base(server.url, token if way is TokenWay.URL else None)
        for note in launch.notes:
            log.info("%s", note)
        log.info("run: relay on %s", server.url)  # never the token
        if token is not None:
            log.info("run: %s", token_note(way))
        if files is not None:
            for name, text in launch.files.items():
                (Path(files.name) / name).write_text(text, encoding="utf-8")
        own = launch.resolved_env(relay, files.name if files else "", token)
        child_env = {**env, **own}
        argv = launch.argv(command, relay, token)
        if ready is not None:
            ready(relay)
        return await run_child(argv, env=child_env, cwd=cwd)
    finally:
        if files is not None:
            files.cleanup()
        await server.stop()


def _interactive(command: Sequence[str], agent: str) -> bool:
    """The agent owns the terminal (a TUI): the relay's log goes to a file."""
    if not sys.stdout.isatty():
        return False
    args = list(command[1:])
    if agent == "codex":
        positional = [a for a in args if not a.startswith("-")]
        return not positional or positional[0] not in ("exec", "e", "mcp", "login", "logout")
    if agent == "claude":
        return not ({"-p", "--print"} & set(args))
    if agent == "gemini":
        return sys.stdin.isatty() and not any(
            a in ("-p", "--prompt") or a.startswith("--prompt=") for a in args
        )
    return False


def run_cmd(
    command: Sequence[str], *, config: str | None, log_path: str | None, print_only: bool
) -> int:
    """`unbroken run -- <non-OpenCode command>` (called by the run subcommand)."""
    env = dict(os.environ)
    try:
        base = load_config(config)
    except (ConfigError, ValueError) as exc:
        print(f"unbroken: invalid config: {exc}", file=sys.stderr)
        return 2
    if print_only:
        print_env(command, base, env)
        return 0
    problem = cannot_start(command[0], env)
    if problem is not None:
        return problem
    base = dataclasses.replace(base, grace_s=min(base.grace_s, 2.0))
    agent = agent_of(command)
    log_file = log_to(log_path, _interactive(command, agent), env)
    setup_run_logging(log_file)
    if log_file is not None:
        print(f"unbroken: relaying {command[0]}; log: {log_file}", file=sys.stderr)
    return asyncio.run(run_agent(command, base=base, env=env, cwd=Path.cwd()))
