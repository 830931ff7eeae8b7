"""Client-facing aiohttp server: access checks, routing, body limits, health, shutdown.

Every request is dispatched here from its raw request-target
(`unbroken.relay.access`): checked (400 / 421 / 403 / 401), then routed to
``/healthz``, an extra endpoint (``/status``, ``/metrics``, ``/ui``) or a relay route,
whose rest of path and query go upstream still percent-encoded.  Bodies are
read as received (never decompressed), up to ``max_body_mb``.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import json
import logging
import os
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from unbroken import __version__
from unbroken.config import Config, Route, bind_problem
from unbroken.core.wire.redact import redact
from unbroken.observe import webview
from unbroken.observe.guard import Guarded
from unbroken.observe.hooks import Hooks, LogHooks, MultiHooks
from unbroken.observe.journal import Journal, journal_path
from unbroken.observe.metrics import CONTENT_TYPE_LATEST, Metrics
from unbroken.observe.otel import OtelHooks, otel_from_env
from unbroken.observe.outcomes import Health
from unbroken.observe.status import StatusTracker
from unbroken.relay.access import Access, Denied, Target, parse_target
from unbroken.relay.connections import (
    GuardedHandler,
    GuardedRunner,
    GuardedServer,
    effective_max_connections,
    install_accept_log_limiter,
)
from unbroken.relay.http import handle_http
from unbroken.relay.logfilter import install_log_filter
from unbroken.relay.relay_state import RelayState
from unbroken.relay.siblings import (
    WorkerSpec,
    read_worker_status,
    stop_signals,
    write_worker_status,
)
from unbroken.relay.upstream import looped
from unbroken.relay.websocket import handle_websocket, is_websocket_request

__all__ = ["CUT_SHORT_S", "RelayServer", "build_app", "finish_cut_short", "serve", "tune_gc"]

log = logging.getLogger("unbroken")

RELAY_KEY = web.AppKey("relay", RelayState)
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


@dataclass
class _Gate:
    """The app's access rules, known once the port is bound (None: checks off)."""

    access: Access | None = None
    endpoints: Mapping[str, Handler] | None = None


GATE_KEY = web.AppKey("gate", _Gate)


def _json(status: int, payload: object, headers: Mapping[str, str] | None = None) -> web.Response:
    return web.Response(
        status=status,
        text=json.dumps(payload),
        content_type="application/json",
        headers=headers,
    )


def _error(
    status: int, code: str, message: str, kind: str = "invalid_request_error"
) -> web.Response:
    return _json(status, {"error": {"message": f"unbroken: {message}", "type": kind, "code": code}})


def _denied(d: Denied) -> web.Response:
    kinds = {401: "authentication_error", 403: "permission_error"}
    kind = kinds.get(d.status, "invalid_request_error")
    return _error(d.status, d.code, d.message, kind)


def _route_list(relay: RelayState) -> list[str]:
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
            "store": relay.store.status()["state"],
        },
    )


async def _read_body(request: web.Request, limit: int, idle_s: float) -> bytes | None:
    """The whole request body as received (still encoded), or None past ``limit`` bytes.

    Raises TimeoutError when the client stays silent ``idle_s`` mid-body.
    """
    if request.content_length is not None and request.content_length > limit:
        return None
    chunks: list[bytes] = []
    size = 0
    content = request.content
    while True:
        # What has arrived is taken without a timer (usually the whole body came with
        # the headers); only a wait for more arms one.
        chunk = content.read_nowait()
        if not chunk:
            if content.at_eof():
                break
            async with asyncio.timeout(idle_s):
                chunk = await content.readany()
            if not chunk:
                break
        size += len(chunk)
        if size > limit:
            return None
        chunks.append(chunk)
    return b"".join(chunks)


def _too_large(relay: RelayState) -> web.Response:
    mb = relay.config.max_body_mb
    return _error(413, "request_too_large", f"request body exceeds retry.max_body_mb ({mb:g} MB)")


def _not_found(relay: RelayState, path: str) -> web.Response:
    return _json(
        404,
        {
            "error": {
                "message": f"no route for {path!r}; call /<route>/<upstream path>",
                "type": "not_found",
                "code": "unknown_route",
            },
            "routes": _route_list(relay),
            "endpoints": ["/healthz", "/status", "/metrics", "/ui"],
        },
    )


def _preflight(request: web.Request, origin: str) -> web.Response:
    """CORS preflight from an allowed origin (any other origin was refused before)."""
    headers = {
        "Access-Control-Allow-Origin": origin,
        "Access-Control-Allow-Methods": "GET, POST, OPTIONS",
        "Access-Control-Max-Age": "600",
        "Vary": "Origin",
    }
    asked = request.headers.get("access-control-request-headers")
    if asked:
        headers["Access-Control-Allow-Headers"] = asked
    return _Preflight(status=204, headers=headers)


class _Preflight(web.Response):
    """Our own CORS preflight answer (its Access-Control-* headers stay)."""


async def _dispatch(request: web.Request) -> web.StreamResponse:
    """Every request: check it, then route it.  Tells the connection when it started.

    One function, not a chain of them: a turn's coroutine runs under this one, and
    every coroutine in between is one more frame to resume on every wake-up.
    """
    protocol = request.protocol
    guarded = protocol if isinstance(protocol, GuardedHandler) else None
    if guarded is not None:
        guarded.request_started()
    try:
        relay = request.app[RELAY_KEY]
        gate = request.app[GATE_KEY]
        target = parse_target(request.raw_path)
        if isinstance(target, Denied):
            return _denied(target)
        endpoint: Handler | None = None
        if not target.has_rest:
            endpoint = (
                _healthz
                if target.name == "healthz"
                else ((gate.endpoints or {}).get(f"/{target.name}"))
            )
        if gate.access is not None:
            denied = gate.access.check(target, request.headers, open_path=endpoint is _healthz)
            if denied is not None:
                return _denied(denied)
        origin = request.headers.get("origin")
        if origin is not None and request.method == "OPTIONS":
            return _preflight(request, origin)
        if endpoint is not None:
            if request.method not in ("GET", "HEAD"):
                return _error(405, "method_not_allowed", f"/{target.name} answers GET only")
            return await endpoint(request)
        route = relay.config.routes.get(target.name)
        if route is None or not target.has_rest:
            return _not_found(relay, target.path)
        return await _relay(request, relay, route, target)
    finally:
        if guarded is not None:
            guarded.request_finished()


async def _relay(
    request: web.Request, relay: RelayState, route: Route, target: Target
) -> web.StreamResponse:
    rest = target.rest
    if looped(
        request.headers, relay.via
    ):  # it came back through us: answer before holding anything
        return _error(
            508,
            "loop_detected",
            f"the request came back to this relay (route {route.name!r} leads to itself)",
            "server_error",
        )
    if is_websocket_request(request):
        if not rest.rstrip("/").endswith("responses"):
            return _error(
                400, "websocket_unsupported", "WebSocket is relayed on <route>/v1/responses only"
            )
        return await handle_websocket(relay, request, route, rest)
    config = relay.config
    try:
        body = await _read_body(request, config.max_body_bytes, config.header_read_timeout_s)
    except TimeoutError:
        return _error(408, "request_timeout", "the request body stopped arriving")
    if body is None:
        return _too_large(relay)
    response = await handle_http(relay, request, route, rest, body)
    # (``prepared`` first: a streamed turn's response is, and isinstance on an ABC's
    # subclass is a Python-level check)
    if not response.prepared and isinstance(response, web.Response) and response.status >= 400:
        _redact_response(response, config.secrets())
    return response


def _redact_response(response: web.Response, secrets: tuple[str, ...]) -> None:
    """An upstream error answer passed through whole: no known secret in it."""
    body = response.body
    if not secrets or not isinstance(body, bytes | bytearray):
        return
    clean = redact(bytes(body), secrets)
    if clean != body:
        response.headers.popall("Content-Length", None)
        response.body = clean
        log.warning("an upstream error answer echoed a configured secret: redacted")


async def _cors(request: web.Request, response: web.StreamResponse) -> None:
    """on_response_prepare: no upstream CORS header, ever; ours for an allowed origin.

    Runs for every response of either transport (WebSocket handshakes included)
    just before its headers are written.
    """
    # (the class's flag, not isinstance: a StreamResponse is a MutableMapping, an ABC,
    # whose isinstance check runs in Python)
    if not getattr(response, "clean_of_cors", False):
        if isinstance(response, _Preflight):
            return
        headers = response.headers
        stale = [k for k in headers if k[:15].lower() == "access-control-"]
        for name in stale:
            headers.popall(name, None)
    origin = request.headers.get("origin")
    if origin is None:
        return
    gate = request.app[GATE_KEY]
    if gate.access is not None and gate.access.origin_ok(origin):
        if "Access-Control-Allow-Origin" not in response.headers:
            response.headers["Access-Control-Allow-Origin"] = origin
            response.headers.add("Vary", "Origin")


def build_app(relay: RelayState, endpoints: Mapping[str, Handler] | None = None) -> web.Application:
    """``endpoints``: extra GET routes (path -> handler), matched before the relay routes."""
    # Bodies are read by _read_body with our own limit and a JSON 413.
    app = web.Application(client_max_size=2**63)
    app[RELAY_KEY] = relay
    app[GATE_KEY] = _Gate(endpoints=dict(endpoints or {}))
    # One handler for every path: the raw request-target is parsed by `access`.
    app.router.add_route("*", r"/{tail:[\s\S]*}", _dispatch)
    app.on_response_prepare.append(_cors)

    async def _close(app: web.Application) -> None:
        await relay.close()

    app.on_cleanup.append(_close)
    return app


class RelayServer:
    """A started relay on a host and port (port 0 picks a free one)."""

    def __init__(
        self, config: Config, *, hooks: Hooks | None = None, worker: WorkerSpec | None = None
    ) -> None:
        self.hooks = MultiHooks(LogHooks(verbose=config.verbose))
        self.worker = worker
        self.relay = RelayState(
            config,
            hooks=self.hooks,
            worker=worker.id if worker is not None else None,
            channel_dir=worker.runtime_dir if worker is not None else None,
        )
        self.health = Health(
            {name: [u.name for u in r.upstreams] for name, r in config.routes.items()},
            self.relay.cooloffs,
            breakers=self.relay.health_view,
        )
        self.hooks.add(self.health)
        self.journal: Journal | None = None
        if config.journal.enabled:
            self.journal = Journal(
                journal_path(config.journal.path), retention_days=config.journal.retention_days
            )
        inflight = self.relay.inflight.copy
        self.metrics = Metrics(inflight, self.health.snapshot, fleet=self._fleet)
        self.status = StatusTracker(inflight, self.health.snapshot, extra=self._status_extra)
        #: OpenTelemetry, when the OTEL_EXPORTER_OTLP_* variables ask for it (`observe.otel`)
        self.otel: OtelHooks | None = otel_from_env(config)
        for observer in (self.status, self.metrics, self.journal, self.otel):
            if observer is not None:
                self.hooks.add(Guarded(observer))
        if hooks is not None:
            self.hooks.add(hooks)
        self.app = build_app(
            self.relay,
            {"/status": self._get_status, "/metrics": self._get_metrics, "/ui": self._get_ui},
        )
        self._status_task: asyncio.Task[None] | None = None

        async def _stop_status(app: web.Application) -> None:
            if self._status_task is not None:
                self._status_task.cancel()

        self.app.on_cleanup.append(_stop_status)
        self.max_connections, fd_limit = effective_max_connections(config.max_connections)
        if fd_limit is not None:
            log.warning(
                "max_connections lowered from %d to %d: the open-file limit is %d "
                "(raise it with ulimit -n)",
                config.max_connections,
                self.max_connections,
                fd_limit,
            )
        self.runner = GuardedRunner(
            self.app,
            handler_cancellation=True,  # a client that goes away cancels its turn at once
            access_log=None,
            shutdown_timeout=1.0,  # our own drain() has already waited the grace period
            keepalive_timeout=config.keepalive_timeout_s,
            auto_decompress=False,  # bodies go upstream exactly as received
            header_read_timeout_s=config.header_read_timeout_s,
            max_connections=self.max_connections,
        )
        self.config = config
        self.host = config.host.strip() or "127.0.0.1"  # "" never means every interface
        self.port = config.port
        self.url = ""

    @property
    def connections(self) -> GuardedServer | None:
        """The connection-level server (counts, limits), once started."""
        server = self.runner.server
        return server if isinstance(server, GuardedServer) else None

    def _status_extra(self) -> dict[str, object]:
        return {
            "journal": self.journal.status() if self.journal is not None else None,
            "process": self.process_stats(),
            **self._fleet(),
            "transitions": [
                {"route": r, "upstream": u, "to": k, "count": n}
                for (r, u, k), n in sorted(self.relay.transitions.items())
            ],
        }

    def _fleet(self) -> dict[str, Any]:
        """Health-store state, breaker transitions and the worker's identity."""
        worker = self.worker
        return {
            "store": self.relay.store.status(),
            "transitions": self.relay.transitions,
            "worker": None if worker is None else {"id": worker.id, "pid": os.getpid()},
        }

    def _worker_summary(self) -> dict[str, Any]:
        now = time.time()
        return {
            "worker": self.worker.id if self.worker is not None else None,
            "pid": os.getpid(),
            "now": now,
            "inflight": [
                {**self.status.turn_view(t, now), "worker": self.worker.id if self.worker else None}
                for t in self.relay.inflight.copy()
            ],
            "totals": self.status.totals(),
        }

    async def _write_status(self) -> None:
        assert self.worker is not None
        while True:
            write_worker_status(self.worker, self._worker_summary())
            await asyncio.sleep(1.0)

    def process_stats(self) -> dict[str, object]:
        """Resource use of this process: connections, tasks, fds, RSS (soak, leak checks)."""
        conns = self.connections
        stats: dict[str, object] = {
            "connections": conns.connection_count if conns is not None else 0,
            "max_connections": self.max_connections,
            "refused_busy": conns.stats.refused_busy if conns is not None else 0,
            "header_timeouts": conns.stats.header_timeouts if conns is not None else 0,
            "tasks": len(asyncio.all_tasks()),
            "open_fds": _count_fds(),
            "rss_bytes": _rss_bytes(),
        }
        return stats

    async def _get_status(self, request: web.Request) -> web.Response:
        data = self.status.snapshot()
        if self.worker is not None:
            # every worker's view: this one's live, its siblings' from their summaries
            me = self._worker_summary()
            write_worker_status(self.worker, me)
            views = [v for v in read_worker_status(self.worker) if v.get("pid") != me["pid"]]
            views.insert(0, me)
            data["inflight"] = [t for v in views for t in v.get("inflight", [])]
            data["workers"] = [
                {
                    "id": v.get("worker"),
                    "pid": v.get("pid"),
                    "inflight": len(v.get("inflight", [])),
                    "totals": v.get("totals", {}),
                }
                for v in views
            ]
        return _json(200, data)

    async def _get_ui(self, request: web.Request) -> web.Response:
        """The web view (`observe.webview`): it reads /status, with the same authorisation."""
        body, headers = webview.page()
        return web.Response(body=body, headers=headers)

    async def _get_metrics(self, request: web.Request) -> web.Response:
        body = self.metrics.expose()
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def start(self) -> None:
        problem = bind_problem(self.config)
        if problem is not None:
            raise ValueError(problem)
        install_log_filter()
        install_accept_log_limiter(asyncio.get_running_loop())
        stored = self.relay.store_override_warning()
        if stored is not None:
            log.warning("%s", stored)
        if self.journal is not None:
            self.journal.start()
            log.info("journal: %s", self.journal.path)
        if self.otel is not None:
            log.info("OpenTelemetry: %s", self.otel.described)
        await self.relay.store.start()
        await self.runner.setup()
        site = web.TCPSite(
            self.runner,
            self.host,
            self.port,
            reuse_address=True,
            reuse_port=True if self.worker is not None else None,
        )
        if self.worker is not None:
            self._status_task = asyncio.ensure_future(self._write_status())
        await site.start()
        server = getattr(site, "_server", None)
        sockets = getattr(server, "sockets", None) or []
        if sockets:
            self.port = sockets[0].getsockname()[1]
        self.app[GATE_KEY].access = Access(self.config, self.port)
        host = f"[{self.host}]" if ":" in self.host else self.host
        self.url = f"http://{host}:{self.port}"

    def cut_short(self) -> None:
        """A second signal: `stop` waits no longer for in-flight turns.  They are cut
        (each ends with its protocol's error, and is journaled as ended), then the
        relay closes as usual."""
        self.relay.cut.set()

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
            if self.otel is not None:
                await self.otel.aclose()

    async def __aenter__(self) -> RelayServer:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()


def _count_fds() -> int | None:
    try:
        return len(os.listdir("/proc/self/fd"))
    except OSError:
        return None


def _rss_bytes() -> int | None:
    try:
        with open("/proc/self/statm", encoding="ascii") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


#: after a second signal, the shutdown (cutting the turns, closing the journal) gets
#: this long before it is cancelled
CUT_SHORT_S = 10.0


async def finish_cut_short(server: RelayServer, cleanup: asyncio.Future[None]) -> None:
    """A second signal during ``server.stop()`` (``cleanup``): cut the in-flight turns
    now, and let the shutdown finish so their ends reach the journal (issue 36); a
    shutdown that still hangs after `CUT_SHORT_S` is cancelled."""
    server.cut_short()
    done, _ = await asyncio.wait({cleanup}, timeout=CUT_SHORT_S)
    if not done:
        cleanup.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await cleanup


#: the cyclic collector's first threshold in a serving process (CPython's default: 700)
GC_THRESHOLD0 = 10_000


def tune_gc() -> None:
    """Make the cyclic garbage collector cheap for a serving process (call once started).

    A finished turn is freed by reference counting (`tests/relay/test_no_cycles.py`),
    so the collector finds little to free.  With CPython's default threshold (700 net
    container allocations) it still ran about once every ten turns at c=64, walking
    the live objects of every turn in flight each time: about 40 µs of CPU per turn,
    10 % of the relay's own cost (measured with ``bench/turn_cost.py`` and
    ``gc.callbacks``).  At 10,000 it runs about 50 times less often; what cyclic
    garbage there is (an error's traceback) waits a little longer.  ``gc.freeze``
    moves the start-up objects (modules, config, tables) out of its full collections.
    """
    gc.collect()
    gc.freeze()
    _, gen1, gen2 = gc.get_threshold()
    gc.set_threshold(GC_THRESHOLD0, gen1, gen2)


async def serve(
    config: Config,
    *,
    ready: Callable[[str], None] | None = None,
    stop_event: asyncio.Event | None = None,
) -> int:
    """Run until SIGINT/SIGTERM/SIGHUP (or ``stop_event``), then shut down gracefully.

    The first signal stops accepting and lets in-flight turns finish within
    ``grace_s``; a second one cuts the grace period short.  Either way the exit
    status is 0.  SIGHUP (a closed terminal) drains like SIGTERM, unless it was
    ignored at start (``nohup``); see `unbroken.relay.workers`.
    """
    server = RelayServer(config)
    await server.start()
    tune_gc()
    stop = stop_event or asyncio.Event()
    force = asyncio.Event()
    loop = asyncio.get_running_loop()

    def _signal() -> None:
        (force if stop.is_set() else stop).set()

    for sig in stop_signals():
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
            await finish_cut_short(server, cleanup)
    # The signal handlers stay until the loop closes: a late signal is harmless.
    return 0
