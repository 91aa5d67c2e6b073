"""Human-readable tables for ``elastictrain status``."""

from __future__ import annotations

import time
from datetime import datetime
from typing import Any

from elastictrain.launch.run_state import RunStatus

__all__ = ["newest_checkpoint", "run_table", "runs_table"]


def newest_checkpoint(directory: str, *, checksums: bool = False) -> dict[str, Any] | None:
    """Step, time, world size and path of the newest checkpoint in ``directory`` (a directory, or
    ``s3://bucket/prefix``) that verifies.

    A status call runs while the trainer writes and retires checkpoints: by default it
    checks each candidate's manifest and file sizes (a few ``stat`` calls, whatever
    the checkpoint's size), and a checkpoint retired while it is read is not corrupt
    (the directory is listed again).

    Args:
        checksums: Also read every file of the candidate to check its sha256.

    Raises:
        CheckpointError: The directory cannot be read, or no checkpoint in it verifies.
    """
    from elastictrain.checkpoint import find_checkpoint, step_dir
    from elastictrain.checkpoint.storage import storage_for
    from elastictrain.errors import CheckpointError, ConfigError

    try:
        storage, prefix = storage_for(directory)  # s3://bucket/prefix, or a directory
    except (ValueError, ImportError) as exc:
        raise ConfigError(f"--checkpoint-dir {directory!r}: {exc}") from exc
    try:
        found = find_checkpoint(storage, prefix, None, checksums=checksums)
    except OSError as exc:  # an object store's bucket or credentials (a directory's are CheckpointErrors)
        raise CheckpointError(f"cannot read checkpoints in {storage.location(prefix)}: {exc}") from exc
    if found is None:
        return None
    step, manifest = found
    return {"step": step, "time": manifest["time"], "world_size": manifest["world_size"],
            "path": storage.location(f"{prefix}/{step_dir(step)}" if prefix else step_dir(step)),
            "checksums_verified": checksums}


def _age(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds:.1f}s ago"


_ENDED = ("succeeded", "failed")
"""States a node agent publishes as it exits (it then gives its lease back)."""


def _name(record: dict[str, Any]) -> str:
    """The node's name (``node2``), as its own lines say it; a record of an older version has none:
    its host."""
    return str(record.get("name") or record.get("host", "?"))


def _lease(participant: dict[str, Any], record: dict[str, Any]) -> str:
    if not participant["alive"]:
        return "released" if record.get("state") in _ENDED else "expired"
    ttl = participant.get("lease_ttl_s")
    return f"{ttl}s left" if ttl is not None else "held"


def _state(record: dict[str, Any], alive: bool) -> str:
    """A node's published state, unless its lease says it is gone without having said so."""
    state = str(record.get("state", "?"))
    if alive or state in _ENDED:
        return state
    return "lost" if "updated_at" not in record else f"lost (last said {state} {_age(_since(record))})"


def _since(record: dict[str, Any]) -> float:
    return time.time() - float(record.get("updated_at", time.time()))


def _clock(ts: float) -> str:
    return datetime.fromtimestamp(ts).strftime("%Y-%m-%d %H:%M:%S")


def run_table(status: RunStatus, checkpoint: dict[str, Any] | None, checkpoint_dir: str | None = None) -> str:
    if not status.exists:
        return f"run {status.run_id!r}: no keys on this etcd (never started, or expired)"
    meta = status.meta
    state = "closed" if status.closed else ("training" if status.live else (
        "gathering nodes" if not status.complete else "re-forming (members lost)"))
    world = sum(p["nproc"] for p in status.participants if p["alive"])
    records = {str(n["node_id"]): n for n in status.nodes}
    spares = sum(1 for n in status.waiting if records.get(n, {}).get("state") == "spare")
    lines = [
        f"run {status.run_id!r}: {state}, round {status.round if status.round is not None else '-'}, "
        f"{len(status.participants)} node(s) (min {meta.get('min_nodes', '?')}, max {meta.get('max_nodes', '?')}), "
        f"world size {world or '-'}, waiting to join: {len(status.waiting)}"
        + (f" ({spares} hot spare(s))" if spares else ""),
    ]
    rows = [("RANK", "NODE", "HOST", "ADDRESS", "PID", "LEASE", "STATE", "RESTARTS")]
    for p in status.participants:
        record = records.get(p["node_id"], {})
        rows.append((str(p["rank"]), _name(record), str(record.get("host", "?")), str(p["addr"] or "?"),
                     str(p["pid"] or "?"), _lease(p, record), _state(record, p["alive"]),
                     str(record.get("restarts", "?"))))
    participant_ids = {p["node_id"] for p in status.participants}
    for node_id, record in records.items():
        if node_id not in participant_ids:
            waiting = node_id in status.waiting
            rows.append(("-", _name(record), str(record.get("host", "?")), str(record.get("addr", "?")),
                         str(record.get("pid", "?")), "held" if waiting else "-",
                         ("spare" if record.get("state") == "spare" else "waiting") if waiting else (
                             _state(record, False) if not record.get("alive", True)
                             else f"{record.get('state', '?')}, updated {_age(_since(record))}"),
                         str(record.get("restarts", "?"))))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines += ["  " + "  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows]
    restarts = sum(int(r.get("restarts", 0) or 0) for r in records.values())
    lines.append(f"restarts so far (all nodes): {restarts}")
    if checkpoint is not None:
        lines.append(f"newest checkpoint: step {checkpoint['step']} at {_clock(checkpoint['time'])} "
                     f"(world size {checkpoint['world_size']}) {checkpoint['path']}")
    elif checkpoint_dir is not None:
        lines.append(f"newest checkpoint: none in {checkpoint_dir}")
    lines += [f"unreadable: {problem}" for problem in status.problems]
    return "\n".join(lines)


def runs_table(runs: list[RunStatus]) -> str:
    if not runs:
        return "no runs on this etcd"
    rows = [("RUN ID", "STATE", "ROUND", "NODES")]
    for run in runs:
        state = "closed" if run.closed else ("training" if run.live else ("gathering" if run.exists else "-"))
        if run.problems:
            state += f" ({len(run.problems)} unreadable key(s))"
        rows.append((run.run_id, state, str(run.round if run.round is not None else "-"), str(len(run.participants))))
    widths = [max(len(row[i]) for row in rows) for i in range(4)]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in rows)
