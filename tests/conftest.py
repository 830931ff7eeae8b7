"""Shared fixtures, and how the suite runs in parallel; the session rule that no test
may be skipped is in noskip.py.

The README's ``pytest`` runs on pytest-xdist workers (``addopts = "-n 4"`` in
pyproject.toml): each test goes to whichever worker is free, so every test owns what
it uses (ports are ephemeral, files are under ``tmp_path``, every redis-server is the
test's own, a relay's runtime directory is its own, the npm installs of the agent CLIs
take the test cache's file lock).  The tests of a fixture wider than one test share
it, so they run on one worker: `SHARED` names their files, `GroupScheduling` keeps
each group together (xdist's own ``--dist loadgroup`` cannot: it renames node ids,
which pytest 9 no longer allows), and a session whose tests use such a fixture from a
file not in `SHARED` stops at collection.  The e2e tests and the long tier go out
first (`_rank`), so no worker is left with a long test at the end.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio

from browserfix import chromium_binary
from redisfix import RedisServer
from unbroken.mock import MockProvider

pytest_plugins = ("noskip",)

# Helper modules whose asserts check what a test sees: pytest rewrites them as it does a
# test module's, so a failing check shows its values.
pytest.register_assert_rewrite(
    "core.turn.ledgerfix", "mock.wsfix", "relay.regressionfix", "servefix", "turnfix"
)

#: Files whose tests share a fixture set up once for the module or the session, and
#: the worker group each runs in.
SHARED: dict[str, str] = {
    "tests/test_bench_smoke.py": "bench-smoke",  # `runs`: the benchmarks, started once
    "tests/test_demo.py": "demo",  # `demo_run`: one `unbroken demo --json`
    "tests/e2e/test_opencode_e2e.py": "opencode-scenarios",  # `scenarios`: one batch
    "tests/e2e/test_opencode_after_commit_e2e.py": "opencode-scenarios",
}


def group_of(nodeid: str) -> str | None:
    """The worker group of a test (`SHARED`), or None: any worker."""
    return SHARED.get(nodeid.split("::", 1)[0])


def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """``-n N`` (xdist's ``--dist load``): load balancing that keeps each `SHARED` group
    on one worker.  Another ``--dist`` is xdist's own."""
    if config.getvalue("dist") != "load":
        return None
    from xdist.scheduler import LoadScopeScheduling  # type: ignore[import-untyped]

    config.option.loadscopereorder = False  # in the order `_rank` gave, not largest first

    class GroupScheduling(LoadScopeScheduling):  # type: ignore[misc]  # (xdist is untyped)
        """One work unit per test, but one per group for a `SHARED` file's tests, in
        the order of the collection (`_rank`)."""

        def _split_scope(self, nodeid: str) -> str:
            return group_of(nodeid) or nodeid

    return GroupScheduling(config, log)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Check that every test sharing a wider fixture is in a `SHARED` group and, on
    xdist workers, order the tests by `_rank` (a stable sort: the e2e tests
    ``run_last`` stay last among them, the rest keep their order).  Runs after the
    e2e conftest's."""
    for item in items:
        wide = _wider_fixture(item)
        if wide is not None and group_of(item.nodeid) is None:
            raise pytest.UsageError(
                f"{item.nodeid} uses the {wide[1]}-scoped fixture {wide[0]!r}: add its file "
                "to SHARED in tests/conftest.py, so its tests run on one xdist worker"
            )
    if hasattr(config, "workerinput"):
        items.sort(key=_rank)


def _rank(item: pytest.Item) -> int:
    """The order the tests go out to the workers: the e2e scenario batch (it waits out
    OpenCode's backoff on its worker), the other e2e tests, the long tier, then the
    rest in file order.  Long tests first, so none is left running alone at the end;
    the timing-sensitive demo runs with the rest, after the load of the first two."""
    if item.get_closest_marker("e2e"):
        return 0 if group_of(item.nodeid) else 1
    return 2 if item.get_closest_marker("slow") else 3


def _wider_fixture(item: pytest.Item) -> tuple[str, str] | None:
    """A fixture of this project's wider than a test that ``item`` uses: (name, scope)."""
    info = getattr(item, "_fixtureinfo", None)
    if info is None:
        return None
    for name, defs in info.name2fixturedefs.items():
        fixture = defs[-1]
        if fixture.baseid and fixture.scope != "function":  # (pytest's own: no baseid)
            return name, fixture.scope
    return None


@pytest.fixture(autouse=True)
def _state_home(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    """Journals of relays started by tests go to a temporary XDG_STATE_HOME, never ~/.local."""
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path_factory.mktemp("state")))


@pytest_asyncio.fixture
async def mock() -> AsyncIterator[MockProvider]:
    """A started mock provider on 127.0.0.1 with an ephemeral port."""
    async with MockProvider(host="127.0.0.1", port=0) as provider:
        yield provider


@pytest.fixture
def no_waits() -> Iterator[None]:
    """Retry waits switched off for this test (the turn machine's testing mode)."""
    from unbroken.core.turn.machine import set_testing

    with set_testing(True):
        yield


@pytest.fixture
def redis_server(tmp_path: Path) -> Iterator[RedisServer]:
    """A real redis-server on a free loopback port (`redisfix`), for the store tests."""
    server = RedisServer(tmp_path)
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def chromium() -> str:
    """A headless-capable Chromium (`browserfix`): found, or installed with apt-get as root
    (under a file lock, once per machine; a test's own look is cheap after that, so the
    fixture is a test's, not the session's, and any xdist worker may run its tests)."""
    return chromium_binary()
