"""Anthropic continuation by prefill: the join, the framing, the refusals (sans-IO).

The property: for random text-only Messages streams, cut after random numbers of
released frames (again and again, up to four cuts), a model that continues exactly
from the prefill it is given yields a client stream whose text is the uncut text,
byte for byte, with valid framing (one ``message_start``, one ``message_delta``, one
``message_stop``, block indexes in order, every delta inside its open block).  A
model that continues with whitespace of its own at the join yields the committed
text plus the continuation, with only the whitespace the client already has at that
position left out.
"""

from __future__ import annotations

import itertools
import json
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from unbroken.core.turn.ledger import Ledger, LedgerState, Verdict
from unbroken.core.wire.protocols import ANTHROPIC
from unbroken.core.wire.protocols.anthropic_prefill import (
    Committed,
    FrameSplicer,
    Plan,
    plan_continuation,
    read_committed,
    request_refusal,
)
from unbroken.core.wire.protocols.prefill import (
    JoinError,
    PrefillRefusal,
    TextJoin,
    echo_tails,
    reconcile,
)
from unbroken.core.wire.sse import Event, SSESplitter

ORIG_IN = 1000


def frame(name: str, payload: dict[str, Any]) -> bytes:
    return f"event: {name}\ndata: {json.dumps(payload)}\n\n".encode()


def stream(
    blocks: list[list[str]],
    *,
    input_tokens: int = ORIG_IN,
    output_tokens: int = 7,
    pings: bool = True,
    tool_after: bool = False,
) -> list[bytes]:
    """A text-only Messages stream: one text block per list of delta pieces."""
    usage = {"input_tokens": input_tokens, "output_tokens": 1, "cache_read_input_tokens": 0}
    out = [
        frame("message_start", {"type": "message_start", "message": {"id": "m", "usage": usage}})
    ]
    index = 0
    for pieces in blocks:
        out.append(
            frame(
                "content_block_start",
                {
                    "type": "content_block_start",
                    "index": index,
                    "content_block": {"type": "text", "text": ""},
                },
            )
        )
        if pings and index == 0:
            out.append(frame("ping", {"type": "ping"}))
        for piece in pieces:
            out.append(
                frame(
                    "content_block_delta",
                    {
                        "type": "content_block_delta",
                        "index": index,
                        "delta": {"type": "text_delta", "text": piece},
                    },
                )
            )
        out.append(frame("content_block_stop", {"type": "content_block_stop", "index": index}))
        index += 1
    if tool_after:
        out.append(
            frame(
                "content_block_start",
                {
                    "type": "content_block_start",
                    "index": index,
                    "content_block": {"type": "tool_use", "id": "t", "name": "bash", "input": {}},
                },
            )
        )
        out.append(
            frame(
                "content_block_delta",
                {
                    "type": "content_block_delta",
                    "index": index,
                    "delta": {"type": "input_json_delta", "partial_json": "{}"},
                },
            )
        )
        out.append(frame("content_block_stop", {"type": "content_block_stop", "index": index}))
    out.append(
        frame(
            "message_delta",
            {
                "type": "message_delta",
                "delta": {"stop_reason": "tool_use" if tool_after else "end_turn"},
                "usage": {"output_tokens": output_tokens},
            },
        )
    )
    out.append(frame("message_stop", {"type": "message_stop"}))
    return out


def events(raw: bytes) -> list[Event]:
    return SSESplitter().feed(raw)


def client_view(raw: bytes) -> dict[str, Any]:
    """Check the framing of a client's stream; return its text and counters."""
    text: list[str] = []
    names: list[str] = []
    open_index: int | None = None
    next_index = 0
    usage: dict[str, Any] = {}
    tools = 0
    for event in events(raw):
        if event.data is None:
            continue
        obj = json.loads(event.data)
        assert obj["type"] == event.name
        names.append(event.name or "")
        if event.name == "content_block_start":
            assert open_index is None, "a block starts inside another"
            assert obj["index"] == next_index, "block indexes in order from 0"
            open_index = obj["index"]
            next_index += 1
            block = obj["content_block"]
            if block["type"] == "text":
                text.append(block["text"])
            else:
                tools += 1
        elif event.name == "content_block_delta":
            assert obj["index"] == open_index, "a delta outside its block"
            if obj["delta"]["type"] == "text_delta":
                text.append(obj["delta"]["text"])
        elif event.name == "content_block_stop":
            assert obj["index"] == open_index
            open_index = None
        elif event.name == "message_delta":
            assert open_index is None
            usage = obj["usage"]
    assert names.count("message_start") == 1
    assert names[0] == "message_start"
    assert names.count("message_delta") == 1
    assert names.count("message_stop") == 1
    assert names[-1] == "message_stop"
    assert names[-2] == "message_delta"
    return {"text": "".join(text), "usage": usage, "tools": tools}


def repeats(prefill: str, rest: str) -> bool:
    """Whether a continuation whose (first block's) text is ``rest`` repeats the end of
    ``prefill`` (`prefill.echo_tails`): refused, the model's words or an echo alike."""
    tails = echo_tails(prefill)
    return any(rest.startswith(t) for t in tails) or (
        bool(rest.strip()) and any(t.startswith(rest) for t in tails)
    )


def released_prefix(frames: list[bytes], cut: int) -> bytes:
    """What the ledger releases of ``frames`` when the stream is cut after ``cut`` of them."""
    ledger = Ledger(ANTHROPIC)
    out: list[bytes] = []
    for raw in frames[:cut]:
        (event,) = events(raw)
        out.extend(e.raw for e in ledger.feed(event))
    return b"".join(out)


def pieces_of(text: str, cuts: list[int]) -> list[str]:
    points = sorted({c % (len(text) + 1) for c in cuts} | {0, len(text)})
    return [text[a:b] for a, b in itertools.pairwise(points) if b > a] or [""]


texts = st.text(alphabet="ab c\n\t.é", min_size=1, max_size=40)


def continue_exactly(
    p: Plan, full: str, client_prefill: str, cut_points: list[int], tool: bool
) -> list[bytes]:
    """A model that continues ``full`` exactly from the prefill it is given."""
    assert (client_prefill + full).startswith(p.prefill)
    rest = (client_prefill + full)[len(p.prefill) :]
    prefill_tokens = len(p.prefill)  # the mock tokenizer: one token a character
    return stream(
        [pieces_of(rest, cut_points)],
        input_tokens=ORIG_IN + prefill_tokens,
        output_tokens=len(rest),
        tool_after=tool,
    )


def splice(p: Plan, frames: list[bytes], cut: int | None) -> bytes:
    """The client's bytes from a continuation cut after ``cut`` frames (None: whole),
    through the splicer and the ledger, as a continued attempt releases them."""
    splicer = FrameSplicer(p)
    ledger = Ledger(ANTHROPIC)
    ledger.state = LedgerState.COMMITTED  # a continuation attempt follows output
    out: list[bytes] = []
    for raw in frames if cut is None else frames[:cut]:
        (event,) = events(raw)
        for spliced in splicer.feed(event):
            out.extend(e.raw for e in ledger.feed(spliced))
    if cut is None:
        assert ledger.verdict is Verdict.DONE
    return b"".join(out)


@settings(max_examples=300, deadline=None)
@given(
    blocks=st.lists(texts, min_size=1, max_size=3),
    split=st.lists(st.integers(0, 60), max_size=8),
    cuts=st.lists(st.integers(3, 40), min_size=1, max_size=4),
    client_prefill=st.sampled_from(["", "Sure", "{"]),
    tool=st.booleans(),
)
def test_cut_again_and_again_the_client_gets_the_uncut_text(
    blocks: list[str], split: list[int], cuts: list[int], client_prefill: str, tool: bool
) -> None:
    full = "".join(blocks)
    request: dict[str, Any] = {"model": "m", "stream": True, "max_tokens": 100}
    request["messages"] = [{"role": "user", "content": "hi"}]
    if client_prefill:
        request["messages"].append({"role": "assistant", "content": client_prefill})
    frames = stream([pieces_of(b, split) for b in blocks], tool_after=tool)
    client = released_prefix(frames, min(cuts[0], len(frames) - 2))
    for n, cut in enumerate([*cuts[1:], None]):
        committed = read_committed(client)
        if isinstance(committed, PrefillRefusal):
            # Only a tool call or the stop already released refuse a text-only turn.
            assert committed in (PrefillRefusal.TOOL_CALL, PrefillRefusal.STOP_RELEASED)
            return
        assert committed.text == full[: len(committed.text)]
        p = plan_continuation(request, committed)
        assert isinstance(p, Plan)
        assert not p.prefill[-1:].isspace()
        last = p.body["messages"][-1]
        if p.prefill:
            assert last == {"role": "assistant", "content": p.prefill}
        cont = continue_exactly(p, full, client_prefill, split[n:] or [1], tool)
        rest = (client_prefill + full)[len(p.prefill) :]
        try:
            client += splice(p, cont, cut if cut is None else min(cut, len(cont) - 2))
        except JoinError:
            # A continuation that starts with the end of the prefill again: refused, as
            # an echo would be (never shown twice); the client has a prefix of the text.
            assert repeats(p.prefill, rest)
            return
        assert cut is not None or not repeats(p.prefill, rest)
    view = client_view(client)
    assert view["text"] == full
    assert view["tools"] == (1 if tool else 0)


@settings(max_examples=300, deadline=None)
@given(
    text=texts,
    cut=st.integers(4, 30),
    leading=st.text(alphabet=" \n\t", max_size=4),
    rest=st.text(alphabet="xy z", min_size=1, max_size=10).filter(lambda s: not s[0].isspace()),
    split=st.lists(st.integers(0, 20), max_size=4),
)
def test_a_model_with_its_own_whitespace_at_the_join(
    text: str, cut: int, leading: str, rest: str, split: list[int]
) -> None:
    """Committed prefix + continuation, with no whitespace the client has shown twice."""
    request = {"model": "m", "stream": True, "messages": [{"role": "user", "content": "q"}]}
    frames = stream([pieces_of(text, split)])
    client = released_prefix(frames, min(cut, len(frames) - 2))
    committed = read_committed(client)
    if isinstance(committed, PrefillRefusal):
        assert committed is PrefillRefusal.STOP_RELEASED
        return
    p = plan_continuation(request, committed)
    assert isinstance(p, Plan)
    continuation = leading + rest
    cont = stream([pieces_of(continuation, split)], input_tokens=ORIG_IN + 3, output_tokens=5)
    out = client + splice(p, cont, None)
    view = client_view(out)
    shown = committed.text[len(committed.text.rstrip()) :]
    assert view["text"] == committed.text + reconcile(shown, leading) + rest
    # usage: input as the original said, output = the prefill's tokens + the continuation's
    assert view["usage"]["output_tokens"] == 3 + 5


def test_the_join_rule_by_example() -> None:
    assert reconcile(" ", " world") == "world"
    assert reconcile("\n", "\n\nNext") == "\nNext"
    assert reconcile("\n\n", "\n") == ""
    assert reconcile(" ", "\n") == "\n"
    join = TextJoin(" ")
    assert join.text(" ") == ""  # whitespace only: held
    assert join.text("\n") == ""
    assert join.text("x") == "\nx"  # the space was shown; the newline is new
    assert join.text(" y") == " y"  # past the join: as it is
    echo = TextJoin("", echo="Hello")
    assert echo.text("Hel") == ""
    assert echo.text("lo world") == " world"  # the echoed prefix is dropped


def _committed(frames: list[bytes]) -> Committed | PrefillRefusal:
    return read_committed(b"".join(frames))


def test_refusals_read_from_what_was_released() -> None:
    start = frame(
        "message_start", {"type": "message_start", "message": {"usage": {"input_tokens": 5}}}
    )

    def block(kind: str, **extra: Any) -> bytes:
        cb = {"type": kind, **extra}
        return frame(
            "content_block_start", {"type": "content_block_start", "index": 0, "content_block": cb}
        )

    assert (
        _committed([start, block("tool_use", id="t", name="x", input={})])
        is PrefillRefusal.TOOL_CALL
    )
    assert _committed([start, block("thinking", thinking="")]) is PrefillRefusal.THINKING
    assert _committed([start, block("redacted_thinking", data="x")]) is PrefillRefusal.THINKING
    assert (
        _committed([start, block("server_tool_use", id="s", name="web_search")])
        is PrefillRefusal.SERVER_TOOL
    )
    assert _committed([start, block("web_search_tool_result")]) is PrefillRefusal.SERVER_TOOL
    assert _committed([start, block("mystery")]) is PrefillRefusal.OTHER_CONTENT
    citations = frame(
        "content_block_delta",
        {
            "type": "content_block_delta",
            "index": 0,
            "delta": {"type": "citations_delta", "citation": {}},
        },
    )
    assert _committed([start, block("text", text=""), citations]) is PrefillRefusal.OTHER_CONTENT
    delta = frame(
        "message_delta", {"type": "message_delta", "delta": {}, "usage": {"output_tokens": 1}}
    )
    assert _committed([start, block("text", text=""), delta]) is PrefillRefusal.STOP_RELEASED
    assert read_committed(b"event: ping\ndata: {nope\n\n") is PrefillRefusal.MALFORMED
    assert read_committed(b"event: content_block_delta\ndata: {") is PrefillRefusal.MALFORMED
    ok = _committed([start, block("text", text="Hi"), b": keepalive\n\n"])
    assert isinstance(ok, Committed)
    assert (ok.text, ok.open_index, ok.next_index) == ("Hi", 0, 1)


@pytest.mark.parametrize(
    ("request_", "refusal"),
    [
        ({"stream": True, "messages": [{"role": "user", "content": "q"}]}, None),
        ({"messages": [{"role": "user", "content": "q"}]}, PrefillRefusal.NOT_STREAMED),
        ({"stream": True, "messages": []}, PrefillRefusal.BAD_REQUEST),
        ({"stream": True}, PrefillRefusal.BAD_REQUEST),
        (
            {
                "stream": True,
                "thinking": {"type": "enabled", "budget_tokens": 1024},
                "messages": [{"role": "user"}],
            },
            PrefillRefusal.THINKING_ENABLED,
        ),
        (
            {"stream": True, "thinking": {"type": "adaptive"}, "messages": [{"role": "user"}]},
            PrefillRefusal.THINKING_ENABLED,
        ),
        ({"stream": True, "thinking": {"type": "disabled"}, "messages": [{"role": "user"}]}, None),
        (
            {"stream": True, "tool_choice": {"type": "any"}, "messages": [{"role": "user"}]},
            PrefillRefusal.FORCED_TOOL,
        ),
        (
            {"stream": True, "tool_choice": {"type": "auto"}, "messages": [{"role": "user"}]},
            None,
        ),
        (
            {
                "stream": True,
                "messages": [
                    {"role": "user"},
                    {"role": "assistant", "content": [{"type": "tool_use"}]},
                ],
            },
            PrefillRefusal.CLIENT_PREFILL,
        ),
        (
            {
                "stream": True,
                "messages": [
                    {"role": "user"},
                    {"role": "assistant", "content": [{"type": "text", "text": "{"}]},
                ],
            },
            None,
        ),
    ],
)
def test_request_refusals(request_: dict[str, Any], refusal: PrefillRefusal | None) -> None:
    assert request_refusal(request_) is refusal


def test_the_plan_extends_a_client_prefill_and_trims_whitespace() -> None:
    committed = Committed("one two \n", 0, 1, {"input_tokens": 4})
    request: dict[str, Any] = {
        "stream": True,
        "messages": [
            {"role": "user", "content": "q"},
            {"role": "assistant", "content": [{"type": "text", "text": "Answer:"}]},
        ],
    }
    p = plan_continuation(request, committed)
    assert isinstance(p, Plan)
    assert p.prefill == "Answer:one two"
    assert p.shown_ws == " \n"
    body: Any = p.body
    assert body["messages"][-1]["content"] == [{"type": "text", "text": "Answer:one two"}]
    assert request["messages"][-1]["content"] == [
        {"type": "text", "text": "Answer:"}
    ]  # not mutated
    only_ws = plan_continuation(
        {"stream": True, "messages": [{"role": "user"}]}, Committed("  ", 0, 1)
    )
    assert isinstance(only_ws, Plan)
    assert (only_ws.prefill, only_ws.shown_ws) == ("", "  ")
    assert only_ws.body["messages"] == [{"role": "user"}]  # nothing to prefill: no message


@pytest.mark.parametrize(
    ("prefill", "pieces", "refused"),
    [
        ("Hello wor", ["wo", "rld"], True),  # the partial word again
        ("Hello wor", [" wor", "ld"], True),  # with the space before it
        ("Hello wor", ["Hello", " world"], True),  # the whole prefill
        ("Hello wor", ["l", "d!"], False),  # the word goes on
        ("Hello world.", [" How", " are"], False),  # a new sentence
        ("I said no", [" no"], True),  # the model's own repeat: refused all the same
        ("Hello wor", ["w"], True),  # ends inside a repeat: no guess either
    ],
)
def test_a_continuation_repeating_the_prefill_is_refused(
    prefill: str, pieces: list[str], refused: bool
) -> None:
    """Issue 33: an echo of the prefill's end is never shown twice (refused, not
    stripped: an echo and the model's own words cannot be told apart)."""
    join = TextJoin("", tail=prefill)
    out = []
    try:
        for piece in pieces:
            out.append(join.text(piece))
        out.append(join.flush())
    except JoinError:
        assert refused
        assert not "".join(out)  # nothing of it was let through
        return
    assert not refused
    assert "".join(out) == "".join(pieces)
