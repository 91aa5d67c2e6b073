"""FSDP2 and HSDP behind the :class:`~elastictrain.train.strategy.ParallelStrategy` seam:
``Session(..., sharding="fsdp" | "hsdp")``.

:class:`FsdpStrategy` shards the session's model over the group with
:func:`~elastictrain.train.fsdp.sharded.shard` (one unit per direct child that holds parameters,
then the root, unless ``shard_units`` picks others: see :mod:`~elastictrain.train.fsdp.units`);
:class:`HsdpStrategy` over a 2-D mesh, sharded within each node
(``local_world_size`` wide) and replicated across nodes. The session's optimizer object is kept,
re-pointed at the shards. Accumulation (:meth:`~FsdpStrategy.no_sync`), mixed precision (FSDP2's
policy from the session's ``precision``, beside its autocast and GradScaler), global-norm
clipping, the scheduler, the sampler and hooks work as under DDP; buffers are broadcast from
rank 0 after each step (FSDP2 does not synchronize them; DDP broadcasts them in its forward).

State: a rank holds shards, no replica; a rank that lacks the state receives its rows from the
ranks that hold them (the region exchange, below), when they hold them all. The session shards
first and restores a checkpoint after (:attr:`~FsdpStrategy.restores_wrapped`), through
:class:`~elastictrain.train.fsdp.state.ModelState` and
:class:`~elastictrain.train.fsdp.state.OptimizerState`: each rank reads only the regions of its
own shards (of a sharded checkpoint at any world size and mesh, or sliced from a DDP one's full
tensors), so no rank assembles the full state. The model and the optimizer are saved through
the same adapters: each rank writes its own shards.

Recovery in place (the default ``recovery="in-process"``): ``fully_shard`` turns a module into
shards of one mesh for good, so the strategy keeps a storage-less skeleton of the unsharded model
(:class:`~elastictrain.train.fsdp.skeleton.Skeleton`, taken before the first shard) and each
re-formed generation trains a fresh module built from it (:meth:`~FsdpStrategy.unwrapped`: the
session's model becomes that module, and the same optimizer object is re-pointed at it). The fresh
module is filled from the ranks' memory when the live ranks hold every region of a step
(:meth:`~FsdpStrategy.covers` plans the region exchange of
:mod:`~elastictrain.train.fsdp.exchange`: an hsdp replica lost, a node joining an fsdp or hsdp
job), else from the newest checkpoint (an fsdp rank lost with its shards and no copy of them:
the steps since are redone, and the ``recovery`` event says how many). The sampler cursor,
scheduler and extras reach a joining rank by the replicated transfer, as under DDP. With
``redundancy_every`` (fsdp), each rank keeps a copy of a buddy's shards in host memory
(:attr:`FsdpStrategy.redundancy`), and with each snapshot of its own shards the replicated state
of that step (:meth:`~FsdpStrategy.keep_state`): when a rank is lost with its shards, the live
ranks rebuild from the newest step they hold whole, the newest one or the step of the last
refresh every rank completed, rolling back to it from memory (no disk read); the steps after it,
``redundancy_every`` at most, are redone.

Under in-process recovery the mesh is made of failsafe groups
(:mod:`~elastictrain.train.fsdp.failsafe_group`, one :class:`SwallowedFailure` per generation): a unit's
all-gather that fails inside the user's forward is recorded (:meth:`FsdpStrategy.swallowed`), not
raised there, and the step loop discards the step at its end.
"""

from __future__ import annotations

import contextlib
import gc
import logging
from typing import TYPE_CHECKING, Any, Protocol, cast

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from elastictrain._torch_compat import clear_dtensor_caches
from elastictrain.errors import SessionError
from elastictrain.train.fsdp.exchange import Exchange, announce, buffer_holdings, state_specs
from elastictrain.train.fsdp.failsafe_group import AbandonedStep, SwallowedFailure
from elastictrain.train.fsdp.forward_waits import ForwardWaits
from elastictrain.train.fsdp.gradients import clip_grad_norm_, no_sync
from elastictrain.train.fsdp.holdings import Holding, own_holdings
from elastictrain.train.fsdp.initialize import initialize
from elastictrain.train.fsdp.mesh import mesh_shape
from elastictrain.train.fsdp.optimizer import parameter_fqns, shard_optimizer
from elastictrain.train.fsdp.redundancy import Redundancy, start_redundancy
from elastictrain.train.fsdp.regions import TensorSpec
from elastictrain.train.fsdp.sharded import Sharded, ShardingConfig, shard
from elastictrain.train.fsdp.skeleton import Skeleton
from elastictrain.train.fsdp.state import ModelState, OptimizerState, full_state_dict
from elastictrain.train import peer_connections
from elastictrain.train.fsdp.units import UnitSpec
from elastictrain.train.meta_init import InitWeights, on_meta_device
from elastictrain.train.precision import MixedPrecision
from elastictrain.train.state_transfer import Agreement, transfer
from elastictrain.train.strategy import GroupView, ParallelStrategy, register_strategy

if TYPE_CHECKING:
    from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence

    from elastictrain.train.session_config import SessionConfig

__all__ = ["FsdpStrategy", "HoldingsSource", "HsdpStrategy", "Hyperparameters"]

logger = logging.getLogger(__name__)

_SHARDED_OBJECTS = ("model", "optimizer")
"""The state objects the region exchange rebuilds; the others travel by the replicated transfer."""


_MESH_SHAPES: set[tuple[int, ...]] = set()
"""The shapes of the meshes this process has sharded over (see :meth:`FsdpStrategy._wrap`): per
process, as DTensor's caches are."""

_HYPERPARAMETERS = "optimizer_hyperparameters"
"""The name the optimizer's param-group settings travel under in the replicated transfer."""


class Hyperparameters:
    """An optimizer's param-group settings (learning rate, momentum, weight decay, ...: what a
    scheduler changes), without their parameters, as a state object of the replicated transfer.

    The region exchange moves the optimizer's state tensors only: without these, a rank that joins
    in place would train its first step at the settings its own optimizer was built with (its
    learning rate, not the one the survivors' scheduler had set).

    Args:
        optimizer: The session's optimizer.
    """

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.optimizer = optimizer

    def state_dict(self) -> dict[str, Any]:
        """``{"groups": [settings of each param group, "params" left out]}``."""
        return {"groups": [{k: v for k, v in group.items() if k != "params"} for group in self.optimizer.param_groups]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Set each param group's settings to the sender's.

        Raises:
            SessionError: The sender's optimizer has another number of param groups.
        """
        groups = state["groups"]
        if len(groups) != len(self.optimizer.param_groups):
            raise SessionError(f"the optimizer received {len(groups)} param group(s)' settings for its "
                               f"{len(self.optimizer.param_groups)}")
        for group, settings in zip(self.optimizer.param_groups, groups, strict=True):
            group.update(settings)


class HoldingsSource(Protocol):
    """Regions of the sharded state held beyond a rank's own shards (copies of another rank's,
    kept by a redundancy source), offered to the region exchange when the group re-forms."""

    def holdings(self) -> Sequence[Holding]:
        """The regions this rank holds, each with its step (those of the agreed newest step count).
        Must not run a collective."""
        ...


class FsdpStrategy(ParallelStrategy):
    """FSDP2 over the whole group (see the module docstring).

    Args:
        precision: The session's precision (``SessionConfig.precision``): bf16 and fp16 become
            FSDP2's mixed precision policy.
        redundancy_every: See ``SessionConfig.redundancy_every``.
        units: The FSDP units (``SessionConfig.shard_units``). A module a later generation builds
            from the skeleton is sharded into the units of the same FQNs as the first generation's.
        init_weights: ``SessionConfig.init_weights``: sets a model built on the meta device
            (:meth:`initialize`).
    """

    name = "fsdp"

    def __init__(self, precision: str = "fp32", redundancy_every: int | None = None, *,
                 units: UnitSpec | None = None, init_weights: InitWeights | None = None) -> None:
        super().__init__()
        self._precision = precision
        self._units = units
        self._init_weights = init_weights
        self._unit_fqns: frozenset[str] | None = None
        self._sharded: Sharded | None = None
        self._skeleton: Skeleton | None = None
        self._sources: list[HoldingsSource] = []
        self._exchange: Exchange | None = None
        self._received: dict[str, tuple[TensorSpec, torch.Tensor]] | None = None
        self._redundancy_every = redundancy_every
        self._objects: Callable[[], Mapping[str, Any]] | None = None
        self._live_step: int | None = None  # the step of the live state covers() announced, if any
        self._rebuilt: int | None = None  # the step transfer_state() brought this rank to
        self.redundancy: Redundancy | None = None
        """The copies of the last generation (kept after it is left: they outlive the group)."""
        self._failures: SwallowedFailure | None = None
        self._forward_waits: ForwardWaits | None = None  # without failsafe groups (--recovery restart)

    def add_holdings_source(self, source: HoldingsSource) -> None:
        """Offer ``source``'s regions to the region exchange of each later re-formation."""
        self._sources.append(source)

    def _shard_width(self, world_size: int, local_world_size: int) -> int:
        """Ranks per shard group: the whole group under fsdp."""
        return world_size

    def _config(self, view: GroupView) -> ShardingConfig:
        return ShardingConfig(sharding="fsdp", units=self._units_now())

    def _units_now(self) -> UnitSpec | None:
        """The units of this generation's module: ``units`` for the first; for a module rebuilt from
        the skeleton, the FQNs the first chose (a predicate may have judged the modules by identity)."""
        chosen = self._unit_fqns
        if chosen is None:
            return self._units
        return lambda fqn, _module: fqn in chosen

    def _wrap(self, module: torch.nn.Module, optimizer: torch.optim.Optimizer, view: GroupView, *,
              identical: bool) -> torch.nn.Module:
        """See base class. Shards ``module`` in place and returns it (a checkpoint is restored after,
        into the shards: :attr:`restores_wrapped`).

        Raises:
            ConfigError: A world the hsdp mesh does not tile (one line).
            SessionError: The model was sharded by an earlier group (pass :meth:`unwrapped`'s).
        """
        if isinstance(module, FSDPModule):
            raise SessionError(f"the model is already sharded by an earlier group: sharding={self.name!r} shards "
                               "the module unwrapped() gives")
        if self._skeleton is None and (view.in_process or on_meta_device(module)):
            # Before fully_shard: a later generation builds from it, and so does initialize().
            self._skeleton = Skeleton(module)
        config = self._config(view)
        shape = mesh_shape(config.sharding, view.placement.world_size, config.nproc_per_node)
        if shape in _MESH_SHAPES:
            # torch takes this mesh for the earlier one of its shape (it compares meshes by shape
            # and names, not by rank): DTensor's decisions cached for that one must go. A mesh of
            # a new shape is equal to none (its first step does not pay for the caches' refill).
            clear_dtensor_caches()
        _MESH_SHAPES.add(shape)
        precision = MixedPrecision(self._precision, view.placement.device)
        received, self._received, self._exchange = self._received, None, None
        self._failures = SwallowedFailure() if view.in_process else None
        self._sharded = shard(module, optimizer, config, precision=precision, group=view.group,
                              broadcast=not identical and received is None, failures=self._failures,
                              device=view.placement.device)
        if self._failures is None:
            self._forward_waits = ForwardWaits(module)
        if self._unit_fqns is None:
            self._unit_fqns = frozenset(fqn for fqn, unit in module.named_modules()
                                        if fqn and isinstance(unit, FSDPModule))
        if received is not None:
            _fill(module, optimizer, received)
            if self._skeleton is not None:
                self._skeleton.keep_buffers(module)  # a meta-built model's: from its peers
        if self._redundancy_every is not None:
            previous = self.redundancy  # closed, its copies consumed by the rebuild above
            self.redundancy = start_redundancy(module, optimizer, every=self._redundancy_every,
                                               nproc_per_node=view.local_world_size,
                                               timeout=view.placement.timeout, group=view.group,
                                               replicated=self._replicated if self._objects is not None else None)
            if previous is not None:
                self.redundancy.adopt_buffers(previous)
        return module

    def covers(self, group: Any, agreement: Agreement, module: torch.nn.Module, optimizer: torch.optim.Optimizer,
               *, step: int, local_world_size: int) -> bool:
        """See base class: what this rank holds announced, each piece with its step (its live shards
        and buffers at its committed ``step``, the redundancy's snapshots and copy at the steps of its
        refreshes, a holdings source's regions), the step to rebuild at picked (the newest one the
        live ranks hold whole: maybe older than the agreed newest, and every rank then rolls back
        to it, see :mod:`~elastictrain.train.fsdp.rollback`) and the moves planned for the new
        layout; a collective over ``group``."""
        held: list[Holding] = []
        replicated: list[int] = []
        specs = {}
        self._live_step = self._rebuilt = None
        if isinstance(module, FSDPModule):  # still the previous generation's: its state is this rank's `step`
            held = own_holdings(module, optimizer, step)
            held += buffer_holdings(module, step)  # FSDP2 does not shard them: every rank holds them whole
            specs = state_specs(module, optimizer)
            replicated.append(step)
            self._live_step = step
        if self.redundancy is not None:
            held += self.redundancy.kept_holdings()  # its snapshots and the buddy's copy, of the refreshes' steps
            replicated += self.redundancy.kept_steps()
        for source in self._sources:
            held += source.holdings()
        world = dist.get_world_size(group)
        self._exchange = announce(group, held=held, specs=specs, replicated=replicated, newest=agreement.step or 0,
                                  shard_width=self._shard_width(world, local_world_size))
        return self._exchange.covered

    def unwrapped(self, module: torch.nn.Module, optimizer: torch.optim.Optimizer) -> torch.nn.Module:
        """See base class: a sharded module gives way to a fresh one built from the skeleton, its
        parameters and persistent buffers on the meta device (no storage): :meth:`wrap` shards it and
        allocates only this rank's shards (on the group's device), which a restore or the region
        exchange then fills. Nothing may read or load its values before :meth:`wrap`."""
        if not isinstance(module, FSDPModule):
            return module
        if self._skeleton is None:
            raise SessionError(f"sharding={self.name!r} took no skeleton of the model before sharding it")
        device = next(module.parameters()).device
        fresh = self._skeleton.build(device, allocate=False)
        shard_optimizer(optimizer, parameter_fqns(module), dict(fresh.named_parameters()))
        optimizer.state.clear()
        return fresh

    def transfer_state(self, group: Any, agreement: Agreement, objects: Mapping[str, Any], *, step: int) -> bool:
        """See base class: every rank brought to the step :meth:`covers` picked (:meth:`rebuild_step`).
        The replicated objects (sampler cursor, scheduler, scaler, extras) come from this rank's own
        memory where it holds that step (its live objects, or the redundancy's copy of an older
        step, which :meth:`~elastictrain.train.fsdp.redundancy.Redundancy.roll_back` loads, RNG
        included), else by the replicated transfer from a rank that does; each rank's regions of the
        model and optimizer by the exchange :meth:`covers` planned, applied to the shards by :meth:`wrap`.

        Raises:
            SessionError: :meth:`covers` planned no covered exchange.
        """
        exchange = self._exchange
        if exchange is None or exchange.step is None:
            raise SessionError(f"sharding={self.name!r}: no covered region exchange was planned")
        target = exchange.step
        rest = _replicated_objects(objects)
        if exchange.rank in exchange.holders and target != self._live_step:
            assert self.redundancy is not None  # noqa: S101 - only the redundancy keeps other steps' state
            self.redundancy.roll_back(target, rest)
            logger.info("rolled back to step %d from this rank's memory (the state of step %s is not held whole "
                        "by the live ranks)", target, agreement.step)
        receivers = tuple(r for r in range(dist.get_world_size(group)) if r not in exchange.holders)
        received = transfer(group, Agreement(target, exchange.holders, receivers), rest, step=target)
        self._received = exchange.run(group)
        self._exchange, self._rebuilt = None, target
        return received

    def _initialize(self, module: torch.nn.Module, *, seed: int) -> None:
        """See base class: :func:`~elastictrain.train.fsdp.initialize.initialize`, over a storage-less
        copy of the model built from the skeleton."""
        if self._init_weights is None or self._skeleton is None or self._unit_fqns is None:
            raise SessionError(f"sharding={self.name!r}: a model on the meta device needs init_weights")
        device = self.view.placement.device
        initialize(module, self._skeleton.build(device, allocate=False), self._init_weights,
                   units=self._unit_fqns, seed=seed, device=device)
        self._skeleton.keep_buffers(module)  # for the generations rebuilt from it: no checkpoint holds them

    def rebuild_step(self, agreement: Agreement) -> int | None:
        """See base class: the step :meth:`covers` picked, once :meth:`transfer_state` brought every rank to it."""
        return self._rebuilt if self._rebuilt is not None else agreement.step

    def keep_state(self, objects: Callable[[], Mapping[str, Any]]) -> None:
        """See base class: the redundancy keeps the replicated part (all but the model and the
        optimizer, which its snapshots hold shard by shard) with each snapshot."""
        self._objects = objects

    def own_groups(self) -> tuple[dist.ProcessGroup, ...]:
        """See base class: the mesh's groups (hsdp's sub-groups: a gradient all-reduce across
        replicas waits there) and the redundancy's two (its vote waits on the training thread)."""
        mesh = self._mesh_groups(self._sharded) if self._sharded is not None else ()
        return mesh + (self.redundancy.groups() if self.redundancy is not None else ())

    def on_cut(self) -> Callable[[], None] | None:
        """See base class: the mesh's failure is recorded and its waits end
        (:meth:`~elastictrain.train.fsdp.failsafe_group.SwallowedFailure.cut`), under in-process recovery."""
        return self._failures.cut if self._failures is not None else None

    @staticmethod
    def _mesh_groups(sharded: Sharded) -> tuple[dist.ProcessGroup, ...]:
        """The groups that communicate under the mesh's (failsafe wrappers' inner groups)."""
        return tuple(getattr(g, "inner", g) for g in sharded.mesh.get_all_groups())

    def _replicated(self) -> dict[str, Any]:
        assert self._objects is not None  # noqa: S101 - only given to the redundancy with objects
        return _replicated_objects(self._objects())

    def _leave(self) -> None:
        """See base class. The model stays sharded until :meth:`unwrapped` (see the module
        docstring); the redundancy's refreshes stop, its copies stay (:attr:`redundancy`). The
        mesh's sub-groups (hsdp's, under their failsafe wrappers) are severed: a peer blocked on
        this rank in one of their collectives fails at once (the default group's are the
        generation's to sever).

        Then a full garbage collection, now: a rank that leaves waits for its agent's next
        generation (a replacement starting, the rendezvous), while the next formation allocates
        thousands of objects (the holdings announced and planned, a module and its shards built
        afresh) and woke a full collection of the whole process in it (0.1-0.5 s at the
        benchmark's LM, on 2 loaded cores), with every rank waiting for the slowest."""
        if self._failures is not None:
            self._failures.close()
        self._failures = None
        if self._forward_waits is not None:
            self._forward_waits.remove()
            self._forward_waits = None
        if self._sharded is not None:
            peer_connections.sever(*self._mesh_groups(self._sharded))
        if self.redundancy is not None:
            self.redundancy.close()
        gc.collect()

    def no_sync(self) -> contextlib.AbstractContextManager[Any]:
        """See base class: ``set_requires_gradient_sync(False)`` over the backward passes inside."""
        _ = self.view  # SessionError when not wrapped
        assert self._sharded is not None  # noqa: S101 - set with the view
        return no_sync(self._sharded.module)

    def before_apply(self, step: int) -> None:
        """See base class: the redundancy's vote on a refresh due after ``step`` starts."""
        if self.redundancy is not None:
            self.redundancy.prepare(step)

    def after_step(self, step: int) -> None:
        """See base class: the buffers broadcast from rank 0 (FSDP2 leaves them to each rank), then
        the redundancy's refresh when one is due (its snapshot; the copy is sent in the background)."""
        view = self.view
        assert self._sharded is not None  # noqa: S101 - set with the view
        source = dist.get_global_rank(view.group, 0) if view.group is not None else 0
        for buffer in self._sharded.model.buffers():
            dist.broadcast(buffer, src=source, group=view.group)
        if self.redundancy is not None:
            self.redundancy.after_step(step)

    def before_forward(self) -> None:
        """See base class: raises the collective failure swallowed earlier in the step, if one was
        (the step is then discarded before this forward). Each unit gathers its parameters in
        the forward, as plain FSDP2 does."""
        _ = self.view
        failed = self.swallowed()
        if failed is not None:
            raise failed

    def swallowing(self, waiting: Callable[[], contextlib.AbstractContextManager[Any]] | None = None,
                   ) -> contextlib.AbstractContextManager[Any]:
        """See base class: under in-process recovery the mesh is made of failsafe groups
        (:mod:`~elastictrain.train.fsdp.failsafe_group`): inside, a failed all-gather or
        reduce-scatter is recorded, and it and the later collectives of the mesh return at once.
        Without them (``--recovery restart``) nothing is swallowed, and ``waiting`` is entered
        around each unit's gathering of its parameters in the forward
        (:mod:`~elastictrain.train.fsdp.forward_waits`)."""
        _ = self.view
        if self._failures is not None:
            return self._failures.swallowing(waiting)
        if self._forward_waits is None or waiting is None:
            return contextlib.nullcontext()
        return self._forward_waits.marking(waiting)

    def swallowed(self) -> BaseException | None:
        """See base class."""
        return self._failures.failure if self._failures is not None else None

    @contextlib.contextmanager
    def abandoning(self) -> Iterator[None]:
        """See base class: inside, a collective of the mesh that fails, or comes after a failure,
        raises :class:`~elastictrain.train.fsdp.failsafe_group.AbandonedStep` out of the backward
        (the rest of it would compute on garbage while the peers wait to re-form, on the cores a
        replacement shares), and FSDP2's state is reset (``reset_iter_state``: its in-flight
        collectives waited for, every unit resharded), so that :meth:`covers` reads this rank's
        shards from the module as after a whole backward."""
        failures = self._failures
        if failures is None:
            yield
            return
        try:
            with failures.abandoning():
                yield
        except AbandonedStep as abandoned:
            assert self._sharded is not None  # noqa: S101 - failures only with a wrapped model
            logger.info("the backward stopped at a collective after the failure (%s); FSDP2's state reset", abandoned)
            self._sharded.module.reset_iter_state()  # outside abandoning(): its waits record, not raise
            raise

    def clip_grad_norm(self, parameters: Iterable[torch.Tensor], max_norm: float) -> torch.Tensor:
        """See base class: the norm over every shard (a collective over the mesh)."""
        return clip_grad_norm_(parameters, max_norm)

    def state_objects(self, module: torch.nn.Module, optimizer: torch.optim.Optimizer) -> tuple[Any, Any]:
        """See base class: the sharded adapters once the model is sharded; before (a restore at
        the start), the unsharded model and optimizer themselves."""
        if not isinstance(module, FSDPModule):
            return module, optimizer
        return ModelState(module), OptimizerState(module, optimizer)

    @property
    def restores_wrapped(self) -> bool:
        """See base class: True. A checkpoint is restored once the model is sharded, into
        :class:`~elastictrain.train.fsdp.state.ModelState` and
        :class:`~elastictrain.train.fsdp.state.OptimizerState`: each rank reads the regions of its own
        shards only (see ``docs/sharding.md``)."""
        return True

    @property
    def live_transfer(self) -> bool:
        """See base class: True, when :meth:`covers` finds every region held by a live rank."""
        return True

    def full_state_dict(self, module: torch.nn.Module) -> dict[str, Any]:
        """See base class: gathered to rank 0's CPU memory, ``{}`` on other ranks; a collective."""
        if not isinstance(module, FSDPModule):
            return dict(module.state_dict())
        return full_state_dict(module)


class HsdpStrategy(FsdpStrategy):
    """Hybrid sharding: shard within each node (``local_world_size`` ranks), replicate across nodes.

    No redundancy option: the other nodes are its replicas."""

    name = "hsdp"

    def _config(self, view: GroupView) -> ShardingConfig:
        return ShardingConfig(sharding="hsdp", units=self._units_now(), nproc_per_node=view.local_world_size,
                              timeout=view.placement.timeout)

    def _shard_width(self, world_size: int, local_world_size: int) -> int:
        """See base class: a node's ranks."""
        return local_world_size


def _replicated_objects(objects: Mapping[str, Any]) -> dict[str, Any]:
    """The state objects the replicated transfer sends (and the redundancy keeps with each snapshot):
    all but the model and the optimizer, which the region exchange rebuilds; and the optimizer's
    param-group settings (:class:`Hyperparameters`), which it does not."""
    rest = {name: obj for name, obj in objects.items() if name not in _SHARDED_OBJECTS}
    if "optimizer" in objects:
        optimizer = objects["optimizer"]
        rest[_HYPERPARAMETERS] = Hyperparameters(getattr(optimizer, "optimizer", optimizer))
    return rest


def _fill(module: torch.nn.Module, optimizer: torch.optim.Optimizer,
          received: Mapping[str, tuple[TensorSpec, torch.Tensor]]) -> None:
    """Copy the region exchange's boxes into the new shards' local tensors, and build the optimizer's
    state on the shards from them (a state tensor shaped as its parameter is sharded as it is).

    Raises:
        SessionError: A box does not fit its shard (the layouts disagree).
    """
    def put(key: str, local: torch.Tensor) -> None:
        box = received[key][1]
        if tuple(box.shape) != tuple(local.shape):
            raise SessionError(f"{key}: the exchange brought a box of {tuple(box.shape)} for a shard of "
                               f"{tuple(local.shape)}")
        local.copy_(box)

    with torch.no_grad():
        for fqn, tensor in [*module.named_parameters(), *module.named_buffers()]:
            put(f"model/{fqn}", tensor.to_local() if isinstance(tensor, DTensor) else tensor)
        for fqn, param in module.named_parameters():
            prefix = f"optimizer/{fqn}/"
            state: dict[str, Any] = {}
            for key in sorted(k for k in received if k.startswith(prefix)):
                name, box = key[len(prefix):], received[key][1]
                if isinstance(param, DTensor) and received[key][0].sharded:
                    value = torch.empty_like(param)
                    put(key, cast(DTensor, value).to_local())
                else:
                    value = box if box.dim() == 0 else box.to(param.device)
                state[name] = value
            if state:
                optimizer.state[param] = state


def _fsdp(config: SessionConfig) -> FsdpStrategy:
    return FsdpStrategy(config.precision, config.redundancy_every, units=config.shard_units,
                        init_weights=config.init_weights)


def _hsdp(config: SessionConfig) -> HsdpStrategy:
    return HsdpStrategy(config.precision, units=config.shard_units, init_weights=config.init_weights)


register_strategy("fsdp", _fsdp)
register_strategy("hsdp", _hsdp)
