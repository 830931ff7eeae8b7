"""Shared fixtures."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest_asyncio

from unbroken.mock import MockProvider


@pytest_asyncio.fixture
async def mock() -> AsyncIterator[MockProvider]:
    """A started mock provider on 127.0.0.1 with an ephemeral port."""
    async with MockProvider(host="127.0.0.1", port=0) as provider:
        yield provider
