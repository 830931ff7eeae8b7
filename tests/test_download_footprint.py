"""tools/download_footprint.py, which gives the README's download figures: it reads npm's
cache index and the test cache the way npm and tests/e2e/clis.py lay them out."""

from __future__ import annotations

import importlib.util
import json
import os
import sys
from pathlib import Path
from types import ModuleType

import pytest

from docsamples import ROOT


def _tool() -> ModuleType:
    spec = importlib.util.spec_from_file_location(
        "download_footprint", ROOT / "tools" / "download_footprint.py"
    )
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def _index(cache: Path, entries: dict[str, int]) -> None:
    """npm's cache index: one bucket file per key, lines of ``<hash>\\t<json>``."""
    for i, (url, size) in enumerate(entries.items()):
        bucket = cache / "_cacache" / "index-v5" / f"{i:02x}" / "ab" / "bucket"
        bucket.parent.mkdir(parents=True)
        entry = {"key": f"make-fetch-happen:request-cache:{url}", "size": size, "time": 1}
        bucket.write_text(f"\nhash\t{json.dumps(entry)}\nnot json\n")


def _package(home: Path, where: str, name: str, version: str, payload: int = 0) -> Path:
    folder = home / where / name
    folder.mkdir(parents=True)
    (folder / "package.json").write_text(json.dumps({"name": name, "version": version}))
    if payload:
        (folder / "blob").write_bytes(b"x" * payload)
    return folder


def test_downloads_are_the_tarballs_of_installed_packages_each_counted_once(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    tool = _tool()
    registry = "https://registry.npmjs.org"
    npm = tmp_path / "npm-cache"
    _index(
        npm,
        {
            f"{registry}/@openai/codex/-/codex-0.169.0.tgz": 1_000,
            f"{registry}/@openai/codex/-/codex-0.169.0-linux-x64.tgz": 167_000_000,
            f"{registry}/@openai/codex/-/codex-0.169.01.tgz": 5,  # another version
            f"{registry}/shared/-/shared-1.0.0.tgz": 2_000_000,
            f"{registry}/opencode-ai/-/opencode-ai-1.18.33.tgz": 3_000,
            f"{registry}/unrelated/-/unrelated-9.9.9.tgz": 7_000_000,
        },
    )
    cache = tmp_path / "tests-cache"
    monkeypatch.setenv("UNBROKEN_TEST_CACHE", str(cache))
    codex = cache / "npm" / "@openai+codex@0.169.0"
    _package(codex, "node_modules", "@openai/codex", "0.169.0")
    _package(codex, "node_modules/@openai/codex/node_modules", "@openai/codex", "0.169.0-linux-x64")
    _package(codex, "node_modules", "shared", "1.0.0")
    _package(codex, "node_modules/shared/node_modules", "bundled", "2.0.0")  # came inside shared
    opencode = cache / "npm" / "opencode-ai@1.18.33"
    _package(opencode, "node_modules", "opencode-ai", "1.18.33", payload=64_000)
    blob = _package(opencode, "node_modules", "shared", "1.0.0") / "blob"
    os.link(opencode / "node_modules" / "opencode-ai" / "blob", blob)  # a hard link counts once

    assert tool.main(["--npm-cache", str(npm)]) == 1  # claude and gemini are not there
    out = capsys.readouterr().out
    lines = {line.split()[0]: line for line in out.splitlines() if line.startswith("  ")}
    # opencode comes first (PINNED's order) and gets the shared 2 MB; codex does not again
    assert "downloaded     2.0 MB" in lines["opencode-ai@1.18.33"]
    assert "downloaded   167.0 MB" in lines["@openai/codex@0.169.0"]
    assert "downloaded   169.0 MB" in lines["all"]
    assert tool.disk_bytes(opencode) < 2 * 64_000 + 64 * 4096
    assert "not in the test cache" in out and "@google/gemini-cli@0.61.0" in out
