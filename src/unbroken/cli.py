"""Command line: ``unbroken serve``, ``unbroken mock`` and the feature commands.

Each feature module that adds commands exposes ``register(sub)``, which adds
its sub-parsers and sets ``func`` on them (a callable taking the parsed
arguments and returning an exit code).  `COMMAND_MODULES` lists them.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import importlib
import logging
import sys
from collections.abc import Sequence
from typing import Any

from unbroken import __version__
from unbroken.config import ConfigError, load_config

__all__ = ["main", "setup_logging"]

#: Feature modules whose ``register(subparsers)`` adds commands.
COMMAND_MODULES: tuple[str, ...] = (
    "unbroken.observe.stats",
    "unbroken.observe.status",
    "unbroken.demo",
    "unbroken.opencode.launcher",
    "unbroken.opencode.resume",
)


def setup_logging() -> None:
    logging.basicConfig(
        level=logging.INFO,
        stream=sys.stderr,
        format="%(asctime)s %(name)s %(levelname)s %(message)s",
    )
    logging.getLogger("aiohttp.access").setLevel(logging.WARNING)


def _serve(args: argparse.Namespace) -> int:
    from unbroken.relay.server import serve

    try:
        config = load_config(args.config)
    except ConfigError as exc:
        print(f"unbroken: invalid config: {exc}", file=sys.stderr)
        return 2
    overrides: dict[str, Any] = {}
    if args.host is not None:
        overrides["host"] = args.host
    if args.port is not None:
        overrides["port"] = args.port
    if overrides:
        config = dataclasses.replace(config, **overrides)
    setup_logging()

    def ready(url: str) -> None:
        routes = ", ".join(sorted(config.routes))
        print(f"unbroken {__version__} relaying on {url} (routes: {routes})", flush=True)

    try:
        return asyncio.run(serve(config, ready=ready))
    except OSError as exc:
        print(
            f"unbroken: cannot listen on {config.host}:{config.port}: {exc.strerror}",
            file=sys.stderr,
        )
        return 1


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="unbroken",
        description="A relay that keeps AI coding agent sessions alive when LLM providers fail.",
    )
    parser.add_argument("--version", action="version", version=f"unbroken {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    p_serve = sub.add_parser("serve", help="run the relay")
    p_serve.add_argument("--config", help="TOML config file (default: $UNBROKEN_CONFIG)")
    p_serve.add_argument("--host", help="listen address (default 127.0.0.1)")
    p_serve.add_argument("--port", type=int, help="listen port (default 4780)")
    p_serve.set_defaults(func=_serve)
    sub.add_parser("mock", help="run the fault-injecting mock provider (unbroken mock --help)")
    for name in COMMAND_MODULES:
        importlib.import_module(name).register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "mock":
        from unbroken.mock.cli import main_mock

        return main_mock(argv[1:])
    args = _parser().parse_args(argv)
    result: int = args.func(args)
    return result
