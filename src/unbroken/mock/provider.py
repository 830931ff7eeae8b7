"""The mock provider: an aiohttp server with a FIFO of per-request actions.

`MockProvider` is its lifecycle and control API (``/_mock/...``); the provider
requests are answered by its HTTP mode (`mock.http_mode`) and its WebSocket mode
(`mock.ws_mode`), over the state both share (`mock.state`)."""

from __future__ import annotations

import asyncio
import json
from types import TracebackType
from typing import Any, Self

from aiohttp import web

from unbroken.mock.actions import (
    ActionError,
    expand_actions,
    expand_upgrade_actions,
)
from unbroken.mock.http_mode import HttpMode
from unbroken.mock.limits import MockLimits
from unbroken.mock.state import _RATE_HEADERS, RecordedRequest, RecordedUpgrade
from unbroken.mock.ws_mode import WebSocketMode

__all__ = ["MockProvider", "RecordedRequest", "RecordedUpgrade"]


async def _add_rate_headers(request: web.Request, response: web.StreamResponse) -> None:
    """The budgets left, on every answer the limits let through (any action's)."""
    extra = request.get(_RATE_HEADERS)
    if extra:
        for name, value in extra:
            response.headers[name] = value


def _format_host(host: str) -> str:
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


class MockProvider(HttpMode, WebSocketMode):
    """A deterministic, fault-injecting fake LLM provider.

    ``async with MockProvider() as mock:`` starts it on ``127.0.0.1`` on an
    ephemeral port; ``mock.url`` is its base URL.
    """

    # -- lifecycle -----------------------------------------------------------

    @property
    def url(self) -> str:
        """Base URL, e.g. ``http://127.0.0.1:41234`` (valid once started)."""
        return f"http://{_format_host(self.host)}:{self.port}"

    def make_app(self) -> web.Application:
        app = web.Application(client_max_size=1 << 30)
        app.router.add_get("/_mock/health", self._h_health)
        app.router.add_get("/_mock/requests", self._h_requests)
        app.router.add_get("/_mock/upgrades", self._h_upgrades)
        app.router.add_post("/_mock/reset", self._h_reset)
        app.router.add_post("/_mock/script", self._h_script)
        app.router.add_post("/_mock/default", self._h_default)
        app.router.add_post("/_mock/limits", self._h_limits)
        app.router.add_get("/_mock/limits", self._h_limits_get)
        app.on_response_prepare.append(_add_rate_headers)
        app.router.add_route("*", "/{tail:.*}", self._h_provider)
        return app

    async def start(self) -> None:
        if self._runner is not None:
            return
        self._stopping = asyncio.Event()
        runner = web.AppRunner(
            self.make_app(), handler_cancellation=True, access_log=None, shutdown_timeout=1.0
        )
        await runner.setup()
        site = web.TCPSite(runner, self.host, self.port)
        try:
            await site.start()
        except BaseException:
            await runner.cleanup()
            raise
        self._runner = runner
        for address in runner.addresses:
            if isinstance(address, tuple) and len(address) >= 2:
                self.port = int(address[1])
                break

    async def stop(self) -> None:
        runner, self._runner = self._runner, None
        if runner is None:
            return
        if self._stopping is not None:
            self._stopping.set()
        for transport in list(self._active):
            transport.abort()
        self._active.clear()
        await runner.cleanup()
        for _, fut in self._waiters:
            if not fut.done():
                fut.cancel()
        self._waiters.clear()

    async def __aenter__(self) -> Self:
        await self.start()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.stop()

    # -- control API ---------------------------------------------------------

    async def _h_health(self, request: web.Request) -> web.Response:
        pending = {("" if k is None else k): len(q) for k, q in self._queues.items() if q}
        upgrades = {("" if k is None else k): len(q) for k, q in self._upgrade_queues.items() if q}
        return web.json_response(
            {
                "ok": True,
                "url": self.url,
                "requests": len(self.requests),
                "pending": pending,
                "upgrades": len(self.upgrades),
                "pending_upgrades": upgrades,
                "sockets": self.sockets_accepted,
            }
        )

    async def _h_requests(self, request: web.Request) -> web.Response:
        return web.json_response([r.to_dict() for r in self.requests])

    async def _h_upgrades(self, request: web.Request) -> web.Response:
        return web.json_response([u.to_dict() for u in self.upgrades])

    async def _h_reset(self, request: web.Request) -> web.Response:
        self.reset()
        return web.json_response({"ok": True})

    async def _read_json(self, request: web.Request) -> Any:
        try:
            return json.loads(await request.read() or b"null")
        except ValueError as exc:
            raise ActionError(f"invalid JSON body: {exc}") from None

    async def _h_script(self, request: web.Request) -> web.Response:
        try:
            data = await self._read_json(request)
            if isinstance(data, list):
                data = {"actions": data}
            if not isinstance(data, dict):
                raise ActionError('expected {"actions": [...], "upgrades": [...], "key": optional}')
            unknown = set(data) - {"actions", "upgrades", "key"}
            if unknown:
                raise ActionError(
                    f"{sorted(unknown)[0]}: unknown key (expected actions, upgrades, key)"
                )
            key = data.get("key")
            if key is not None and not isinstance(key, str):
                raise ActionError("key: expected a string")
            actions = data.get("actions") or []
            upgrades = data.get("upgrades") or []
            expand_actions(actions)  # validate both before queuing either
            expand_upgrade_actions(upgrades)
            self.script(actions, key=key)
            self.script_upgrades(upgrades, key=key)
        except ActionError as exc:
            return web.json_response({"ok": False, "error": str(exc)}, status=400)
        return web.json_response(
            {
                "ok": True,
                "pending": self.pending(key),
                "pending_upgrades": self.pending_upgrades(key),
            }
        )

    async def _h_limits(self, request: web.Request) -> web.Response:
        """``{"rpm": 60, "tpm": 0, "style": "openai"}`` sets the limits; ``null`` lifts them."""
        try:
            data = await self._read_json(request)
            self.limits = None if data is None else MockLimits.from_dict(data)
        except (ActionError, ValueError) as exc:
            return web.json_response({"ok": False, "error": str(exc)}, status=400)
        return web.json_response({"ok": True})

    async def _h_limits_get(self, request: web.Request) -> web.Response:
        """The limits, what they answered, and every request's (time, status)."""
        limits = self.limits
        if limits is None:
            return web.json_response(None)
        return web.json_response({**limits.view(), "log": [[t, s] for t, _, s in limits.log]})

    async def _h_default(self, request: web.Request) -> web.Response:
        try:
            self.set_default(await self._read_json(request))
        except ActionError as exc:
            return web.json_response({"ok": False, "error": str(exc)}, status=400)
        return web.json_response({"ok": True})
