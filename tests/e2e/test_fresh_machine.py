"""The README's test command on a fresh machine: the session installs the CLIs itself.

A pytest subprocess runs one real-CLI test with an empty CLI cache
(``UNBROKEN_TEST_CACHE`` pointed at a temporary directory): it must install the
pinned OpenCode with npm, say so, run the test, and skip nothing.  Marked
``run_last`` so it runs while the long OpenCode scenarios wait in the background.
"""

from __future__ import annotations

import os
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from e2e.clis import CACHE_ENV, PINNED

pytestmark = [pytest.mark.e2e, pytest.mark.run_last, pytest.mark.timeout(1500)]

REPO = Path(__file__).resolve().parents[2]
ONE_TEST = "tests/e2e/test_opencode_e2e.py::test_the_pinned_opencode_cli_runs"


def test_a_fresh_machine_installs_the_clis_and_skips_nothing(tmp_path: Path) -> None:
    cache = tmp_path / "empty-cache"
    report = tmp_path / "report.xml"
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("UNBROKEN_", "PYTEST_")) or k == "PYTEST_ADDOPTS"
    }
    env[CACHE_ENV] = str(cache)
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-p",
            "no:cacheprovider",
            f"--junitxml={report}",
            ONE_TEST,
        ],
        cwd=REPO,
        env=env,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=1400,
        check=False,
    )
    output = done.stdout + done.stderr
    assert done.returncode == 0, output
    cli = PINNED["opencode"]
    assert f"unbroken tests: installing {cli.spec} with npm into {cache}" in output, output
    home = cache / "npm" / cli.spec
    assert (home / ".installed").read_text().strip() == cli.spec
    assert (home / "node_modules" / ".bin" / cli.bin).exists()
    suite = ET.parse(report).getroot().find("testsuite")
    assert suite is not None, report.read_text()
    counts = {k: int(suite.get(k, "0")) for k in ("tests", "skipped", "failures", "errors")}
    assert counts == {"tests": 1, "skipped": 0, "failures": 0, "errors": 0}, output
