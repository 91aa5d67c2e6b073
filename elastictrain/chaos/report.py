"""The report of a chaos run: ``report.json`` and, when matplotlib is importable, ``report.png``.

The JSON holds the faults (kind, target, when, recovery time: injection to the
next step applied by a restarted group, or by the same group when the fault did
not restart it; steps redone), the totals, the node
exit codes and every invariant's result. The plot shows loss and world size
over time with a marker per fault.
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from elastictrain.chaos.config import ChaosConfig
from elastictrain.chaos.schedule import FaultRecord
from elastictrain.chaos.verdict import Verdict

__all__ = ["build_report", "recovery_summary", "write_plot", "write_report"]


def recovery_summary(faults: Sequence[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per fault kind: count, median/min/max recovery seconds, steps redone."""
    by_kind: dict[str, list[dict[str, Any]]] = {}
    for fault in faults:
        by_kind.setdefault(fault["kind"], []).append(fault)
    out = {}
    for kind, items in sorted(by_kind.items()):
        times = [f["recovery_s"] for f in items if f.get("recovery_s") is not None]
        out[kind] = {
            "count": len(items),
            "recovered": len(times),
            "recovery_s_median": round(statistics.median(times), 2) if times else None,
            "recovery_s_min": round(min(times), 2) if times else None,
            "recovery_s_max": round(max(times), 2) if times else None,
            "steps_redone": sum(f.get("steps_redone") or 0 for f in items),
        }
    return out


def write_report(path: Path, report: dict[str, Any]) -> None:
    path.write_text(json.dumps(report, indent=2, sort_keys=False, default=str) + "\n")


def write_plot(path: Path, *, start: float, steps: Sequence[dict[str, Any]], segments: Sequence[dict[str, Any]],
               faults: Sequence[dict[str, Any]], end: float) -> str | None:
    """Loss and world size over time with fault markers; returns why it was skipped, or None."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception as exc:  # noqa: BLE001 - the plot is optional
        return f"skipped: matplotlib not importable ({type(exc).__name__})"
    fig, (loss_ax, world_ax) = plt.subplots(2, 1, sharex=True, figsize=(10, 6), height_ratios=(3, 1))
    points = [(s["t"] - start, s["loss"]) for s in steps if s.get("loss") is not None]
    if points:
        loss_ax.plot(*zip(*points), ".", markersize=3, label="loss (applied steps)")
        loss_ax.set_yscale("log")
        loss_ax.legend(loc="upper right", fontsize=8)
    loss_ax.set_ylabel("loss")
    xs, ys = [], []
    for seg in sorted(segments, key=lambda s: s["t"]):
        xs.append(seg["t"] - start)
        ys.append(seg["world"])
    if xs:
        world_ax.step([*xs, end - start], [*ys, ys[-1]], where="post")
    world_ax.set_ylabel("world size")
    world_ax.set_xlabel("seconds since start")
    for fault in faults:
        if fault.get("injected_s") is None:
            continue
        for ax in (loss_ax, world_ax):
            ax.axvline(fault["injected_s"], color="red", alpha=0.4, linewidth=1)
        loss_ax.annotate(fault["kind"], (fault["injected_s"], 1.0), xycoords=("data", "axes fraction"),
                         rotation=90, fontsize=7, va="top", ha="right", color="red")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return None


def _steps_redone(fault: FaultRecord, steps: Sequence[dict[str, Any]], segments: Sequence[dict[str, Any]],
                  restored: Mapping[str, int]) -> int:
    """Applied steps the fault cost: the last step before the next group formed, minus the step it started from."""
    if fault.injected is None or fault.restarted is False:
        return 0
    new = next((s for s in segments if s["t"] > fault.injected), None)
    if new is None:
        return 0
    before = [s for s in steps if s["t"] < new["t"]]
    return max(0, (before[-1]["step"] if before else 0) - restored.get(new["seg"], 0))


def build_report(config: ChaosConfig, verdict: Verdict, *, run_id: str, run_dir: Path, script_args: Sequence[str],
                 faults: Sequence[FaultRecord], nodes: Mapping[str, int | None], killed: Sequence[str],
                 aborted: str | None, start: float, end: float) -> dict[str, Any]:
    """Write ``report.json`` (and ``report.png``) into ``run_dir`` and return the report."""
    evidence = verdict.evidence
    steps, segments = evidence.of("step"), evidence.of("segment")
    # Where each group started: the checkpoint it restored (restart) or the step it
    # re-formed at (in-process).
    restored = {e["seg"]: e["step"] for e in [*evidence.of("recovered"), *evidence.of("restored")]}
    items = []
    for fault in faults:
        item = fault.to_json(start)
        item["steps_redone"] = _steps_redone(fault, steps, segments, restored)
        items.append(item)
    plot_path = run_dir / "report.png"
    skipped = write_plot(plot_path, start=start, steps=steps, segments=segments, faults=items, end=end)
    committed = verdict.final.step if verdict.final is not None else 0
    report = {
        "run_id": run_id,
        "run_dir": str(run_dir),
        "script": config.script,
        "script_args": list(script_args),
        "seed": config.seed,
        "nodes": {"initial": config.nodes, "min": config.min_nodes, "max": config.max_nodes,
                  "nproc_per_node": config.nproc_per_node, "etcd_members": config.etcd_members},
        "timeouts_s": {"pg_timeout": config.pg_timeout.total_seconds(),
                       "join_timeout": config.join_timeout.total_seconds(),
                       "hang": config.hang_duration.total_seconds(),
                       "etcd_down": config.etcd_down.total_seconds(),
                       "rejoin_after": config.rejoin_after.total_seconds()},
        "duration_s": round(end - start, 2),
        "aborted": aborted,
        "completed": verdict.completed,
        "faults": items,
        "faults_injected": sum(1 for f in faults if f.injected is not None),
        "recovery_by_kind": recovery_summary([f for f in items if f["injected_s"] is not None]),
        "committed_steps": committed,
        "steps_applied": len(steps),
        "steps_redone": max(0, len(steps) - committed),
        "segments": len(segments),
        "final_world_size": segments[-1]["world"] if segments else None,
        "node_exit_codes": dict(nodes),
        "nodes_killed_by_faults": list(killed),
        "invariants": {name: r.to_json() for name, r in verdict.results.items()},
        "ok": all(r.ok is not False for r in verdict.results.values()),
        "plot": str(plot_path) if skipped is None else skipped,
    }
    write_report(run_dir / "report.json", report)
    return report
