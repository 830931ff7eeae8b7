#!/usr/bin/env python3
"""Check that every lower bound in pyproject.toml is real.

Creates a fresh virtual environment, installs unbroken with each runtime
dependency (and the ``demo`` extra's) pinned to its lower bound (``aiohttp>=3.10`` ->
``aiohttp==3.10``) and everything else resolved as pip resolves it for a new user today (the
newest versions allowed: that is how ``openai==1.40`` met httpx 0.28), then
runs ``unbroken demo --json``, imports every module, prints every ``--help``,
draws the status view and runs a short demo in text mode.  With ``--tests`` it
also installs the ``test`` extra at its lower bounds and runs the suite without
the end-to-end tests.

    python tools/min_deps.py                 # the runtime bounds (about a minute)
    python tools/min_deps.py --tests         # and the test extra's (a few minutes more)
    python tools/min_deps.py --try openai==1.55.3   # override one pin, to bisect a bound

Exit status 0 when everything passed.  Needs the package index (pip) and the
Python you run it with (the oldest supported, 3.11, is the one that matters:
an old pin may have no wheel for a newer Python).  The demo is offline.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
_REQ = re.compile(r"^\s*([A-Za-z0-9][A-Za-z0-9._-]*)\s*(\[[^\]]*\])?\s*(.*)$")


def lowest(requirement: str) -> str:
    """``name>=1.2,<2`` -> ``name==1.2``; an exact pin stays; no lower bound: unchanged."""
    m = _REQ.match(requirement)
    if m is None:
        raise ValueError(f"cannot read the requirement {requirement!r}")
    name, extras, spec = m.group(1), m.group(2) or "", m.group(3).split(";")[0]
    for clause in spec.split(","):
        clause = clause.strip()
        if clause.startswith((">=", "==")):
            return f"{name}{extras}=={clause[2:].strip()}"
    return requirement


#: the extras whose commands the runtime checks run (the ``demo`` extra's openai SDK:
#: ``unbroken demo --json``)
RUNTIME_EXTRAS = ("demo",)


def pins(extra: str | None = None) -> list[str]:
    """The lower bounds as exact pins, with `RUNTIME_EXTRAS`' too; the extra's own pin of
    a package wins (the test extra pins the SDK versions its tests were written against)."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    reqs = list(project["dependencies"])
    for name in (*RUNTIME_EXTRAS, *([extra] if extra is not None else [])):
        reqs += project["optional-dependencies"][name]
    out: dict[str, str] = {}
    for r in reqs:
        out[_name(r)] = lowest(r)
    return list(out.values())


def _name(requirement: str) -> str:
    m = _REQ.match(requirement)
    assert m is not None
    return m.group(1).lower().replace("_", "-")


def run(argv: list[str], **kw: object) -> subprocess.CompletedProcess[str]:
    shown = [a if "\n" not in a else "'<script>'" for a in argv]
    print("$", " ".join(shown), flush=True)
    return subprocess.run(argv, text=True, check=False, **kw)  # type: ignore[call-overload,no-any-return]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--tests",
        action="store_true",
        help="also install the test extra at its lower bounds and run "
        "pytest -m 'not e2e' (default: runtime dependencies only)",
    )
    parser.add_argument(
        "--try",
        dest="overrides",
        action="append",
        default=[],
        metavar="REQ",
        help="use this requirement instead of the lower bound "
        "of the same package (repeatable; default: none)",
    )
    parser.add_argument(
        "--venv",
        metavar="DIR",
        help="the virtual environment to create (default: a temporary one, removed afterwards)",
    )
    args = parser.parse_args(argv)

    requirements = pins("test" if args.tests else None)
    for override in args.overrides:
        requirements = [r for r in requirements if _name(r) != _name(override)] + [override]
    with tempfile.TemporaryDirectory(prefix="unbroken-min-deps-") as scratch:
        venv = Path(args.venv) if args.venv else Path(scratch) / "venv"
        if run([sys.executable, "-m", "venv", "--clear", str(venv)]).returncode:
            return 1
        py = str(venv / "bin" / "python")
        env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH")}
        env["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"
        done = run([py, "-m", "pip", "install", "--quiet", str(ROOT), *requirements], env=env)
        if done.returncode:
            print("min-deps: the lower bounds cannot be installed together", file=sys.stderr)
            return 1
        freeze = run(
            [py, "-m", "pip", "freeze", "--exclude", "unbroken"], env=env, capture_output=True
        )
        print("installed:", ", ".join(freeze.stdout.split()), flush=True)
        ok = True
        demo = run(
            [py, "-m", "unbroken", "demo", "--json"],
            env=env,
            capture_output=True,
            cwd=scratch,
            timeout=300,
        )
        try:
            summary = json.loads(demo.stdout)
        except ValueError:
            summary = None
        if demo.returncode or not summary:
            ok = False
            print(
                f"min-deps: `unbroken demo --json` failed (exit {demo.returncode}):\n"
                f"{demo.stderr[-4000:]}",
                file=sys.stderr,
            )
        else:
            print(
                f"demo: {summary['completed']} of {summary['turns']} turns completed, "
                f"{summary['duplicates']} duplicated frames",
                flush=True,
            )
        imports = run([py, "-c", _IMPORT_ALL], env=env, capture_output=True, cwd=scratch)
        if imports.returncode:
            ok = False
            print(
                f"min-deps: importing every module failed:\n{imports.stderr[-4000:]}",
                file=sys.stderr,
            )
        if args.tests:
            # The tests import from the source tree; the installed copy is the same code.
            suite = run(
                [py, "-m", "pytest", "-p", "no:cacheprovider", "-m", "not e2e", "-q", "-x"],
                env=env,
                cwd=ROOT,
            )
            ok = ok and suite.returncode == 0
    print("min-deps: OK, every lower bound works" if ok else "min-deps: FAILED", flush=True)
    return 0 if ok else 1


_IMPORT_ALL = """
import importlib, pkgutil, unbroken
for mod in pkgutil.walk_packages(unbroken.__path__, "unbroken."):
    if not mod.name.endswith("__main__"):
        importlib.import_module(mod.name)
from unbroken.cli import main
for cmd in ("serve", "run", "resume", "status", "stats", "demo", "opencode", "mock"):
    try:
        main([cmd, "--help"])
    except SystemExit:
        pass
import io, time
from rich.console import Console
from unbroken.observe.status import render
snapshot = {"now": time.time(), "uptime_s": 1.0, "totals": {"failures_by_reason": {"503": 1}},
            "inflight": [{"id": 1, "route": "r", "state": "waiting", "attempts": 2,
                          "upstream": "http://127.0.0.1:9", "last_failure": "503",
                          "next_retry_in_s": 0.2, "age_s": 1.0, "held_bytes": 0}],
            "upstreams": [{"route": "r", "upstream": "http://127.0.0.1:9", "up": True, "ok": 1,
                           "failed": 1, "recent_failures": [{"reason": "503", "at": 0.0}]}]}
Console(file=io.StringIO(), width=80).print(render(snapshot, "http://127.0.0.1:4780"))
assert main(["demo", "--turns", "2", "--no-direct"]) == 0  # the text summary, rich output
"""


if __name__ == "__main__":
    sys.exit(main())
