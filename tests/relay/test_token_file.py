"""Issue 33 item 8: the token file's path is checked before it is opened.

Before: a FIFO at the token path hung ``unbroken serve`` forever with no output (the
open blocked for a writer); a directory there gave "Is a directory" without the
path; a 0777 or another user's directory around it was accepted although the docs
promise 0700.  Now each is one line naming the path, exit code 2, and nothing
blocks.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from servefix import serve_subprocess
from unbroken.relay.tokenfile import TokenFileError, load_or_create

NOBODY = 65534


def _config(tmp_path: Path) -> Path:
    cfg = tmp_path / "c.toml"
    cfg.write_text(
        '[journal]\nenabled = false\n[routes.keyed]\nupstreams = [{ url = "http://127.0.0.1:9", '
        'api_key_env = "KEYED_KEY" }]\n'
    )
    return cfg


async def _serve(tmp_path: Path, state: Path) -> tuple[int, list[str]]:
    """`unbroken serve` with a keyed route: its exit code and stderr lines (it must
    exit: a hang is killed after 30 s and fails the test)."""
    env = {"XDG_STATE_HOME": str(state), "KEYED_KEY": "sk-keyed-0123456789abcdef"}
    served = await serve_subprocess(_config(tmp_path), env=env, listen=False)
    code, err = await served.exited(30)  # (a hang fails the test)
    return code, err.strip().splitlines()


@pytest.mark.parametrize("what", ["fifo", "directory", "dir_0777"])
async def test_serve_refuses_a_bad_token_path_with_one_line(tmp_path: Path, what: str) -> None:
    state = tmp_path / "state"
    path = state / "unbroken" / "token"
    path.parent.mkdir(parents=True, mode=0o700)
    shown = str(path)
    if what == "fifo":
        os.mkfifo(path, 0o600)
    elif what == "directory":
        path.mkdir(mode=0o700)
    else:
        path.parent.chmod(0o777)
        shown = str(path.parent)
    code, lines = await _serve(tmp_path, state)
    assert code == 2 and len(lines) == 1, lines
    assert shown in lines[0] and "Traceback" not in lines[0]
    if what == "dir_0777":
        assert "writable by others" in lines[0] and not path.exists()


def test_a_fifo_is_refused_without_being_opened(tmp_path: Path) -> None:
    path = tmp_path / "token"
    os.mkfifo(path, 0o600)
    tmp_path.chmod(0o700)
    with pytest.raises(TokenFileError, match=f"{path} is a FIFO, not a regular file"):
        load_or_create(path)


def test_a_directory_at_the_path_is_named(tmp_path: Path) -> None:
    path = tmp_path / "token"
    path.mkdir()
    tmp_path.chmod(0o700)
    with pytest.raises(TokenFileError, match=f"{path} is a directory, not a regular file"):
        load_or_create(path)


@pytest.mark.parametrize("mode", [0o777, 0o770, 0o722, 0o702])
def test_a_directory_others_can_write_is_refused(tmp_path: Path, mode: int) -> None:
    d = tmp_path / "unbroken"
    d.mkdir()
    d.chmod(mode)
    with pytest.raises(TokenFileError, match=f"the token directory {d} is writable by others"):
        load_or_create(d / "token")
    assert not (d / "token").exists()  # no token made where someone else could swap it


def test_a_directory_others_may_only_read_is_made_0700(tmp_path: Path) -> None:
    d = tmp_path / "unbroken"
    d.mkdir()
    d.chmod(0o755)
    token, created = load_or_create(d / "token")
    assert created and stat.S_IMODE(d.stat().st_mode) == 0o700
    assert load_or_create(d / "token") == (token, False)


def test_a_new_directory_is_0700(tmp_path: Path) -> None:
    d = tmp_path / "a" / "unbroken"
    load_or_create(d / "token")
    assert stat.S_IMODE(d.stat().st_mode) == 0o700


def test_another_users_directory_is_refused(tmp_path: Path) -> None:
    d = tmp_path / "unbroken"
    if os.geteuid() == 0:
        d.mkdir(mode=0o700)
        os.chown(d, NOBODY, NOBODY)
    else:
        d = Path("/")  # root's (no one else makes a directory for another user)
    with pytest.raises(TokenFileError, match=f"the token directory {d} belongs to another user"):
        load_or_create(d / "token")


def test_a_file_where_the_directory_should_be_is_named(tmp_path: Path) -> None:
    (tmp_path / "unbroken").write_text("x")
    with pytest.raises(TokenFileError, match=f"token directory {tmp_path / 'unbroken'}"):
        load_or_create(tmp_path / "unbroken" / "token")
