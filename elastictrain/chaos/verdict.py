"""The verdict on a finished chaos run: every invariant, from the job's evidence and what the harness saw.

:func:`judge` combines the evidence checks of :mod:`~elastictrain.chaos.invariants`
with the ones only the harness can make: how each node exited against what
was expected (min-nodes up, or not), whether a fault went unrecovered past its
bound, and whether a worker process outlived the run.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from elastictrain.chaos import invariants as inv
from elastictrain.chaos.cluster import Node
from elastictrain.chaos.config import ChaosConfig
from elastictrain.chaos.schedule import FaultRecord
from elastictrain.chaos.recorder import CHAOS_DIR_ENV, FINAL_PARAMETERS

__all__ = ["Verdict", "expected_outcome", "judge"]


@dataclass
class Verdict:
    """The invariants of a run, and what they were judged from."""

    results: dict[str, inv.InvariantResult]
    evidence: inv.Evidence
    final: inv.Checkpoint | None
    """The newest committed checkpoint, if any."""
    completed: bool
    """The job reported its normal end."""


def expected_outcome(nodes: Sequence[Node], *, min_nodes: int, join_timeout: float) -> bool | None:
    """Whether the job should finish: True if min-nodes stayed up (or came back within the join timeout),
    False if it fell below for good, None when a node came back about when the survivors would give up."""
    marks: list[tuple[float, int]] = []
    for node in nodes:
        marks.append((node.started, +1))
        if node.killed is not None:
            marks.append((node.killed, -1))
    first_exit = min((n.ended for n in nodes if n.killed is None and n.ended is not None), default=None)
    alive, below_since, outcome, reached_min = 0, None, True, False
    for t, delta in sorted(marks):
        if first_exit is not None and t >= first_exit:
            break
        alive += delta
        reached_min = reached_min or alive >= min_nodes
        if reached_min and alive < min_nodes and below_since is None:
            below_since = t
        elif alive >= min_nodes and below_since is not None:
            if t - below_since > join_timeout - 5:
                outcome = None  # the replacement arrived about when the survivors gave up
            below_since = None
    return False if below_since is not None else outcome


def _reason(node: Node) -> str:
    """The line in which a node that gave up says why (empty if it said nothing to the point)."""
    for line in reversed(node.tail(40).splitlines()):
        lowered = line.lower()
        if "timed out" in lowered or "min-nodes" in lowered or "waiting for" in lowered:
            return line.strip()[-300:]
    return ""


def _left_behind(node: Node) -> bool:
    """A node cut off by ``partition_node`` that came back after the job had ended: it is refused, rightly,
    and exits non-zero saying so."""
    return node.partitioned is not None and "the job it named has already ended" in node.tail(40)


def _exit_status(nodes: Sequence[Node], expected: bool | None, aborted: str | None) -> inv.InvariantResult:
    natural = [n for n in nodes if n.killed is None]
    codes = {n.name: n.exit_code for n in nodes}
    if aborted:
        return inv.InvariantResult("exit_status", False, f"run aborted: {aborted}; exit codes {codes}")
    if expected is None:
        return inv.InvariantResult("exit_status", None, "too close to call (a node returned about when the join "
                                   f"timeout ran out); exit codes {codes}")
    if expected:
        bad = [n for n in natural if n.exit_code != 0 and not _left_behind(n)]
        if bad:
            return inv.InvariantResult("exit_status", False, "; ".join(
                f"{n.name} exited {n.exit_code}: {n.tail(3)}" for n in bad))
        late = [n.name for n in natural if n.exit_code != 0]
        why_late = f" (but {', '.join(late)}: cut off until the job had ended, then refused by the closed run)"
        return inv.InvariantResult("exit_status", True, "min-nodes stayed up and every node the harness left "
                                   f"alone exited 0: {codes}" + (why_late if late else ""))
    reasons = {n.name: _reason(n) for n in natural}
    ok = all(n.exit_code not in (0, None) for n in natural) and all(reasons.values())
    return inv.InvariantResult("exit_status", ok, "below min-nodes for longer than the join timeout: survivors "
                               f"exited {codes}, saying: {reasons}")


def _ghosts(evidence: inv.Evidence, evidence_dir: Path) -> list[int]:
    """Worker processes of this run still alive (their parent-death signal gets a few seconds)."""
    marker = f"{CHAOS_DIR_ENV}={evidence_dir}".encode()
    pids = {w["pid"] for w in evidence.workers}
    deadline = time.time() + 10
    while True:
        ghosts = []
        for pid in pids:
            try:
                with open(f"/proc/{pid}/environ", "rb") as f:  # the pid may have been reused: check it is ours
                    if marker in f.read().split(b"\0"):
                        ghosts.append(pid)
            except OSError:
                continue
        if not ghosts or time.time() > deadline:
            return sorted(ghosts)
        time.sleep(0.5)


def _final_checkpoint(checkpoints: Mapping[int, inv.CheckpointDir]) -> tuple[inv.Checkpoint | None, str]:
    if not checkpoints:
        return None, "no committed checkpoint"
    step = max(checkpoints)
    try:
        return inv.read_checkpoint(checkpoints[step], step), ""
    except Exception as exc:  # noqa: BLE001 - reported as an invariant failure
        return None, f"cannot read the final checkpoint {checkpoints[step]}: {exc}"


def _final_parameters(final: inv.Checkpoint, reference: inv.Checkpoint, evidence_dir: Path,
                      config: ChaosConfig) -> inv.InvariantResult:
    """The final checkpoint's parameters against the reference's, and the job's own final full
    parameters (:data:`~elastictrain.chaos.recorder.FINAL_PARAMETERS`, if it wrote them) too."""
    result = inv.check_final_parameters(final, reference, atol=config.atol, rtol=config.rtol)
    path = evidence_dir / FINAL_PARAMETERS
    if result.ok is not True or not path.exists():
        return result
    try:
        weights = torch.load(path, weights_only=True, map_location="cpu")
    except Exception as exc:  # noqa: BLE001 - reported as an invariant failure
        return inv.InvariantResult(result.name, False, f"cannot read the job's {FINAL_PARAMETERS}: {exc}")
    live = inv.check_final_parameters(inv.Checkpoint(final.step, path, weights, None, None), reference,
                                      atol=config.atol, rtol=config.rtol)
    return inv.InvariantResult(result.name, live.ok, f"checkpoint: {result.detail}; the job's own final "
                               f"parameters ({FINAL_PARAMETERS}): {live.detail}")


def unnoticed_faults(config: ChaosConfig, faults: Sequence[FaultRecord]) -> list[FaultRecord]:
    """The faults the job recovered from only once they ended by themselves, where it should have
    noticed them first (see :meth:`ChaosConfig.noticed_within`): a hang waited out."""
    return [f for f in faults if (limit := config.noticed_within(f.kind)) is not None
            and (recovery := f.recovery_s) is not None and recovery >= limit]


def judge(config: ChaosConfig, *, run_dir: Path, evidence_dir: Path, nodes: Sequence[Node],
          faults: Sequence[FaultRecord], bounds: Mapping[str, float], aborted: str | None,
          reference_exit: int | None) -> Verdict:
    """Check every invariant of a finished run (see :mod:`~elastictrain.chaos.invariants`).

    Args:
        config: The run's configuration.
        run_dir: The run's directory.
        evidence_dir: Where the job's recorder wrote.
        nodes: Every node the harness started.
        faults: The faults, injected or not.
        bounds: The recovery bound used for each fault kind, seconds.
        aborted: Why the harness stopped the run early, if it did.
        reference_exit: Exit code of the reference run (None: there was none).
    """
    results: dict[str, inv.InvariantResult] = {}

    def add(result: inv.InvariantResult) -> None:
        results[result.name] = result

    evidence = inv.Evidence.load(evidence_dir)
    agent_events = inv.read_lines(run_dir / "events.jsonl")
    expected = expected_outcome(nodes, min_nodes=config.min_nodes, join_timeout=config.join_timeout.total_seconds())
    add(_exit_status(nodes, expected, aborted))

    root = evidence.checkpoint_root()
    checkpoints = inv.checkpoint_dirs(root) if root is not None else {}
    final, why_not = _final_checkpoint(checkpoints)
    ended = evidence.of("end")
    if final is None:
        add(inv.InvariantResult("committed_history", False, why_not))
        add(inv.InvariantResult("exactly_once", False, why_not))
    else:
        history = inv.committed_history(evidence, final)
        add(inv.check_committed_history(history, evidence))
        if ended and ended[-1]["step"] != final.step:
            add(inv.InvariantResult("committed_history", False, f"the job ended at step {ended[-1]['step']} "
                                    f"but the newest committed checkpoint is step {final.step}"))
        add(inv.check_exactly_once(history, evidence, final))

    if final is None:
        add(inv.InvariantResult("final_parameters", False, why_not))
    elif not ended:
        add(inv.InvariantResult("final_parameters", None, "the job did not complete"))
    elif reference_exit is None:
        add(inv.InvariantResult("final_parameters", None, "no reference run"))
    else:
        ref_root = inv.Evidence.load(run_dir / "reference" / "evidence").checkpoint_root()
        ref_checkpoints = inv.checkpoint_dirs(ref_root) if ref_root is not None else {}
        reference, why_not = _final_checkpoint(ref_checkpoints)
        if reference_exit != 0 or reference is None:
            add(inv.InvariantResult("final_parameters", False, f"the reference run failed (exit {reference_exit}"
                                    f"{'; ' + why_not if why_not else ''}); see reference/log.txt"))
        else:
            add(_final_parameters(final, reference, evidence_dir, config))

    add(inv.check_restores(evidence, checkpoints, agent_events))
    add(inv.check_checkpoints_intact(checkpoints))
    add(inv.check_world_sizes(evidence, agent_events, low=config.min_nodes * config.nproc_per_node,
                              high=config.max_nodes * config.nproc_per_node))
    add(inv.check_survivors_kept(evidence, faults, in_process=config.recovery == "in-process"))
    add(inv.check_spares_fill_in(evidence, faults))
    hung = [f for f in faults if f.hung]
    unnoticed = [] if aborted else unnoticed_faults(config, faults)
    if aborted:
        detail = aborted
    elif unnoticed:
        detail = "; ".join(f"fault {f.index} ({f.kind.value}): the job trained again only {f.recovery_s:.1f}s "
                           "after it, once the hung worker was continued: its agent did not notice the hang"
                           for f in unnoticed)
    elif bounds:
        detail = ("every fault was followed by training (or, below min-nodes, by the survivors' exit) within its "
                  "bound: " + ", ".join(f"{k} {v:g}s" for k, v in sorted(bounds.items())))
    else:
        detail = "no faults; the run ended by itself"
    add(inv.InvariantResult("no_hang", not aborted and not hung and not unnoticed, detail))
    ghosts = _ghosts(evidence, evidence_dir)
    for pid in ghosts:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    add(inv.InvariantResult("no_ghost_workers", not ghosts, f"workers alive after the run: {ghosts}" if ghosts else
                            f"none of {len({w['pid'] for w in evidence.workers})} worker processes outlived the run"))
    return Verdict(results, evidence, final, bool(ended))
