"""The token of the routes that inject a key, kept for the owner in a 0600 file.

``unbroken serve`` with a route that injects a key (``api_key_env``) and no token
configured (``UNBROKEN_TOKEN``, ``[server] token_env``) does not serve that route to
whoever connects: it creates a random token in
``$XDG_STATE_HOME/unbroken/token`` (``~/.local/state/unbroken/token``), mode 0600
in a 0700 directory of this user's (`load_or_create` checks both, and refuses
anything at the path but a regular file without opening it), reuses it on later
starts, logs where it is (never the token), and that route needs it
(`relay.access`).  Routes where the client brings its own key stay open on
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

    The directory must be this user's and writable by no one else (else
    `TokenFileError`: someone else may have put the file there); one that others may
    only read or enter is made 0700, as the docs promise.  An existing file must be a
    regular file of this user that no one else can read (else `TokenFileError`:
    another user may know the token); anything else at the path (a FIFO, a
    directory, a socket, a symbolic link) is refused without being opened, so nothing
    blocks.  Every error is one line that names the path.
    """
    _check_dir(path.parent)
    try:
        return _read(path), False
    except FileNotFoundError:
        pass
    token = secrets.token_urlsafe(32)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}")
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    except OSError as exc:
        raise TokenFileError(f"cannot create the token file {path}: {_why(exc)}") from None
    try:
        with os.fdopen(fd, "w", encoding="ascii") as f:
            f.write(token + "\n")
        try:
            os.link(tmp, path)  # atomic, and never over a file another start made
        except FileExistsError:
            return _read(path), False
        except OSError as exc:
            raise TokenFileError(f"cannot create the token file {path}: {_why(exc)}") from None
    finally:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
    return token, True


def _why(exc: OSError) -> str:
    return exc.strerror or type(exc).__name__


#: what a file that is not a regular one is, for the message
_KINDS = (
    (stat.S_ISDIR, "a directory"),
    (stat.S_ISFIFO, "a FIFO"),
    (stat.S_ISSOCK, "a socket"),
    (stat.S_ISLNK, "a symbolic link"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
)


def _kind(mode: int) -> str:
    return next((name for test, name in _KINDS if test(mode)), "not a regular file")


def _check_dir(parent: Path) -> None:
    """The token's directory: created 0700 if absent; this user's, and writable by no
    one else; made 0700 if others may read or enter it."""
    try:
        parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        st = os.stat(parent)
    except OSError as exc:
        raise TokenFileError(f"cannot use the token directory {parent}: {_why(exc)}") from None
    if not stat.S_ISDIR(st.st_mode):
        raise TokenFileError(f"the token directory {parent} is {_kind(st.st_mode)}")
    if st.st_uid != os.getuid():
        raise TokenFileError(
            f"the token directory {parent} belongs to another user: use a directory of "
            "your own (XDG_STATE_HOME)"
        )
    if st.st_mode & 0o022:
        raise TokenFileError(
            f"the token directory {parent} is writable by others (mode "
            f"{stat.S_IMODE(st.st_mode):04o}): chmod 700 it, and remove the token file in "
            "it if someone else may have put it there"
        )
    if st.st_mode & 0o077:
        try:
            os.chmod(parent, 0o700)
        except OSError as exc:
            msg = f"cannot chmod 700 the token directory {parent}: {_why(exc)}"
            raise TokenFileError(msg) from None


def _read(path: Path) -> str:
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        raise
    except OSError as exc:
        raise TokenFileError(f"cannot read the token file {path}: {_why(exc)}") from None
    if stat.S_ISLNK(st.st_mode):
        raise TokenFileError(f"cannot read the token file {path}: it is a symbolic link")
    if not stat.S_ISREG(st.st_mode):
        raise TokenFileError(
            f"the token file {path} is {_kind(st.st_mode)}, not a regular file: remove it"
        )
    try:
        # O_NONBLOCK: a FIFO put there since the lstat does not block the open
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError as exc:
        if isinstance(exc, FileNotFoundError):
            raise
        raise TokenFileError(f"cannot read the token file {path}: {_why(exc)}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise TokenFileError(
                f"the token file {path} is {_kind(st.st_mode)}, not a regular file: remove it"
            )
        if st.st_uid != os.getuid():
            raise TokenFileError(f"the token file {path} belongs to another user: remove it")
        if st.st_mode & 0o077:
            raise TokenFileError(
                f"the token file {path} is readable by others: remove it (a new token is "
                "made) or chmod 600 it if no one else can have read it"
            )
        raw = os.read(fd, 1024)
    except OSError as exc:
        raise TokenFileError(f"cannot read the token file {path}: {_why(exc)}") from None
    finally:
        os.close(fd)
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
