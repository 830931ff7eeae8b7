"""The pinned agent CLIs the end-to-end tests drive, installed once per machine with npm.

`ensure_npm_cli` installs ``package@version`` into its own directory of the test
cache, outside the work tree, and returns the path of its executable.  The cache is
``$UNBROKEN_TEST_CACHE``, else ``$XDG_CACHE_HOME/unbroken-tests``, else
``~/.cache/unbroken-tests``; each CLI lives in ``npm/<package>@<version>/`` there
(``/`` in a scoped package name becomes ``+``).  A file lock serialises concurrent
test sessions; a directory without its ``.installed`` stamp (an interrupted
install) is removed and installed again.  Anything that stops the install (no npm,
no registry, a failed postinstall) raises `CliUnavailable` with a message that
says what to do: the tests that need the CLI then fail with it, they never skip.

`PINNED` names every CLI the suite uses; a test module asks for one with
``pytest.mark.cli("<name>")`` and the e2e conftest installs what the selected tests
need before the first of them runs.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import subprocess
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

__all__ = [
    "CACHE_ENV",
    "INSTALLED",
    "PINNED",
    "CliUnavailable",
    "NpmCli",
    "cache_root",
    "ensure_npm_cli",
    "installed",
]

#: Overrides the cache directory (the fresh-machine test points it at an empty one).
CACHE_ENV = "UNBROKEN_TEST_CACHE"
STAMP = ".installed"


class CliUnavailable(RuntimeError):
    """The CLI cannot be installed; the message says why and what to do."""


@dataclass(frozen=True)
class NpmCli:
    package: str
    version: str
    bin: str

    @property
    def spec(self) -> str:
        return f"{self.package}@{self.version}"

    @property
    def override_env(self) -> str:
        """An environment variable naming an already installed binary to use instead."""
        return f"UNBROKEN_{self.bin.upper()}_BIN"


#: name (as in ``pytest.mark.cli(name)``) -> the pinned npm package.
PINNED: dict[str, NpmCli] = {
    "opencode": NpmCli("opencode-ai", "1.18.33", "opencode"),
    "codex": NpmCli("@openai/codex", "0.169.0", "codex"),
    "claude": NpmCli("@anthropic-ai/claude-code", "2.1.328", "claude"),
    "gemini": NpmCli("@google/gemini-cli", "0.61.0", "gemini"),
}


#: name -> its executable, or why it could not be installed (filled by the e2e conftest).
INSTALLED: dict[str, Path | CliUnavailable] = {}


def installed(name: str) -> Path:
    """The executable of a pinned CLI the session installed (raises `CliUnavailable`)."""
    got = INSTALLED.get(name)
    if got is None:
        raise CliUnavailable(
            f"the {name} CLI was not installed for this test: mark it pytest.mark.cli({name!r})"
        )
    if isinstance(got, CliUnavailable):
        raise CliUnavailable(f"{PINNED[name].spec} is not available: {got}")
    return got


def cache_root(env: Mapping[str, str] | None = None) -> Path:
    """Where the CLIs go: ``$UNBROKEN_TEST_CACHE``, else ``$XDG_CACHE_HOME/unbroken-tests``,
    else ``~/.cache/unbroken-tests`` (a relative ``XDG_CACHE_HOME`` is ignored, as the
    XDG spec says)."""
    env = os.environ if env is None else env
    override = env.get(CACHE_ENV)
    if override:
        return Path(override).expanduser().resolve()
    xdg = env.get("XDG_CACHE_HOME")
    base = Path(xdg) if xdg and Path(xdg).is_absolute() else Path.home() / ".cache"
    return base / "unbroken-tests"


def _say(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def ensure_npm_cli(
    package: str,
    version: str,
    bin_name: str | None = None,
    *,
    cache: Path | None = None,
    say: Callable[[str], None] = _say,
    timeout_s: float = 1200.0,
) -> Path:
    """The executable of ``package@version``, installed with npm first if needed.

    ``bin_name`` defaults to the package name without its scope.  ``say`` gets one
    line when an install starts and one when it is done (nothing when the CLI is
    already there).  Raises `CliUnavailable`.
    """
    spec = f"{package}@{version}"
    bin_name = bin_name or package.rsplit("/", 1)[-1]
    root = (cache or cache_root()) / "npm"
    home = root / f"{package.replace('/', '+')}@{version}"
    exe = home / "node_modules" / ".bin" / bin_name
    if _installed(home, exe, spec):
        return exe
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise CliUnavailable(f"cannot create the test cache {root}: {exc}") from None
    with (root / ".lock").open("a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another test session may be installing it
        if _installed(home, exe, spec):
            return exe
        npm = shutil.which("npm")
        if npm is None:
            raise CliUnavailable(
                f"npm is not on PATH: the end-to-end tests install {spec} with it. Install "
                "Node.js and npm, or deselect these tests with -m 'not e2e'."
            )
        if home.exists():
            shutil.rmtree(home)  # an interrupted install
        home.mkdir()
        say(f"unbroken tests: installing {spec} with npm into {home} (once per machine)")
        argv = [
            npm,
            "install",
            "--prefix",
            str(home),
            "--no-save",
            "--no-package-lock",
            "--no-audit",
            "--no-fund",
            "--loglevel=error",
            spec,
        ]
        try:
            done = subprocess.run(
                argv,
                stdin=subprocess.DEVNULL,
                capture_output=True,
                text=True,
                timeout=timeout_s,
                check=False,
            )
        except subprocess.TimeoutExpired:
            shutil.rmtree(home, ignore_errors=True)
            raise CliUnavailable(
                f"`npm install {spec}` did not finish in {timeout_s:.0f} s (is the npm "
                "registry reachable?). Deselect the end-to-end tests with -m 'not e2e'."
            ) from None
        if done.returncode != 0 or not exe.exists():
            shutil.rmtree(home, ignore_errors=True)
            tail = "\n".join((done.stderr or done.stdout).strip().splitlines()[-15:])
            why = f"exit {done.returncode}" if done.returncode else f"no {exe.name} after it"
            raise CliUnavailable(
                f"`npm install {spec}` failed ({why}); is the npm registry "
                f"({_registry(npm)}) reachable? Deselect the end-to-end tests with "
                f"-m 'not e2e'.\n{tail}"
            )
        (home / STAMP).write_text(spec + "\n")
        say(f"unbroken tests: installed {spec}")
    return exe


def _installed(home: Path, exe: Path, spec: str) -> bool:
    try:
        return (home / STAMP).read_text().strip() == spec and exe.exists()
    except OSError:
        return False


def _registry(npm: str) -> str:
    try:
        done = subprocess.run(
            [npm, "config", "get", "registry"],
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            timeout=30,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired):
        return "the configured registry"
    return done.stdout.strip() or "the configured registry"
