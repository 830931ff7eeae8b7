"""``unbroken opencode setup | undo``: the relay made permanent in OpenCode's config.

``setup`` points every provider OpenCode uses (`unbroken.opencode.discovery`) at a
running ``unbroken serve``: it patches ``opencode.json`` (keeping comments) and
keeps a backup; ``undo`` puts the original bytes back (or removes the file, and
the directories, that setup created).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import sys
import urllib.request
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

from unbroken.config import ConfigError, Route, load_config
from unbroken.opencode import jsonc
from unbroken.opencode.discovery import (
    Provider,
    config_dir,
    discover,
    is_unbroken,
    load_merged,
    route_for,
    route_name,
)

__all__ = ["SetupResult", "UndoResult", "register", "setup", "target_file", "undo"]

SCHEMA_URL: Final = "https://opencode.ai/config.json"
BACKUP_SUFFIX: Final = ".unbroken-backup"
CREATED_SUFFIX: Final = ".unbroken-created"

# -- unbroken opencode setup | undo ----------------------------------------------------------


def target_file(scope: str, project: Path, env: Mapping[str, str]) -> Path:
    """The file ``setup`` patches: an existing config of that scope, else ``opencode.json``."""
    names: tuple[str, ...]
    if scope == "global":
        d = config_dir(env)
        names = ("opencode.jsonc", "opencode.json", "config.json")
    else:
        d = project
        names = ("opencode.jsonc", "opencode.json")
    for name in names:
        if (d / name).is_file():
            return d / name
    return d / "opencode.json"


@dataclass
class SetupResult:
    path: Path
    changed: bool
    routed: dict[str, str]  # provider id -> new baseURL
    already: list[str]
    missing: list[Provider]  # in use, but no route on the relay


def setup(
    scope: str,
    *,
    relay_url: str,
    routes: Mapping[str, Route],
    project: Path,
    env: Mapping[str, str],
    probe: Callable[[str], bool] = lambda url: False,
) -> SetupResult:
    """Point every provider in use at ``relay_url``; keep a backup of the file first."""
    relay_url = relay_url.rstrip("/")
    path = target_file(scope, project, env)
    # The global file applies to every project: only providers visible everywhere.
    merged, _ = load_merged(project if scope == "project" else None, env)
    providers = discover(merged, env, probe=probe)
    original = path.read_bytes() if path.exists() else None
    text = original.decode("utf-8") if original is not None else ""
    routed: dict[str, str] = {}
    already: list[str] = []
    missing: list[Provider] = []
    for p in providers:
        current = _current_base(merged, p.id)
        if current and current.rstrip("/").startswith(relay_url + "/"):
            already.append(p.id)
            continue
        if p.url is None:
            missing.append(p)
            continue
        match = route_for(p.url, routes)
        if match is None:
            missing.append(dataclasses.replace(p, problem="no route on the relay reaches it"))
            continue
        name, suffix = match
        new = f"{relay_url}/{name}{suffix}"
        routed[p.id] = new
        if not text.strip():
            text = json.dumps({"$schema": SCHEMA_URL}, indent=2) + "\n"
        text = jsonc.set_path(text, ["provider", p.id, "options", "baseURL"], new)
    if original is None:
        changed = bool(routed)
    else:
        changed = text.encode("utf-8") != original
    if changed:
        new_dirs = [d for d in (path.parent, *path.parent.parents) if not d.exists()]
        path.parent.mkdir(parents=True, exist_ok=True)
        backup = path.with_name(path.name + BACKUP_SUFFIX)
        created = path.with_name(path.name + CREATED_SUFFIX)
        if not backup.exists() and not created.exists():
            if original is None:
                # The directories setup created, innermost first: undo removes them
                # again when they are empty.
                marker = {"created_dirs": [str(d) for d in new_dirs]}
                created.write_text(json.dumps(marker) + "\n", encoding="utf-8")
            else:
                backup.write_bytes(original)
        tmp = path.with_name(path.name + ".unbroken-tmp")
        tmp.write_bytes(text.encode("utf-8"))
        os.replace(tmp, path)
    return SetupResult(path, changed, routed, already, missing)


def _current_base(config: Mapping[str, Any], pid: str) -> str | None:
    section = config.get("provider")
    entry = section.get(pid) if isinstance(section, Mapping) else None
    options = entry.get("options") if isinstance(entry, Mapping) else None
    url = options.get("baseURL") if isinstance(options, Mapping) else None
    return url if isinstance(url, str) else None


@dataclass(frozen=True)
class UndoResult:
    """What `undo` did: ``action`` is ``restored``, ``removed`` or ``nothing``."""

    path: Path
    action: str
    removed_dirs: tuple[Path, ...] = ()

    def lines(self) -> list[str]:
        """What to tell the user, one line per thing done."""
        if self.action == "restored":
            return [
                f"restored {self.path} from {self.path.name}{BACKUP_SUFFIX}, the copy setup kept"
            ]
        if self.action == "removed":
            out = [f"removed {self.path}, which setup had created"]
            out += [
                f"removed the directory {d}, which setup had created and which is empty again"
                for d in self.removed_dirs
            ]
            return out
        return [
            f"{self.path}: nothing to undo (no {self.path.name}{BACKUP_SUFFIX} or "
            f"{self.path.name}{CREATED_SUFFIX} next to it)"
        ]


def undo(scope: str, *, project: Path, env: Mapping[str, str]) -> UndoResult:
    """Put back what ``setup`` changed: the original bytes of the file from its backup,
    or, when setup created the file, no file (and no directory setup created for it,
    once that is empty again)."""
    path = target_file(scope, project, env)
    backup = path.with_name(path.name + BACKUP_SUFFIX)
    created = path.with_name(path.name + CREATED_SUFFIX)
    if backup.exists():
        os.replace(backup, path)
        return UndoResult(path, "restored")
    if not created.exists():
        return UndoResult(path, "nothing")
    made = [d for d in _created_dirs(created) if d in path.parents]  # nothing else, ever
    with contextlib.suppress(FileNotFoundError):
        path.unlink()
    created.unlink()
    removed: list[Path] = []
    for d in made:  # innermost first
        try:
            d.rmdir()
        except OSError:  # not empty (or gone): leave it, and everything above it
            break
        removed.append(d)
    return UndoResult(path, "removed", tuple(removed))


def _created_dirs(marker: Path) -> list[Path]:
    """The directories setup recorded as created (an empty marker, from an older
    version, records none)."""
    try:
        data = json.loads(marker.read_text(encoding="utf-8") or "{}")
    except (OSError, ValueError):
        return []
    dirs = data.get("created_dirs") if isinstance(data, dict) else None
    if not isinstance(dirs, list):
        return []
    return [Path(d) for d in dirs if isinstance(d, str)]


def _relay_routes(url: str) -> list[str] | None:
    try:
        with urllib.request.urlopen(f"{url.rstrip('/')}/healthz", timeout=1.0) as r:
            data = json.loads(r.read(1 << 20))
    except (OSError, ValueError):
        return None
    routes = data.get("routes") if isinstance(data, dict) else None
    return [str(r) for r in routes] if isinstance(routes, list) else None


def _setup_cmd(args: argparse.Namespace) -> int:
    try:
        config = load_config(args.config)
    except ConfigError as exc:
        print(f"unbroken: invalid config: {exc}", file=sys.stderr)
        return 2
    host = f"[{config.host}]" if ":" in config.host else config.host
    relay_url = (args.relay or f"http://{host}:{config.port}").rstrip("/")
    if args.relay is not None:
        from unbroken.config_values import validate_http_url

        try:
            relay_url = validate_http_url("--relay", args.relay)
        except ConfigError as exc:
            print(f"unbroken opencode setup: {exc}", file=sys.stderr)
            return 2
    scope = "project" if args.project else "global"
    env = dict(os.environ)
    project = Path(env.get("PWD") or Path.cwd())
    if not project.is_dir() or project.resolve() != Path.cwd().resolve():
        project = Path.cwd()
    result = setup(
        scope,
        relay_url=relay_url,
        routes=config.routes,
        project=project,
        env=env,
        probe=is_unbroken,
    )
    for pid, url in result.routed.items():
        print(f"{pid}: baseURL -> {url}")
    for pid in result.already:
        print(f"{pid}: already routed through {relay_url}")
    for p in result.missing:
        print(f"{p.id}: left alone ({p.problem})")
        if p.url is not None:
            print(
                f"  to relay it, add to your unbroken config:\n"
                f"  [routes.{route_name(p.id, set())}]\n"
                f'  upstreams = [{{ url = "{p.url}" }}]'
            )
    if result.changed:
        print(
            f"patched {result.path} (backup kept; `unbroken opencode undo"
            f"{' --project' if args.project else ''}` restores it)"
        )
    else:
        print(f"{result.path}: nothing to change")
    live = _relay_routes(relay_url)
    if live is None:
        print(f"note: no unbroken relay answers at {relay_url}; start it with `unbroken serve`")
    else:
        needed = {u.removeprefix(relay_url + "/").split("/", 1)[0] for u in result.routed.values()}
        absent = sorted(needed - set(live))
        if absent:
            print(
                f"warning: the running relay has no route {', '.join(absent)}; "
                "restart `unbroken serve` with the same config"
            )
    return 0


def _undo_cmd(args: argparse.Namespace) -> int:
    scope = "project" if args.project else "global"
    result = undo(scope, project=Path.cwd(), env=dict(os.environ))
    for line in result.lines():
        print(line)
    return 1 if result.action == "nothing" else 0


def register(sub: Any) -> None:
    p_oc = sub.add_parser(
        "opencode",
        help="install unbroken into OpenCode's config (setup, undo)",
        description="Make the relay permanent in OpenCode's config for a running "
        "`unbroken serve` (setup), or put the config back (undo).",
    )
    oc_sub = p_oc.add_subparsers(dest="opencode_command", metavar="{setup,undo}")

    def usage(args: argparse.Namespace) -> int:
        p_oc.print_help(sys.stderr)
        return 2

    p_oc.set_defaults(func=usage)
    for name, helptext in (
        ("setup", "point OpenCode's providers at a running `unbroken serve` (keeps a backup)"),
        ("undo", "restore opencode.json byte for byte from the backup"),
    ):
        p = oc_sub.add_parser(name, help=helptext, description=helptext)
        scope = p.add_mutually_exclusive_group()
        scope.add_argument(
            "--global",
            dest="global_",
            action="store_true",
            help="the global config, $XDG_CONFIG_HOME/opencode (the default)",
        )
        scope.add_argument(
            "--project", action="store_true", help="./opencode.json in the current directory"
        )
        if name == "setup":
            p.add_argument(
                "--config",
                metavar="FILE",
                help="the unbroken config `unbroken serve` runs with (default: "
                "$UNBROKEN_CONFIG, else the built-in routes)",
            )
            p.add_argument(
                "--relay",
                metavar="URL",
                help="the relay's URL (default: from the config, http://127.0.0.1:4780)",
            )
            p.set_defaults(func=_setup_cmd)
        else:
            p.set_defaults(func=_undo_cmd)
