"""The device mesh a sharded model lives on: 1-D for fsdp, 2-D for hsdp.

- ``"fsdp"``: every rank holds a shard of every unit; the mesh is ``(world,)``, named ``("fsdp",)``.
- ``"hsdp"``: shard within a node, replicate across nodes; the mesh is ``(replicas, nproc_per_node)``,
  named ``("replicate", "shard")``. Rank ``r`` sits at ``(r // nproc_per_node, r % nproc_per_node)``:
  a node's ranks (contiguous, as the launcher numbers them) form one shard group, and the ranks of
  the same local rank on every node form a replicate group.

With ``failures=`` (in-process recovery), each of the mesh's groups is a
:class:`~elastictrain.train.fsdp.failsafe_group.FailsafeGroup` over the group it would have been: a
collective failure inside a step is recorded there instead of raised in the user's forward.
"""

from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from elastictrain.errors import ConfigError
from elastictrain.train import peer_connections
from elastictrain.train.fsdp.failsafe_group import SwallowedFailure, failsafe_group
from elastictrain.train.process_group import resolve_timeout

__all__ = ["FSDP_DIMS", "HSDP_DIMS", "SHARDED_MODES", "build_mesh", "mesh_shape"]

SHARDED_MODES = ("fsdp", "hsdp")
"""The sharded modes (``"ddp"`` replicates and has no mesh)."""

FSDP_DIMS = ("fsdp",)
"""The dimension name of the fsdp mesh."""

HSDP_DIMS = ("replicate", "shard")
"""The dimension names of the hsdp mesh: across nodes, within a node."""


def mesh_shape(sharding: str, world_size: int, nproc_per_node: int | None = None) -> tuple[int, ...]:
    """The mesh shape of ``sharding`` at ``world_size`` ranks.

    Args:
        sharding: ``"fsdp"`` or ``"hsdp"``.
        world_size: Ranks in the group.
        nproc_per_node: hsdp's shard group width (ranks per node); ignored by fsdp.

    Raises:
        ConfigError: An unknown mode, or a world that the hsdp mesh does not tile.
    """
    if sharding not in SHARDED_MODES:
        raise ConfigError(f"sharding must be one of {SHARDED_MODES}, got {sharding!r}")
    if world_size < 1:
        raise ConfigError(f"world size must be at least 1, got {world_size}")
    if sharding == "fsdp":
        return (world_size,)
    if nproc_per_node is None or nproc_per_node < 1:
        raise ConfigError(f"hsdp needs nproc_per_node (the ranks per node, a positive int), got {nproc_per_node!r}")
    if world_size % nproc_per_node:
        raise ConfigError(f"hsdp needs a world size that is a multiple of nproc_per_node: "
                          f"{world_size} ranks do not fill nodes of {nproc_per_node}")
    return (world_size // nproc_per_node, nproc_per_node)


def build_mesh(sharding: str, device_type: str, *, nproc_per_node: int | None = None,
               group: dist.ProcessGroup | None = None, timeout: timedelta | None = None,
               failures: SwallowedFailure | None = None) -> DeviceMesh:
    """The device mesh of ``sharding`` over ``group`` (default: the whole default group); a collective.

    Args:
        sharding: ``"fsdp"`` or ``"hsdp"``.
        device_type: ``"cpu"`` or ``"cuda"``: where the parameters live.
        nproc_per_node: hsdp's shard group width.
        group: Train over this group instead of the default one (fsdp only: the 2-D mesh of hsdp
            forms its sub-groups over the default group).
        timeout: The collective timeout of hsdp's sub-groups: the default group's, so that a hung
            or lost peer is noticed as soon as in DDP; None: ``resolve_timeout()`` (``ELASTICTRAIN_PG_TIMEOUT``
            or 60 s). (``init_device_mesh`` would give them torch's default for the backend, 30
            minutes for gloo: a rank hung in an hsdp step went unnoticed that long.) fsdp trains
            over ``group`` itself, with its own timeout.
        failures: Make each of the mesh's groups a failsafe group over it, recording a collective
            failure here while ``failures`` swallows (in-process recovery).

    Raises:
        ConfigError: See :func:`mesh_shape`; hsdp over a group that is not the default one.
    """
    if not dist.is_initialized():
        raise ConfigError(f"sharding={sharding!r} needs an initialized process group")
    world = dist.get_world_size(group)
    shape = mesh_shape(sharding, world, nproc_per_node)
    if group is not None and group is not dist.group.WORLD:
        if sharding == "hsdp":
            raise ConfigError("hsdp trains over the default process group; got an explicit process_group")
        if failures is not None:
            group = failsafe_group(group, failures)
        return DeviceMesh.from_group(group, device_type, mesh_dim_names=FSDP_DIMS)
    if sharding == "fsdp":
        default = dist.group.WORLD
        if failures is None or default is None:
            return init_device_mesh(device_type, shape, mesh_dim_names=FSDP_DIMS)
        return DeviceMesh.from_group(failsafe_group(default, failures), device_type, mesh_dim_names=FSDP_DIMS)
    return _hsdp_mesh(device_type, shape, timeout if timeout is not None else resolve_timeout(), failures)


def _hsdp_mesh(device_type: str, shape: tuple[int, ...], timeout: timedelta,
               failures: SwallowedFailure | None) -> DeviceMesh:
    """hsdp's 2-D mesh over the default group, its sub-groups made here with ``timeout`` (each
    wrapped in a failsafe group with ``failures``)."""
    replicas, width = shape
    ranks = torch.arange(replicas * width).view(replicas, width)
    # new_group is a collective of the default group: every rank makes every group, in one order.
    shard_groups = [_sub_group(ranks[i].tolist(), timeout) for i in range(replicas)]
    replicate_groups = [_sub_group(ranks[:, j].tolist(), timeout) for j in range(width)]
    replica, local = divmod(dist.get_rank(), width)
    shard, replicate = shard_groups[replica], replicate_groups[local]
    if failures is not None:
        shard, replicate = failsafe_group(shard, failures, timeout), failsafe_group(replicate, failures, timeout)
    return DeviceMesh.from_group([replicate, shard], device_type, mesh=ranks, mesh_dim_names=HSDP_DIMS)


def _sub_group(ranks: list[int], timeout: timedelta) -> dist.ProcessGroup:
    """``dist.new_group(ranks)`` (a collective of the default group). A member's connections to its
    peers go on record (:mod:`~elastictrain.train.peer_connections`): a rank that leaves the group
    in place severs them, and a peer blocked on it in a collective of this group fails at once
    instead of after ``timeout``."""
    if dist.get_rank() not in ranks:
        return dist.new_group(ranks, timeout=timeout)
    with peer_connections.recording(len(ranks) - 1) as connections:
        group = dist.new_group(ranks, timeout=timeout)
    peer_connections.keep(group, connections)
    return group
