"""Shared fixtures; the session rule that no test may be skipped is in noskip.py."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
import pytest_asyncio

from browserfix import chromium_binary
from redisfix import RedisServer
from unbroken.mock import MockProvider

pytest_plugins = ("noskip",)

# Helper modules whose asserts check what a test sees: pytest rewrites them as it does a
# test module's, so a failing check shows its values.
pytest.register_assert_rewrite("core.ledgerfix", "mock.wsfix", "relay.regressionfix", "turnfix")


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
    from unbroken.core.turn import set_testing

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


@pytest.fixture(scope="session")
def chromium() -> str:
    """A headless-capable Chromium (`browserfix`): found, or installed with apt-get as root."""
    return chromium_binary()
