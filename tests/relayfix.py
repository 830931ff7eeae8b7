"""Shared test helpers: start a relay in-process in front of the mock provider."""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Any

from unbroken.config import parse_config
from unbroken.core.admission.policy import Failure
from unbroken.observe.hooks import Hooks, TurnRecord
from unbroken.relay.server import RelayServer

#: the token `make_config` gives a relay whose route injects a key (`Config.key_token`)
KEY_TOKEN = "keytok-0123456789abcdef"
#: the header a request on such a route must carry
KEY_AUTH = {"x-unbroken-token": KEY_TOKEN}


class Recorder(Hooks):
    """Collects hook calls; lets tests wait for a turn to end without sleeping."""

    def __init__(self) -> None:
        self.ended: list[TurnRecord] = []
        self.failures: list[tuple[str, str, float | None]] = []
        self._ended = asyncio.Event()

    def attempt_failed(
        self, turn: TurnRecord, upstream: str, failure: Failure, *, phase: str, wait_s: float | None
    ) -> None:
        self.failures.append((failure.label, phase, wait_s))

    def turn_ended(self, turn: TurnRecord) -> None:
        self.ended.append(turn)
        self._ended.set()

    async def wait_turns(self, n: int) -> list[TurnRecord]:
        async with asyncio.timeout(30):
            while len(self.ended) < n:
                self._ended.clear()
                await self._ended.wait()
        return self.ended


def make_config(
    upstreams: list[Any],
    *,
    retry: dict[str, Any] | None = None,
    stream: dict[str, Any] | None = None,
    env: dict[str, str] | None = None,
    route: str = "mock",
) -> Any:
    data: dict[str, Any] = {
        "retry": {"delay_ms": 5, **(retry or {})},
        "routes": {route: {"upstreams": upstreams}},
    }
    if stream:
        data["stream"] = stream
    cfg = parse_config(data, env=env or {})
    # like `unbroken serve`: a route that injects a key needs a token (`relay.tokenfile`)
    key_token = KEY_TOKEN if cfg.injects_keys and cfg.token is None else None
    return dataclasses.replace(cfg, port=0, grace_s=5.0, key_token=key_token)


async def start_relay(config: Any) -> tuple[RelayServer, Recorder]:
    rec = Recorder()
    server = RelayServer(config, hooks=rec)
    await server.start()
    return server, rec
