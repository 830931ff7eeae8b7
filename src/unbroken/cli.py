"""Command line: ``unbroken serve``, ``unbroken mock``."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import logging
import sys
from collections.abc import Sequence

from unbroken import __version__
from unbroken.config import ConfigError, load_config

__all__ = ["main"]


def _setup_logging() -> None:
    logging.basicConfig(
        level=logging.INFO,
        stream=sys.stderr,
        format="%(asctime)s %(name)s %(levelname)s %(message)s",
    )
    logging.getLogger("aiohttp.access").setLevel(logging.WARNING)


def _serve(args: argparse.Namespace) -> int:
    from unbroken.server import serve

    try:
        config = load_config(args.config)
    except ConfigError as exc:
        print(f"unbroken: invalid config: {exc}", file=sys.stderr)
        return 2
    overrides: dict[str, object] = {}
    if args.host is not None:
        overrides["host"] = args.host
    if args.port is not None:
        overrides["port"] = args.port
    if overrides:
        config = dataclasses.replace(config, **overrides)
    _setup_logging()

    def ready(url: str) -> None:
        routes = ", ".join(sorted(config.routes))
        print(f"unbroken {__version__} relaying on {url} (routes: {routes})", flush=True)

    try:
        return asyncio.run(serve(config, ready=ready))
    except OSError as exc:
        print(f"unbroken: cannot listen on {config.host}:{config.port}: {exc.strerror}",
              file=sys.stderr)
        return 1


def _mock(argv: list[str]) -> int:
    from unbroken.mock.cli import main_mock

    return main_mock(argv)


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "mock":
        return _mock(argv[1:])
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
    sub.add_parser("mock", help="run the fault-injecting mock provider (see: unbroken mock --help)")
    args = parser.parse_args(argv)
    if args.command == "serve":
        return _serve(args)
    return 2
