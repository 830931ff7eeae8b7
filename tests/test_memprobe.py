"""``bench/memprobe``: a forked child (a worker) writes its memory record (issue 25)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

# The child waits for its own record (a deadline, no fixed sleep), then exits; the
# parent (the supervisor) never starts a probe of its own.
CHILD = """
import os, sys, time
out = sys.argv[1]
pid = os.fork()
if pid == 0:
    path = os.path.join(out, f"{os.getpid()}.jsonl")
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        if os.path.exists(path) and open(path).read().endswith("\\n"):
            os._exit(0)
        time.sleep(0.05)  # the poll's pace
    os._exit(1)
_, status = os.waitpid(pid, 0)
print(os.waitstatus_to_exitcode(status), pid)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallinfo2")
def test_a_forked_worker_records_its_heap_and_the_trim(tmp_path: Path) -> None:
    env = {
        **os.environ,
        "PYTHONPATH": str(ROOT / "bench" / "memprobe"),
        "MEMPROBE_DIR": str(tmp_path),
        "MEMPROBE_PERIOD": "0.2",
        "MEMPROBE_TRIM": "1",
    }
    out = subprocess.run(
        [sys.executable, "-c", CHILD, str(tmp_path)],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    code, child = out.stdout.split()
    assert code == "0", out.stderr
    files = sorted(p.name for p in tmp_path.iterdir())
    assert files == [f"{child}.jsonl"]  # the child's only: the parent has no probe
    rec = json.loads((tmp_path / files[0]).read_text().splitlines()[0])
    assert rec["rss"] > 0 and rec["blocks"] > 0 and rec["objs"] > 0
    assert rec["used_mib"] > 0 and rec["arena_mib"] >= rec["used_mib"]
    assert rec["trim"] is True and rec["rss_after_trim"] > 0  # the first worker trims
    assert rec["queue"] is None  # no Redis store in this process
