"""Command line: ``unbroken serve``, ``unbroken mock`` and the feature commands.

Each feature module that adds commands exposes ``register(sub)``, which adds
its sub-parsers and sets ``func`` on them (a callable taking the parsed
arguments and returning an exit code).  `COMMAND_MODULES` lists them.

Bad input never ends in a traceback: a usage error is one line and exit code
2 (`OneLineParser`), and a ``ValueError``, ``OSError`` or ``UnicodeError`` that
escapes a command is reported as one line, exit code 2, too.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import importlib
import logging
import os
import sys
from collections.abc import Sequence
from typing import Any

from unbroken import __version__
from unbroken.cmdline import OneLineParser, setup_logging
from unbroken.cmdline import one_line as _one_line
from unbroken.config import ConfigError, bind_problem, load_config
from unbroken.config_values import check_host, port_number

__all__ = ["BROKEN_PIPE_EXIT", "OneLineParser", "main", "port_number", "setup_logging"]


#: Feature modules whose ``register(subparsers)`` adds commands.
COMMAND_MODULES: tuple[str, ...] = (
    "unbroken.observe.stats",
    "unbroken.observe.status",
    "unbroken.demo",
    "unbroken.opencode.run",
    "unbroken.opencode.setup",
    "unbroken.opencode.resume",
)
#: the module of each command, so that running one imports only its own (the demo
#: alone pulls in the openai SDK: a quarter of a second before ``unbroken run`` starts
#: its agent); ``--help`` and anything unknown still get every command
COMMAND_OF: dict[str, str] = {
    "stats": "unbroken.observe.stats",
    "status": "unbroken.observe.status",
    "demo": "unbroken.demo",
    "run": "unbroken.opencode.run",
    "opencode": "unbroken.opencode.setup",
    "resume": "unbroken.opencode.resume",
}


def _serve(args: argparse.Namespace) -> int:
    from unbroken.relay.server import serve

    try:
        config = load_config(args.config)
        overrides: dict[str, Any] = {}
        if args.host is not None:
            overrides["host"] = check_host("--host", args.host)  # "" is loopback
        if args.port is not None:
            overrides["port"] = args.port
    except ConfigError as exc:
        print(f"unbroken: invalid config: {_one_line(exc)}", file=sys.stderr)
        return 2
    if overrides:
        config = dataclasses.replace(config, **overrides)
    problem = bind_problem(config)
    if problem is not None:
        print(f"unbroken: {problem}", file=sys.stderr)
        return 2
    token_note = None
    if config.token is None and config.injects_keys:
        # No key without a right to it: the routes that inject a key need a token.
        from unbroken.relay.tokenfile import TokenFileError, default_token_path, load_or_create

        path = default_token_path()
        try:
            key_token, created = load_or_create(path)
        except (TokenFileError, OSError) as exc:
            detail: object = exc
            if isinstance(exc, OSError):  # (`load_or_create` names the path itself)
                detail = f"token file {path}: {exc.strerror or type(exc).__name__}"
            print(f"unbroken: {_one_line(detail)} (or set UNBROKEN_TOKEN)", file=sys.stderr)
            return 2
        config = dataclasses.replace(config, key_token=key_token)
        keyed = ", ".join(sorted(n for n, r in config.routes.items() if r.injects_key))
        token_note = (
            f"routes that inject a key ({keyed}) need the token in {path} "
            f"({'created' if created else 'kept'}, mode 0600): send it as x-unbroken-token "
            "or in a /t/<token>/ prefix; other routes need none on loopback"
        )
    setup_logging()
    if token_note is not None:
        logging.getLogger("unbroken").info("%s", token_note)

    def ready(url: str) -> None:
        routes = ", ".join(sorted(config.routes))
        print(f"unbroken {__version__} relaying on {url} (routes: {routes})", flush=True)
        # the token itself is never printed: the reader puts in the one they set
        view = f"{url}/t/<token>/ui" if config.token else f"{url}/ui"
        print(f"web view: {view}", flush=True)

    try:
        if args.workers > 1:
            from unbroken.relay.workers import serve_workers

            return serve_workers(config, args.workers, ready=ready)
        return asyncio.run(serve(config, ready=ready))
    except OSError as exc:
        print(
            f"unbroken: cannot listen on {config.host}:{config.port}: "
            f"{exc.strerror or _one_line(exc)}",
            file=sys.stderr,
        )
        return 1


def _workers(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        n = 0
    if not 1 <= n <= 256:
        raise argparse.ArgumentTypeError(f"expected 1..256, got {text!r}")
    return n


def _parser(command: str | None = None) -> argparse.ArgumentParser:
    """The parser; with ``command`` (the first argument), only what that command needs."""
    parser = OneLineParser(
        prog="unbroken",
        description="A relay that keeps AI coding agent sessions alive when LLM providers fail.",
    )
    parser.add_argument("--version", action="version", version=f"unbroken {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    p_serve = sub.add_parser("serve", help="run the relay")
    p_serve.add_argument("--config", help="TOML config file (default: $UNBROKEN_CONFIG)")
    p_serve.add_argument(
        "--host",
        help="listen address (default 127.0.0.1; '' is loopback too). Any address that is "
        "not loopback needs a token: UNBROKEN_TOKEN or [server] token_env",
    )
    p_serve.add_argument("--port", type=port_number, help="listen port, 0-65535 (default 4780)")
    p_serve.add_argument(
        "--workers",
        type=_workers,
        default=1,
        metavar="N",
        help="N relay processes on the same port (SO_REUSEPORT), supervised: a crashed worker "
        "is restarted; they share upstream health (default 1)",
    )
    p_serve.set_defaults(func=_serve)
    sub.add_parser("mock", help="run the fault-injecting mock provider (unbroken mock --help)")
    only = COMMAND_OF.get(command or "")
    for name in COMMAND_MODULES if only is None else (only,):
        importlib.import_module(name).register(sub)
    return parser


#: the exit status when the reader of stdout went away (``unbroken stats --json | head -c
#: 1``): a Unix tool that SIGPIPE ends shows 128 + 13 in the shell
BROKEN_PIPE_EXIT = 141


def main(argv: Sequence[str] | None = None) -> int:
    """Run one command; its exit code.  If stdout's reader went away, stop quietly with
    `BROKEN_PIPE_EXIT`, as ``cat`` or ``git log`` do, not with an error and not with
    Python's "Exception ignored" on the interpreter's last flush."""
    try:
        try:
            return _main(argv)
        finally:
            sys.stdout.flush()  # a broken pipe shows here when the output was short
    except BrokenPipeError:
        # The recipe of Python's signal docs: stdout points at devnull from here on, so
        # the interpreter's own flush at exit has nowhere to fail.
        with contextlib.suppress(OSError, ValueError):
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, sys.stdout.fileno())
        return BROKEN_PIPE_EXIT


def _main(argv: Sequence[str] | None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "mock":
        from unbroken.mock.command import main_mock

        return main_mock(argv[1:])
    args = _parser(argv[0] if argv else None).parse_args(argv)
    try:
        result: int = args.func(args)
    except BrokenPipeError:
        raise  # not bad input: `main` ends quietly
    except (ValueError, OSError, UnicodeError) as exc:
        # Bad input that a command did not catch itself: one line, never a traceback.
        name = getattr(args, "command", None) or "unbroken"
        detail = _one_line(exc) or type(exc).__name__
        print(f"unbroken {name}: error: {detail}", file=sys.stderr)
        return 2
    return result
