"""The chaos harness: run a job on several local node agents, inject faults, check invariants, report.

:func:`run_chaos` starts an etcd (1 or 3 members) and ``nodes`` separate
``elastictrain run --etcd ... --run-id ...`` agents on this machine, then
follows the job's progress through the evidence its
:class:`~elastictrain.chaos.Recorder` writes, and injects each fault once the
job has applied the fault's step and recovered from the previous fault. A gate
file paces the job (see :mod:`~elastictrain.chaos.recorder`): it holds the job
after the next fault's step until the fault is injected, so faults land where
the schedule says on any machine. When every node has exited it judges the
invariants (:mod:`~elastictrain.chaos.verdict`) and writes the report
(:mod:`~elastictrain.chaos.report`). An uninterrupted reference run of the same
script (one process, no launcher) runs alongside, for the final-parameters invariant.
With ``netns`` each node runs in its own network namespace (:mod:`~elastictrain.chaos.netns`),
so that ``partition_node`` can cut one off the network.

Everything lands in ``run_dir``: ``evidence/`` (the job's), ``gate``, ``events.jsonl``
(the agents'), ``nodes/<name>.log``, ``etcd/``, the job's own files (its
arguments may name ``{run_dir}``, e.g. ``--ckpt {run_dir}/ckpt``),
``reference/``, ``report.json`` and ``report.png``.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import subprocess
import sys
import time
import uuid
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

from elastictrain._process import dying_with_us
from elastictrain.chaos import invariants as inv
from elastictrain.chaos.cluster import EtcdCluster, Node
from elastictrain.chaos.config import DEFAULT_KINDS, ChaosConfig
from elastictrain.chaos.faults import FaultKind, FaultRecord, RandomPlanner, process_state, worker_pids
from elastictrain.chaos.netns import NS_INTERFACE, NodeNetwork
from elastictrain.chaos.recorder import CHAOS_DIR_ENV, GATE_ENV
from elastictrain.chaos.report import build_report
from elastictrain.chaos.verdict import judge
from elastictrain.launch.config import check_writable_dir
from elastictrain.errors import ConfigError
from elastictrain.events import LineTail

logger = logging.getLogger(__name__)

__all__ = ["DEFAULT_KINDS", "ChaosConfig", "ChaosResult", "run_chaos"]

_OPEN = 2**62  # a gate that holds nothing

_REFERENCE_GRACE_S = 30.0
"""How long the job may go without a step after its reference run failed, before the run
ends: a job that cannot run as one process still trains distributed within it."""

# Launcher variables a reference run must not inherit (it is one plain process).
_LAUNCHER_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR",
                 "MASTER_PORT", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT", "ELASTICTRAIN_ETCD",
                 "ELASTICTRAIN_RUN_ID")


@dataclass
class ChaosResult:
    """What a chaos run produced."""

    run_dir: Path
    report: dict[str, Any]
    invariants: dict[str, inv.InvariantResult]

    @property
    def ok(self) -> bool:
        """True if no invariant was violated (unchecked ones do not count)."""
        return all(r.ok is not False for r in self.invariants.values())

    def failures(self) -> str:
        return "; ".join(f"{n}: {r.detail}" for n, r in self.invariants.items() if r.ok is False)


class _Progress:
    """Follows the job's rank-0 evidence file as it grows."""

    def __init__(self, path: Path) -> None:
        self._tail = LineTail(path)
        self.segments: list[dict[str, Any]] = []
        self.steps: list[dict[str, Any]] = []
        self.checkpoints: list[int] = []  # steps saved, or restored (a save can commit and still fail)
        self.config: dict[str, Any] | None = None

    def poll(self) -> None:
        try:
            lines = self._tail.new_lines()
        except FileNotFoundError:
            return
        for line in lines:
            try:
                event = json.loads(line)
            except ValueError:
                continue
            kind = event.get("kind")
            if kind == "segment":
                self.segments.append(event)
            elif kind == "step":
                self.steps.append(event)
            elif kind in ("saved", "restored"):
                self.checkpoints.append(event["step"])
            elif kind == "config" and self.config is None:
                self.config = event

    @property
    def step(self) -> int:
        """The step applied last (0 before any)."""
        return self.steps[-1]["step"] if self.steps else 0

    def newest_checkpoint(self) -> int:
        return max(self.checkpoints, default=0)

    def first_step_of(self, seg: str) -> dict[str, Any] | None:
        """The first step the process group ``seg`` applied, if any yet."""
        return next((s for s in self.steps if s["seg"] == seg), None)

    def total_steps(self) -> int | None:
        return inv.total_steps(self.config)


class _Harness:
    def __init__(self, config: ChaosConfig) -> None:
        self.config = config
        self.run_dir = Path(config.run_dir).resolve()
        if self.run_dir.exists() and any(self.run_dir.iterdir()):
            raise ConfigError(f"run directory {self.run_dir} is not empty")
        check_writable_dir(str(self.run_dir), "--run-dir")
        (self.run_dir / "nodes").mkdir()
        self.evidence_dir = self.run_dir / "evidence"
        self.gate_file = self.run_dir / "gate"
        self.run_id = f"chaos-{uuid.uuid4().hex[:8]}"
        self.progress = _Progress(self.evidence_dir / "events.jsonl")
        self._agent_events = LineTail(self.run_dir / "events.jsonl")
        self._spares_said: list[tuple[str, float]] = []  # (node, when) of each `spare` event read so far
        self.planner = RandomPlanner(config.seed, config.kinds, config.gap)
        # With netns every node gets its own namespace, and etcd listens on their bridge.
        self.network = NodeNetwork.create() if config.netns else None
        try:
            self.etcd = EtcdCluster(self.run_dir / "etcd", config.etcd_members,
                                    host=self.network.gateway if self.network else "127.0.0.1")
        except BaseException:
            if self.network:
                self.network.teardown()
            raise
        self.nodes: list[Node] = []
        self.faults: list[FaultRecord] = []
        self.actions: list[tuple[float, Callable[[], None]]] = []
        self.stopped: dict[int, float] = {}  # pid -> when SIGSTOPped, until resumed
        self.cut_nodes: dict[int, Node] = {}  # fault index -> the node partition_node cut off
        self.aborted: str | None = None
        self.gate = -1
        self.start = time.time()

    # --- processes ----------------------------------------------------------------------------

    def _env(self, evidence: Path) -> dict[str, str]:
        env = dict(os.environ)
        env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
        env.setdefault("OMP_NUM_THREADS", "1")
        env["PYTHONUNBUFFERED"] = "1"
        env[CHAOS_DIR_ENV] = str(evidence)
        env["ELASTICTRAIN_PG_TIMEOUT"] = f"{self.config.pg_timeout.total_seconds():g}"
        env.update(self.config.env)
        return env

    def _args(self, run_dir: Path) -> list[str]:
        return [a.replace("{run_dir}", str(run_dir)) for a in self.config.script_args]

    def start_node(self, *, join: bool) -> Node:
        config = self.config
        index = len(self.nodes)
        name = f"node{index}"
        local_addr = self.network.add_node(index) if self.network else "127.0.0.1"
        command = [
            sys.executable, "-m", "elastictrain", "run", "--etcd", self.etcd.endpoints, "--run-id", self.run_id,
            "--node-name", name, "--min-nodes", str(config.min_nodes), "--max-nodes", str(config.max_nodes),
            "--nproc-per-node", str(config.nproc_per_node), "--max-restarts", str(config.max_restarts),
            "--recovery", config.recovery,
            "--local-addr", local_addr, "--event-log", str(self.run_dir / "events.jsonl"),
            "--join-timeout", f"{config.join_timeout.total_seconds():g}",
            *(["--join"] if join else []), *config.run_args, config.script, *self._args(self.run_dir),
        ]
        env = {**self._env(self.evidence_dir), GATE_ENV: str(self.gate_file)}
        if self.network:
            command = self.network.wrap(index, command)
            env["GLOO_SOCKET_IFNAME"] = NS_INTERFACE  # else gloo binds to the address the hostname resolves to
        node = Node.start(name, command, env=env, log=self.run_dir / "nodes" / f"{name}.log",
                          cwd=self.run_dir, joined=join)
        self.nodes.append(node)
        logger.info("started %s (pid %d)%s", name, node.pid, " with --join" if join else "")
        return node

    def start_reference(self) -> subprocess.Popen[bytes] | None:
        if not self.config.reference:
            return None
        ref = self.run_dir / "reference"
        ref.mkdir()
        env = {k: v for k, v in self._env(ref / "evidence").items() if k not in _LAUNCHER_ENV}
        with open(ref / "log.txt", "wb") as log:
            return subprocess.Popen(dying_with_us([sys.executable, self.config.script, *self._args(ref)]), env=env,
                                    cwd=ref, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)

    def alive_nodes(self) -> list[Node]:
        return [n for n in self.nodes if n.alive()]

    # --- faults -------------------------------------------------------------------------------

    def _later(self, delay: timedelta, action: Callable[[], None]) -> None:
        self.actions.append((time.time() + delay.total_seconds(), action))

    def _nodes_by_segment(self) -> dict[int, set[str]]:
        """Names of the nodes with a worker in each process group (from the job's evidence)."""
        nodes: dict[int, set[str]] = defaultdict(set)
        for worker in inv.read_lines(self.evidence_dir / "workers.jsonl"):
            nodes[worker["seg"]].add(worker["node"])
        return nodes

    def _training_nodes(self) -> set[str]:
        """Names of the nodes with a worker in the newest process group."""
        if not self.progress.segments:
            return set()
        return self._nodes_by_segment().get(self.progress.segments[-1]["seg"], set())

    def _said_spare(self, since: float = 0.0) -> set[str]:
        """Names of the nodes that said they wait as hot spares (the agents' ``spare`` event), since ``since``.
        The agents' event log is read on from where the last call stopped."""
        with contextlib.suppress(FileNotFoundError):
            for line in self._agent_events.new_lines():
                if b'"spare"' not in line:
                    continue
                try:
                    event = json.loads(line)
                except ValueError:
                    continue
                if event.get("kind") == "spare":
                    self._spares_said.append((event["node"], event.get("ts", 0.0)))
        return {node for node, ts in self._spares_said if ts > since}

    def _spares(self) -> list[Node]:
        """Live nodes that wait as hot spares now: they said so and have no worker in the newest group."""
        said, training = self._said_spare(), self._training_nodes()
        return [n for n in self.alive_nodes() if n.name in said and n.name not in training]

    def _settled(self, name: str) -> bool:
        """Whether a node added to a full round waits as a spare (it said so) or trains, or has exited."""
        node = next(n for n in self.nodes if n.name == name)
        return not node.alive() or name in self._said_spare() or name in self._training_nodes()

    def _start_joiner(self, fault: FaultRecord) -> tuple[str, bool]:
        """Start one more node with ``--join`` for ``fault``; its name, and whether the round is
        full without it (it waits as a hot spare: ``fault`` settles once it says so)."""
        spare = len(self.alive_nodes()) >= self.config.max_nodes
        name = self.start_node(join=True).name
        fault.awaits_spare = name if spare else ""
        return name, spare

    def _pick_node(self) -> tuple[Node, bool] | None:
        """A node to kill, preferably one that trains now; and whether it does."""
        alive = self.alive_nodes()
        training = [n for n in alive if n.name in self._training_nodes()]
        pool = training or alive
        if not pool:
            return None
        return pool[self.planner.choice(range(len(pool)))], bool(training)

    def _pick_worker(self) -> tuple[Node, int] | None:
        training = self._training_nodes()
        candidates = [(n, pid) for n in self.alive_nodes() if n.name in training for pid in worker_pids(n.pid)
                      if process_state(pid) not in (None, "T", "Z")]
        if not candidates:
            return None
        index = self.planner.choice(range(len(candidates)))
        return candidates[index]

    def inject(self, fault: FaultRecord) -> bool:
        """Inject ``fault`` now; False if its target is not there yet (try again shortly)."""
        kind, config = fault.kind, self.config
        now = time.time()
        fault.spare_waiting = bool(self._spares())
        if kind in (FaultKind.KILL_WORKER, FaultKind.HANG_WORKER):
            picked = self._pick_worker()
            if picked is None:
                return False
            node, pid = picked
            fault.target = f"{node.name} worker pid {pid}"
            fault.target_pids = [pid]
            if kind is FaultKind.KILL_WORKER:
                os.kill(pid, signal.SIGKILL)
                fault.ended = now
            else:
                os.kill(pid, signal.SIGSTOP)
                self.stopped[pid] = now

                def resume(pid: int = pid) -> None:
                    self.stopped.pop(pid, None)
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGKILL if config.hang_then_kill else signal.SIGCONT)
                    fault.ended = time.time()

                self._later(config.hang_duration, resume)
        elif kind in (FaultKind.KILL_NODE, FaultKind.BOUNCE_NODE):
            picked = self._pick_node()
            if picked is None:
                return False
            node, training = picked
            alive = len(self.alive_nodes())
            fault.target = node.name if training else f"{node.name} (waiting to join: not training)"
            fault.target_pids = worker_pids(node.pid)
            # A node outside the training group leaves it untouched (a bounce still
            # brings a node that joins, and so a new group).
            fault.expects_restart = training or kind is FaultKind.BOUNCE_NODE
            node.kill()
            if kind is FaultKind.KILL_NODE:
                fault.ended = now
                # With no node coming back, the survivors wait out --join-timeout and give up.
                fault.below_min = alive - 1 < config.min_nodes
            else:
                def replace() -> None:
                    name, spare = self._start_joiner(fault)
                    fault.target += f", replaced by {name}" + (" (the round is full: a spare)" if spare else "")
                    fault.ended = time.time()

                self._later(config.rejoin_after, replace)
        elif kind is FaultKind.PARTITION_NODE:
            assert self.network is not None  # noqa: S101 - the config requires netns
            picked = self._pick_node()
            if picked is None:
                return False
            if len(self.alive_nodes()) - 1 < config.min_nodes:
                # Below min-nodes the survivors would wait for the cut node: not a partition the job
                # can ride out, so wait for a node to join (or give up after 60 s).
                fault.note = "cutting a node would leave fewer than min-nodes"
                return False
            node, training = picked
            fault.note = ""
            fault.target_pids = worker_pids(node.pid)
            index = self.nodes.index(node)
            fault.target = node.name if training else f"{node.name} (waiting to join: not training)"
            fault.expects_restart = training
            self.network.cut(index)
            node.partitioned = now
            self.cut_nodes[fault.index] = node

            def heal(index: int = index) -> None:
                assert self.network is not None  # noqa: S101
                self.network.heal(index)
                fault.ended = time.time()

            self._later(config.partition_duration, heal)
        elif kind is FaultKind.JOIN:
            name, spare = self._start_joiner(fault)
            fault.target = name + (" (the round is full: it waits as a hot spare)" if spare else "")
            # A spare changes no group: the fault has settled once the node says it waits.
            fault.expects_restart = not spare
            fault.ended = now
        elif kind is FaultKind.KILL_ETCD:
            fault.target = f"all {len(self.etcd.servers)} etcd member(s)"
            for index in range(len(self.etcd.servers)):
                self.etcd.kill_member(index)

            def restart_all() -> None:
                self.etcd.start()
                fault.ended = time.time()

            self._later(config.etcd_down, restart_all)
        elif kind is FaultKind.KILL_ETCD_LEADER:
            leader = self.etcd.leader()
            if leader is None:
                return False
            fault.target = f"etcd leader m{leader}"
            self.etcd.kill_member(leader)

            def restart_leader(index: int = leader) -> None:
                self.etcd.start_member(index)
                fault.ended = time.time()

            self._later(config.etcd_down, restart_leader)
        fault.injected = now
        fault.step_before = self.progress.step
        logger.info("fault %d: %s at step %d -> %s", fault.index, kind.value, self.progress.step, fault.target)
        return True

    def _bound(self, fault: FaultRecord) -> float:
        bound = self.config.bound_for(fault.kind)
        if fault.below_min:
            bound += self.config.join_timeout.total_seconds()
        return bound

    def _back_from_partition(self, fault: FaultRecord) -> bool:
        """Whether the node ``fault`` cut off has settled since the heal: trains again, waits as a
        spare (a spare took its place meanwhile), or has exited.

        Waiting for it keeps its rejoin (a restart of the whole group) from landing on the next fault.
        """
        node = self.cut_nodes[fault.index]
        if not node.alive():
            fault.note = f"{node.name} exited {node.exit_code} after the heal"
            return True
        assert fault.ended is not None  # noqa: S101 - checked by the caller
        if node.name in self._said_spare(since=fault.ended):
            fault.note = f"{node.name} waits as a spare after the heal"
            return True
        nodes_by_segment = self._nodes_by_segment()
        for seg in (s for s in self.progress.segments if s["t"] > fault.ended):
            trained = self.progress.first_step_of(seg["seg"]) is not None
            if trained and node.name in nodes_by_segment.get(seg["seg"], ()):
                fault.note = f"{node.name} rejoined after the heal"
                return True
        return False

    def check_recovered(self, fault: FaultRecord, *, final: bool = False) -> bool:
        """Whether the job trains again after ``fault``; sets its recovery time.

        Args:
            fault: An injected fault.
            final: The run is over: judge with what there is.
        """
        assert fault.injected is not None  # noqa: S101 - private invariant
        if fault.ended is None or fault.below_min:
            return False
        if fault.kind is FaultKind.PARTITION_NODE and not self._back_from_partition(fault) and not final:
            return False
        if fault.awaits_spare and not self._settled(fault.awaits_spare) and not final:
            return False
        progress = self.progress
        if fault.expects_restart:
            # A bounce recovers once a group with the replacement in the rendezvous trains; with a
            # spare waiting, once the group the spare completed trains (the replacement is a spare).
            bounce = fault.kind is FaultKind.BOUNCE_NODE and not fault.spare_waiting
            ref = fault.ended if bounce else fault.injected
            for seg in (s for s in progress.segments if s["t"] > ref):
                first = progress.first_step_of(seg["seg"])
                if first is not None:
                    fault.recovered, fault.restarted = first["t"], True
                    return True
            return False
        if not fault.kind.etcd:  # a node that was not training died: training just goes on
            first = next((s for s in progress.steps if s["t"] > fault.injected), None)
            if first is None and not final:
                return False
            fault.restarted = any(g["t"] > fault.injected for g in progress.segments)
            fault.recovered = first["t"] if first else None
            return True
        # etcd: training needs no etcd within a round, but heartbeats may have lapsed
        # while it was down. Settle until a lapse would have been judged (5 missed
        # heartbeats and a rendezvous), then: did a new group form, and when did
        # training go on (in the new group if there was one)?
        settle = fault.ended + 10.0
        if time.time() < settle and not final:
            return False
        new = [s for s in progress.segments if fault.injected < s["t"] <= settle]
        if new and progress.first_step_of(new[-1]["seg"]) is None and not final:
            return False  # a group formed because of the outage and has not trained yet
        fault.restarted = bool(new)
        first = progress.first_step_of(new[-1]["seg"]) if new else next(
            (s for s in progress.steps if s["t"] > fault.injected), None)
        fault.recovered = first["t"] if first else None
        return True

    def next_fault(self) -> FaultRecord | None:
        config, index = self.config, len(self.faults)
        if config.faults:
            if index >= config.faults:
                return None
            nodes = len(self.alive_nodes())
            planned = self.planner.next(self.progress.step, nodes=nodes, min_nodes=config.min_nodes,
                                        max_nodes=config.capacity, etcd_members=config.etcd_members)
            if planned is None:
                return None
        else:
            if index >= len(config.schedule):
                return None
            planned = config.schedule[index]
        return FaultRecord(index, planned.kind, planned.at_step, expects_restart=planned.kind.restarts_workers)

    # --- the run ------------------------------------------------------------------------------

    def run(self) -> ChaosResult:
        config = self.config
        reference = None
        try:
            self.evidence_dir.mkdir()
            self._set_gate(0)  # hold the job until the first fault is planned
            self.etcd.start()
            reference = self.start_reference()
            for _ in range(config.nodes):
                self.start_node(join=False)
            self._loop(reference)
        finally:
            self._teardown()
        if reference is not None:
            try:
                reference.wait(timeout=max(60.0, config.deadline.total_seconds() / 2))
            except subprocess.TimeoutExpired:
                reference.kill()
                reference.wait()
        return self._finish(None if reference is None else reference.returncode)

    def _finish(self, reference_exit: int | None) -> ChaosResult:
        end = time.time()
        bounds: dict[str, float] = {}
        for fault in self.faults:
            if fault.injected is not None:
                bounds[fault.kind.value] = max(bounds.get(fault.kind.value, 0.0), self._bound(fault))
        verdict = judge(self.config, run_dir=self.run_dir, evidence_dir=self.evidence_dir, nodes=self.nodes,
                        faults=self.faults, bounds=bounds, aborted=self.aborted, reference_exit=reference_exit)
        report = build_report(
            self.config, verdict, run_id=self.run_id, run_dir=self.run_dir, script_args=self._args(self.run_dir),
            faults=self.faults, nodes={n.name: n.exit_code for n in self.nodes},
            killed=[n.name for n in self.nodes if n.killed is not None], aborted=self.aborted, start=self.start,
            end=end)
        return ChaosResult(self.run_dir, report, verdict.results)

    def _loop(self, reference: subprocess.Popen[bytes] | None) -> None:
        try:
            self._follow(reference)
        finally:
            self.progress.poll()
            for fault in self.faults:
                if fault.below_min:
                    fault.note = fault.note or "left fewer than min-nodes for good: the job was to give up"
                elif fault.injected is not None and fault.recovered is None and not fault.hung:
                    self.check_recovered(fault, final=True)
                    if fault.recovered is None:
                        fault.note = fault.note or "no training after it: the run ended first"

    def _set_gate(self, value: int) -> None:
        """Let the job start steps up to ``value`` (it only ever rises)."""
        if value <= self.gate:
            return
        self.gate = value
        tmp = self.gate_file.with_suffix(".tmp")
        tmp.write_text(str(value))
        os.replace(tmp, self.gate_file)

    def _follow(self, reference: subprocess.Popen[bytes] | None) -> None:
        """Inject the faults one after the other as the job progresses, until every node has exited.

        The gate holds the job after the step of the next fault; once the fault
        is injected the job may go a little further, always past its newest
        checkpoint, so that a restarted group can show that it trains.
        """
        pending: FaultRecord | None = None  # planned, not injected yet
        current: FaultRecord | None = None  # injected, not recovered yet
        planning = True
        reference_failed_at: float | None = None
        waiting_since: float | None = None
        config, progress = self.config, self.progress
        while True:
            now = time.time()
            for due, action in [a for a in self.actions if a[0] <= now]:
                self.actions.remove((due, action))
                action()
            progress.poll()
            if not self.alive_nodes() and not self.actions:
                return
            if now - self.start > config.deadline.total_seconds():
                self.aborted = f"deadline of {config.deadline.total_seconds():g}s reached"
                return
            failed = reference.poll() if reference is not None else None
            if failed not in (None, 0) and not progress.steps:
                # The job fails as one plain process too, and trains no step distributed either: its
                # nodes would be replaced until the deadline. (A job that only runs distributed
                # trains within the grace; it needs --no-reference for its final parameters.)
                reference_failed_at = reference_failed_at or now
                if now - reference_failed_at > _REFERENCE_GRACE_S:
                    self.aborted = (f"the reference run (the job as one plain process) exited {failed}, and the job "
                                    f"trained no step in {_REFERENCE_GRACE_S:g}s since: the job itself does not run "
                                    f"(see {self.run_dir / 'reference' / 'log.txt'})")
                    return
            if current is not None:
                if self.check_recovered(current):
                    logger.info("fault %d (%s) recovered in %.1fs", current.index, current.kind.value,
                                (current.recovered or now) - (current.injected or now))
                    current = None
                elif now - (current.injected or now) > self._bound(current):
                    current.hung = True
                    self.aborted = (f"fault {current.index} ({current.kind.value}): "
                                    + ("the survivors below min-nodes did not exit" if current.below_min
                                       else "no training") + f" within {self._bound(current):g}s")
                    return
                else:
                    # A new group must be able to train one step past where it starts: its
                    # checkpoint (restart; committed even when the save then failed, so
                    # restores count too), or in-process the step the survivors stopped at:
                    # the step in flight when the fault struck (a join lets it finish) until
                    # the new group formed, then the last step applied before it formed.
                    start = progress.newest_checkpoint()
                    if config.recovery == "in-process":
                        formed = [g for g in progress.segments if g["t"] > (current.injected or now)]
                        if formed:
                            applied = [s["step"] for s in progress.steps if s["t"] < formed[-1]["t"]]
                            start = max(start, max(applied, default=0))
                        else:
                            start = max(start, (current.step_before or 0) + 1)
                    self._set_gate(start + 1)
                    new = [g for g in progress.segments if g["t"] > (current.injected or now)]
                    if new and now - new[-1]["t"] > 10 and progress.first_step_of(new[-1]["seg"]) is None:
                        # Belt and braces: a group held at the gate cannot show that it trains.
                        self._set_gate(max(progress.step, progress.newest_checkpoint()) + 1)
            if current is None and pending is None and planning:
                pending = self.next_fault()
                if pending is None:
                    planning = False
                    self._set_gate(_OPEN)
                else:
                    self.faults.append(pending)
                    self._set_gate(pending.at_step)
            total = progress.total_steps()
            if pending is not None and total is not None and pending.at_step >= total:
                pending.note = f"not injected: the job ends at step {total}"
                pending, planning = None, False
                self._set_gate(_OPEN)
            if current is None and pending is not None and progress.step >= pending.at_step:
                if self.inject(pending):
                    current, pending, waiting_since = pending, None, None
                    if current.kind.etcd:
                        self._set_gate(progress.step + 3)  # training needs no etcd: let it go on
                    elif not current.expects_restart:
                        self._set_gate(progress.step + 1)
                else:
                    waiting_since = waiting_since or now
                    if now - waiting_since > 60:
                        pending.note = f"not injected: {pending.note or 'no target found'} within 60 s"
                        pending, waiting_since = None, None
            time.sleep(0.05)

    def _teardown(self) -> None:
        for pid in list(self.stopped):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
        for node in self.nodes:
            if node.alive():
                node.kill(fault=False)
        self.etcd.stop()
        if self.network:
            self.network.teardown()

def run_chaos(config: ChaosConfig) -> ChaosResult:
    """Run one chaos run end to end; see the module docstring.

    Raises:
        ConfigError: A bad configuration, or a non-empty ``run_dir``.
        EtcdServerError: etcd could not be started.
    """
    return _Harness(config).run()
