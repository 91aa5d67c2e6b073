"""The chaos harness: run a job on several local node agents, inject faults, check invariants, report.

:func:`run_chaos` starts an etcd (1 or 3 members) and ``nodes`` separate
``elastictrain run --etcd ... --run-id ...`` agents on this machine, then
follows the job's progress through the evidence its
:class:`~elastictrain.chaos.Recorder` writes, and injects each fault
(:mod:`~elastictrain.chaos.faults`: a class per kind) once the job has applied
the fault's step and recovered from the previous fault. A gate file paces the
job (see :mod:`~elastictrain.chaos.recorder`): it holds the job after the next
fault's step until the fault is injected, so faults land where the schedule
says on any machine. When every node has exited it judges the
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
from elastictrain.chaos.faults import Fault, fault_for
from elastictrain.chaos.netns import NS_PEER_INTERFACE, NodeNetwork, mount_small_disk, unmount_small_disk
from elastictrain.chaos.recorder import CHAOS_DIR_ENV, GATE_ENV
from elastictrain.chaos.report import build_report
from elastictrain.chaos.schedule import FaultRecord, RandomPlanner
from elastictrain.chaos.verdict import judge
from elastictrain.checkpoint.storage import storage_for
from elastictrain.launch.config import check_writable_dir
from elastictrain.train.injector import INJECT_FILE_ENV, INJECT_STATE_ENV
from elastictrain.errors import ConfigError
from elastictrain.events import LineTail

logger = logging.getLogger(__name__)

__all__ = ["DEFAULT_KINDS", "ChaosConfig", "ChaosResult", "run_chaos"]

_OPEN = 2**62  # a gate that holds nothing
_FOLLOWED = ("spare", "straggler", "checkpoint_abandoned", "checkpoint_commit")
"""The kinds of events of the run's event log that the harness follows."""

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


class Harness:
    """One chaos run: its etcd, its nodes, the job's progress and its faults; see the module docstring."""

    def __init__(self, config: ChaosConfig) -> None:
        self.config = config
        self.run_dir = Path(config.run_dir).resolve()
        if self.run_dir.exists() and any(self.run_dir.iterdir()):
            raise ConfigError(f"run directory {self.run_dir} is not empty")
        check_writable_dir(str(self.run_dir), "--run-dir")
        if config.checkpoint_dir:
            _check_location_empty(config.checkpoint_dir)
        (self.run_dir / "nodes").mkdir()
        self.checkpoint_dir = self.run_dir / "ckpt"
        """Where the job is to keep its checkpoints (``--ckpt {run_dir}/ckpt``) unless ``checkpoint_dir``
        names an object store: on a tmpfs of its own with ``checkpoint_disk_mb`` (faults that fill it
        need one)."""
        self._disk_mounted = False
        self.evidence_dir = self.run_dir / "evidence"
        self.gate_file = self.run_dir / "gate"
        self.run_id = f"chaos-{uuid.uuid4().hex[:8]}"
        self.progress = _Progress(self.evidence_dir / "events.jsonl")
        self._agent_events = LineTail(self.run_dir / "events.jsonl")
        self._events_seen: dict[str, list[dict[str, Any]]] = defaultdict(list)  # by kind, as read so far
        self.inject_file = self.run_dir / "inject"
        (self.run_dir / "inject-state").mkdir()
        self._in_loop: list[str] = []
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
        self.faults: list[Fault] = []
        self.actions: list[tuple[float, Callable[[], None]]] = []
        self.stopped: dict[int, float] = {}  # pid -> when SIGSTOPped, until resumed
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
        env[INJECT_FILE_ENV] = str(self.inject_file)
        env[INJECT_STATE_ENV] = str(self.run_dir / "inject-state")
        env["ELASTICTRAIN_PG_TIMEOUT"] = f"{self.config.pg_timeout.total_seconds():g}"
        env.update(self.config.env)
        return env

    def _args(self, run_dir: Path, checkpoint_dir: str) -> list[str]:
        return [a.replace("{checkpoint_dir}", checkpoint_dir).replace("{run_dir}", str(run_dir))
                for a in self.config.script_args]

    @property
    def job_checkpoint_dir(self) -> str:
        """What the job's ``{checkpoint_dir}`` argument names: ``checkpoint_dir``, else ``{run_dir}/ckpt``."""
        return self.config.checkpoint_dir or str(self.checkpoint_dir)

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
            *(["--join"] if join else []), *config.run_args, config.script,
            *self._args(self.run_dir, self.job_checkpoint_dir),
        ]
        env = {**self._env(self.evidence_dir), GATE_ENV: str(self.gate_file)}
        if self.network:
            command = self.network.wrap(index, command)
            env["GLOO_SOCKET_IFNAME"] = NS_PEER_INTERFACE  # else gloo binds to the address the hostname resolves to
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
            return subprocess.Popen(dying_with_us([sys.executable, self.config.script,
                                                     *self._args(ref, self._reference_checkpoint_dir(ref))]), env=env,
                                    cwd=ref, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)

    def _reference_checkpoint_dir(self, ref: Path) -> str:
        if self.config.checkpoint_dir:
            return f"{self.config.checkpoint_dir.rstrip('/')}/reference"
        return str(ref / "ckpt")

    def alive_nodes(self) -> list[Node]:
        return [n for n in self.nodes if n.alive()]

    # --- faults -------------------------------------------------------------------------------

    def later(self, delay: timedelta, action: Callable[[], None]) -> tuple[float, Callable[[], None]]:
        """Run ``action`` ``delay`` from now, from the run's loop; the handle :meth:`cancel` takes."""
        entry = (time.time() + delay.total_seconds(), action)
        self.actions.append(entry)
        return entry

    def cancel(self, entry: tuple[float, Callable[[], None]]) -> None:
        """Drop an action :meth:`later` had planned, unless it has run."""
        with contextlib.suppress(ValueError):
            self.actions.remove(entry)

    def nodes_by_segment(self) -> dict[int, set[str]]:
        """Names of the nodes with a worker in each process group (from the job's evidence)."""
        nodes: dict[int, set[str]] = defaultdict(set)
        for worker in inv.read_lines(self.evidence_dir / "workers.jsonl"):
            nodes[worker["seg"]].add(worker["node"])
        return nodes

    def training_nodes(self) -> set[str]:
        """Names of the nodes with a worker in the newest process group."""
        if not self.progress.segments:
            return set()
        return self.nodes_by_segment().get(self.progress.segments[-1]["seg"], set())

    def agent_events(self, kind: str) -> list[dict[str, Any]]:
        """The run's events of ``kind`` so far (one of :data:`_FOLLOWED`: the agents' and the
        workers' event log is read on from where the last call stopped)."""
        with contextlib.suppress(FileNotFoundError):
            for line in self._agent_events.new_lines():
                if not any(f'"{followed}"'.encode() in line for followed in _FOLLOWED):
                    continue
                try:
                    event = json.loads(line)
                except ValueError:
                    continue
                if event.get("kind") in _FOLLOWED:
                    self._events_seen[event["kind"]].append(event)
        return self._events_seen[kind]

    def said_spare(self, since: float = 0.0) -> set[str]:
        """Names of the nodes that said they wait as hot spares (the agents' ``spare`` event), since ``since``."""
        return {e["node"] for e in self.agent_events("spare") if e.get("ts", 0.0) > since}

    def set_gate(self, value: int) -> None:
        """Let the job start steps up to ``value`` (it only ever rises)."""
        if value <= self.gate:
            return
        self.gate = value
        tmp = self.gate_file.with_suffix(".tmp")
        tmp.write_text(str(value))
        os.replace(tmp, self.gate_file)

    def place_in_loop(self, spec: str) -> None:
        """Add a fault for the workers' injector to meet in their training loop
        (:mod:`~elastictrain.train.injector`): the injection file is rewritten whole, atomically."""
        self._in_loop.append(spec)
        tmp = self.inject_file.with_suffix(".tmp")
        tmp.write_text("".join(f"{line}\n" for line in self._in_loop))
        os.replace(tmp, self.inject_file)

    def spares(self) -> list[Node]:
        """Live nodes that wait as hot spares now: they said so and have no worker in the newest group."""
        said, training = self.said_spare(), self.training_nodes()
        return [n for n in self.alive_nodes() if n.name in said and n.name not in training]

    def node_settled(self, name: str) -> bool:
        """Whether a node added to a full round waits as a spare (it said so) or trains, or has exited."""
        node = next(n for n in self.nodes if n.name == name)
        return not node.alive() or name in self.said_spare() or name in self.training_nodes()

    def inject(self, fault: Fault) -> bool:
        """Inject ``fault`` now; False if its target is not there yet (try again shortly)."""
        now, record = time.time(), fault.record
        record.spare_waiting = bool(self.spares())
        if not fault.inject(now):
            return False
        record.injected = now
        record.step_before = self.progress.step
        logger.info("fault %d: %s at step %d -> %s", record.index, record.kind.value, self.progress.step,
                    record.target)
        return True

    def next_fault(self) -> Fault | None:
        """The next fault: the schedule's, or one the planner draws now; None once there is none."""
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
        record = FaultRecord(index, planned.kind, planned.at_step,
                             expects_restart=planned.kind.fault_class.restarts_workers)
        return fault_for(record, self)

    # --- the run ------------------------------------------------------------------------------

    def run(self) -> ChaosResult:
        try:
            return self._run()
        finally:
            if self._disk_mounted:  # after the verdict, which reads the checkpoints there
                unmount_small_disk(self.checkpoint_dir)
                self._disk_mounted = False

    def _run(self) -> ChaosResult:
        config = self.config
        reference = None
        try:
            if config.checkpoint_disk_mb:
                self.checkpoint_dir.mkdir()
                mount_small_disk(self.checkpoint_dir, config.checkpoint_disk_mb)
                self._disk_mounted = True
            self.evidence_dir.mkdir()
            self.set_gate(0)  # hold the job until the first fault is planned
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
            if fault.record.injected is not None:
                bounds[fault.kind.value] = max(bounds.get(fault.kind.value, 0.0), fault.bound())
        records = [f.record for f in self.faults]
        verdict = judge(self.config, run_dir=self.run_dir, evidence_dir=self.evidence_dir, nodes=self.nodes,
                        faults=records, bounds=bounds, aborted=self.aborted, reference_exit=reference_exit)
        report = build_report(
            self.config, verdict, run_id=self.run_id, run_dir=self.run_dir,
            script_args=self._args(self.run_dir, self.job_checkpoint_dir),
            faults=records, nodes={n.name: n.exit_code for n in self.nodes},
            killed=[n.name for n in self.nodes if n.killed is not None], aborted=self.aborted, start=self.start,
            end=end)
        return ChaosResult(self.run_dir, report, verdict.results)

    def _loop(self, reference: subprocess.Popen[bytes] | None) -> None:
        try:
            self._follow(reference)
        finally:
            self.progress.poll()
            for fault in self.faults:
                record = fault.record
                if record.below_min:
                    record.note = record.note or "left fewer than min-nodes for good: the job was to give up"
                elif record.injected is not None and record.recovered is None and not record.hung:
                    fault.recovered(final=True)
                    if record.recovered is None:
                        record.note = record.note or "no training after it: the run ended first"

    def _follow(self, reference: subprocess.Popen[bytes] | None) -> None:
        """Inject the faults one after the other as the job progresses, until every node has exited.

        The gate holds the job after the step of the next fault; once the fault
        is injected the job may go a little further, always past its newest
        checkpoint, so that a restarted group can show that it trains.
        """
        pending: Fault | None = None  # planned, not injected yet
        current: Fault | None = None  # injected, not recovered yet
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
                if self._watch(current, now):
                    current = None
                elif self.aborted:
                    return
            if current is None and pending is None and planning:
                pending = self.next_fault()
                if pending is None:
                    planning = False
                    self.set_gate(_OPEN)
                else:
                    self.faults.append(pending)
                    self.set_gate(pending.record.at_step)
            total = progress.total_steps()
            if pending is not None and total is not None and pending.record.at_step >= total:
                pending.record.note = f"not injected: the job ends at step {total}"
                pending, planning = None, False
                self.set_gate(_OPEN)
            if current is None and pending is not None and progress.step >= pending.record.at_step:
                if self.inject(pending):
                    current, pending, waiting_since = pending, None, None
                    if current.of_etcd:
                        self.set_gate(progress.step + 3)  # training needs no etcd: let it go on
                    elif not current.record.expects_restart:
                        self.set_gate(progress.step + 1)
                else:
                    waiting_since = waiting_since or now
                    if now - waiting_since > 60:
                        pending.record.note = f"not injected: {pending.record.note or 'no target found'} within 60 s"
                        pending, waiting_since = None, None
            time.sleep(0.05)

    def _watch(self, fault: Fault, now: float) -> bool:
        """Whether the job has recovered from ``fault``, an injected fault. Until it has, the gate lets
        the job train past where its new group starts; after the fault's bound the run is aborted."""
        record = fault.record
        injected = record.injected if record.injected is not None else now
        if fault.recovered():
            logger.info("fault %d (%s) recovered in %.1fs", record.index, record.kind.value,
                        (record.recovered or now) - injected)
            return True
        if now - injected > fault.bound():
            record.hung = True
            self.aborted = (f"fault {record.index} ({record.kind.value}): "
                            + ("the survivors below min-nodes did not exit" if record.below_min else "no training")
                            + f" within {fault.bound():g}s")
            return False
        # A new group must be able to train one step past where it starts: its checkpoint (restart;
        # committed even when the save then failed, so restores count too), or in-process the step
        # the survivors stopped at: the step in flight when the fault struck (a join lets it finish)
        # until the new group formed, then the last step applied before it formed.
        progress = self.progress
        start = progress.newest_checkpoint()
        formed = [g for g in progress.segments if g["t"] > injected]
        if self.config.recovery == "in-process":
            if formed:
                applied = [s["step"] for s in progress.steps if s["t"] < formed[-1]["t"]]
                start = max(start, max(applied, default=0))
            else:
                start = max(start, (record.step_before or 0) + 1)
        self.set_gate(start + 1)
        if formed and now - formed[-1]["t"] > 10 and progress.first_step_of(formed[-1]["seg"]) is None:
            # Belt and braces: a group held at the gate cannot show that it trains.
            self.set_gate(max(progress.step, progress.newest_checkpoint()) + 1)
        return False

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
        ConfigError: A bad configuration, a non-empty ``run_dir``, or a ``checkpoint_dir`` that
            holds anything or cannot be read.
        EtcdServerError: etcd could not be started.
    """
    return Harness(config).run()


def _check_location_empty(location: str) -> None:
    """Refuse a checkpoint location that holds anything: the job would restore a checkpoint of
    another run, and the invariants would judge it.

    Raises:
        ConfigError: It holds objects, or cannot be read (a missing bucket, no access).
    """
    try:
        storage, prefix = storage_for(location)
        names = storage.list_dir(prefix)
    except FileNotFoundError:
        return
    except (OSError, ValueError, ImportError) as exc:
        raise ConfigError(f"checkpoint location {location}: {exc}") from exc
    raise ConfigError(f"checkpoint location {location} is not empty (it holds {', '.join(names[:3])}"
                      f"{', ...' if len(names) > 3 else ''}): give each chaos run a prefix of its own")
