"""Issue 25: secrets in URLs stay secret.

A path token of an upstream that chains to another unbroken (``/t/<token>/``), a
Redis password in the store URL (userinfo or ``?password=``), the relay's own token
in a client header (a ``Referer``), in ``unbroken status --url`` or in what
``unbroken run --print-env`` prints: none is shown or stored, none goes upstream.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import os
import sqlite3
import subprocess
import sys
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web

from redisfix import RedisServer, free_port
from relayfix import make_config, start_relay
from unbroken.config import JournalSettings, parse_config
from unbroken.core.wire.redact import redact_url
from unbroken.mock import MockProvider

PEER_TOKEN = "peer-token-0123456789abcdef"
TOKEN = "own-token-0123456789abcdef"
PASSWORD = "redis-pass-0123456789"
CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


@pytest.mark.parametrize(
    ("url", "shown"),
    [
        ("https://api.openai.com", "https://api.openai.com"),
        (f"http://peer:4780/t/{PEER_TOKEN}/openai", "http://peer:4780/t/REDACTED/openai"),
        (f"http://peer:4780/t/{PEER_TOKEN}", "http://peer:4780/t/REDACTED"),
        (f"redis://:{PASSWORD}@h:6379/0", "redis://h:6379/0"),
        (
            f"redis://u:{PASSWORD}@h/0?password={PASSWORD}&db=1",
            "redis://h/0?password=REDACTED&db=1",
        ),
        (f"unix:///run/r.sock?password={PASSWORD}", "unix:///run/r.sock?password=REDACTED"),
        (f"redis://h?Token={PASSWORD}#frag", "redis://h?Token=REDACTED"),
    ],
)
def test_redact_url(url: str, shown: str) -> None:
    assert redact_url(url) == shown


async def test_a_chained_upstream_token_is_never_shown_or_stored(
    mock: MockProvider, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Review: a token in an upstream URL's path (chaining to another unbroken's
    ``/t/<token>/``) showed in /status, metric labels and the journal."""
    caplog.set_level(logging.DEBUG)
    # the peer: a relay with a token, which passes a 503 straight back (one attempt)
    peer_cfg = parse_config(
        {"retry": {"max_attempts": 1}, "routes": {"mock": {"upstreams": [mock.url]}}},
        env={"UNBROKEN_TOKEN": PEER_TOKEN},
    )
    peer, _ = await start_relay(
        dataclasses.replace(peer_cfg, port=0, journal=JournalSettings(False))
    )
    path = tmp_path / "journal.sqlite3"
    cfg = make_config([f"{peer.url}/t/{PEER_TOKEN}/mock"], route="chain")
    cfg = dataclasses.replace(cfg, journal=JournalSettings(path=str(path)))
    server, rec = await start_relay(cfg)
    try:
        mock.script([{"status": 503}])
        async with aiohttp.ClientSession() as s:
            async with s.post(f"{server.url}/chain/v1/chat/completions", json=CHAT) as r:
                assert r.status == 200  # the chain works: 503 passed back, retried, 200
                await r.read()
            await rec.wait_turns(1)
            assert server.journal is not None
            await server.journal.flush()
            async with s.get(f"{server.url}/status") as r:
                status = await r.text()
            async with s.get(f"{server.url}/metrics") as r:
                metrics = await r.text()
    finally:
        await server.stop()
        await peer.stop()
    assert len(mock.requests) == 2
    assert "/t/REDACTED/mock" in status and "/t/REDACTED/mock" in metrics
    assert "retry route=chain" in caplog.text and "/t/REDACTED/mock" in caplog.text
    dump = "\n".join(sqlite3.connect(path).iterdump())
    assert "/t/REDACTED/mock" in dump
    for where in (status, metrics, caplog.text, dump):
        assert PEER_TOKEN not in where
    for f in await asyncio.to_thread(lambda: list(tmp_path.iterdir())):
        assert PEER_TOKEN.encode() not in f.read_bytes()


async def test_a_redis_password_in_the_store_url_is_never_shown(
    mock: MockProvider, redis_server: RedisServer, caplog: pytest.LogCaptureFixture
) -> None:
    """Review: a Redis password in the URL's query (``?password=``) showed in /status."""
    import redis

    caplog.set_level(logging.DEBUG)
    client = redis.Redis(host="127.0.0.1", port=redis_server.port)
    client.config_set("requirepass", PASSWORD)
    client.close()
    for store in (
        f"redis://127.0.0.1:{redis_server.port}/0?password={PASSWORD}",
        f"redis://:{PASSWORD}@127.0.0.1:{redis_server.port}/0",
    ):
        cfg = parse_config(
            {"health": {"store": store}, "routes": {"mock": {"upstreams": [mock.url]}}}, env={}
        )
        server, _ = await start_relay(dataclasses.replace(cfg, port=0))
        try:
            async with aiohttp.ClientSession() as s, asyncio.timeout(20):
                while True:  # until the store has connected (with the password)
                    async with s.get(f"{server.url}/status") as r:
                        status = await r.json()
                    if status["store"]["state"] == "ok":
                        break
                    await asyncio.sleep(0.05)
                async with s.get(f"{server.url}/metrics") as r:
                    metrics = await r.text()
        finally:
            await server.stop()
        assert status["store"]["state"] == "ok"  # the password worked
        assert status["store"]["url"] == redact_url(store)
        assert PASSWORD not in json.dumps(status) and PASSWORD not in metrics
    assert PASSWORD not in caplog.text


async def test_the_token_is_cut_from_every_forwarded_header(tmp_path: Path) -> None:
    """Review: a client ``Referer`` carrying the relay's token was forwarded upstream."""
    seen: list[dict[str, str]] = []

    async def handle(request: web.Request) -> web.Response:
        seen.append(dict(request.headers))
        return web.json_response({"ok": True})

    app = web.Application()
    app.router.add_post("/{tail:.*}", handle)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    up = f"http://127.0.0.1:{runner.addresses[0][1]}"
    cfg = parse_config({"routes": {"cap": {"upstreams": [up]}}}, env={"UNBROKEN_TOKEN": TOKEN})
    server, _ = await start_relay(dataclasses.replace(cfg, port=0))
    try:
        async with (
            aiohttp.ClientSession() as s,
            s.post(
                f"{server.url}/t/{TOKEN}/cap/v1/chat/completions",
                json=CHAT,
                headers={
                    "Referer": f"{server.url}/t/{TOKEN}/cap/ui?x=1",
                    "X-Note": f"token={TOKEN}; keep=this",
                },
            ) as r,
        ):
            assert r.status == 200
    finally:
        await server.stop()
        await runner.cleanup()
    (headers,) = seen
    assert TOKEN not in json.dumps(headers)
    assert headers["Referer"] == f"{server.url}/t/REDACTED/cap/ui?x=1"
    assert headers["X-Note"] == "token=REDACTED; keep=this"


def _unbroken(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    full = {k: v for k, v in os.environ.items() if not k.startswith("UNBROKEN_")}
    full.update(env or {})
    return subprocess.run(
        [sys.executable, "-m", "unbroken", *args],
        capture_output=True,
        text=True,
        timeout=60,
        env=full,
        check=False,
    )


async def test_status_url_with_a_token_never_prints_it(mock: MockProvider) -> None:
    """Review: ``unbroken status --url .../t/<token>`` printed the token."""
    cfg = parse_config(
        {"routes": {"mock": {"upstreams": [mock.url]}}}, env={"UNBROKEN_TOKEN": TOKEN}
    )
    server, _ = await start_relay(dataclasses.replace(cfg, port=0))
    try:
        shown = await asyncio.to_thread(
            _unbroken, "status", "--once", "--url", f"{server.url}/t/{TOKEN}"
        )
    finally:
        await server.stop()
    assert shown.returncode == 0, shown.stderr
    assert f"at {server.url}/t/REDACTED " in shown.stdout and "in flight" in shown.stdout
    gone = await asyncio.to_thread(
        _unbroken, "status", "--once", "--url", f"http://127.0.0.1:{free_port()}/t/{TOKEN}/"
    )
    assert gone.returncode == 1 and "/t/REDACTED" in gone.stdout
    bad = await asyncio.to_thread(_unbroken, "status", "--url", f"ftp://h/t/{TOKEN}")
    assert bad.returncode == 2
    for run in (shown, gone, bad):
        assert TOKEN not in run.stdout + run.stderr


HEADERS = "CUSTOM_HEADERS"


async def test_print_env_honours_the_token(mock: MockProvider, tmp_path: Path) -> None:
    """Review: ``unbroken run --print-env`` ignored ``UNBROKEN_TOKEN``: the printed base
    URLs got 401 from a relay with a token.  Claude Code gets it now in its header
    variable (issue 33: not in a base URL a tool could put on its command line), as a
    shell expansion (the value itself is never printed)."""
    port = free_port()
    cfg = tmp_path / "c.toml"
    cfg.write_text(f'[server]\nport = {port}\n[routes.anthropic]\nupstreams = ["{mock.url}"]\n')
    env = {"UNBROKEN_TOKEN": TOKEN, "ANTHROPIC_BASE_URL": mock.url}
    printed = await asyncio.to_thread(
        _unbroken, "run", "--config", str(cfg), "--print-env", "--", "claude", env=env
    )
    assert printed.returncode == 0, printed.stderr
    assert TOKEN not in printed.stdout and "${UNBROKEN_TOKEN}" in printed.stdout
    exports = "\n".join(ln for ln in printed.stdout.splitlines() if ln.startswith("export "))
    shell = await asyncio.to_thread(
        subprocess.run,
        [
            "bash",
            "-c",
            f'{exports}\nprintf "%s\\0%s" "$ANTHROPIC_BASE_URL" "$ANTHROPIC_CUSTOM_HEADERS"',
        ],
        capture_output=True,
        text=True,
        env={**os.environ, "UNBROKEN_TOKEN": TOKEN},
        check=True,
    )
    base, custom = shell.stdout.split("\0")
    assert base == f"http://127.0.0.1:{port}/anthropic"
    assert custom == f"x-unbroken-token: {TOKEN}"
    name, _, value = custom.partition(": ")
    relay = parse_config(
        {"routes": {"anthropic": {"upstreams": [mock.url]}}}, env={"UNBROKEN_TOKEN": TOKEN}
    )
    server, _ = await start_relay(dataclasses.replace(relay, port=port))
    try:
        body = {"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]}
        async with (
            aiohttp.ClientSession() as s,
            s.post(
                f"{base}/v1/messages", json=body, headers={"x-api-key": "sk-own", name: value}
            ) as r,
        ):
            assert r.status == 200
            await r.read()
    finally:
        await server.stop()
    assert mock.requests[-1].path == "/v1/messages"


def test_print_env_reads_serves_token_file_for_a_keyed_route(tmp_path: Path) -> None:
    """No token set, but the agent's route injects a key: `serve` will want its file
    token, so the printed URL reads it from the file (never printing it)."""
    import io

    from unbroken.agents.launcher import print_env

    base = parse_config(
        {
            "routes": {
                "anthropic": {
                    "upstreams": [{"url": "https://api.anthropic.com", "api_key_env": "K"}]
                }
            }
        },
        env={"K": "sk-ant-0123456789abcdef"},
    )
    out = io.StringIO()
    print_env(["claude"], base, {"XDG_STATE_HOME": str(tmp_path)}, out=out)
    path = tmp_path / "unbroken" / "token"
    # in Claude Code's header variable (issue 33), not in its base URL
    assert f"export ANTHROPIC_CUSTOM_HEADERS='x-unbroken-token: '\"$(cat {path})\"\n" in (
        out.getvalue()
    )
    assert "/t/" not in out.getvalue()
    out = io.StringIO()
    print_env(["python"], base, {"XDG_STATE_HOME": str(tmp_path)}, out=out)
    assert f'/t/"$(cat {path})"/anthropic' in out.getvalue()  # no header setting: the URL
    out = io.StringIO()
    print_env(["claude"], parse_config({}, env={}), {"XDG_STATE_HOME": str(tmp_path)}, out=out)
    assert "/t/" not in out.getvalue()  # nothing keyed, no token: the plain URL
