"""What a relay worker knows of its siblings (``serve --workers N``).

Its identity (`WorkerSpec`) and the ``/status`` summaries the workers leave for
one another in the supervisor's runtime directory.  The relay server reads and
writes them; the supervisor (`unbroken.relay.workers`) runs the servers, so this
sits below both and neither imports the other back.
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import time
from pathlib import Path
from typing import Any

__all__ = [
    "STATUS_FRESH_S",
    "WorkerSpec",
    "read_worker_status",
    "stop_signals",
    "write_worker_status",
]

#: a sibling's summary older than this is not shown (its worker is gone or stuck)
STATUS_FRESH_S = 5.0
#: a sibling's summary larger than this is not read (it lists its turns in flight)
STATUS_MAX_BYTES = 4 << 20


def stop_signals() -> tuple[signal.Signals, ...]:
    """The signals that drain a relay, worker or not: SIGTERM, SIGINT, and SIGHUP unless
    it was ignored when the process started (``nohup``: the user asked to outlive the
    terminal).  SIGHUP drains rather than reloads: see `unbroken.relay.workers`."""
    ignored = signal.getsignal(signal.SIGHUP) is signal.SIG_IGN
    return (signal.SIGTERM, signal.SIGINT) + (() if ignored else (signal.SIGHUP,))


@dataclasses.dataclass(frozen=True)
class WorkerSpec:
    """Who a worker is: its number, and the supervisor's runtime directory."""

    id: int
    runtime_dir: str


def write_worker_status(spec: WorkerSpec, data: dict[str, Any]) -> None:
    """Write this worker's ``/status`` summary where its siblings read it (atomically)."""
    path = Path(spec.runtime_dir) / f"status-{spec.id}.json"
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    try:
        tmp.write_text(json.dumps(data))
        os.replace(tmp, path)
    except OSError:
        pass


def read_worker_status(spec: WorkerSpec) -> list[dict[str, Any]]:
    """Every worker's latest summary (fresh, well-formed ones only), this one's included.

    A file in the runtime directory is a sibling's word, not trusted: one that is too
    large, not JSON, or not shaped like `write_worker_status`'s is skipped."""
    out = []
    now = time.time()
    for path in sorted(Path(spec.runtime_dir).glob("status-*.json")):
        try:
            with path.open("rb") as f:
                raw = f.read(STATUS_MAX_BYTES + 1)
            if len(raw) > STATUS_MAX_BYTES:
                continue
            data = json.loads(raw)
        except (OSError, ValueError, RecursionError):
            continue
        if _summary_ok(data) and 0 <= now - data["now"] <= STATUS_FRESH_S:
            out.append(data)
    return out


def _summary_ok(data: Any) -> bool:
    if not isinstance(data, dict):
        return False
    at, worker, pid = data.get("now"), data.get("worker"), data.get("pid")
    return (
        isinstance(at, int | float)
        and not isinstance(at, bool)
        and isinstance(worker, int)
        and isinstance(pid, int)
        and isinstance(data.get("inflight", []), list)
        and all(isinstance(t, dict) for t in data.get("inflight", []))
        and isinstance(data.get("totals", {}), dict)
    )
