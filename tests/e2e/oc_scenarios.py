"""The end-to-end scenarios, each with unbroken (and, with ``UNBROKEN_E2E_ALONE=1``,
OpenCode alone beside it where that proves something: recorded below otherwise).

Each scenario is a coroutine returning plain facts; the tests assert on them.  They
all run concurrently (`Batch`, below; conftest.py's ``scenarios`` fixture starts it), so
the suite pays for the slowest only.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import json
import os
import re
import shutil
import sys
import tempfile
import threading
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, TypedDict, overload

from e2e.oc_after_commit import (
    ROUTE_TOML,
    AfterCommitRun,
    after_commit_session,
    every_request_cut,
    text_then_bash,
)
from e2e.oc_harness import (
    Background,
    Finished,
    OpenCodeClient,
    Sandbox,
    TimedMock,
    fake_provider,
    free_port,
    kill_leftovers,
    max_per_second,
    opencode,
    run_args,
    run_to_end,
    turn_requests,
    unbroken_run,
)
from unbroken.config import parse_config
from unbroken.observe.hooks import Hooks, TurnRecord
from unbroken.relay.server import RelayServer

TEXT = "Hello from the mock provider."
SEED_FAILURES = 20

#: OpenCode alone (no unbroken) in these scenarios: facts about the pinned OpenCode,
#: not about the relay, so they are recorded here once instead of run beside every
#: relayed run (four more OpenCode processes, one of them a hot re-prompt loop, in
#: the busiest minute of the suite).  Measured with
#: ``UNBROKEN_E2E_ALONE=1 pytest -m e2e tests/e2e/test_opencode_e2e.py``: with that
#: variable set the scenarios run OpenCode alone too and the tests check these again
#: (tests/e2e/test_opencode_e2e.py; the test suite of 2026-12-06 passed them).  A new
#: OpenCode pin must be measured again: `ALONE_VERSION` must be the pinned version.
ALONE_VERSION = "1.18.33"
ALONE_ENV = "UNBROKEN_E2E_ALONE"
#: 30 x 503: OpenCode's first try and its 5 retries, then exit 1 (the time is the
#: docs' figure, `docsamples.documented_storm_seconds`, within 12 s)
STORM_ALONE_REQUESTS = 6
STORM_ALONE_EXIT = 1
#: resets before any output: OpenCode retried twice itself (3 requests)
RESET_ALONE_REQUESTS = 3
#: a clean end with no finish chunk: OpenCode re-prompts at once, 13-15 requests/s on
#: a quiet two-core machine, 0.4/s the lowest seen (load average 10): this one
DROP_ALONE_MIN_PER_SECOND = 0.4
#: 20 drops after output: OpenCode's 6 provider turns, then the session is dead
SEED_ALONE_TURNS = 6


def measure_alone() -> bool:
    """Whether the scenarios run OpenCode alone too (`ALONE_ENV`)."""
    return bool(os.environ.get(ALONE_ENV))


#: A stream that emits text ("Hello f"), then dies with no finish chunk.
CUT_AFTER_TEXT = {"fault": "reset", "after_frame": 3}


#: Every sandbox made (about 100 MB each: OpenCode unpacks its native libraries).
SANDBOXES: list[Path] = []


def _box(tag: str) -> Sandbox:
    root = Path(tempfile.mkdtemp(prefix=f"unbroken-e2e-{tag}-"))
    SANDBOXES.append(root)
    return Sandbox(root)


def remove_sandboxes() -> None:
    """Delete the sandboxes (kept when ``UNBROKEN_E2E_KEEP`` is set, for a post-mortem)."""
    if os.environ.get("UNBROKEN_E2E_KEEP"):
        return
    while SANDBOXES:
        shutil.rmtree(SANDBOXES.pop(), ignore_errors=True)


@dataclass
class SessionRun:
    """One prompt through an OpenCode server."""

    outcome: str  # completed | dead | timeout
    turns: int  # provider requests that carried the turn
    recovered_on: int | None  # the turn request that succeeded
    resumes: int
    elapsed: float
    max_per_second: int
    times: list[float] = field(default_factory=list)
    log: str = ""


async def _session(
    *, with_unbroken: bool, script: list[dict[str, Any]], env: dict[str, str], limit_s: float
) -> SessionRun:
    box = _box("seed-with" if with_unbroken else "seed-without")
    async with TimedMock() as mock:
        mock.script(script)
        box.write_global_config(fake_provider(mock.url + "/v1"))
        port = free_port()
        make = unbroken_run if with_unbroken else opencode
        start = time.monotonic()
        async with Background(make("serve", "--port", str(port)), box, env) as bg:
            client = OpenCodeClient(f"http://127.0.0.1:{port}")
            try:
                assert bg.proc is not None
                proc = bg.proc
                await client.wait_healthy(alive=lambda: proc.returncode is None)
                await client.subscribe()
                sid = await client.create_session()
                await client.prompt_async(sid, "say hi")

                def ended() -> str | None:
                    for e in client.events.of("message.updated", sid):
                        info = e["properties"]["info"]
                        if info.get("role") == "assistant" and info.get("finish") == "stop":
                            return "completed"
                    if not with_unbroken and client.events.of("session.error", sid):
                        if client.events.of("session.idle", sid):
                            return "dead"
                    return None

                try:
                    outcome = await client.events.wait_for(ended, limit_s)
                except TimeoutError:
                    outcome = "timeout"
                if outcome == "dead":
                    await asyncio.sleep(6)  # a dead session stays dead: no further requests
            finally:
                await client.close()
        log = bg.output()
    turns = turn_requests(mock)
    first = mock.times[0] if mock.times else start
    return SessionRun(
        outcome=outcome,
        turns=len(turns),
        recovered_on=len(turns) if outcome == "completed" else None,
        resumes=len(re.findall(r"resumed session=", log)),
        elapsed=time.monotonic() - start,
        max_per_second=max_per_second(mock.times),
        times=[round(t - first, 1) for t in mock.times],
        log=log,
    )


async def seed() -> dict[str, SessionRun]:
    """The plugin's verification: a provider that opens a stream, emits text, then dies
    with no finish chunk, 20 times in a row, then answers."""
    script = [{**CUT_AFTER_TEXT, "count": SEED_FAILURES}]
    env = {"UNBROKEN_RESUME_DELAY_MS": "1000"}
    with_ = _session(with_unbroken=True, script=script, env=env, limit_s=330)
    if not measure_alone():
        return {"with": await with_}
    without, done = await asyncio.gather(
        _session(with_unbroken=False, script=script, env={}, limit_s=150), with_
    )
    return {"without": without, "with": done}


@dataclass
class CliRun:
    finished: Finished
    requests: int
    times: list[float]
    extra: dict[str, Any] = field(default_factory=dict)


async def _cli(
    tag: str,
    script: list[dict[str, Any]],
    *,
    with_unbroken: bool,
    prompt: tuple[str, ...] = (),
    default: dict[str, Any] | None = None,
    limit_s: float = 200,
    window: float | None = None,
) -> CliRun:
    """``opencode run`` once, directly or through ``unbroken run``."""
    box = _box(tag)
    async with TimedMock() as mock:
        mock.script(script)
        if default is not None:
            mock.set_default(default)
        box.write_global_config(fake_provider(mock.url + "/v1"))
        args = run_args(*prompt)
        argv = unbroken_run(*args) if with_unbroken else opencode(*args)
        if window is None:
            finished = await run_to_end(argv, box, limit_s=limit_s)
        else:
            finished = await _for_window(argv, box, mock, window)
        first = mock.times[0] if mock.times else 0.0
        return CliRun(finished, len(turn_requests(mock)), [t - first for t in mock.times])


async def _for_window(argv: list[str], box: Sandbox, mock: TimedMock, window: float) -> Finished:
    """Run until ``window`` seconds after the first provider request, then stop it."""
    start = time.monotonic()
    async with Background(argv, box) as bg:
        await mock.wait_for_requests(1, timeout=120)
        await asyncio.sleep(window)
        assert bg.proc is not None
        code = bg.proc.returncode
    return Finished(-1 if code is None else code, "", bg.output(), time.monotonic() - start)


async def storm() -> dict[str, CliRun]:
    """503s that outlast OpenCode's own 5 retries."""
    script = [{"status": 503, "count": 30}]
    return await _with_and_alone(
        _cli("storm-with", script, with_unbroken=True),
        lambda: _cli("storm-without", script, with_unbroken=False),
    )


async def _with_and_alone(
    with_: Awaitable[CliRun], alone: Callable[[], Awaitable[CliRun]]
) -> dict[str, CliRun]:
    """The relayed run, and OpenCode alone beside it when `measure_alone`."""
    if not measure_alone():
        return {"with": await with_}
    without, done = await asyncio.gather(alone(), with_)
    return {"without": without, "with": done}


async def reset_before_output() -> dict[str, CliRun]:
    """Resets before any output: right after the headers, and after the role chunk."""
    script = [
        {"fault": "reset", "after_frame": 0},
        {"fault": "reset", "after_frame": 1},
    ]
    return await _with_and_alone(
        _cli("reset-with", script, with_unbroken=True),
        lambda: _cli("reset-without", script, with_unbroken=False),
    )


async def tool_reset() -> dict[str, CliRun]:
    """A reset in the middle of a bash tool call's arguments (after 2 of 8 fragments)."""
    box = _box("tool-with")
    async with TimedMock() as mock:
        marker = box.project / "marker.txt"
        tool = {
            "reply": "tool",
            "tool_name": "bash",
            "tool_args": {"command": f"echo ran >> {marker}", "description": "Append a line"},
        }
        mock.script([{**tool, "fault": "reset", "after_frame": 5}, tool])
        box.write_global_config(fake_provider(mock.url + "/v1"))
        args = run_args("append", "a", "line", "to", "marker.txt")
        finished = await run_to_end(unbroken_run(*args), box, limit_s=120)
        lines = marker.read_text().splitlines() if marker.exists() else []
        run = CliRun(finished, len(turn_requests(mock)), [], {"marker_lines": lines})
    return {"with": run}


async def drop_after_output() -> dict[str, CliRun]:
    """Every stream emits text, then ends cleanly with no finish chunk: OpenCode alone
    re-prompts at once, without limit.  Count upstream requests per second."""
    default = {**CUT_AFTER_TEXT, "fault": "end"}
    window = 15.0
    runs = await _with_and_alone(
        _cli("drop-with", [], with_unbroken=True, default=default, window=window),
        lambda: _cli("drop-without", [], with_unbroken=False, default=default, window=window),
    )
    for run in runs.values():
        inside = [t for t in run.times if t <= window]
        run.extra["per_second"] = len(inside) / window
        run.extra["max_per_second"] = max_per_second(inside)
    return runs


class _Turns(Hooks):
    def __init__(self) -> None:
        self.ended: list[TurnRecord] = []

    def turn_ended(self, turn: TurnRecord) -> None:
        self.ended.append(turn)


class SetupUndo(TypedDict):
    """What `setup_undo` saw, in order."""

    original: bytes  # the project's opencode.json, with a comment
    first: Finished  # `unbroken opencode setup --project`
    patched: bytes
    second: Finished  # the same setup again
    patched_again: bytes
    backup: bytes  # opencode.json.unbroken-backup
    through: Finished  # `opencode run` through the relay
    turns_via_relay: int
    undone: Finished  # `unbroken opencode undo --project`
    restored: bytes
    backup_left: bool
    direct: Finished  # `opencode run` after the undo
    turns_after_undo: int
    requests: int  # provider requests, both runs


async def setup_undo() -> SetupUndo:
    """``unbroken opencode setup --project`` then ``undo`` on a real opencode.json."""
    box = _box("setup")
    async with TimedMock() as mock:
        toml = box.root / "unbroken.toml"
        toml.write_text(f'[routes.fake]\nupstreams = [{{ url = "{mock.url}/v1" }}]\n')
        config = dataclasses.replace(
            parse_config({"routes": {"fake": {"upstreams": [f"{mock.url}/v1"]}}}, env={}),
            port=0,
            grace_s=1.0,
        )
        turns = _Turns()
        relay = RelayServer(config, hooks=turns)
        await relay.start()
        try:
            path = box.project / "opencode.json"
            original = (
                "// my project's OpenCode config\n" + _indent_json(fake_provider(mock.url + "/v1"))
            ).encode()
            path.write_bytes(original)
            cmd = [sys.executable, "-m", "unbroken", "opencode"]
            setup_cmd = [*cmd, "setup", "--project", "--config", str(toml), "--relay", relay.url]
            first = await run_to_end(setup_cmd, box, limit_s=30)
            patched = path.read_bytes()
            second = await run_to_end(setup_cmd, box, limit_s=30)
            patched_again = path.read_bytes()
            backup = path.with_name("opencode.json.unbroken-backup").read_bytes()
            through = await run_to_end(opencode(*run_args()), box, limit_s=60)
            turns_via_relay = len(turns.ended)
            undone = await run_to_end([*cmd, "undo", "--project"], box, limit_s=30)
            restored = path.read_bytes()
            direct = await run_to_end(opencode(*run_args()), box, limit_s=60)
            return {
                "original": original,
                "first": first,
                "patched": patched,
                "second": second,
                "patched_again": patched_again,
                "backup": backup,
                "through": through,
                "turns_via_relay": turns_via_relay,
                "undone": undone,
                "restored": restored,
                "backup_left": path.with_name("opencode.json.unbroken-backup").exists(),
                "direct": direct,
                "turns_after_undo": len(turns.ended),
                "requests": len(mock.requests),
            }
        finally:
            await relay.stop()


def _indent_json(data: Any) -> str:
    return json.dumps(data, indent=2) + "\n"


async def after_commit_openai() -> AfterCommitRun:
    """Issue 23: OpenCode's built-in ``openai`` provider (Responses), 20 cuts after output,
    with ``[stream] after_commit = "continue"``."""
    return await after_commit_session("openai", tag="after-commit-openai", box_for=_box)


async def after_commit_default() -> AfterCommitRun:
    """The contrast: the same 20 cuts with no unbroken config (``after_commit`` is
    ``"error"``): OpenCode sees every cut and retries until its retries are spent."""
    return await after_commit_session(
        "openai",
        tag="after-commit-default",
        box_for=_box,
        config=None,
        script=every_request_cut(),
        limit_s=240,
    )


async def after_commit_anthropic() -> AfterCommitRun:
    """Issue 23: OpenCode's built-in ``anthropic`` provider (Messages, text, no thinking),
    20 cuts after output, with ``[routes.anthropic] after_commit = "continue"``."""
    return await after_commit_session(
        "anthropic", tag="after-commit-anthropic", box_for=_box, config=ROUTE_TOML
    )


async def after_commit_tool() -> AfterCommitRun:
    """Issue 23: OpenCode's ``anthropic`` provider answers text then a ``bash`` call; the
    text is cut 5 times and continued by prefill; the call arrives whole, once."""
    return await after_commit_session(
        "anthropic",
        tag="after-commit-tool",
        box_for=_box,
        script=text_then_bash(),
        prompt="append a line to marker.txt",
    )


#: The scenarios by the kind of result they give (`Batch.result` is typed by these).
CliScenario = Literal["storm", "reset_before_output", "tool_reset", "drop_after_output"]
AfterCommitScenario = Literal[
    "after_commit_openai", "after_commit_anthropic", "after_commit_tool", "after_commit_default"
]
ScenarioName = Literal["seed", "setup_undo", CliScenario, AfterCommitScenario]
Outcome = dict[str, SessionRun] | dict[str, CliRun] | SetupUndo | AfterCommitRun

SCENARIOS: dict[ScenarioName, Callable[[], Awaitable[Outcome]]] = {
    "seed": seed,
    "storm": storm,
    "reset_before_output": reset_before_output,
    "tool_reset": tool_reset,
    "drop_after_output": drop_after_output,
    "setup_undo": setup_undo,
    "after_commit_openai": after_commit_openai,
    "after_commit_anthropic": after_commit_anthropic,
    "after_commit_tool": after_commit_tool,
    "after_commit_default": after_commit_default,
}


def scenario_name(value: object) -> ScenarioName:
    """A ``pytest.mark.scenario`` argument as the scenario it names."""
    for name in SCENARIOS:
        if name == value:
            return name
    raise LookupError(f"no e2e scenario named {value!r} (oc_scenarios.SCENARIOS)")


#: Seconds after the first e2e test each scenario starts (the longest first).
START_AFTER_S: dict[ScenarioName, float] = {
    "seed": 0.0,
    "storm": 2.0,
    "setup_undo": 8.0,
    "reset_before_output": 14.0,
    "tool_reset": 20.0,
    "drop_after_output": 30.0,
    # these count from the end of the scenario they wait for (AFTER), if it runs
    "after_commit_openai": 0.0,
    "after_commit_anthropic": 8.0,
    "after_commit_tool": 16.0,
    "after_commit_default": 24.0,
}
#: Scenarios that start only once another one (when selected) has ended: the
#: hot-loop rate drop_after_output measures needs the CPU that OpenCode servers
#: starting beside it would take.
AFTER: dict[ScenarioName, ScenarioName] = {
    name: "drop_after_output"
    for name in (
        "after_commit_openai",
        "after_commit_anthropic",
        "after_commit_tool",
        "after_commit_default",
    )
}


class Batch:
    """A background event loop running the scenarios; results are futures."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="e2e", daemon=True)
        self.thread.start()
        self.futures: dict[ScenarioName, concurrent.futures.Future[Outcome]] = {}

    def start(self, name: ScenarioName) -> None:
        if name not in self.futures:
            self.futures[name] = asyncio.run_coroutine_threadsafe(self._run(name), self.loop)

    async def _run(self, name: ScenarioName) -> Outcome:
        # Staggered: a dozen OpenCode processes starting at once would starve the
        # measurements of CPU on a small machine.
        after = AFTER.get(name)
        first = self.futures.get(after) if after is not None else None
        if first is not None:
            await asyncio.wait([asyncio.wrap_future(first)])  # its outcome is its test's
        await asyncio.sleep(START_AFTER_S.get(name, 0.0))
        return await SCENARIOS[name]()

    @overload
    def result(self, name: Literal["seed"], timeout: float) -> dict[str, SessionRun]: ...
    @overload
    def result(self, name: CliScenario, timeout: float) -> dict[str, CliRun]: ...
    @overload
    def result(self, name: Literal["setup_undo"], timeout: float) -> SetupUndo: ...
    @overload
    def result(self, name: AfterCommitScenario, timeout: float) -> AfterCommitRun: ...
    def result(self, name: ScenarioName, timeout: float) -> Outcome:
        """The scenario's result, once it has run (started now if no test started it)."""
        self.start(name)
        return self.futures[name].result(timeout)

    def close(self) -> None:
        for fut in self.futures.values():
            fut.cancel()  # cancels the task: processes are killed in their finally blocks

        async def drain() -> None:
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            if tasks:
                await asyncio.wait(tasks, timeout=15)

        with_timeout = asyncio.run_coroutine_threadsafe(drain(), self.loop)
        try:
            with_timeout.result(20)
        except (concurrent.futures.TimeoutError, concurrent.futures.CancelledError):
            pass
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        kill_leftovers()
        remove_sandboxes()
