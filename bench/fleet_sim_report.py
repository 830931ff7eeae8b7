"""The fleet simulator's report: the standard matrix of scenarios, its Markdown table,
and a plot of requests a second per scenario (`bench/fleet_sim.py`)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from fleet_sim import Result, Scenario
from fleet_sim_world import PROVIDERS

__all__ = ["matrix", "plot", "table"]

#: the 40-agent configurations: (label, relays, store)
SETUPS = (
    ("1 relay", 1, "none"),
    ("2 relays, shared store", 2, "redis"),
    ("2 relays, no store", 2, "none"),
)


def matrix(base: Scenario, *, big: bool = True, big_seconds: float = 60.0) -> list[Scenario]:
    """40 agents behind 5 requests/s x every provider x `SETUPS`; the outages on the
    textbook provider; then 10,000 agents over 50 relays (shared store, 1,000 requests/s)."""
    out: list[Scenario] = []
    for provider in PROVIDERS:
        for _, relays, store in SETUPS:
            out.append(
                replace(
                    base,
                    agents=40,
                    relays=relays,
                    store=store,
                    provider=provider,
                    outage="none",
                    limit_rps=5.0,
                )
            )
    for outage in ("outage", "brownout"):
        for _, relays, store in SETUPS[:2]:
            out.append(
                replace(
                    base,
                    agents=40,
                    relays=relays,
                    store=store,
                    provider="textbook",
                    outage=outage,
                    limit_rps=5.0,
                )
            )
    if big:
        for provider in ("textbook", "quantized", "bare"):
            out.append(
                replace(
                    base,
                    agents=10_000,
                    relays=50,
                    store="redis",
                    provider=provider,
                    outage="none",
                    limit_rps=1000.0,
                    seconds=big_seconds,
                )
            )
    return out


def table(results: list[Result]) -> str:
    """One Markdown table, a row per run."""
    if not results:
        return ""
    head = ["scenario", *results[0].row()]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in results:
        sc = r.scenario
        store = f", {sc.store}" if sc.relays > 1 else ""
        out = "" if sc.outage == "none" else f" + {sc.outage}"
        name = (
            f"{sc.provider}{out}: {sc.agents} agents, {sc.relays} relay(s){store}, "
            f"limit {sc.limit_rps:g}/s"
        )
        lines.append("| " + " | ".join([name, *r.row().values()]) + " |")
    return "\n".join(lines) + "\n"


def plot(results: list[Result], out: Path) -> list[Path]:
    """A PNG per run: requests sent, 429s and oks a second, the limit as a line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out.mkdir(parents=True, exist_ok=True)
    paths: list[Path] = []
    for i, r in enumerate(results):
        sc = r.scenario
        fig, ax = plt.subplots(figsize=(7, 3))
        xs = list(range(len(r.per_second)))
        ax.plot(xs, [p[0] for p in r.per_second], label="sent")
        ax.plot(xs, [p[1] for p in r.per_second], label="429")
        ax.plot(xs, [p[2] for p in r.per_second], label="ok")
        ax.axhline(sc.limit_rps, color="grey", linestyle="--", label="limit")
        if sc.outage != "none":
            ax.axvspan(
                sc.outage_start_s,
                sc.outage_start_s + sc.outage_s,
                alpha=0.15,
                color="red",
                label=sc.outage,
            )
        ax.set_xlabel("simulated s")
        ax.set_ylabel("requests/s")
        ax.set_yscale("symlog", linthresh=max(1.0, sc.limit_rps))
        ax.set_title(sc.label, fontsize=9)
        ax.legend(fontsize=7, loc="upper right")
        fig.tight_layout()
        path = (
            out / f"fleet-{i:02d}-{sc.provider}-{sc.agents}x{sc.relays}-{sc.store}-{sc.outage}.png"
        )
        fig.savefig(path, dpi=90)
        plt.close(fig)
        paths.append(path)
    return paths
