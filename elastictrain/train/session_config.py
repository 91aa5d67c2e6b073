"""How a :class:`~elastictrain.train.session.Session` trains: :class:`SessionConfig`, checked once."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from elastictrain.train import process_group as pg
from elastictrain._control import RECOVERY_MODES
from elastictrain._durations import parse_duration
from elastictrain.errors import ConfigError
from elastictrain.train.hang_bounds import HangBounds
from elastictrain.train.precision import PRECISIONS
from elastictrain.train.strategy import SHARDINGS

if TYPE_CHECKING:
    import torch

    from elastictrain.train.fsdp.units import UnitSpec

__all__ = ["SessionConfig"]


def _positive(name: str, value: Any, *, allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"{name} must be a positive int{' or None' if allow_none else ''}, got {value!r}")


@dataclass(frozen=True, kw_only=True, slots=True)
class SessionConfig:
    """How a :class:`Session` trains. Every field can also be passed to ``Session(...)`` directly."""

    global_batch_size: int
    """Samples per optimizer step over all ranks; constant when the world size changes."""

    micro_batch_size: int | None = None
    """Most samples per forward pass on a rank; the rest is gradient accumulation.
    None: one micro-batch per rank per step (its share of the global batch)."""

    epochs: int = 1
    """Epochs to train; a restart continues the epoch it was in."""

    max_steps: int | None = None
    """Stop after this many optimizer steps in total (across restarts), even mid-epoch."""

    seed: int = 0
    """Seeds the data order, each rank's RNGs on a fresh start, and DataLoader workers."""

    shuffle: bool = True
    """Shuffle the dataset each epoch (a permutation drawn from ``seed`` and the epoch)."""

    drop_last: bool = False
    """Skip an epoch's last ``len % global_batch_size`` samples instead of a short last step."""

    checkpoint_dir: str | None = None
    """Where checkpoints go, on storage every node shares: a directory (a shared filesystem) or
    ``s3://bucket/prefix`` (S3 or a compatible store; the ``[s3]`` extra). None: no checkpoints
    (a restart starts over)."""

    checkpoint_every: int | None = None
    """Save after every this many optimizer steps; None: only at the end.
    A failure loses at most this many steps."""

    keep_last: int = 3
    """Committed checkpoints to keep."""

    async_save: bool = False
    """Write checkpoints on a background thread; training waits only for the copy to CPU memory."""

    overlap_save: bool = False
    """With ``async_save``: make that copy in the background too, while the next step computes; its
    optimizer step waits for the copy if it is not done. Training code must then not change
    parameters or buffers in place outside the optimizer and the model's forward (see
    ``CheckpointManager(overlap=True)``; ``session.checkpoints.wait_snapshot()`` makes it safe)."""

    checkpoint_timeout: timedelta = timedelta(minutes=5)
    """How long a checkpoint save's storage call may go without progress (each 64 MiB written
    counts) before the save is abandoned as failed (a hung NFS server; seconds are accepted).
    Training goes on meanwhile under ``async_save``; saves due while a call still blocks are
    skipped, and said so."""

    precision: str = "auto"
    """``"auto"`` (bf16 or fp16 on GPU, fp32 on CPU), ``"fp32"``, ``"bf16"`` or ``"fp16"`` (with a GradScaler)."""

    grad_clip_norm: float | None = None
    """Clip the total gradient 2-norm to this (after unscaling); None: no clipping."""

    num_workers: int = 0
    """DataLoader worker processes per rank."""

    pin_memory: bool | None = None
    """DataLoader ``pin_memory``; None: on when training on CUDA."""

    backend: str | None = None
    """Process-group backend; None: ``ELASTICTRAIN_BACKEND``, else NCCL on GPU, gloo on CPU."""

    timeout: timedelta | None = None
    """Collective timeout (seconds are accepted); None: ``ELASTICTRAIN_PG_TIMEOUT``, else 60 s."""

    device: str | None = None
    """Overrides the device (default: this local rank's GPU, else the CPU)."""

    sync_loss: bool = False
    """All-reduce each step's loss so hooks and logs see the global-batch mean (one small
    collective per step); otherwise they see this rank's mean."""

    log_every: int | None = 10
    """Log loss and throughput on rank 0 every this many steps; None: never."""

    sharding: str = "ddp"
    """How the model trains over the group: ``"ddp"`` (every rank holds the whole model and
    optimizer; DistributedDataParallel); ``"fsdp"`` (FSDP2: each rank holds a shard of everything)
    or ``"hsdp"`` (sharded within a node, replicated across nodes): see ``docs/sharding.md``."""

    redundancy_every: int | None = None
    """``sharding="fsdp"``: each rank keeps a copy of a buddy's shards (parameters and optimizer
    state; the buddy on another node) in host memory, refreshed in the background after every
    this many steps; None: no copies. See ``docs/sharding.md``."""

    shard_units: UnitSpec | None = None
    """``sharding="fsdp"`` or ``"hsdp"``: which submodules are FSDP units (each gathered whole for its
    forward and backward only). None: each direct child that holds parameters, then the root. For
    transformers, the block class or a collection of classes (``{TransformerBlock}``: one unit per
    block, as torchtitan wraps them) or a predicate ``(fqn, module) -> bool``; then the root. A
    shared (tied) parameter is never split across units: it stays with a unit that holds every
    module sharing it (the root at the latest). See ``docs/sharding.md``."""

    init_weights: Callable[[torch.nn.Module], object] | None = None
    """``sharding="fsdp"`` or ``"hsdp"`` with a model built on the meta device (no storage, as for a
    model that does not fit one device: ``with torch.device("meta"): model = Net()``): a
    ``Module.apply`` function that sets a module's own parameters and buffers
    (``lambda m: m.reset_parameters() if hasattr(m, "reset_parameters") else None``). On a fresh
    start (no checkpoint, no live peer) the session applies it unit by unit, no rank holding the
    whole model, with torch's RNG seeded from ``seed``: the values equal ``torch.manual_seed(seed);
    model.apply(init_weights)`` on the full model. See ``docs/sharding.md``."""

    ddp_kwargs: Mapping[str, Any] = field(default_factory=dict)
    """Extra keyword arguments of ``DistributedDataParallel`` (e.g. ``find_unused_parameters``)."""

    recovery: str = "in-process"
    """``"in-process"``: under ``elastictrain run``, survive faults and membership changes in this
    process (the group re-forms in place, state comes from live peers); ``"restart"``: leave
    that to the agent, which restarts the workers from the last checkpoint. Without an
    in-process agent (torchrun, ``--recovery restart``) the session restarts either way."""

    recovery_timeout: timedelta = timedelta(seconds=600)
    """How long a recovering worker waits for its agent's next assignment."""

    hang_bounds: HangBounds = field(default_factory=HangBounds)
    """Under in-process recovery, how long a rank may take to reach a step's collective (or to
    save) before its agent takes it for hung, captures its stacks and replaces it (see
    :class:`~elastictrain.train.hang_bounds.HangBounds`; ``Session.long_call`` widens it)."""

    def next_save(self, step: int) -> int | None:
        """The step of the periodic save after ``step``, or None when the next is the run's last save."""
        every = self.checkpoint_every
        due = None if every is None else (step // every + 1) * every
        return None if due is None or (self.max_steps is not None and due >= self.max_steps) else due

    def __post_init__(self) -> None:
        _positive("global_batch_size", self.global_batch_size)
        _positive("micro_batch_size", self.micro_batch_size, allow_none=True)
        _positive("epochs", self.epochs)
        _positive("max_steps", self.max_steps, allow_none=True)
        _positive("checkpoint_every", self.checkpoint_every, allow_none=True)
        _positive("keep_last", self.keep_last)
        _positive("log_every", self.log_every, allow_none=True)
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or not 0 <= self.seed < 2**64:
            raise ConfigError(f"seed must be an int in [0, 2**64), got {self.seed!r}")
        if isinstance(self.num_workers, bool) or not isinstance(self.num_workers, int) or self.num_workers < 0:
            raise ConfigError(f"num_workers must be a non-negative int, got {self.num_workers!r}")
        if self.precision not in PRECISIONS:
            raise ConfigError(f"precision must be one of {PRECISIONS}, got {self.precision!r}")
        if self.grad_clip_norm is not None and not (isinstance(self.grad_clip_norm, (int, float))
                                                    and not isinstance(self.grad_clip_norm, bool)
                                                    and self.grad_clip_norm > 0):
            raise ConfigError(f"grad_clip_norm must be a positive number or None, got {self.grad_clip_norm!r}")
        if self.checkpoint_every is not None and self.checkpoint_dir is None:
            raise ConfigError("checkpoint_every needs a checkpoint_dir")
        if self.overlap_save and not self.async_save:
            raise ConfigError("overlap_save needs async_save=True")
        if self.timeout is not None:
            object.__setattr__(self, "timeout", pg.resolve_timeout(self.timeout))
        if not isinstance(self.ddp_kwargs, Mapping):
            raise ConfigError(f"ddp_kwargs must be a mapping, got {type(self.ddp_kwargs).__name__}")
        if not isinstance(self.hang_bounds, HangBounds):
            raise ConfigError(f"hang_bounds must be a HangBounds, got {type(self.hang_bounds).__name__}")
        if self.sharding not in SHARDINGS:
            raise ConfigError(f"sharding must be one of {SHARDINGS}, got {self.sharding!r}")
        _positive("redundancy_every", self.redundancy_every, allow_none=True)
        if self.redundancy_every is not None and self.sharding != "fsdp":
            raise ConfigError(f"redundancy_every needs sharding='fsdp', got sharding={self.sharding!r}")
        if self.shard_units is not None:
            if self.sharding not in ("fsdp", "hsdp"):
                raise ConfigError(f"shard_units needs sharding='fsdp' or 'hsdp', got sharding={self.sharding!r}")
            from elastictrain.train.fsdp.units import check_units  # FSDP's imports only for a sharded session

            check_units(self.shard_units, name="shard_units")
        if self.init_weights is not None:
            if self.sharding not in ("fsdp", "hsdp"):
                raise ConfigError(f"init_weights needs sharding='fsdp' or 'hsdp', got sharding={self.sharding!r}")
            if not callable(self.init_weights):
                raise ConfigError("init_weights must be a function of a module, got "
                                  f"{type(self.init_weights).__name__}")
        if self.recovery not in RECOVERY_MODES:
            raise ConfigError(f"recovery must be one of {RECOVERY_MODES}, got {self.recovery!r}")
        if not isinstance(self.checkpoint_timeout, timedelta):
            object.__setattr__(self, "checkpoint_timeout", parse_duration("checkpoint_timeout",
                                                                          self.checkpoint_timeout, minimum=1))
        if not isinstance(self.recovery_timeout, timedelta):
            object.__setattr__(self, "recovery_timeout", parse_duration("recovery_timeout", self.recovery_timeout,
                                                                        minimum=1))
