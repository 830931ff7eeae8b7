"""The sans-IO core imports no I/O library: aiohttp, asyncio and ssl stay in relay/."""

from __future__ import annotations

import ast
from pathlib import Path

import unbroken.core

FORBIDDEN = {"aiohttp", "asyncio", "ssl", "socket", "yarl", "multidict"}
CORE = Path(unbroken.core.__file__).resolve().parent


def _imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module.split(".")[0])
            if node.module.startswith("unbroken.") and not node.module.startswith("unbroken.core"):
                names.add(node.module)
    return names


def test_core_imports_no_io_library_and_nothing_outside_core() -> None:
    files = sorted(CORE.rglob("*.py"))
    assert len(files) >= 10
    bad = {
        str(f.relative_to(CORE)): sorted(
            n for n in _imports(f) if n in FORBIDDEN or n.startswith("unbroken.")
        )
        for f in files
    }
    assert {k: v for k, v in bad.items() if v} == {}


def test_the_walk_sees_a_forbidden_import(tmp_path: Path) -> None:
    sample = tmp_path / "m.py"
    sample.write_text("import asyncio\nfrom aiohttp import web\nfrom unbroken.relay import x\n")
    assert {"asyncio", "aiohttp", "unbroken.relay"} <= _imports(sample)
