"""The agent as a child process, and where ``unbroken run`` logs while it runs.

Shared by every launcher (`unbroken.agents.launcher`, `unbroken.opencode.run`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shutil
import signal
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Protocol

from unbroken.cmdline import setup_logging

__all__ = ["Helper", "cannot_start", "log_to", "run_child", "setup_run_logging"]


class Helper(Protocol):
    """What runs beside the child (auto-resume): stopped when the child exits."""

    async def stop(self) -> None: ...


def _exit_code(code: int | None) -> int:
    if code is None:
        return 1
    return 128 - code if code < 0 else code


def cannot_start(name: str, env: Mapping[str, str]) -> int | None:
    """None if the command ``name`` can be run; else says why on one line and returns
    the exit code a shell gives it (127: not found, 126: not executable), as `env` and
    `timeout` do.  Checked before the relay starts: a typo was three log lines, then
    the error."""
    why = None
    if os.sep in name:
        path = Path(name)
        if not path.exists():
            code, why = 127, "no such file"
        elif path.is_dir() or not os.access(path, os.X_OK):
            code, why = 126, "not an executable file"
    elif shutil.which(name, path=env.get("PATH", os.defpath)) is None:
        code, why = 127, "command not found"
    if why is None:
        return None
    print(f"unbroken run: cannot start {name}: {why}", file=sys.stderr)
    return code


def log_to(path: str | None, interactive: bool, env: Mapping[str, str]) -> Path | None:
    """Where the relay and resume logs go: ``--log``, or a file when the agent owns the
    terminal (its TUI), else stderr (None)."""
    if path:
        return Path(path)
    if not interactive:
        return None
    state = env.get("XDG_STATE_HOME") or str(
        Path(env.get("HOME") or Path.home()) / ".local" / "state"
    )
    return Path(state) / "unbroken" / "run.log"


def setup_run_logging(log_file: Path | None) -> None:
    if log_file is None:
        setup_logging()
        return
    log_file.parent.mkdir(parents=True, exist_ok=True, mode=0o700)  # the token's, too
    handler = logging.FileHandler(log_file, encoding="utf-8")
    handler.setFormatter(logging.Formatter("%(asctime)s %(name)s %(levelname)s %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(logging.INFO)
    logging.getLogger("aiohttp.access").setLevel(logging.WARNING)


async def run_child(
    argv: Sequence[str],
    *,
    env: Mapping[str, str],
    cwd: Path,
    beside: Callable[[asyncio.subprocess.Process], Helper] | None = None,
) -> int:
    """Run an agent as a child process and return its exit code.

    SIGTERM and SIGHUP are forwarded to it; Ctrl-C reaches it from the terminal and
    unbroken waits for it to exit.  ``beside`` starts a helper that runs as long as
    the child does (auto-resume) and is stopped when it exits.
    """
    try:
        proc = await asyncio.create_subprocess_exec(*argv, env=dict(env), cwd=str(cwd))
    except OSError as exc:
        print(f"unbroken: cannot start {argv[0]}: {exc.strerror}", file=sys.stderr)
        return 127
    loop = asyncio.get_running_loop()

    def forward(sig: int) -> None:
        with contextlib.suppress(ProcessLookupError):
            proc.send_signal(sig)

    installed: list[int] = []
    for sig in (signal.SIGTERM, signal.SIGHUP):
        with contextlib.suppress(NotImplementedError, RuntimeError, ValueError):
            loop.add_signal_handler(sig, forward, sig)
            installed.append(sig)
    with contextlib.suppress(NotImplementedError, RuntimeError, ValueError):
        loop.add_signal_handler(signal.SIGINT, lambda: None)
        installed.append(signal.SIGINT)
    helper = beside(proc) if beside is not None else None
    try:
        code = await proc.wait()
    finally:
        for signum in installed:
            with contextlib.suppress(NotImplementedError, RuntimeError, ValueError):
                loop.remove_signal_handler(signum)
        if helper is not None:
            await helper.stop()
    return _exit_code(code)
