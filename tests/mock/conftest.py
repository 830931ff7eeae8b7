"""Fixtures shared by the mock provider's tests."""

from __future__ import annotations

from collections.abc import AsyncIterator

import aiohttp
import pytest_asyncio


@pytest_asyncio.fixture
async def session() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as s:
        yield s
