"""constraints.txt pins the test environment (the README's test command uses it), and
tools/newest_deps.py, which moves those pins on, reads and compares them right."""

from __future__ import annotations

import importlib.util
import re
import sys
import tomllib
from types import ModuleType

from packaging.requirements import Requirement

from docsamples import ROOT


def _tool() -> ModuleType:
    spec = importlib.util.spec_from_file_location("newest_deps", ROOT / "tools" / "newest_deps.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def _requirements() -> list[Requirement]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    reqs = [*project["dependencies"], *project["optional-dependencies"]["test"]]
    return [Requirement(r) for r in reqs]


def test_every_dependency_of_the_test_environment_is_pinned_within_its_range() -> None:
    pins = _tool().read_pins((ROOT / "constraints.txt").read_text())
    for req in _requirements():
        if req.marker is not None and not req.marker.evaluate():
            continue
        name = re.sub(r"[-_.]+", "-", req.name).lower()
        assert name in pins, f"constraints.txt does not pin {req.name}"
        assert req.specifier.contains(pins[name], prereleases=True), (
            f"constraints.txt pins {name}=={pins[name]}, outside pyproject's {req}"
        )


def test_pins_are_read_by_canonical_name_and_moves_are_listed() -> None:
    tool = _tool()
    old = tool.read_pins("# a comment\nTyping_Extensions==4.1\nredis==8.0 ; python_version>'3'\n")
    assert old == {"typing-extensions": "4.1", "redis": "8.0"}
    new = tool.read_pins("-e git+x#egg=unbroken\ntyping-extensions==4.1\nredis==8.2\nruff==1\n")
    assert tool.moved(old, new) == ["~ redis 8.0 -> 8.2", "+ ruff==1"]
    assert tool.moved(new, old) == ["~ redis 8.2 -> 8.0", "- ruff==1"]
    assert tool.moved(old, old) == []


def test_a_rewrite_keeps_the_comment_header() -> None:
    tool = _tool()
    text = (ROOT / "constraints.txt").read_text()
    kept = tool.header(text)
    assert kept.startswith("# The test environment, pinned")
    assert "==" not in kept
    assert text.startswith(kept)
