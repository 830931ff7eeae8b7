"""The session rule: a skipped test fails the run (tests/noskip.py); deselecting does not."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent
SAMPLE = """
import pytest

def test_runs():
    pass

@pytest.mark.slow
def test_skips():
    pytest.skip("the frobnicator is not installed")

@pytest.mark.xfail(reason="known")
def test_xfails():
    assert False
"""


def _pytest(tmp_path: Path, *args: str, allow: bool = False) -> tuple[int, str]:
    (tmp_path / "test_sample.py").write_text(SAMPLE)
    # its own rootdir and ini: a pyproject.toml in an ancestor of the temp dir (another
    # tool's leftover in /tmp) would otherwise become the rootdir and change the node ids
    (tmp_path / "pytest.ini").write_text("[pytest]\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("UNBROKEN_", "PYTEST_"))}
    env["PYTHONPATH"] = os.pathsep.join([str(TESTS), env.get("PYTHONPATH", "")])
    if allow:
        env["UNBROKEN_ALLOW_SKIPS"] = "1"
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-p",
            "noskip",
            "-p",
            "no:cacheprovider",
            "-o",
            "markers=slow",
            *args,
            "test_sample.py",
        ],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    return done.returncode, done.stdout + done.stderr


@pytest.mark.parametrize(
    ("args", "allow", "code", "says"),
    [
        ((), False, 1, "No test may be skipped"),
        ((), True, 0, "allowed by UNBROKEN_ALLOW_SKIPS"),
        (("-m", "not slow"), False, 0, "1 deselected"),
        (("-n", "2"), False, 1, "No test may be skipped"),  # on xdist workers, as `pytest` runs
    ],
)
def test_a_skip_fails_the_session_unless_deselected_or_allowed(
    tmp_path: Path, args: tuple[str, ...], allow: bool, code: int, says: str
) -> None:
    got, out = _pytest(tmp_path, *args, allow=allow)
    assert got == code, out
    assert says in out, out
    if not args:
        assert "SKIPPED test_sample.py::test_skips: the frobnicator is not installed" in out
