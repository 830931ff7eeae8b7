"""Real-socket regression tests for the turn defects of issue 9: how an HTTP turn ends.

One test per defect: an upstream ``101`` to a plain POST is retried, a turn completed
then closed by the client journals ok, a cut after finish_reason still ends with
``[DONE]`` and is recorded, and a replay decided by a frame and retried at once
serves the next attempt.  Each checks the bytes on the wire and what the hooks
record; clients and fakes come from `relay.regressionfix`.
"""

from __future__ import annotations

from relay.regressionfix import (
    CHAT,
    CHAT_PATH,
    DONE,
    FINISH,
    FakeUpstream,
    RawHTTP,
    has_frames,
    json_answer,
    relay_for,
    sse_frames,
    switching_protocols,
)
from unbroken.mock import MockProvider, frames_for


# -- 7. HTTP: an upstream 101 to a plain POST is retried -----------------------------------
async def test_http_upstream_101_is_retried() -> None:
    plain = {k: v for k, v in CHAT.items() if k != "stream"}
    answer = b"".join(frames_for("chat", {}, plain))
    async with (
        FakeUpstream(switching_protocols, json_answer(answer)) as up,
        relay_for(up.url) as (server, rec),
    ):
        client = await RawHTTP.post(server.url, f"/mock/{CHAT_PATH}", plain)
        try:
            head = await client.head(cap=4)
            if head is not None and client.status == 200:
                await client.read_all(cap=4)
        finally:
            client.close()
        assert client.status == 200, (
            f"the client got status {client.status} (None: no answer within 4 s); "
            f"upstream requests: {len(up.arrivals)}"
        )
        turns = await rec.wait_turns(1)
    assert bytes(client.body) == answer
    assert len(up.arrivals) == 2
    assert turns[0].outcome == "recovered"


# -- 8. HTTP: a turn completed, then closed by the client, journals ok ---------------------
async def test_http_turn_completed_then_closed_by_client_is_ok(mock: MockProvider) -> None:
    async with relay_for(mock.url) as (server, rec):
        # frames 150 ms apart: the client closes between the terminal frame and [DONE]
        mock.script([{"chunk_delay_ms": 150}])
        client = await RawHTTP.post(server.url, f"/mock/{CHAT_PATH}", CHAT)
        try:
            assert await client.head(cap=5) is not None
            got = await client.until(has_frames(FINISH), cap=5)
            assert got is not None
            assert b'"finish_reason":"stop"' in sse_frames(bytes(client.body))[FINISH - 1]
        finally:
            client.close()  # like Codex: gone right after the terminal frame
        turns = await rec.wait_turns(1)
    assert turns[0].outcome == "ok"


# -- 11. HTTP: a cut after finish_reason still ends with [DONE], and is recorded -------------
async def test_http_cut_after_finish_reason_gets_done_and_is_recorded(mock: MockProvider) -> None:
    async with relay_for(mock.url) as (server, rec):
        mock.script([{"fault": "reset", "after_frame": FINISH}])
        client = await RawHTTP.post(server.url, f"/mock/{CHAT_PATH}", CHAT)
        try:
            assert await client.head(cap=5) is not None
            await client.read_all(cap=5)
        finally:
            client.close()
        turns = await rec.wait_turns(1)
    body = bytes(client.body)
    clean = frames_for("chat", {}, CHAT)
    assert body.startswith(b"".join(clean[:FINISH]))
    assert body.endswith(DONE), f"the stream ended without [DONE]: ...{body[-120:]!r}"
    assert turns[0].outcome == "ok"
    cut = [a.reason for a in turns[0].attempt_log if a.reason not in ("", "ok")]
    assert cut or rec.failures, (
        "the cut after the terminal frame was not recorded on the attempt "
        f"(attempts: {[(a.reason, a.phase) for a in turns[0].attempt_log]})"
    )


# -- 13. HTTP: a replay decided by a frame, retried at once, serves the next attempt ---------
async def test_http_in_stream_error_replayed_with_no_delay_is_served(mock: MockProvider) -> None:
    # Found with the turn machine's legality checks (issue 22): with no wait before the
    # retry (delay_ms = 0, or a reroute), a replay decided by an in-stream error left
    # its decision behind, and the next attempt's first chunk "ended" that attempt
    # with it: the relay opened a third request mid-stream and the turn crashed (500).
    async with relay_for(mock.url, retry={"delay_ms": 0}) as (server, rec):
        mock.script([{"fault": "error_event", "after_frame": 1, "error": "overloaded"}, {}])
        client = await RawHTTP.post(server.url, f"/mock/{CHAT_PATH}", CHAT)
        try:
            assert await client.head(cap=5) is not None
            await client.read_all(cap=5)
        finally:
            client.close()
        turns = await rec.wait_turns(1)
    assert client.status == 200, bytes(client.body)
    assert bytes(client.body) == b"".join(frames_for("chat", {}, CHAT))
    assert len(mock.requests) == 2
    assert [f[:2] for f in rec.failures] == [("stream_error", "pending")]
    assert turns[0].outcome == "recovered"
