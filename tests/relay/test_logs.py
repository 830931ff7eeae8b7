"""Clean logs (issue 10): a canary key in malformed requests appears nowhere.

Review: a header line with a control character was logged whole at ERROR, key
included (``Authorization: Bearer sk-...\\x01``), and so were body bytes
(``Data after Connection: close: b'{"model": ...'``); ordinary client aborts
printed tracebacks.  Here a real ``unbroken serve`` (verbose on, journal on)
gets a battery of malformed requests carrying a canary key; the canary must not
be in its stdout or stderr, the journal, ``/status``, ``/metrics`` or
``unbroken stats --json``, and no traceback may be printed.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import sys
from pathlib import Path

import aiohttp

from servefix import serve_subprocess
from unbroken.mock import MockProvider
from unbroken.relay.logfilter import SafeLogFilter

CANARY = "sk-canary-9c1f2e7d5b3a"
INJECTED = "sk-injected-canary-44aa55bb66"
TOKEN = "tok-canary-log-0123456789"
CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True}


def _malformed(port: int) -> list[bytes]:
    host = f"127.0.0.1:{port}"
    close = "Connection: close\r\n"
    auth = f"x-unbroken-token: {TOKEN}\r\n{close}"
    post = f"POST /mock/v1/chat/completions HTTP/1.1\r\nHost: {host}\r\n{auth}"
    body = json.dumps({"model": CANARY}).encode()
    return [
        # a control character in a header value
        f"{post}Authorization: Bearer {CANARY}\x01\r\nContent-Length: 0\r\n\r\n".encode(),
        f"{post}Authorization: Bearer {CANARY}\r\nX-Bad\x7f: {CANARY}\r\n\r\n".encode(),
        # body bytes after Connection: close
        f"{post}Content-Length: 2\r\n\r\n{{}}".encode() + body,
        # broken chunked body
        f"{post}Transfer-Encoding: chunked\r\n\r\nzz\r\n{CANARY}\r\n0\r\n\r\n".encode(),
        # an over-long header line
        f"{post}X-Big: {CANARY}{'a' * 9000}\r\n\r\n".encode(),
        # a bad method, a bad version, a bad Content-Length
        f"{CANARY} /mock/v1/x HTTP/1.1\r\nHost: {host}\r\n{close}\r\n".encode(),
        f"POST /mock/v1/x HTTP/{CANARY}\r\nHost: {host}\r\n{close}\r\n".encode(),
        f"{post}Content-Length: {CANARY}\r\n\r\n".encode(),
        # the canary in a bad request-target, a foreign Host, a wrong token, an Origin
        f"POST /mock/v1/{CANARY}%00 HTTP/1.1\r\nHost: {host}\r\n{auth}\r\n".encode(),
        f"POST /mock/v1/x HTTP/1.1\r\nHost: {CANARY}.evil:{port}\r\n{close}\r\n".encode(),
        f"POST /mock/v1/x HTTP/1.1\r\nHost: {host}\r\nx-unbroken-token: {CANARY}\r\n"
        f"{close}\r\n".encode(),
        f"POST /t/{CANARY}/mock/v1/x HTTP/1.1\r\nHost: {host}\r\n{close}\r\n".encode(),
        f"{post}Origin: https://{CANARY}.example\r\nContent-Length: 0\r\n\r\n".encode(),
        # a valid request line, then garbage
        f"{post}\r\n".encode() + f"GARBAGE {CANARY}\r\n\r\n".encode(),
        b"\x16\x03\x01\x02\x00" + CANARY.encode(),  # TLS to the HTTP port
    ]


async def _send_raw(port: int, data: bytes) -> None:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(data)
        await writer.drain()
        async with asyncio.timeout(5):
            while await reader.read(65536):
                pass
    except (ConnectionError, TimeoutError):
        pass
    finally:
        writer.close()


async def test_canary_key_appears_nowhere(mock: MockProvider, tmp_path: Path) -> None:
    cfg = tmp_path / "c.toml"
    cfg.write_text(
        "[server]\nheader_read_timeout_s = 2\n"
        f'[routes.mock]\nupstreams = [{{ url = "{mock.url}" }}, '
        f'{{ url = "{mock.url}", api_key_env = "INJ" }}]\n'
        "[retry]\ndelay_ms = 5\nverbose = true\n"
    )
    env = {"XDG_STATE_HOME": str(tmp_path / "state"), "INJ": INJECTED, "UNBROKEN_TOKEN": TOKEN}
    served = await serve_subprocess(cfg, env=env)
    port, base = served.port, served.url
    ok = {"x-unbroken-token": TOKEN}
    try:
        for data in _malformed(port):
            await _send_raw(port, data)
        timeout = aiohttp.ClientTimeout(total=30)
        async with aiohttp.ClientSession(timeout=timeout) as s:
            # retries with the canary as the client's key (logged while verbose)
            mock.script(
                [
                    {"status": 503},
                    {"fault": "close_before_headers"},
                    {"fault": "reset", "after_frame": 1},
                ]
            )
            async with s.post(
                f"{base}/mock/v1/chat/completions",
                json=CHAT,
                headers={**ok, "Authorization": f"Bearer {CANARY}"},
            ) as r:
                assert r.status == 200
                await r.read()
            # a client that goes away mid-stream
            mock.script([{"chunk_delay_ms": 200, "deltas": 20}])
            async with s.post(
                f"{base}/mock/v1/chat/completions",
                json=CHAT,
                headers={**ok, "Authorization": f"Bearer {CANARY}"},
            ) as r:
                await r.content.readany()
            # an upstream error answer that echoes the injected key
            mock.script(
                [
                    {
                        "status": 400,
                        "body": json.dumps(
                            {"error": {"message": f"bad key {INJECTED} / {CANARY}"}}
                        ),
                    }
                ]
            )
            async with s.post(f"{base}/mock/v1/chat/completions", json=CHAT, headers=ok) as r:
                await r.read()
            async with s.get(f"{base}/status", headers=ok) as r:
                status = await r.text()
            async with s.get(f"{base}/metrics", headers=ok) as r:
                metrics = await r.text()
    finally:
        _, err = await served.stop(within_s=60)
    logs = served.ready + served.out + err
    journal = b"".join(p.read_bytes() for p in (tmp_path / "state").rglob("*") if p.is_file())
    stats = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "unbroken",
        "stats",
        "--json",
        "--since",
        "all",
        "--journal",
        str(next((tmp_path / "state").rglob("journal.sqlite3"))),
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        env=served.env,
    )
    stats_out, stats_err = await asyncio.wait_for(stats.communicate(), 60)
    assert stats.returncode == 0, stats_err
    assert json.loads(stats_out)  # a real report

    for where, text in (
        ("logs", logs),
        ("status", status),
        ("metrics", metrics),
        ("stats", stats_out.decode() + stats_err.decode()),
    ):
        for secret in (CANARY, INJECTED, TOKEN):
            assert secret not in text, (where, secret)
    for secret in (CANARY, INJECTED, TOKEN):
        assert secret.encode() not in journal, secret
    assert "Traceback" not in logs
    # what the logs keep: the error class and the peer address, one line each
    errors = [line for line in logs.splitlines() if "Error handling request" in line]
    assert errors, logs
    assert all("127.0.0.1" in line and re.search(r"\(\w+\)", line) for line in errors), errors
    assert "retry route=mock" in logs  # verbose logging still says what happened


def test_filter_turns_client_aborts_into_info_lines() -> None:
    class ClientGone(Exception):
        pass

    try:
        raise ClientGone()
    except ClientGone:
        record = logging.LogRecord(
            "aiohttp.server",
            logging.ERROR,
            __file__,
            1,
            "Error handling request from %s",
            ("127.0.0.1",),
            sys.exc_info(),
        )
    assert SafeLogFilter().filter(record)
    assert record.levelno == logging.INFO and record.exc_info is None
    assert record.getMessage() == (
        "client went away: Error handling request from 127.0.0.1 (ClientGone)"
    )


def test_filter_drops_bytes_and_unsafe_arguments() -> None:
    record = logging.LogRecord(
        "aiohttp.server",
        logging.ERROR,
        __file__,
        1,
        "Data after close: %r from %s %s",
        (f"b'{CANARY}'", "10.0.0.7", f"Authorization: Bearer {CANARY}"),
        None,
    )
    assert SafeLogFilter().filter(record)
    text = record.getMessage()
    assert CANARY not in text and "10.0.0.7" in text
    record = logging.LogRecord(
        "aiohttp.server",
        logging.ERROR,
        __file__,
        1,
        f"Bad line b'{CANARY}\\n' more\nsecond line",
        (),
        None,
    )
    assert SafeLogFilter().filter(record)
    assert CANARY not in record.getMessage() and "\n" not in record.getMessage()


def _record(exc: BaseException) -> logging.LogRecord:
    try:
        raise exc
    except BaseException:
        return logging.LogRecord(
            "aiohttp.server",
            logging.ERROR,
            __file__,
            1,
            "Error handling request from %s",
            ("127.0.0.1",),
            sys.exc_info(),
        )


def test_malformed_requests_are_one_line_a_minute_and_real_errors_stay() -> None:
    from aiohttp.http_exceptions import BadHttpMessage, LineTooLong

    now = [1000.0]
    f = SafeLogFilter(clock=lambda: now[0])
    first = _record(BadHttpMessage("bad"))
    assert f.filter(first) and first.levelno == logging.WARNING
    assert first.getMessage().startswith("Error handling request from 127.0.0.1 (BadHttpMessage)")
    assert not any(f.filter(_record(LineTooLong("x", "8190"))) for _ in range(500))
    for _ in range(3):  # a real server error is never rate-limited
        real = _record(RuntimeError("boom"))
        assert f.filter(real) and real.levelno == logging.ERROR
        assert real.getMessage() == "Error handling request from 127.0.0.1 (RuntimeError)"
    now[0] += 60
    later = _record(BadHttpMessage("bad"))
    assert f.filter(later) and "500 more since the last report" in later.getMessage()


async def test_a_flood_of_malformed_requests_is_not_a_flood_of_log_lines(tmp_path: Path) -> None:
    cfg = tmp_path / "c.toml"
    cfg.write_text('[routes.mock]\nupstreams = [{ url = "http://127.0.0.1:9" }]\n')
    served = await serve_subprocess(cfg, env={"XDG_STATE_HOME": str(tmp_path / "state")})
    port = served.port
    try:
        for i in range(60):
            await _send_raw(port, [b"GARBAGE\x01\r\n\r\n", b"GET / HTTP/1.1\r\nBad\r\n\r\n"][i % 2])
        async with aiohttp.ClientSession() as s, s.get(f"http://127.0.0.1:{port}/healthz") as r:
            assert r.status == 200  # served on
    finally:
        _, err = await served.stop(within_s=60)
    lines = [line for line in err.splitlines() if "aiohttp" in line]
    assert len(lines) == 1, lines
    assert "WARNING" in lines[0] and "malformed request" in lines[0]
