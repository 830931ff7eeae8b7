"""The benchmarks keep working: each one runs in ``--quick`` mode (small counts; the numbers
mean nothing here, only that every phase runs to its report).

The eight run at the same time, as separate processes started once for this module, so
the suite waits for the slowest one, not for their sum.  ``bench/compare.py`` leaves
LiteLLM out only because ``--no-litellm`` says so (installing it takes minutes), and the
test checks that its report says so.  The long tier (``-m 'not slow'`` deselects it),
on one worker (the module's fixture starts them: tests/conftest.py).
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "bench"
TIMEOUT_S = 200  # the budget of the slowest benchmark, on a loaded 2-CPU VM

pytestmark = [pytest.mark.slow, pytest.mark.timeout(TIMEOUT_S + 30)]


class Run:
    def __init__(
        self, name: str, argv: list[str], tmp: Path, env: dict[str, str] | None = None
    ) -> None:
        self.name = name
        self.log = tmp / f"{name}.log"
        with open(self.log, "wb") as out:
            self.proc = subprocess.Popen(
                [sys.executable, *argv],
                cwd=ROOT,
                stdout=out,
                stderr=subprocess.STDOUT,
                env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})},
            )

    def result(self) -> str:
        """Wait for the benchmark; fail with the end of its output unless it exits 0."""
        try:
            rc = self.proc.wait(TIMEOUT_S)
        except subprocess.TimeoutExpired:
            self.stop()
            pytest.fail(
                f"{self.name} --quick still running after {TIMEOUT_S} s:\n"
                f"{self.log.read_text(errors='replace')[-3000:]}"
            )
        out = self.log.read_text(errors="replace")
        assert rc == 0, f"{self.name} --quick exited {rc}:\n{out[-3000:]}"
        return out

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)  # each benchmark stops its own children
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[dict[str, Run], Path]]:
    tmp = tmp_path_factory.mktemp("bench")
    argvs = {
        "http_bench": [str(BENCH / "http_bench.py"), "--quick", "--json", str(tmp / "http.json")],
        "ws_bench": [str(BENCH / "ws_bench.py"), "--quick"],
        "instr_cost": [str(BENCH / "instr_cost.py"), "--quick"],
        "turn_cost": [
            str(BENCH / "turn_cost.py"),
            "--quick",
            "--also",
            f"again={ROOT}",
            "--profile",
            str(tmp / "turns.prof"),
            "--top",
            "5",
        ],
        "compare": [
            str(BENCH / "compare.py"),
            "--quick",
            "--no-litellm",
            "--out",
            str(tmp / "benchmarks.md"),
            "--img",
            str(tmp / "img"),
            "--json",
            str(tmp / "compare.json"),
        ],
        "ratelimit_bench": [
            str(BENCH / "ratelimit_bench.py"),
            "--quick",
            "--no-litellm",
            "--out",
            str(tmp / "ratelimit.md"),
            "--img",
            str(tmp / "rlimg"),
        ],
        "recovery_bench": [
            str(BENCH / "recovery_bench.py"),
            "--quick",
            "--out",
            str(tmp / "recovery.md"),
            "--img",
            str(tmp / "rimg"),
            "--json",
            str(tmp / "recovery.json"),
        ],
        # the zero-config storm benchmark's `unbroken serve` 30 x 503 row (about 9 s)
        "agent_storm_bench": [
            str(BENCH / "agent_storm_bench.py"),
            "--quick",
            "--out",
            str(tmp / "storm.md"),
        ],
    }
    # turn_cost's relays also run under bench/ttfc_trace (the c=1 step timestamps)
    path = os.pathsep.join(filter(None, (str(BENCH / "ttfc_trace"), os.environ.get("PYTHONPATH"))))
    trace = {"PYTHONPATH": path, "TTFC_TRACE_DIR": str(tmp)}
    started = {
        name: Run(name, argv, tmp, trace if name == "turn_cost" else None)
        for name, argv in argvs.items()
    }
    try:
        yield started, tmp
    finally:
        for r in started.values():
            r.stop()


def test_http_bench_quick(runs: tuple[dict[str, Run], Path]) -> None:
    procs, tmp = runs
    out = procs["http_bench"].result()
    assert "unbroken HTTP benchmark (QUICK" in out
    res = json.loads((tmp / "http.json").read_text())
    for path in ("direct", "bare", "unbroken"):
        assert res["throughput"][path]["rps"] > 0, path
        assert res["throughput_ns"][path]["rps"] > 0, path  # the non-streamed window
        assert res["ttfc"][path]["samples"] > 0, path
    assert "non-streamed req/s per core" in out  # a target row of its own


def test_ws_bench_quick(runs: tuple[dict[str, Run], Path]) -> None:
    procs, _ = runs
    out = procs["ws_bench"].result()
    assert "## WebSocket" in out
    for row in ("| direct |", "| bare aiohttp WS relay |", "| unbroken |"):
        assert row in out, row


def test_instr_cost_quick(runs: tuple[dict[str, Run], Path]) -> None:
    procs, _ = runs
    out = procs["instr_cost"].result()
    assert "instructions (callgrind)" in out
    rows = {
        m[1]: m
        for m in re.finditer(
            r"^  (bare|unbroken) +([\d,.]+) +([\d.]+)x +([\d,.]+) +([\d.]+)x", out, re.M
        )
    }
    assert set(rows) == {"bare", "unbroken"}, out
    for name, m in rows.items():
        per_turn, per_frame = float(m[2].replace(",", "")), float(m[4].replace(",", ""))
        assert per_turn > 100 and per_frame > 1, (name, m[0])  # thousands of instructions
    assert rows["bare"][3] == "1.000" and rows["bare"][5] == "1.000"


def test_turn_cost_quick(runs: tuple[dict[str, Run], Path]) -> None:
    procs, tmp = runs
    out = procs["turn_cost"].result()
    for name in ("unbroken", "again"):  # the tree under test, and a tree named by --also
        assert f"  {name} " in out and "x bare" in out, name
    assert "added TTFC p50 over direct" in out
    assert "cProfile of unbroken serve" in out and (tmp / "turns.prof").stat().st_size > 0
    traces = [p.read_text() for p in tmp.glob("ttfc_trace_*.txt")]
    assert traces, "bench/ttfc_trace wrote nothing"
    steps = ("bytes_in", "turn_built", "client.request", "upstream_answered", "prepare", "written")
    assert any(
        "first request byte -> first delta written" in t and all(s in t for s in steps)
        for t in traces
    ), traces


def test_ratelimit_bench_quick(runs: tuple[dict[str, Run], Path]) -> None:
    procs, tmp = runs
    procs["ratelimit_bench"].result()
    report = (tmp / "ratelimit.md").read_text()
    assert "## Rate limits: many agents on one key" in report
    for row in ("| direct |", "| unbroken |", "| unbroken x2 |"):
        assert row in report, row
    assert (tmp / "rlimg" / "ratelimit.png").stat().st_size > 0


def test_compare_quick(runs: tuple[dict[str, Run], Path]) -> None:
    procs, tmp = runs
    out = procs["compare"].result()
    assert "LiteLLM: left out (--no-litellm)" in out
    res = json.loads((tmp / "compare.json").read_text())
    assert res["litellm"] is False
    agg = res["agg"]
    for path in ("bare", "unbroken"):
        assert agg["rps_stream"][path]["per_core"] > 0, path
        assert agg["rps_plain"][path]["per_core"] > 0, path
        assert agg["cpu"][path]["us_per_frame"] > 0, path
        assert agg["memory"][path]["idle_mib"] > 0, path
    cells = res["matrix"]["cells"]
    assert len(cells) == 10
    outcomes = {"complete", "spliced", "truncated, shown as success", "error"}
    for case, row in cells.items():
        assert set(row) == {"direct", "bare", "unbroken"}, case
        assert {c["outcome"] for c in row.values()} <= outcomes, case
    md = (tmp / "benchmarks.md").read_text()
    assert "python bench/compare.py --quick --no-litellm" in md
    assert "**LiteLLM left out** (`--no-litellm`)" in " ".join(md.split())  # prose is wrapped
    assert "## Fault matrix" in md
    for png in ("ttfc.png", "rps_per_core.png", "memory.png", "fault_matrix.png"):
        assert (tmp / "img" / png).stat().st_size > 1000, png
        assert f"img/{png}" in md, png


def test_recovery_bench_quick(runs: tuple[dict[str, Run], Path]) -> None:
    procs, tmp = runs
    procs["recovery_bench"].result()
    md = (tmp / "recovery.md").read_text()
    assert "python bench/recovery_bench.py --quick" in md  # the command comes first
    for heading in (
        "## Systems",
        "## Targets",
        "## Outage by time",
        "## Outage by count",
        "## Busy and partly failing",
    ):
        assert heading in md, heading
    for header in (
        "| target | measured | verdict |",
        "| outage | turns | system | completed | recovery p50 s |",
        "| 503s | turns | system | outage lasted s |",
        "| system | turns | completed | latency p50 s |",
    ):
        assert header in md, header
    # every target has a verdict; LiteLLM is left out of --quick, and the report says so
    assert md.count("**met**") + md.count("**missed**") + md.count("not measured") >= 8
    assert "| litellm | **not run**: left out (--quick without --litellm) |" in md
    res = json.loads((tmp / "recovery.json").read_text())
    ran = [r for r in res["results"] if "not_run" not in r]
    kinds = {(r["system"], r["scenario"], r["turns"] > 1) for r in ran}
    for system in ("defaults", "fixed"):
        for kind in (
            ("time", False),
            ("time", True),
            ("count", False),
            ("count", True),
            ("busy", True),
        ):
            assert (system, *kind) in kinds, (system, kind)
    # two relays sharing a real redis-server (found as tests/redisfix.py finds it)
    redis = [r for r in res["results"] if r["system"] == "redis"]
    assert redis and all("not_run" not in r for r in redis), [r.get("not_run") for r in redis]
    for r in ran:  # the measurements exist (their values are not judged here)
        assert r["turns"] > 0 and 0 <= r["completed"] <= r["turns"], r["system"]
        assert ("waits" if r["scenario"] == "busy" else "recovery") in r, r["system"]
    for png in (
        "recovery_latency.png",
        "outage_requests.png",
        "count_turn_time.png",
        "busy_retry_waits.png",
    ):
        assert (tmp / "rimg" / png).stat().st_size > 1000, png
        assert f"rimg/{png}" in md, png


def test_agent_storm_bench_quick(runs: tuple[dict[str, Run], Path]) -> None:
    procs, tmp = runs
    procs["agent_storm_bench"].result()
    md = (tmp / "storm.md").read_text()
    assert md.startswith("# Zero-config storm benchmark")
    assert f"Reproduce: `python bench/agent_storm_bench.py --quick --out {tmp / 'storm.md'}`" in md
    [row] = [line for line in md.splitlines() if line.startswith("| 503 x 30 |")]
    assert "`unbroken serve` + streamed HTTP client" in row and row.endswith("| 1/1 |"), row
