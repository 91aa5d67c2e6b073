"""``elastictrain chaos`` (or ``python -m elastictrain.chaos``): run a job under injected faults, check the
invariants, write a report.

Examples::

    # the built-in demo job, three faults at known steps
    elastictrain chaos --schedule kill_worker@4,kill_node@10,join@16

    # a soak: 50 random faults drawn from seed 7
    elastictrain chaos --faults 50 --seed 7

    # (root) each node in its own network namespace; cut one off etcd and its peers for 30 s at step 6
    elastictrain chaos --netns --schedule partition_node@6

    # the demo job sharded: FSDP2 over 2 nodes x 2 workers, recovering in place (copies of the shards in memory)
    elastictrain chaos --sharding fsdp --nproc-per-node 2 --faults 6 --seed 1

    # checkpoints in S3 or a compatible store (an empty prefix) instead of the run directory
    AWS_ENDPOINT_URL=http://127.0.0.1:9000 elastictrain chaos --faults 10 --checkpoint-dir s3://bucket/chaos-1

    # your own job (instrumented with elastictrain.chaos.Recorder); {run_dir} is substituted
    elastictrain chaos --faults 10 --seed 1 -- train.py --ckpt {run_dir}/ckpt

Exit code: 0 when every invariant held, 1 when one was violated, 2 on bad input.
"""

from __future__ import annotations

import argparse
import logging
import math
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from elastictrain.chaos.config import DEFAULT_KINDS, ChaosConfig, default_recovery, demo_sharding_args, kinds_for
from elastictrain.chaos.schedule import FaultKind, parse_kinds, parse_schedule
from elastictrain.chaos.harness import run_chaos
from elastictrain.errors import ConfigError, ElasticTrainError
from elastictrain.train.strategy import SHARDINGS

DEMO_JOB = str(Path(__file__).resolve().parent / "_demo_job.py")
_DEMO_STEPS_PER_EPOCH = 24  # the demo's 384 samples at a global batch of 16


def _gap(text: str) -> tuple[int, int]:
    low, _, high = text.partition(":")
    try:
        return int(low), int(high or low)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected LOW:HIGH steps, got {text!r}") from None


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="elastictrain chaos", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--run-dir", default=None, help="where the run's files go (default: elastictrain-runs/chaos-TIME)")
    p.add_argument("--nodes", type=int, default=3, help="node agents at the start (default 3); those above --max-nodes wait as hot spares")
    p.add_argument("--min-nodes", type=int, default=2, help="--min-nodes of the job (default 2)")
    p.add_argument("--max-nodes", type=int, default=3, help="--max-nodes of the job (default 3)")
    p.add_argument("--nproc-per-node", type=int, default=1, help="workers per node (default 1)")
    p.add_argument("--schedule", default="", help="faults as KIND@STEP,... (kinds: "
                   + ", ".join(k.value for k in FaultKind) + ")")
    p.add_argument("--faults", type=int, default=0, help="draw this many random faults instead of --schedule")
    p.add_argument("--seed", type=int, default=0, help="seed of the random faults and targets (default 0)")
    p.add_argument("--kinds", default=None, help="kinds the random faults are drawn from "
                   f"(default {','.join(k.value for k in DEFAULT_KINDS)}, +kill_etcd_leader with 3 etcd members, "
                   "+partition_node,link_cut with --netns, +disk_full with --checkpoint-disk-mb)")
    p.add_argument("--gap", type=_gap, default=(2, 5), help="steps between a recovery and the next random fault, LOW:HIGH (default 2:5)")
    p.add_argument("--etcd-members", type=int, default=1, choices=(1, 3), help="etcd cluster size (default 1)")
    p.add_argument("--etcd-down", type=float, default=3.0, help="seconds killed etcd members stay down (default 3)")
    p.add_argument("--hang", type=float, default=None, help="seconds hang_worker stops a worker (default: pg timeout + 5)")
    p.add_argument("--hang-then-kill", action="store_true", help="end a hang with SIGKILL instead of SIGCONT")
    p.add_argument("--netns", action="store_true", help="run each node in its own network namespace (root, iproute2); "
                   "needed by partition_node and link_cut")
    p.add_argument("--checkpoint-disk-mb", type=int, default=0, help="mount a tmpfs of this many MB at "
                   "{run_dir}/ckpt for the checkpoints (root); needed by disk_full")
    p.add_argument("--checkpoint-dir", default="", help="keep the demo job's checkpoints in this s3://bucket/prefix "
                   "(empty; AWS_ENDPOINT_URL and the AWS credential variables name the store) instead of "
                   "{run_dir}/ckpt; disk_full is then left out. A job of your own names it {checkpoint_dir}")
    p.add_argument("--partition-duration", type=float, default=None, help="seconds partition_node keeps a node "
                   "cut off (default: pg timeout + 10)")
    p.add_argument("--rejoin-after", type=float, default=3.0, help="seconds before bounce_node's replacement starts (default 3)")
    p.add_argument("--pg-timeout", type=float, default=20.0, help="collective timeout of the workers, seconds (default 20)")
    p.add_argument("--join-timeout", type=float, default=60.0, help="--join-timeout of the nodes, seconds (default 60)")
    p.add_argument("--max-restarts", type=int, default=1000, help="--max-restarts of the nodes (default 1000)")
    p.add_argument("--sharding", choices=SHARDINGS, default="ddp", help="the demo job's Session(sharding=...) "
                   "(default ddp); fsdp recovers in process with a copy of each rank's shards on another "
                   "node, refreshed every step (--redundancy-every 1). hsdp shards within a node: give "
                   "--nproc-per-node 2 or more")
    p.add_argument("--recovery", choices=("in-process", "restart"), default=None,
                   help="--recovery of the nodes (default in-process; restart leaves out kill_in_save)")
    p.add_argument("--recovery-bound", type=float, default=None, help="seconds a fault may go without training "
                   "before the run counts as hung (default: 120 + pg timeout + the fault's own duration)")
    p.add_argument("--deadline", type=float, default=1800.0, help="seconds before the whole run is stopped (default 1800)")
    p.add_argument("--no-reference", action="store_true", help="skip the reference run (and the final-parameters invariant)")
    p.add_argument("--atol", type=float, default=1e-5, help="final-parameters absolute tolerance (default 1e-5)")
    p.add_argument("--rtol", type=float, default=1e-4, help="final-parameters relative tolerance (default 1e-4)")
    p.add_argument("--run-arg", action="append", default=[], help="extra `elastictrain run` flag (repeatable)")
    p.add_argument("--step-time", type=float, default=0.0, help="the demo job's sleep per step (default 0: the harness paces it)")
    p.add_argument("-v", "--verbose", action="store_true", help="log each fault as it happens")
    p.add_argument("script", nargs="?", default=None, help="training script (default: the built-in demo job)")
    p.add_argument("script_args", nargs=argparse.REMAINDER, help="its arguments; {run_dir} and {checkpoint_dir} "
                   "are substituted")
    return p


def _demo_args(args: argparse.Namespace, schedule_steps: int, recovery: str) -> tuple[str, ...]:
    if args.faults:
        steps = args.faults * (args.gap[1] + 2) + 12
    else:
        steps = schedule_steps + 12
    epochs = max(2, math.ceil(steps / _DEMO_STEPS_PER_EPOCH))
    return ("--ckpt", "{checkpoint_dir}", "--epochs", str(epochs), "--step-time", str(args.step_time),
            *demo_sharding_args(args.sharding, recovery))


def config_from(args: argparse.Namespace) -> ChaosConfig:
    if args.step_time < 0 or not math.isfinite(args.step_time):
        raise ConfigError(f"--step-time must be a finite number of seconds >= 0, got {args.step_time}")
    schedule = tuple(parse_schedule(args.schedule))
    recovery = args.recovery or default_recovery(args.sharding)
    if args.kinds:
        kinds = parse_kinds(args.kinds)
    else:
        kinds = kinds_for(recovery, DEFAULT_KINDS + ((FaultKind.KILL_ETCD_LEADER,) if args.etcd_members == 3 else ())
                          + ((FaultKind.PARTITION_NODE, FaultKind.LINK_CUT) if args.netns else ())
                          + ((FaultKind.DISK_FULL,) if args.checkpoint_disk_mb else ()))
    if args.sharding != "ddp" and args.script is not None:
        raise ConfigError("--sharding configures the built-in demo job; give your own script its flag among its "
                          "arguments, and --recovery restart")
    script_args = list(args.script_args)
    if script_args[:1] == ["--"]:
        script_args = script_args[1:]
    if args.script is None:
        script, script_args = DEMO_JOB, list(_demo_args(args, max((f.at_step for f in schedule), default=0), recovery))
    else:
        script = args.script
    run_dir = args.run_dir or str(Path("elastictrain-runs") / time.strftime("chaos-%Y%m%d-%H%M%S"))
    return ChaosConfig(
        script=script, script_args=tuple(script_args), run_dir=run_dir, nodes=args.nodes,
        min_nodes=args.min_nodes, max_nodes=args.max_nodes, nproc_per_node=args.nproc_per_node,
        schedule=schedule, faults=args.faults, seed=args.seed, kinds=kinds, gap=args.gap,
        etcd_members=args.etcd_members, etcd_down=args.etcd_down, hang=args.hang,
        hang_then_kill=args.hang_then_kill, netns=args.netns, partition=args.partition_duration,
        rejoin_after=args.rejoin_after, pg_timeout=args.pg_timeout,
        join_timeout=args.join_timeout, max_restarts=args.max_restarts, recovery=recovery, sharding=args.sharding,
        recovery_bound=args.recovery_bound,
        deadline=args.deadline, reference=not args.no_reference, atol=args.atol, rtol=args.rtol,
        run_args=tuple(args.run_arg), checkpoint_disk_mb=args.checkpoint_disk_mb, checkpoint_dir=args.checkpoint_dir,
    )


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point; returns the exit code."""
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(asctime)s %(name)s: %(message)s")
    try:
        result = run_chaos(config_from(args))
    except ConfigError as exc:
        print(f"elastictrain chaos: error: {exc}", file=sys.stderr)
        return 2
    except ElasticTrainError as exc:
        print(f"elastictrain chaos: error: {exc}", file=sys.stderr)
        return 1
    report = result.report
    print(f"chaos run {report['run_id']}: {report['faults_injected']} fault(s) in {report['duration_s']:.0f}s, "
          f"{report['committed_steps']} committed steps, {report['steps_redone']} redone, "
          f"final world size {report['final_world_size']}")
    for kind, summary in report["recovery_by_kind"].items():
        print(f"  {kind:18} x{summary['count']:<3} recovery median {summary['recovery_s_median']}s "
              f"(min {summary['recovery_s_min']}, max {summary['recovery_s_max']})")
    for name, outcome in report["invariants"].items():
        mark = {True: "ok  ", False: "FAIL", None: "n/a "}[outcome["ok"]]
        print(f"  [{mark}] {name}: {outcome['detail']}")
    print(f"report: {result.run_dir / 'report.json'}; plot: {report['plot']}")
    return 0 if result.ok else 1


if __name__ == "__main__":
    sys.exit(main())
