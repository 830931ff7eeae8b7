"""`unbroken run -- codex ...` reads what Codex's own command line says (issue 33): its
``-c`` overrides, ``-p``/``--profile`` and ``--ignore-user-config``, as Codex does."""

from __future__ import annotations

from pathlib import Path

from unbroken.agents import codex
from unbroken.agents.launcher import plan_for, relay_config
from unbroken.config import parse_config
from unbroken.core.profiles import profile_named

BASE = 'model_provider = "fake"\n[model_providers.fake]\nbase_url = "http://127.0.0.1:9/v1"\n'


def test_c_flags_set_the_idle_timeout_and_the_active_provider(tmp_path: Path) -> None:
    (tmp_path / "config.toml").write_text(
        BASE + '[model_providers.other]\nbase_url = "http://127.0.0.1:8/v1"\n'
    )
    env = {"CODEX_HOME": str(tmp_path)}
    argv = [
        "-c",
        "model_provider=other",
        "exec",
        "--config",
        "model_providers.other.stream_idle_timeout_ms=20000",
        "hello",
    ]
    launch = plan_for(["codex", *argv], env)
    assert launch.clients["codex"]["client_idle_timeout_s"] == 20.0
    assert "active provider: other" in launch.notes[-1]
    cfg = relay_config(parse_config({}, env={}), launch)
    assert profile_named("codex", cfg.clients).client_idle_timeout_s == 20.0
    # before: the command line was invisible (Codex's default 300 s was assumed)
    assert launch.argv(["codex", *argv], "http://R")[-len(argv) :] == argv


def test_a_base_url_given_with_c_is_relayed_and_its_flag_replaced(tmp_path: Path) -> None:
    env = {"CODEX_HOME": str(tmp_path / "none")}
    argv = ["exec", "-c", 'openai_base_url="https://gw.example.com/v1"', "--json", "hi"]
    launch = codex.plan(env, argv)
    assert launch.routes == {"openai": "https://gw.example.com"}
    full = launch.argv(["codex", *argv], "http://R")
    assert full == ["codex", "-c", 'openai_base_url="http://R/openai/v1"', "exec", "--json", "hi"]
    # a provider's base URL with --config=...: the same
    argv = ["--config=model_providers.p.base_url=http://127.0.0.1:7/v1", "exec", "x"]
    launch = codex.plan(env, argv)
    assert launch.routes["p"] == "http://127.0.0.1:7"
    assert launch.argv(["codex", *argv], "http://R")[-2:] == ["exec", "x"]
    assert not any("127.0.0.1:7" in a for a in launch.argv(["codex", *argv], "http://R"))


def test_a_profile_layers_its_file_over_the_base_config(tmp_path: Path) -> None:
    (tmp_path / "config.toml").write_text(BASE)
    (tmp_path / "fast.config.toml").write_text(
        "[model_providers.fake]\nstream_idle_timeout_ms = 9000\n"
    )
    env = {"CODEX_HOME": str(tmp_path)}
    for argv in (["-p", "fast", "exec", "x"], ["exec", "--profile=fast", "x"]):
        launch = codex.plan(env, argv)
        assert launch.routes["fake"] == "http://127.0.0.1:9"  # the base keeps its url
        assert launch.clients["codex"]["client_idle_timeout_s"] == 9.0
        assert launch.user_args is None  # nothing of the user's is replaced
    # -c wins over the profile
    launch = codex.plan(
        env, ["-p", "fast", "-c", "model_providers.fake.stream_idle_timeout_ms=4000"]
    )
    assert launch.clients["codex"]["client_idle_timeout_s"] == 4.0
    # a profile that is not there, or not a plain name, is said, not fatal
    assert any("no " in n for n in codex.plan(env, ["-p", "gone"]).notes)
    assert any("not a plain name" in n for n in codex.plan(env, ["-p", "../x"]).notes)


def test_ignore_user_config_leaves_config_toml_out(tmp_path: Path) -> None:
    (tmp_path / "config.toml").write_text(BASE)
    launch = codex.plan({"CODEX_HOME": str(tmp_path)}, ["--ignore-user-config", "exec", "x"])
    assert "fake" not in launch.routes and "openai" in launch.routes


def test_values_are_toml_or_else_strings_and_dashdash_ends_the_flags() -> None:
    cli = codex.command_line(["-c", "a.b=[1, 2]", "-c", "c=not toml", "--", "-c", "d=1"])
    assert cli.overrides == [("a.b", [1, 2]), ("c", "not toml")]
    assert codex.command_line(["-c", "novalue", "-c"]).overrides == []
