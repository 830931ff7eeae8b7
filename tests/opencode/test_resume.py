"""Auto-resume: the decision table (plain event dicts, some captured from OpenCode
1.18.33) and the I/O loop against a small fake OpenCode server.  The real OpenCode
end to end is in tests/e2e/test_opencode_e2e.py."""

from __future__ import annotations

import asyncio
import json
import logging
import signal
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web

from unbroken.opencode.resume import Resumer
from unbroken.opencode.resume_policy import (
    ResumeSession,
    ResumeSettings,
    Skip,
    decide,
    is_retryable,
    resume_body,
    settings_from_env,
)

DATA = Path(__file__).parent / "data" / "opencode_events"
SID = "ses_1"


def captured(name: str) -> list[dict[str, Any]]:
    events: list[dict[str, Any]] = json.loads((DATA / f"{name}.json").read_text())["events"]
    return events


# -- event builders (shapes as OpenCode 1.18 sends them) --------------------------------


def ev(kind: str, **props: Any) -> dict[str, Any]:
    return {"type": kind, "properties": {"sessionID": SID, **props}}


def user(mid: str = "msg_u1", provider: str = "fake", model: str = "fake-model") -> dict[str, Any]:
    return ev(
        "message.updated",
        info={
            "id": mid,
            "sessionID": SID,
            "role": "user",
            "agent": "build",
            "model": {"providerID": provider, "modelID": model},
        },
    )


def assistant(
    mid: str = "msg_a1",
    *,
    finish: str | None = None,
    error: dict[str, Any] | None = None,
    provider: str = "fake",
    model: str = "fake-model",
) -> dict[str, Any]:
    info: dict[str, Any] = {
        "id": mid,
        "sessionID": SID,
        "role": "assistant",
        "providerID": provider,
        "modelID": model,
        "time": {"created": 1},
    }
    if finish is not None:
        info["finish"] = finish
    if error is not None:
        info["error"] = error
    return ev("message.updated", info=info)


def text(mid: str = "msg_a1", content: str = "Hello f") -> dict[str, Any]:
    return ev(
        "message.part.updated",
        part={"id": "prt_1", "messageID": mid, "sessionID": SID, "type": "text", "text": content},
    )


def status(kind: str, **extra: Any) -> dict[str, Any]:
    return ev("session.status", status={"type": kind, **extra})


def error(name: str, **data: Any) -> dict[str, Any]:
    return ev("session.error", error={"name": name, "data": {"message": "x", **data}})


IDLE = [status("idle"), ev("session.idle")]
RETRY = status("retry", attempt=1, message="overloaded", next=0)

#: The relay's native Chat Completions error, as OpenCode reports it once its retries are spent.
RELAY_ERROR = {
    "name": "UnknownError",
    "data": {
        "message": json.dumps(
            {
                "message": "unbroken: server_disconnected: body cut short; the turn was cut after "
                "output reached the client. Retry the request.",
                "type": "server_error",
                "param": None,
                "code": "upstream_unavailable",
            }
        )
    },
}


def turn(*middle: dict[str, Any]) -> list[dict[str, Any]]:
    return [user(), status("busy"), assistant(), *middle, *IDLE]


# -- the decision table -----------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "expected", "reason"),
    [
        ("ok", Skip, "completed"),
        ("reset6", ResumeSession, "retryable APIError"),
        ("abortretry", Skip, "aborted during a retry"),
        ("abortstream", Skip, "MessageAbortedError"),
        ("auth", Skip, "auth error"),
        ("ctx", Skip, "context overflowed"),
        ("end1", Skip, "completed"),  # OpenCode continued by itself after the unknown finish
    ],
)
def test_decisions_on_events_captured_from_opencode(name: str, expected: type, reason: str) -> None:
    decision = decide(captured(name))
    assert isinstance(decision, expected), decision
    assert reason in decision.reason


@pytest.mark.parametrize(
    ("events", "expected", "reason"),
    [
        # session.error once OpenCode's retries are spent
        (
            turn(text(), RETRY, ev("session.error", error=RELAY_ERROR)),
            ResumeSession,
            "retryable UnknownError",
        ),
        (turn(error("APIError", statusCode=503, isRetryable=True)), ResumeSession, "APIError 503"),
        (turn(error("APIError", statusCode=529, isRetryable=False)), ResumeSession, "APIError 529"),
        (
            turn(error("APIError", message="Provider is overloaded", isRetryable=False)),
            ResumeSession,
            "overloaded",
        ),
        (turn(error("UnknownError", message="socket hang up")), ResumeSession, "socket hang up"),
        (turn(error("UnknownError", message="TypeError: x is undefined")), Skip, "not transient"),
        (
            turn(error("APIError", statusCode=400, isRetryable=False, message="bad tool schema")),
            Skip,
            "not retryable",
        ),
        # never
        (turn(text(), error("MessageAbortedError", message="Aborted")), Skip, "aborted"),
        (turn(error("ProviderAuthError", providerID="fake")), Skip, "auth"),
        (turn(error("APIError", statusCode=401, isRetryable=False)), Skip, "auth"),
        (turn(error("APIError", statusCode=500, message="invalid x-api-key")), Skip, "auth"),
        (turn(error("ContextOverflowError")), Skip, "context overflowed"),
        (
            turn(error("UnknownError", message='{"code":"context_length_exceeded"}')),
            Skip,
            "context overflowed",
        ),
        (turn(error("MessageOutputLengthError")), Skip, "output length"),
        # no session.error: the last assistant message decides
        (turn(text(), assistant(finish="unknown")), ResumeSession, "finish 'unknown' after output"),
        (turn(assistant(finish="unknown")), Skip, "zero-output 'unknown' finish"),
        (
            turn(
                ev("message.part.delta", messageID="msg_a1", partID="p", field="text", delta="Hi"),
                assistant(finish="unknown"),
            ),
            ResumeSession,
            "after output",
        ),
        (turn(text(), assistant(error=RELAY_ERROR)), ResumeSession, "error after output"),
        (turn(assistant(error=RELAY_ERROR)), Skip, "before any output"),
        (
            turn(text(), assistant(error={"name": "MessageAbortedError", "data": {}})),
            Skip,
            "aborted",
        ),
        (turn(text(), RETRY, status("busy")), Skip, "aborted during a retry"),
        (turn(text()), Skip, "interrupted"),
        (turn(text(), assistant(finish="stop")), Skip, "completed"),
        (turn(text(), assistant(finish="tool-calls")), Skip, "completed"),
        ([user(), status("busy"), *IDLE], Skip, "no assistant reply"),
        # only the latest turn counts
        (
            [
                *turn(error("APIError", statusCode=503, isRetryable=True)),
                user("msg_u2"),
                status("busy"),
                assistant("msg_a2", finish="stop"),
                *IDLE,
            ],
            Skip,
            "completed",
        ),
        # a repeated update of the same user message does not start a new turn
        (
            [*turn(error("APIError", statusCode=503, isRetryable=True))[:-2], user(), *IDLE],
            ResumeSession,
            "APIError 503",
        ),
    ],
)
def test_decision_table(events: list[dict[str, Any]], expected: type, reason: str) -> None:
    decision = decide(events)
    assert isinstance(decision, expected), decision
    assert reason in decision.reason, decision.reason


def test_filters_on_provider_glob_and_model_prefix() -> None:
    events = turn(text(), assistant(finish="unknown", provider="openai", model="gpt-5-codex"))
    assert isinstance(decide(events, ResumeSettings(provider="open*")), ResumeSession)
    assert isinstance(decide(events, ResumeSettings(model="gpt-5")), ResumeSession)
    assert isinstance(decide(events, ResumeSettings(model="gpt-5*")), ResumeSession)
    skip = decide(events, ResumeSettings(provider="anthropic"))
    assert isinstance(skip, Skip) and "not covered" in skip.reason
    assert isinstance(decide(events, ResumeSettings(model="claude")), Skip)
    # a turn that failed before any assistant message: the user message names the model
    early = [
        user(provider="anthropic", model="claude-x"),
        status("busy"),
        error("APIError", statusCode=503, isRetryable=True),
        *IDLE,
    ]
    assert isinstance(decide(early, ResumeSettings(provider="anthropic")), ResumeSession)
    assert isinstance(decide(early, ResumeSettings(provider="openai")), Skip)


def test_is_retryable_mirrors_opencode() -> None:
    assert is_retryable({"name": "APIError", "data": {"message": "", "statusCode": 502}})[0]
    assert is_retryable({"name": "APIError", "data": {"message": "rate limit"}})[0]
    assert not is_retryable({"name": "APIError", "data": {"message": "nope", "statusCode": 404}})[0]
    assert is_retryable({"name": "UnknownError", "data": {"message": "RESOURCE_EXHAUSTED"}})[0]
    assert not is_retryable({"name": "SomethingNew", "data": {}})[0]
    forbidden = {"name": "APIError", "data": {"statusCode": 403, "isRetryable": True}}
    assert not is_retryable(forbidden)[0]


def test_settings_from_env_defaults_aliases_and_precedence() -> None:
    assert settings_from_env({}) == ResumeSettings("*", "*", 3000, 0)
    s = settings_from_env(
        {
            "OPENCODE_RESUME_PROVIDER": "anthropic",
            "OPENCODE_RESUME_MODEL": "claude",
            "OPENCODE_RESUME_DELAY_MS": "10",
            "OPENCODE_RESUME_MAX_ATTEMPTS": "4",
        }
    )
    assert s == ResumeSettings("anthropic", "claude", 10, 4)
    s = settings_from_env({"OPENCODE_RESUME_DELAY_MS": "10", "UNBROKEN_RESUME_DELAY_MS": "20"})
    assert s.delay_ms == 20  # UNBROKEN_ wins
    with pytest.raises(ValueError, match="UNBROKEN_RESUME_DELAY_MS"):
        settings_from_env({"UNBROKEN_RESUME_DELAY_MS": "soon"})
    with pytest.raises(ValueError, match="OPENCODE_RESUME_MAX_ATTEMPTS"):
        settings_from_env({"OPENCODE_RESUME_MAX_ATTEMPTS": "-1"})


def test_resume_body_resends_the_users_own_prompt() -> None:
    message = {
        "info": {
            "id": "msg_u1",
            "role": "user",
            "agent": "plan",
            "system": "be brief",
            "model": {"providerID": "fake", "modelID": "m", "variant": "high"},
        },
        "parts": [
            {
                "id": "prt_1",
                "sessionID": SID,
                "messageID": "msg_u1",
                "type": "text",
                "text": "fix the bug",
            },
            {"id": "prt_2", "type": "text", "text": "Called the Read tool", "synthetic": True},
            {
                "id": "prt_3",
                "type": "file",
                "mime": "text/plain",
                "url": "file:///a.py",
                "filename": "a.py",
            },
        ],
    }
    assert resume_body(message) == {
        "parts": [
            {"type": "text", "text": "fix the bug"},
            {"type": "file", "mime": "text/plain", "url": "file:///a.py", "filename": "a.py"},
        ],
        "model": {"providerID": "fake", "modelID": "m"},
        "variant": "high",
        "agent": "plan",
        "system": "be brief",
    }
    assert resume_body({"info": {}, "parts": [{"type": "step-start"}]}) is None


# -- the I/O loop against a fake OpenCode server ------------------------------------------


class FakeOpenCode:
    """Just enough of OpenCode's server: /event, /session/status, messages, prompt_async."""

    def __init__(self) -> None:
        self.subscribers: list[asyncio.Queue[dict[str, Any] | None]] = []
        self.prompts: list[tuple[str, dict[str, Any]]] = []
        self.auth: list[str | None] = []
        self.status: dict[str, dict[str, str]] = {}
        self.messages: dict[str, list[dict[str, Any]]] = {}
        self.connected = asyncio.Event()
        self.prompted = asyncio.Event()
        self.event_status = 200  # what GET /event answers
        self.event_requests = 0
        self.on_prompt: Any = None
        app = web.Application()
        app.router.add_get("/event", self.event)
        app.router.add_get("/session/status", self.session_status)
        app.router.add_get("/session/{sid}/message", self.session_messages)
        app.router.add_post("/session/{sid}/prompt_async", self.prompt_async)
        self.runner = web.AppRunner(app)
        self.url = ""

    async def start(self) -> None:
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        self.url = f"http://127.0.0.1:{port}"

    async def event(self, request: web.Request) -> web.StreamResponse:
        self.auth.append(request.headers.get("Authorization"))
        self.event_requests += 1
        if self.event_status != 200:
            return web.Response(status=self.event_status)
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        queue: asyncio.Queue[dict[str, Any] | None] = asyncio.Queue()
        self.subscribers.append(queue)
        await resp.write(b'data: {"type":"server.connected","properties":{}}\n\n')
        self.connected.set()
        try:
            while (item := await queue.get()) is not None:
                await resp.write(f"data: {json.dumps(item)}\n\n".encode())
        finally:
            self.subscribers.remove(queue)
        return resp

    def emit(self, *events: dict[str, Any]) -> None:
        for e in events:
            for q in self.subscribers:
                q.put_nowait(e)

    def drop_streams(self) -> None:
        self.connected.clear()
        for q in self.subscribers:
            q.put_nowait(None)

    async def session_status(self, request: web.Request) -> web.Response:
        return web.json_response(self.status)

    async def session_messages(self, request: web.Request) -> web.Response:
        return web.json_response(self.messages.get(request.match_info["sid"], []))

    async def prompt_async(self, request: web.Request) -> web.Response:
        sid = request.match_info["sid"]
        self.prompts.append((sid, await request.json()))
        self.prompted.set()
        if self.on_prompt is not None:
            self.on_prompt(sid, len(self.prompts))
        return web.Response(status=204)


@pytest.fixture
async def fake() -> AsyncIterator[FakeOpenCode]:
    server = FakeOpenCode()
    await server.start()
    server.messages[SID] = [
        {
            "info": {
                "id": "msg_u1",
                "role": "user",
                "agent": "build",
                "model": {"providerID": "fake", "modelID": "fake-model"},
            },
            "parts": [{"id": "prt_u", "type": "text", "text": "say hi"}],
        }
    ]
    yield server
    server.drop_streams()
    await server.runner.cleanup()


async def started(fake: FakeOpenCode, settings: ResumeSettings, **kw: Any) -> tuple[Resumer, Any]:
    resumer = Resumer(fake.url, settings, **kw)
    task = asyncio.create_task(resumer.run())
    async with asyncio.timeout(5):
        await fake.connected.wait()
        await resumer.connected.wait()
    return resumer, task


async def stopped(resumer: Resumer, task: Any) -> None:
    resumer.stop()
    async with asyncio.timeout(5):
        await task


async def until(predicate: Any, limit_s: float = 5.0) -> None:
    for _ in range(int(limit_s / 0.01)):
        if predicate():
            return
        await asyncio.sleep(0.01)
    raise AssertionError("condition not met in time")


def failed_turn(uid: str = "msg_u1", aid: str = "msg_a1") -> list[dict[str, Any]]:
    return [
        user(uid),
        status("busy"),
        assistant(aid),
        text(aid),
        RETRY,
        status("busy"),
        ev("session.error", error=RELAY_ERROR),
        *IDLE,
    ]


async def test_a_dead_turn_is_resumed_with_the_users_prompt(
    fake: FakeOpenCode, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, "unbroken.opencode.resume")
    resumer, task = await started(fake, ResumeSettings(delay_ms=20))
    fake.emit(*failed_turn())
    async with asyncio.timeout(5):
        await fake.prompted.wait()
    assert fake.prompts == [
        (
            SID,
            {
                "parts": [{"type": "text", "text": "say hi"}],
                "model": {"providerID": "fake", "modelID": "fake-model"},
                "agent": "build",
            },
        )
    ]
    await until(lambda: bool(resumer.outcomes))
    assert resumer.outcomes == [(SID, "resumed")] and resumer.resumes == 1
    await stopped(resumer, task)
    assert "resume session=ses_1 attempt=1" in caplog.text
    assert "retryable UnknownError" in caplog.text


async def test_an_abort_is_never_resumed_and_the_reason_is_logged(
    fake: FakeOpenCode, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, "unbroken.opencode.resume")
    resumer, task = await started(fake, ResumeSettings(delay_ms=1))
    fake.emit(user(), status("busy"), assistant(), text(), error("MessageAbortedError"), *IDLE)
    await until(lambda: len(resumer.decisions) >= 1)
    fake.emit(user("msg_u2"), status("busy"), assistant("msg_a2"), text("msg_a2"), RETRY, *IDLE)
    await until(lambda: len(resumer.decisions) >= 2)
    await stopped(resumer, task)  # both decisions are Skips: nothing can follow them
    assert fake.prompts == [] and resumer.outcomes == []
    assert "no resume session=ses_1 reason='the user aborted the turn" in caplog.text
    assert "aborted during a retry" in caplog.text


async def test_resumes_stop_at_max_attempts_in_a_row(fake: FakeOpenCode) -> None:
    resumer, task = await started(fake, ResumeSettings(delay_ms=1, max_attempts=2))

    def again(sid: str, n: int) -> None:  # each re-sent prompt dies again
        fake.emit(*failed_turn(f"msg_r{n}", f"msg_ra{n}"))

    fake.on_prompt = again
    fake.emit(*failed_turn())
    await until(lambda: len(resumer.decisions) >= 3)
    await stopped(resumer, task)  # the third decision is a Skip: nothing follows it
    assert len(fake.prompts) == 2
    last = resumer.decisions[-1][1]
    assert isinstance(last, Skip) and "UNBROKEN_RESUME_MAX_ATTEMPTS" in last.reason


async def test_a_new_user_prompt_during_the_delay_cancels_the_resume(fake: FakeOpenCode) -> None:
    resumer, task = await started(fake, ResumeSettings(delay_ms=300))
    fake.emit(*failed_turn())
    await until(lambda: bool(resumer.decisions))
    fake.emit(user("msg_u9"), status("busy"))  # the user typed something else
    await until(lambda: bool(resumer.outcomes))
    await stopped(resumer, task)
    assert fake.prompts == []
    assert resumer.outcomes[0][1].startswith("cancelled")


async def test_a_busy_session_at_send_time_is_left_alone(fake: FakeOpenCode) -> None:
    resumer, task = await started(fake, ResumeSettings(delay_ms=50))
    fake.emit(*failed_turn())
    fake.status[SID] = {"type": "busy"}  # e.g. the TUI started a turn we did not see
    await until(lambda: bool(resumer.outcomes))
    await stopped(resumer, task)
    assert fake.prompts == [] and resumer.outcomes == [(SID, "busy")]


async def test_reconnects_after_the_event_stream_drops(fake: FakeOpenCode) -> None:
    resumer, task = await started(fake, ResumeSettings(delay_ms=1), password="pw")
    fake.drop_streams()
    await until(lambda: fake.connected.is_set() and bool(fake.subscribers))
    fake.emit(*failed_turn())
    async with asyncio.timeout(5):
        await fake.prompted.wait()
    await stopped(resumer, task)
    assert len(fake.auth) >= 2
    assert all(a == "Basic b3BlbmNvZGU6cHc=" for a in fake.auth)  # opencode:pw


def test_cli_rejects_a_bad_setting(monkeypatch: pytest.MonkeyPatch) -> None:
    from unbroken.cli import main

    monkeypatch.setenv("UNBROKEN_RESUME_DELAY_MS", "later")
    assert main(["resume", "--opencode", "http://127.0.0.1:9"]) == 2


async def test_updates_that_trail_the_idle_event_still_count(fake: FakeOpenCode) -> None:
    resumer, task = await started(fake, ResumeSettings(delay_ms=1))
    # OpenCode can publish the final message update just after the idle pair.
    fake.emit(user(), status("busy"), assistant(), text(), *IDLE, assistant(finish="unknown"))
    async with asyncio.timeout(5):
        await fake.prompted.wait()
    await stopped(resumer, task)
    [(_, decision)] = resumer.decisions
    assert (
        isinstance(decision, ResumeSession) and "finish 'unknown' after output" in decision.reason
    )


async def test_a_cancelled_resumer_leaves_no_task_behind(fake: FakeOpenCode) -> None:
    """Cancelled while it follows the stream (as when OpenCode exits under `unbroken run`):
    its own tasks end with it, so none can fail later with nobody to see it."""
    resumer, task = await started(fake, ResumeSettings(delay_ms=10_000))
    fake.emit(*failed_turn())  # a resume waits out its delay: one more task of its own
    await until(lambda: bool(resumer.decisions))
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    mine = [
        t for t in asyncio.all_tasks() if "Resumer." in getattr(t.get_coro(), "__qualname__", "")
    ]
    assert mine == []


async def test_says_at_once_why_opencode_is_unreachable_then_one_line_per_change(
    fake: FakeOpenCode, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, "unbroken.opencode.resume")
    fake.event_status = 401
    resumer = Resumer(fake.url, ResumeSettings(delay_ms=1), retry_s=0.01)
    task = asyncio.create_task(resumer.run())

    def lines() -> list[str]:
        return [r.getMessage() for r in caplog.records if r.getMessage().startswith("resume:")]

    await until(lambda: fake.event_requests >= 5)  # five tries, one line
    assert lines() == [
        f"resume: cannot reach OpenCode at {fake.url}/event (it answered 401: set "
        "OPENCODE_SERVER_PASSWORD (and OPENCODE_SERVER_USERNAME) to the server's); trying "
        "again every 0.01 s"
    ]
    fake.event_status = 200
    async with asyncio.timeout(5):
        await resumer.connected.wait()
    fake.event_status = 503
    fake.drop_streams()
    seen = fake.event_requests
    await until(lambda: fake.event_requests >= seen + 5)
    resumer.stop()
    async with asyncio.timeout(5):
        await task
    assert lines()[1:] == [
        f"resume: watching {fake.url} for turns that die after output (delay 1 ms, max "
        "attempts unlimited)",
        f"resume: lost {fake.url}/event (the server closed the connection); reconnecting "
        "every 0.01 s",
        f"resume: cannot reach OpenCode at {fake.url}/event (it answered 503); trying again "
        "every 0.01 s",
    ]


async def test_an_unreachable_server_is_named_at_once(
    unused_tcp_port: int, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, "unbroken.opencode.resume")
    url = f"http://127.0.0.1:{unused_tcp_port}"
    resumer = Resumer(url, retry_s=30)  # the first try decides, however long the interval
    task = asyncio.create_task(resumer.run())
    await until(lambda: resumer.problem is not None)
    resumer.stop()
    async with asyncio.timeout(5):
        await task
    [line] = [r.getMessage() for r in caplog.records]
    assert line.startswith(f"resume: cannot reach OpenCode at {url}/event (cannot connect: ")
    assert line.endswith("; trying again every 30 s")


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["--opencode", "localhost:4096"], "--opencode: expected an http:// or https:// URL"),
        (["--opencode", "http://"], "--opencode: expected an http"),
        (["--opencode", "http://u:p@127.0.0.1:4096"], "--opencode: credentials in the URL"),
        (["--opencode", "ws://127.0.0.1:4096"], "--opencode: expected an http:// or https://"),
        (
            ["--opencode", "http://127.0.0.1:4096", "--delay-ms", "-5"],
            "--delay-ms must not be negative, got -5",
        ),
        (
            ["--opencode", "http://127.0.0.1:4096", "--max-attempts", "-1"],
            "--max-attempts must not be negative, got -1",
        ),
    ],
)
async def test_cli_refuses_bad_input_in_one_line(args: list[str], says: str) -> None:
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "unbroken",
        "resume",
        *args,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode == 2
    [line] = err.decode().splitlines()
    assert line.startswith("unbroken resume: ") and says in line, line
    assert out == b""


async def test_cli_says_at_once_when_opencode_is_unreachable(unused_tcp_port: int) -> None:
    url = f"http://127.0.0.1:{unused_tcp_port}"
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "unbroken",
        "resume",
        "--opencode",
        url,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    assert proc.stderr is not None
    seen: list[str] = []
    try:
        async with asyncio.timeout(20):
            while not any("cannot reach" in line for line in seen):
                seen.append((await proc.stderr.readline()).decode())
    finally:
        proc.send_signal(signal.SIGTERM)
        rest, _ = await asyncio.wait_for(proc.communicate(), 30)
    assert f"cannot reach OpenCode at {url}/event (cannot connect: " in seen[-1]
    assert proc.returncode == 0
    assert "Traceback" not in "".join(seen) + rest.decode()
