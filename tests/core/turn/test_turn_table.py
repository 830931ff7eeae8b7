"""The turn machine's table (`core.turn.turn_table`): the code runs it, and the docs are made
from it."""

from __future__ import annotations

import random
import subprocess
import sys
import typing
from pathlib import Path

import pytest

from turnfix import Report, Timers
from unbroken.core.admission.policy import RetryPolicy, RetryState
from unbroken.core.turn import machine as machine_mod
from unbroken.core.turn import turn_fields as turn_mod
from unbroken.core.turn import turn_table
from unbroken.core.turn.ledger import Hold
from unbroken.core.turn.machine import Action, Open, TurnError, TurnMachine, Wait
from unbroken.core.turn.turn_table import ENTERS, LEGAL, ROWS, Step, TurnEvent
from unbroken.core.wire.protocols import CHAT

ROOT = Path(__file__).resolve().parents[3]
GATE = ROOT / "docs" / "gate.md"
TURN = ROOT / "src" / "unbroken" / "core" / "turn" / "machine.py"


def _machine() -> TurnMachine:
    return TurnMachine(
        protocol=CHAT,
        hold=Hold(),
        timers=Timers(),
        retry=RetryState(RetryPolicy(delay_ms=100, backoff="fixed"), 1, rng=random.Random(0)),
        stream=True,
        now=0.0,
        report=Report(),
    )


def _step(m: TurnMachine) -> Step:
    """``m.step`` read through a call: mypy would keep a bare ``m.step`` narrowed to the
    step a first assert saw, across the calls that move the machine on."""
    return m.step


def test_gate_md_shows_the_table_the_code_runs() -> None:
    part = turn_table.generated_part(GATE.read_text(encoding="utf-8"))
    assert part is not None, "docs/gate.md lost its generated turn table markers"
    assert part == turn_table.markdown(), (
        "docs/gate.md's turn table differs from core/turn/turn_table.py's ROWS: regenerate it "
        "with `python -m unbroken.core.turn.turn_table --markdown`"
    )


def test_the_doc_check_notices_a_hand_edit() -> None:
    doc = GATE.read_text(encoding="utf-8").replace("| NEW | `start` |", "| NEW | `begin` |")
    assert turn_table.generated_part(doc) != turn_table.markdown()


def test_the_turn_header_shows_the_same_steps() -> None:
    assert turn_table.header_table() in TURN.read_text(encoding="utf-8")


def test_the_command_prints_the_table() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "unbroken.core.turn.turn_table", "--markdown"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert out == turn_table.markdown()
    bad = subprocess.run(
        [sys.executable, "-m", "unbroken.core.turn.turn_table"], capture_output=True, text=True
    )
    assert bad.returncode == 2 and "usage" in bad.stderr


def test_every_action_enters_a_step_and_every_row_is_unique() -> None:
    assert set(ENTERS) == set(typing.get_args(Action))
    pairs = [(r.step, r.event) for r in ROWS]
    assert len(pairs) == len(set(pairs))
    assert {e for _, e in pairs} == set(TurnEvent)  # every event is legal somewhere
    # ENDED and ERROR accept no event of the table; every other step accepts one
    assert {s for s, _ in pairs} == set(Step) - {Step.ENDED, Step.ERROR}


def test_the_legal_events_of_each_step() -> None:
    # Written out by hand, independently of the rows: the table says what the header did.
    expected = {
        Step.NEW: {"start"},
        Step.IDLE: {"next_attempt"},
        Step.CONNECTING: {"open_failed", "answered", "transport_failed"},
        Step.RESUMING: {"open_failed", "answered", "transport_failed"},
        Step.STREAM: {
            "feed_chunk",
            "feed_verbatim",
            "feed_frame",
            "body_ended",
            "transport_failed",
        },
        Step.PASS_THROUGH: {"feed_body", "body_ended", "transport_failed"},
        Step.ERROR_BODY: {"error_body", "transport_failed"},
        Step.FINAL_BODY: {"final_body", "transport_failed"},
        Step.ENDED: set(),
        Step.ERROR: set(),
    }
    got = {s: {e.value for e, steps in LEGAL.items() if s in steps} for s in Step}
    assert got == expected


def test_the_step_after_an_event_is_the_step_its_action_enters() -> None:
    m = _machine()
    action = m.start(0.0)
    assert isinstance(action, Open) and _step(m) is Step.CONNECTING
    assert m.answered(0.1, 503, sse=False).__class__.__name__ == "ReadErrorBody"
    assert _step(m) is Step.ERROR_BODY
    wait = m.error_body(0.2, b"")
    assert isinstance(wait, Wait) and _step(m) is ENTERS[Wait] is Step.IDLE


def test_an_action_the_table_does_not_list_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    # The table is what runs: take Open out of (NEW, start) and start() is refused,
    # the machine left in ERROR (on the old code, the steps were set by hand: no
    # table to take anything out of).
    rows = dict(turn_table.ALLOWED)
    rows[Step.NEW, TurnEvent.START] = frozenset({Wait})
    monkeypatch.setattr(turn_mod, "ALLOWED", rows)
    monkeypatch.setattr(machine_mod, "ALLOWED", rows)  # (start checks it inline)
    m = _machine()
    with pytest.raises(TurnError, match="not in the table"):
        m.start(0.0)
    assert m.step is Step.ERROR
    with pytest.raises(TurnError):
        m.next_attempt(0.1)


def test_an_event_the_table_does_not_list_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    # each event's check is the table's LEGAL entry for it
    assert machine_mod._START_IN is LEGAL[TurnEvent.START]
    assert machine_mod._ANSWERED_IN is LEGAL[TurnEvent.ANSWERED]
    monkeypatch.setattr(machine_mod, "_START_IN", frozenset())
    m = _machine()
    with pytest.raises(TurnError, match="illegal in step new"):
        m.start(0.0)
    assert m.step is Step.ERROR


#: the turn's given facts (constructor arguments, never changed): not state
_GIVEN = {"socket", "stream"}


def test_the_machine_keeps_no_flags_its_state_is_the_step_and_the_sub_states() -> None:
    """Every yes/no of the machine's state is a sub-state enum listed in
    `turn_table.SUBSTATES` (the issue counted nine flags beside `_Step`)."""
    hints = typing.get_type_hints(turn_mod.TurnFields)
    flags = {name for name, hint in hints.items() if hint is bool} - _GIVEN
    assert flags == set()
    enums = {
        name: hint
        for name, hint in hints.items()
        if isinstance(hint, type) and hint.__module__ == turn_table.__name__
    }
    assert enums.pop("step") is Step
    assert enums == {sub.field: sub.states for sub in turn_table.SUBSTATES}
    # (``writing`` is a count: a keepalive's write may overlap the output's)
    assert hints["writing"] is int


def test_each_sub_state_value_says_what_enters_it() -> None:
    machine = _machine()
    for sub in turn_table.SUBSTATES:
        assert set(sub.entered) == {value.name for value in sub.states}, sub.field
        assert all(sub.entered.values()), sub.field
        assert isinstance(getattr(machine, sub.field), sub.states)
        assert (sub.states.__doc__ or "").strip(), sub.field
