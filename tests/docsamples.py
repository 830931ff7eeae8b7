"""Reading the samples out of README.md and docs/*.md, for the tests that keep them true.

Each test that owns a sample compares it with what the code prints today, by
structure (section names, keys, labels, cause names) where numbers vary from run
to run, and exactly where the output is deterministic.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
DOCS = ROOT / "docs"
CONFIGURATION = DOCS / "configuration.md"
TROUBLESHOOTING = DOCS / "troubleshooting.md"


def doc_files() -> list[Path]:
    return [README, *sorted(DOCS.glob("*.md"))]


def section(path: Path, heading: str) -> str:
    """The text under a heading (any level) up to the next heading of that level or
    above; ``#`` lines inside code blocks are not headings."""
    lines = path.read_text().splitlines(keepends=True)
    fenced = False
    start = level = None
    for i, line in enumerate(lines):
        if line.startswith("```"):
            fenced = not fenced
            continue
        m = None if fenced else re.match(r"^(#+) (.*?)\s*$", line)
        if m is None:
            continue
        if start is None:
            if m.group(2) == heading:
                start, level = i + 1, len(m.group(1))
        elif level is not None and len(m.group(1)) <= level:
            return "".join(lines[start:i])
    assert start is not None, f"{path.name}: no heading {heading!r}"
    return "".join(lines[start:])


def code_blocks(text: str, lang: str | None = None) -> list[str]:
    """The fenced code blocks of a markdown text (of one language, when given)."""
    out = []
    for m in re.finditer(r"^```([A-Za-z]*)\n(.*?)^```\s*$", text, re.M | re.S):
        if lang is None or m.group(1) == lang:
            out.append(m.group(2))
    return out


def block_after(path: Path, marker: str, lang: str | None = None) -> str:
    """The code block that holds ``marker``, or else the first one after it."""
    text = path.read_text()
    i = text.index(marker)
    for m in re.finditer(r"^```([A-Za-z]*)\n(.*?)^```\s*$", text, re.M | re.S):
        if m.end() > i and (lang is None or m.group(1) == lang):
            return m.group(2)
    raise AssertionError(f"{path.name}: no code block at or after {marker!r}")


def numbers_out(line: str) -> str:
    """A line with its numbers, URLs and runs of spaces made uniform."""
    line = re.sub(r"https?://\S+", "URL", line)
    line = re.sub(r"\(journal [^)]*\)", "(journal PATH)", line)
    line = re.sub(r"\d+(\.\d+)?", "#", line)
    return re.sub(r"\s+", " ", line).strip()


def counted_names(text: str) -> set[str]:
    """``503 12, server_disconnected 8`` or ``503 ×12, stall ×2`` -> the names."""
    return {m.group(1) for m in re.finditer(r"([A-Za-z_0-9]+) ×?\d+(?:,|\)|$)", text)}


def lines_in_order(sample: list[str], real: list[str]) -> Iterator[tuple[str, str]]:
    """Pair every sample line with the next real line that has its shape; a ``...``
    sample line (and the start of the sample) skips any number of real lines."""
    i = 0
    skipping = True
    for line in sample:
        if line.strip() == "...":
            skipping = True
            continue
        while skipping and i < len(real) and numbers_out(real[i]) != numbers_out(line):
            i += 1
        assert i < len(real), f"sample line {line!r} has no counterpart in:\n" + "\n".join(real)
        yield line, real[i]
        i += 1
        skipping = False


#: OpenCode alone in a 503 storm, as the docs give it: "about 73 s of 503s", "(~70 s)", ...
STORM = re.compile(r"(?:about |~)(\d+) s(?: of 503s|\)| from the first| for a 503 storm)")
STORM_PLACES = [
    README,
    DOCS / "agents.md",
    DOCS / "opencode.md",
    ROOT / "tests" / "e2e" / "conftest.py",
]


def documented_storm_seconds() -> int:
    """How long OpenCode alone lasts in a 503 storm, as the docs say (the e2e test
    checks it against a fresh measurement when ``UNBROKEN_E2E_ALONE=1``)."""
    found = {int(m.group(1)) for p in STORM_PLACES for m in STORM.finditer(p.read_text())}
    assert len(found) == 1, f"the OpenCode-alone 503 storm time differs between places: {found}"
    return found.pop()
