"""``unbroken demo``: a storm against the mock provider, with and without the relay.

Needs no network and no keys.  Starts the fault-injecting mock provider and a
relay in front of it (both on loopback, ephemeral ports), then drives N
concurrent agent-like turns through the relay with the official ``openai``
SDK: each turn streams a tool call, "runs" it, and streams the answer.  Every
turn has its own scripted storm (503 bursts, a 429 with Retry-After, resets
before output, a reset mid-tool-arguments, a drop after output, a stall).
Then the same storms run straight against the mock, with the same client, for
contrast.

The client is the same both times: the openai SDK with its defaults (two
retries of its own) and a short read timeout, in an agent loop that retries a
failed step once, as agents do.  A turn is *lost* when a step fails twice.

``--protocol gemini`` runs the same kind of storm over the Gemini API
(``:streamGenerateContent?alt=sse``, a whole ``functionCall``, Google RPC errors,
``RetryInfo``): the client is then a plain Gemini API client (aiohttp) with no
retries of its own, in the same agent loop.  Its storms are the Gemini API's own
(`unbroken.demo_gemini`): a 429 names its wait in ``RetryInfo.retryDelay``, an ``error`` object
arrives inside the stream, and since a function call arrives whole there is no
"mid-tool-args": the cuts before output come before the call's event.

Every completed stream is checked against the exact reply the mock sends
(``unbroken.mock.frames_for``): a frame delivered twice (a leaked replay)
counts as a duplicate, which must never happen.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import logging
import sys
import textwrap
import time
from collections import Counter
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from unbroken.config import JournalSettings, parse_config
from unbroken.core.turn.machine import NOT_FAILURES, Outcome
from unbroken.demo_gemini import gemini_agent_turn, gemini_storms
from unbroken.demo_messages import TEXT_REPLY, TOOL_REPLY, messages_agent_turn, messages_storms
from unbroken.mock import MockProvider, frames_for
from unbroken.observe.hooks import AttemptInfo, Hooks, TurnRecord
from unbroken.relay.server import RelayServer

__all__ = ["DEMO_PROTOCOLS", "STORMS", "DemoTurn", "register", "run_demo"]

MODEL = "mock-coder-1"
ROUTE = "demo"
#: the wire protocols the demo's agent can speak (`run_demo`'s ``protocol``)
DEMO_PROTOCOLS = ("chat", "gemini", "anthropic")
#: ``--after-commit``: the relay's ``[stream] after_commit`` for the run
AFTER_COMMIT = ("error", "continue")
#: the protocols whose cut answer the relay can continue in place (``continue``): the
#: Gemini API documents no model-role continuation, so a Gemini cut always ends in error
CONTINUE_PROTOCOLS = ("chat", "anthropic")
NO_GEMINI_CONTINUE = (
    "--after-commit continue needs --protocol chat or anthropic: the Gemini API has no "
    "way to continue a cut answer, so its drops after output always end in an error"
)
AGENT_RETRIES = 1  # the agent loop retries a failed step once
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "bash",
            "description": "Run a shell command.",
            "parameters": {
                "type": "object",
                "properties": {"command": {"type": "string"}},
                "required": ["command"],
            },
        },
    }
]


@dataclass(frozen=True)
class Storm:
    name: str
    #: the turn's queue at the mock: faults and the replies of its two steps, in order
    script: tuple[dict[str, Any], ...]

    @property
    def faults(self) -> int:
        return sum(int(a.get("count", 1)) for a in self.script if "fault" in a or "status" in a)


def storms(
    *, retry_after_s: float = 1.0, stall_s: float = 20.0, protocol: str = "chat"
) -> list[Storm]:
    """The storm of each kind of turn (chat frames: 1 role, 2 tool start, 3-10 arguments;
    Gemini frames: 1 the whole ``functionCall``, 2 the finish; text: 8 pieces)."""
    if protocol == "gemini":
        return [Storm(name, script) for name, script in gemini_storms(retry_after_s, stall_s)]
    if protocol == "anthropic":
        return [Storm(name, script) for name, script in messages_storms(retry_after_s, stall_s)]
    return [
        Storm("503 burst", ({"status": 503, "count": 6}, TOOL_REPLY, TEXT_REPLY)),
        Storm(
            "429 + Retry-After",
            (
                {"status": 429, "headers": {"Retry-After": f"{retry_after_s:g}"}},
                TOOL_REPLY,
                TEXT_REPLY,
            ),
        ),
        Storm(
            "resets before output",
            (
                {"fault": "reset", "after_frame": 1, "reply": "tool", "count": 2},
                TOOL_REPLY,
                TEXT_REPLY,
            ),
        ),
        Storm(
            "reset mid-tool-args",
            ({"fault": "reset", "after_frame": 5, "reply": "tool"}, TOOL_REPLY, TEXT_REPLY),
        ),
        Storm(
            "drop after output",
            (TOOL_REPLY, {"fault": "reset", "after_frame": 4, "reply": "text"}, TEXT_REPLY),
        ),
        Storm(
            "stall",
            (
                {"fault": "stall", "after_frame": 1, "seconds": stall_s, "reply": "tool"},
                TOOL_REPLY,
                TEXT_REPLY,
            ),
        ),
    ]


STORMS = storms()


@dataclass
class DemoTurn:
    """One agent turn as the client lived it."""

    number: int
    storm: str
    key: str
    step: int = 0  # 0: the tool call, 1: the answer, 2: done
    state: str = "queued"  # queued | requesting | streaming | retrying | done | LOST
    errors: int = 0  # errors that reached the agent
    last_error: str | None = None
    chunks: int = 0
    duplicates: int = 0  # chunks of a completed stream beyond the exact reply
    corrupted: int = 0  # completed streams whose text or tool call differs from the reply
    completed: bool = False
    lost: bool = False


class _Absorbed(Hooks):
    """Upstream failures by label, before commit (absorbed) and after (reached the client)."""

    def __init__(self) -> None:
        self.before: Counter[str] = Counter()
        self.after: Counter[str] = Counter()
        self.by_session: Counter[str] = Counter()  # absorbed, per agent session
        self.continued = 0  # cuts after output finished in place (after_commit = continue)
        self.gave_up = 0  # attempts the client abandoned (its own timeout) before they ended

    def continuation(self, turn: TurnRecord, result: str) -> None:
        if result == "spliced":
            self.continued += 1

    def attempt_ended(self, turn: TurnRecord, attempt: AttemptInfo) -> None:
        if attempt.reason == Outcome.ABORTED_BY_CLIENT:
            self.gave_up += 1
        if attempt.reason in NOT_FAILURES:
            return
        if attempt.phase == "committed":
            self.after[attempt.reason] += 1
        else:
            self.before[attempt.reason] += 1
            self.by_session[turn.session_id or ""] += 1


@dataclass
class DemoRun:
    name: str
    turns: list[DemoTurn]
    server: RelayServer | None = None
    absorbed: _Absorbed | None = None
    started: float = field(default_factory=time.monotonic)
    seconds: float = 0.0


def _expected(shape: dict[str, Any], request: dict[str, Any]) -> tuple[int, str, str]:
    """(chunks, text, tool arguments) of the clean reply the mock sends."""
    chunks, text, args = 0, "", ""
    for frame in frames_for("chat", shape, request):
        data = frame.decode().removeprefix("data: ").strip()
        if data == "[DONE]":
            continue
        chunks += 1
        obj = json.loads(data)
        for choice in obj.get("choices") or []:
            delta = choice.get("delta") or {}
            text += delta.get("content") or ""
            for tc in delta.get("tool_calls") or []:
                args += (tc.get("function") or {}).get("arguments") or ""
    return chunks, text, args


async def _agent_turn(client: Any, turn: DemoTurn) -> None:
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": "You are a coding agent. Use the bash tool."},
        {"role": "user", "content": f"Task {turn.number}: say hello from the shell."},
    ]
    headers = {"x-mock-key": turn.key, "x-session-id": f"demo-session-{turn.number}"}
    for step, shape in enumerate((TOOL_REPLY, TEXT_REPLY)):
        turn.step = step
        request = {
            "model": MODEL,
            "messages": messages,
            "tools": TOOLS,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        want_chunks, want_text, want_args = _expected(shape, request)
        for _try in range(1 + AGENT_RETRIES):
            turn.state = "requesting"
            chunks = 0
            text = args = ""
            call_id = ""
            try:
                stream = await client.chat.completions.create(**request, extra_headers=headers)
                turn.state = "streaming"
                async for chunk in stream:
                    chunks += 1
                    turn.chunks += 1
                    for choice in chunk.choices:
                        text += choice.delta.content or ""
                        for tc in choice.delta.tool_calls or []:
                            call_id = call_id or tc.id or ""
                            if tc.function is not None:
                                args += tc.function.arguments or ""
            except Exception as exc:  # what an agent sees: SDK errors, read timeouts, resets
                turn.errors += 1
                turn.last_error = type(exc).__name__
                turn.state = "retrying"
                continue
            turn.duplicates += max(0, chunks - want_chunks)
            if text != want_text or args != want_args:
                turn.corrupted += 1
            break
        else:
            turn.state = "LOST"
            turn.lost = True
            return
        if shape is TOOL_REPLY:
            messages = [
                *messages,
                {
                    "role": "assistant",
                    "content": None,
                    "tool_calls": [
                        {
                            "id": call_id or "call_0",
                            "type": "function",
                            "function": {"name": "bash", "arguments": args},
                        }
                    ],
                },
                {"role": "tool", "tool_call_id": call_id or "call_0", "content": "hello"},
            ]
    turn.step = 2
    turn.state = "done"
    turn.completed = True


async def _drive(
    run: DemoRun,
    base_url: str,
    client_timeout_s: float,
    on_tick: Callable[[DemoRun], None] | None,
    protocol: str = "chat",
) -> None:
    if protocol == "anthropic":
        async with aiohttp.ClientSession(
            timeout=aiohttp.ClientTimeout(
                total=None, sock_connect=client_timeout_s, sock_read=client_timeout_s
            ),
            headers={"User-Agent": "unbroken-demo"},
        ) as messages_session:
            await _tick_while(
                run,
                on_tick,
                [
                    messages_agent_turn(messages_session, base_url, t, MODEL, AGENT_RETRIES)
                    for t in run.turns
                ],
            )
        return
    if protocol == "gemini":
        session = aiohttp.ClientSession(
            timeout=aiohttp.ClientTimeout(
                total=None, sock_connect=client_timeout_s, sock_read=client_timeout_s
            ),
            headers={"User-Agent": "unbroken-demo"},
        )
        try:
            await _tick_while(
                run,
                on_tick,
                [gemini_agent_turn(session, base_url, t, MODEL, AGENT_RETRIES) for t in run.turns],
            )
        finally:
            await session.close()
        return
    import openai

    client = openai.AsyncOpenAI(
        base_url=f"{base_url}/v1", api_key="demo-no-key-needed", timeout=client_timeout_s
    )
    try:
        await _tick_while(run, on_tick, [_agent_turn(client, t) for t in run.turns])
    finally:
        await client.close()


async def _tick_while(
    run: DemoRun,
    on_tick: Callable[[DemoRun], None] | None,
    turns: list[Coroutine[Any, Any, None]],
) -> None:
    """Run the turns, with the live table refreshed meanwhile."""
    ticker: asyncio.Task[None] | None = None
    if on_tick is not None:

        async def tick() -> None:
            while True:
                on_tick(run)
                await asyncio.sleep(0.1)

        ticker = asyncio.ensure_future(tick())
    try:
        await asyncio.gather(*turns)
    finally:
        run.seconds = time.monotonic() - run.started
        if ticker is not None:
            ticker.cancel()
        if on_tick is not None:
            on_tick(run)


def _turns(n: int, kinds: list[Storm], prefix: str) -> list[DemoTurn]:
    return [
        DemoTurn(number=i + 1, storm=kinds[i % len(kinds)].name, key=f"{prefix}-{i + 1}")
        for i in range(n)
    ]


def _script(mock: MockProvider, turns: list[DemoTurn], kinds: list[Storm]) -> int:
    by_name = {s.name: s for s in kinds}
    faults = 0
    for t in turns:
        storm = by_name[t.storm]
        mock.script(list(storm.script), key=t.key)
        faults += storm.faults
    return faults


async def run_demo(
    *,
    turns: int = 12,
    direct: bool = True,
    retry_after_s: float = 1.0,
    stall_s: float = 20.0,
    client_timeout_s: float = 5.0,
    journal: str | None = None,
    on_tick: Callable[[DemoRun], None] | None = None,
    protocol: str = "chat",
    after_commit: str = "error",
) -> dict[str, Any]:
    """Run the storm through the relay (and straight at the mock); return the summary.

    ``protocol``: ``chat`` (the openai SDK, Chat Completions), ``gemini`` (the Gemini
    API's ``streamGenerateContent``) or ``anthropic`` (Messages).  ``after_commit``:
    the relay's ``[stream] after_commit``; ``continue`` finishes a drop after output in
    place (Messages by prefill; Chat by the mock's documented ``prefix`` mode)."""
    if protocol not in DEMO_PROTOCOLS:
        raise ValueError(f"protocol: expected one of {', '.join(DEMO_PROTOCOLS)}, got {protocol!r}")
    if after_commit not in AFTER_COMMIT:
        raise ValueError(f"after_commit: expected one of {', '.join(AFTER_COMMIT)}")
    if after_commit == "continue" and protocol not in CONTINUE_PROTOCOLS:
        raise ValueError(NO_GEMINI_CONTINUE)
    route: dict[str, Any] = {}  # the demo route's keys beside its upstream
    if after_commit == "continue":
        route["after_commit"] = "continue"
        if protocol == "chat":
            route["chat_prefix"] = "prefix"  # the mock continues a prefix: true message
    kinds = storms(retry_after_s=retry_after_s, stall_s=stall_s, protocol=protocol)
    async with MockProvider(host="127.0.0.1", port=0, record=False) as mock:
        config = parse_config(
            {
                # Each turn's storm is scripted on its own: fixed waits and no circuit
                # breaker, so the turns do not pay for each other's faults (one mock
                # upstream takes all twelve storms; with breakers on it would open and
                # park every turn, and an exponential backoff would outgrow the client's
                # 5 s read timeout).  The stream timers are scaled to that timeout: early
                # headers (then keepalives) come well before it, as the default 20 s come
                # before an SDK's 600 s.  With the default 20 s, a turn parked behind a
                # 429 for 3 s and then stalled waited 5 s for its headers: the client gave
                # up before the relay's 2 s stall timer fired (journaled aborted_by_client).
                "retry": {"delay_ms": 200, "backoff": "fixed", "verbose": False},
                "health": {"breakers": False},
                "stream": {
                    "first_frame_timeout_s": 2.0,
                    "idle_timeout_s": 1.0,
                    "keepalive_s": 2.0,
                    "early_headers_s": 1.0,
                },
                "routes": {ROUTE: {**route, "upstreams": [{"url": mock.url}]}},
            },
            env={},
        )
        config = dataclasses.replace(
            config,
            port=0,
            grace_s=2.0,
            journal=JournalSettings(enabled=journal is not None, path=journal),
        )
        relay_turns = _turns(turns, kinds, "relay")
        faults = _script(mock, relay_turns, kinds)
        absorbed = _Absorbed()
        server = RelayServer(config, hooks=absorbed)
        await server.start()
        run = DemoRun("Through unbroken", relay_turns, server, absorbed)
        try:
            await _drive(run, f"{server.url}/{ROUTE}", client_timeout_s, on_tick, protocol)
            totals = server.status.totals()
        finally:
            await server.stop()

        direct_run: DemoRun | None = None
        if direct:
            mock.reset()
            direct_turns = _turns(turns, kinds, "direct")
            _script(mock, direct_turns, kinds)
            direct_run = DemoRun("Straight to the mock, no relay", direct_turns)
            await _drive(direct_run, mock.url, client_timeout_s, on_tick, protocol)

    summary: dict[str, Any] = {
        "protocol": protocol,
        "after_commit": after_commit,
        "continued": absorbed.continued,
        "turns": turns,
        "completed": sum(t.completed for t in relay_turns),
        "lost": sum(t.lost for t in relay_turns),
        "faults_injected": faults,
        "failures_absorbed": sum(absorbed.before.values()),
        "failures_after_commit": sum(absorbed.after.values()),
        "absorbed_by_reason": dict(absorbed.before.most_common()),
        "after_commit_by_reason": dict(absorbed.after.most_common()),
        "client_errors": sum(t.errors for t in relay_turns),
        "client_gave_up": absorbed.gave_up,
        "duplicates": sum(t.duplicates for t in relay_turns),
        "corrupted": sum(t.corrupted for t in relay_turns),
        "retries": totals["retries"],
        "wasted_tokens_est": totals["wasted_tokens_est"],
        "seconds": round(run.seconds, 2),
        "storms": dict(Counter(t.storm for t in relay_turns)),
        "direct_completed": None,
        "direct_lost": None,
        "direct_client_errors": None,
        "direct_duplicates": None,
        "direct_seconds": None,
    }
    if direct_run is not None:
        summary.update(
            direct_completed=sum(t.completed for t in direct_run.turns),
            direct_lost=sum(t.lost for t in direct_run.turns),
            direct_client_errors=sum(t.errors for t in direct_run.turns),
            direct_duplicates=sum(t.duplicates for t in direct_run.turns),
            direct_seconds=round(direct_run.seconds, 2),
        )
    return summary


# -- terminal output -------------------------------------------------------------------------
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
            session = f"demo-session-{t.number}"
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
    if s.get("protocol") == "anthropic":
        client = (
            "Client: a Messages client (POST /v1/messages, streamed) with no retries of its "
            "own and a short read timeout"
        )
    elif s.get("protocol") == "gemini":
        client = (
            "Client: a Gemini API client (streamGenerateContent?alt=sse) with no retries of "
            "its own and a short read timeout"
        )
    else:
        client = "Client: openai SDK defaults (2 retries) and a short read timeout"
    lines += [
        "",
        f"{client}, in an agent loop that retries a failed step once; a turn is lost when a "
        "step fails twice.",
    ]
    return "\n".join(wrapped for line in lines for wrapped in _wrap(line, width))


def _demo(args: argparse.Namespace) -> int:
    logger = logging.getLogger("unbroken")
    level = logger.level
    logger.setLevel(logging.ERROR)  # the table is the output
    try:
        return _run_demo_command(args)
    finally:
        logger.setLevel(level)


def _run_demo_command(args: argparse.Namespace) -> int:
    if args.turns < 1:
        print("unbroken demo: --turns must be at least 1", file=sys.stderr)
        return 2
    if args.after_commit == "continue" and args.protocol not in CONTINUE_PROTOCOLS:
        print(f"unbroken demo: {NO_GEMINI_CONTINUE}", file=sys.stderr)
        return 2
    from rich.console import Console
    from rich.live import Live

    console = Console()
    live_view = console.is_terminal and not args.json
    kinds = storms(protocol=args.protocol)
    if not args.json:
        over = {"gemini": " over the Gemini API", "anthropic": " over Anthropic Messages"}.get(
            args.protocol, ""
        )
        console.print(
            f"[bold]unbroken demo[/bold]: {args.turns} concurrent agent turns{over} (a streamed "
            "tool call, then the answer), each under its own storm: "
            + ", ".join(s.name for s in kinds)
            + ". No network, no keys: a local mock provider plays the LLM.\n"
        )
    live: Live | None = None
    current: list[str] = []

    def on_tick(run: DemoRun) -> None:
        nonlocal live
        if live is None or not current or current[-1] != run.name:
            if live is not None:
                live.stop()
            current.append(run.name)
            live = Live(render_run(run, console.width), console=console, auto_refresh=False)
            live.start()
        live.update(render_run(run, console.width), refresh=True)

    try:
        summary = asyncio.run(
            run_demo(
                turns=args.turns,
                direct=not args.no_direct,
                journal=args.journal,
                on_tick=on_tick if live_view else None,
                protocol=args.protocol,
                after_commit=args.after_commit,
            )
        )
    finally:
        if live is not None:
            live.stop()
    if args.json:
        print(json.dumps(summary))
    else:
        console.print()
        console.print(
            format_summary(summary, min(console.width, 80)), highlight=False, soft_wrap=True
        )
    ok = summary["completed"] == summary["turns"] and summary["duplicates"] == 0
    return 0 if ok else 1


def register(sub: Any) -> None:
    p = sub.add_parser(
        "demo", help="watch the relay absorb a scripted storm (no network, no keys, < 60 s)"
    )
    p.add_argument(
        "--turns", type=int, default=12, help="concurrent agent turns (default: %(default)s)"
    )
    p.add_argument("--json", action="store_true", help="print the summary as one JSON object")
    p.add_argument(
        "--protocol",
        choices=DEMO_PROTOCOLS,
        default="chat",
        help="the agent's wire protocol: chat (the openai SDK, Chat Completions), "
        "gemini (the Gemini API's streamGenerateContent) or anthropic (Messages) "
        "(default: %(default)s)",
    )
    p.add_argument(
        "--after-commit",
        choices=AFTER_COMMIT,
        default="error",
        help="the relay's [stream] after_commit: continue finishes a drop after output in "
        "place, with no error (Messages by prefill, Chat by a prefix mode; the Gemini "
        "API has no continuation) "
        "(default: %(default)s)",
    )
    p.add_argument(
        "--no-direct", action="store_true", help="skip the run straight against the mock"
    )
    p.add_argument(
        "--journal",
        metavar="FILE",
        help="also write the relay's journal to this SQLite file, for `unbroken "
        "stats --journal FILE` (default: none)",
    )
    p.set_defaults(func=_demo)
