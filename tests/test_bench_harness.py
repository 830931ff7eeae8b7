"""The benchmarks' harness gives every child started under callgrind the same time to start.

A clean-clone CI run failed ``test_bench_smoke.py::test_instr_cost_quick``: the bare
proxy, started under callgrind beside the suite's other benchmarks, had not printed its
ready line after the default 30 s (here it took 39 s with 12 busy processes on two
cores, 4.4 s on a quiet machine).  unbroken's start under the same launcher already
had 120 s.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

import http_bench as hb  # what instr_cost uses: the harness, as http_bench re-exports it
import instr_cost


class RecordingFleet(hb.Fleet):
    """Records what each start asks for; starts nothing."""

    def __init__(self, workdir: Path) -> None:
        super().__init__(workdir, "none")
        self.asked: dict[str, dict[str, Any]] = {}

    def start(self, name: str, argv: Any, **kw: Any) -> Any:
        self.asked[name] = {"argv": list(argv), **kw}
        return hb.Proc.__new__(hb.Proc)


def test_both_systems_under_callgrind_get_the_launched_start_time(tmp_path: Path) -> None:
    fleet = RecordingFleet(tmp_path)
    instr_cost._start(fleet, "http://127.0.0.1:9", "bare", None, "")
    instr_cost._start(fleet, "http://127.0.0.1:9", "new", hb.ROOT, "")
    assert set(fleet.asked) == {"bare", "unbroken-new"}
    for name, asked in fleet.asked.items():
        assert asked["argv"][0] == "valgrind", name
        assert asked["ready_timeout_s"] == hb.LAUNCHED_READY_S, name
    assert hb.LAUNCHED_READY_S >= 120.0
