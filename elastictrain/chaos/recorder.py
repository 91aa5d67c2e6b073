"""Evidence a training job writes for the chaos invariants: which samples each committed step used.

The chaos harness cannot see inside a job, so the job writes down what it did,
and :mod:`elastictrain.chaos.invariants` checks it afterwards. Three lines in a
:class:`~elastictrain.train.session.Session` script turn it on::

    recorder = elastictrain.chaos.Recorder(model)
    with elastictrain.Session(model, optimizer, dataset, ..., hooks=[recorder],
                              extra_state={"chaos": recorder}) as session:
        for step in recorder.track(session):
            for micro in step:
                ...

Without ``ELASTICTRAIN_CHAOS_DIR`` in the environment (the harness sets it) the
recorder does nothing, so the script runs unchanged outside chaos runs.

What it writes under ``$ELASTICTRAIN_CHAOS_DIR``:

- ``steps/<segment>.r<rank>.jsonl``, every rank: one line per step it trained
  (``step``, ``epoch``, ``world``, ``idx``: the sample indices it consumed),
  written after the step's backward passes and before the optimizer step.
- ``workers.jsonl``, every rank: one line per worker process (segment, rank, pid, node).
- ``events.jsonl``, rank 0: ``segment`` (a new process group formed), ``config``,
  ``restored`` (step, path, producer segment, parameter fingerprint), ``step``
  (applied: step, loss), ``save_begin`` (step, fingerprint), ``saved``, ``end``,
  ``failure``.

The harness paces the job through a *gate* (``$ELASTICTRAIN_CHAOS_GATE``, a
file holding a step number): :meth:`Recorder.track` and :meth:`Recorder.steps`
do not start step ``n`` until the gate is at least ``n``. So a fault lands
exactly after the step it names, and a joining node has the time it needs,
however fast or loaded the machine. While held, rank 0 reads the gate and
broadcasts its decision every 0.2 s: the broadcast is a heartbeat, so a held
job notices a dead or hung peer as a training job would (the collective fails
or times out). Without the variable (outside the harness, or in its reference
run) the job runs freely and the recorder adds no collective.

A *segment* is one process group's life: the workers of one rendezvous round.
Its id is drawn by rank 0 and broadcast, so all ranks of a round share it.
The recorder is also checkpointed (``extra_state``): its state is the
*lineage*, the chain of ``(segment, restored step)`` that led to the current
state. The lineage saved in the final checkpoint names exactly the segments
whose steps are part of the committed history; steps that ran but were lost
with an uncommitted checkpoint belong to no link of it.

Every line is one ``write()`` on a file opened with ``O_APPEND``, so a worker
killed at any moment leaves whole lines behind.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
import uuid
from collections.abc import Iterable, Iterator
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from elastictrain.train.hooks import Hooks

__all__ = ["CHAOS_DIR_ENV", "FINAL_PARAMETERS", "GATE_ENV", "MARKER", "Recorder", "fingerprint", "is_sharded"]

CHAOS_DIR_ENV = "ELASTICTRAIN_CHAOS_DIR"
"""Where the recorder writes; set by the chaos harness for every node and worker."""

GATE_ENV = "ELASTICTRAIN_CHAOS_GATE"
"""File holding the highest step the job may start (see :meth:`Recorder.steps`); set by the harness."""

MARKER = "elastictrain_chaos_lineage"
"""Key of the recorder's checkpointed state, so a checker can find it among the extras."""

FINAL_PARAMETERS = "final_parameters.pt"
"""The job's final full parameters (:meth:`Recorder.final_parameters`), in the evidence directory."""

_NODE_ENV = "ELASTICTRAIN_NODE_NAME"


def fingerprint(module: torch.nn.Module) -> str:
    """sha256 over the bytes of ``module``'s state dict, in key order: equal states, equal prints.

    A sharded module's DTensors count by their full tensors, so that a model prints the same
    sharded (FSDP2, at any world size) as whole: then it is a collective, which every rank of
    the mesh calls (see :func:`is_sharded`).
    """
    digest = hashlib.sha256()
    for name, value in module.state_dict().items():
        digest.update(name.encode())
        if isinstance(value, DTensor):
            value = value.full_tensor()
        if isinstance(value, torch.Tensor):
            digest.update(value.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()[:32]


def is_sharded(module: torch.nn.Module) -> bool:
    """Whether ``module`` holds DTensor parameters (FSDP2, HSDP): its :func:`fingerprint` is a collective."""
    return any(isinstance(p, DTensor) for p in module.parameters())


_GATE_WAIT = timedelta(days=1)
"""How long the harness may hold a step at its gate (the run's deadline ends it long before)."""


def _gate_allows(path: str, number: int) -> bool:
    try:
        with open(path) as f:
            return number <= int(f.read().strip())
    except (OSError, ValueError):
        return True  # no gate file: run freely (it is replaced atomically, never torn)


class _Lines:
    """Appends JSON lines to one file, each with a single ``write()``."""

    def __init__(self, path: str) -> None:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        self._fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)

    def write(self, **record: Any) -> None:
        os.write(self._fd, (json.dumps(record, separators=(",", ":")) + "\n").encode())


class Recorder(Hooks):
    """Session hooks plus a checkpointed lineage: the evidence of a chaos run.

    Pass it both as a hook and as ``extra_state`` (any name), and iterate the
    session's steps through :meth:`track`. Disabled (every method a no-op)
    unless ``directory`` or ``$ELASTICTRAIN_CHAOS_DIR`` is set.

    Args:
        model: The unwrapped model; its fingerprint is recorded at each save and restore. Once
            :meth:`steps` (or :meth:`track`) has the session, the session's current module is
            fingerprinted instead (:attr:`module`): a sharded session re-formed in place trains a
            module rebuilt from the first, and the first, sharded over a mesh that is gone, is no
            longer the model.
        directory: Evidence directory; default ``$ELASTICTRAIN_CHAOS_DIR``.
    """

    def __init__(self, model: torch.nn.Module, directory: str | None = None) -> None:
        self.model = model
        self._session: Any = None
        self.directory = directory or os.environ.get(CHAOS_DIR_ENV) or None
        self.segment: str | None = None
        self.rank = 0
        self.world_size = 1
        self._lineage: list[dict[str, Any]] = []
        self._continued: list[dict[str, Any]] = []
        self._linked = False
        self._events: _Lines | None = None
        self._steps: _Lines | None = None
        self._config_written = False

    @property
    def enabled(self) -> bool:
        """True when evidence is written."""
        return self.directory is not None

    # --- checkpointed state --------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """The lineage: ``[{"seg": id, "base": restored step}, ...]``, oldest first."""
        # Between a survivor's re-rendezvous and its recovery its new segment is not linked
        # yet: the state it sends to new workers carries the lineage it continues.
        lineage = self._continued if self._continued and not self._linked else self._lineage
        return {MARKER: 1, "lineage": [dict(link) for link in lineage]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Take the restored checkpoint's lineage; :meth:`on_restore` then appends this segment."""
        self._lineage = [dict(link) for link in state.get("lineage", [])]

    # --- hooks ---------------------------------------------------------------------------------

    def on_rendezvous(self, *, rank: int, world_size: int, restart_count: int) -> None:
        """See base class."""
        if not self.enabled:
            return
        self.rank, self.world_size = rank, world_size
        ident = [uuid.uuid4().hex[:12]]
        if dist.is_available() and dist.is_initialized() and world_size > 1:
            # One id per process group: the ranks of a round must agree on it.
            dist.broadcast_object_list(ident, src=0)
        self.segment = ident[0]
        # A restore (restart) or a recovery (in-process) then links this segment to the
        # lineage it continues; a fresh start keeps this one link.
        self._continued = [dict(link) for link in self._lineage]
        self._lineage = [{"seg": self.segment, "base": 0}]
        self._linked = False
        assert self.directory is not None  # noqa: S101 - enabled
        self._steps = _Lines(os.path.join(self.directory, "steps", f"{self.segment}.r{rank}.jsonl"))
        _Lines(os.path.join(self.directory, "workers.jsonl")).write(
            seg=self.segment, rank=rank, world=world_size, pid=os.getpid(), node=os.environ.get(_NODE_ENV),
            restart=restart_count, t=time.time())
        # The run's events are rank 0's: a worker that was rank 0 of an earlier group is not now.
        self._events = _Lines(os.path.join(self.directory, "events.jsonl")) if rank == 0 else None
        self._emit("segment", world=world_size, restart=restart_count, pid=os.getpid(),
                   node=os.environ.get(_NODE_ENV))

    def on_restore(self, *, step: int, path: str) -> None:
        """See base class."""
        if not self.enabled or self.segment is None:
            return
        # load_state_dict ran just before: the lineage is the checkpoint's; its last link made it.
        producer = self._lineage[-1]["seg"] if self._lineage else None
        self._lineage.append({"seg": self.segment, "base": step})
        self._linked = True
        self._emit("restored", step=step, path=path, producer=producer, fp=self._fingerprint())

    def on_recovery(self, *, step: int, cause: str, generation: int, world_size: int, seconds: float) -> None:
        """See base class. The group re-formed in place: this segment continues the lineage
        the state carries (a survivor's own, or the one a new worker received) from ``step``."""
        if not self.enabled or self.segment is None:
            return
        previous = self._continued if self._continued else []
        if self._lineage and self._lineage[0]["seg"] != self.segment:  # received with the state just now
            previous = self._lineage
        self._lineage = [*previous, {"seg": self.segment, "base": step}]
        self._linked = True
        # No collective here: the ranks that restored the checkpoint in place, not from a peer,
        # hear of no recovery (a new worker among them), so a sharded model is not fingerprinted.
        self._emit("recovered", step=step, cause=cause[:300], generation=generation, world=world_size,
                   seconds=round(seconds, 4), fp=None if is_sharded(self.module) else self._fingerprint())

    def before_save(self, *, step: int) -> None:
        """See base class."""
        self._emit("save_begin", step=step, fp=self._fingerprint())

    def after_save(self, *, step: int, directory: str, seconds: float) -> None:
        """See base class."""
        self._emit("saved", step=step, dir=directory, seconds=round(seconds, 4))

    def on_step_end(self, *, step: int, loss: float, throughput: float) -> None:
        """See base class."""
        self._emit("step", step=step, loss=loss)

    def on_end(self, *, step: int) -> None:
        """See base class."""
        self._emit("end", step=step, fp=self._fingerprint())

    def on_failure(self, *, error: BaseException) -> None:
        """See base class."""
        self._emit("failure", error=f"{type(error).__name__}: {error}"[:500])

    # --- steps ---------------------------------------------------------------------------------

    def track(self, session: Any) -> Iterator[Any]:
        """``session.steps()``, recording the samples of each step once its backward passes ran.

        Each step waits for the harness's gate first (see the module docstring).
        Records the indices of the step's plan; call :meth:`record` yourself
        instead to record the indices your batches actually carried.
        """
        for step in self.steps(session):
            yield step
            self.record(step)

    @property
    def module(self) -> torch.nn.Module:
        """The model the recorder fingerprints: the session's current module once :meth:`steps`
        has the session (``session.module``), before that the model it was given."""
        return self._session.module if self._session is not None else self.model

    def steps(self, session: Any) -> Iterator[Any]:
        """Like :meth:`track`, without recording: for scripts that call :meth:`record` themselves."""
        self._session = session
        self._write_config(session)
        for step in session.steps():
            self._wait_for_gate(step.number, session)
            yield step

    def _wait_for_gate(self, number: int, session: Any) -> None:
        path = os.environ.get(GATE_ENV)
        if not self.enabled or not path:
            return
        if getattr(session, "recovers_in_process", False):
            # Every rank reads the gate itself (the harness runs every node here). No
            # collective: a dead or hung peer is the agents' to notice, and a re-formation
            # they start must not wait for the gate, so it ends the wait; the step then
            # fails against the dead peer (and is discarded) or carries the flag. The wait is
            # inside the step, where a rank that takes too long is taken for hung: it is a
            # long call of the script's own (the harness holds the job), so it says so.
            if _gate_allows(path, number):
                return
            with session.long_call(_GATE_WAIT):
                while not _gate_allows(path, number):
                    if session.reform_due():
                        return
                    time.sleep(0.05)
            return
        distributed = dist.is_available() and dist.is_initialized() and self.world_size > 1
        if distributed:
            # On the model's device: NCCL broadcasts only device tensors.
            device = next(iter(self.module.parameters()), torch.zeros(())).device
            flag = torch.zeros(1, dtype=torch.int32, device=device)
        while True:
            go = self.rank != 0 or _gate_allows(path, number)
            if distributed:
                # Every rank takes part in each broadcast: rank 0's decision, and a
                # heartbeat that fails (or times out) when a peer is dead (or hung).
                flag.fill_(int(go))
                dist.broadcast(flag, src=0)
                go = bool(flag.item())
            if go:
                return
            time.sleep(0.2)

    def record(self, step: Any, indices: Iterable[int] | None = None) -> None:
        """Write this rank's sample indices for ``step`` (a :class:`~elastictrain.train.session.Step`).

        Args:
            step: The step just trained (backward done, not yet applied).
            indices: The dataset indices this rank trained on in it, padding
                excluded; default: those of ``step.plan``.
        """
        if self._steps is None or getattr(step, "discarded", False):
            return  # a discarded step (its collective failed) runs again and is recorded then
        if indices is None:
            indices = [i for micro in step.plan.micro_batches for i in micro.indices]
        self._steps.write(seg=self.segment, rank=self.rank, world=self.world_size, step=step.number,
                          epoch=step.epoch, idx=[int(i) for i in indices], t=time.time())

    def _write_config(self, session: Any) -> None:
        if self._config_written or self.rank != 0 or not self.enabled:
            return
        self._config_written = True
        config, sampler = session.config, session.sampler
        self._emit("config", num_samples=sampler.num_samples, global_batch=config.global_batch_size,
                   drop_last=config.drop_last, epochs=config.epochs, max_steps=config.max_steps,
                   checkpoint_every=config.checkpoint_every)

    def final_parameters(self, weights: dict[str, Any]) -> None:
        """Write the job's final full parameters (rank 0's ``session.full_state_dict()``, gathered
        by every rank) as :data:`FINAL_PARAMETERS`, for the final-parameters invariant: what the
        job trained, besides what its last checkpoint holds. Other ranks' (empty) dicts are ignored."""
        if not self.enabled or self.rank != 0 or not weights:
            return
        assert self.directory is not None  # noqa: S101 - enabled
        tensors = {name: value.detach().cpu() for name, value in weights.items() if isinstance(value, torch.Tensor)}
        path = os.path.join(self.directory, FINAL_PARAMETERS)
        torch.save(tensors, path + ".partial")
        os.replace(path + ".partial", path)

    def _fingerprint(self) -> str | None:
        """Rank 0's :func:`fingerprint` of the model (None elsewhere); every rank takes part when
        the model is sharded (the hooks that call it run on every rank at the same point)."""
        module = self.module
        if not self.enabled or (self.rank != 0 and not is_sharded(module)):
            return None
        value = fingerprint(module)
        return value if self.rank == 0 else None

    def _emit(self, kind: str, **fields: Any) -> None:
        if self._events is not None:
            self._events.write(kind=kind, seg=self.segment, t=time.time(), **fields)
