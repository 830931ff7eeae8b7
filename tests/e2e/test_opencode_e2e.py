"""The real OpenCode CLI, with and without unbroken, against the fault-injecting mock.

Every test prints what it measured (provider turns, outcome, requests per second).
"""

from __future__ import annotations

import asyncio
import tempfile
from pathlib import Path

import pytest

from docsamples import documented_storm_seconds
from e2e.oc_harness import OPENCODE_VERSION, Sandbox, opencode, run_to_end
from e2e.oc_scenarios import (
    ALONE_ENV,
    ALONE_VERSION,
    DROP_ALONE_MIN_PER_SECOND,
    RESET_ALONE_REQUESTS,
    SEED_ALONE_TURNS,
    SEED_FAILURES,
    STORM_ALONE_EXIT,
    STORM_ALONE_REQUESTS,
    TEXT,
    Batch,
    CliRun,
    SessionRun,
)

pytestmark = [pytest.mark.e2e, pytest.mark.cli("opencode"), pytest.mark.timeout(420)]


def report(capsys: pytest.CaptureFixture[str], text: str) -> None:
    with capsys.disabled():
        print(f"\n    e2e: {text}", flush=True)


def _fails(run: CliRun) -> str:
    f = run.finished
    return (
        f"exit {f.code}, {run.requests} requests\n"
        f"stdout: {f.stdout[-1500:]}\nstderr: {f.stderr[-3000:]}"
    )


def test_the_recorded_alone_baselines_are_of_the_pinned_opencode() -> None:
    """OpenCode alone is recorded, not run each time (oc_scenarios): a new pin must be
    measured again, with the command there."""
    assert ALONE_VERSION == OPENCODE_VERSION, (
        f"the OpenCode-alone baselines are of {ALONE_VERSION}, the pin is {OPENCODE_VERSION}: "
        f"measure them again ({ALONE_ENV}=1 pytest -m e2e tests/e2e/test_opencode_e2e.py) "
        "and update them in tests/e2e/oc_scenarios.py"
    )


def test_the_pinned_opencode_cli_runs() -> None:
    """The installed CLI is the pinned one (the fresh-machine test runs this one alone)."""
    with tempfile.TemporaryDirectory(prefix="unbroken-e2e-version-") as root:
        finished = asyncio.run(run_to_end(opencode("--version"), Sandbox(Path(root)), limit_s=60))
    assert finished.code == 0, finished
    assert finished.stdout.strip() == OPENCODE_VERSION


@pytest.mark.scenario("storm")
def test_503_storm_kills_opencode_alone_but_not_through_unbroken(
    scenarios: Batch, capsys: pytest.CaptureFixture[str]
) -> None:
    runs = scenarios.result("storm", timeout=300)
    relayed = runs["with"]
    documented = documented_storm_seconds()
    alone = runs.get("without")  # measured again (UNBROKEN_E2E_ALONE=1), else recorded
    if alone is not None:
        died_after = alone.times[-1] if alone.times else 0.0
        said = f"exit {alone.finished.code} after {alone.requests} requests ({died_after:.0f} s"
        assert alone.finished.code == STORM_ALONE_EXIT, _fails(alone)
        assert alone.requests == STORM_ALONE_REQUESTS, _fails(alone)  # 1 try, 5 retries
        # The docs give this time (README, docs/agents.md, docs/opencode.md): still true.
        assert abs(died_after - documented) <= 12, (died_after, documented, alone.times)
    else:
        said = f"exit {STORM_ALONE_EXIT} after {STORM_ALONE_REQUESTS} requests (~{documented} s"
    report(
        capsys,
        f"503 storm: OpenCode alone: {said} from the first to the last); through `unbroken "
        f"run -- opencode run` (no config): exit {relayed.finished.code} in "
        f"{relayed.finished.elapsed:.1f} s, {relayed.requests} upstream requests, "
        f"{relayed.finished.stream_errors()} errors seen by OpenCode",
    )
    assert relayed.finished.code == 0, _fails(relayed)
    assert TEXT in relayed.finished.stdout
    assert relayed.finished.stream_errors() == 0, _fails(relayed)  # OpenCode saw no error
    assert relayed.requests == 31  # 30 503s absorbed by the relay, then the answer


@pytest.mark.scenario("reset_before_output")
def test_reset_before_output_completes_without_an_opencode_retry(
    scenarios: Batch, capsys: pytest.CaptureFixture[str]
) -> None:
    runs = scenarios.result("reset_before_output", timeout=300)
    relayed = runs["with"]
    alone = runs.get("without")  # measured again (UNBROKEN_E2E_ALONE=1), else recorded
    report(
        capsys,
        f"reset before output: OpenCode alone retried {RESET_ALONE_REQUESTS - 1} times"
        + (f" (backoff {alone.times[-1]:.1f} s)" if alone is not None else "")
        + f"; through unbroken: {relayed.requests} upstream requests in "
        f"{relayed.times[-1]:.1f} s, {relayed.finished.stream_errors()} OpenCode retries",
    )
    assert relayed.finished.code == 0, _fails(relayed)
    assert relayed.finished.stdout.strip().endswith(TEXT), _fails(relayed)
    assert relayed.finished.stream_errors() == 0, _fails(relayed)
    assert relayed.requests == 3
    if alone is not None:
        # The contrast: alone, OpenCode saw the failures and had to retry twice itself.
        # (Its "stream error" log line is not printed for every failure: count requests.)
        assert alone.requests == RESET_ALONE_REQUESTS, _fails(alone)
        assert alone.finished.stream_errors() >= 1, _fails(alone)


@pytest.mark.scenario("tool_reset")
def test_reset_mid_tool_arguments_runs_the_tool_exactly_once(
    scenarios: Batch, capsys: pytest.CaptureFixture[str]
) -> None:
    run = scenarios.result("tool_reset", timeout=300)["with"]
    lines = run.extra["marker_lines"]
    report(
        capsys,
        f"reset mid tool arguments: bash ran {len(lines)} time(s); {run.requests} upstream "
        f"requests; {run.finished.stream_errors()} errors seen by OpenCode",
    )
    assert run.finished.code == 0, _fails(run)
    assert lines == ["ran"], _fails(run)
    assert run.finished.stream_errors() == 0, _fails(run)
    assert run.requests == 3  # cut call, its replay, then the turn after the tool result


@pytest.mark.scenario("drop_after_output")
def test_drop_after_output_causes_no_hot_reprompt_loop(
    scenarios: Batch, capsys: pytest.CaptureFixture[str]
) -> None:
    runs = scenarios.result("drop_after_output", timeout=300)
    relayed = runs["with"]
    alone = runs.get("without")  # measured again (UNBROKEN_E2E_ALONE=1), else recorded
    alone_rate = alone.extra["per_second"] if alone is not None else DROP_ALONE_MIN_PER_SECOND
    report(
        capsys,
        "drop after output (clean end, no finish), 15 s window: OpenCode alone "
        + (
            f"{alone_rate:.1f} requests/s (peak {alone.extra['max_per_second']} in one second)"
            if alone is not None
            else f"at least {alone_rate} requests/s (recorded)"
        )
        + f"; through unbroken {relayed.extra['per_second']:.2f} requests/s (peak "
        f"{relayed.extra['max_per_second']})",
    )
    # The hot loop unbroken exists to prevent. Its rate is bound by the CPU OpenCode gets:
    # 13-15 requests/s on an idle machine, as low as 0.4/s at a load average of 15 (a CI
    # run measured 0.4 against 0.2 through unbroken), so only the order is asserted here;
    # the bounds that matter are unbroken's own, below.
    assert alone_rate > relayed.extra["per_second"]
    assert relayed.extra["max_per_second"] <= 2
    assert relayed.extra["per_second"] < 0.5


@pytest.mark.scenario("setup_undo")
def test_setup_and_undo_round_trip_a_real_opencode_json(
    scenarios: Batch, capsys: pytest.CaptureFixture[str]
) -> None:
    r = scenarios.result("setup_undo", timeout=300)
    report(
        capsys,
        f"setup/undo: patched, second setup changed nothing, OpenCode went through the relay "
        f"({r['turns_via_relay']} turn), undo restored {len(r['restored'])} bytes exactly",
    )
    assert r["first"].code == 0, r["first"]
    assert r["patched"] != r["original"]
    assert b"// my project's OpenCode config" in r["patched"]  # comments kept
    assert r["backup"] == r["original"]
    assert r["second"].code == 0 and "nothing to change" in r["second"].stdout
    assert r["patched_again"] == r["patched"]
    assert r["through"].code == 0 and TEXT in r["through"].stdout, r["through"]
    assert r["turns_via_relay"] == 1
    assert r["undone"].code == 0, r["undone"]
    assert r["undone"].stdout.startswith("restored "), r["undone"]
    assert r["restored"] == r["original"]
    assert not r["backup_left"]
    assert r["direct"].code == 0 and TEXT in r["direct"].stdout, r["direct"]
    assert r["turns_after_undo"] == 1  # the relay saw nothing more
    assert r["requests"] == 2


@pytest.mark.run_last
@pytest.mark.scenario("seed")
def test_seed_twenty_drops_after_output_kill_opencode_alone_and_resume_recovers(
    scenarios: Batch, capsys: pytest.CaptureFixture[str]
) -> None:
    runs: dict[str, SessionRun] = scenarios.result("seed", timeout=400)
    resumed = runs["with"]
    alone = runs.get("without")  # measured again (UNBROKEN_E2E_ALONE=1), else recorded
    report(
        capsys,
        f"{SEED_FAILURES} drops after output: without unbroken "
        f"{alone.turns if alone is not None else SEED_ALONE_TURNS} provider turns, session "
        f"{alone.outcome if alone is not None else 'dead'}; with unbroken (relay + resume) "
        f"{resumed.turns} provider turns, {resumed.outcome} on turn {resumed.recovered_on} "
        f"after {resumed.resumes} resumes ({resumed.elapsed:.0f} s; peak "
        f"{resumed.max_per_second} requests/s)",
    )
    if alone is not None:
        assert alone.outcome == "dead", alone
        assert alone.turns == SEED_ALONE_TURNS, alone.times
    assert resumed.outcome == "completed", resumed.log[-4000:]
    assert resumed.turns == SEED_FAILURES + 1, resumed.times
    assert resumed.recovered_on == SEED_FAILURES + 1
    assert resumed.resumes == 3  # one per OpenCode retry cycle of 6 failures
    assert resumed.max_per_second <= 2  # no hot loop
