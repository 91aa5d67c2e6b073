"""Issue 41's recovery targets, side by side: a sharded transformer LM losing a worker or a node.

A transformer LM (``_train_sharded.py``; ``--width 512 --layers 8``: ~310 MB of parameters and
AdamW state) trains on 2 local nodes of 2 workers (gloo, CPU) under each launcher in turn,
reaches ``--action-step``, then:

- ``fsdp_worker_kill``: fsdp over the 4 workers; SIGKILL the highest rank's worker. Recovered
  at the first step past the last step completed before the kill, at world size 4.
- ``hsdp_node_loss``: hsdp (each node a replica of 2 shards; ``--min-nodes 1``); SIGKILL node
  1 whole (agent, workers). Recovered at the first step past the last pre-kill step, at world
  size 2 (one replica).

``--kill-at F`` moves the kill F of a step later (a crash lands anywhere in a step; at once, the
default, is the worst instant for ``elastictrain_redundancy``: its copy of the step just done is
still in flight, so one step is redone). Each trial reports the time from the kill to that step
and the committed steps redone (step numbers some rank completed twice), with the milestones
of the recovery (failure noticed, rendezvous, workers started, imports, the loop ready, first
step): :func:`benchmarks.recovery.run_trial`, the issue-14 driver's trial, measures both.

Launchers (``--launchers``, interleaved trial by trial, the order rotating each repetition):

- ``elastictrain_inprocess``: ``elastictrain run --recovery in-process``, the job a
  ``Session(sharding=...)``: survivors keep their processes, where the session's sharding
  recovers in process. Until it does, the session refuses at start in one line and the
  combination is reported as ``unsupported`` (with that line), not timed: once the session
  accepts it, the same command measures it. An fsdp worker lost takes its shards with it: the
  survivors restore the newest checkpoint in place.
- ``elastictrain_redundancy``: the same, with ``Session(redundancy_every=1)`` (fsdp only): each
  rank keeps a copy of a buddy's shards in host memory, refreshed every step, and the survivors
  rebuild the lost worker's shards from memory (the newest step they hold whole: at most one step
  redone), no checkpoint read. Each trial says where the state came from (``state_from``, from
  rank 0's ``recovery`` event: ``peers`` is the live ranks' memory).
- ``elastictrain_restart``: ``elastictrain run --recovery restart``, the same Session job:
  every worker restarts and restores the newest sharded checkpoint (elastictrain's format,
  resharded to the new world).
- ``torchrun_dcp``: stock ``torchrun`` (c10d, tuned as ``recovery.py``'s ``torchrun_tuned``:
  ``--monitor-interval 0.05``, a 1 s last call) on the same model in a plain ``fully_shard``
  loop with ``torch.distributed.checkpoint`` (``FileSystemWriter``/``Reader``) at the same
  interval: every worker restarts and loads the newest committed DCP checkpoint.

Both checkpoint every ``--ckpt-every`` steps (default 5), synchronously for DCP and as the
Session's defaults for elastictrain. Part (c), the save stall of a warm sharded checkpoint
against ``torch.save`` of the same shards (and DCP's save and resharded load), is
``checkpoint_sharded.py``'s: run at the same model (``--ranks 4``, the same width and layers)
unless ``--no-checkpoint``, its JSON under ``checkpoint``.

    # issue 41's table (run it alone, ~1 h on 2 cores):
    python benchmarks/sharded_recovery.py --width 512 --layers 8 --reps 3 \\
        --launchers elastictrain_redundancy,elastictrain_inprocess,elastictrain_restart,torchrun_dcp \\
        --out benchmarks/results/sharded41.json
    # a smoke run (a tiny model):
    python benchmarks/sharded_recovery.py --width 32 --layers 1 --reps 1 --action-step 4 --ckpt-every 2

One JSON line on stdout (and ``--out``), the markdown table on stderr (and next to ``--out``).
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make ``benchmarks`` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks._common import BENCH_DIR, emit_with_table, machine, ratio
from benchmarks.recovery import (
    Scenario, TrialSetup, _aggregate, _cell, _elastictrain_has_join, private_etcd, run_trial,
)

SCRIPT = BENCH_DIR / "_train_sharded.py"
LAUNCHERS = ("elastictrain_redundancy", "elastictrain_inprocess", "elastictrain_restart", "torchrun_dcp")
REDUNDANCY = "elastictrain_redundancy"
"""In process with ``redundancy_every=1``: the fsdp state rebuilt from the buddies' copies in memory."""
SCENARIOS: dict[str, tuple[str, Scenario]] = {
    "fsdp_worker_kill": ("fsdp", Scenario("worker_crash", nodes=2, min_nodes=2, max_nodes=2, world_after=4,
                                          nproc_per_node=2)),
    "hsdp_node_loss": ("hsdp", Scenario("node_loss", nodes=2, min_nodes=1, max_nodes=2, world_after=2,
                                        nproc_per_node=2, past_last_step=True)),
}
TABLE_ROWS = {
    "fsdp_worker_kill": "fsdp, worker kill → first step past the last pre-kill step",
    "hsdp_node_loss": "hsdp, node loss (2 → 1 node) → first step past the last pre-kill step",
}
CHECKPOINT_ROWS = (
    ("warm async save stall vs `torch.save` of each rank's shards", "async_stall", "torch_save",
     "async_stall_over_torch_save"),
    ("warm overlapped save stall vs `torch.save` of each rank's shards", "overlap_stall", "torch_save",
     "overlap_stall_over_torch_save"),
    ("sync save (committed) vs DCP `FileSystemWriter`", "sync_save", "dcp_save", "sync_save_over_dcp_save"),
    ("resharded load at N-1 ranks vs DCP `FileSystemReader`", "restore", "dcp_load", "restore_over_dcp_load"),
)
"""(c)'s rows: label, elastictrain's measure, the baseline's, their ratio in ``checkpoint_sharded.py``'s JSON."""
REFUSED = re.compile(r"\b(?:ConfigError|SessionError): (.*)")
"""A session's refusal at start, in an agent's log (the worker's one line, with its reason)."""


@dataclass
class ShardedTrial(TrialSetup):
    """A trial of ``_train_sharded.py``: the Session loop under elastictrain, the DCP loop under torchrun."""

    sharding: str = "fsdp"
    width: int = 512
    layers: int = 8
    ckpt_every: int = 5

    def script_name(self) -> str:
        """See base class."""
        return SCRIPT.name

    def tuned(self) -> bool:
        """See base class: the torchrun baseline runs tuned."""
        return True

    def script(self) -> list[str]:
        """See base class."""
        loop = "dcp" if self.launcher == "torchrun_dcp" else "session"
        copies = ["--redundancy-every", "1"] if self.launcher == REDUNDANCY else []
        return [str(SCRIPT), "--events", str(self.workdir / "events.jsonl"), "--ckpt-dir", str(self.workdir / "ckpt"),
                "--loop", loop, "--sharding", self.sharding, "--width", str(self.width), "--layers", str(self.layers),
                "--ckpt-every", str(self.ckpt_every), *copies]

    def command(self, node: int) -> list[str]:
        """See base class: the redundancy launcher is ``elastictrain run --recovery in-process``."""
        cmd = super().command(node)
        if self.launcher == REDUNDANCY:
            at = cmd.index(str(SCRIPT))
            cmd[at:at] = ["--recovery", "in-process"]
        return cmd


def refusal(workdir: Path) -> str | None:
    """The line in which the job refused its launcher's recovery mode at start, if it did."""
    for log in sorted(workdir.glob("agent-*.log")):
        for line in log.read_text(errors="replace").splitlines():
            if (found := REFUSED.search(line)) is not None:
                return found.group(1).strip()[:300]
    return None


def run(scenarios: list[str], launchers: list[str], reps: int, *, action_step: int, width: int, layers: int,
        ckpt_every: int, recovery_timeout: float, start_timeout: float, kill_at: float = 0.0, keep: bool = False,
        log: Any = print) -> dict[str, Any]:
    """Every trial, interleaved; a combination the job refuses is tried once and reported ``unsupported``."""
    join_flag = _elastictrain_has_join()
    root = Path(tempfile.mkdtemp(prefix="bench-sharded-"))
    results: dict[str, Any] = {"scenarios": {}, "action_step": action_step, "width": width, "layers": layers,
                               "ckpt_every": ckpt_every, "kill_at": kill_at}
    try:
        with private_etcd() as etcd:
            for name in scenarios:
                sharding, scenario = SCENARIOS[name]
                trials: dict[str, list[dict[str, Any]]] = {ln: [] for ln in launchers}
                unsupported: dict[str, str] = {}
                if REDUNDANCY in launchers and sharding != "fsdp":
                    unsupported[REDUNDANCY] = f"redundancy_every is fsdp's ({sharding}: the other nodes are replicas)"
                for rep in range(reps):
                    order = launchers[rep % len(launchers):] + launchers[:rep % len(launchers)]
                    for launcher in (ln for ln in order if ln not in unsupported):
                        workdir = root / f"{name}-{launcher}-{rep}"
                        workdir.mkdir(parents=True)
                        setup = ShardedTrial(launcher, scenario, workdir, etcd.endpoint, action_step,
                                             recovery_timeout, start_timeout, join_flag, sharding=sharding,
                                             width=width, layers=layers, ckpt_every=ckpt_every, kill_at=kill_at)
                        trial = run_trial(setup)
                        trial["rep"] = rep
                        trial["state_from"] = sorted({str(e["state_from"]) for e in trial.get("run_events", [])
                                                      if e.get("kind") == "recovery" and "state_from" in e})
                        refused = refusal(workdir) if "error" in trial else None
                        if refused is not None:
                            unsupported[launcher] = refused
                            log(f"[sharded] {name} {launcher}: unsupported: {refused}")
                        else:
                            trials[launcher].append(trial)
                            log(f"[sharded] {name} rep {rep} {launcher}: " + (
                                f"{trial['recovery_s']:.2f}s, redone {trial.get('steps_redone')}"
                                if "recovery_s" in trial else f"FAILED: {trial.get('error')}"))
                        if "error" not in trial and not keep:
                            shutil.rmtree(workdir, ignore_errors=True)
                entry: dict[str, Any] = {"sharding": sharding}
                for launcher in launchers:
                    entry[launcher] = ({"unsupported": unsupported[launcher]} if launcher in unsupported
                                       else {**_aggregate(trials[launcher]), "trials": trials[launcher]})
                for ours in (REDUNDANCY, "elastictrain_inprocess", "elastictrain_restart"):
                    if ours in launchers and "torchrun_dcp" in launchers:
                        entry[f"ratio_{ours}_over_torchrun_dcp"] = ratio(
                            entry[ours].get("recovery_s"), entry["torchrun_dcp"].get("recovery_s"))
                results["scenarios"][name] = entry
    finally:
        kept = [p for p in root.iterdir() if p.is_dir()] if root.exists() else []
        if not kept:
            shutil.rmtree(root, ignore_errors=True)
    results["kept_trial_dirs"] = str(root) if root.exists() else None
    return results


def checkpoint_stall(width: int, layers: int, reps: int, timeout: float) -> dict[str, Any]:
    """``checkpoint_sharded.py`` at the same model over 4 ranks: its JSON record (or the error)."""
    with tempfile.TemporaryDirectory(prefix="bench-sharded-ckpt-") as scratch:
        out = Path(scratch) / "checkpoint_sharded.json"
        command = [sys.executable, str(BENCH_DIR / "checkpoint_sharded.py"), "--ranks", "4", "--width", str(width),
                   "--layers", str(layers), "--reps", str(reps), "--out", str(out), "--timeout", f"{timeout:g}"]
        done = subprocess.run(command, capture_output=True, text=True, timeout=2 * timeout + 60)
        if done.returncode != 0 or not out.exists():
            return {"error": f"checkpoint_sharded.py exited {done.returncode}: {done.stderr[-500:]}"}
        record: dict[str, Any] = json.loads(out.read_text())
        return record


def markdown_table(record: dict[str, Any], launchers: list[str]) -> str:
    lines = [f"| measure | {' | '.join(launchers)} |", "|---|" + "---|" * len(launchers)]

    def row(label: str, cells: list[str]) -> None:
        lines.append(f"| {label} | {' | '.join(cells)} |")

    for name, entry in record["scenarios"].items():
        stats = [entry.get(ln, {}) for ln in launchers]
        row(TABLE_ROWS[name], [f"unsupported: {e['unsupported']}" if "unsupported" in e
                               else _cell(e.get("recovery_s")) for e in stats])
        row("↳ committed steps redone", ["—" if "unsupported" in e else _cell(e.get("steps_redone"), digits=0, unit="")
                                        for e in stats])
        row("↳ state from", ["—" if "unsupported" in e else ", ".join(sorted(
            {s for t in e.get("trials", []) for s in t.get("state_from", [])} or {"restart"})) for e in stats])
    ckpt = record.get("checkpoint")
    if ckpt is not None and "results" in ckpt:
        found = ckpt["results"]
        lines += ["", f"| checkpoint (c), {ckpt.get('state_mb')} MB of state over {ckpt.get('ranks')} ranks "
                  "(`checkpoint_sharded.py`) | elastictrain | baseline | ratio |", "|---|---|---|---|"]
        for label, ours, theirs, key in CHECKPOINT_ROWS:
            lines.append(f"| {label} | {_cell(found.get(ours), digits=3)} | {_cell(found.get(theirs), digits=3)} | "
                         f"{found.get(key, float('nan')):.2f} |")
    elif ckpt is not None:
        lines += ["", f"checkpoint (c): {ckpt.get('error')}"]
    lines.append("")
    lines.append(f"Median (min–max) over {record['reps']} repetition(s), seconds from the SIGKILL; 2 nodes x 2 "
                 f"workers, width {record['width']}, {record['layers']} layers, a checkpoint every "
                 f"{record['ckpt_every']} steps, the kill after step {record['action_step']}"
                 + (f", {record['kill_at']:g} of a step later." if record.get("kill_at") else " (at once)."))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--scenarios", default=",".join(SCENARIOS))
    parser.add_argument("--launchers", default=",".join(LAUNCHERS))
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--width", type=int, default=512, help="model width (512 and 8 layers: ~310 MB of state)")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--action-step", type=int, default=12)
    parser.add_argument("--ckpt-every", type=int, default=5)
    parser.add_argument("--recovery-timeout", type=float, default=300.0)
    parser.add_argument("--start-timeout", type=float, default=600.0)
    parser.add_argument("--kill-at", type=float, default=0.0,
                        help="where in the next step the kill lands, as a fraction of a step (0: just after "
                             "--action-step, the redundancy's copy of it in flight; 0.5: half-way through)")
    parser.add_argument("--no-checkpoint", action="store_true", help="skip (c), checkpoint_sharded.py")
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--keep", action="store_true", help="keep every trial's logs and events")
    args = parser.parse_args(argv)
    scenarios = [s for s in args.scenarios.split(",") if s]
    launchers = [ln for ln in args.launchers.split(",") if ln]
    for name in scenarios:
        if name not in SCENARIOS:
            parser.error(f"unknown scenario {name!r}; choose from {', '.join(SCENARIOS)}")
    for name in launchers:
        if name not in LAUNCHERS:
            parser.error(f"unknown launcher {name!r}; choose from {', '.join(LAUNCHERS)}")
    if not 0 <= args.kill_at < 1:
        parser.error(f"--kill-at is a fraction of a step in [0, 1), got {args.kill_at:g}")
    if args.ckpt_every < 1 or args.action_step <= args.ckpt_every:
        parser.error(f"need 1 <= --ckpt-every < --action-step, got {args.ckpt_every} and {args.action_step}")
    record: dict[str, Any] = {"benchmark": "sharded_recovery", "machine": machine(), "reps": args.reps,
                              **run(scenarios, launchers, args.reps, action_step=args.action_step, width=args.width,
                                    layers=args.layers, ckpt_every=args.ckpt_every,
                                    recovery_timeout=args.recovery_timeout, start_timeout=args.start_timeout,
                                    kill_at=args.kill_at, keep=args.keep,
                                    log=lambda m: print(m, file=sys.stderr, flush=True))}
    if not args.no_checkpoint:
        record["checkpoint"] = checkpoint_stall(args.width, args.layers, args.reps, args.start_timeout)
    record["machine_after"] = machine()["loadavg_1_5_15"]
    emit_with_table(record, markdown_table(record, launchers), args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
