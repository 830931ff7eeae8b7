"""The ``unbroken mock`` command line (run as ``python -m unbroken.mock``)."""

from __future__ import annotations

import asyncio
import json
import re
import signal
import sys
from pathlib import Path

import aiohttp
import pytest

from unbroken.mock import ActionError, load_script, main_mock

READY = re.compile(r"^unbroken mock listening on (http://127\.0\.0\.1:(\d+))$")


async def run_cli(*args: str) -> asyncio.subprocess.Process:
    return await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "unbroken.mock",
        *args,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )


async def test_cli_serves_script(tmp_path: Path) -> None:
    script = tmp_path / "script.json"
    script.write_text(
        json.dumps(
            {
                "default": {"text": "from the default"},
                "actions": [{"status": 503, "headers": {"Retry-After": "2"}}],
                "queues": {"k1": [{"status": 429}]},
            }
        )
    )
    proc = await run_cli("--port", "0", "--script", str(script))
    try:
        assert proc.stdout is not None
        line = (await asyncio.wait_for(proc.stdout.readline(), 20)).decode().strip()
        match = READY.match(line)
        assert match, line
        url = match.group(1)
        assert int(match.group(2)) > 0
        req = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
        async with aiohttp.ClientSession() as session:
            async with session.get(url + "/_mock/health") as resp:
                assert resp.status == 200
                assert (await resp.json())["ok"] is True
            async with session.post(url + "/v1/chat/completions", json=req) as resp:
                assert resp.status == 503
                assert resp.headers["Retry-After"] == "2"
            async with session.post(
                url + "/v1/chat/completions", json=req, headers={"x-mock-key": "k1"}
            ) as resp:
                assert resp.status == 429
            async with session.post(url + "/v1/chat/completions", json=req) as resp:
                body = await resp.json()
                assert body["choices"][0]["message"]["content"] == "from the default"
    finally:
        if proc.returncode is None:
            proc.send_signal(signal.SIGTERM)
        code = await asyncio.wait_for(proc.wait(), 20)
    assert code == 0


async def test_cli_invalid_script_exits_2(tmp_path: Path) -> None:
    script = tmp_path / "bad.toml"
    script.write_text('[[actions]]\nstatus = 500\n\n[[actions]]\nfault = "explode"\n')
    proc = await run_cli("--port", "0", "--script", str(script))
    _, stderr = await asyncio.wait_for(proc.communicate(), 20)
    assert proc.returncode == 2
    assert "actions[1].fault" in stderr.decode()


def test_main_mock_reports_bad_top_level_key(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    script = tmp_path / "bad.json"
    script.write_text(json.dumps({"actoins": []}))
    assert main_mock(["--script", str(script)]) == 2
    assert "actoins" in capsys.readouterr().err
    assert main_mock(["--script", str(tmp_path / "missing.json")]) == 2


def test_load_script_toml(tmp_path: Path) -> None:
    script = tmp_path / "ok.toml"
    script.write_text(
        '[default]\ndeltas = 3\n\n[[actions]]\nfault = "reset"\nafter_frame = 2\ncount = 2\n\n'
        "[queues]\nq = [{ status = 500 }]\n"
    )
    loaded = load_script(script)
    assert loaded.default == {"deltas": 3}
    assert loaded.queues == {"q": [{"status": 500}]}
    with pytest.raises(ActionError, match=r"queues\.q\[0\]\.status"):
        bad = tmp_path / "bad.json"
        bad.write_text(json.dumps({"queues": {"q": [{"status": "x"}]}}))
        load_script(bad)
