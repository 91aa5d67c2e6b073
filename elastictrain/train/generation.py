"""One generation of a session's training group, and what is built on it.

A :class:`~elastictrain.train.session.Session` trains through a sequence of
generations: the group it starts in, then, under in-process recovery, each group
its agent re-forms after a fault or a membership change. What depends on the
group (the model wrapped by the parallelism strategy, the gloo group the state
travels over, the checkpoint manager coordinating over the group) is built on one
:class:`Generation` and dropped with it; what outlives a generation (the model,
the optimizer, the sampler, the committed step) stays with the session.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.distributed as dist

from elastictrain.train import peer_connections, process_group as pg
from elastictrain.checkpoint import CheckpointManager, TorchDistributedCoordinator
from elastictrain.errors import CheckpointError, CheckpointWriteError, ConfigError
from elastictrain.train.control import WorkerControl
from elastictrain.train.recovery import abort_default_group
from elastictrain.train.session_config import SessionConfig
from elastictrain.train.strategy import GroupView, ParallelStrategy

__all__ = ["Generation"]

logger = logging.getLogger(__name__)

_INT63 = (1 << 63) - 1
"""What of a setting crosses ranks in an int64 (a seed may take 64 bits)."""


class Generation:
    """The group a session trains in now, and the wrappers built on it.

    Args:
        placement: Device, backend, rank and world of the group.
        group: The caller's process group (``Session(process_group=...)``), or None for
            the default group, which the session forms and destroys.
        in_process: Whether faults and membership changes are recovered in this process
            (the agent's control channel is open and the group is distributed).
        strategy: How the model trains over the group (the session's, for every generation).
        local_world_size: Workers per node.
    """

    def __init__(self, placement: pg.Placement, group: dist.ProcessGroup | None, *, in_process: bool,
                 strategy: ParallelStrategy, local_world_size: int = 1) -> None:
        self.placement = placement
        self.group = group
        self.in_process = in_process
        self.strategy = strategy
        self.local_world_size = local_world_size
        self.model: torch.nn.Module | None = None
        """What the forward runs through, as the strategy wrapped it (None when not distributed)."""
        self.forwards = 0
        """Forward passes through :attr:`model` (the step loop resets it: a step whose last
        micro-batch ran none did not synchronize its gradients)."""
        self.checkpoints: CheckpointManager | None = None
        self._gloo: Any = None
        self._checkpoint_group: Any = None

    def cpu_group(self) -> Any:
        """A gloo group of this generation, for the state transfer: the caller's group, the
        default one (None) when it is gloo, else a gloo group made once."""
        if self.group is not None:
            return self.group
        if self.placement.backend == "gloo":
            return None
        if self._gloo is None:
            self._gloo = pg.new_gloo_group(self.placement.timeout)
        return self._gloo

    def check_same_settings(self, settings: Mapping[str, int | bool | None]) -> None:
        """Refuse a group whose ranks were given different ``settings``; a collective (a small one).

        Ranks that plan different data or a different number of steps would train apart
        silently, or one would finish while the others wait on it forever.

        Raises:
            ConfigError: Some rank's value differs (every rank raises it).
        """
        placement = self.placement
        if not placement.distributed:
            return
        # In-process: over gloo, as the state's agreement (a dead peer fails it at once). Else over
        # the group as it is: the caller's may be NCCL's, which gathers device tensors.
        group = self.cpu_group() if self.in_process else self.group
        nccl = not self.in_process and "nccl" in str(placement.backend)
        mine = torch.tensor([-1 if v is None else int(v) & _INT63 for v in settings.values()], dtype=torch.int64,
                            device=placement.device if nccl else torch.device("cpu"))
        everyone = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
        dist.all_gather(everyone, mine, group=group)
        rows = [t.tolist() for t in everyone]
        for index, name in enumerate(settings):
            values = [row[index] for row in rows]
            if len(set(values)) > 1:
                by_rank = ", ".join(f"rank {rank}: {'None' if v == -1 else v}" for rank, v in enumerate(values))
                raise ConfigError(f"ranks disagree on {name} ({by_rank}): every rank must run the same "
                                  "script with the same settings and data")

    def open_checkpoints(self, config: SessionConfig, control: WorkerControl | None, *,
                         on_write_failure: Callable[[int, CheckpointWriteError], None] | None = None,
                         ) -> CheckpointManager:
        """The checkpoint manager of this generation, coordinating over its group.

        ``fence=True``: this world claims the directory before it restores, so a stale world
        (cut off from etcd while this one formed) can no longer commit there.
        ``on_write_failure``: says that a save could not write (see ``CheckpointManager``).
        """
        assert config.checkpoint_dir is not None  # noqa: S101 - the caller checks
        coordinator = None
        superseded = control.superseded if control is not None else None
        if self.group is not None:
            coordinator = TorchDistributedCoordinator(self.group)
        elif self.placement.distributed:
            # A gloo group of the checkpoint's own (its saves run on a thread of their own),
            # made here so that leaving the generation can sever it, and so that a save that
            # waits for a peer's files stops once that peer is gone.
            self._checkpoint_group = pg.new_gloo_group(self.placement.timeout)
            coordinator = TorchDistributedCoordinator(self._checkpoint_group)
            superseded = _replaced_or_peer_lost(control, self._checkpoint_group)
        self.checkpoints = CheckpointManager(
            config.checkpoint_dir, keep_last=config.keep_last, async_save=config.async_save,
            overlap=config.overlap_save, coordinator=coordinator, timeout=self.placement.timeout, fence=True,
            superseded=superseded, save_timeout=config.checkpoint_timeout, on_write_failure=on_write_failure,
        )
        return self.checkpoints

    def wrap(self, module: torch.nn.Module, optimizer: torch.optim.Optimizer, *, identical: bool,
             control: WorkerControl | None) -> None:
        """Wrap ``module`` over this group with the session's strategy (usually a collective;
        ``identical``: every rank already holds the same state), see
        :meth:`~elastictrain.train.strategy.ParallelStrategy.wrap`. Each forward through what it
        returns (:attr:`model`) counts in :attr:`forwards`.

        Under in-process recovery, once the agent announced the next generation and no step
        finished for a while (a collective waits for a peer that is gone without closing its
        connections: a host lost, a network cut), the liveness thread of ``control`` ends the
        wait: it aborts NCCL's communicators, or shuts down this group's gloo connections
        (:func:`~elastictrain.train.peer_connections.shut_down`). The collective fails at once instead
        of after the group's timeout, and the rank re-forms."""
        if not self.placement.distributed:
            return
        view = GroupView(placement=self.placement, group=self.group, in_process=self.in_process,
                         local_world_size=self.local_world_size)
        self.model = self.strategy.wrap(module, optimizer, view, identical=identical)
        self.model.register_forward_pre_hook(self._count_forward)
        if self.in_process and control is not None:
            backend = self.placement.backend or ""
            if "nccl" in backend:
                control.on_stuck(abort_default_group)
            elif backend == "gloo":
                # This group's connections: the callback runs on another thread, maybe once
                # this rank has formed the next group (which it must not touch).
                # The checkpoint group's too: a save in flight waits there for a peer that is gone;
                # and the strategy's own groups' (hsdp's gradient all-reduce across replicas). Then the
                # strategy ends the waits gloo does not (fsdp's: a send half written to a peer that is gone).
                groups = (self._checkpoint_group, *self.strategy.own_groups())
                connections = peer_connections.on_record(None) + tuple(
                    connection for group in groups if group is not None
                    for connection in peer_connections.on_record(group))
                control.on_stuck(functools.partial(_shut_down_stuck, connections, self.strategy.on_cut()),
                                 in_collective_only=True, lost=functools.partial(peer_connections.closed, connections))

    def _count_forward(self, *_: Any) -> None:
        self.forwards += 1

    def leave(self) -> CheckpointError | None:
        """Drop the group and what was built on it, without a collective (peers may be dead):
        a checkpoint save in flight fails at its barrier, so nothing commits.

        Returns:
            Why an asynchronous save in flight was abandoned, if one was.

        The training groups' connections are severed first (:func:`~elastictrain.train.peer_connections.sever`):
        a peer blocked on this rank in a collective, or a DDP bucket still queued here, fails at
        once instead of after the group's timeout, and so does a save that waits for that peer.
        """
        peer_connections.sever(None, self._gloo)
        self.strategy.leave()
        self.model = None
        checkpoints, self.checkpoints = self.checkpoints, None
        try:
            if checkpoints is not None:
                checkpoints.close()
        except CheckpointError as exc:
            return exc
        finally:
            if self._checkpoint_group is not None:
                peer_connections.sever(self._checkpoint_group)  # a peer whose save still waits on this rank fails now
            self._gloo = self._checkpoint_group = None
            pg.destroy_process_group()

    def end(self) -> None:
        """Drop the wrappers and destroy the group if the session formed it (the run is over), else
        the gloo groups the session made in the caller's."""
        self.strategy.end()
        self.model = None
        made = [g for g in (self._gloo, self._checkpoint_group) if g is not None]
        self._gloo = self._checkpoint_group = None
        if self.placement.owned:
            pg.destroy_process_group()  # and every group made in it
            return
        for group in made:  # made here in the caller's world, which lives on
            try:
                dist.destroy_process_group(group)
            except (RuntimeError, ValueError) as exc:
                logger.warning("could not destroy a gloo group of the session: %s", exc)


def _shut_down_stuck(connections: tuple[tuple[int, int], ...], cut: Callable[[], None] | None) -> None:
    if peer_connections.shut_down(connections):
        logger.warning("a collective is stuck on a peer that is gone: shut down this group's connections")
        if cut is not None:
            cut()


def _replaced_or_peer_lost(control: WorkerControl | None, group: dist.ProcessGroup) -> Callable[[], bool]:
    """What ends a save's wait for its peers' checkpoint files early: the agent announced the next
    generation, or a peer's connection in the checkpoint ``group`` closed (it died, or left)."""
    def check() -> bool:
        return (control is not None and control.superseded()) or peer_connections.lost_peer(group)
    return check
