"""``unbroken stats [--since 24h] [--json]``: what the journal says happened.

Reads the SQLite journal (see `unbroken.observe.journal`) and reports turns by
outcome, the recovery rate, failures by phase, cause and upstream, retries
per turn, time spent waiting, estimated wasted tokens and the replay-safety
view.  `compute_stats` is the whole report as one JSON-able dict.
"""

from __future__ import annotations

import argparse
import json
import re
import sqlite3
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

from unbroken.config import ConfigError, load_config
from unbroken.core.turn.machine import NOT_FAILURES, OUTCOME_NAMES
from unbroken.observe.journal import SCHEMA, journal_path

__all__ = ["compute_stats", "format_stats", "parse_since", "percentile", "register"]

_UNITS = {"s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0, "w": 7 * 86400.0}


#: what ``--since`` accepts, said in its errors
SINCE_FORMS = (
    "a number and a unit: s, m, h, d or w (90s, 30m, 24h, 7d, 2w; 1.5h; no unit: "
    "seconds), with or without a minus sign (-5h: since 5 hours ago, as 5h), or all"
)


def parse_since(text: str) -> float | None:
    """``90s``, ``30m``, ``24h``, ``7d``, ``2w`` (``-5h`` as ``5h``: ago) -> seconds;
    ``all`` -> None."""
    text = text.strip().lower()
    if text == "all":
        return None
    m = re.fullmatch(r"-?\s*(\d+(?:\.\d+)?)\s*([smhdw]?)", text)
    if not m:
        raise ValueError(f"expected {SINCE_FORMS}; got {text!r}")
    return float(m.group(1)) * _UNITS[m.group(2) or "s"]


def percentile(values: list[float], p: float) -> float | None:
    """Nearest-rank percentile (``p`` in 0..100) of ``values``; None when empty."""
    if not values:
        return None
    ordered = sorted(values)
    rank = max(1, -(-len(ordered) * p // 100))  # ceil(n * p / 100), at least 1
    return ordered[int(rank) - 1]


def _dist(values: list[float], digits: int = 3) -> dict[str, float | None]:
    def r(v: float | None) -> float | None:
        return None if v is None else round(v, digits)

    return {
        "p50": r(percentile(values, 50)),
        "p99": r(percentile(values, 99)),
        "max": r(max(values) if values else None),
    }


def _queued(conn: sqlite3.Connection) -> str:
    """The ``queued_s`` column, or 0 in a journal written before it (version < 4)."""
    columns = {row[1] for row in conn.execute("PRAGMA table_info(turns)")}
    return "queued_s" if "queued_s" in columns else "0"


def _continued(conn: sqlite3.Connection, cutoff: float) -> dict[str, int]:
    """Turns finished in place after cuts (``after_commit = "continue"``): how many,
    the continuations they made, and the output a redo would have sampled again."""
    columns = {row[1] for row in conn.execute("PRAGMA table_info(turns)")}
    if "splices" not in columns:  # a journal written before version 5
        return {"turns": 0, "splices": 0, "saved_tokens_est": 0}
    turns, splices, saved = conn.execute(
        "SELECT COUNT(*), COALESCE(SUM(splices), 0), COALESCE(SUM(saved_tokens), 0)"
        " FROM turns WHERE started >= ? AND splices > 0",
        (cutoff,),
    ).fetchone()
    return {"turns": turns, "splices": splices, "saved_tokens_est": saved}


def _refused(conn: sqlite3.Connection, cutoff: float) -> dict[str, dict[str, int]]:
    """Turns continue mode refused (``after_commit = "continue"``), by reason: how
    many, and how many of them a cut after output then ended with an error (what
    continue mode would have finished)."""
    columns = {row[1] for row in conn.execute("PRAGMA table_info(turns)")}
    if "continuation" not in columns:  # a journal written before version 6
        return {}
    rows = conn.execute(
        "SELECT SUBSTR(t.continuation, 9), COUNT(*),"
        " SUM(EXISTS (SELECT 1 FROM attempts a WHERE a.turn_uid = t.uid"
        " AND a.phase = 'committed'))"
        " FROM turns t WHERE t.started >= ? AND t.continuation LIKE 'refused\\_%' ESCAPE '\\'"
        " GROUP BY 1 ORDER BY 2 DESC, 1",
        (cutoff,),
    ).fetchall()
    return {reason: {"turns": n, "cut_after_output": cut or 0} for reason, n, cut in rows}


def compute_stats(
    conn: sqlite3.Connection, *, since_s: float | None = 86400.0, now: float | None = None
) -> dict[str, Any]:
    """The report over turns started in the last ``since_s`` seconds (None: all)."""
    now = time.time() if now is None else now
    cutoff = now - since_s if since_s is not None else float("-inf")
    turns = conn.execute(
        f"SELECT uid, outcome, attempts, wait_s, first_byte_s, {_queued(conn)} FROM turns"
        " WHERE started >= ?",
        (cutoff,),
    ).fetchall()
    attempts = conn.execute(
        "SELECT a.turn_uid, a.upstream, a.reason, a.phase, a.est_output_tokens,"
        " a.input_tokens, a.output_tokens"
        " FROM attempts a JOIN turns t ON t.uid = a.turn_uid WHERE t.started >= ?",
        (cutoff,),
    ).fetchall()

    outcome_of: dict[str, str] = {}
    outcomes: Counter[str] = Counter({o: 0 for o in OUTCOME_NAMES})
    retries: list[float] = []
    waits: list[float] = []
    ttfb: list[float] = []
    queued: list[float] = []
    for uid, outcome, n_attempts, wait_s, first_byte_s, queued_s in turns:
        name = outcome or "unfinished"
        outcome_of[uid] = name
        outcomes[name] += 1
        if outcome is not None:
            retries.append(max(0, (n_attempts or 1) - 1))
            waits.append(wait_s or 0.0)
            queued.append(queued_s or 0.0)
        if first_byte_s is not None:
            ttfb.append(first_byte_s)

    by_phase: Counter[str] = Counter()
    by_cause: Counter[str] = Counter()
    by_upstream: Counter[str] = Counter()
    failed_turns: set[str] = set()
    before: dict[str, int] = {}  # turn -> failures before commit
    after: dict[str, int] = {}
    after_causes: Counter[str] = Counter()
    wasted = 0
    tokens_in = tokens_out = 0
    n_attempts_total = 0
    for uid, upstream, reason, phase, est, t_in, t_out in attempts:
        n_attempts_total += 1
        tokens_in += t_in or 0
        tokens_out += t_out or 0
        if reason in NOT_FAILURES:
            continue
        phase = phase or "unknown"
        by_phase[phase] += 1
        by_cause[reason] += 1
        by_upstream[upstream] += 1
        failed_turns.add(uid)
        if phase == "committed":
            after[uid] = after.get(uid, 0) + 1
            after_causes[reason] += 1
        else:
            before[uid] = before.get(uid, 0) + 1
            wasted += est or 0

    settled = [
        u
        for u in failed_turns
        if outcome_of.get(u) not in (None, "unfinished", "aborted_by_client")
    ]
    # A turn finished in place after a cut (``resumed``) is recovered as well: the
    # client got the whole answer.
    recovered = sum(1 for u in settled if outcome_of[u] in ("recovered", "resumed"))

    def ended(uids: dict[str, int]) -> dict[str, int]:
        return dict(Counter(outcome_of.get(u, "unfinished") for u in uids))

    return {
        "since_s": since_s,
        "from": None if since_s is None else cutoff,
        "until": now,
        "turns": len(turns),
        "outcomes": dict(outcomes),
        "recovery_rate": round(recovered / len(settled), 4) if settled else None,
        "turns_with_failures": len(settled),
        "turns_recovered": recovered,
        "attempts": n_attempts_total,
        "failures": sum(by_phase.values()),
        "failures_by_phase": dict(by_phase.most_common()),
        "failures_by_cause": dict(by_cause.most_common()),
        "failures_by_upstream": dict(by_upstream.most_common()),
        "retries_per_turn": _dist(retries, 0),
        "waiting_s": {"total": round(sum(waits), 3), **_dist(waits)},
        "time_to_first_byte_s": _dist(ttfb),
        #: time turns waited at the relay for the providers' rate limits
        "queued_s": {
            "total": round(sum(queued), 3),
            "turns": sum(1 for q in queued if q > 0),
            **_dist(queued),
        },
        "wasted_tokens_est": wasted,
        "continued": _continued(conn, cutoff),
        "continue_refused": _refused(conn, cutoff),
        "tokens": {"input": tokens_in, "output": tokens_out},
        "replay_safety": {
            "before_commit": {
                "failures": sum(before.values()),
                "turns": len(before),
                "recovered": sum(1 for u in before if outcome_of.get(u) == "recovered"),
                "ended": ended(before),
            },
            "after_commit": {
                "failures": sum(after.values()),
                "turns": len(after),
                "ended": ended(after),
                "by_cause": dict(after_causes.most_common()),
            },
        },
    }


# -- text output --------------------------------------------------------------------------
def _num(v: float | None, unit: str = "") -> str:
    if v is None:
        return "-"
    if isinstance(v, float) and not v.is_integer():
        return f"{v:.2f}{unit}"
    return f"{int(v)}{unit}"


def _counts(d: dict[str, int]) -> str:
    return ", ".join(f"{k} {v}" for k, v in d.items()) or "none"


def format_stats(s: dict[str, Any], *, since: str = "", journal: str = "") -> str:
    lines: list[str] = []
    head = "unbroken stats"
    if since:
        head += f": last {since}" if since != "all" else ": everything"
    if journal:
        head += f" (journal {journal})"
    lines += [head, ""]
    lines.append(f"{'Turns':<26}{s['turns']:>8}")
    for name, n in s["outcomes"].items():
        if n or name in OUTCOME_NAMES[:3]:
            lines.append(f"  {name:<24}{n:>8}")
    rate = s["recovery_rate"]
    if rate is None:
        lines.append(f"{'Recovery rate':<26}{'-':>8}  (no turn hit a failure)")
    else:
        lines.append(
            f"{'Recovery rate':<26}{rate * 100:>7.1f}%  ({s['turns_recovered']} of "
            f"{s['turns_with_failures']} turns that hit a failure ended recovered or resumed)"
        )
    lines.append("")
    lines.append(f"{'Failures':<26}{s['failures']:>8}  (in {s['attempts']} attempts)")
    lines.append(f"  {'by phase':<14}{_counts(s['failures_by_phase'])}")
    lines.append(f"  {'by cause':<14}{_counts(s['failures_by_cause'])}")
    lines.append(f"  {'by upstream':<14}{_counts(s['failures_by_upstream'])}")
    lines.append("")
    r = s["retries_per_turn"]
    lines.append(
        f"{'Retries per turn':<26}p50 {_num(r['p50'])}  p99 {_num(r['p99'])}  max {_num(r['max'])}"
    )
    w = s["waiting_s"]
    lines.append(
        f"{'Time waiting':<26}{_num(w['total'], ' s')} in total; "
        f"per turn p50 {_num(w['p50'], ' s')}, p99 {_num(w['p99'], ' s')}, "
        f"max {_num(w['max'], ' s')}"
    )
    q = s["queued_s"]
    lines.append(
        f"{'Queued for rate limits':<26}{_num(q['total'], ' s')} in total, {q['turns']} turns; "
        f"per turn p50 {_num(q['p50'], ' s')}, p99 {_num(q['p99'], ' s')}"
    )
    t = s["time_to_first_byte_s"]
    lines.append(
        f"{'Time to first byte':<26}p50 {_num(t['p50'], ' s')}, p99 {_num(t['p99'], ' s')}, "
        f"max {_num(t['max'], ' s')}"
    )
    lines.append(
        f"{'Wasted tokens (est.)':<26}{s['wasted_tokens_est']:>8}  "
        "(output generated by attempts that died before commit)"
    )
    c = s.get("continued") or {}
    if c.get("turns"):
        lines.append(
            f"{'Finished in place':<26}{c['turns']:>8}  turns, {c['splices']} continuations "
            f"after cuts; ~{c['saved_tokens_est']} output tokens not sampled again"
        )
    refused = s.get("continue_refused") or {}
    if refused:
        total = sum(r["turns"] for r in refused.values())
        by = ", ".join(
            f"{k} {r['turns']} ({r['cut_after_output']} cut after output)"
            for k, r in refused.items()
        )
        lines.append(f"{'Continue mode refused':<26}{total:>8}  turns: {by}")
    tok = s["tokens"]
    lines.append(f"{'Reported usage':<26}{tok['input']:>8} in, {tok['output']} out")
    lines.append("")
    b = s["replay_safety"]["before_commit"]
    a = s["replay_safety"]["after_commit"]
    lines.append("Replay safety")
    lines.append(
        f"  before commit   {b['failures']} failures in {b['turns']} turns: "
        f"{b['recovered']} recovered invisibly; ended: {_counts(b['ended'])}"
    )
    lines.append(
        f"  after commit    {a['failures']} failures in {a['turns']} turns (never replayed); "
        f"ended: {_counts(a['ended'])}"
    )
    if a["by_cause"]:
        lines.append(f"                  causes: {_counts(a['by_cause'])}")
    return "\n".join(lines)


def compute_sessions(
    conn: sqlite3.Connection, *, since_s: float | None = 86400.0, now: float | None = None
) -> list[dict[str, Any]]:
    """Turns grouped by client session (``--by session``): which agent sessions hit
    failures.  The sessions with the most failed attempts come first."""
    now = time.time() if now is None else now
    cutoff = now - since_s if since_s is not None else float("-inf")
    columns = {row[1] for row in conn.execute("PRAGMA table_info(turns)")}
    client = "MAX(t.client)" if "client" in columns else "NULL"  # a version 1 journal
    rows = conn.execute(
        f"SELECT t.session_id, {client}, COUNT(*),"
        " SUM(t.outcome = 'recovered'), SUM(t.outcome = 'ended_with_error'),"
        " SUM(MAX(t.attempts - 1, 0)), MIN(t.started), MAX(t.started)"
        " FROM turns t WHERE t.started >= ? GROUP BY t.session_id",
        (cutoff,),
    ).fetchall()
    out = [
        {
            "session_id": sid,
            "client": cl,
            "turns": n,
            "recovered": rec or 0,
            "ended_with_error": ended or 0,
            "failed_attempts": failed or 0,
            "first": first,
            "last": last,
        }
        for sid, cl, n, rec, ended, failed, first, last in rows
    ]
    out.sort(key=lambda r: (-r["failed_attempts"], -r["ended_with_error"], -r["last"]))
    return out


def format_sessions(rows: list[dict[str, Any]], *, since: str = "") -> str:
    head = f"Sessions (since {since})" if since else "Sessions"
    lines = [
        head,
        f"  {'session':<38} {'client':<14} {'turns':>6} {'failed':>7} "
        f"{'recovered':>10} {'errors':>7}",
    ]
    for r in rows:
        sid = r["session_id"] or "(none)"
        if len(sid) > 38:
            sid = sid[:37] + "…"
        lines.append(
            f"  {sid:<38} {(r['client'] or '-'):<14} {r['turns']:>6} "
            f"{r['failed_attempts']:>7} {r['recovered']:>10} {r['ended_with_error']:>7}"
        )
    if not rows:
        lines.append("  (no turns)")
    return "\n".join(lines)


# -- command --------------------------------------------------------------------------------
def _stats(args: argparse.Namespace) -> int:
    try:
        since_s = parse_since(args.since)
    except ValueError as exc:
        print(f"unbroken stats: --since: {exc}", file=sys.stderr)
        return 2
    if args.journal:
        path = Path(args.journal)
        if not path.is_file():
            print(f"unbroken stats: no journal at {path}", file=sys.stderr)
            return 2  # bad input: the file named on the command line is not there
    else:
        try:
            config = load_config(args.config)
        except ConfigError as exc:
            print(f"unbroken: invalid config: {exc}", file=sys.stderr)
            return 2
        path = journal_path(config.journal.path)
        if not config.journal.enabled:
            print(
                "unbroken stats: the journal is off ([journal] enabled = false): "
                "no turn is recorded",
                file=sys.stderr,
            )
            return 1
        if not path.is_file():
            # `unbroken serve` creates it with its first turn: before that, there is
            # nothing to report, which is not an error (JSON: the report of no turns)
            note = (
                f"no turns yet: `unbroken serve` writes the journal to {path} from its first turn"
            )
            if args.json:
                print(json.dumps(_empty_report(args.by == "session", since_s)))
            else:
                print(f"unbroken stats: {note}")
            return 0
    try:
        conn = sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=5.0)
        try:
            if args.by == "session":
                sessions = compute_sessions(conn, since_s=since_s)
            else:
                report = compute_stats(conn, since_s=since_s)
        finally:
            conn.close()
    except sqlite3.Error as exc:
        print(f"unbroken stats: cannot read {path}: {exc}", file=sys.stderr)
        return 1
    if args.by == "session":
        if args.json:
            print(json.dumps({"sessions": sessions}))
        else:
            print(format_sessions(sessions, since=args.since))
        return 0
    if args.json:
        print(json.dumps(report))
    else:
        print(format_stats(report, since=args.since, journal=str(path)))
    return 0


def _empty_report(by_session: bool, since_s: float | None) -> dict[str, Any]:
    """The report of a journal with no turns in it yet."""
    conn = sqlite3.connect(":memory:")
    try:
        conn.executescript(SCHEMA)
        if by_session:
            return {"sessions": compute_sessions(conn, since_s=since_s)}
        return compute_stats(conn, since_s=since_s)
    finally:
        conn.close()


def register(sub: Any) -> None:
    p = sub.add_parser("stats", help="what the journal says happened (outcomes, failures, waste)")
    p.add_argument(
        "--since",
        default="24h",
        help="window: 30m, 24h, 7d, 2w (-5h: the same as 5h), or all (default 24h)",
    )
    p.accept_dashed_value("--since")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument(
        "--by",
        choices=["session"],
        help="group turns by client session (session-id, X-Claude-Code-Session-Id, "
        "x-session-id, prompt_cache_key) (default: no grouping)",
    )
    p.add_argument("--journal", help="journal file (default: [journal] path, or the XDG state dir)")
    p.add_argument("--config", help="TOML config file (default: $UNBROKEN_CONFIG)")
    p.set_defaults(func=_stats)
