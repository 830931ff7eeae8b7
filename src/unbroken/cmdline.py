"""What every command line shares: one-line usage errors and the log format.

It sits below every feature (``cli``, ``mock.command``, the launchers), so that none
of them imports ``unbroken.cli`` back: ``cli`` dispatches to the features, and
they take their parser and logging from here.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence
from typing import Any, NoReturn

__all__ = ["OneLineParser", "one_line", "setup_logging"]


class OneLineParser(argparse.ArgumentParser):
    """An ArgumentParser whose usage errors are one line (and exit code 2).

    An option named with `accept_dashed_value` takes a value that starts with ``-``
    as the next argument (``--since -5h``), where argparse would take it for an
    option and say the value is missing.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.dashed_values: set[str] = set()

    def accept_dashed_value(self, option: str) -> None:
        self.dashed_values.add(option)

    def parse_known_args(  # type: ignore[override]
        self, args: Sequence[str] | None = None, namespace: Any = None
    ) -> tuple[argparse.Namespace, list[str]]:
        if args is not None and self.dashed_values:
            args = _join_dashed(list(args), self.dashed_values)
        return super().parse_known_args(args, namespace)

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {one_line(message)} (see {self.prog} --help)\n")


def _join_dashed(args: list[str], options: set[str]) -> list[str]:
    """``[opt, "-5h"]`` -> ``["opt=-5h"]`` for each of ``options`` (before ``--``)."""
    out: list[str] = []
    i = 0
    while i < len(args):
        arg = args[i]
        if arg == "--":
            out.extend(args[i:])
            break
        if arg in options and i + 1 < len(args) and args[i + 1].startswith("-"):
            out.append(f"{arg}={args[i + 1]}")
            i += 2
            continue
        out.append(arg)
        i += 1
    return out


def one_line(text: object) -> str:
    """``text`` with every run of whitespace (newlines included) made one space."""
    return " ".join(str(text).split())


def setup_logging() -> None:
    logging.basicConfig(
        level=logging.INFO,
        stream=sys.stderr,
        format="%(asctime)s %(name)s %(levelname)s %(message)s",
    )
    logging.getLogger("aiohttp.access").setLevel(logging.WARNING)
