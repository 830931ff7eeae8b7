"""End-to-end tests with the real OpenCode CLI: all scenarios run concurrently.

OpenCode's own retry backoff makes its baselines slow (about 74 s for a 503 storm,
about 63 s per 5-retry cycle), and the 20-failure verification needs three such
cycles.  So the first e2e test starts every selected scenario at once in a
background event loop, each test waits only for its own, and the long verification
(marked ``run_last``) is moved to the end of the session (on xdist workers, to the
end of the e2e tests, which go first: tests/conftest.py): the rest of the suite runs
while OpenCode sits in its backoff.  OpenCode alone (the baselines) is recorded in
oc_scenarios.py and run only with ``UNBROKEN_E2E_ALONE=1``.

The scenario tests share that batch (a session fixture): tests/conftest.py keeps them
on one pytest-xdist worker, and sends them out first.

The CLIs come from `clis.ensure_npm_cli`: once the selection is known, the session
installs every CLI the selected tests ask for (``pytest.mark.cli("opencode")``) into
the test cache, once per machine, printing a line while it does (each xdist worker
asks; the cache's file lock lets one install while the others wait for it).  A CLI
that cannot be installed fails the tests that need it, with the reason; nothing is
skipped.
``UNBROKEN_OPENCODE_BIN`` (``UNBROKEN_<BIN>_BIN``) uses an installed binary instead.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from e2e.clis import INSTALLED, PINNED, CliUnavailable, cache_root, ensure_npm_cli, installed
from e2e.oc_scenarios import AFTER, Batch, ScenarioName, scenario_name

if TYPE_CHECKING:
    from _pytest.capture import CaptureManager  # (pytest does not export its type)


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "scenario(name): the e2e scenario a test checks")
    config.addinivalue_line("markers", "run_last: move this test to the end of the session")
    config.addinivalue_line(
        "markers", "cli(name): the test drives this pinned agent CLI (see tests/e2e/clis.py)"
    )


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    last = [i for i in items if i.get_closest_marker("run_last")]
    if last:
        items[:] = [i for i in items if not i.get_closest_marker("run_last")] + last


def pytest_collection_finish(session: pytest.Session) -> None:
    """Install the CLIs the selected tests need, before the first of them runs."""
    if session.config.option.collectonly:
        return
    wanted: list[str] = []
    for item in session.items:
        for marker in item.iter_markers("cli"):
            if marker.args[0] not in wanted:
                wanted.append(marker.args[0])
    if not wanted:
        return
    say = _printer(session.config)
    cache = cache_root()  # fixed now: tests change XDG_* variables in os.environ later
    for name in wanted:
        cli = PINNED[name]
        override = os.environ.get(cli.override_env)
        if override:
            path = Path(override)
            INSTALLED[name] = (
                path
                if path.exists()
                else CliUnavailable(f"{cli.override_env}={override}: no such file")
            )
            continue
        try:
            INSTALLED[name] = ensure_npm_cli(
                cli.package, cli.version, cli.bin, cache=cache, say=say
            )
        except CliUnavailable as exc:
            INSTALLED[name] = exc
            say(f"unbroken tests: cannot install {cli.spec}; its tests will fail: {exc}")


def _printer(config: pytest.Config) -> Callable[[str], None]:
    """Print one line on the terminal, past pytest's output capture."""
    reporter: pytest.TerminalReporter | None = config.pluginmanager.get_plugin("terminalreporter")
    capture: CaptureManager | None = config.pluginmanager.get_plugin("capturemanager")

    worker = hasattr(config, "workerinput")  # an xdist worker: its terminal is not shown

    def say(line: str) -> None:
        with capture.global_and_fixture_disabled() if capture else contextlib.nullcontext():
            if worker:  # its stderr is the terminal's (a worker's stdout is its channel)
                print(line, file=sys.stderr, flush=True)
            elif reporter is not None:
                reporter.write_line(line)
            else:
                print(line, flush=True)

    return say


@pytest.fixture(autouse=True)
def _clis(request: pytest.FixtureRequest) -> None:
    """A test that needs a CLI fails at once, with the reason, when it is not installed."""
    for marker in request.node.iter_markers("cli"):
        problem = None
        try:
            installed(marker.args[0])
        except CliUnavailable as exc:
            problem = str(exc)
        if problem is not None:
            pytest.fail(problem, pytrace=False)


@pytest.fixture(scope="session")
def scenarios(request: pytest.FixtureRequest) -> Iterator[Batch]:
    wanted: list[ScenarioName] = []
    for item in request.session.items:
        marker = item.get_closest_marker("scenario")
        if marker is not None and (name := scenario_name(marker.args[0])) not in wanted:
            wanted.append(name)
    batch = Batch()
    # The slowest first, so the long ones are under way while the short ones start;
    # a scenario that waits for another (AFTER) after the one it waits for.
    for name in sorted(wanted, key=lambda n: (n != "seed", n in AFTER)):
        batch.start(name)
    yield batch
    batch.close()
