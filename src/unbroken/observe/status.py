"""Live status: ``GET /status`` (JSON) and ``unbroken status``, a terminal view of it.

`StatusTracker` is a `Hooks` observer that keeps totals since the relay
started; `snapshot()` adds the turns in flight (read from the relay's live
`TurnRecord` objects) and the upstreams' health.  Only structural facts are
shown: no header value (not even the session id), no key, no content.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time
from collections import Counter, deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Final
from urllib.parse import urlsplit

from unbroken import __version__
from unbroken.core.admission.policy import Failure
from unbroken.core.turn.machine import NOT_FAILURES, OUTCOME_NAMES
from unbroken.core.wire.redact import REDACTED_PART, redact_url
from unbroken.observe.hooks import AttemptInfo, Hooks, TurnRecord
from unbroken.observe.metrics import held_bytes

__all__ = ["StatusTracker", "fetch_status", "register", "render", "watch"]

DEFAULT_URL = "http://127.0.0.1:4780"
#: ``/status`` lists this many failed attempts, newest last (``last_failures``)
LAST_FAILURES: Final = 20
#: ``/status`` counts attempts and turn ends over this many last seconds (``timeline``)
TIMELINE_S: Final = 300
#: an in-flight turn's ``chain`` shows its last this many attempts
CHAIN_MAX: Final = 8
#: turn outcomes counted as good in the timeline (the others, but a client's abort, as bad)
_GOOD_OUTCOMES = frozenset({"ok", "recovered", "resumed"})


class StatusTracker(Hooks):
    """Totals since start, plus a JSON snapshot of what is happening now."""

    def __init__(
        self,
        inflight: Callable[[], Iterable[TurnRecord]] = tuple,
        upstreams: Callable[[], list[dict[str, Any]]] = list,
        *,
        extra: Callable[[], dict[str, Any]] | None = None,
    ) -> None:
        self.inflight = inflight
        self.upstreams = upstreams
        self.extra = extra
        self.started = time.time()
        self.turns = 0
        self.outcomes: Counter[str] = Counter({o: 0 for o in OUTCOME_NAMES})
        self.attempts = 0
        self.failures = 0
        self.failures_by_reason: Counter[str] = Counter()
        self.failures_by_phase: Counter[str] = Counter()
        self.retries = 0
        self.retry_wait_s = 0.0
        self.wasted_tokens_est = 0
        self.continuations: Counter[str] = Counter()
        self.saved_tokens_est = 0
        #: the last failed attempts (final once ended), with their turn's id and route
        self._last_failures: deque[tuple[int, str, AttemptInfo]] = deque(maxlen=LAST_FAILURES)
        #: one bucket a second: [second, attempts ok, attempts failed, turns ok, turns failed]
        self._timeline: deque[list[int]] = deque(maxlen=TIMELINE_S)

    def _bucket(self, at: float | None) -> list[int]:
        second = int(at if at is not None else time.time())
        line = self._timeline
        if line and line[-1][0] >= second:
            return line[-1]  # the same second (or a clock step back: counted in the last)
        bucket = [second, 0, 0, 0, 0]
        line.append(bucket)
        return bucket

    # -- hooks ---------------------------------------------------------------------------
    def attempt_failed(
        self, turn: TurnRecord, upstream: str, failure: Failure, *, phase: str, wait_s: float | None
    ) -> None:
        if wait_s is not None:
            self.retries += 1

    def attempt_ended(self, turn: TurnRecord, attempt: AttemptInfo) -> None:
        self.attempts += 1
        if attempt.reason in NOT_FAILURES:
            if attempt.reason == "ok":
                self._bucket(attempt.ended)[1] += 1
            return
        self.failures += 1
        self._bucket(attempt.ended)[2] += 1
        self._last_failures.append((turn.id, turn.route, attempt))
        self.failures_by_reason[attempt.reason or "unknown"] += 1
        self.failures_by_phase[attempt.phase or "unknown"] += 1
        if attempt.phase != "committed":
            self.wasted_tokens_est += attempt.est_output_tokens

    def continuation(self, turn: TurnRecord, result: str) -> None:
        self.continuations[result] += 1

    def turn_ended(self, turn: TurnRecord) -> None:
        self.turns += 1
        self.outcomes[turn.outcome or "unknown"] += 1
        if turn.outcome in _GOOD_OUTCOMES:
            self._bucket(turn.ended)[3] += 1
        elif turn.outcome != "aborted_by_client":
            self._bucket(turn.ended)[4] += 1
        self.retry_wait_s += turn.waited_s  # really waited: a cut-short wait as it went
        self.saved_tokens_est += turn.saved_tokens

    # -- snapshot ------------------------------------------------------------------------
    @staticmethod
    def turn_view(turn: TurnRecord, now: float) -> dict[str, Any]:
        next_in = None
        if turn.next_retry_at is not None and turn.state == "waiting":
            next_in = round(max(0.0, turn.next_retry_at - now), 3)
        return {
            "id": turn.id,
            "route": turn.route,
            "path": turn.path.split("?")[0][:256],
            "protocol": turn.protocol,
            "stream": turn.stream,
            "client": turn.client,  # the client profile (core/profiles.py)
            "state": turn.state,
            "attempts": turn.attempts,
            "upstream": turn.upstream,
            "last_failure": turn.last_failure,
            "next_retry_in_s": next_in,
            "parked_for": turn.parked_for if turn.state == "parked" else None,
            "age_s": round(max(0.0, now - turn.started), 3),
            "held_bytes": held_bytes(turn),
            "splices": turn.splices,  # continuations after cuts (after_commit = continue)
            #: its last attempts, oldest first (the last one may still run: reason "")
            "chain": [_attempt_view(a) for a in turn.attempt_log[-CHAIN_MAX:]],
        }

    def last_failures(self) -> list[dict[str, Any]]:
        """The last failed attempts (what the journal wrote for them), oldest first."""
        return [
            {"turn": turn_id, "route": route, **_attempt_view(a)}
            for turn_id, route, a in self._last_failures
        ]

    def timeline(self, now: float) -> dict[str, Any]:
        """Per second over the last `TIMELINE_S` seconds (seconds without events left out)."""
        since = int(now) - TIMELINE_S
        return {
            "fields": ["at", "ok", "failed", "turns_ok", "turns_failed"],
            "seconds": [list(b) for b in self._timeline if b[0] > since],
        }

    def totals(self) -> dict[str, Any]:
        return {
            "turns": self.turns,
            "outcomes": dict(self.outcomes),
            "attempts": self.attempts,
            "failures": self.failures,
            "failures_by_reason": dict(self.failures_by_reason),
            "failures_by_phase": dict(self.failures_by_phase),
            "retries": self.retries,
            "retry_wait_s": round(self.retry_wait_s, 3),
            "wasted_tokens_est": self.wasted_tokens_est,
            #: cuts after commit finished in place (spliced) or not (refused_<reason>)
            "continuations": dict(self.continuations),
            "saved_tokens_est": self.saved_tokens_est,
        }

    def snapshot(self) -> dict[str, Any]:
        now = time.time()
        turns = sorted(self.inflight(), key=lambda t: (t.started, t.id))
        data: dict[str, Any] = {
            "version": __version__,
            "now": now,
            "started": self.started,
            "uptime_s": round(now - self.started, 3),
            "inflight": [self.turn_view(t, now) for t in turns],
            "upstreams": self.upstreams(),
            "totals": self.totals(),
            "last_failures": self.last_failures(),
            "timeline": self.timeline(now),
        }
        if self.extra is not None:
            data.update(self.extra())
        return data


def _attempt_view(a: AttemptInfo) -> dict[str, Any]:
    return {
        "n": a.number,
        "upstream": a.upstream,
        "choice": a.choice,
        "reason": a.reason,  # "ok", a failure label, or "" while the attempt runs
        "phase": a.phase,
        "status": a.status,
        "started": round(a.started, 3),
        "ended": None if a.ended is None else round(a.ended, 3),
    }


# -- the terminal view --------------------------------------------------------------------
def _dur(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    if seconds < 10:
        return f"{seconds:.1f}s"
    if seconds < 3600:
        m, s = divmod(int(seconds), 60)
        return f"{m}m{s:02d}s" if m else f"{s}s"
    h, rest = divmod(int(seconds), 3600)
    return f"{h}h{rest // 60:02d}m"


def _size(n: int) -> str:
    if n < 1024:
        return f"{n} B"
    if n < 1024 * 1024:
        return f"{n / 1024:.1f} KiB"
    return f"{n / 1024 / 1024:.1f} MiB"


#: the colour of an in-flight turn's state
INFLIGHT_STATE_STYLE = {
    "waiting": "yellow",
    "parked": "magenta",
    "holding": "cyan",
    "streaming": "green",
    "done": "dim",
}
#: "Since start" lists this many failure reasons, then "and N more".
TOP_REASONS = 6
#: A narrow column grows past its header up to this width before wide columns get space.
NARROW_CAP = 16


@dataclass(frozen=True)
class _Col:
    header: str
    #: wide columns (URLs, failure lists) wrap their whole value; narrow ones truncate with …
    wide: bool = False
    justify: str = "left"
    #: a narrow column's floor, when its values matter more than its header's length
    floor: int = 0


def _lines(cell: Any) -> list[str]:
    return str(cell.plain if hasattr(cell, "plain") else cell).split("\n")


def fit_widths(cols: Sequence[_Col], rows: Sequence[Sequence[Any]], width: int) -> list[int]:
    """Column widths for a table (no outer edge, see `_table`) that fits ``width`` cells.

    Every column first gets its floor: a narrow column its header (so no header is
    ever cut) or its own ``floor``, a wide one its header's longest word (it wraps).
    Spare room goes to the narrow columns, up to their content (at most
    `NARROW_CAP`), then to the wide ones, up to their content, then to the narrow
    ones again.  A terminal too narrow even for the floors shrinks the widest
    narrow columns (truncated with an ellipsis).
    """
    from rich.cells import cell_len

    n = len(cols)
    avail = max(n, width - (3 * n - 1))  # a border between columns, padding 1 on each side
    natural = []
    for i, col in enumerate(cols):
        cells = [line for row in rows for line in _lines(row[i])]
        natural.append(max([cell_len(col.header), *(cell_len(c) for c in cells)]))
    floor = [
        max(cell_len(w) for w in col.header.split())
        if col.wide
        else max(cell_len(col.header), col.floor)
        for col in cols
    ]
    widths = list(floor)
    narrow = [i for i, c in enumerate(cols) if not c.wide]
    while sum(widths) > avail:
        i = max(narrow or range(n), key=lambda j: widths[j])
        if widths[i] <= 1:
            break
        widths[i] -= 1
    spare = avail - sum(widths)
    wide = [i for i, c in enumerate(cols) if c.wide]
    for group, cap in ((narrow, NARROW_CAP), (wide, None), (narrow, None)):
        target = {
            i: natural[i] if cap is None else min(natural[i], max(cap, floor[i])) for i in group
        }
        while spare > 0:
            short = [i for i in group if widths[i] < target[i]]
            if not short:
                break
            for i in short[:spare]:
                widths[i] += 1
                spare -= 1
    return widths


def _table(title: str, cols: Sequence[_Col], rows: Sequence[Sequence[Any]], width: int) -> Any:
    from rich.table import Table

    # No outer edge; the edge padding stays (rich 13.7 sizes columns differently without it).
    table = Table(title=title, title_justify="left", expand=False, show_edge=False)
    for col, w in zip(cols, fit_widths(cols, rows, width), strict=True):
        table.add_column(
            col.header,
            width=w,
            no_wrap=not col.wide,
            overflow="fold" if col.wide else "ellipsis",
            justify=col.justify,  # type: ignore[arg-type]
        )
    for row in rows:
        table.add_row(*row)
    return table


INFLIGHT_COLS: Final = (
    _Col("turn"),
    _Col("route"),
    _Col("state", floor=9),
    _Col("try", justify="right"),
    _Col("upstream", wide=True),
    _Col("last failure", wide=True),
    _Col("retry"),
    _Col("age", floor=6),
    _Col("held", floor=7),
)
UPSTREAM_COLS: Final = (
    _Col("route"),
    _Col("upstream", wide=True),
    _Col("up"),
    _Col("ok", justify="right"),
    _Col("failed", justify="right"),
    _Col("recent failures", wide=True),
    _Col("cool-off"),
)


class StatusView:
    """The terminal view of one ``/status`` snapshot; it fits the console's width."""

    def __init__(self, data: dict[str, Any], url: str = "") -> None:
        self.data = data
        self.url = url

    def __rich_console__(self, console: Any, options: Any) -> Any:
        yield from self.parts(options.max_width)

    def parts(self, width: int) -> list[Any]:
        from rich.text import Text

        data = self.data
        totals = data.get("totals", {})
        inflight = data.get("inflight", [])
        head = Text()
        head.append(f"unbroken {data.get('version', '?')}", style="bold")
        if self.url:
            head.append(f" at {self.url}")
        head.append(f"  up {_dur(data.get('uptime_s'))}  ")
        head.append(f"{len(inflight)} in flight", style="bold")
        journal = data.get("journal")
        if isinstance(journal, dict) and journal.get("healthy") is False:
            dropped = journal.get("dropped", 0)
            head.append(f"  journal NOT WRITTEN ({dropped} rows dropped)", style="red")
        parked = sum(1 for t in inflight if t.get("state") == "parked")
        if parked:
            head.append(f"  {parked} parked", style="magenta")
        workers = data.get("workers")
        if isinstance(workers, list) and workers:
            head.append(f"  {len(workers)} workers")
        store = data.get("store")
        if isinstance(store, dict) and store.get("state") == "degraded":
            head.append(f"  {store.get('kind', 'store')} store DEGRADED", style="red")
        for u in data.get("upstreams", []):
            pacer = u.get("pacer") if isinstance(u, dict) else None
            if isinstance(pacer, dict) and pacer.get("waiting"):
                # the upstream's line: retries waiting for its pacer, breaker or cool-off
                ramp = ", ramping" if pacer.get("ramping") else ""
                head.append(
                    f"  {u.get('route')}/{u.get('upstream')}: {pacer['waiting']} in line{ramp}",
                    style="yellow",
                )
            limits = u.get("ratelimits") if isinstance(u, dict) else None
            for rl in limits if isinstance(limits, list) else ():
                if isinstance(rl, dict) and rl.get("waiting"):
                    # turns waiting for the provider's budget on one key (a hash)
                    head.append(
                        f"  {u.get('route')}/{u.get('upstream')}: {rl['waiting']} waiting for "
                        f"the rate limit (key {rl.get('credential', '?')})",
                        style="yellow",
                    )

        rows: list[list[Any]] = []
        for t in inflight:
            state = t.get("state", "")
            retry_in = t.get("next_retry_in_s")
            rows.append(
                [
                    str(t.get("id")),
                    t.get("route", ""),
                    Text(state, style=INFLIGHT_STATE_STYLE.get(state, "")),
                    str(t.get("attempts", 0)),
                    t.get("upstream", ""),
                    t.get("last_failure") or "-",
                    # a parked turn waits for its upstream's line: say for what
                    _dur(retry_in) if retry_in is not None else (t.get("parked_for") or "-"),
                    _dur(t.get("age_s")),
                    _size(int(t.get("held_bytes") or 0)) if t.get("held_bytes") else "-",
                ]
            )
        if not rows:
            rows.append(["-", "-", "idle", "", "", "", "", "", ""])
        turns = _table("In flight", INFLIGHT_COLS, rows, width)
        if not inflight:
            turns.caption = "nothing in flight"

        now = float(data.get("now") or time.time())
        upstreams = data.get("upstreams", [])
        active = [
            u
            for u in upstreams
            if u.get("ok")
            or u.get("failed")
            or u.get("cooloff_s")
            or u.get("breaker", "closed") != "closed"
        ]
        rows = []
        for u in active:
            recent = u.get("recent_failures", [])[-3:]
            recent_text = "\n".join(
                f"{r['reason']} {_dur(now - r['at'])} ago" for r in reversed(recent)
            )
            rows.append(
                [
                    u.get("route", ""),
                    u.get("upstream", ""),
                    _up_text(u, now),
                    str(u.get("ok", 0)),
                    _failed_text(u),
                    recent_text or "-",
                    _dur(u["cooloff_s"]) if u.get("cooloff_s") else "-",
                ]
            )
        if not rows:
            rows.append(["-", "no traffic yet", "", "", "", "", ""])
        ups = _table("Upstreams", UPSTREAM_COLS, rows, width)
        idle = len(upstreams) - len(active)
        if idle:
            ups.caption = f"{idle} upstream(s) without traffic not shown"
        return [head, turns, ups, since_start(totals)]


def _up_text(u: dict[str, Any], now: float) -> Any:
    """The "up" cell: up, DOWN, or the breaker when it is not closed (open: for how long)."""
    from rich.text import Text

    state = u.get("breaker", "closed")
    if state == "open":
        until = u.get("open_until")
        left = f" {_dur(max(0.0, until - now))}" if isinstance(until, (int, float)) else ""
        return Text(f"OPEN{left}", style="bold red")
    if state == "half_open":
        return Text("probe", style="yellow")
    return Text("up", style="green") if u.get("up") else Text("DOWN", style="bold red")


def _failed_text(u: dict[str, Any]) -> str:
    """Failed attempts since start, and their share of the attempts in the ``ok`` and
    ``failed`` columns beside it.  (It showed the breaker's ``failure_rate``, over its
    30 s window, beside the counts since start: "44 (50%)" where 44 of 46 had failed.)"""
    failed = int(u.get("failed") or 0)
    total = failed + int(u.get("ok") or 0)
    return f"{failed} ({100 * failed / total:.0f}%)" if failed and total else str(failed)


def since_start(totals: dict[str, Any]) -> Any:
    """The "Since start" panel: counts, the top failure reasons and "and N more"."""
    from rich.table import Table

    outcomes = totals.get("outcomes", {})
    tot = Table(title="Since start", title_justify="left", show_header=False, expand=False)
    tot.add_column("what")
    tot.add_column("count", justify="right")
    tot.add_row("turns", str(totals.get("turns", 0)))
    for name in (*OUTCOME_NAMES, *(o for o in outcomes if o not in OUTCOME_NAMES)):
        if outcomes.get(name):
            tot.add_row(f"  {name}", str(outcomes[name]))
    tot.add_row("attempts", str(totals.get("attempts", 0)))
    tot.add_row("upstream failures", str(totals.get("failures", 0)))
    by_reason = sorted(totals.get("failures_by_reason", {}).items(), key=lambda kv: -kv[1])
    for reason, n in by_reason[:TOP_REASONS]:
        tot.add_row(f"  {reason}", str(n))
    rest = by_reason[TOP_REASONS:]
    if rest:
        tot.add_row(f"  and {len(rest)} more", str(sum(n for _, n in rest)))
    tot.add_row("retries", str(totals.get("retries", 0)))
    tot.add_row("time waiting", _dur(totals.get("retry_wait_s", 0.0)))
    tot.add_row("wasted tokens (est.)", str(totals.get("wasted_tokens_est", 0)))
    return tot


def render(data: dict[str, Any], url: str = "") -> StatusView:
    """A rich renderable of one ``/status`` snapshot (it fits the console's width)."""
    return StatusView(data, url)


def _render_error(url: str, message: str) -> Any:
    from rich.text import Text

    return Text(f"unbroken status: cannot reach {url}/status ({message}); retrying", style="red")


def _auth_headers() -> dict[str, str]:
    """The relay's token, when one is set (``UNBROKEN_TOKEN``): /status needs it then."""
    token = os.environ.get("UNBROKEN_TOKEN")
    return {"x-unbroken-token": token} if token else {}


async def fetch_status(url: str, timeout: float = 5.0) -> dict[str, Any]:  # noqa: ASYNC109
    import aiohttp

    async with (
        aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout)) as session,
        session.get(f"{url}/status", headers=_auth_headers()) as resp,
    ):
        resp.raise_for_status()
        data: dict[str, Any] = await resp.json()
        return data


async def watch(
    url: str, interval: float = 1.0, *, console: Any = None, max_updates: int | None = None
) -> int:
    """Redraw the view in place every ``interval`` seconds (until Ctrl-C or ``max_updates``)."""
    import aiohttp
    from rich.console import Console
    from rich.live import Live

    console = console or Console()
    updates = 0
    shown = redact_url(url)  # a /t/<token>/ in --url is never printed
    with Live(_render_error(shown, "connecting"), console=console, auto_refresh=False) as live:
        while max_updates is None or updates < max_updates:
            try:
                data = await fetch_status(url)
                live.update(render(data, shown), refresh=True)
            except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
                live.update(_render_error(shown, type(exc).__name__), refresh=True)
            updates += 1
            if max_updates is None or updates < max_updates:
                await asyncio.sleep(interval)
    return 0


async def _once(url: str, as_json: bool) -> int:
    import json

    import aiohttp
    from rich.console import Console

    shown = redact_url(url)  # a /t/<token>/ in --url is never printed
    try:
        data = await fetch_status(url)
    except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
        detail = _hide(f"{type(exc).__name__} {exc}", url)
        print(f"unbroken status: cannot reach {shown}/status: {detail}")
        return 1
    if as_json:
        print(json.dumps(data, indent=2))
    else:
        Console().print(render(data, shown))
    return 0


def _hide(text: str, url: str) -> str:
    """``text`` without the secret parts of ``url`` (an error message may quote it)."""
    shown = redact_url(url)
    if shown == url:
        return text
    text = text.replace(url, shown)
    path = urlsplit(url).path
    if "/t/" not in path:
        return text
    secret = path.split("/t/", 1)[1].split("/", 1)[0]
    return text.replace(secret, REDACTED_PART) if len(secret) >= 8 else text


#: The shortest refresh interval ``unbroken status`` accepts (seconds).
MIN_INTERVAL_S: Final = 0.2


def _status(args: argparse.Namespace) -> int:
    if not args.interval >= MIN_INTERVAL_S:  # also refuses NaN
        print(
            f"unbroken status: --interval must be at least {MIN_INTERVAL_S} s, "
            f"got {args.interval:g}",
            file=sys.stderr,
        )
        return 2
    url = args.url.rstrip("/")
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        print(
            f"unbroken status: --url must be an http(s) URL such as {DEFAULT_URL}, "
            f"got {redact_url(args.url)!r}",
            file=sys.stderr,
        )
        return 2
    try:
        # Redrawing in place needs a terminal: into a file or a pipe, one snapshot.
        if args.once or args.json or not sys.stdout.isatty():
            return asyncio.run(_once(url, args.json))
        return asyncio.run(watch(url, args.interval))
    except KeyboardInterrupt:
        return 0


def register(sub: Any) -> None:
    p = sub.add_parser(
        "status",
        help="live view of a running relay (in-flight turns, upstreams)",
        description="A live terminal view of a relay's GET /status: the turns in flight, "
        "each upstream's recent failures, totals since start. Redraws until Ctrl-C; when "
        "stdout is not a terminal (a file, a pipe), prints one snapshot and exits.",
    )
    p.add_argument(
        "--url",
        default=os.environ.get("UNBROKEN_URL") or DEFAULT_URL,
        help=f"the relay's base URL (default: $UNBROKEN_URL, else {DEFAULT_URL})",
    )
    p.add_argument(
        "--interval",
        type=float,
        default=1.0,
        metavar="SECONDS",
        help=f"seconds between refreshes, at least {MIN_INTERVAL_S} (default: %(default)s)",
    )
    p.add_argument(
        "--once",
        action="store_true",
        help="print one snapshot and exit (the default when stdout is not a terminal)",
    )
    p.add_argument("--json", action="store_true", help="print the raw /status JSON once")
    p.set_defaults(func=_status)
