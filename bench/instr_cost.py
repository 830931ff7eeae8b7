"""Instructions per turn and per frame, counted by callgrind: the relay against the bare floor.

A benchmark, not a test.  CPU time on this shared VM moves by 10-30 % between two
processes of the same code; instruction counts do not: valgrind's callgrind counts
every instruction the process executes (all threads: the journal writer included),
whatever else the machine is doing, so two runs of the same code agree to a few
parts in a thousand, and a change of 1 % shows.  Instructions are not time (a
cache miss costs more than an add), but for the same interpreter and libraries they
track it closely, and a ratio against the bare pass-through measured the same way
is free of the machine's noise.

    python bench/instr_cost.py [--quick] [--turns 300] [--concurrency 1] [--deltas 6]
                               [--non-streamed] [--frames 200] [--config-extra TOML]
                               [--also NAME=SRC_TREE ...]

Processes are those of ``bench/http_bench.py`` (its mock and load generator, on the
harness core, at full speed), and each system under test under
``valgrind --tool=callgrind`` (about 50x slower), pinned to the other core:
the bare aiohttp pass-through, ``unbroken serve`` with default settings (the
journal on), and any ``--also`` tree.  Per system: a warm-up batch, then the
counters are zeroed (``callgrind_control -z``), a batch of ``--turns`` turns runs,
and the counters are dumped (``callgrind_control -d``); instructions / turns.

* **per turn**: short streamed chat turns (``--deltas`` text deltas, no delay).
* **per frame** (``--frames N``, 0 to skip): turns of N deltas with 20 ms between
  frames, so that each frame travels alone (the relay under valgrind is slow; with
  less room they would arrive coalesced); (instructions of such a turn - those of
  a short turn) / (N - ``--deltas``): what one more frame costs.  Also shown: a long
  turn's instructions / its frames, per-turn work included (as ``http_bench``'s CPU
  per chunk).

Needs Linux, valgrind and callgrind_control.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import http_bench as hb
import turn_cost as tc

FRAME_DELAY_MS = 20
_TOTAL = re.compile(rb"^(?:summary|totals): (\d+)", re.M)


class Counted:
    """A system under test running under callgrind, its counters read by dumping them."""

    def __init__(self, proc: hb.Proc, out: Path) -> None:
        self.proc, self.out = proc, out

    def _control(self, flag: str) -> None:
        subprocess.run(
            ["callgrind_control", flag, str(self.proc.pid)],
            check=True,
            capture_output=True,
            timeout=120,
        )

    def zero(self) -> None:
        self._control("--instr=on")
        self._control("-z")

    def dump(self) -> int:
        """Instructions since the last zero or dump."""
        before = set(self.out.parent.glob(self.out.name + "*"))
        self._control("-d")
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            for path in set(self.out.parent.glob(self.out.name + "*")) - before:
                m = _TOTAL.search(path.read_bytes())
                if m:
                    path.unlink()
                    return int(m.group(1))
            time.sleep(0.05)
        raise RuntimeError(f"{self.proc.name}: no callgrind dump appeared")


def _valgrind(out: Path) -> list[str]:
    # Not instrumented while it starts (imports run several times faster): `Counted.zero`
    # switches instrumentation on before the warm-up.
    return ["valgrind", "--tool=callgrind", "--instr-atstart=no", f"--callgrind-out-file={out}"]


def _start(fleet: hb.Fleet, mock_url: str, name: str, src: Path | None, extra: str) -> Counted:
    out = fleet.workdir / f"callgrind.{name}"
    env = {"PYTHONHASHSEED": "0"}
    if src is None:
        argv = [
            *_valgrind(out),
            hb.PY,
            str(hb.ROOT / "bench" / "bare_proxy.py"),
            "--upstream",
            mock_url,
            "--port",
            "0",
        ]
        proc = fleet.start(
            name,
            argv,
            cpu=fleet.sut_cpu,
            ready=r"listening on (http://\S+)",
            env=env,
            ready_timeout_s=hb.LAUNCHED_READY_S,
        )
        return Counted(proc, out)
    path = os.pathsep.join(filter(None, (str(src / "src"), os.environ.get("PYTHONPATH"))))
    proc = hb.start_unbroken(
        fleet,
        mock_url,
        name,
        extra_config=extra,
        env={**env, "PYTHONPATH": path},
        launcher=_valgrind(out),
    )
    return Counted(proc, out)


def _per_turn(gen: hb.Proc, sut: Counted, spec: dict[str, Any], n: int, c: int) -> float:
    url = f"{sut.proc.url}/mock/{hb.PROTOCOLS['chat']['path']}"
    sut.zero()
    r = gen.call({"op": "batch", "url": url, "n": n, "concurrency": c, **spec}, timeout=1800)
    used = sut.dump()
    if r["errors"] or not r["ok"]:
        raise RuntimeError(f"{sut.proc.name}: {r['errors']} errors, last {r['last_error']}")
    ok: int = r["ok"]
    return used / ok


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--turns", type=int, default=300)
    parser.add_argument("--warmup", type=int, default=100)
    parser.add_argument("--concurrency", type=int, default=1)
    parser.add_argument("--deltas", type=int, default=6, help="text deltas per short turn")
    parser.add_argument("--non-streamed", action="store_true", help="stream=false turns")
    parser.add_argument(
        "--frames",
        type=int,
        default=200,
        help="deltas per long turn for the per-frame count (0: skip)",
    )
    parser.add_argument("--long-turns", type=int, default=10)
    parser.add_argument(
        "--config-extra",
        default="",
        help="TOML appended to unbroken's config (and the --also trees')",
    )
    parser.add_argument(
        "--also",
        action="append",
        default=[],
        metavar="NAME=SRC",
        help="also count unbroken from another source tree, as NAME",
    )
    parser.add_argument(
        "--quick", action="store_true", help="tiny counts (a smoke test: the numbers mean little)"
    )
    args = parser.parse_args()
    if args.quick:
        args.turns, args.warmup, args.frames, args.long_turns = 20, 10, 12, 2
    if not sys.platform.startswith("linux"):
        print("instr_cost: needs Linux", file=sys.stderr)
        return 2
    missing = [t for t in ("valgrind", "callgrind_control") if shutil.which(t) is None]
    if missing:
        print(
            f"instr_cost: needs {' and '.join(missing)} (Debian: apt install valgrind)",
            file=sys.stderr,
        )
        return 2
    pinning = (
        "taskset" if shutil.which("taskset") and len(os.sched_getaffinity(0)) >= 2 else ("none")
    )
    if pinning != "none":
        with contextlib.suppress(OSError):
            os.sched_setaffinity(0, {hb.HARNESS_CPU})
    also = dict(tc._named_tree(v) for v in args.also)
    spec = tc.request_spec(argparse.Namespace(deltas=args.deltas, non_streamed=args.non_streamed))
    workdir = Path(tempfile.mkdtemp(prefix="unbroken-instr-"))
    fleet = hb.Fleet(workdir, pinning)
    trees: dict[str, Path | None] = {"bare": None, "unbroken": hb.ROOT, **also}
    turn: dict[str, float] = {}
    frame: dict[str, tuple[float, float]] = {}
    try:
        me = str(Path(hb.__file__).resolve())
        mock = fleet.start(
            "mock", [hb.PY, me, "--mock"], cpu=fleet.harness_cpu, ready=r"listening on (http://\S+)"
        )
        gen = fleet.start(
            "loadgen", [hb.PY, me, "--loadgen"], cpu=fleet.harness_cpu, ready=None, pipe_stdio=True
        )
        long_spec = hb.mock_spec("chat", {"deltas": args.frames, "chunk_delay_ms": FRAME_DELAY_MS})
        for name, src in trees.items():
            sut = _start(fleet, mock.url, name, src, "" if src is None else args.config_extra)
            _per_turn(gen, sut, spec, args.warmup, args.concurrency)
            turn[name] = _per_turn(gen, sut, spec, args.turns, args.concurrency)
            hb.log(f"{name}: {turn[name] / 1e3:,.1f} k instructions per turn")
            if args.frames > args.deltas and not args.non_streamed:
                short = _per_turn(
                    gen,
                    sut,
                    hb.mock_spec("chat", {"deltas": args.deltas, "chunk_delay_ms": FRAME_DELAY_MS}),
                    args.long_turns,
                    1,
                )
                long = _per_turn(gen, sut, long_spec, args.long_turns, 1)
                frames = args.frames + 3  # role chunk, finish chunk, [DONE]
                frame[name] = ((long - short) / (args.frames - args.deltas), long / frames)
                hb.log(f"{name}: {frame[name][0] / 1e3:,.1f} k instructions per extra frame")
            fleet.stop(sut.proc)
    finally:
        fleet.stop_all()
        shutil.rmtree(workdir, ignore_errors=True)
    kind = "non-streamed" if args.non_streamed else f"streamed ({args.deltas} deltas)"
    print(
        f"\ninstructions (callgrind), {kind} turns, c={args.concurrency}, {args.turns} turns"
        f" after {args.warmup} warm-up:"
    )
    print(
        f"  {'system':12s} {'k instr/turn':>13s} {'vs bare':>8s}"
        + (
            f" {'k instr/frame':>14s} {'vs bare':>8s} {'incl. turn':>11s} {'vs bare':>8s}"
            if frame
            else ""
        )
    )
    for name in trees:
        line = f"  {name:12s} {turn[name] / 1e3:13,.1f} {turn[name] / turn['bare']:7.3f}x"
        if frame:
            f, b = frame[name], frame["bare"]
            line += (
                f" {f[0] / 1e3:14,.2f} {f[0] / b[0]:7.3f}x {f[1] / 1e3:11,.2f} {f[1] / b[1]:7.3f}x"
            )
        print(line)
    if frame:
        print(
            f"  (per frame: {args.long_turns} turns of {args.frames} deltas, "
            f"{FRAME_DELAY_MS} ms apart, minus as many of {args.deltas}; incl. turn: a long "
            "turn's instructions / its frames)"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
