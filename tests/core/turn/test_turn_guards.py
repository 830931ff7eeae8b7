"""Only the table moves the turn machine (issue 34, 4): one method writes the step, the
sub-states are written through checked setters, and the guards of `answered`,
`transport_failed` and `body_ended` are ordered lists the code runs and the docs show."""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import pytest

from turnfix import TEXT, make, streaming
from unbroken.core.turn import machine as machine_mod
from unbroken.core.turn import turn_fields as fields_mod
from unbroken.core.turn import turn_table
from unbroken.core.turn.machine import (
    Open,
    PassThrough,
    ReadErrorBody,
    Stream,
    TurnError,
    TurnMachine,
)
from unbroken.core.turn.turn_fields import TurnFields
from unbroken.core.turn.turn_guards import ALWAYS, GUARDS, guards_of
from unbroken.core.turn.turn_table import (
    ANSWER_KEPT,
    ENTERED_IN,
    NOTHING_SENT,
    SUBSTATES,
    Step,
    TurnEvent,
    Watch,
)

ROOT = Path(__file__).resolve().parents[3]
GATE = ROOT / "docs" / "gate.md"

#: the machine's state fields the scan watches: the step and each sub-state
FIELDS = frozenset({"step", *(sub.field for sub in SUBSTATES)})
#: where each may be written: the step by the table's transition, each sub-state by its
#: checked setter (all of them on `TurnFields`)
WRITERS = {
    "step": {"TurnFields._moved"},
    **{sub.field: {f"TurnFields._set_{sub.field}"} for sub in SUBSTATES},
}


def machine_modules() -> list[Path]:
    """The modules `TurnMachine` is made of (each class of its MRO in the package): a new
    part is scanned without being listed here."""
    paths = {
        Path(inspect.getsourcefile(cls) or "")
        for cls in TurnMachine.__mro__
        if cls.__module__.startswith("unbroken.")
    }
    return sorted(paths)


def field_writes(path: Path) -> list[tuple[str, str, int]]:
    """(field, ``Class.method``, line) for each assignment to a watched field of any
    object (``self.step = ...``, ``m.watch = ...``, ``x.reply += ...``, in a tuple
    target too) and each ``setattr`` of one by name."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    found: list[tuple[str, str, int]] = []

    def visit(node: ast.AST, where: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.ClassDef):
                visit(child, child.name)
                continue
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                visit(child, f"{where}.{child.name}" if where else child.name)
                continue
            targets: list[ast.expr] = []
            if isinstance(child, ast.Assign):
                targets = child.targets
            elif isinstance(child, (ast.AugAssign, ast.AnnAssign)):
                targets = [child.target]
            for target in targets:
                for t in ast.walk(target):
                    if isinstance(t, ast.Attribute) and t.attr in FIELDS:
                        found.append((t.attr, where, getattr(child, "lineno", 0)))
            if (
                isinstance(child, ast.Call)
                and isinstance(child.func, ast.Name)
                and child.func.id == "setattr"
                and len(child.args) > 1
                and isinstance(child.args[1], ast.Constant)
                and child.args[1].value in FIELDS
            ):
                found.append((str(child.args[1].value), where, child.lineno))
            visit(child, where)

    visit(tree, "")
    return found


def test_only_the_table_writes_the_step_and_only_the_setters_the_sub_states() -> None:
    # On the old code: the step written in 21 places (14 by hand in the helpers, one a
    # ``Step.STREAM`` set to fake a cut's step), the sub-states in 26, unchecked.
    writes = [w for path in machine_modules() for w in field_writes(path)]
    step_writes = [w for w in writes if w[0] == "step"]
    assert len(step_writes) == 1, step_writes
    for field, where, line in writes:
        assert where in WRITERS[field], f"{field} written by hand in {where} (line {line})"
    # each setter exists and writes its own field
    for sub in SUBSTATES:
        assert callable(getattr(TurnFields, f"_set_{sub.field}"))


def test_the_scan_notices_a_hand_write(tmp_path: Path) -> None:
    sample = tmp_path / "sample.py"
    sample.write_text(
        "class TurnFields:\n"
        "    def _moved(self):\n        self.step = 1\n"
        "    def _set_watch(self, v):\n        self.watch = v\n"
        "class Part(TurnFields):\n"
        "    def _helper(self, m):\n"
        "        self.step = 2\n"
        "        m.reply, x = 3, 4\n"
        "        self.kept += 1\n"
        "        setattr(self, 'pacing', 5)\n"
        "        self.stepping = 6\n"
    )
    assert field_writes(sample) == [
        ("step", "TurnFields._moved", 3),
        ("watch", "TurnFields._set_watch", 5),
        ("step", "Part._helper", 8),
        ("reply", "Part._helper", 9),
        ("kept", "Part._helper", 10),
        ("pacing", "Part._helper", 11),
    ]


def test_the_scan_covers_every_part_of_the_machine() -> None:
    names = {p.name for p in machine_modules()}
    assert {"machine.py", "turn_fields.py", "turn_continue.py", "turn_endings.py"} <= names
    assert {"turn_feeds.py", "turn_clock.py", "turn_fast_path.py"} <= names


# -- the checked setters ----------------------------------------------------------------
def _step(m: TurnMachine) -> Step:
    """``m.step`` read through a call (mypy would keep it narrowed across the calls)."""
    return m.step


def test_a_checked_setter_refuses_a_value_its_step_cannot_enter() -> None:
    m, _ = make()
    assert isinstance(m.start(0.0), Open)
    assert m.step is Step.CONNECTING
    # the answer is kept only by `error_body` (ERROR_BODY), and nothing is unsent again
    assert m.step not in ENTERED_IN[ANSWER_KEPT]
    with pytest.raises(TurnError, match="kept ANSWER entered in step connecting"):
        m._set_kept(ANSWER_KEPT)
    assert _step(m) is Step.ERROR  # refused like an action its row does not list
    assert m.kept is not ANSWER_KEPT
    with pytest.raises(TurnError):
        m.answered(0.1, 200, sse=True)

    m, _ = make()
    streaming(m)
    m.feed_chunk(1.1, TEXT)  # released: the client has headers
    with pytest.raises(TurnError, match="reply NOTHING entered in step stream"):
        m._set_reply(NOTHING_SENT)
    assert m.reply is not NOTHING_SENT


def test_the_machine_writes_its_sub_states_through_the_checked_setters(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The table says where a value may be entered, and the machine's own writes obey it:
    # take STREAM out of where the watch goes IDLE, and the stream's first frame is
    # refused (the machine in ERROR, nothing released).
    entered = dict(ENTERED_IN)
    entered[Watch.IDLE] = frozenset({Step.PASS_THROUGH})
    monkeypatch.setattr(fields_mod, "ENTERED_IN", entered)
    m, _ = make()
    streaming(m)
    with pytest.raises(TurnError, match="watch IDLE entered in step stream"):
        m.feed_chunk(1.1, TEXT)
    assert m.step is Step.ERROR


def test_every_sub_state_value_is_entered_somewhere_the_table_names() -> None:
    for sub in SUBSTATES:
        assert set(sub.by) == {value.name for value in sub.states}, sub.field
        for value in sub.states:
            steps = ENTERED_IN[value]
            assert steps, (sub.field, value)
            # nothing is entered in ERROR: every event but the end from outside raises there
            assert Step.ERROR not in steps, (sub.field, value)


# -- the guards -------------------------------------------------------------------------
def test_each_guard_list_names_methods_of_the_machine_and_ends_with_always() -> None:
    assert {g.event for g in GUARDS} == {"answered", "transport_failed", "body_ended"}
    for guards in GUARDS:
        assert TurnEvent(guards.event)  # an event of the table
        *first, last = guards.guards
        assert last.when == ALWAYS and all(g.when != ALWAYS for g in first), guards.event
        for g in guards.guards:
            for name in (g.when, g.then):
                assert callable(getattr(TurnMachine, name)), (guards.event, name)
            assert g.condition and g.outcome


@pytest.mark.parametrize(
    ("event", "run"),
    [
        ("answered", "_ANSWERED"),
        ("transport_failed", "_TRANSPORT_FAILED"),
        ("body_ended", "_BODY_ENDED"),
    ],
)
def test_the_machine_runs_the_guard_lists_in_their_order(event: str, run: str) -> None:
    ran = getattr(machine_mod, run)
    expected = [(g.when, g.then) for g in guards_of(event).guards]
    assert [(when.__name__, then.__name__) for when, then in ran] == expected


def test_answered_decides_by_its_guard_list(monkeypatch: pytest.MonkeyPatch) -> None:
    # As listed: a 2xx SSE answer streams, a 503 is read as a retryable answer.
    m, _ = make()
    m.start(0.0)
    assert isinstance(m.answered(0.1, 200, sse=True), Stream)
    m, _ = make()
    m.start(0.0)
    assert isinstance(m.answered(0.1, 503, sse=False), ReadErrorBody)
    # The list is what runs: put the last guard (always: a plain body) first, and the
    # same answers pass through.
    reordered = (machine_mod._ANSWERED[-1], *machine_mod._ANSWERED[:-1])
    monkeypatch.setattr(machine_mod, "_ANSWERED", reordered)
    for status, sse in ((200, True), (503, False)):
        m, _ = make()
        m.start(0.0)
        assert isinstance(m.answered(0.1, status, sse=sse), PassThrough)


def test_gate_md_shows_the_guards_the_code_runs() -> None:
    doc = GATE.read_text(encoding="utf-8")
    part = turn_table.generated_part(doc)
    assert part is not None and part == turn_table.markdown()
    for guards in GUARDS:
        for i, g in enumerate(guards.guards, 1):
            assert f"| {i} |" in part and f"(`{g.then}`) |" in part, (guards.event, g.then)


def test_the_doc_check_notices_a_guard_moved_by_hand() -> None:
    # two guards of `answered` swapped in the doc (numbers kept): the check fails
    lines = GATE.read_text(encoding="utf-8").splitlines(keepends=True)
    i = next(n for n, line in enumerate(lines) if "(`_resume_answered`) |" in line)
    one, two = lines[i], lines[i + 1]
    lines[i] = "| 1 |" + two.removeprefix("| 2 |")
    lines[i + 1] = "| 2 |" + one.removeprefix("| 1 |")
    assert turn_table.generated_part("".join(lines)) != turn_table.markdown()
