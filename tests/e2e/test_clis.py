"""The CLI installer (clis.py) without the network: a stand-in npm on PATH.

Not marked e2e: these run with ``-m 'not e2e'`` too.  The real install is
covered by test_fresh_machine.py.
"""

from __future__ import annotations

import stat
import sys
from pathlib import Path

import pytest

from e2e.clis import CACHE_ENV, CliUnavailable, cache_root, ensure_npm_cli

#: Writes the package's bin like npm would (``--prefix DIR ... pkg@ver``), or fails.
FAKE_NPM = r"""#!{python}
import os, sys
args = sys.argv[1:]
if args[:2] == ["config", "get"]:
    print("http://registry.test/")
    sys.exit(0)
if os.environ.get("FAKE_NPM_FAIL"):
    print("npm error code ENOTFOUND", file=sys.stderr)
    print("npm error network request to http://registry.test/ failed", file=sys.stderr)
    sys.exit(1)
prefix = args[args.index("--prefix") + 1]
spec = args[-1]
name = spec.rsplit("@", 1)[0].rsplit("/", 1)[-1]
bin_dir = os.path.join(prefix, "node_modules", ".bin")
os.makedirs(bin_dir, exist_ok=True)
with open(os.path.join(prefix, "calls"), "a") as f:
    f.write(spec + "\n")
path = os.path.join(bin_dir, os.environ.get("FAKE_NPM_BIN", name))
with open(path, "w") as f:
    f.write("#!/bin/sh\necho " + spec + "\n")
os.chmod(path, 0o755)
"""


@pytest.fixture
def npm(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    bindir = tmp_path / "bin"
    bindir.mkdir()
    fake = bindir / "npm"
    fake.write_text(FAKE_NPM.format(python=sys.executable))
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("PATH", str(bindir))
    return fake


def test_installs_once_into_the_cache_and_says_so(npm: Path, tmp_path: Path) -> None:
    said: list[str] = []
    cache = tmp_path / "cache"
    exe = ensure_npm_cli("@scope/tool", "1.2.3", "tool", cache=cache, say=said.append)
    home = cache / "npm" / "@scope+tool@1.2.3"
    assert exe == home / "node_modules" / ".bin" / "tool" and exe.exists()
    assert (home / ".installed").read_text() == "@scope/tool@1.2.3\n"
    assert said == [
        f"unbroken tests: installing @scope/tool@1.2.3 with npm into {home} (once per machine)",
        "unbroken tests: installed @scope/tool@1.2.3",
    ]
    again: list[str] = []
    assert ensure_npm_cli("@scope/tool", "1.2.3", cache=cache, say=again.append) == exe
    assert again == []  # already there: not a word, and npm is not run again
    assert (home / "calls").read_text() == "@scope/tool@1.2.3\n"


def test_an_interrupted_install_is_done_again(npm: Path, tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    home = cache / "npm" / "tool@2.0.0"
    (home / "node_modules" / ".bin").mkdir(parents=True)  # no stamp: npm died half-way
    (home / "node_modules" / ".bin" / "tool").write_text("half")
    exe = ensure_npm_cli("tool", "2.0.0", cache=cache, say=lambda _: None)
    assert exe.read_text().startswith("#!/bin/sh")
    assert (home / ".installed").exists()


def test_a_failed_npm_install_says_why_and_leaves_nothing(
    npm: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("FAKE_NPM_FAIL", "1")
    cache = tmp_path / "cache"
    with pytest.raises(CliUnavailable) as err:
        ensure_npm_cli("tool", "1.0.0", cache=cache, say=lambda _: None)
    text = str(err.value)
    assert "`npm install tool@1.0.0` failed (exit 1)" in text
    assert "http://registry.test/" in text and "ENOTFOUND" in text
    assert "-m 'not e2e'" in text
    assert not (cache / "npm" / "tool@1.0.0").exists()


def test_an_install_without_the_binary_is_a_failure(
    npm: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("FAKE_NPM_BIN", "something-else")
    with pytest.raises(CliUnavailable, match="no tool after it"):
        ensure_npm_cli("tool", "1.0.0", cache=tmp_path / "c", say=lambda _: None)


def test_no_npm_says_what_to_do(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))  # nothing there
    with pytest.raises(CliUnavailable, match=r"npm is not on PATH.*Install Node\.js and npm"):
        ensure_npm_cli("tool", "1.0.0", cache=tmp_path / "c", say=lambda _: None)


def test_where_the_cache_is(tmp_path: Path) -> None:
    home = Path.home()
    assert cache_root({}) == home / ".cache" / "unbroken-tests"
    assert cache_root({"XDG_CACHE_HOME": "relative"}) == home / ".cache" / "unbroken-tests"
    assert cache_root({"XDG_CACHE_HOME": str(tmp_path)}) == tmp_path / "unbroken-tests"
    assert cache_root({CACHE_ENV: str(tmp_path / "x"), "XDG_CACHE_HOME": "/elsewhere"}) == (
        tmp_path / "x"
    )
