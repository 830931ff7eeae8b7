"""Issue 23's OpenCode acceptance: 20 cuts after output, finished in place by the relay.

OpenCode runs as a server (``unbroken run --config FILE -- opencode serve``), so
unbroken's auto-resumer watches it too, with one of its built-in providers pointed at
the mock the way a user points it at a proxy: ``openai`` (Responses, which OpenCode
sends with ``store: false``) or ``anthropic`` (Messages, no thinking).  The user's
unbroken config sets ``after_commit = "continue"`` (in ``[stream]``, or in the
provider's ``[routes.NAME]``).  The mock cuts the stream
20 times, each time after the client has seen output.  The facts gathered here are
what OpenCode saw (its events, its session's text, the failures it logged), what
reached the provider (OpenCode's own requests and the relay's continuations), and
what unbroken's journal recorded.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import sqlite3
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from e2e.oc_harness import (
    BUILTIN_MODELS,
    Background,
    OpenCodeClient,
    Sandbox,
    TimedMock,
    builtin_provider,
    free_port,
    is_continuation,
    run_to_end,
    step_requests,
    unbroken_run,
)
from unbroken.opencode.resume import SETTLE_S

#: Cuts after output in one turn (the issue's acceptance figure).
CUTS = 20
#: The reply: long enough that every one of the 21 pieces carries new text.
WORDS = [f"w{i:02d}" for i in range(1, 65)]
LONG_TEXT = "Resumed " + " ".join(WORDS) + " done."
DELTAS = 64
#: The user's unbroken config for ``unbroken run --config FILE -- opencode``: the
#: setting for every route, ...
CONTINUE_TOML = '[stream]\nafter_commit = "continue"\n'
#: ... or for the provider's route only (``run`` points it at OpenCode's base URL and
#: keeps its settings).
ROUTE_TOML = (
    '[routes.anthropic]\nupstreams = ["https://api.anthropic.com/v1"]\nafter_commit = "continue"\n'
)


#: The text-then-tool case (Anthropic): the text before the call, and the last answer.
LEAD_TEXT = "Let me run the command that writes the marker file, then check it."
TOOL_DONE = "The marker file has its line."
TOOL_CUTS = 5


def reply() -> dict[str, Any]:
    return {"text": LONG_TEXT, "deltas": DELTAS}


def cut_script(provider: str, cuts: int = CUTS) -> list[dict[str, Any]]:
    """``cuts`` resets, each after output reached the client, then a clean finish.

    The first request (OpenCode's) is cut after two text deltas.  Each continuation
    takes the next action from the mock's queue (docs/mock.md): a Responses resume
    (``GET ...?starting_after=N``, whose frames start with the next delta) is cut after
    two of its frames; an Anthropic prefill continuation (the scripted text goes on
    after the prefix) after two of its deltas.
    """
    first = {**reply(), "fault": "reset", "after_deltas": 2}
    if provider == "openai":
        later = {"fault": "reset", "after_frame": 2}
    else:
        later = {**reply(), "fault": "reset", "after_deltas": 2}
    return [first, *(dict(later) for _ in range(cuts - 1)), reply()]


def every_request_cut(cuts: int = CUTS) -> list[dict[str, Any]]:
    """The same cuts for the default setting, where each cut reaches OpenCode and it
    sends the step again: each of its requests is cut after two text deltas."""
    return [{**reply(), "fault": "reset", "after_deltas": 2, "count": cuts}, reply()]


@dataclass
class AfterCommitRun:
    provider: str
    outcome: str  # completed | dead | timeout
    text: str  # the assistant text in OpenCode's session
    steps: int  # model requests OpenCode itself sent
    continuations: int  # requests the relay made to finish the turn in place
    retries: list[dict[str, Any]]  # OpenCode's session.status retry events
    errors: list[dict[str, Any]]  # session.error events
    stream_errors: int  # failures OpenCode logged ('message="stream error"')
    resumes: int  # unbroken's auto-resume decisions ('resume session=' in the log)
    journal: list[dict[str, Any]]  # unbroken's journal: the turns
    stats: dict[str, Any]  # `unbroken stats --json` on that journal
    sent: list[dict[str, Any]]  # the bodies of the POSTs that reached the provider
    cancels: int  # background responses the relay cancelled
    resume_cursors: list[int]  # ``starting_after`` of each Responses resume, in order
    elapsed: float  # from the prompt to the end of the turn
    marker_lines: list[str] = field(default_factory=list)  # the project's marker.txt
    log: str = ""
    requests: list[str] = field(default_factory=list)  # method, path, query per request


def journal_path(box: Sandbox) -> Path:
    """Where ``unbroken run`` keeps its journal by default (``$XDG_STATE_HOME/unbroken``)."""
    return box.dirs["state"] / "unbroken" / "journal.sqlite3"


def _journal(box: Sandbox) -> list[dict[str, Any]]:
    """The turns unbroken's journal recorded."""
    path = journal_path(box)
    if not path.exists():
        return []
    with contextlib.closing(sqlite3.connect(path)) as conn:
        conn.row_factory = sqlite3.Row
        return [dict(r) for r in conn.execute("SELECT * FROM turns ORDER BY started")]


async def _stats(box: Sandbox) -> dict[str, Any]:
    """``unbroken stats --json`` on the run's journal, as the user would ask for it."""
    path = journal_path(box)
    if not path.exists():
        return {}
    argv = [sys.executable, "-m", "unbroken", "stats", "--json", "--since", "all"]
    done = await run_to_end([*argv, "--journal", str(path)], box, limit_s=60)
    if done.code != 0:
        return {"exit": done.code, "stderr": done.stderr[-2000:]}
    data: dict[str, Any] = json.loads(done.stdout)
    return data


def marker_path(box: Sandbox) -> Path:
    """The file the scripted ``bash`` call appends to."""
    return box.project / "marker.txt"


def marker_lines(box: Sandbox) -> list[str]:
    path = marker_path(box)
    return path.read_text().splitlines() if path.exists() else []


def text_then_bash(cuts: int = TOOL_CUTS) -> list[dict[str, Any]]:
    """OpenCode's first step answers with text, then a ``bash`` call that appends a line
    to the project's marker.txt; the text is cut ``cuts`` times (each continuation
    brings the rest of the text, then the call).  The step after the tool result
    answers ``TOOL_DONE``."""
    lead = {
        "reply": "text_tool",
        "text": LEAD_TEXT,
        "deltas": 12,
        "tool_name": "bash",
        "tool_args": {"command": "echo ran >> marker.txt", "description": "Append a line"},
    }
    cut = {**lead, "fault": "reset", "after_deltas": 2}
    return [*(dict(cut) for _ in range(cuts)), lead, {"text": TOOL_DONE}]


def _text(messages: list[dict[str, Any]]) -> str:
    """The text of the session's assistant messages, in order."""
    out: list[str] = []
    for m in messages:
        if m.get("info", {}).get("role") != "assistant":
            continue
        out.extend(p.get("text", "") for p in m.get("parts", []) if p.get("type") == "text")
    return "".join(out)


async def after_commit_session(
    provider: str,
    *,
    tag: str,
    box_for: Any,
    config: str | None = CONTINUE_TOML,
    limit_s: float = 120.0,
    script: list[dict[str, Any]] | None = None,
    prompt: str = "say hi",
) -> AfterCommitRun:
    """One prompt through ``unbroken run --config FILE -- opencode serve`` while the mock
    cuts the stream ``CUTS`` times after output (``config=None``: no unbroken config,
    today's default)."""
    box: Sandbox = box_for(tag)
    model = BUILTIN_MODELS[provider]
    options: tuple[str, ...] = ()
    if config is not None:
        toml = box.root / "unbroken.toml"
        toml.write_text(config)
        options = ("--config", str(toml))
    async with TimedMock() as mock:
        mock.script(cut_script(provider) if script is None else script)
        mock.set_default(reply())
        box.write_global_config(builtin_provider(provider, mock.url + "/v1"))
        port = free_port()
        argv = unbroken_run(
            "serve",
            "--print-logs",
            "--log-level",
            "WARN",
            "--port",
            str(port),
            options=options,
        )
        text = ""
        async with Background(argv, box) as bg:
            client = OpenCodeClient(f"http://127.0.0.1:{port}")
            try:
                assert bg.proc is not None
                proc = bg.proc
                try:
                    await client.wait_healthy(alive=lambda: proc.returncode is None)
                except AssertionError:
                    raise AssertionError(
                        f"`unbroken run -- opencode serve` exited {proc.returncode} before "
                        f"OpenCode's server came up:\n{bg.output()[-3000:]}"
                    ) from None
                await client.subscribe()
                sid = await client.create_session()
                prompted = time.monotonic()
                await client.prompt_async(sid, prompt, model=model)

                def ended() -> str | None:
                    for e in client.events.of("message.updated", sid):
                        info = e["properties"]["info"]
                        if info.get("role") == "assistant" and info.get("finish") == "stop":
                            return "completed"
                    if client.events.of("session.error", sid) and client.events.of(
                        "session.idle", sid
                    ):
                        return "dead"
                    return None

                try:
                    outcome = await client.events.wait_for(ended, limit_s)
                except TimeoutError:
                    outcome = "timeout"
                elapsed = time.monotonic() - prompted
                if outcome == "completed":
                    # The auto-resumer decides when the session goes idle (after
                    # SETTLE_S) and logs a resume at once: watch for one a while.
                    with contextlib.suppress(TimeoutError):
                        await client.events.wait_for(
                            lambda: client.events.of("session.idle", sid), 30
                        )
                    await asyncio.sleep(SETTLE_S + 2.0)
                text = _text(await client.messages(sid))
                retries = [
                    e
                    for e in client.events.of("session.status", sid)
                    if (e["properties"].get("status") or {}).get("type") == "retry"
                ]
                errors = client.events.of("session.error", sid)
            finally:
                await client.close()
        log = bg.output()
    return AfterCommitRun(
        provider=provider,
        outcome=outcome,
        text=text,
        steps=len(step_requests(mock)),
        continuations=sum(1 for r in mock.requests if is_continuation(r)),
        retries=retries,
        errors=errors,
        stream_errors=log.count('message="stream error"'),
        resumes=len(re.findall(r"\bresume session=", log)),
        journal=_journal(box),
        stats=await _stats(box),
        sent=[r.json() for r in mock.requests if r.method == "POST" and r.body],
        cancels=len(mock.background.cancels),
        resume_cursors=[
            int(r.query.get("starting_after", "-1")) for r in mock.requests if r.method == "GET"
        ],
        elapsed=elapsed,
        marker_lines=marker_lines(box),
        log=log,
        requests=[f"{r.method} {r.path} {dict(r.query)}" for r in mock.requests],
    )
