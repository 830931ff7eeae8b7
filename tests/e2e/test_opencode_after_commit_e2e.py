"""Issue 23's acceptance for OpenCode: 20 cuts after output, and the turn still finishes.

The real OpenCode CLI runs as a server under ``unbroken run --config FILE -- opencode
serve`` (so unbroken's auto-resumer watches it), with a built-in provider pointed at
the mock and, in the user's unbroken config, ``[stream] after_commit = "continue"``
(openai) or ``[routes.anthropic] after_commit = "continue"`` (the per-route override).
The mock cuts the stream 20 times, each after output reached OpenCode.  Required:
the session ends with the exact text, OpenCode never sees an error (no retry status,
no ``session.error``, no "stream error" in its log), OpenCode sends the step once
(the mock's request log and unbroken's journal agree), nothing is auto-resumed, and
the journal records the 20 continuations.

Without the setting (today's default) the same stream makes OpenCode see an error
at every cut and redo the step: 6 requests per retry cycle, and the auto-resumer
re-prompting between cycles (see test_opencode_e2e.py's seed test).
"""

from __future__ import annotations

import itertools

import pytest

from e2e.oc_after_commit import CUTS, LEAD_TEXT, LONG_TEXT, TOOL_CUTS, TOOL_DONE, AfterCommitRun
from e2e.oc_scenarios import Batch

pytestmark = [pytest.mark.e2e, pytest.mark.cli("opencode"), pytest.mark.timeout(420)]


def report(capsys: pytest.CaptureFixture[str], text: str) -> None:
    with capsys.disabled():
        print(f"\n    e2e: {text}", flush=True)


def _facts(run: AfterCommitRun) -> str:
    turns = run.journal
    return (
        f"outcome {run.outcome}, {run.steps} OpenCode requests, {run.continuations} "
        f"continuations, {len(run.retries)} OpenCode retries, errors {run.errors}, "
        f"{run.stream_errors} stream errors, {run.resumes} auto-resumes\n"
        f"text: {run.text!r}\nrequests: {run.requests}\njournal: {turns}\n"
        f"log: {run.log[-4000:]}"
    )


def _check(run: AfterCommitRun) -> None:
    assert run.outcome == "completed", _facts(run)
    assert run.text == LONG_TEXT, _facts(run)  # exact: nothing doubled, nothing lost
    # OpenCode never saw a failure.
    assert run.errors == [], _facts(run)
    assert run.retries == [], _facts(run)
    assert run.stream_errors == 0, _facts(run)
    assert run.resumes == 0, _facts(run)  # the auto-resumer had nothing to do
    # OpenCode asked once (the provider saw one request from it, and so did the relay);
    # the relay finished the turn with 20 continuations.
    assert run.steps == 1, _facts(run)
    assert run.continuations == CUTS, _facts(run)
    assert len(run.journal) == 1, _facts(run)
    (turn,) = run.journal
    assert turn["session_id"] and turn["client"] == "opencode", _facts(run)
    assert (turn["outcome"], turn["splices"]) == ("resumed", CUTS), _facts(run)
    assert turn["attempts"] == CUTS + 1, _facts(run)
    continued = run.stats.get("continued") or {}
    assert (continued.get("turns"), continued.get("splices")) == (1, CUTS), run.stats
    assert run.stats.get("recovery_rate") == 1.0, run.stats  # the cut turn was recovered


def _say(run: AfterCommitRun, capsys: pytest.CaptureFixture[str], what: str) -> None:
    spliced = run.journal[0].get("splices") if len(run.journal) == 1 else None
    report(
        capsys,
        f"{CUTS} cuts after output, {what}, after_commit = continue: session {run.outcome} "
        f"in {run.elapsed:.1f} s; {run.steps} OpenCode request(s), {run.continuations} "
        f"continuations upstream, {len(run.retries)} OpenCode retries, {run.stream_errors} "
        f"errors seen by OpenCode, {run.resumes} auto-resumes; journal: {len(run.journal)} "
        f"turn(s), {spliced} continuations recorded",
    )


@pytest.mark.scenario("after_commit_openai")
def test_opencode_responses_twenty_cuts_after_output_finish_without_a_retry(
    scenarios: Batch, capsys: pytest.CaptureFixture[str]
) -> None:
    run: AfterCommitRun = scenarios.result("after_commit_openai", timeout=360)
    _say(run, capsys, "OpenCode's openai provider (Responses)")
    _check(run)
    # The exact resume: OpenCode's request (store: false) went up as a background one,
    # each continuation is a resume after the last event the relay released, and nothing
    # was left running at the provider.  A resumed stream is held until a frame names
    # its response (issue 33: a resume of another response is refused before anything
    # of it is released), and the mock's deltas name none: a cut while it is held
    # resumes from the same cursor again, never from one before it.
    assert len(run.sent) == 1, _facts(run)
    assert run.sent[0].get("background") is True and run.sent[0].get("store") is True
    cursors = run.resume_cursors
    assert len(cursors) == CUTS and cursors == sorted(cursors), run.requests
    assert run.cancels == 0, _facts(run)


@pytest.mark.scenario("after_commit_default")
def test_without_the_setting_opencode_sees_every_cut_and_the_session_dies(
    scenarios: Batch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The contrast (no unbroken config): each cut after output ends with the native
    retryable error, OpenCode retries the step 5 times, every try is cut, and the
    session dies with the error (the auto-resumer then re-sends it)."""
    run: AfterCommitRun = scenarios.result("after_commit_default", timeout=400)
    report(
        capsys,
        f"{CUTS} cuts after output, OpenCode's openai provider, default after_commit = "
        f"error: session {run.outcome} after {run.elapsed:.0f} s; {run.steps} OpenCode "
        f"requests, {len(run.retries)} OpenCode retries, {run.stream_errors} errors seen by "
        "OpenCode",
    )
    assert run.outcome == "dead", _facts(run)
    assert (run.steps, run.continuations) == (6, 0), _facts(run)  # 1 try + 5 retries
    assert run.stream_errors == 6 and len(run.retries) == 5, _facts(run)
    assert [t["outcome"] for t in run.journal] == ["ended_with_error"] * 6, _facts(run)
    assert run.sent[0].get("store") is False and "background" not in run.sent[0]


@pytest.mark.scenario("after_commit_anthropic")
def test_opencode_anthropic_twenty_cuts_after_text_finish_without_a_retry(
    scenarios: Batch, capsys: pytest.CaptureFixture[str]
) -> None:
    run: AfterCommitRun = scenarios.result("after_commit_anthropic", timeout=360)
    _say(run, capsys, "OpenCode's anthropic provider (Messages, text), per route")
    _check(run)
    # Each continuation is OpenCode's request plus the assistant's committed text (a
    # prefill that grows and never ends in whitespace).
    original = run.sent[0]["messages"]
    prefills = []
    for body in run.sent[1:]:
        assert body["messages"][:-1] == original, "a continuation changed OpenCode's messages"
        last = body["messages"][-1]
        assert last["role"] == "assistant"
        content = last["content"]
        prefill = (
            content if isinstance(content, str) else "".join(b.get("text", "") for b in content)
        )
        assert prefill == prefill.rstrip() and LONG_TEXT.startswith(prefill), prefill
        prefills.append(prefill)
    assert len(prefills) == CUTS
    assert all(len(a) < len(b) for a, b in itertools.pairwise(prefills)), prefills


@pytest.mark.scenario("after_commit_tool")
def test_opencode_anthropic_text_cut_before_a_bash_call_runs_it_once(
    scenarios: Batch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The step answers text, then a ``bash`` call; the text is cut 5 times.  Each
    continuation brings the rest of the text, then the call, whole: OpenCode runs it
    once, sees no error, and its next step (with the tool's result) finishes the turn."""
    run: AfterCommitRun = scenarios.result("after_commit_tool", timeout=360)
    report(
        capsys,
        f"{TOOL_CUTS} cuts in the text before a bash call (anthropic, continue): session "
        f"{run.outcome} in {run.elapsed:.1f} s; bash ran {len(run.marker_lines)} time(s); "
        f"{run.steps} OpenCode requests, {run.continuations} continuations, "
        f"{run.stream_errors} errors seen by OpenCode",
    )
    assert run.outcome == "completed", _facts(run)
    assert run.marker_lines == ["ran"], _facts(run)
    assert run.text == LEAD_TEXT + TOOL_DONE, _facts(run)
    assert (run.errors, run.retries, run.stream_errors, run.resumes) == ([], [], 0, 0), _facts(run)
    # Two steps (the answer with the call, then the one after the tool's result), each
    # sent once by OpenCode; the first finished by 5 continuations.
    assert run.steps == 2 and run.continuations == TOOL_CUTS, _facts(run)
    assert [(t["outcome"], t["splices"]) for t in run.journal] == [
        ("resumed", TOOL_CUTS),
        ("ok", 0),
    ], _facts(run)
    results = [
        b
        for body in run.sent
        for m in body["messages"]
        if isinstance(m.get("content"), list)
        for b in m["content"]
        if b.get("type") == "tool_result"
    ]
    assert len(results) == 1, _facts(run)  # one tool result, in the last request
