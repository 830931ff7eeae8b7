"""End-to-end tests with the real OpenCode CLI: all scenarios run concurrently.

OpenCode's own retry backoff makes its baselines slow (about 73 s for a 503 storm,
about 63 s per 5-retry cycle), and the 20-failure verification needs three such
cycles.  So the first e2e test starts every selected scenario at once in a
background event loop, each test waits only for its own, and the long verification
(marked ``run_last``) is moved to the end of the session: the rest of the suite
runs while OpenCode sits in its backoff.

The binary comes from ``.ci/run`` (``.ci/node``) or ``$UNBROKEN_OPENCODE_BIN``.
When it is missing the tests fail if ``CI`` is set and are skipped otherwise.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
import threading
from collections.abc import Iterator
from typing import Any

import pytest
from oc_harness import OPENCODE_VERSION, kill_leftovers, opencode_bin
from oc_scenarios import SCENARIOS, remove_sandboxes


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "scenario(name): the e2e scenario a test checks")
    config.addinivalue_line("markers", "run_last: move this test to the end of the session")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    last = [i for i in items if i.get_closest_marker("run_last")]
    if last:
        items[:] = [i for i in items if not i.get_closest_marker("run_last")] + last


#: Seconds after the first e2e test each scenario starts (the longest first).
START_AFTER_S: dict[str, float] = {
    "seed": 0.0,
    "storm": 2.0,
    "setup_undo": 8.0,
    "reset_before_output": 14.0,
    "tool_reset": 20.0,
    "drop_after_output": 30.0,
}


class Batch:
    """A background event loop running the scenarios; results are futures."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="e2e", daemon=True)
        self.thread.start()
        self.futures: dict[str, concurrent.futures.Future[Any]] = {}

    def start(self, name: str) -> None:
        if name not in self.futures:
            self.futures[name] = asyncio.run_coroutine_threadsafe(self._run(name), self.loop)

    async def _run(self, name: str) -> Any:
        # Staggered: a dozen OpenCode processes starting at once would starve the
        # measurements of CPU on a small machine.
        await asyncio.sleep(START_AFTER_S.get(name, 0.0))
        return await SCENARIOS[name]()

    def result(self, name: str, timeout: float) -> Any:
        self.start(name)
        return self.futures[name].result(timeout)

    def close(self) -> None:
        for fut in self.futures.values():
            fut.cancel()  # cancels the task: processes are killed in their finally blocks

        async def drain() -> None:
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            if tasks:
                await asyncio.wait(tasks, timeout=15)

        with_timeout = asyncio.run_coroutine_threadsafe(drain(), self.loop)
        try:
            with_timeout.result(20)
        except (concurrent.futures.TimeoutError, concurrent.futures.CancelledError):
            pass
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        kill_leftovers()
        remove_sandboxes()


@pytest.fixture(scope="session")
def scenarios(request: pytest.FixtureRequest) -> Iterator[Batch]:
    if opencode_bin() is None:
        reason = (
            f"OpenCode {OPENCODE_VERSION} not installed: run .ci/run, or npm install --prefix "
            f".ci/node opencode-ai@{OPENCODE_VERSION}, or set UNBROKEN_OPENCODE_BIN"
        )
        if os.environ.get("CI"):
            pytest.fail(reason)
        pytest.skip(reason)
    batch = Batch()
    wanted: list[str] = []
    for item in request.session.items:
        marker = item.get_closest_marker("scenario")
        if marker is not None and marker.args[0] not in wanted:
            wanted.append(marker.args[0])
    # The slowest first, so the long ones are under way while the short ones start.
    for name in sorted(wanted, key=lambda n: n != "seed"):
        batch.start(name)
    yield batch
    batch.close()
