"""Real-socket regression tests for the turn defects of issue 9: HTTP timers.

One test per defect: early headers reach a raw client at early_headers_s, a client
that pauses reading is not cut as a stall (and a stall after it resumes still is), a
comment-only stream trips first_frame_timeout_s, idle_timeout_s holds below
early_headers_s and keepalive_s, the first keepalive goes out keepalive_s after the
last write, and keepalives to the client do not hide an upstream stall (issue 22).
Times are measured with ``time.monotonic()`` around socket events; a test that waits
for the relay gives up after a short cap and fails with what it saw, so a regression
costs seconds, not minutes.  The only sleeps are a client that pauses reading (the
point of that test) and fake upstreams pacing their frames.  Clients and fakes come
from `relay.regressionfix`.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from relay.regressionfix import (
    CHAT,
    CHAT_PATH,
    DONE,
    FIRST_OUTPUT,
    FakeUpstream,
    RawHTTP,
    comments_forever,
    contains,
    has_frames,
    relay_for,
    sse_answer,
    sse_frames,
    without_comments,
)
from unbroken.mock import MockProvider, frames_for


# -- 4. HTTP: early headers reach a raw client at early_headers_s ---------------------------
async def test_http_early_headers_reach_a_raw_client_on_time(mock: MockProvider) -> None:
    # A guard more than a reproduction: with the aiohttp installed here (3.14),
    # StreamResponse.prepare() sends the headers at once (only web.Response buffers
    # them until the body), so the pre-rewrite relay already passes this.  A relay
    # that buffered the headers until its first body write would fail it.
    early = 1.0
    stream = {"early_headers_s": early, "keepalive_s": 30}
    async with relay_for(mock.url, stream=stream, retry={"delay_ms": 100}) as (server, _):
        mock.script([{"status": 503, "count": 1000}])
        t0 = time.monotonic()
        client = await RawHTTP.post(server.url, f"/mock/{CHAT_PATH}", CHAT)
        try:
            at = await client.head(cap=early + 2)
        finally:
            client.close()
    elapsed = None if at is None else round(at - t0, 2)
    assert at is not None and elapsed is not None and elapsed <= early + 0.5, (
        f"early headers reached the client after {elapsed} s "
        f"(early_headers_s={early}; None: not within {early + 2} s)"
    )
    assert client.status == 200
    assert client.headers["content-type"].startswith("text/event-stream")


# -- 5. HTTP: a client that pauses reading is not cut as a stall ----------------------------
async def _paused_reader(
    mock: Any, action: dict[str, Any], read_cap: float
) -> tuple[RawHTTP, Any, list[Any], float | None]:
    """A reader that pauses for four idle timeouts after the first output, then reads
    the rest within ``read_cap``: (client, recorder, turns, when the body ended)."""
    stream = {
        "idle_timeout_s": 0.5,
        "first_frame_timeout_s": 0.5,
        "keepalive_s": 30,
        "early_headers_s": 30,
    }
    async with relay_for(mock.url, stream=stream) as (server, rec):
        mock.script([action])
        client = await RawHTTP.post(server.url, f"/mock/{CHAT_PATH}", CHAT, rcvbuf=16384)
        try:
            assert await client.head(cap=5) is not None
            assert await client.until(has_frames(FIRST_OUTPUT), cap=5) is not None
            await asyncio.sleep(2.0)  # the reader pauses: four idle timeouts long
            at = await client.read_all(cap=read_cap)
        finally:
            client.close()
        turns = await rec.wait_turns(1)
    return client, rec, turns, at


async def test_http_slow_reader_is_not_cut_as_a_stall(mock: MockProvider) -> None:
    # ~16 MB of text deltas: far more than the loopback socket buffers hold
    action = {"text": "x" * 12_000_000, "deltas": 12_000}
    expected = b"".join(frames_for("chat", action, CHAT))
    client, rec, turns, _ = await _paused_reader(mock, action, read_cap=20)
    body = bytes(client.body)
    assert body.endswith(DONE), f"stream did not end with [DONE]: ...{body[-300:]!r}"
    assert body == expected
    assert turns[0].outcome == "ok", (turns[0].outcome, rec.failures)
    assert rec.failures == []


async def test_http_stall_after_a_slow_reader_resumes_is_still_caught(mock: MockProvider) -> None:
    # The turn's timer fires while the relay is blocked writing to the paused reader;
    # no deadline runs during a write, so it found none.  Found in review: nothing
    # armed it again after the write, so a stall that followed was never caught (the
    # turn hung until the upstream gave up).
    action = {
        "text": "x" * 12_000_000,
        "deltas": 12_000,
        "fault": "stall",
        "after_frame": 11_000,
        "seconds": 30,
    }
    _, rec, turns, at = await _paused_reader(mock, action, read_cap=10)
    assert at is not None, (
        "the upstream stalled after the reader resumed, and the stream had not ended "
        f"within 10 s (idle_timeout_s=0.5); failures: {rec.failures}"
    )
    assert [f[:2] for f in rec.failures] == [("stall", "committed")]
    assert turns[0].outcome == "ended_with_error"


# -- 6. HTTP: a comment-only stream trips first_frame_timeout_s ----------------------------
async def test_http_comment_only_stream_trips_first_frame_timeout() -> None:
    first = 1.0
    clean = frames_for("chat", {}, CHAT)
    async with (
        FakeUpstream(comments_forever, sse_answer(clean)) as up,
        relay_for(up.url, stream={"first_frame_timeout_s": first}) as (server, rec),
    ):
        t0 = time.monotonic()
        client = await RawHTTP.post(server.url, f"/mock/{CHAT_PATH}", CHAT)
        try:
            at = None
            if await client.head(cap=first + 3) is not None:
                at = await client.read_all(cap=first + 3)
        finally:
            client.close()
        elapsed = None if at is None else round(at - t0, 2)
        assert at is not None and elapsed is not None and elapsed <= first + 1, (
            f"comment-only stream not replayed within first_frame_timeout_s + 1 s "
            f"(upstream requests: {len(up.arrivals)}; finished after {elapsed} s)"
        )
        turns = await rec.wait_turns(1)
    assert client.status == 200 and without_comments(bytes(client.body)) == b"".join(clean)
    assert len(up.arrivals) == 2
    assert [f[0] for f in rec.failures] == ["stall"]
    assert turns[0].outcome == "recovered"


# -- 9. HTTP: idle_timeout_s below early_headers_s and keepalive_s is enforced ---------------
async def test_http_idle_timeout_shorter_than_early_headers_and_keepalive_is_enforced(
    mock: MockProvider,
) -> None:
    idle = 1.0
    async with relay_for(mock.url, stream={"idle_timeout_s": idle}) as (server, rec):
        # (a) after the first released output frame: the client gets the native error
        mock.script([{"fault": "stall", "after_frame": FIRST_OUTPUT, "seconds": 30}])
        client = await RawHTTP.post(server.url, f"/mock/{CHAT_PATH}", CHAT)
        try:
            assert await client.head(cap=5) is not None
            first = await client.until(has_frames(FIRST_OUTPUT), cap=5)
            assert first is not None
            ended = await client.read_all(cap=idle + 2)
        finally:
            client.close()
        elapsed = None if ended is None else round(ended - first, 2)
        assert ended is not None and elapsed is not None and elapsed <= idle + 0.5, (
            f"stall after output not caught within idle_timeout_s + 0.5 s "
            f"(stream ended {elapsed} s after the last frame; None: not within {idle + 2} s)"
        )
        error = sse_frames(bytes(client.body))[-1]
        assert b'"error"' in error and DONE not in bytes(client.body)
        await rec.wait_turns(1)
        assert rec.failures == [("stall", "committed", None)]

        # (b) before any output: replayed, the client sees one clean stream
        mock.script([{"fault": "stall", "after_frame": 1, "seconds": 30}, {}])
        t0 = time.monotonic()
        client = await RawHTTP.post(server.url, f"/mock/{CHAT_PATH}", CHAT)
        try:
            ended = None
            if await client.head(cap=idle + 2) is not None:
                ended = await client.read_all(cap=idle + 2)
        finally:
            client.close()
        elapsed = None if ended is None else round(ended - t0, 2)
        assert ended is not None and elapsed is not None and elapsed <= idle + 0.5, (
            f"stall before output not replayed within idle_timeout_s + 0.5 s ({elapsed} s)"
        )
        turns = await rec.wait_turns(2)
    assert bytes(client.body) == b"".join(frames_for("chat", {}, CHAT))
    assert rec.failures[1][0] == "stall"
    assert turns[1].outcome == "recovered"


# -- 10. HTTP: the first keepalive goes out keepalive_s after the last write -----------------
async def test_http_first_keepalive_at_keepalive_s(mock: MockProvider) -> None:
    keepalive, early = 1.0, 5.0
    stream = {"keepalive_s": keepalive, "early_headers_s": early, "idle_timeout_s": 60}
    async with relay_for(mock.url, stream=stream) as (server, _):
        mock.script([{"fault": "stall", "after_frame": FIRST_OUTPUT, "seconds": 30}])
        client = await RawHTTP.post(server.url, f"/mock/{CHAT_PATH}", CHAT)
        try:
            assert await client.head(cap=5) is not None
            last = await client.until(has_frames(FIRST_OUTPUT), cap=5)
            assert last is not None
            at = await client.until(contains(b": keepalive\n\n"), cap=early + 1)
        finally:
            client.close()
    elapsed = None if at is None else round(at - last, 2)
    assert at is not None and elapsed is not None and elapsed <= keepalive + 0.5, (
        f"first keepalive {elapsed} s after the last write (keepalive_s={keepalive}, "
        f"early_headers_s={early}; None: not within {early + 1} s)"
    )


# -- 12. HTTP: keepalives to the client do not hide an upstream stall (issue 22) -------------
RESPONSES_PATH = "v1/responses"
RESPONSES: dict[str, Any] = {"model": "m", "input": "hi", "stream": True}
CODEX_UA = {"User-Agent": "codex_exec/0.169.0"}
RESPONSES_KEEPALIVE = b'event: keepalive\ndata: {"type":"keepalive"}\n\n'


async def _stall_behind_keepalives(
    mock: Any, path: str, body: dict[str, Any], headers: dict[str, str], keepalive: bytes
) -> None:
    """The upstream sends its first output, then hangs for 30 s while the relay writes
    a keepalive to the client every 0.1 s: the stall must still end the turn within
    idle_timeout_s of the last upstream byte (committed: the native error)."""
    idle = 0.5
    stream = {
        "idle_timeout_s": idle,
        "first_frame_timeout_s": idle,
        "keepalive_s": 0.1,
        "early_headers_s": 30,
    }
    proto = "responses" if path == RESPONSES_PATH else "chat"
    frames = frames_for(proto, {}, body)
    k = next(i for i, f in enumerate(frames, 1) if b"delta" in f and b"role" not in f)
    async with relay_for(mock.url, stream=stream) as (server, rec):
        mock.script([{"fault": "stall", "after_frame": k, "seconds": 30}])
        client = await RawHTTP.post(server.url, f"/mock/{path}", body, headers=headers)
        try:
            assert await client.head(cap=5) is not None
            last = await client.until(contains(frames[k - 1]), cap=5)
            assert last is not None, bytes(client.body)
            ended = await client.read_all(cap=idle + 3)
        finally:
            client.close()
        got = bytes(client.body)
        elapsed = None if ended is None else round(ended - last, 2)
        assert ended is not None and elapsed is not None and elapsed <= idle + 0.5, (
            f"an upstream stall behind keepalives was not caught within idle_timeout_s + "
            f"0.5 s (ended {elapsed} s after the last upstream frame; None: not within "
            f"{idle + 3} s; {got.count(keepalive)} keepalives written)"
        )
        turns = await rec.wait_turns(1)
    assert got.count(keepalive) >= 2  # the keepalives did flow meanwhile
    assert got.startswith(b"".join(frames[:k]))
    assert b"error" in sse_frames(got)[-1]
    assert rec.failures == [("stall", "committed", None)]
    assert turns[0].outcome == "ended_with_error"


async def test_http_stall_behind_comment_keepalives_is_caught(mock: MockProvider) -> None:
    await _stall_behind_keepalives(mock, CHAT_PATH, CHAT, {}, b": keepalive\n\n")


async def test_http_stall_behind_codex_keepalive_events_is_caught(mock: MockProvider) -> None:
    # Codex measured: a 20 s idle timer took 200 s through the relay (20 s direct),
    # because the relay's own keepalive writes kept resetting its stall clock.
    await _stall_behind_keepalives(mock, RESPONSES_PATH, RESPONSES, CODEX_UA, RESPONSES_KEEPALIVE)
