"""Client-facing aiohttp server: routing, body limits, health, graceful shutdown."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import signal
from collections.abc import Awaitable, Callable, Mapping

from aiohttp import web

from unbroken import __version__
from unbroken.config import Config
from unbroken.observe.guard import Guarded
from unbroken.observe.health import Health
from unbroken.observe.hooks import Hooks, LogHooks, MultiHooks
from unbroken.observe.journal import Journal, journal_path
from unbroken.observe.metrics import CONTENT_TYPE_LATEST, Metrics
from unbroken.observe.status import StatusTracker
from unbroken.relay.http import Relay
from unbroken.relay.websocket import handle_websocket, is_websocket_request

__all__ = ["RelayServer", "build_app", "serve"]

log = logging.getLogger("unbroken")

RELAY_KEY = web.AppKey("relay", Relay)


def _json(status: int, payload: object) -> web.Response:
    return web.Response(status=status, text=json.dumps(payload), content_type="application/json")


def _route_list(relay: Relay) -> list[str]:
    return [f"/{name}/..." for name in sorted(relay.config.routes)]


async def _healthz(request: web.Request) -> web.Response:
    relay = request.app[RELAY_KEY]
    return _json(
        200,
        {
            "status": "ok",
            "version": __version__,
            "routes": sorted(relay.config.routes),
            "inflight": len(relay.inflight),
        },
    )


async def _read_body(request: web.Request, limit: int) -> bytes | None:
    """The whole request body, or None when it exceeds ``limit`` bytes."""
    if request.content_length is not None and request.content_length > limit:
        return None
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.content.iter_any():
        size += len(chunk)
        if size > limit:
            return None
        chunks.append(chunk)
    return b"".join(chunks)


async def _relay(request: web.Request) -> web.StreamResponse:
    relay = request.app[RELAY_KEY]
    name = request.match_info["route"]
    route = relay.config.routes.get(name)
    if route is None:
        return _not_found(relay, request.path)
    if is_websocket_request(request):
        rest = request.match_info["rest"]
        if not rest.rstrip("/").endswith("responses"):
            return _json(
                400,
                {"error": {"message": "WebSocket is relayed on <route>/v1/responses only",
                           "type": "invalid_request_error", "code": "websocket_unsupported"}},
            )
        return await handle_websocket(relay, request, route, rest)
    limit = relay.config.max_body_bytes
    body = await _read_body(request, limit)
    if body is None:
        mb = relay.config.max_body_mb
        return _json(
            413,
            {
                "error": {
                    "message": f"request body exceeds retry.max_body_mb ({mb:g} MB)",
                    "type": "invalid_request_error",
                    "code": "request_too_large",
                }
            },
        )
    return await relay.handle(request, route, request.match_info["rest"], body)


def _not_found(relay: Relay, path: str) -> web.Response:
    return _json(
        404,
        {
            "error": {
                "message": f"no route for {path!r}; call /<route>/<upstream path>",
                "type": "not_found",
                "code": "unknown_route",
            },
            "routes": _route_list(relay),
            "endpoints": ["/healthz", "/status", "/metrics"],
        },
    )


async def _unknown(request: web.Request) -> web.Response:
    return _not_found(request.app[RELAY_KEY], request.path)


Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def build_app(relay: Relay, endpoints: Mapping[str, Handler] | None = None) -> web.Application:
    """``endpoints``: extra GET routes (path -> handler), matched before the relay routes."""
    # Bodies are read by _read_body with our own limit and a JSON 413.
    app = web.Application(client_max_size=2**63)
    app[RELAY_KEY] = relay
    app.router.add_get("/healthz", _healthz)
    for path, handler in (endpoints or {}).items():
        app.router.add_get(path, handler)
    app.router.add_route("*", r"/{route}/{rest:.*}", _relay)
    app.router.add_route("*", r"/{tail:.*}", _unknown)

    async def _close(app: web.Application) -> None:
        await relay.close()

    app.on_cleanup.append(_close)
    return app


class RelayServer:
    """A started relay on a host and port (port 0 picks a free one)."""

    def __init__(self, config: Config, *, hooks: Hooks | None = None) -> None:
        self.hooks = MultiHooks(LogHooks(verbose=config.verbose))
        self.relay = Relay(config, hooks=self.hooks)
        self.health = Health(
            {name: [u.name for u in r.upstreams] for name, r in config.routes.items()},
            self.relay.cooloffs,
        )
        self.hooks.hooks.append(self.health)
        self.journal: Journal | None = None
        if config.journal.enabled:
            self.journal = Journal(
                journal_path(config.journal.path), retention_days=config.journal.retention_days
            )
        inflight = self.relay.inflight.copy
        self.metrics = Metrics(inflight, self.health.snapshot)
        self.status = StatusTracker(inflight, self.health.snapshot, extra=self._status_extra)
        for observer in (self.status, self.metrics, self.journal):
            if observer is not None:
                self.hooks.hooks.append(Guarded(observer))
        if hooks is not None:
            self.hooks.hooks.append(hooks)
        self.app = build_app(
            self.relay, {"/status": self._get_status, "/metrics": self._get_metrics}
        )
        self.runner = web.AppRunner(
            self.app,
            handler_cancellation=True,  # a client that goes away cancels its turn at once
            access_log=None,
            shutdown_timeout=1.0,  # our own drain() has already waited the grace period
        )
        self.host = config.host
        self.port = config.port
        self.url = ""

    def _status_extra(self) -> dict[str, object]:
        return {"journal": self.journal.status() if self.journal is not None else None}

    async def _get_status(self, request: web.Request) -> web.Response:
        return _json(200, self.status.snapshot())

    async def _get_metrics(self, request: web.Request) -> web.Response:
        body = self.metrics.expose()
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def start(self) -> None:
        if self.journal is not None:
            self.journal.start()
            log.info("journal: %s", self.journal.path)
        await self.runner.setup()
        site = web.TCPSite(self.runner, self.host, self.port, reuse_address=True)
        await site.start()
        server = getattr(site, "_server", None)
        sockets = getattr(server, "sockets", None) or []
        if sockets:
            self.port = sockets[0].getsockname()[1]
        host = f"[{self.host}]" if ":" in self.host else self.host
        self.url = f"http://{host}:{self.port}"

    async def stop(self) -> None:
        """Stop accepting, let in-flight turns finish within the grace period, close."""
        try:
            for site in list(self.runner.sites):
                await site.stop()  # stop accepting
            cut = await self.relay.drain(self.relay.config.grace_s)
            if cut:
                log.warning("grace period over: %d request(s) cut short", cut)
            await self.runner.cleanup()
        finally:
            if self.journal is not None:
                await self.journal.aclose()

    async def __aenter__(self) -> RelayServer:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()


async def serve(
    config: Config,
    *,
    ready: Callable[[str], None] | None = None,
    stop_event: asyncio.Event | None = None,
) -> int:
    """Run until SIGINT/SIGTERM (or ``stop_event``), then shut down gracefully.

    The first signal stops accepting and lets in-flight turns finish within
    ``grace_s``; a second one cuts the grace period short.  Either way the exit
    status is 0.
    """
    server = RelayServer(config)
    await server.start()
    stop = stop_event or asyncio.Event()
    force = asyncio.Event()
    loop = asyncio.get_running_loop()

    def _signal() -> None:
        (force if stop.is_set() else stop).set()

    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError, RuntimeError):
            loop.add_signal_handler(sig, _signal)
    if ready is not None:
        ready(server.url)
    try:
        await stop.wait()
        log.info("shutting down: waiting up to %gs for in-flight turns", config.grace_s)
    finally:
        cleanup = asyncio.ensure_future(server.stop())
        forced = asyncio.ensure_future(force.wait())
        await asyncio.wait({cleanup, forced}, return_when=asyncio.FIRST_COMPLETED)
        forced.cancel()
        if not cleanup.done():
            log.info("second signal: not waiting for in-flight turns")
            cleanup.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await cleanup
    # The signal handlers stay until the loop closes: a late signal is harmless.
    return 0
