"""What every command line shares: one-line usage errors and the log format.

It sits below every feature (``cli``, ``mock.cli``, the launchers), so that none
of them imports ``unbroken.cli`` back: ``cli`` dispatches to the features, and
they take their parser and logging from here.
"""

from __future__ import annotations

import argparse
import logging
import sys
from typing import NoReturn

__all__ = ["OneLineParser", "one_line", "setup_logging"]


class OneLineParser(argparse.ArgumentParser):
    """An ArgumentParser whose usage errors are one line (and exit code 2)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {one_line(message)} (see {self.prog} --help)\n")


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
