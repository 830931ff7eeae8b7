"""``unbroken demo``'s terminal output: the live table of a run, and the summary."""

from __future__ import annotations

import textwrap
import time
from typing import Any

from unbroken.demo.runner import PROTOCOLS, DemoRun

__all__ = ["COMPACT_BELOW", "DEMO_STATE_STYLE", "format_summary", "render_run"]

#: the colour of a demo turn's state and of its relay turn's (from /status)
DEMO_STATE_STYLE = {
    "queued": "dim",
    "requesting": "yellow",
    "streaming": "green",
    "retrying": "bold yellow",
    "done": "bold green",
    "LOST": "bold red",
    "waiting": "yellow",
    "holding": "cyan",
    "parked": "magenta",
}


#: below this many columns, the live table is drawn compact, to fit 80: no rules and no
#: edges, short headers, each turn on one line (a long failure name ends in an ellipsis)
COMPACT_BELOW = 120
#: each column's compact header and width: with the nine spaces between them they add
#: up to 80 (a wider sum made rich squeeze the last columns, their headers cut to ``e…``)
_COMPACT: dict[str, tuple[str, int]] = {
    "turn": ("#", 2),
    "storm": ("storm", 20),
    "step": ("step", 6),
    "client": ("client", 10),
    "relay": ("relay", 9),
    "attempt": ("try", 3),
    "last failure": ("failure", 10),
    "next try": ("next", 5),
    "absorbed": ("abs", 3),
    "errors seen": ("err", 3),
}


def render_run(run: DemoRun, width: int | None = None) -> Any:
    """The live table of one run, for a terminal ``width`` columns wide (None: wide)."""
    from rich import box
    from rich.table import Table
    from rich.text import Text

    relay: dict[str, Any] = {}
    if run.server is not None:
        now = time.time()
        for info in list(run.server.relay.inflight):
            if info.session_id:
                relay[info.session_id] = {
                    "state": info.state,
                    "attempts": info.attempts,
                    "last_failure": info.last_failure,
                    "next": None
                    if info.next_retry_at is None or info.state != "waiting"
                    else max(0.0, info.next_retry_at - now),
                }
    compact = width is not None and width < COMPACT_BELOW
    table = Table(
        title=f"{run.name}  {time.monotonic() - run.started:5.1f} s",
        title_justify="left",
        expand=False,
    )
    if compact:  # no rules between columns, one space between them, no edges
        table.box, table.pad_edge, table.padding = box.SIMPLE_HEAD, False, (0, 0)
        table.show_edge = False

    def column(name: str, justify: Any = "left") -> None:
        if not compact:
            table.add_column(name, justify=justify)
            return
        header, most = _COMPACT[name]
        table.add_column(header, justify=justify, max_width=most, no_wrap=True, overflow="ellipsis")

    column("turn", "right")
    column("storm")
    column("step")
    column("client")
    if run.server is not None:
        column("relay")
        column("attempt", "right")
        column("last failure")
        column("next try")
        column("absorbed", "right")
    column("errors seen", "right")
    for t in run.turns:
        step = ("tool" if compact else "tool call", "answer", "-")[t.step]
        row: list[Any] = [
            str(t.number),
            t.storm,
            step,
            Text(t.state, style=DEMO_STATE_STYLE.get(t.state, "")),
        ]
        if run.server is not None:
            session = t.session
            r = relay.get(session)
            if r is None:
                row += ["-", "", "", ""]
            else:
                row += [
                    Text(r["state"], style=DEMO_STATE_STYLE.get(r["state"], "")),
                    str(r["attempts"]),
                    r["last_failure"] or "",
                    _next_try(r["next"], compact),
                ]
            hidden = run.absorbed.by_session[session] if run.absorbed is not None else 0
            row.append(Text(str(hidden), style="cyan" if hidden else "dim"))
        errors = Text(str(t.errors), style="red" if t.errors else "green")
        row.append(errors)
        table.add_row(*row)
    return table


def _next_try(seconds: float | None, compact: bool) -> str:
    """The wait before a turn's next try: ``in 2.5s``, or in 5 columns ``2.5s``/``125s``."""
    if seconds is None:
        return ""
    if not compact:
        return f"in {seconds:.1f}s"
    return f"{seconds:.1f}s" if seconds < 99.95 else f"{min(seconds, 9999):.0f}s"


def _counts(d: dict[str, int]) -> str:
    return ", ".join(f"{k} ×{v}" for k, v in sorted(d.items(), key=lambda kv: -kv[1]))


#: the summary's label column: a value that wraps goes on below its first character
_LABEL = 24


def _wrap(line: str, width: int) -> list[str]:
    """One summary line in ``width`` columns, broken between words only: a labelled line
    goes on under its value, any other under its own first word."""
    if len(line) <= width:
        return [line]
    indent = _LABEL if line.startswith("  ") and line[_LABEL - 1 : _LABEL] == " " else 0
    wrapped = textwrap.wrap(
        line.replace(" ×", "\0×"),  # a count stays with its name
        width=max(width, indent + 20),
        subsequent_indent=" " * indent,
        break_long_words=False,
        break_on_hyphens=False,
    )
    return [part.replace("\0", " ") for part in wrapped]


def format_summary(s: dict[str, Any], width: int = 80) -> str:
    """The summary, each line within ``width`` columns (broken between words)."""
    n = s["turns"]
    lines = [
        f"Through unbroken ({s['seconds']:.1f} s)",
        f"  turns completed       {s['completed']} of {n}",
        f"  faults injected       {s['faults_injected']}",
        f"  failures absorbed     {s['failures_absorbed']}  ({_counts(s['absorbed_by_reason'])})"
        if s["absorbed_by_reason"]
        else f"  failures absorbed     {s['failures_absorbed']}",
    ]
    if s.get("continued"):
        lines.append(
            f"  continued in place    {s['continued']} drop(s) after output: the turn finished "
            "with no error (after_commit = continue)"
        )
    if s["client_errors"]:
        after = s["failures_after_commit"]
        lines.append(
            f"  what the client saw   {s['client_errors']} error(s); {after} from drops after "
            "output, which unbroken never replays: it ends them with a native, retryable "
            "error (the agent retried the step)"
        )
    else:
        lines.append("  what the client saw   clean streams, nothing else")
    if s.get("client_gave_up"):
        lines.append(
            f"  client gave up        {s['client_gave_up']} attempt(s): its own read timeout "
            "fired before the relay's stall timer, so those faults reached it"
        )
    lines.append(f"  duplicated frames     {s['duplicates']}")
    lines.append(f"  wasted tokens (est.)  {s['wasted_tokens_est']}")
    if s["direct_completed"] is not None:
        lines += [
            "",
            f"Straight against the mock, same storm, same client ({s['direct_seconds']:.1f} s)",
            f"  turns completed       {s['direct_completed']} of {n}  ({s['direct_lost']} lost)",
            f"  what the client saw   {s['direct_client_errors']} errors",
        ]
    client = PROTOCOLS.get(str(s.get("protocol")), PROTOCOLS["chat"]).client
    lines += [
        "",
        f"{client}, in an agent loop that retries a failed step once; a turn is lost when a "
        "step fails twice.",
    ]
    return "\n".join(wrapped for line in lines for wrapped in _wrap(line, width))
