#!/usr/bin/env python3
"""Try the newest dependencies before they reach a clean clone.

``constraints.txt`` pins the test environment, so the README's test command
resolves the same versions on every machine and a new release of mypy, ruff,
redis or aiohttp cannot turn a clean clone red overnight.  This is the check to
run now and then (by hand, or from a scheduled job) to move the pins on:

1. create a fresh virtual environment and install ``.[test]`` *without* the
   constraints, so pip takes the newest versions pyproject.toml's ranges allow;
2. say which packages moved against ``constraints.txt`` (new, gone, changed);
3. run the checks that newer dependencies break first: ``ruff check``,
   ``ruff format --check``, ``mypy`` and ``lint-imports`` (``--tests`` runs
   ``pytest -m 'not e2e'`` too);
4. with ``--write`` and every check green, rewrite ``constraints.txt`` from
   what was installed (its comment header kept).

    python tools/newest_deps.py               # what moved, and do the checks pass
    python tools/newest_deps.py --tests       # and the suite without the e2e tests
    python tools/newest_deps.py --write       # move the pins when all of it passed

Exit status 0 when every check passed; 1 when one failed (its output is shown).
Needs the package index.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CONSTRAINTS = ROOT / "constraints.txt"
_PIN = re.compile(r"^\s*([A-Za-z0-9][A-Za-z0-9._-]*)\s*==\s*([^\s;#]+)")

CHECKS: tuple[tuple[str, ...], ...] = (
    ("ruff", "check", "src", "tests", "bench", "tools"),
    ("ruff", "format", "--check", "src", "tests", "bench", "tools"),
    ("mypy",),
    ("lint-imports",),
)


def canonical(name: str) -> str:
    """PEP 503's normal form: ``Typing_Extensions`` and ``typing-extensions`` are one."""
    return re.sub(r"[-_.]+", "-", name).lower()


def read_pins(text: str) -> dict[str, str]:
    """``name==version`` lines (comments, blanks and editable installs left out)."""
    pins: dict[str, str] = {}
    for line in text.splitlines():
        m = _PIN.match(line)
        if m is not None:
            pins[canonical(m.group(1))] = m.group(2)
    return pins


def header(text: str) -> str:
    """The leading comment block of a constraints file, kept when it is rewritten."""
    lines: list[str] = []
    for line in text.splitlines():
        if not line.startswith("#"):
            break
        lines.append(line)
    return "\n".join(lines) + ("\n" if lines else "")


def moved(old: dict[str, str], new: dict[str, str]) -> list[str]:
    """One line per package that is new, gone or at another version, sorted by name."""
    out: list[str] = []
    for name in sorted(old.keys() | new.keys()):
        before, after = old.get(name), new.get(name)
        if before == after:
            continue
        if before is None:
            out.append(f"+ {name}=={after}")
        elif after is None:
            out.append(f"- {name}=={before}")
        else:
            out.append(f"~ {name} {before} -> {after}")
    return out


def _run(cmd: list[str], *, cwd: Path = ROOT) -> tuple[int, str]:
    done = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, check=False)
    return done.returncode, done.stdout + done.stderr


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    ap.add_argument("--tests", action="store_true", help="also run pytest -m 'not e2e'")
    ap.add_argument("--write", action="store_true", help="rewrite constraints.txt if all passed")
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="unbroken-newest-") as tmp:
        venv = Path(tmp) / "venv"
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        py, binx = str(venv / "bin" / "python"), venv / "bin"
        rc, out = _run([py, "-m", "pip", "install", "--quiet", "-e", ".[test]"])
        if rc != 0:
            print(f"newest_deps: pip could not install .[test]:\n{out}", file=sys.stderr)
            return 1
        rc, frozen = _run([py, "-m", "pip", "freeze", "--exclude-editable"])
        current = CONSTRAINTS.read_text()
        changes = moved(read_pins(current), read_pins(frozen))
        print("\n".join(changes) if changes else "nothing moved against constraints.txt")
        checks = [[str(binx / c[0]), *c[1:]] for c in CHECKS]
        if args.tests:
            checks.append([py, "-m", "pytest", "-q", "-m", "not e2e", "-p", "no:cacheprovider"])
        failed = 0
        for cmd in checks:
            rc, out = _run(cmd)
            name = " ".join([Path(cmd[0]).name, *cmd[1:]])
            print(f"{'ok  ' if rc == 0 else 'FAIL'} {name}")
            if rc != 0:
                failed += 1
                print(out[-4000:])
        if failed:
            return 1
        if args.write and changes:
            pinned = [ln for ln in frozen.splitlines() if _PIN.match(ln)]
            CONSTRAINTS.write_text(header(current) + "\n".join(pinned) + "\n")
            print(f"wrote {CONSTRAINTS.name}: {len(pinned)} pins")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
