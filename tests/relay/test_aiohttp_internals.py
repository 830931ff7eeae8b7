"""The aiohttp internals the relay relies on are still there, and still do what it needs.

`relay/connections.py` extends aiohttp's low-level server (the header deadline, the
connection cap), `relay/http.py` sends a stream's headers with its first bytes, and
`relay/websocket.py` and `relay/server.py` read a few attributes aiohttp keeps to
itself: all reach past aiohttp's public API.  An aiohttp release that renames or changes
one of these fails here by name, not as a mysterious relay bug.  A new private
name in relay/ fails `test_every_private_name_of_aiohttp_the_relay_uses_is_checked`
until it is checked here too.
"""

from __future__ import annotations

import ast
import asyncio
import inspect
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from aiohttp.web_protocol import RequestHandler

import unbroken.relay
from unbroken.relay.connections import GuardedHandler, GuardedRunner, GuardedServer
from unbroken.relay.http import _WithFirstWrite
from unbroken.relay.websocket import abort_websocket, handshake_headers

RELAY = Path(unbroken.relay.__file__).resolve().parent

#: every private name of aiohttp's that relay/ uses, with where
CHECKED = {
    "_connections": "connections.py: web.Server's open connections (handler -> transport)",
    "_kwargs": "connections.py: web.Server's handler arguments, passed on to each handler",
    "_loop": "connections.py: web.Server's event loop",
    "_make_server": "connections.py: web.AppRunner builds its server (GuardedRunner's hook)",
    "_task_handler": "connections.py: a RequestHandler's task (the connection is done with it)",
    "_send_headers_immediately": "http.py: a StreamResponse sends its headers at prepare()",
    "_server": "server.py: a TCPSite's asyncio server (the port it bound)",
    "_response": "websocket.py: a client WebSocket's handshake response (its headers)",
    "_conn": "websocket.py: a client WebSocket's connection (its transport, to abort)",
    "_drain_helper": "websocket.py: a RequestHandler waits for a slow client's buffer",
    "_close_transport": "wslinger.py: a WebSocketResponse closes its TCP connection (lingered)",
    "_req": "wslinger.py: a prepared WebSocketResponse's request (its transport)",
}


@pytest.fixture
async def guarded() -> AsyncIterator[tuple[GuardedRunner, str, asyncio.Event]]:
    """A GuardedRunner serving one route; the event lets its handler go on."""
    go = asyncio.Event()

    async def slow(request: web.Request) -> web.StreamResponse:
        await go.wait()
        return web.Response(text="ok")

    app = web.Application()
    app.router.add_get("/slow", slow)
    runner = GuardedRunner(
        app, header_read_timeout_s=30.0, max_connections=10, access_log=None, keepalive_timeout=7
    )
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    try:
        yield runner, f"http://127.0.0.1:{port}", go
    finally:
        go.set()
        await runner.cleanup()


async def test_the_runner_hook_builds_a_guarded_server_with_aiohttp_s_arguments(
    guarded: tuple[GuardedRunner, str, asyncio.Event],
) -> None:
    runner, _, _ = guarded
    assert inspect.iscoroutinefunction(web.AppRunner._make_server)
    server = runner.server
    assert isinstance(server, GuardedServer)  # _make_server was the hook
    assert server._loop is asyncio.get_running_loop()
    assert isinstance(server._kwargs, dict)
    assert server._kwargs.get("keepalive_timeout") == 7  # the runner's kwargs got through


async def test_the_server_s_connections_and_each_handler_s_task(
    guarded: tuple[GuardedRunner, str, asyncio.Event],
) -> None:
    runner, url, go = guarded
    server = runner.server
    assert isinstance(server, GuardedServer)
    async with aiohttp.ClientSession() as session:
        request = asyncio.ensure_future(session.get(f"{url}/slow"))
        assert await server.wait_connections(lambda n: n == 1) == 1
        assert isinstance(server._connections, dict)
        ((handler, transport),) = server._connections.items()
        assert isinstance(handler, GuardedHandler) and isinstance(handler, RequestHandler)
        assert isinstance(transport, asyncio.Transport)
        # the handler's task: what connection_lost waits on before the count drops
        deadline = asyncio.get_running_loop().time() + 10
        while handler._task_handler is None:
            assert asyncio.get_running_loop().time() < deadline
            await asyncio.sleep(0)
        assert isinstance(handler._task_handler, asyncio.Task)
        go.set()
        async with await request as resp:
            assert await resp.text() == "ok"
    assert await server.wait_connections(lambda n: n == 0) == 0


async def test_a_stream_s_headers_leave_with_its_first_bytes() -> None:
    """``_send_headers_immediately = False``: prepare() writes nothing to the socket;
    the first write() sends the status line, the headers and the bytes together."""
    assert web.StreamResponse._send_headers_immediately is True  # aiohttp's default
    writes: list[bytes] = []
    after_prepare: list[int] = []

    async def handler(request: web.Request) -> web.StreamResponse:
        transport: Any = request.transport
        real_write, real_writelines = transport.write, transport.writelines

        def write(data: bytes) -> None:
            writes.append(bytes(data))
            real_write(data)

        def writelines(parts: list[bytes]) -> None:
            writes.append(b"".join(parts))
            real_writelines(parts)

        transport.write, transport.writelines = write, writelines
        resp = _WithFirstWrite(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        after_prepare.append(len(writes))
        await resp.write(b"data: x\n\n")
        await resp.write_eof()
        return resp

    app = web.Application()
    app.router.add_get("/", handler)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        port = runner.addresses[0][1]
        async with (
            aiohttp.ClientSession() as session,
            session.get(f"http://127.0.0.1:{port}/") as resp,
        ):
            assert await resp.read() == b"data: x\n\n"
    finally:
        await runner.cleanup()
    assert after_prepare == [0]  # prepare() sent nothing
    assert writes[0].startswith(b"HTTP/1.1 200 OK\r\n")
    assert b"data: x\n\n" in writes[0]  # one send: the headers and the first bytes


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _self_stores(node: ast.AST) -> set[str]:
    return {
        n.attr
        for n in ast.walk(node)
        if isinstance(n, ast.Attribute)
        and isinstance(n.ctx, ast.Store)
        and isinstance(n.value, ast.Name)
        and n.value.id == "self"
    }


async def test_a_site_s_server_a_socket_s_handshake_and_connection_and_the_drain() -> None:
    drains: list[bool] = []

    async def socket(request: web.Request) -> web.WebSocketResponse:
        drains.append(inspect.iscoroutinefunction(request.protocol._drain_helper))
        ws = web.WebSocketResponse()
        ws.headers["x-codex-turn"] = "7"
        await ws.prepare(request)
        async for _ in ws:
            pass
        return ws

    app = web.Application()
    app.router.add_get("/ws", socket)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        sockets = site._server.sockets  # type: ignore[union-attr]
        port = sockets[0].getsockname()[1]
        assert port == runner.addresses[0][1]
        async with (
            aiohttp.ClientSession() as session,
            session.ws_connect(f"http://127.0.0.1:{port}/ws") as ws,
        ):
            assert isinstance(ws._response, aiohttp.ClientResponse)
            assert ("x-codex-turn", "7") in [(k.lower(), v) for k, v in handshake_headers(ws)]
            transport = ws._conn.transport  # type: ignore[union-attr]
            assert isinstance(transport, asyncio.Transport) and not transport.is_closing()
            abort_websocket(ws)
            assert transport.is_closing()
    finally:
        await runner.cleanup()
    assert drains == [True]


def _private_names_used(path: Path) -> set[str]:
    """Private attributes used in ``path`` that its own code does not define: through
    ``super()``, on ``self`` in a class that does not set them and when no class of the
    module defines such a method (inherited from aiohttp, or set at class level), or
    on another object when no code of the module sets them."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    anywhere = _self_stores(tree) | {
        n.target.id
        for n in ast.walk(tree)
        if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)  # fields
    }
    used: set[str] = set()
    methods = {
        n.name for n in ast.walk(tree) if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)
    }
    for cls in [n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)]:
        own = _self_stores(cls) | methods  # a method of ours, maybe of a base class of ours
        for item in cls.body:  # a class attribute set over a base class's
            if isinstance(item, ast.Assign):
                used |= {t.id for t in item.targets if isinstance(t, ast.Name) and _private(t.id)}
        for n in ast.walk(cls):
            if (
                isinstance(n, ast.Attribute)
                and isinstance(n.value, ast.Name)
                and n.value.id == "self"
                and _private(n.attr)
                and n.attr not in own
            ):
                used.add(n.attr)
    for n in ast.walk(tree):
        if not isinstance(n, ast.Attribute) or not _private(n.attr):
            continue
        value = n.value
        if isinstance(value, ast.Call) and ast.unparse(value.func) == "super":
            used.add(n.attr)
        elif isinstance(value, ast.Name) and value.id in ("self", "os", "sys"):
            continue
        elif n.attr not in anywhere:
            used.add(n.attr)
    for n in ast.walk(tree):  # getattr(obj, "_name", default)
        if (
            isinstance(n, ast.Call)
            and isinstance(n.func, ast.Name)
            and n.func.id == "getattr"
            and len(n.args) >= 2
            and isinstance(n.args[1], ast.Constant)
            and isinstance(n.args[1].value, str)
            and _private(n.args[1].value)
        ):
            used.add(n.args[1].value)
    return used


def test_a_websocket_response_closes_its_connection_through_close_transport() -> None:
    """`ClientSocket` overrides the one place aiohttp closes the TCP connection of a
    server WebSocket, and reads the prepared request's transport from ``_req``."""
    close_transport = web.WebSocketResponse._close_transport
    source = inspect.getsource(close_transport)
    assert "self._req" in source and ".transport.close()" in source
    assert "self._close_transport()" in inspect.getsource(web.WebSocketResponse.close)
    assert "self._close_transport()" in inspect.getsource(
        web.WebSocketResponse._set_code_close_transport
    )
    assert "_req" in web.StreamResponse.__annotations__  # set by prepare(), None before
    assert "self._req = request" in inspect.getsource(web.StreamResponse._start)


def test_every_private_name_of_aiohttp_the_relay_uses_is_checked() -> None:
    used: set[str] = set()
    ours: set[str] = set()  # defined by relay/ itself (a base class in another module)
    for path in sorted(RELAY.glob("*.py")):
        used |= _private_names_used(path)
        tree = ast.parse(path.read_text(encoding="utf-8"))
        ours |= {
            n.name for n in ast.walk(tree) if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)
        } | _self_stores(tree)
    assert used - (ours - set(CHECKED)) == set(CHECKED)


def test_the_scan_sees_a_private_name(tmp_path: Path) -> None:
    sample = tmp_path / "m.py"
    sample.write_text(
        "class S(Base):\n    _flag = False\n\n    def _hook(self, other):\n"
        "        self._mine = 1\n        super()._hook(other)\n"
        "        return other._theirs, self._inherited, self._mine, self._hook\n"
        "\ndef g(x):\n    return getattr(x, '_hidden', None)\n"
    )
    assert _private_names_used(sample) == {"_flag", "_theirs", "_inherited", "_hook", "_hidden"}
