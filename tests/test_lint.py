"""The code base stays ruff-clean, and src and the typed tests pass mypy --strict."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", *args], cwd=ROOT, capture_output=True, text=True, timeout=300
    )


def test_ruff_clean() -> None:
    paths = [p for p in ("src", "tests", "bench", "tools") if (ROOT / p).is_dir()]
    result = _run("ruff", "check", *paths)
    assert result.returncode == 0, result.stdout + result.stderr


def test_ruff_format_clean() -> None:
    paths = [p for p in ("src", "tests", "bench", "tools") if (ROOT / p).is_dir()]
    result = _run("ruff", "format", "--check", *paths)
    assert result.returncode == 0, result.stdout + result.stderr


def test_mypy_strict_on_src_and_the_typed_tests() -> None:
    result = _run("mypy")  # files (src, typed test directories), strictness: pyproject.toml
    assert result.returncode == 0, result.stdout + result.stderr
