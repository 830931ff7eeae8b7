"""A real headless Chromium for the web view's tests, driven over the DevTools protocol.

The binary is, in order: ``$UNBROKEN_TEST_CHROMIUM``; ``chromium`` (Debian's
package) or ``chromium-browser`` on ``PATH``; ``/usr/bin/chromium``.  Without
any, a session running as root on a machine with ``apt-get`` installs Debian's
``chromium`` (``apt-get update``, then ``apt-get install -y chromium``; a file
lock keeps two sessions from doing it at once); otherwise the test fails with a
one-line reason that says what to install.  Never a skip.

`Browser` starts one headless Chromium with its own profile directory and
``--remote-debugging-port=0``, reads the port it picked from the profile's
``DevToolsActivePort``, and talks to its first page over a WebSocket
(``websockets``): `navigate`, `evaluate`, `wait_for` (polls a JavaScript
condition until a deadline), `screenshot`.  It also records what the page throws
and every Content-Security-Policy violation, for the tests to assert there is none.
"""

from __future__ import annotations

import asyncio
import base64
import fcntl
import itertools
import json
import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path
from types import TracebackType
from typing import Any

import aiohttp
import pytest
import websockets

__all__ = ["VIEWPORT", "Browser", "chromium_binary"]

#: a path to the browser to use instead of looking for one
CHROMIUM_ENV = "UNBROKEN_TEST_CHROMIUM"
FIX = (
    "no chromium found: install Debian's (apt-get update && apt-get install -y chromium), "
    f"or set {CHROMIUM_ENV}=/path/to/chromium"
)
#: the flags issue 35's brief names
FLAGS = (
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
    "--no-default-browser-check",
    "--remote-debugging-port=0",
)
#: the page's viewport (CSS pixels, scale 1): screenshots are this wide
VIEWPORT = (1280, 900)
APT_TIMEOUT_S = 900.0


def _found() -> str | None:
    env = os.environ.get(CHROMIUM_ENV)
    if env:
        return env
    for name in ("chromium", "chromium-browser"):
        path = shutil.which(name)
        if path:
            return path
    return "/usr/bin/chromium" if os.access("/usr/bin/chromium", os.X_OK) else None


def _apt_install() -> None:
    """Debian's chromium, installed as root with apt-get (one session at a time)."""
    apt = shutil.which("apt-get")
    if apt is None or os.geteuid() != 0:
        why = "no apt-get" if apt is None else "not root, so it cannot apt-get install it"
        pytest.fail(f"{FIX} ({why})", pytrace=False)
    lock = Path(tempfile.gettempdir()) / "unbroken-tests-chromium.lock"
    with lock.open("w") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        if _found() is not None:
            return  # another session installed it meanwhile
        env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
        wait = ("-o", "DPkg::Lock::Timeout=600")
        for cmd in ([apt, *wait, "update", "-q"], [apt, *wait, "install", "-y", "-q", "chromium"]):
            print(f"browserfix: {' '.join(cmd)}", flush=True)
            try:
                done = subprocess.run(
                    cmd, env=env, capture_output=True, text=True, timeout=APT_TIMEOUT_S
                )
            except subprocess.TimeoutExpired:
                pytest.fail(f"{FIX} ({' '.join(cmd[-2:])} timed out)", pytrace=False)
            if done.returncode != 0:
                last = (done.stderr.strip().splitlines() or ["?"])[-1]
                pytest.fail(f"{FIX} ({cmd[-1]} failed: {last})", pytrace=False)


def chromium_binary() -> str:
    """The browser to drive; installs Debian's when it is missing and we may (see above)."""
    path = _found()
    if path is None:
        _apt_install()
        path = _found()
    if path is None or not os.access(path, os.X_OK):
        pytest.fail(f"{path or 'chromium'} is not executable; {FIX}", pytrace=False)
    return path


class Browser:
    """One headless Chromium and its first page, over the DevTools protocol."""

    def __init__(self, binary: str, profile: Path) -> None:
        self.binary = binary
        self.profile = profile
        self.proc: asyncio.subprocess.Process | None = None
        self.ws: Any = None
        self._ids = itertools.count(1)
        self._waiting: dict[int, asyncio.Future[dict[str, Any]]] = {}
        self._reader: asyncio.Task[None] | None = None
        #: what the page threw (Runtime.exceptionThrown), as one-line descriptions
        self.exceptions: list[str] = []
        #: console and browser log lines at level error (CSP violations among them)
        self.errors: list[str] = []

    async def __aenter__(self) -> Browser:
        self.proc = await asyncio.create_subprocess_exec(
            self.binary,
            *FLAGS,
            f"--user-data-dir={self.profile}",
            "about:blank",
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        port = await self._port()
        async with (
            aiohttp.ClientSession() as http,
            http.get(f"http://127.0.0.1:{port}/json/list") as r,
        ):
            targets = await r.json()
        page = next(t for t in targets if t.get("type") == "page")
        self.ws = await websockets.connect(
            page["webSocketDebuggerUrl"], max_size=64 * 1024 * 1024, ping_interval=None
        )
        self._reader = asyncio.ensure_future(self._read())
        for domain in ("Page", "Runtime", "Log"):
            await self.send(f"{domain}.enable")
        width, height = VIEWPORT
        await self.send(
            "Emulation.setDeviceMetricsOverride",
            {"width": width, "height": height, "deviceScaleFactor": 1, "mobile": False},
        )
        return self

    async def _port(self) -> int:
        """The DevTools port Chromium picked (it writes it into the profile)."""
        active = self.profile / "DevToolsActivePort"
        deadline = time.monotonic() + 60
        while True:
            if active.exists():
                first = active.read_text().split("\n", 1)[0].strip()
                if first.isdigit():
                    return int(first)
            assert self.proc is not None
            if self.proc.returncode is not None:
                pytest.fail(f"chromium exited with {self.proc.returncode}", pytrace=False)
            if time.monotonic() > deadline:
                pytest.fail("chromium did not open its DevTools port in 60 s", pytrace=False)
            await asyncio.sleep(0.05)

    async def _read(self) -> None:
        async for raw in self.ws:
            msg = json.loads(raw)
            if "id" in msg:
                fut = self._waiting.pop(msg["id"], None)
                if fut is not None and not fut.done():
                    fut.set_result(msg)
                continue
            method, params = msg.get("method"), msg.get("params", {})
            if method == "Runtime.exceptionThrown":
                details = params.get("exceptionDetails", {})
                self.exceptions.append(
                    str(details.get("exception", {}).get("description") or details.get("text"))
                )
            elif method == "Log.entryAdded" and params["entry"].get("level") == "error":
                entry = params["entry"]
                self.errors.append(f"{entry.get('source')}: {entry.get('text')}")
            elif method == "Runtime.consoleAPICalled" and params.get("type") == "error":
                self.errors.append(f"console: {params.get('args')}")

    async def send(self, method: str, params: dict[str, Any] | None = None) -> dict[str, Any]:
        n = next(self._ids)
        fut: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        self._waiting[n] = fut
        await self.ws.send(json.dumps({"id": n, "method": method, "params": params or {}}))
        async with asyncio.timeout(30):
            msg = await fut
        if "error" in msg:
            raise AssertionError(f"{method}: {msg['error']}")
        result: dict[str, Any] = msg.get("result", {})
        return result

    async def navigate(self, url: str) -> None:
        await self.send("Page.navigate", {"url": url})
        await self.wait_for("document.readyState === 'complete'")

    async def evaluate(self, expression: str) -> Any:
        got = await self.send("Runtime.evaluate", {"expression": expression, "returnByValue": True})
        if "exceptionDetails" in got:
            raise AssertionError(f"{expression}: {got['exceptionDetails'].get('text')}")
        return got["result"].get("value")

    async def wait_for(self, condition: str, cap: float = 30.0) -> Any:
        """Polls ``condition`` (JavaScript) until it is truthy; its value."""
        deadline = time.monotonic() + cap
        while True:
            value = await self.evaluate(condition)
            if value:
                return value
            if time.monotonic() > deadline:
                raise AssertionError(f"not true within {cap:g} s: {condition}")
            await asyncio.sleep(0.05)

    async def screenshot(self, path: Path) -> bytes:
        """The whole page (as wide as `VIEWPORT`, as tall as its content) as PNG."""
        size = (await self.send("Page.getLayoutMetrics"))["cssContentSize"]
        clip = {"x": 0, "y": 0, "width": VIEWPORT[0], "height": size["height"], "scale": 1}
        got = await self.send(
            "Page.captureScreenshot",
            {"format": "png", "clip": clip, "captureBeyondViewport": True},
        )
        data = base64.b64decode(got["data"])

        def write() -> None:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(data)

        await asyncio.to_thread(write)
        return data

    async def __aexit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if self.ws is not None:
            await self.ws.close()
        if self._reader is not None:
            self._reader.cancel()
        if self.proc is not None:
            if self.proc.returncode is None:
                self.proc.terminate()
            try:
                async with asyncio.timeout(10):
                    await self.proc.wait()
            except TimeoutError:
                self.proc.kill()
                await self.proc.wait()
