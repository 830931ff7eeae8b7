"""Bad input on every command line: one line on stderr, exit code 2, never a traceback.

Issue 10's review found tracebacks for ``--port 65536``/``-1``, a non-UTF-8
config file, the URL ``http://[::1`` and more, and ``opencode setup --relay
notaurl`` writing ``"baseURL": "notaurl/mock/v1"`` and exiting 0.
"""

from __future__ import annotations

import asyncio
import os
import sys
from pathlib import Path

import pytest

from unbroken.cli import main

TOKEN = "tok-0123456789abcdef-cli"


@pytest.fixture
def files(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    for var in list(os.environ):
        if var.startswith(("UNBROKEN_", "OPENCODE_")):
            monkeypatch.delenv(var)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))
    monkeypatch.chdir(tmp_path)
    (tmp_path / "latin1.toml").write_bytes('[server]\nhost = "caf\u00e9"\n'.encode("latin-1"))
    (tmp_path / "v6.toml").write_text('[routes.x]\nupstreams = [{ url = "http://[::1" }]\n')
    (tmp_path / "nul.toml").write_text('[routes.x]\nupstreams = [{ url = "http://a\\u0000b" }]\n')
    (tmp_path / "crlf.toml").write_text(
        '[routes.x]\nupstreams = [{ url = "http://a/\\r\\nX: 1" }]\n'
    )
    (tmp_path / "space.toml").write_text('[routes.x]\nupstreams = [{ url = "http://a/b c" }]\n')
    (tmp_path / "dots.toml").write_text('[routes.".."]\nupstreams = ["http://a"]\n')
    (tmp_path / "name.toml").write_text('[routes."a b?#"]\nupstreams = ["http://a"]\n')
    (tmp_path / "badport.toml").write_text("[server]\nport = 65536\n")
    (tmp_path / "commit.toml").write_text('[stream]\nafter_commit = "resume"\n')
    (tmp_path / "rcommit.toml").write_text(
        '[routes.x]\nafter_commit = true\nupstreams = ["http://a"]\n'
    )
    (tmp_path / "splices.toml").write_text("[stream]\nmax_splices = 0\n")
    (tmp_path / "prefix.toml").write_text(
        '[routes.x]\nchat_prefix = "yes"\nupstreams = ["http://a"]\n'
    )
    return tmp_path


# (argv, text the one line must contain)
CASES: list[tuple[list[str], str]] = [
    (["status", "--url", "notaurl", "--once"], "--url"),
    (["serve", "--port", "65536"], "--port"),
    (["serve", "--port", "-1"], "--port"),
    (["serve", "--port", "http"], "--port"),
    (["serve", "--port"], "--port"),
    (["serve", "--host", "a b"], "--host"),
    (["serve", "--host", "http://0.0.0.0"], "--host"),
    (["serve", "--host", "0.0.0.0"], "UNBROKEN_TOKEN"),
    (["serve", "--host", "::"], "UNBROKEN_TOKEN"),
    (["serve", "--config", "latin1.toml"], "UTF-8"),
    (["serve", "--config", "missing.toml"], "--config"),
    (["serve", "--config", "v6.toml"], "routes.x.upstreams[0].url"),
    (["serve", "--config", "nul.toml"], "routes.x.upstreams[0].url"),
    (["serve", "--config", "crlf.toml"], "routes.x.upstreams[0].url"),
    (["serve", "--config", "space.toml"], "routes.x.upstreams[0].url"),
    (["serve", "--config", "dots.toml"], "routes.."),
    (["serve", "--config", "name.toml"], "routes.a b?#"),
    (["serve", "--config", "badport.toml"], "server.port"),
    (["serve", "--config", "commit.toml"], "stream.after_commit"),
    (["serve", "--config", "rcommit.toml"], "routes.x.after_commit"),
    (["serve", "--config", "splices.toml"], "stream.max_splices"),
    (["serve", "--config", "prefix.toml"], "routes.x.chat_prefix"),
    (["serve", "--bogus"], "--bogus"),
    (["mock", "--port", "65536"], "--port"),
    (["mock", "--port", "-1"], "--port"),
    (["mock", "--host", "a b"], "--host"),
    (["mock", "--script", "missing.json"], "missing.json"),
    (["mock", "--script", "latin1.toml"], "latin1.toml"),
    (["stats", "--since", "soon"], "--since"),
    (["stats", "--config", "latin1.toml"], "UTF-8"),
    (["stats", "--journal", "missing.sqlite3"], "missing.sqlite3"),
    (["status", "--interval", "-1"], "--interval"),
    (["status", "--interval", "nan"], "--interval"),
    (["resume", "--opencode", "notaurl"], "--opencode"),
    (["resume", "--opencode", "http://[::1"], "--opencode"),
    (["resume", "--opencode", "http://127.0.0.1:9", "--delay-ms", "-5"], "--delay-ms"),
    (["demo", "--turns", "0"], "--turns"),
    (["demo", "--turns", "many"], "--turns"),
    (["demo", "--protocol", "responses"], "--protocol"),
    (["demo", "--protocol", "gemini", "--after-commit", "continue"], "--after-commit"),
    (["run"], "opencode"),
    (["run", "--"], "opencode"),
    (["run", "--config", "missing.toml", "--", "opencode"], "--config"),
    (["run", "--config", "latin1.toml", "--", "opencode"], "UTF-8"),
    (["opencode", "setup", "--relay", "notaurl"], "--relay"),
    (["opencode", "setup", "--relay", "http://[::1"], "--relay"),
    (["opencode", "setup", "--relay", "ftp://127.0.0.1:4780"], "--relay"),
    (["opencode", "setup", "--relay", "http://127.0.0.1:4780/a b"], "--relay"),
    (["opencode", "setup", "--config", "latin1.toml"], "UTF-8"),
    (["bogus"], "bogus"),
]


def _run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    try:
        code = main(argv)
    except SystemExit as exc:  # argparse
        code = exc.code if isinstance(exc.code, int) else 2
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.parametrize(("argv", "needle"), CASES, ids=[" ".join(c[0]) for c in CASES])
def test_bad_input_is_one_line_and_exit_2(
    argv: list[str], needle: str, files: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, err = _run(argv, capsys)
    assert code == 2, (code, out, err)
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1, err
    assert needle in lines[0], lines[0]
    assert "Traceback" not in err + out
    assert "relaying on" not in out  # nothing started
    assert not (files / "home" / ".config").exists()  # opencode setup wrote nothing


@pytest.mark.parametrize(
    "argv",
    [
        ["serve", "--port", "65536"],
        ["mock", "--port", "-1"],
        ["serve", "--config", "latin1.toml"],
        ["opencode", "setup", "--relay", "notaurl"],
        ["serve", "--host", "0.0.0.0"],
    ],
    ids=lambda a: " ".join(a),
)
async def test_real_entry_point_no_traceback(argv: list[str], files: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("UNBROKEN_")}
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "unbroken",
        *argv,
        cwd=files,
        env=env,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode == 2
    assert len(err.decode().strip().splitlines()) == 1, err
    assert b"Traceback" not in out + err


def test_weak_token_in_env_is_refused_without_echo(
    files: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("UNBROKEN_TOKEN", "weak token!")
    code, _, err = _run(["serve", "--host", "0.0.0.0"], capsys)
    assert code == 2 and "UNBROKEN_TOKEN" in err and "weak token!" not in err
    assert len(err.strip().splitlines()) == 1


@pytest.mark.parametrize(
    ("command", "code", "why"),
    [
        ("nonexistent-binary-35", 127, "command not found"),
        ("./nonexistent-35", 127, "no such file"),
        ("latin1.toml", 126, "not an executable file"),  # found (a path), not executable
        ("./", 126, "not an executable file"),  # a directory
    ],
)
async def test_run_a_command_that_cannot_start_is_one_line_before_anything_starts(
    command: str, code: int, why: str, files: Path
) -> None:
    """Issue 35: `unbroken run -- nonexistent-binary` started the relay, logged three INFO
    lines, then failed with 127.  Now it is one line before anything starts, with the
    shell's codes for a command it cannot run (127 not found, 126 not executable), as
    `env` and `timeout` give them: an agent's wrapper script can tell them from 2."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("UNBROKEN_")}
    argv = ["run", "--", "./latin1.toml" if command == "latin1.toml" else command, "--x"]
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "unbroken",
        *argv,
        cwd=files,
        env=env,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode == code
    assert out == b""
    assert err.decode() == f"unbroken run: cannot start {argv[2]}: {why}\n"


@pytest.mark.parametrize("unbuffered", [False, True], ids=["buffered", "unbuffered"])
def test_a_reader_that_goes_away_ends_the_command_quietly(files: Path, unbuffered: bool) -> None:
    """Issue 35: `unbroken stats --json | head -c 1` printed "Broken pipe" and exited 2
    (bad input); with a short output Python said "Exception ignored ... BrokenPipeError"
    at exit (status 120).  Now nothing on stderr and 141, the status the shell shows
    for a Unix tool that SIGPIPE ends (`seq 100000 | head -1`)."""
    import subprocess

    env = {k: v for k, v in os.environ.items() if not k.startswith("UNBROKEN_")}
    env["XDG_STATE_HOME"] = str(files / "state")  # no journal: the report of no turns
    if unbuffered:  # the write fails inside the command, not at the last flush
        env["PYTHONUNBUFFERED"] = "1"
    read_end, write_end = os.pipe()
    os.close(read_end)  # the reader is gone before anything is written
    try:
        done = subprocess.run(
            [sys.executable, "-m", "unbroken", "stats", "--json"],
            cwd=files,
            env=env,
            stdout=write_end,
            stderr=subprocess.PIPE,
            timeout=60,
            check=False,
        )
    finally:
        os.close(write_end)
    assert (done.returncode, done.stderr) == (141, b"")
