"""Issue 25: no key without a right to it, and no key in any body the relay forwards.

A route that injects a key (``api_key_env``) serves only requests that carry the
relay's token: the configured one, or the one `unbroken serve` keeps for its owner
in a 0600 file (`unbroken.relay.tokenfile`).  Routes where the client brings its
own key stay open on loopback.  Any body answering a request that carried the
relay's key is redacted, streamed or not, across chunk boundaries.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import random
import re
import shutil
import stat
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web

from relayfix import KEY_AUTH, KEY_TOKEN, make_config, start_relay
from unbroken.config import parse_config
from unbroken.core.wire.redact import REDACTED, Redactor, redact
from unbroken.mock import MockProvider

KEY = "sk-injected-key-0123456789abcdef"
CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


def _stranger(argv: list[str]) -> list[str]:
    """``argv`` run as another Unix user (``nobody``) when this test runs as root with
    setpriv; otherwise as this user, which proves the same check: a process that
    does not hold the token (the relay cannot tell users apart on loopback)."""
    if os.geteuid() == 0 and shutil.which("setpriv"):
        return ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", *argv]
    return argv


async def _exec(argv: list[str]) -> tuple[int, str, str]:
    proc = await asyncio.create_subprocess_exec(
        *argv, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE
    )
    out, err = await asyncio.wait_for(proc.communicate(), 30)
    assert proc.returncode is not None
    return proc.returncode, out.decode(), err.decode()


def _curl(url: str, *headers: str) -> list[str]:
    argv = ["curl", "-sS", "-o", "-", "-w", "\n%{http_code}", "-X", "POST", url]
    for h in ("content-type: application/json", *headers):
        argv += ["-H", h]
    return [*argv, "--data", json.dumps(CHAT)]


class _Serve:
    """`unbroken serve` in a subprocess, its owner's state directory in ``state``."""

    def __init__(self, proc: asyncio.subprocess.Process, url: str) -> None:
        self.proc, self.url = proc, url

    @classmethod
    async def start(cls, config: Path, state: Path, **env: str) -> _Serve:
        full = {k: v for k, v in os.environ.items() if not k.startswith("UNBROKEN_")}
        full.update(XDG_STATE_HOME=str(state), **env)
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "unbroken",
            "serve",
            "--config",
            str(config),
            "--port",
            "0",
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            env=full,
        )
        assert proc.stdout is not None
        line = (await asyncio.wait_for(proc.stdout.readline(), 30)).decode()
        m = re.search(r"(http://\S+)", line)
        if m is None:
            _, err = await proc.communicate()
            raise AssertionError(f"no ready line: {line!r} {err.decode()!r}")
        return cls(proc, m.group(1))

    async def stop(self) -> str:
        if self.proc.returncode is None:
            self.proc.terminate()
        _, err = await asyncio.wait_for(self.proc.communicate(), 30)
        return err.decode()


def _two_routes(tmp_path: Path, url: str) -> Path:
    cfg = tmp_path / "c.toml"
    cfg.write_text(
        f'[routes.keyed]\nupstreams = [{{ url = "{url}", api_key_env = "KEYED_KEY" }}]\n'
        f'[routes.open]\nupstreams = [{{ url = "{url}" }}]\n'
    )
    return cfg


# -- a local stranger ------------------------------------------------------------------------


async def test_a_local_stranger_cannot_spend_the_key(mock: MockProvider, tmp_path: Path) -> None:
    """Review: with no token (the loopback default), ``setpriv --reuid=nobody curl
    .../route/...`` got the upstream to see the injected key."""
    state = tmp_path / "state"
    served = await _Serve.start(_two_routes(tmp_path, mock.url), state, KEYED_KEY=KEY)
    token_file = state / "unbroken" / "token"
    try:
        # the stranger: no token, so 401 (JSON), and the provider sees nothing
        code, out, err = await _exec(_stranger(_curl(f"{served.url}/keyed/v1/chat/completions")))
        body, status = out.rsplit("\n", 1)
        assert (code, status) == (0, "401"), err
        assert json.loads(body)["error"]["code"] == "unauthorized"
        assert mock.requests == []
        # ... nor can read the token (a 0600 file in a 0700 directory of the owner's)
        assert stat.S_IMODE(token_file.stat().st_mode) == 0o600
        assert stat.S_IMODE(token_file.parent.stat().st_mode) == 0o700
        if os.geteuid() == 0:
            code, out, _ = await _exec(_stranger(["cat", str(token_file)]))
            assert code != 0 and out == ""
        # a route where the client brings its own key stays open on loopback
        code, out, _ = await _exec(
            _stranger(
                _curl(f"{served.url}/open/v1/chat/completions", "authorization: Bearer sk-own")
            )
        )
        assert out.rsplit("\n", 1)[1] == "200"
        assert mock.requests[-1].headers["Authorization"] == "Bearer sk-own"
        # the owner, with the token from the file: the key is injected
        token = token_file.read_text().strip()
        for url, auth in (
            (f"{served.url}/keyed/v1/chat/completions", (f"x-unbroken-token: {token}",)),
            (f"{served.url}/t/{token}/keyed/v1/chat/completions", ()),
        ):
            code, out, _ = await _exec(_curl(url, *auth))
            assert out.rsplit("\n", 1)[1] == "200"
            assert mock.requests[-1].headers["Authorization"] == f"Bearer {KEY}"
        assert len(mock.requests) == 3
    finally:
        err = await served.stop()
    # the log says where the token is, never the token or the key
    assert str(token_file) in err and "created" in err
    assert token not in err and KEY not in err


async def test_the_token_file_is_kept_across_starts(mock: MockProvider, tmp_path: Path) -> None:
    state = tmp_path / "state"
    cfg = _two_routes(tmp_path, mock.url)
    first = await _Serve.start(cfg, state, KEYED_KEY=KEY)
    err = await first.stop()
    token = (state / "unbroken" / "token").read_text()
    second = await _Serve.start(cfg, state, KEYED_KEY=KEY)
    err = await second.stop()
    assert "(kept, mode 0600)" in err
    assert (state / "unbroken" / "token").read_text() == token
    # a configured token is used instead, and no file is made
    other = tmp_path / "other"
    third = await _Serve.start(cfg, other, KEYED_KEY=KEY, UNBROKEN_TOKEN="t" * 24)
    await third.stop()
    assert not (other / "unbroken" / "token").exists()


async def test_a_token_file_others_can_read_stops_serve_with_one_line(
    mock: MockProvider, tmp_path: Path
) -> None:
    state = tmp_path / "state"
    path = state / "unbroken" / "token"
    path.parent.mkdir(parents=True)
    path.write_text("x" * 32 + "\n")
    path.chmod(0o644)
    full = {k: v for k, v in os.environ.items() if not k.startswith("UNBROKEN_")}
    full.update(XDG_STATE_HOME=str(state), KEYED_KEY=KEY)
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "unbroken",
        "serve",
        "--config",
        str(_two_routes(tmp_path, mock.url)),
        "--port",
        "0",
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        env=full,
    )
    _, err = await asyncio.wait_for(proc.communicate(), 30)
    lines = err.decode().strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1, lines
    assert "readable by others" in lines[0] and "x" * 32 not in lines[0]


def test_load_or_create(tmp_path: Path) -> None:
    from unbroken.relay.tokenfile import TokenFileError, load_or_create

    path = tmp_path / "s" / "unbroken" / "token"
    token, created = load_or_create(path)
    assert created and re.fullmatch(r"[A-Za-z0-9_-]{40,}", token)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert load_or_create(path) == (token, False)
    assert [p.name for p in path.parent.iterdir()] == ["token"]  # no temporary file left
    path.write_text("short\n")
    with pytest.raises(TokenFileError, match="does not hold a token"):
        load_or_create(path)
    path.unlink()
    path.symlink_to(tmp_path / "elsewhere")
    with pytest.raises(TokenFileError, match="cannot read"):
        load_or_create(path)


# -- in-process: the access rule ------------------------------------------------------------


async def test_keyed_route_needs_the_token_and_fails_closed_without_one(mock: MockProvider) -> None:
    data = {
        "routes": {
            "keyed": {"upstreams": [{"url": mock.url, "api_key_env": "K"}]},
            "open": {"upstreams": [mock.url]},
        }
    }
    cfg = make_config([mock.url])
    cfg = dataclasses.replace(cfg, routes=parse_config(data, env={"K": KEY}).routes)
    assert cfg.injects_keys and cfg.key_token is None and cfg.token is None
    for key_token in (None, KEY_TOKEN):
        server, _ = await start_relay(dataclasses.replace(cfg, key_token=key_token))
        try:
            async with aiohttp.ClientSession() as s:
                for path, headers, want in (
                    ("/keyed/v1/chat/completions", {}, 401),
                    ("/keyed/v1/chat/completions", {"x-unbroken-token": "wrong" * 5}, 401),
                    ("/keyed/v1/chat/completions", KEY_AUTH, 200 if key_token else 401),
                    (f"/t/{KEY_TOKEN}/keyed/v1/chat/completions", {}, 200 if key_token else 401),
                    ("/open/v1/chat/completions", {}, 200),
                    ("/status", {}, 200),
                ):
                    async with s.request(
                        "GET" if path == "/status" else "POST",
                        server.url + path,
                        json=CHAT,
                        headers=headers,
                    ) as r:
                        assert r.status == want, (key_token, path, headers)
                        if want == 401:
                            err = (await r.json())["error"]
                            assert err["type"] == "authentication_error"
                            assert "x-unbroken-token" in err["message"]
                        await r.read()
        finally:
            await server.stop()
    keyed = [r for r in mock.requests if r.headers.get("Authorization") == f"Bearer {KEY}"]
    assert len(keyed) == 2  # only the two requests that carried the token


async def test_a_keyed_websocket_needs_the_token(mock: MockProvider) -> None:
    server, _ = await start_relay(
        make_config([{"url": mock.url, "api_key_env": "K"}], env={"K": KEY})
    )
    url = server.url.replace("http://", "ws://") + "/mock/v1/responses"
    try:
        async with aiohttp.ClientSession() as s:
            with pytest.raises(aiohttp.WSServerHandshakeError) as info:
                await s.ws_connect(url)
            assert info.value.status == 401
            assert mock.upgrades == []
            async with s.ws_connect(url, headers=KEY_AUTH) as ws:
                await ws.close()
    finally:
        await server.stop()


# -- redaction of every body a keyed request gets ---------------------------------------------


class _Echo:
    """An upstream that echoes the credential it was sent, in a 200 JSON body or an SSE
    stream cut into small writes (a secret may straddle two reads)."""

    def __init__(self) -> None:
        self.runner: web.AppRunner | None = None
        self.url = ""

    async def handle(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        key = request.headers.get("Authorization", "").removeprefix("Bearer ")
        if not body.get("stream"):
            return web.json_response({"choices": [{"message": {"content": f"your key: {key}"}}]})
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        frame = json.dumps({"choices": [{"delta": {"content": f"key={key}!"}}]})
        data = f"data: {frame}\n\ndata: [DONE]\n\n".encode()
        cut = data.index(key.encode()) + len(key) // 2 if key else 7
        for piece in (data[:cut], data[cut : cut + 3], data[cut + 3 :]):
            await resp.write(piece)
        await resp.write_eof()
        return resp

    async def __aenter__(self) -> _Echo:
        app = web.Application()
        app.router.add_post("/{tail:.*}", self.handle)
        self.runner = web.AppRunner(app)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        self.url = f"http://127.0.0.1:{self.runner.addresses[0][1]}"
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self.runner is not None
        await self.runner.cleanup()


@pytest.fixture
async def echo() -> AsyncIterator[_Echo]:
    async with _Echo() as e:
        yield e


@pytest.mark.parametrize("stream", [False, True])
async def test_a_key_echoed_in_a_successful_answer_is_redacted(echo: _Echo, stream: bool) -> None:
    """Review: keys echoed in successful bodies were not redacted (only error answers)."""
    server, _ = await start_relay(
        make_config([{"url": echo.url, "api_key_env": "K"}], env={"K": KEY})
    )
    try:
        async with (
            aiohttp.ClientSession(headers=KEY_AUTH) as s,
            s.post(f"{server.url}/mock/v1/chat/completions", json={**CHAT, "stream": stream}) as r,
        ):
            got = await r.read()
            assert r.status == 200
    finally:
        await server.stop()
    assert KEY.encode() not in got and REDACTED.encode() in got
    if stream:
        assert got.endswith(b"data: [DONE]\n\n") and got.count(b"\n\n") == 2
    else:
        assert json.loads(got)["choices"][0]["message"]["content"] == f"your key: {REDACTED}"


async def test_without_an_injected_key_the_body_passes_untouched(echo: _Echo) -> None:
    """A route where the client brings its own key: its answers are not scanned (the
    client knows its own key), and the length stays."""
    server, _ = await start_relay(make_config([{"url": echo.url}], env={}))
    try:
        async with (
            aiohttp.ClientSession() as s,
            s.post(
                f"{server.url}/mock/v1/chat/completions",
                json=CHAT,
                headers={"Authorization": f"Bearer {KEY}"},
            ) as r,
        ):
            got = await r.read()
            assert r.headers.get("Content-Length") == str(len(got))
    finally:
        await server.stop()
    assert KEY.encode() in got


async def test_a_key_echoed_over_a_websocket_is_redacted(mock: MockProvider) -> None:
    """A Responses WebSocket on a keyed route: a message that echoes the key (not an
    error) reaches the client redacted."""
    cfg = make_config([{"url": mock.url, "api_key_env": "K"}], env={"K": KEY})
    server, _ = await start_relay(cfg)
    url = server.url.replace("http://", "ws://") + "/mock/v1/responses"
    mock.script([{"text": f"the key is {KEY} indeed", "deltas": 1}])
    got: list[str] = []
    try:
        async with aiohttp.ClientSession() as s, s.ws_connect(url, headers=KEY_AUTH) as ws:
            create = {"type": "response.create", "model": "m", "input": "hi", "store": False}
            await ws.send_str(json.dumps(create))
            while not got or json.loads(got[-1])["type"] != "response.completed":
                got.append((await ws.receive(timeout=10)).data)
    finally:
        await server.stop()
    assert mock.upgrades[0].headers["Authorization"] == f"Bearer {KEY}"
    assert not [m for m in got if KEY in m]
    assert [m for m in got if REDACTED in m]


def test_the_redactor_finds_a_secret_across_any_cut() -> None:
    """Random bodies of secrets, their prefixes and plain bytes, cut anywhere: the
    output is `redact` of the whole body, and a chunk that cannot begin a secret goes
    out whole (an SSE event is not held back)."""
    keys = [KEY, KEY[:12], KEY_TOKEN]
    rng = random.Random(25)
    for _ in range(3000):
        parts = [
            rng.choice(
                ["data: x\n\n", *keys, "sk-in", "\n", *(k[: rng.randint(1, len(k))] for k in keys)]
            )
            for _ in range(rng.randint(0, 8))
        ]
        body = "".join(parts).encode()
        cuts = sorted(rng.sample(range(len(body) + 1), min(len(body) + 1, rng.randint(0, 6))))
        chunks = [body[a:b] for a, b in zip([0, *cuts], [*cuts, len(body)], strict=True)]
        r = Redactor(keys)
        out = b"".join(r.feed(c) for c in chunks) + r.flush()
        assert out == redact(body, keys), (body, chunks)
    r = Redactor([KEY])
    assert r.feed(b"data: {}\n\n") == b"data: {}\n\n"
    assert r.feed(b"data: sk-inj") == b"data: "
    assert r.feed(KEY[6:].encode() + b"\n\n") == REDACTED.encode() + b"\n\n"


def test_the_redaction_benchmark_runs() -> None:
    """``bench/redact_cost.py`` (the figure docs/security.md gives) keeps working."""
    import subprocess

    bench = Path(__file__).resolve().parents[2] / "bench" / "redact_cost.py"
    done = subprocess.run(
        [sys.executable, str(bench), "--quick"], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert re.search(r"\+-?\d+ ns per chunk when a key is injected", done.stdout), done.stdout
