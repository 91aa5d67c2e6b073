"""How a session's model trains over its group: the :class:`ParallelStrategy` seam, and its registry.

DDP goes through it (:mod:`~elastictrain.train.ddp`); FSDP2 and HSDP register from
``elastictrain.train.fsdp``. The session, its step loop and its recovery only talk to the
seam: a strategy wraps the model over each generation's group, accumulates gradients without
synchronizing them, carries the step-boundary vote, clips the global gradient norm, names
what a checkpoint saves for the model and optimizer, declares whether a live peer's state can be
handed to a rank that lacks it, and drops what it built when the generation ends.

``Session(..., sharding=NAME)`` picks one by name (:func:`create_strategy`); a module that
implements one calls :func:`register_strategy` when it is imported.
"""

from __future__ import annotations

import contextlib
import importlib
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from elastictrain.errors import ConfigError, SessionError
from elastictrain.train import process_group as pg
from elastictrain.train.boundary import explicit_vote
from elastictrain.train.state_transfer import Agreement, transfer

if TYPE_CHECKING:
    from elastictrain.train.session_config import SessionConfig

__all__ = ["SHARDINGS", "GroupView", "ParallelStrategy", "create_strategy", "register_strategy"]

SHARDINGS = ("ddp", "fsdp", "hsdp")
"""The values ``Session(sharding=...)`` accepts (each is available once its module registers it)."""

_HOMES = {"ddp": "elastictrain.train.ddp", "fsdp": "elastictrain.train.fsdp", "hsdp": "elastictrain.train.fsdp"}
"""The module that registers each strategy when imported (imported on first use)."""

StrategyFactory = Callable[["SessionConfig"], "ParallelStrategy"]
_registry: dict[str, StrategyFactory] = {}


@dataclass(frozen=True, kw_only=True, slots=True)
class GroupView:
    """The group of one generation, as a strategy sees it."""

    placement: pg.Placement
    """Device, backend, rank and world size of the group."""

    group: dist.ProcessGroup | None
    """The process group to train over; None: the default group."""

    in_process: bool
    """Whether faults are recovered in this process: a collective failure inside the user's forward
    must not escape the step loop (no collective runs there, or its failure is recorded and the step
    discarded at its end: :meth:`ParallelStrategy.swallowing`), and the vote is taken at each boundary."""

    local_world_size: int
    """Workers per node (a hybrid strategy shards within a node and replicates across nodes)."""


class ParallelStrategy(ABC):
    """How a session's model trains over a generation's group.

    One strategy serves a session from start to end; each generation of the group uses it
    between :meth:`wrap` and :meth:`leave` (or :meth:`end`), which drop what it built on that
    group. Within a generation, each optimizer step runs:

    1. :meth:`arm_vote` (in-process recovery only) before the step's first forward;
    2. a forward and backward per micro-batch through what :meth:`wrap` returned, each but the
       last inside :meth:`no_sync`, each after :meth:`before_forward` and inside :meth:`swallowing`
       (in-process only); the last backward synchronizes the gradients; a failure
       :meth:`swallowed` discards the step;
    3. :meth:`clip_grad_norm` (if the session clips) and the optimizer step;
    4. :meth:`after_step`, then :meth:`votes` (in-process only): how many ranks voted to
       re-form the group after this step. Every rank gets the same number.

    Collective failures are not caught here (but inside :meth:`swallowing`): a method that runs
    one (:meth:`wrap`, :meth:`after_step`, :meth:`votes`, :meth:`clip_grad_norm`,
    :meth:`full_state_dict`, :meth:`transfer_state`) lets the backend's error through, and the
    session decides at the step boundary. Calling a per-generation method before :meth:`wrap` or after :meth:`leave`
    raises :class:`~elastictrain.errors.SessionError`.

    Policy in the base, mechanism in subclasses: the public methods check, then call the
    ``_`` hooks a subclass implements.
    """

    name: str = ""
    """The ``sharding=`` value this strategy answers to."""

    def __init__(self) -> None:
        self._view: GroupView | None = None
        self._wanted = False

    # --- a generation's life -------------------------------------------------------------------

    def wrap(self, module: torch.nn.Module, optimizer: torch.optim.Optimizer, view: GroupView, *,
             identical: bool) -> torch.nn.Module:
        """Wrap ``module`` over ``view``'s group; usually a collective.

        Args:
            module: The user's model, on ``view.placement.device``.
            optimizer: Its optimizer. A strategy that replaces the parameters (sharding them)
                re-points the optimizer's param groups and state at the new ones in place: the
                session keeps stepping the same object.
            view: The generation's group (distributed: ``view.placement.distributed``).
            identical: Every rank already holds the same state (a live transfer made it so), so
                nothing needs broadcasting.

        Returns:
            What the forward runs through (``session.model``).

        Raises:
            SessionError: Already wrapped for a generation not yet left, or the group is not
                distributed.
        """
        if self._view is not None:
            raise SessionError(f"the {self.name} strategy is already wrapped over a group: leave it first")
        if not view.placement.distributed:
            raise SessionError(f"the {self.name} strategy wraps over a process group; there is none")
        wrapped = self._wrap(module, optimizer, view, identical=identical)
        self._view = view
        return wrapped

    def initialize(self, module: torch.nn.Module, *, seed: int) -> None:
        """Set the values of ``module``, built on the meta device (no storage) and wrapped, when no
        peer and no checkpoint brings them: ``SessionConfig.init_weights`` over the model, torch's
        RNG seeded from ``seed`` for it; no collective (every rank sets the same values).

        Raises:
            SessionError: Not wrapped, or the strategy trains no model built on the meta device.
            ConfigError: ``init_weights`` failed or left a tensor unset (one line).
        """
        _ = self.view
        self._initialize(module, seed=seed)

    def _initialize(self, module: torch.nn.Module, *, seed: int) -> None:
        raise SessionError(f"sharding={self.name!r} trains no model built on the meta device")

    def leave(self) -> None:
        """Drop what :meth:`wrap` built, without a collective (peers may be dead); a no-op when not
        wrapped."""
        if self._view is not None:
            self._view = None
            self._wanted = False
            self._leave()

    def end(self) -> None:
        """Drop what :meth:`wrap` built at the end of the run (see :meth:`leave`)."""
        self.leave()

    def own_groups(self) -> tuple[dist.ProcessGroup, ...]:
        """The process groups this strategy made over the wrapped group whose collectives the
        training waits in (their connections on record, :mod:`~elastictrain.train.peer_connections`):
        when one waits for a peer that is gone without closing its connections, the generation
        shuts theirs down with its own group's. None by default (DDP trains on the group itself)."""
        return ()

    def on_cut(self) -> Callable[[], None] | None:
        """What ends this generation's waits for its collectives once the generation shut their
        connections down under one stuck on a peer that is gone, a wait gloo may not end itself
        (a send half written to that peer); called on another thread. None by default: DDP's
        wait is in C++, where its gradient all-reduce fails as the connections are shut down."""
        return None

    @property
    def view(self) -> GroupView:
        """The group wrapped over now.

        Raises:
            SessionError: Not wrapped.
        """
        if self._view is None:
            raise SessionError(f"the {self.name} strategy is not wrapped over a group")
        return self._view

    # --- each step -----------------------------------------------------------------------------

    @abstractmethod
    def no_sync(self) -> contextlib.AbstractContextManager[Any]:
        """Inside it, a backward accumulates gradients without synchronizing them (every
        micro-batch of a step but the last). DDP: ``no_sync()``; FSDP2: ``set_requires_gradient_sync``."""

    def arm_vote(self, wanted: bool) -> None:
        """This rank's vote for the step about to run: re-form the group after it (``wanted``).

        Raises:
            SessionError: Not wrapped.
        """
        _ = self.view
        self._arm_vote(wanted)

    def votes(self) -> int:
        """How many ranks voted to re-form after the step just applied (the same on every rank).

        The default is an explicit all-reduce of the vote at the boundary (one small collective
        per step, :func:`~elastictrain.train.boundary.explicit_vote`); a strategy that carries the
        vote on its own gradient collective overrides :meth:`_arm_vote` and :meth:`_votes`.

        Raises:
            SessionError: Not wrapped.
        """
        _ = self.view
        return self._votes()

    def _arm_vote(self, wanted: bool) -> None:
        self._wanted = wanted

    def _votes(self) -> int:
        view = self.view
        wanted, self._wanted = self._wanted, False
        return explicit_vote(wanted, view.placement, group=view.group)

    def before_forward(self) -> None:
        """Run before each micro-batch's forward by the session, where a collective failure
        discards the step (a failure inside the user's forward would escape the step loop).
        Default: nothing (DDP's forward runs no collective). Raises the backend's error if a
        collective fails (or failed inside the step, see :meth:`swallowed`)."""
        return

    def swallowing(self, waiting: Callable[[], contextlib.AbstractContextManager[Any]] | None = None,
                   ) -> contextlib.AbstractContextManager[Any]:
        """Entered by the session around each micro-batch of a step (the user's forward and
        backward): under in-process recovery a strategy whose forward runs collectives (FSDP2's
        all-gathers) records their failure inside instead of raising it in the user's code
        (:meth:`swallowed`); in either recovery mode it enters ``waiting`` around each wait for
        one (the session's marker of a step's own collectives, whose time is no compute).
        Default: nothing is swallowed or marked."""
        return contextlib.nullcontext()

    def swallowed(self) -> BaseException | None:
        """The collective failure recorded inside :meth:`swallowing` in this generation, if one was:
        the step is then discarded and the group re-forms. Default: None."""
        return None

    def abandoning(self) -> contextlib.AbstractContextManager[Any]:
        """Entered by the session around a micro-batch's backward, inside :meth:`swallowing`: a
        strategy that swallows may stop the backward at its next collective once one failed,
        raising a collective failure (which the session catches: the step is discarded), with its
        own state reset for the re-formation. Default: nothing is stopped."""
        return contextlib.nullcontext()

    def before_apply(self, step: int) -> None:
        """What the group starts before the optimizer step of ``step``, every rank, each step
        (e.g. fsdp's redundancy starts its vote on a refresh due after it, so that the optimizer
        step overlaps the round trip). Default: nothing. Raises a backend error if a collective
        cannot start."""
        return

    @abstractmethod
    def after_step(self, step: int) -> None:
        """What the group does after the optimizer step of ``step`` (before :meth:`votes`): e.g.
        DDP's bucket rebuild and buffer broadcast, fsdp's redundancy refresh. Raises a backend
        error if a collective fails."""

    def clip_grad_norm(self, parameters: Iterable[torch.Tensor], max_norm: float) -> torch.Tensor:
        """Clip the global gradient 2-norm of ``parameters`` to ``max_norm``; returns the norm
        before clipping. Default: ``clip_grad_norm_`` on the local gradients (they are the whole
        gradient when replicated); a sharded strategy reduces the norm over its shards."""
        return torch.nn.utils.clip_grad_norm_(list(parameters), max_norm)

    # --- state ---------------------------------------------------------------------------------

    @abstractmethod
    def state_objects(self, module: torch.nn.Module,
                      optimizer: torch.optim.Optimizer) -> tuple[Any, Any]:
        """What a checkpoint saves and restores (and a live transfer sends) for the model and the
        optimizer: objects with ``state_dict()``/``load_state_dict()``. DDP: the module and the
        optimizer; a sharded strategy: adapters whose ``state_dict()`` holds DTensors."""

    @property
    @abstractmethod
    def live_transfer(self) -> bool:
        """Whether every rank that holds the newest step holds the whole state, so that a rank
        without it can receive it from one live peer (:meth:`transfer_state`). False: the ranks
        restore from the newest checkpoint instead when a rank lacks the state."""

    @property
    def restores_wrapped(self) -> bool:
        """Whether a group that restores a checkpoint wraps first and restores into the wrapped state
        (:meth:`state_objects` of the wrapped module), rather than into the unwrapped module before
        :meth:`wrap`. Default False (DDP: every rank holds the whole state either way). A sharded
        strategy: True, so that each rank reads only the regions of its own shards and no rank
        ever holds the full model or optimizer state."""
        return False

    def covers(self, group: Any, agreement: Agreement, module: torch.nn.Module, optimizer: torch.optim.Optimizer,
               *, step: int, local_world_size: int) -> bool:
        """Whether the live holders of the newest step (``agreement``) hold the whole state (or, for a
        strategy that keeps older steps in memory, the live ranks hold an older step whole:
        :meth:`rebuild_step`), so that :meth:`transfer_state` can give every rank its part of it;
        called on every rank of a group that forms when some rank holds state and :attr:`live_transfer` is True, before
        :meth:`unwrapped`. Default: True (every holder holds the whole of a replica). A sharded
        strategy announces its regions and plans their moves here (a collective over the gloo
        ``group``); False makes every rank restore the newest checkpoint.

        Args:
            group: The new generation's gloo group.
            agreement: What the ranks hold (:func:`~elastictrain.train.state_transfer.agree`).
            module: The model as the previous generation left it (sharded over its old mesh).
            optimizer: Its optimizer.
            step: This rank's committed step.
            local_world_size: Workers per node in the new generation.
        """
        return True

    def unwrapped(self, module: torch.nn.Module, optimizer: torch.optim.Optimizer) -> torch.nn.Module:
        """The module the next generation restores into, receives into and wraps: ``module``
        itself by default. A strategy whose wrapping cannot be undone (FSDP2 shards a module once)
        returns a fresh unsharded module of the same structure, its values not yet set, with
        ``optimizer`` re-pointed at its parameters and its state dropped; the session's model
        becomes that module (``session.model``, ``session.module``). No collective."""
        return module

    def transfer_state(self, group: Any, agreement: Agreement, objects: Mapping[str, Any], *, step: int) -> bool:
        """Bring the ranks without the newest state to it from live holders (a collective over the
        gloo ``group``); returns whether this rank received it. Default: the replicated transfer
        (:func:`~elastictrain.train.state_transfer.transfer`).

        Raises:
            SessionError: The strategy declared no live transfer (:attr:`live_transfer`).
            ConfigError: A holder's state cannot be sent (see ``transfer``).
        """
        if not self.live_transfer:
            raise SessionError(f"the {self.name} strategy holds no replicated state to transfer live")
        return transfer(group, agreement, objects, step=step)

    def rebuild_step(self, agreement: Agreement) -> int | None:
        """The step :meth:`transfer_state` brought every rank to: the agreed newest one
        (``agreement.step``, the default), or an older one that :meth:`covers` found the live ranks
        hold whole when they lack part of the newest (a sharded strategy's in-memory copies: every
        rank rolls back to it and the steps after it are redone)."""
        return agreement.step

    def keep_state(self, objects: Callable[[], Mapping[str, Any]]) -> None:
        """Given once by the session: its training state by name, as a checkpoint writes it
        (:meth:`~elastictrain.train.group_keeper.GroupKeeper.objects`), for a strategy that keeps
        copies of older steps in memory to roll back to (fsdp's ``redundancy_every``). Default:
        not kept."""
        return

    @abstractmethod
    def full_state_dict(self, module: torch.nn.Module) -> dict[str, Any]:
        """The model's full (unsharded) tensors by name, for export or evaluation; rank 0's is
        complete (a sharded strategy gathers them there: a collective, on every rank)."""

    @abstractmethod
    def _wrap(self, module: torch.nn.Module, optimizer: torch.optim.Optimizer, view: GroupView, *,
              identical: bool) -> torch.nn.Module:
        """See :meth:`wrap` (the group is distributed and nothing is wrapped)."""

    @abstractmethod
    def _leave(self) -> None:
        """See :meth:`leave` (called once per :meth:`wrap`)."""


def register_strategy(name: str, factory: StrategyFactory) -> None:
    """Make ``sharding=name`` build its strategy with ``factory(config)`` (a module registers its
    strategies when imported; registering a name again replaces it).

    Raises:
        ValueError: ``name`` is not one of :data:`SHARDINGS`.
    """
    if name not in SHARDINGS:
        raise ValueError(f"sharding {name!r} is none of {SHARDINGS}")
    _registry[name] = factory


def create_strategy(config: SessionConfig) -> ParallelStrategy:
    """The strategy ``config.sharding`` names, built for ``config``.

    Raises:
        ConfigError: Its strategy is not available (its module is not there yet, or did not
            register it). ``SessionConfig`` refuses a name that is none of :data:`SHARDINGS`.
    """
    name = config.sharding
    if name not in _registry:
        home = _HOMES[name]
        try:
            importlib.import_module(home)
        except ModuleNotFoundError as exc:
            if exc.name != home:
                raise  # the module is there, something it imports is not
    factory = _registry.get(name)
    if factory is None:
        raise ConfigError(f"sharding={name!r} is not available yet (issue 41); 'ddp' is")
    return factory(config)
