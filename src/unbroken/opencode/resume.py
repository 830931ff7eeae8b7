"""Auto-resume for OpenCode: a turn that died after output, once OpenCode gave up, is re-sent.

The relay can replay a stream only while the client has seen nothing it could act
on.  After that, a cut stream ends with a retryable error and OpenCode retries the
step, at most 5 times.  A provider that keeps failing still kills the session.
This module watches OpenCode's server (``GET /event``) and, when a turn has failed
for good, waits ``delay_ms`` and re-sends the user's last prompt with
``POST /session/{id}/prompt_async``, as many times as allowed.  It never fights
the user: an abort, an interrupted retry, a denied permission, a compaction, a
context overflow or an auth error is never resumed.

`unbroken.opencode.resume_policy.decide` is the whole policy, a pure function over the
events of one session's turn (plain dicts as OpenCode sends them).  `Resumer` is the
aiohttp I/O around it.  Run it as ``unbroken resume --opencode URL``; ``unbroken run`` starts it for
you whenever OpenCode exposes its server.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import contextlib
import functools
import json
import logging
import os
import signal
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Final

import aiohttp

from unbroken.opencode.resume_policy import (
    Decision,
    ResumeSession,
    ResumeSettings,
    Skip,
    decide,
    event_props,
    resume_body,
    settings_from_env,
    shorten,
)

__all__ = ["Resumer", "register", "wait_healthy"]

log = logging.getLogger("unbroken.opencode.resume")

# -- the I/O loop ---------------------------------------------------------------------


@dataclass
class _Session:
    events: list[Mapping[str, Any]] = field(default_factory=list)
    busy: bool = False
    attempts: int = 0  # consecutive resumes
    own_prompt: bool = False  # the next new user message is our resume
    users: set[str] = field(default_factory=set)
    streamed: set[str] = field(default_factory=set)  # messages whose first delta is kept
    pending: asyncio.Task[None] | None = None
    decided: bool = False  # the pending task has logged a decision to resume
    sending: bool = False  # past the delay: our own prompt's events must not cancel it


MAX_EVENTS_PER_SESSION: Final = 5000


def _describe(exc: BaseException | None) -> str:
    """Why the event stream could not be followed, in a few words (stable per cause)."""
    if isinstance(exc, aiohttp.ClientResponseError):
        if exc.status in (401, 403):
            return (
                f"it answered {exc.status}: set OPENCODE_SERVER_PASSWORD (and "
                "OPENCODE_SERVER_USERNAME) to the server's"
            )
        return f"it answered {exc.status}"
    if isinstance(exc, aiohttp.ClientConnectorError):
        return f"cannot connect: {exc.os_error.strerror or type(exc.os_error).__name__}"
    if isinstance(exc, aiohttp.ServerDisconnectedError):
        return "the server closed the connection"
    if exc is None:
        return "the event stream ended"
    return type(exc).__name__


#: After idle, wait this long for OpenCode's trailing message updates before deciding.
SETTLE_S: Final = 0.25


class Resumer:
    """Watches one OpenCode server and resumes its dead turns.

    ``run()`` subscribes to ``GET /event`` and, when it cannot (or loses it), tries
    again every ``retry_s`` until `stop` is called (or ``stop_event`` is set).  It
    logs one line per change of state: watching, lost, cannot reach (and why).
    ``resumes`` counts the prompts re-sent and ``decisions`` every (session id,
    decision) taken.
    """

    def __init__(
        self,
        base_url: str,
        settings: ResumeSettings | None = None,
        *,
        password: str | None = None,
        username: str | None = None,
        retry_s: float = 1.0,
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self.settings = settings or ResumeSettings()
        self.retry_s = retry_s
        self.sessions: dict[str, _Session] = {}
        self.resumes = 0
        self.decisions: list[tuple[str, Decision]] = []
        #: how each decided resume ended: resumed | cancelled: why | busy | no prompt | failed
        self.outcomes: list[tuple[str, str]] = []
        self.connected = asyncio.Event()
        #: why the event stream is not followed right now (None: it is, or not tried yet)
        self.problem: str | None = None
        self._stop = asyncio.Event()
        self._http: aiohttp.ClientSession | None = None
        self.headers: dict[str, str] = {}
        if password:
            token = base64.b64encode(f"{username or 'opencode'}:{password}".encode()).decode()
            self.headers["Authorization"] = f"Basic {token}"

    def stop(self) -> None:
        self._stop.set()

    async def run(self, stop_event: asyncio.Event | None = None) -> None:
        """Follow the event stream until stopped, trying again every ``retry_s``.

        Every task it starts is finished before it returns, also when it is
        cancelled: nothing is left to fail unobserved once OpenCode is gone.
        """
        timeout = aiohttp.ClientTimeout(total=None, connect=5, sock_connect=5)
        stopped = asyncio.ensure_future(self._stop.wait())
        watch = asyncio.ensure_future(stop_event.wait()) if stop_event else None
        if watch is not None:
            watch.add_done_callback(lambda _: self._stop.set())
        follow: asyncio.Future[None] | None = None
        async with aiohttp.ClientSession(timeout=timeout, headers=self.headers) as http:
            self._http = http
            try:
                while not self._stop.is_set():
                    follow = asyncio.ensure_future(self._follow(http))
                    await asyncio.wait({follow, stopped}, return_when=asyncio.FIRST_COMPLETED)
                    if not follow.done():
                        break
                    exc = follow.exception()
                    follow = None
                    if exc is not None and not isinstance(
                        exc, (aiohttp.ClientError, OSError, TimeoutError)
                    ):
                        raise exc
                    self._failed(exc)
                    with contextlib.suppress(TimeoutError):
                        async with asyncio.timeout(self.retry_s):
                            await self._stop.wait()
            finally:
                pending = [s.pending for s in self.sessions.values() if s.pending]
                tasks = [t for t in (follow, stopped, watch, *pending) if t is not None]
                for task in tasks:
                    task.cancel()
                # Shielded: a second cancellation must not leave these unawaited.
                await asyncio.shield(asyncio.gather(*tasks, return_exceptions=True))
                self._http = None

    def _failed(self, exc: BaseException | None) -> None:
        """Log a change of state: the stream was lost, or cannot be had (and why)."""
        why = _describe(exc)
        if self.connected.is_set():
            self.connected.clear()
            log.info(
                "resume: lost %s/event (%s); reconnecting every %g s",
                self.base_url,
                why,
                self.retry_s,
            )
            self.problem = "lost"
        elif why != self.problem:
            log.warning(
                "resume: cannot reach OpenCode at %s/event (%s); trying again every %g s",
                self.base_url,
                why,
                self.retry_s,
            )
            self.problem = why

    async def _follow(self, http: aiohttp.ClientSession) -> None:
        async with http.get(f"{self.base_url}/event", headers={"Accept": "text/event-stream"}) as r:
            if r.status != 200:
                raise aiohttp.ClientResponseError(
                    r.request_info, r.history, status=r.status, message="GET /event"
                )
            log.info(
                "resume: watching %s for turns that die after output (delay %d ms, "
                "max attempts %s)",
                self.base_url,
                self.settings.delay_ms,
                self.settings.max_attempts or "unlimited",
            )
            self.connected.set()
            self.problem = None
            data: list[str] = []
            async for raw in r.content:
                line = raw.decode("utf-8", "replace").rstrip("\r\n")
                if line.startswith("data:"):
                    data.append(line[5:].removeprefix(" "))
                elif not line and data:
                    payload, data = "\n".join(data), []
                    try:
                        event = json.loads(payload)
                    except ValueError:
                        continue
                    if isinstance(event, dict):
                        self.feed(event)
            raise aiohttp.ServerDisconnectedError("the event stream ended")

    def feed(self, event: Mapping[str, Any]) -> None:
        """Take one ``/event`` payload (the sans-IO entry point)."""
        kind = event.get("type")
        props = event_props(event)
        sid = props.get("sessionID")
        if not isinstance(sid, str):
            return
        state = self.sessions.setdefault(sid, _Session())
        if kind == "message.part.delta":
            mid = str(props.get("messageID"))
            if mid in state.streamed:
                return  # one delta per message is all `decide` needs
            state.streamed.add(mid)
        if kind == "message.updated":
            info = props.get("info")
            if isinstance(info, Mapping) and info.get("role") == "user":
                mid = str(info.get("id"))
                if mid not in state.users:
                    state.users.add(mid)
                    state.events = []  # a new turn
                    state.streamed = set()
                    self._cancel(state, sid, "a new prompt arrived")
                    if state.own_prompt:
                        state.own_prompt = False
                    else:
                        state.attempts = 0
        state.events.append(event)
        if len(state.events) > MAX_EVENTS_PER_SESSION:
            del state.events[: len(state.events) - MAX_EVENTS_PER_SESSION]
        if kind == "session.status":
            status = props.get("status")
            stype = status.get("type") if isinstance(status, Mapping) else None
            if stype in ("busy", "retry"):
                state.busy = True
                self._cancel(state, sid, "the session is busy again")
            elif stype == "idle":
                self._idle(sid, state)
        elif kind == "session.idle":
            self._idle(sid, state)

    def _cancel(self, state: _Session, sid: str, why: str) -> None:
        if state.sending:
            return
        if state.pending is not None and not state.pending.done():
            state.pending.cancel()
            if state.decided:
                log.info("no resume session=%s reason=%r", sid, f"cancelled: {why}")
                self.outcomes.append((sid, f"cancelled: {why}"))
        state.pending = None
        state.decided = False

    def _idle(self, sid: str, state: _Session) -> None:
        if not state.busy:
            return  # the second idle event of a pair, or idle before we saw any work
        state.busy = False
        state.decided = False
        state.pending = asyncio.ensure_future(self._after_idle(sid, state))
        state.pending.add_done_callback(functools.partial(_reap, sid))

    async def _after_idle(self, sid: str, state: _Session) -> None:
        await asyncio.sleep(SETTLE_S)
        decision = decide(state.events, self.settings)
        if (
            isinstance(decision, ResumeSession)
            and self.settings.max_attempts
            and (state.attempts >= self.settings.max_attempts)
        ):
            decision = Skip(
                f"{state.attempts} resumes in a row reached UNBROKEN_RESUME_MAX_ATTEMPTS "
                f"({decision.reason})"
            )
        self.decisions.append((sid, decision))
        if isinstance(decision, Skip):
            if decision.reason.startswith("the turn completed"):
                state.attempts = 0
                log.debug("no resume session=%s reason=%r", sid, decision.reason)
            else:
                log.info("no resume session=%s reason=%r", sid, decision.reason)
            return
        delay = self.settings.delay_ms / 1000
        attempt = state.attempts + 1
        state.decided = True
        log.info(
            "resume session=%s attempt=%d in=%.1fs reason=%r", sid, attempt, delay, decision.reason
        )
        await asyncio.sleep(delay)
        http = self._http
        if http is None:
            return
        state.sending = True
        try:
            if await self._busy(http, sid):
                log.info(
                    "no resume session=%s reason=%r",
                    sid,
                    "the session is busy again: the user moved on",
                )
                self.outcomes.append((sid, "busy"))
                return
            body = await self._last_prompt(http, sid)
            if body is None:
                log.info("no resume session=%s reason=%r", sid, "no user prompt to re-send")
                self.outcomes.append((sid, "no prompt"))
                return
            state.own_prompt = True
            state.attempts = attempt
            url = f"{self.base_url}/session/{sid}/prompt_async"
            async with http.post(url, json=body, timeout=aiohttp.ClientTimeout(total=30)) as r:
                if r.status >= 300:
                    state.own_prompt = False
                    text = shorten(await r.text(), 200)
                    log.warning(
                        "resume session=%s failed: POST prompt_async answered %d %s",
                        sid,
                        r.status,
                        text,
                    )
                    self.outcomes.append((sid, "failed"))
                    return
            self.resumes += 1
            self.outcomes.append((sid, "resumed"))
            log.info("resumed session=%s attempt=%d: re-sent the last prompt", sid, attempt)
        except (aiohttp.ClientError, OSError, TimeoutError) as exc:
            state.own_prompt = False
            self.outcomes.append((sid, "failed"))
            log.warning("resume session=%s failed: %s", sid, type(exc).__name__)
        finally:
            state.sending = False
            state.decided = False

    async def _busy(self, http: aiohttp.ClientSession, sid: str) -> bool:
        async with http.get(
            f"{self.base_url}/session/status", timeout=aiohttp.ClientTimeout(total=10)
        ) as r:
            if r.status != 200:
                return False
            statuses = await r.json(content_type=None)
        status = statuses.get(sid) if isinstance(statuses, Mapping) else None
        return isinstance(status, Mapping) and status.get("type") in ("busy", "retry")

    async def _last_prompt(self, http: aiohttp.ClientSession, sid: str) -> dict[str, Any] | None:
        async with http.get(
            f"{self.base_url}/session/{sid}/message", timeout=aiohttp.ClientTimeout(total=30)
        ) as r:
            if r.status != 200:
                return None
            messages = await r.json(content_type=None)
        if not isinstance(messages, list):
            return None
        for message in reversed(messages):
            info = message.get("info") if isinstance(message, Mapping) else None
            if isinstance(info, Mapping) and info.get("role") == "user":
                return resume_body(message)
        return None


def _reap(sid: str, task: asyncio.Future[None]) -> None:
    """Log what a resume task failed with (nothing it raises goes unobserved)."""
    if not task.cancelled() and task.exception() is not None:
        exc = task.exception()
        log.warning("resume session=%s failed: %s: %s", sid, type(exc).__name__, exc)


async def wait_healthy(
    base_url: str,
    *,
    timeout: float = 60.0,  # noqa: ASYNC109 - a deadline, not a per-call timeout
    headers: Mapping[str, str] | None = None,
    alive: Any = None,
) -> bool:
    """Poll ``GET /global/health`` until OpenCode answers (False on timeout or when
    ``alive()`` turns false)."""
    deadline = time.monotonic() + timeout
    async with aiohttp.ClientSession(headers=dict(headers or {})) as http:
        while time.monotonic() < deadline:
            if alive is not None and not alive():
                return False
            try:
                async with http.get(
                    f"{base_url.rstrip('/')}/global/health", timeout=aiohttp.ClientTimeout(total=2)
                ) as r:
                    if r.status == 200:
                        return True
            except (aiohttp.ClientError, OSError, TimeoutError):
                pass
            await asyncio.sleep(0.25)
    return False


# -- command line -----------------------------------------------------------------------


def _resume_cmd(args: argparse.Namespace) -> int:
    from unbroken.cmdline import setup_logging
    from unbroken.config_values import ConfigError, validate_url

    try:
        if not args.opencode.lower().startswith(("http://", "https://")):
            raise ConfigError(
                "--opencode", f"expected an http:// or https:// URL, got {args.opencode!r}"
            )
        url = validate_url("--opencode", args.opencode)
    except ConfigError as exc:
        print(f"unbroken resume: {exc}", file=sys.stderr)
        return 2
    for flag, value in (("--delay-ms", args.delay_ms), ("--max-attempts", args.max_attempts)):
        if value is not None and value < 0:
            print(f"unbroken resume: {flag} must not be negative, got {value}", file=sys.stderr)
            return 2
    try:
        settings = settings_from_env()
    except ValueError as exc:
        print(f"unbroken: {exc}", file=sys.stderr)
        return 2
    overrides = {
        k: v
        for k, v in (
            ("provider", args.provider),
            ("model", args.model),
            ("delay_ms", args.delay_ms),
            ("max_attempts", args.max_attempts),
        )
        if v is not None
    }
    settings = ResumeSettings(**{**settings.__dict__, **overrides})
    setup_logging()
    password = os.environ.get("OPENCODE_SERVER_PASSWORD")
    username = os.environ.get("OPENCODE_SERVER_USERNAME")

    async def main() -> int:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            with contextlib.suppress(NotImplementedError, RuntimeError):
                loop.add_signal_handler(sig, stop.set)
        resumer = Resumer(url, settings, password=password, username=username)
        log.info("resume: connecting to %s/event", url)
        await resumer.run(stop)
        return 0

    return asyncio.run(main())


def register(sub: Any) -> None:
    defaults = ResumeSettings()
    p = sub.add_parser(
        "resume",
        help="re-send OpenCode turns that died after output (against opencode serve)",
        description="Watch an OpenCode server's /event stream; when a turn fails after "
        "OpenCode's own retries, wait the delay and re-send the user's last prompt. "
        "Settings also come from UNBROKEN_RESUME_PROVIDER, UNBROKEN_RESUME_MODEL, "
        "UNBROKEN_RESUME_DELAY_MS and UNBROKEN_RESUME_MAX_ATTEMPTS (or OPENCODE_RESUME_*); "
        "a flag wins over its variable.",
    )
    p.add_argument(
        "--opencode",
        required=True,
        metavar="URL",
        help="the OpenCode server, e.g. http://127.0.0.1:4096 (required)",
    )
    p.add_argument("--provider", help=f"glob on the provider id (default: {defaults.provider})")
    p.add_argument("--model", help=f"model id prefix (default: {defaults.model}, every model)")
    p.add_argument(
        "--delay-ms",
        type=int,
        metavar="MS",
        help=f"wait before re-sending, >= 0 (default: {defaults.delay_ms})",
    )
    p.add_argument(
        "--max-attempts",
        type=int,
        metavar="N",
        help=f"resumes in a row per session, 0 = unlimited (default: {defaults.max_attempts})",
    )
    p.set_defaults(func=_resume_cmd)
