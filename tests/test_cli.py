"""`unbroken serve` as a real process: config errors, env aliases, logs, signals."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import signal
import sys
from pathlib import Path

import aiohttp
import pytest

from unbroken.mock import MockProvider

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True}


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("UNBROKEN_", "OPENCODE_"))}
    env.update(extra)
    return env


async def _run(args: list[str], env: dict[str, str]) -> tuple[int, str, str]:
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "unbroken",
        *args,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        env=env,
    )
    out, err = await asyncio.wait_for(proc.communicate(), 60)
    return proc.returncode or 0, out.decode(), err.decode()


class Served:
    """A `unbroken serve` subprocess; its URL comes from the ready line."""

    def __init__(self, proc: asyncio.subprocess.Process, url: str, view: str) -> None:
        self.proc, self.url = proc, url
        #: the line after the ready line: where the web view is
        self.view = view

    @classmethod
    async def start(cls, config: Path, env: dict[str, str]) -> Served:
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
            env=env,
        )
        assert proc.stdout is not None
        line = (await asyncio.wait_for(proc.stdout.readline(), 30)).decode()
        m = re.search(r"(http://\S+)", line)
        assert m, line
        view = (await asyncio.wait_for(proc.stdout.readline(), 30)).decode()
        return cls(proc, m.group(1), view)

    async def stop(self, *, signal_it: bool = True) -> tuple[int, str]:
        if signal_it and self.proc.returncode is None:
            self.proc.send_signal(signal.SIGTERM)
        _, err = await asyncio.wait_for(self.proc.communicate(), 60)
        return self.proc.returncode or 0, err.decode()


@pytest.mark.parametrize(
    ("toml", "key"),
    [
        ("[retry]\ndelai_ms = 5\n", "retry.delai_ms"),
        ("[retry]\ndelay_ms = 'soon'\n", "retry.delay_ms"),
        ("[routes.x]\nupstreams = [{ url = 'ftp://nope' }]\n", "routes.x.upstreams[0].url"),
        ("[stream]\nhold = ['everything']\n", "stream.hold"),
        ("[bogus]\n", "bogus"),
    ],
)
async def test_invalid_config_exits_2_naming_the_key(tmp_path: Path, toml: str, key: str) -> None:
    cfg = tmp_path / "unbroken.toml"
    cfg.write_text(toml)
    code, out, err = await _run(["serve", "--config", str(cfg), "--port", "0"], _env())
    assert code == 2
    assert key in err
    assert "relaying on" not in out  # nothing started


async def test_config_from_env_var_and_port_flag(tmp_path: Path) -> None:
    cfg = tmp_path / "c.toml"
    cfg.write_text("[retry]\nmax_attempts = 'x'\n")
    code, _, err = await _run(["serve", "--port", "0"], _env(UNBROKEN_CONFIG=str(cfg)))
    assert code == 2 and "retry.max_attempts" in err


async def test_env_alias_invalid_value_is_named() -> None:
    code, _, err = await _run(["serve", "--port", "0"], _env(OPENCODE_RETRY_DELAY_MS="soon"))
    assert code == 2 and "OPENCODE_RETRY_DELAY_MS" in err


async def test_serve_logs_retries_without_secrets_and_exits_0_on_sigterm(
    mock: MockProvider, tmp_path: Path
) -> None:
    canary = "sk-canary-55aa11"
    cfg = tmp_path / "c.toml"
    cfg.write_text(
        f'[routes.mock]\nupstreams = [{{ url = "{mock.url}" }}, '
        f'{{ url = "{mock.url}", api_key_env = "KEY2" }}]\n'
    )
    # the alias sets the delay; the UNBROKEN_ name wins for verbosity
    env = _env(
        KEY2=canary + "-cfg",
        OPENCODE_RETRY_DELAY_MS="7",
        OPENCODE_RETRY_VERBOSE="false",
        UNBROKEN_RETRY_VERBOSE="true",
        XDG_STATE_HOME=str(tmp_path / "state"),
    )
    served = await Served.start(cfg, env)
    # the route injects a key: it needs the token serve keeps for its owner
    token = (tmp_path / "state" / "unbroken" / "token").read_text().strip()
    # that token guards the keyed route only: the web view is open, like /status
    assert served.view == f"web view: {served.url}/ui\n"
    try:
        mock.script([{"status": 503}, {"fault": "close_before_headers"}, {"status": 429}])
        async with (
            aiohttp.ClientSession() as s,
            s.post(
                f"{served.url}/mock/v1/chat/completions",
                json=CHAT,
                headers={"Authorization": f"Bearer {canary}", "x-unbroken-token": token},
            ) as r,
        ):
            assert r.status == 200
            await r.read()
        async with aiohttp.ClientSession() as s, s.get(f"{served.url}/healthz") as r:
            assert (await r.json())["status"] == "ok"
    finally:
        code, err = await served.stop()
    assert code == 0
    retries = [ln for ln in err.splitlines() if "retry route=mock" in ln]
    assert len(retries) == 3
    # delay_ms = 7 with the default backoff (exponential, full jitter): retry n waits
    # 0..7 * 2**(n-1) ms
    for ln in retries:
        n = int(ln.split("attempt=")[1].split()[0])
        assert 0 <= int(ln.split("wait_ms=")[1].split()[0]) <= 7 * 2 ** (n - 1), ln
    assert "reason=503" in err and "reason=429" in err
    assert canary not in err and token not in err


async def test_serve_names_the_web_view_without_printing_the_token(
    mock: MockProvider, tmp_path: Path
) -> None:
    token = "ui-serve-token-0123456789abcdef"
    cfg = tmp_path / "c.toml"
    cfg.write_text(f'[routes.mock]\nupstreams = [{{ url = "{mock.url}" }}]\n')
    env = _env(UNBROKEN_TOKEN=token, XDG_STATE_HOME=str(tmp_path / "state"))
    served = await Served.start(cfg, env)
    try:
        assert served.view == f"web view: {served.url}/t/<token>/ui\n"
        async with aiohttp.ClientSession() as s:
            async with s.get(f"{served.url}/ui") as r:
                assert r.status == 401
            async with s.get(f"{served.url}/t/{token}/ui") as r:
                assert r.status == 200 and r.content_type == "text/html"
    finally:
        code, err = await served.stop()
    assert code == 0 and token not in err


async def test_sigterm_lets_inflight_stream_finish(mock: MockProvider, tmp_path: Path) -> None:
    cfg = tmp_path / "c.toml"
    cfg.write_text(f'[routes.mock]\nupstreams = [{{ url = "{mock.url}" }}]\n')
    served = await Served.start(cfg, _env())
    try:
        action = json.dumps({"deltas": 20, "chunk_delay_ms": 50})
        async with (
            aiohttp.ClientSession() as s,
            s.post(
                f"{served.url}/mock/v1/chat/completions",
                json=CHAT,
                headers={"x-mock-action": action},
            ) as r,
        ):
            first = await r.content.readany()
            assert first
            served.proc.send_signal(signal.SIGTERM)
            rest = await r.read()
        body = first + rest
        assert body.rstrip().endswith(b"data: [DONE]")
    finally:
        code, _ = await served.stop(signal_it=False)
    assert code == 0


async def test_second_signal_cuts_the_grace_period_short(
    mock: MockProvider, tmp_path: Path
) -> None:
    cfg = tmp_path / "c.toml"
    cfg.write_text(f'[routes.mock]\nupstreams = [{{ url = "{mock.url}" }}]\n')
    served = await Served.start(cfg, _env())
    try:
        action = json.dumps({"deltas": 5, "fault": "stall", "after_frame": 2, "seconds": 600})
        async with (
            aiohttp.ClientSession() as s,
            s.post(
                f"{served.url}/mock/v1/chat/completions",
                json=CHAT,
                headers={"x-mock-action": action},
            ) as r,
        ):
            assert r.status == 200  # headers are out only once output was released
            served.proc.send_signal(signal.SIGTERM)
            # the same signal twice in a row may coalesce: wait until the first is handled
            assert served.proc.stderr is not None
            seen = b""
            while b"shutting down" not in seen:
                line = await asyncio.wait_for(served.proc.stderr.readline(), 30)
                assert line, "the relay exited before the second signal"
                seen += line
            served.proc.send_signal(signal.SIGTERM)
            with contextlib.suppress(aiohttp.ClientError):
                await asyncio.wait_for(r.read(), 30)
    finally:
        code, err = await served.stop(signal_it=False)
    assert code == 0
    assert "second signal" in err


async def test_grace_period_cuts_a_stalled_stream(mock: MockProvider, tmp_path: Path) -> None:
    cfg = tmp_path / "c.toml"
    cfg.write_text(
        f'[server]\ngrace_s = 0.5\n[routes.mock]\nupstreams = [{{ url = "{mock.url}" }}]\n'
    )
    served = await Served.start(cfg, _env())
    try:
        action = json.dumps({"deltas": 5, "fault": "stall", "after_frame": 3, "seconds": 600})
        async with (
            aiohttp.ClientSession() as s,
            s.post(
                f"{served.url}/mock/v1/chat/completions",
                json=CHAT,
                headers={"x-mock-action": action},
            ) as r,
        ):
            first = await r.content.readany()
            assert first
            served.proc.send_signal(signal.SIGTERM)
            rest = await asyncio.wait_for(r.read(), 30)
    finally:
        code, err = await served.stop(signal_it=False)
    assert code == 0
    assert "grace period over: 1 request(s) cut short" in err
    # the cut stream ends with the native, retryable error, never a clean end
    body = first + rest
    assert b'"type":"server_error"' in body and b"[DONE]" not in body


async def test_python_m_help() -> None:
    code, out, _ = await _run(["--help"], _env())
    assert code == 0 and "serve" in out
