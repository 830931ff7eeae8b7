"""Issue 33: a cut right after a complete tool call, with the real Codex CLI and the real
OpenCode (its built-in ``anthropic`` provider), 20 runs each.

Both start a tool as soon as its call is complete.  The mock resets the connection
right after the call's end (Codex: ``response.output_item.done``, before
``response.completed``; OpenCode: the ``tool_use`` block's ``content_block_stop``,
before ``message_delta``); the model's answer to the same request again is another
call (``echo B``), so a tool that ran twice shows as two lines in the project's marker
file.  Zero config (`unbroken run -- <agent>`): the codex and opencode profiles hold a
complete call until its message ends (``tool_tail``), so the cut is replayed before the
agent has seen the call (or, after text, the call is dropped with the error), and the
tool runs once, 20 runs of 20.  Before issue 33 the call was released at its end and
the error event followed: the agent ran it, retried the step, and ran the model's
second call too (Codex 5 of 5 runs, OpenCode 7 of 10).  ``E2E_TOOL_TAIL_RUNS=N`` runs
fewer, for a quick look.
"""

from __future__ import annotations

import os
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from e2e.agent_run import codex_argv, codex_home, reconnects, report, run, zero_config
from e2e.oc_harness import (
    BUILTIN_MODELS,
    Sandbox,
    TimedMock,
    builtin_provider,
    opencode,
    run_args,
    run_to_end,
    step_requests,
    unbroken_run,
)
from unbroken.mock import MockProvider
from unbroken.mock.wire import events_for

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900)]

#: runs per case (the issue's acceptance figure; fewer for a quick look)
RUNS = int(os.environ.get("E2E_TOOL_TAIL_RUNS", "20"))


def _tool(cmd: str) -> dict[str, Any]:
    return {"reply": "tool", "tool_name": "exec_command", "tool_args": {"cmd": cmd}}


def _cut_after_call(tool: dict[str, Any]) -> dict[str, Any]:
    """The call, whole, then a reset before ``response.completed``."""
    events = events_for("responses", tool, {"model": "fake-model", "stream": True})
    done = max(i for i, (name, _) in enumerate(events) if name == "response.output_item.done")
    return {**tool, "fault": "reset", "after_frame": done + 1}


@pytest.mark.cli("codex")
@pytest.mark.parametrize("socket", [False, True], ids=["http", "websocket"])
async def test_codex_cut_right_after_a_complete_call_runs_the_tool_once(
    tmp_path: Path, mock: MockProvider, capsys: pytest.CaptureFixture[str], socket: bool
) -> None:
    cut = _cut_after_call(_tool("echo A >> marker.txt"))
    again = _tool("echo B >> marker.txt")  # the model's call, asked again
    tallies: list[list[str]] = []
    failures: list[str] = []
    for i in range(RUNS):
        root = tmp_path / f"run{i}"
        provider: dict[str, Any] = {"supports_websockets": True} if socket else {}
        env = codex_home(root, mock.url, **provider)
        mock.reset()
        # over WebSocket Codex first warms its socket (a request of its own)
        mock.script(([{}] if socket else []) + [cut, again])
        r = await run(zero_config(codex_argv(root, "run the tool")), env, root / "project")
        marker = root / "project" / "marker.txt"
        ran = marker.read_text().splitlines() if marker.exists() else []
        tallies.append(ran)
        if r.code != 0 or len(ran) != 1 or reconnects(r):
            failures.append(
                f"run {i}: exit {r.code}, ran {ran}, reconnects {reconnects(r)}, "
                f"{len(mock.requests)} requests; stderr {r.stderr[-1500:]}"
            )
    once = sum(1 for ran in tallies if len(ran) == 1)
    report(
        capsys,
        f"codex ({'websocket' if socket else 'http'}), a reset right after a complete call, "
        f"zero config: the tool ran once in {once} of {RUNS} runs "
        f"(runs by how many times it ran: {sorted(Counter(map(len, tallies)).items())})",
    )
    assert not failures, "\n".join(failures)


# -- OpenCode with its built-in anthropic provider --------------------------------------------
def _bash(cmd: str, reply: str = "tool") -> dict[str, Any]:
    return {
        "reply": reply,
        "text": "Let me append the line.",
        "tool_name": "bash",
        "tool_args": {"command": cmd, "description": "Append a line"},
    }


def _cut_after_block(tool: dict[str, Any]) -> dict[str, Any]:
    """The ``tool_use`` block, whole, then a reset before ``message_delta``."""
    events = events_for("anthropic", tool, {"model": "claude-sonnet-4-5", "stream": True})
    stop = max(i for i, (name, _) in enumerate(events) if name == "content_block_stop")
    return {**tool, "fault": "reset", "after_frame": stop + 1}


async def opencode_runs(
    root: Path, reply: str, *, with_unbroken: bool, runs: int
) -> tuple[list[list[str]], list[str]]:
    """``runs`` one-shot ``opencode run`` turns (anthropic/claude-sonnet-4-5, a bash call
    cut right after its ``content_block_stop``); per run the marker file's lines, and
    a line of facts for each run where the tool did not run exactly once."""
    box = Sandbox(root)
    marker = box.project / "marker.txt"
    tallies: list[list[str]] = []
    odd: list[str] = []
    async with TimedMock() as mock:
        box.write_global_config(builtin_provider("anthropic", mock.url + "/v1"))
        model = BUILTIN_MODELS["anthropic"]
        args = run_args("append", "a", "line", "to", "marker.txt", model=model)
        for i in range(runs):
            marker.unlink(missing_ok=True)
            mock.reset()
            mock.set_default({"text": "Done."})
            cut = _cut_after_block(_bash("echo A >> marker.txt", reply))
            mock.script([cut, _bash("echo B >> marker.txt", reply)])
            argv = unbroken_run(*args) if with_unbroken else opencode(*args)
            done = await run_to_end(argv, box, limit_s=90)
            ran = marker.read_text().splitlines() if marker.exists() else []
            tallies.append(ran)
            # the call alone: replayed, OpenCode never sees the cut; after text it sees
            # the error once and retries the step
            seen = done.stream_errors() != (0 if reply == "tool" else 1)
            if done.code != 0 or len(ran) != 1 or (with_unbroken and seen):
                odd.append(
                    f"run {i}: exit {done.code}, ran {ran}, {len(step_requests(mock))} "
                    f"requests, {done.stream_errors()} stream errors; "
                    f"stderr {done.stderr[-1500:]}"
                )
    return tallies, odd


@pytest.mark.cli("opencode")
@pytest.mark.parametrize("reply", ["tool", "text_tool"])
async def test_opencode_anthropic_cut_right_after_a_complete_call_runs_bash_once(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], reply: str
) -> None:
    tallies, odd = await opencode_runs(tmp_path, reply, with_unbroken=True, runs=RUNS)
    once = sum(1 for ran in tallies if len(ran) == 1)
    report(
        capsys,
        f"opencode (anthropic, {reply}), a reset right after the bash call's "
        f"content_block_stop, zero config: bash ran once in {once} of {RUNS} runs "
        f"(runs by how many times it ran: {sorted(Counter(map(len, tallies)).items())})",
    )
    assert not odd, "\n".join(odd)
