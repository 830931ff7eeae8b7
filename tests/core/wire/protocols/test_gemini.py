"""Gemini API classifier, its ledger decisions, and the turn machine with a Gemini
client: table tests over real-shaped ``streamGenerateContent`` frames."""

from __future__ import annotations

import json
import random
from typing import Any

import pytest

from turnfix import Report, Timers
from unbroken.core.admission.policy import Failure, FailureClass, RetryPolicy, RetryState
from unbroken.core.profiles import PROFILES, CommitEnd, check_overrides, identify
from unbroken.core.turn.ledger import Hold, Ledger, LedgerState, Verdict
from unbroken.core.turn.machine import (
    End,
    EndKind,
    GiveUp,
    Keepalive,
    Open,
    Outcome,
    ReadErrorBody,
    SendHeaders,
    Stream,
    TurnMachine,
    Wait,
)
from unbroken.core.wire.protocols import GEMINI, GENERIC, Kind, kind_names, protocol_for_path
from unbroken.core.wire.protocols.gemini import (
    BLANK_LINE_KEEPALIVE,
    GeminiClassifier,
    error_frame,
    final_error_frame,
    is_quota_wall,
    is_stream_path,
    retry_delay,
)
from unbroken.core.wire.sse import Event, SSESplitter

C, OUT, R = Kind.CONTROL, Kind.OUTPUT, Kind.REASONING
CALL = Kind.TOOL_START | Kind.TOOL_END
OK, ERR, RETRY = Kind.TERMINAL_OK, Kind.TERMINAL_ERROR, Kind.RETRYABLE
UNK, BAD = Kind.UNKNOWN, Kind.MALFORMED
USAGE = {"promptTokenCount": 9, "totalTokenCount": 9}


def frame(obj: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(obj).encode() + b"\r\n\r\n"


def chunk(*parts: dict[str, Any], finish: str | None = None, index: int = 0) -> bytes:
    cand: dict[str, Any] = {"content": {"parts": list(parts), "role": "model"}, "index": index}
    if finish:
        cand["finishReason"] = finish
    return frame(
        {
            "candidates": [cand],
            "usageMetadata": USAGE,
            "modelVersion": "gemini-2.5-flash",
            "responseId": "r1",
        }
    )


def parse(raw: bytes) -> list[Event]:
    splitter = SSESplitter()
    events = splitter.feed(raw)
    assert splitter.pending == b""
    return events


def one(raw: bytes) -> Event:
    (event,) = parse(raw)
    return event


HELLO = chunk({"text": "Hello"})
WORLD = chunk({"text": ", world!"})
STOP = chunk({"text": " All good."}, finish="STOP")
THOUGHT = chunk({"text": "Let me think", "thought": True})
SIGNATURE = chunk({"text": "", "thoughtSignature": "c2ln"})
SHELL = {"functionCall": {"name": "run_shell_command", "args": {"command": "echo ran"}}}
TOOL_STOP = chunk(SHELL, finish="STOP")
UNAVAILABLE = frame(
    {"error": {"code": 503, "message": "The model is overloaded.", "status": "UNAVAILABLE"}}
)
INVALID = frame({"error": {"code": 400, "message": "bad", "status": "INVALID_ARGUMENT"}})


def kinds(*raws: bytes) -> list[str]:
    clf = GeminiClassifier()
    out = []
    for raw in raws:
        k, open_tools = clf.classify(one(raw))
        assert open_tools == 0  # a Gemini function call is never open: it arrives whole
        out.append(kind_names(k))
    return out


# -- the table -------------------------------------------------------------------------------
def test_text_stream() -> None:
    assert kinds(HELLO, WORLD, STOP) == ["OUTPUT", "OUTPUT", "OUTPUT|TERMINAL_OK"]


def test_thoughts_signatures_and_metadata() -> None:
    usage_only = frame({"usageMetadata": USAGE, "modelVersion": "m"})
    no_parts = frame({"candidates": [{"content": {"role": "model"}, "index": 0}]})
    assert kinds(THOUGHT, SIGNATURE, usage_only, no_parts) == [
        "REASONING",
        "CONTROL",
        "CONTROL",
        "CONTROL",
    ]


def test_a_function_call_is_complete_in_its_part() -> None:
    assert kinds(chunk(SHELL), TOOL_STOP) == [
        "TOOL_START|TOOL_END",
        "TOOL_START|TOOL_END|TERMINAL_OK",
    ]


def test_server_side_parts_are_output_and_unknown_parts_commit() -> None:
    code = chunk({"executableCode": {"language": "PYTHON", "code": "print(1)"}})
    result = chunk({"codeExecutionResult": {"outcome": "OUTCOME_OK", "output": "1"}})
    strange = chunk({"somethingNew": {"x": 1}})
    bad_call = chunk({"functionCall": {"args": {}}})
    assert kinds(code, result, strange, bad_call) == ["OUTPUT", "OUTPUT", "UNKNOWN", "UNKNOWN"]


def test_errors_finishes_and_malformed_frames() -> None:
    blocked = frame({"promptFeedback": {"blockReason": "SAFETY"}, "usageMetadata": USAGE})
    exhausted = frame({"error": {"code": 429, "message": "quota", "status": "RESOURCE_EXHAUSTED"}})
    assert kinds(UNAVAILABLE) == ["TERMINAL_ERROR|RETRYABLE"]
    assert kinds(exhausted) == ["TERMINAL_ERROR|RETRYABLE"]
    assert kinds(INVALID) == ["TERMINAL_ERROR"]
    assert kinds(blocked) == ["TERMINAL_ERROR"]
    assert kinds(b'data: {"candidates": [\r\n\r\n') == ["MALFORMED"]
    assert kinds(chunk({"text": ""}, finish="MAX_TOKENS")) == ["TERMINAL_OK"]
    assert kinds(chunk({"text": "x"}, finish="FINISH_REASON_UNSPECIFIED")) == ["OUTPUT"]
    assert kinds(b"event: x\r\ndata: {}\r\n\r\n") == ["UNKNOWN"]
    assert kinds(BLANK_LINE_KEEPALIVE, b": comment\r\n\r\n") == ["CONTROL", "CONTROL"]


def test_two_candidates_end_when_both_have_finished() -> None:
    assert kinds(
        chunk({"text": "a"}, index=0),
        chunk({"text": "b"}, index=1),
        chunk({"text": "!"}, finish="STOP", index=0),
        chunk({"text": "?"}, finish="STOP", index=1),
    ) == ["OUTPUT", "OUTPUT", "OUTPUT", "OUTPUT|TERMINAL_OK"]


def test_paths() -> None:
    assert protocol_for_path("v1beta/models/gemini-2.5-flash:streamGenerateContent") is GEMINI
    assert protocol_for_path("v1beta/models/gemini-2.5-flash:generateContent") is GEMINI
    assert protocol_for_path("v1beta/models/gemini-2.5-flash:countTokens") is GEMINI
    assert protocol_for_path("v1beta/models") is GENERIC
    assert is_stream_path("v1beta/models/m:streamGenerateContent")
    assert not is_stream_path("v1beta/models/m:generateContent")


# -- the ledger: what is held, when the turn commits, what a failure does ---------------------
def feed_all(ledger: Ledger, raw: bytes) -> bytes:
    return b"".join(ledger.feed_bytes(e) for e in parse(raw))


def test_frames_that_carry_nothing_are_held_and_a_cut_replays() -> None:
    ledger = Ledger(GEMINI)
    usage_only = frame({"usageMetadata": USAGE})
    assert feed_all(ledger, BLANK_LINE_KEEPALIVE + SIGNATURE + usage_only) == b""
    assert ledger.state is LedgerState.PENDING
    assert ledger.failed("reset") == b"" and ledger.verdict is Verdict.REPLAY


def test_the_first_text_releases_what_was_held_and_commits() -> None:
    ledger = Ledger(GEMINI)
    assert feed_all(ledger, SIGNATURE) == b""
    assert feed_all(ledger, HELLO) == SIGNATURE + HELLO
    assert ledger.state is LedgerState.COMMITTED


def test_a_function_call_is_released_whole_and_commits() -> None:
    ledger = Ledger(GEMINI)
    assert feed_all(ledger, chunk(SHELL)) == chunk(SHELL)
    assert ledger.state is LedgerState.COMMITTED
    assert not ledger.replayable


def test_a_retryable_error_before_output_replays_after_output_fails() -> None:
    ledger = Ledger(GEMINI)
    assert feed_all(ledger, SIGNATURE + UNAVAILABLE) == b""
    assert ledger.verdict is Verdict.REPLAY

    ledger = Ledger(GEMINI)
    feed_all(ledger, HELLO)
    out = feed_all(ledger, UNAVAILABLE)
    assert ledger.verdict is Verdict.FAIL and ledger.state is LedgerState.FAILED
    assert out == ledger.error_bytes and b'"status":"UNAVAILABLE"' in out
    assert b"finishReason" not in out  # never a clean end


def test_a_final_error_is_passed_through() -> None:
    ledger = Ledger(GEMINI)
    assert feed_all(ledger, SIGNATURE + INVALID) == SIGNATURE + INVALID
    assert ledger.passed_through


def test_a_cut_after_output_ends_with_the_native_error_or_nothing_for_a_reset() -> None:
    ledger = Ledger(GEMINI)
    feed_all(ledger, HELLO)
    err = ledger.failed("reset")
    assert ledger.verdict is Verdict.FAIL
    assert one(err).data is not None and json.loads(one(err).data or "")["error"]["code"] == 503

    quiet = Ledger(GEMINI, error_after_commit=False)
    feed_all(quiet, HELLO)
    assert quiet.failed("reset") == b"" and quiet.verdict is Verdict.FAIL
    assert quiet.state is LedgerState.FAILED
    # retries exhausted before any output: the retryable error even for a reset profile
    pending = Ledger(GEMINI, error_after_commit=False)
    assert b"UNAVAILABLE" in pending.give_up("retries exhausted")


def test_a_clean_end_without_a_finish_is_a_truncation() -> None:
    ledger = Ledger(GEMINI)
    feed_all(ledger, HELLO)
    assert b"UNAVAILABLE" in ledger.ended()
    assert ledger.verdict is Verdict.FAIL


def test_hold_all_keeps_everything_until_the_finish() -> None:
    ledger = Ledger(GEMINI, hold=Hold(["all"]))
    assert feed_all(ledger, HELLO + WORLD) == b""
    assert ledger.failed("reset") == b"" and ledger.verdict is Verdict.REPLAY


# -- native frames ---------------------------------------------------------------------------
def test_the_error_frame_is_a_retryable_gemini_error_in_gemini_framing() -> None:
    raw = error_frame("unbroken: cut")
    assert raw.startswith(b"data: {") and raw.endswith(b"}\r\n\r\n")
    assert kinds(raw) == ["TERMINAL_ERROR|RETRYABLE"]


def test_a_final_error_in_the_stream_keeps_its_code() -> None:
    body = json.dumps(
        {"error": {"code": 400, "message": "API key not valid.", "status": "INVALID_ARGUMENT"}}
    ).encode()
    got = json.loads(one(final_error_frame(400, body, "rid")).data or "")["error"]
    assert got == {
        "code": 400,
        "message": "API key not valid. (request id rid)",
        "status": "INVALID_ARGUMENT",
    }
    assert kinds(final_error_frame(404, b"not json")) == ["TERMINAL_ERROR"]


# -- RetryInfo and quotas --------------------------------------------------------------------
def body_429(delay: Any, quota_id: str = "GenerateRequestsPerMinutePerProjectPerModel") -> bytes:
    return json.dumps(
        {
            "error": {
                "code": 429,
                "status": "RESOURCE_EXHAUSTED",
                "message": "You exceeded your current quota, please check your plan "
                "and billing details.",
                "details": [
                    {
                        "@type": "type.googleapis.com/google.rpc.QuotaFailure",
                        "violations": [{"quotaMetric": "m", "quotaId": quota_id}],
                    },
                    {"@type": "type.googleapis.com/google.rpc.Help", "links": []},
                    {"@type": "type.googleapis.com/google.rpc.RetryInfo", "retryDelay": delay},
                ],
            }
        }
    ).encode()


@pytest.mark.parametrize(
    ("delay", "seconds"),
    [
        ("37s", 37.0),
        ("1.5s", 1.5),
        ("0.250s", 0.25),
        (" 2s ", 2.0),
        ({"seconds": 3, "nanos": 500_000_000}, 3.5),
        ({"seconds": "4"}, 4.0),
        ("-1s", None),
        ("soon", None),
        ("3", None),
        ({"seconds": -1}, None),
    ],
)
def test_retry_delay(delay: Any, seconds: float | None) -> None:
    assert retry_delay(body_429(delay)) == seconds


def test_retry_delay_in_odd_bodies() -> None:
    assert retry_delay(b"") is None
    assert retry_delay(b"<html>503</html>") is None
    assert retry_delay(b'{"error": {"code": 503, "details": "x"}}') is None
    assert retry_delay(b"[" + body_429("2s") + b"]") == 2.0


def test_only_a_per_day_quota_is_a_wall() -> None:
    assert not is_quota_wall(body_429("30s"))
    assert is_quota_wall(body_429("30s", "GenerateRequestsPerDayPerProjectPerModel-FreeTier"))
    assert not GEMINI.quota_body(body_429("30s"))


# -- the turn machine with a Gemini client ----------------------------------------------------
def machine(
    *, profile: str = "gemini-cli", max_retry_after_ms: int = 60_000, **timers: Any
) -> TurnMachine:
    retry = RetryState(
        RetryPolicy(delay_ms=250, backoff="fixed", max_retry_after_ms=max_retry_after_ms),
        1,
        rng=random.Random(0),
    )
    return TurnMachine(
        protocol=GEMINI,
        hold=Hold(),
        timers=Timers(**timers),
        retry=retry,
        stream=True,
        now=0.0,
        report=Report(),
        profile=PROFILES[profile],
    )


def test_retry_info_is_obeyed_like_retry_after_and_clamped() -> None:
    m = machine()
    assert isinstance(m.start(0.0), Open)
    assert m.answered(0.1, 429, sse=False) == ReadErrorBody()
    assert m.error_body(0.1, body_429("3s")) == Wait(3.0)

    m = machine(max_retry_after_ms=2000)
    m.start(0.0)
    m.answered(0.1, 429, sse=False)
    assert m.error_body(0.1, body_429("90s")) == Wait(2.0)
    # a Retry-After header wins over the body
    m = machine()
    m.start(0.0)
    m.answered(0.1, 503, sse=False, retry_after_s=1.0)
    assert m.error_body(0.1, body_429("9s")) == Wait(1.0)


def test_a_per_day_quota_is_given_up_not_retried() -> None:
    m = machine()
    m.start(0.0)
    m.answered(0.1, 429, sse=False)
    action = m.error_body(0.1, body_429("30s", "GenerateRequestsPerDayPerProjectPerModel"))
    assert isinstance(action, GiveUp)


def stream_text(m: TurnMachine) -> bytes:
    assert isinstance(m.start(0.0), Open)
    assert m.answered(0.1, 200, sse=True) == Stream()
    return b"".join(e.raw for e in m.feed_chunk(0.2, HELLO).released)


def test_gemini_cli_gets_a_reset_after_commit() -> None:
    assert identify({"user-agent": "GeminiCLI-tui/0.61.0/gemini-2.5-flash (linux; x64)"}) == (
        "gemini-cli"
    )
    m = machine()
    assert stream_text(m) == HELLO
    assert m.transport_failed(0.3, Failure(FailureClass.RESET, "reset")) == End(EndKind.ABORT)
    assert m.outcome is Outcome.ENDED_WITH_ERROR
    m = machine()
    stream_text(m)
    released, over = m.feed_chunk(0.3, UNAVAILABLE)
    assert not released  # no error event reaches the client
    assert over == End(EndKind.ABORT)


def test_an_unknown_client_gets_the_native_error_after_commit() -> None:
    m = machine(profile="unknown")
    assert stream_text(m) == HELLO
    action = m.transport_failed(0.3, Failure(FailureClass.RESET, "reset"))
    assert isinstance(action, End) and action.kind is EndKind.ERROR
    assert b'"code":503' in action.data


@pytest.mark.parametrize("profile", ["gemini-cli", "unknown"])
def test_every_gemini_client_gets_blank_line_keepalives(profile: str) -> None:
    m = machine(profile=profile, early_headers_s=5, keepalive_s=2)
    m.start(0.0)
    m.open_failed(0.1, Failure(FailureClass.REFUSED, "refused"))
    assert m.tick(5.0) == SendHeaders(200)
    assert m.keepalive_bytes == BLANK_LINE_KEEPALIVE
    assert m.tick(7.0) == Keepalive(BLANK_LINE_KEEPALIVE)


def test_after_commit_end_is_a_client_setting() -> None:
    assert check_overrides("gemini-cli", {"after_commit_end": "error"}) == {
        "after_commit_end": CommitEnd.ERROR
    }
    with pytest.raises(ValueError, match="after_commit_end"):
        check_overrides("unknown", {"after_commit_end": "close"})
    assert PROFILES["unknown"].after_commit_end is CommitEnd.ERROR
    assert PROFILES["gemini-cli"].after_commit_end is CommitEnd.RESET
