"""The floor for bench/http_bench.py: a bare aiohttp pass-through proxy.

One aiohttp server and one aiohttp ClientSession; every request
``/<route>/<rest>`` is sent to ``UPSTREAM/<rest>`` and the upstream bytes are
streamed back with ``iter_any`` as they arrive.  No retry, no SSE parsing, no
ledger, no timers: whatever unbroken costs above this is the price of its logic.

    python bench/bare_proxy.py --upstream http://127.0.0.1:PORT [--port 0]

Prints ``bare proxy listening on http://127.0.0.1:PORT`` once ready; exits on
SIGINT/SIGTERM.  Loopback only.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import signal

import aiohttp
from aiohttp import web

from unbroken.relay.upstream import HOP_BY_HOP  # the same RFC 9110 list the relay drops

_DROP_REQUEST = HOP_BY_HOP | {"host", "content-length"}
_DROP_RESPONSE = HOP_BY_HOP | {"content-length", "date", "server"}

SESSION_KEY = web.AppKey("session", aiohttp.ClientSession)
UPSTREAM_KEY = web.AppKey("upstream", str)


async def _proxy(request: web.Request) -> web.StreamResponse:
    session = request.app[SESSION_KEY]
    url = f"{request.app[UPSTREAM_KEY]}/{request.match_info['rest']}"
    if request.query_string:
        url = f"{url}?{request.query_string}"
    body = await request.read()
    headers = {k: v for k, v in request.headers.items() if k.lower() not in _DROP_REQUEST}
    async with session.request(
        request.method, url, headers=headers, data=body, allow_redirects=False
    ) as up:
        resp = web.StreamResponse(
            status=up.status,
            headers={k: v for k, v in up.headers.items() if k.lower() not in _DROP_RESPONSE},
        )
        await resp.prepare(request)
        async for chunk in up.content.iter_any():
            await resp.write(chunk)
        await resp.write_eof()
        return resp


async def _main(upstream: str, host: str, port: int) -> None:
    session = aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=0),
        auto_decompress=False,
        timeout=aiohttp.ClientTimeout(total=None),
        skip_auto_headers=("User-Agent", "Content-Type"),
    )
    app = web.Application(client_max_size=2**30)
    app[SESSION_KEY] = session
    app[UPSTREAM_KEY] = upstream.rstrip("/")
    app.router.add_route("*", r"/{route}/{rest:.*}", _proxy)
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None, shutdown_timeout=1.0)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    await site.start()
    bound = next(a for a in runner.addresses if isinstance(a, tuple))
    print(f"bare proxy listening on http://{host}:{bound[1]}", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError, RuntimeError):
            loop.add_signal_handler(sig, stop.set)
    try:
        await stop.wait()
    finally:
        await runner.cleanup()
        await session.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--upstream", required=True, help="base URL, e.g. http://127.0.0.1:4781")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0)
    args = parser.parse_args()
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(_main(args.upstream, args.host, args.port))


if __name__ == "__main__":
    main()
