"""``unbroken mock``: run the mock provider from the command line."""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
import sys
import tomllib
from pathlib import Path
from typing import Any

from unbroken.cmdline import OneLineParser
from unbroken.config_values import ConfigError, check_host, port_number
from unbroken.mock.actions import (
    ActionError,
    expand_actions,
    expand_upgrade_actions,
    parse_action,
)
from unbroken.mock.limits import BEHAVIOURS, MockLimits
from unbroken.mock.provider import MockProvider

__all__ = ["ScriptFile", "load_script", "main_mock", "serve_mock"]

DEFAULT_PORT = 4781
_SCRIPT_KEYS = ("default", "actions", "queues", "upgrades", "upgrade_queues")


def _queue_map(value: Any, name: str, expand: Any) -> dict[str, list[Any]]:
    if not isinstance(value, dict):
        raise ActionError(f"{name}: expected an object of queue name to action list")
    out: dict[str, list[Any]] = {}
    for queue, items in value.items():
        expand(items, where=f"{name}.{queue}")
        out[str(queue)] = items
    return out


class ScriptFile:
    """A validated script file.

    ``{"default": {...}, "actions": [...], "queues": {K: [...]}, "upgrades": [...],
    "upgrade_queues": {K: [...]}}``: ``upgrades`` are WebSocket upgrade actions
    (``{}`` accept, ``{"status": N}`` refuse, ``{"fault": "close_before_headers"}``).
    """

    def __init__(self, data: Any, source: str = "script") -> None:
        if not isinstance(data, dict):
            raise ActionError(f"{source}: top level must be an object")
        for key in data:
            if key not in _SCRIPT_KEYS:
                raise ActionError(
                    f"{key}: unknown top-level key (expected {', '.join(_SCRIPT_KEYS)})"
                )
        self.default: dict[str, Any] | None = data.get("default")
        parse_action(self.default, where="default")
        self.actions: list[Any] = data.get("actions") or []
        expand_actions(self.actions, where="actions")
        self.queues = _queue_map(data.get("queues") or {}, "queues", expand_actions)
        self.upgrades: list[Any] = data.get("upgrades") or []
        expand_upgrade_actions(self.upgrades, where="upgrades")
        self.upgrade_queues = _queue_map(
            data.get("upgrade_queues") or {}, "upgrade_queues", expand_upgrade_actions
        )

    def apply(self, mock: MockProvider) -> None:
        mock.script(self.actions)
        for name, items in self.queues.items():
            mock.script(items, key=name)
        mock.script_upgrades(self.upgrades)
        for name, items in self.upgrade_queues.items():
            mock.script_upgrades(items, key=name)


def load_script(path: str | Path) -> ScriptFile:
    """Load and validate a JSON or TOML script file (raises ActionError / OSError)."""
    path = Path(path)
    raw = path.read_bytes()
    data: Any
    if path.suffix.lower() == ".toml":
        try:
            data = tomllib.loads(raw.decode("utf-8"))
        except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
            raise ActionError(f"invalid TOML: {exc}") from None
    else:
        try:
            data = json.loads(raw)
        except ValueError as json_exc:
            try:
                data = tomllib.loads(raw.decode("utf-8"))
            except (tomllib.TOMLDecodeError, UnicodeDecodeError):
                raise ActionError(f"invalid JSON: {json_exc}") from None
    return ScriptFile(data, source=str(path))


async def serve_mock(
    host: str = "127.0.0.1",
    port: int = DEFAULT_PORT,
    script_path: str | Path | None = None,
    *,
    stop: asyncio.Event | None = None,
    limits: MockLimits | None = None,
) -> None:
    """Run the mock until ``stop`` is set, SIGINT/SIGTERM, or cancellation.

    Prints ``unbroken mock listening on http://HOST:PORT`` once ready.
    ``limits``: rate limits enforced per key from the start (`mock.limits`).
    """
    script = load_script(script_path) if script_path is not None else None
    mock = MockProvider(
        host=host, port=port, default=script.default if script else None, limits=limits
    )
    if script is not None:
        script.apply(mock)
    stop = stop or asyncio.Event()
    loop = asyncio.get_running_loop()
    installed: list[signal.Signals] = []
    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError, RuntimeError, ValueError):
            loop.add_signal_handler(sig, stop.set)
            installed.append(sig)
    try:
        async with mock:
            print(f"unbroken mock listening on {mock.url}", flush=True)
            await stop.wait()
    finally:
        for sig in installed:
            loop.remove_signal_handler(sig)


def _limit_options(parser: OneLineParser) -> None:
    g = parser.add_argument_group(
        "rate limits", "enforce RPM/TPM per key, as one provider of the zoo (docs/mock.md)"
    )
    g.add_argument(
        "--rate-limits",
        metavar="BEHAVIOUR",
        choices=BEHAVIOURS,
        help=f"enforce rate limits the way this provider does: {', '.join(BEHAVIOURS)} "
        "(default: no limits unless --rpm or --tpm is given, then textbook)",
    )
    g.add_argument("--rpm", type=float, metavar="N", help="requests a minute per key (default 60)")
    g.add_argument(
        "--tpm", type=float, metavar="N", help="tokens a minute per key (default 0: none)"
    )
    g.add_argument(
        "--rate-start",
        type=float,
        metavar="SHARE",
        help="share of each budget a new key has left (default 1)",
    )
    g.add_argument(
        "--shared",
        type=float,
        metavar="SHARE",
        help="'shared': share of each budget's refill that unseen traffic takes (default 0.5)",
    )
    g.add_argument(
        "--overstate",
        type=float,
        metavar="SHARE",
        help="'overstated': share of the limit added to the remaining reported (default 0.5)",
    )


def _limits(args: Any) -> MockLimits | None:
    """The `MockLimits` the rate-limit options ask for (ValueError: a bad value)."""
    table: dict[str, Any] = {}
    for opt, key in (
        ("rpm", "rpm"),
        ("tpm", "tpm"),
        ("rate_start", "start"),
        ("shared", "shared"),
        ("overstate", "overstate"),
    ):
        value = getattr(args, opt)
        if value is not None:
            table[key] = value
    if args.rate_limits is None and not table:
        return None
    table["behaviour"] = args.rate_limits or "textbook"
    try:
        return MockLimits.from_dict(table)
    except ValueError as exc:  # name the option, not the table key
        msg = str(exc).replace("limits.start", "--rate-start").replace("limits.", "--")
        raise ValueError(msg.replace("--behaviour", "--rate-limits")) from None


def main_mock(argv: list[str] | None = None) -> int:
    """Entry point for ``unbroken mock [--host H] [--port P] [--script FILE]``."""
    parser = OneLineParser(
        prog="unbroken mock",
        description="Run a deterministic, fault-injecting fake LLM provider "
        "(OpenAI Chat Completions, OpenAI Responses over HTTP and WebSocket, Anthropic "
        "Messages, the Gemini API's generateContent and streamGenerateContent).",
    )
    parser.add_argument("--host", default="127.0.0.1", help="bind address (default 127.0.0.1)")
    parser.add_argument(
        "--port",
        type=port_number,
        default=DEFAULT_PORT,
        help=f"port (default {DEFAULT_PORT}; 0 = any)",
    )
    parser.add_argument(
        "--script",
        metavar="FILE",
        help='JSON or TOML file: {"default": {...}, "actions": [...], "queues": {"K": [...]}, '
        '"upgrades": [...], "upgrade_queues": {"K": [...]}} (default: none: every request '
        "gets a clean answer until scripted over /_mock/script)",
    )
    _limit_options(parser)
    try:
        args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    except SystemExit as exc:  # --help or a usage error: report the code, don't exit
        return exc.code if isinstance(exc.code, int) else 2
    try:
        args.host = check_host("--host", args.host)
        limits = _limits(args)
    except (ConfigError, ValueError) as exc:
        print(f"unbroken mock: {exc}", file=sys.stderr)
        return 2
    if args.script is not None:
        try:
            load_script(args.script)
        except OSError as exc:
            print(f"unbroken mock: cannot read script {args.script}: {exc}", file=sys.stderr)
            return 2
        except ActionError as exc:
            print(f"unbroken mock: invalid script {args.script}: {exc}", file=sys.stderr)
            return 2
    try:
        asyncio.run(serve_mock(args.host, args.port, args.script, limits=limits))
    except KeyboardInterrupt:
        pass
    except OSError as exc:
        print(f"unbroken mock: cannot listen on {args.host}:{args.port}: {exc}", file=sys.stderr)
        return 1
    except (ValueError, UnicodeError) as exc:  # e.g. a host name that is not one
        print(f"unbroken mock: cannot listen on {args.host!r}: {exc}", file=sys.stderr)
        return 2
    return 0
