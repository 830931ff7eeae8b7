"""The token of the routes that inject a key, kept for the owner in a 0600 file.

``unbroken serve`` with a route that injects a key (``api_key_env``) and no token
configured (``UNBROKEN_TOKEN``, ``[server] token_env``) does not serve that route to
whoever connects: it creates a random token in
``$XDG_STATE_HOME/unbroken/token`` (``~/.local/state/unbroken/token``), mode 0600,
reuses it on later starts, logs where it is (never the token), and that route
needs it (`relay.access`).  Routes where the client brings its own key stay open on
loopback.  Zero config stays two commands: ``unbroken serve``, then the client with
``x-unbroken-token: $(cat ~/.local/state/unbroken/token)`` (or the ``/t/<token>/``
prefix) for a keyed route.
"""

from __future__ import annotations

import contextlib
import os
import re
import secrets
import stat
from collections.abc import Mapping
from pathlib import Path

__all__ = ["TokenFileError", "default_token_path", "load_or_create"]

_TOKEN = re.compile(r"[A-Za-z0-9._~-]{16,512}")


class TokenFileError(ValueError):
    """The token file cannot be used (one line, says what to do; never the token)."""


def default_token_path(env: Mapping[str, str] | None = None) -> Path:
    """``$XDG_STATE_HOME/unbroken/token`` (``~/.local/state`` when unset)."""
    env = os.environ if env is None else env
    state = env.get("XDG_STATE_HOME", "")
    base = Path(state) if state and os.path.isabs(state) else Path.home() / ".local" / "state"
    return base / "unbroken" / "token"


def load_or_create(path: Path) -> tuple[str, bool]:
    """The token in ``path``, created (random, 0600) if absent; and whether it was created.

    An existing file must be a regular file of this user that no one else can read
    (else `TokenFileError`: another user may know the token).
    """
    try:
        return _read(path), False
    except FileNotFoundError:
        pass
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    token = secrets.token_urlsafe(32)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    try:
        with os.fdopen(fd, "w", encoding="ascii") as f:
            f.write(token + "\n")
        try:
            os.link(tmp, path)  # atomic, and never over a file another start made
        except FileExistsError:
            return _read(path), False
    finally:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
    return token, True


def _read(path: Path) -> str:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError as exc:
        if isinstance(exc, FileNotFoundError):
            raise
        raise TokenFileError(f"cannot read the token file {path}: {exc.strerror}") from None
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(f.fileno())
        if not stat.S_ISREG(st.st_mode):
            raise TokenFileError(f"the token file {path} is not a regular file")
        if st.st_uid != os.getuid():
            raise TokenFileError(f"the token file {path} belongs to another user: remove it")
        if st.st_mode & 0o077:
            raise TokenFileError(
                f"the token file {path} is readable by others: remove it (a new token is "
                "made) or chmod 600 it if no one else can have read it"
            )
        raw = f.read(1024)
    try:
        token = raw.decode("ascii").strip()
    except UnicodeDecodeError:
        token = ""
    if not _TOKEN.fullmatch(token):
        raise TokenFileError(
            f"the token file {path} does not hold a token (16 to 512 characters from "
            "[A-Za-z0-9._~-]): remove it and a new one is made"
        )
    return token
