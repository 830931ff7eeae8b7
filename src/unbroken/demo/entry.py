"""``unbroken demo``: the command, its flags, and its run in a terminal.

The live table while the turns run (`output.render_run`), then the summary
(`output.format_summary`), or with ``--json`` the summary alone.  Bad flags are one
line and exit code 2, before anything starts; so is a missing ``openai`` SDK, which
the default protocol's agent needs (the ``demo`` extra).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import sys
from typing import Any

from unbroken.demo.output import format_summary, render_run
from unbroken.demo.runner import (
    AFTER_COMMIT,
    CONTINUE_PROTOCOLS,
    DEMO_PROTOCOLS,
    NO_GEMINI_CONTINUE,
    PROTOCOLS,
    DemoRun,
    run_demo,
    storms,
)

__all__ = ["register"]


def _demo(args: argparse.Namespace) -> int:
    logger = logging.getLogger("unbroken")
    level = logger.level
    logger.setLevel(logging.ERROR)  # the table is the output
    try:
        return _run_demo_command(args)
    finally:
        logger.setLevel(level)


def _run_demo_command(args: argparse.Namespace) -> int:
    if args.turns < 1:
        print("unbroken demo: --turns must be at least 1", file=sys.stderr)
        return 2
    if args.after_commit == "continue" and args.protocol not in CONTINUE_PROTOCOLS:
        print(f"unbroken demo: {NO_GEMINI_CONTINUE}", file=sys.stderr)
        return 2
    speaks = PROTOCOLS[args.protocol]
    missing = speaks.missing()
    if missing is not None:
        print(f"unbroken demo: {missing}", file=sys.stderr)
        return 2
    from rich.console import Console
    from rich.live import Live

    console = Console()
    live_view = console.is_terminal and not args.json
    kinds = storms(protocol=args.protocol)
    if not args.json:
        console.print(
            f"[bold]unbroken demo[/bold]: {args.turns} concurrent agent turns{speaks.over} "
            "(a streamed tool call, then the answer), each under its own storm: "
            + ", ".join(s.name for s in kinds)
            + ". No network, no keys: a local mock provider plays the LLM.\n"
        )
    live: Live | None = None
    current: list[str] = []

    def on_tick(run: DemoRun) -> None:
        nonlocal live
        if live is None or not current or current[-1] != run.name:
            if live is not None:
                live.stop()
            current.append(run.name)
            live = Live(render_run(run, console.width), console=console, auto_refresh=False)
            live.start()
        live.update(render_run(run, console.width), refresh=True)

    try:
        summary = asyncio.run(
            run_demo(
                turns=args.turns,
                direct=not args.no_direct,
                journal=args.journal,
                on_tick=on_tick if live_view else None,
                protocol=args.protocol,
                after_commit=args.after_commit,
            )
        )
    finally:
        if live is not None:
            live.stop()
    if args.json:
        print(json.dumps(summary))
    else:
        console.print()
        console.print(
            format_summary(summary, min(console.width, 80)), highlight=False, soft_wrap=True
        )
    ok = summary["completed"] == summary["turns"] and summary["duplicates"] == 0
    return 0 if ok else 1


def register(sub: Any) -> None:
    p = sub.add_parser(
        "demo", help="watch the relay absorb a scripted storm (no network, no keys, < 60 s)"
    )
    p.add_argument(
        "--turns", type=int, default=12, help="concurrent agent turns (default: %(default)s)"
    )
    p.add_argument("--json", action="store_true", help="print the summary as one JSON object")
    p.add_argument(
        "--protocol",
        choices=DEMO_PROTOCOLS,
        default="chat",
        help="the agent's wire protocol: chat (the openai SDK, Chat Completions; "
        "pip install 'unbroken[demo]'), gemini (the Gemini API's streamGenerateContent) "
        "or anthropic (Messages), both with no SDK (default: %(default)s)",
    )
    p.add_argument(
        "--after-commit",
        choices=AFTER_COMMIT,
        default="error",
        help="the relay's [stream] after_commit: continue finishes a drop after output in "
        "place, with no error (Messages by prefill, Chat by a prefix mode; the Gemini "
        "API has no continuation) "
        "(default: %(default)s)",
    )
    p.add_argument(
        "--no-direct", action="store_true", help="skip the run straight against the mock"
    )
    p.add_argument(
        "--journal",
        metavar="FILE",
        help="also write the relay's journal to this SQLite file, for `unbroken "
        "stats --journal FILE` (default: none)",
    )
    p.set_defaults(func=_demo)
