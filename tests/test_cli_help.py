"""Every option of every command says its default in --help."""

from __future__ import annotations

import argparse

import pytest

from unbroken.cli import _parser, main
from unbroken.mock.command import main_mock

FLAGS = (
    argparse._StoreTrueAction,
    argparse._StoreFalseAction,
    argparse._HelpAction,
    argparse._VersionAction,
    argparse._SubParsersAction,
)


def _commands() -> dict[str, argparse.ArgumentParser]:
    out: dict[str, argparse.ArgumentParser] = {}
    todo = [("unbroken", _parser())]
    while todo:
        name, parser = todo.pop()
        out[name] = parser
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                todo += [(f"{name} {sub}", p) for sub, p in action.choices.items()]
    return out


@pytest.mark.parametrize("command", sorted(_commands()))
def test_every_option_says_its_default(command: str) -> None:
    parser = _commands()[command]
    for action in parser._actions:
        if isinstance(action, FLAGS) or not action.option_strings or action.required:
            continue
        assert action.help and "default" in action.help, (command, action.option_strings)


def test_the_mock_command_says_its_defaults(capsys: pytest.CaptureFixture[str]) -> None:
    assert main_mock(["--help"]) == 0
    text = " ".join(capsys.readouterr().out.split())
    for option in (
        "--host HOST bind address (default",
        "--port PORT port (default",
        "(default: none",
    ):
        assert option in text, text


def test_help_runs_for_every_command(capsys: pytest.CaptureFixture[str]) -> None:
    for command in _commands():
        if command == "unbroken mock":  # its own parser, which returns instead of exiting
            assert main(["mock", "--help"]) == 0
        else:
            with pytest.raises(SystemExit) as exit_:
                main([*command.split()[1:], "--help"])
            assert exit_.value.code == 0
        assert capsys.readouterr().out.startswith(f"usage: {command}")


def test_a_command_imports_only_its_own_module() -> None:
    """``unbroken run`` starts the agent sooner: it no longer imports the demo (and with
    it the openai SDK) or any other command's module (0.8 s -> 0.26 s to its parser)."""
    import subprocess
    import sys

    code = (
        "import sys; from unbroken.cli import _parser; _parser('run'); "
        "print(sorted(m for m in ('unbroken.demo', 'openai', 'unbroken.observe.status', "
        "'unbroken.opencode.run', 'unbroken.opencode.setup') if m in sys.modules))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout
    assert out.strip() == "['unbroken.opencode.run']"


def test_the_mock_and_run_help_name_every_protocol_and_agent(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Issue 35: `unbroken mock --help` and `unbroken run --help` left out Gemini."""
    from unbroken.agents.launcher import agent_of
    from unbroken.mock.wire import PROTOCOL_NAMES

    shown = {
        "chat": "Chat Completions",
        "responses": "Responses",
        "anthropic": "Anthropic Messages",
        "gemini": "streamGenerateContent",
    }
    assert set(shown) == set(PROTOCOL_NAMES)  # a new protocol must be named here too
    assert main(["mock", "--help"]) == 0
    text = " ".join(capsys.readouterr().out.split())
    for name in shown.values():
        assert name in text, name
    agents = {"opencode": "OpenCode", "codex": "Codex", "claude": "Claude Code"}
    agents["gemini"] = "Gemini CLI"
    assert {agent_of([a]) for a in agents} == {"generic", "codex", "claude", "gemini"}
    with pytest.raises(SystemExit):
        main(["run", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "opencode|codex|claude|gemini|<command>" in text.replace("-- ", "--")
    with pytest.raises(SystemExit):
        main(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    for name in agents.values():
        assert name in text, name
