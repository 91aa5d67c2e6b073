"""The step-boundary vote taken in a collective of its own: :func:`explicit_vote`.

Under in-process recovery the ranks agree after each step whether to re-form the group
(their agents want a new generation). DDP carries the vote on its gradient all-reduce
(:class:`~elastictrain.train.ddp.BoundaryFlag`); what cannot carry it takes it here, with one
small all-reduce at the boundary.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from elastictrain.train import process_group as pg

__all__ = ["explicit_vote"]


def explicit_vote(wanted: bool, placement: pg.Placement, *, group: Any = None) -> int:
    """How many ranks of ``group`` (None: the default group, of ``placement``) voted to re-form:
    this rank votes ``wanted``; one all-reduce of one number (on the device under NCCL, which
    reduces device tensors only).

    Raises:
        The backend's error when the all-reduce fails (a peer died): the caller decides.
    """
    device = placement.device if "nccl" in str(placement.backend) else torch.device("cpu")
    vote = torch.tensor([1 if wanted else 0], dtype=torch.int32, device=device)
    dist.all_reduce(vote, op=dist.ReduceOp.SUM, group=group)
    return int(vote.item())
