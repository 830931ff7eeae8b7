"""What the benchmark reports share: the machine they ran on, number formatting and the
Markdown reflow."""

from __future__ import annotations

import contextlib
import datetime
import os
import platform
import subprocess
import textwrap
from pathlib import Path
from typing import Any

from harness import ROOT


def machine_info(pinning: str) -> dict[str, Any]:
    import aiohttp

    model = ""
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    commit = ""
    with contextlib.suppress(Exception):
        commit = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=10,
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--", "src"],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=10,
        ).stdout.strip()
        if dirty:
            commit += " (src/ has uncommitted changes)"
    from unbroken import __version__

    return {
        "nproc": os.cpu_count(),
        "cpu_model": model,
        "kernel": platform.release(),
        "python": platform.python_version(),
        "aiohttp": aiohttp.__version__,
        "unbroken": __version__,
        "commit": commit,
        "pinning": pinning,
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "loadavg_start": os.getloadavg(),
    }


def fnum(x: float | None, nd: int = 2) -> str:
    if x is None or x != x:
        return "n/a"
    return f"{x:,.{nd}f}"


def ratio(a: float | None, b: float | None) -> str:
    if not a or not b or a != a or b != b:
        return "n/a"
    return f"{a / b:.2f}×"


def reflow(md: str, width: int = 92) -> str:
    """Re-wrap prose paragraphs and bullets; leave headings, tables and code blocks alone."""
    out: list[str] = []
    para: list[str] = []
    bullet = False
    fence = False

    def flush() -> None:
        nonlocal para, bullet
        if para:
            text = " ".join(x.strip() for x in para)
            out.append(
                textwrap.fill(
                    text,
                    width,
                    subsequent_indent="  " if bullet else "",
                    break_long_words=False,
                    break_on_hyphens=False,
                )
            )
        para, bullet = [], False

    for line in md.split("\n"):
        if line.startswith("```"):
            flush()
            fence = not fence
            out.append(line)
        elif fence or not line.strip() or line.startswith(("|", "#")):
            flush()
            out.append(line)
        elif line.startswith("* "):
            flush()
            para, bullet = [line], True
        else:
            para.append(line)
    flush()
    return "\n".join(out)
