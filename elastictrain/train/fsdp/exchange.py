"""The region exchange: a re-formed sharded group rebuilds its shards from its ranks' memory.

After the new group forms, every rank announces what it holds, each piece with its step: the
regions of the sharded state (its own shards of the previous generation,
:func:`~elastictrain.train.fsdp.holdings.own_holdings`, and, under ``redundancy_every``, its
snapshots of them and the copy of its buddy's at the steps of the refreshes), the steps whose
replicated state it holds, and the tensors of the state (key, global shape, dtype): small JSON
metadata, gathered as bytes, never unpickled. Every rank then picks the same step, the newest
one held whole (:func:`~elastictrain.train.fsdp.rollback.choose_rebuild`: the agreed newest
step, or an older one that every rank rolls back to), and plans the same moves
(:func:`~elastictrain.train.fsdp.regions.plan_exchange`) for the boxes the new layout gives
each rank; when no step is held whole, :attr:`Exchange.covered` is False and the caller
restores the newest checkpoint instead (every rank knows it from the same plan). Otherwise
:meth:`Exchange.run` moves the bytes point to point over the gloo group and returns this
rank's boxes, which the strategy copies into the local tensors of its new shards."""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from elastictrain.errors import SessionError
from elastictrain.train.fsdp.holdings import Holding
from elastictrain.train.fsdp.regions import Move, Plan, Region, TensorSpec, needed_regions, plan_exchange
from elastictrain.train.fsdp.rollback import choose_rebuild

logger = logging.getLogger(__name__)

__all__ = ["Exchange", "announce", "buffer_holdings", "state_specs"]

_VERSION = 3
"""Of the announcement's JSON: each region as a run of integers (a re-formation announces thousands:
~400 tensors of an LM's parameters and AdamW state, each held at a few steps), its key by index
into the rank's key list; a list or a string per region made the parse slow (and wake the garbage
collector) in a process that holds a model."""


def state_specs(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, tuple[TensorSpec, torch.dtype]]:
    """Each tensor of a sharded model's state (the keys of
    :func:`~elastictrain.train.fsdp.holdings.own_holdings`), with its global shape and dtype."""
    def spec(key: str, value: torch.Tensor) -> tuple[TensorSpec, torch.dtype]:
        return TensorSpec(key, tuple(value.shape), isinstance(value, DTensor) and any(
            p.is_shard() for p in value.placements)), value.dtype

    specs = {f"model/{fqn}": spec(f"model/{fqn}", t) for fqn, t in [*model.named_parameters(), *model.named_buffers()]}
    names = {id(param): fqn for fqn, param in model.named_parameters()}
    for group in optimizer.param_groups:
        for param in group["params"]:
            for name, value in optimizer.state.get(param, {}).items():
                if isinstance(value, torch.Tensor):
                    key = f"optimizer/{names[id(param)]}/{name}"
                    specs[key] = spec(key, value)
    return specs


def buffer_holdings(model: torch.nn.Module, step: int) -> list[Holding]:
    """The model's buffers, whole, as holdings at ``step``: FSDP2 does not shard them, every rank
    holds all of each (:func:`~elastictrain.train.fsdp.holdings.own_holdings` leaves them out)."""
    return [Holding(f"model/{fqn}", (0,) * b.dim(), tuple(b.shape), step, b.detach().contiguous())
            for fqn, b in model.named_buffers()]


def _dtype(name: str) -> torch.dtype:
    value = getattr(torch, name.removeprefix("torch."), None)
    if not isinstance(value, torch.dtype):
        raise SessionError(f"a peer announced an unknown dtype {name!r}")
    return value


def _gather_json(group: Any, mine: dict[str, Any]) -> list[dict[str, Any]]:
    """Every rank's ``mine`` (JSON), gathered over ``group``; a collective."""
    data = torch.frombuffer(bytearray(json.dumps(mine).encode()), dtype=torch.uint8)
    world = dist.get_world_size(group)
    sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(world)]
    dist.all_gather(sizes, torch.tensor([data.numel()], dtype=torch.int64), group=group)
    longest = max(int(s.item()) for s in sizes)
    padded = torch.zeros(longest, dtype=torch.uint8)
    padded[:data.numel()] = data
    everyone = [torch.zeros(longest, dtype=torch.uint8) for _ in range(world)]
    dist.all_gather(everyone, padded, group=group)
    return [json.loads(t[:int(s.item())].numpy().tobytes().decode()) for t, s in zip(everyone, sizes, strict=True)]


def _regions(peer: int, keys: Any, flat: Any) -> list[tuple[int, Region]]:
    """The regions a rank announced (see :data:`_VERSION`), each with its step.

    Raises:
        ValueError: Not a list of string keys and a list of integers that spell regions of them.
    """
    if not (isinstance(keys, list) and isinstance(flat, list) and all(type(k) is str for k in keys)
            and all(type(v) is int for v in flat)):
        raise ValueError("keys are not strings, or the regions not integers")
    out, at, end = [], 0, len(flat)
    while at < end:
        if at + 3 > end:
            raise ValueError(f"a region cut short at {at}")
        step, index, dims = flat[at:at + 3]
        stop = at + 3 + 2 * dims
        if not 0 <= index < len(keys) or dims < 0 or stop > end:
            raise ValueError(f"a region at {at} names key {index} of {len(keys)}, {dims} dimension(s)")
        out.append((step, Region(peer, keys[index], tuple(flat[at + 3:at + 3 + dims]),
                                 tuple(flat[at + 3 + dims:stop]))))
        at = stop
    return out


def _global_rank(group: Any, rank: int) -> int:
    return dist.get_global_rank(group, rank) if group is not None else rank


def _rows(tensor: torch.Tensor, offset: int, rows: tuple[int, int]) -> torch.Tensor:
    """Rows ``rows`` (global) of ``tensor``, whose first row is global row ``offset``; a 0-d tensor whole."""
    if tensor.dim() == 0:
        return tensor
    return tensor.narrow(0, rows[0] - offset, rows[1] - rows[0])


@dataclass(frozen=True, slots=True)
class Exchange:
    """What the ranks agreed to move (see the module docstring)."""

    rank: int
    """This rank in the new group."""
    step: int | None
    """The step the state is rebuilt at: the newest one the live ranks hold whole
    (:func:`~elastictrain.train.fsdp.rollback.choose_rebuild`); None when none is."""
    plan: Plan
    """Every rank's moves at :attr:`step`; with no step held whole, the newest step's plan, and
    what no rank holds of it."""
    holders: tuple[int, ...]
    """The ranks that hold the replicated state (sampler cursor, scheduler, ...) of :attr:`step`."""
    needs: tuple[Region, ...]
    """This rank's boxes in the new layout."""
    specs: dict[str, tuple[TensorSpec, torch.dtype]]
    """Each tensor of the state, with its dtype."""
    held: tuple[Holding, ...]
    """What this rank holds at :attr:`step`."""

    @property
    def covered(self) -> bool:
        """Whether the ranks' memory holds every region of the state at some step (:attr:`step`)."""
        return self.step is not None

    def run(self, group: Any) -> dict[str, tuple[TensorSpec, torch.Tensor]]:
        """Move the bytes: this rank's box of each tensor, by key, with the tensor's spec (a collective over the gloo
        ``group``: every rank runs it, each posting its sends and receives in the plan's order).

        Raises:
            SessionError: No step is covered.
            RuntimeError: A send or receive failed (a peer died).
        """
        if not self.covered:
            raise SessionError(f"{len(self.plan.uncovered)} region(s) of the sharded state are held by no rank")
        out = {need.key: (need, torch.empty(need.sizes, dtype=self.specs[need.key][1])) for need in self.needs}
        works = []
        for tag, move in enumerate(self.plan.moves):
            if self.rank == move.dst:
                need, tensor = out[move.key]
                target = _rows(tensor, need.offsets[0] if need.sizes else 0, move.rows)
                if move.src == self.rank:
                    target.copy_(self._source(move))
                else:
                    works.append(dist.irecv(target, _global_rank(group, move.src), group=group, tag=tag))
            elif self.rank == move.src:
                works.append(dist.isend(self._source(move).contiguous(), _global_rank(group, move.dst),
                                        group=group, tag=tag))
        for work in works:
            if work is not None:
                work.wait()
        moved = sum(m.rows[1] - m.rows[0] for m in self.plan.moves if m.src != m.dst)
        logger.debug("exchanged %d region(s), %d row(s) between ranks", len(self.plan.moves), moved)
        return {key: (self.specs[key][0], tensor) for key, (_, tensor) in out.items()}

    def _source(self, move: Move) -> torch.Tensor:
        """The rows ``move`` sends, from this rank's holdings: one holding's, or adjacent ones'
        joined (the plan merges a rank's adjacent pieces into one move: its own snapshot beside
        the copy of the neighbouring rank's shard)."""
        low, high = move.rows
        parts: list[torch.Tensor] = []
        while low < high:
            for held in self.held:
                start = held.offsets[0] if held.sizes else 0
                stop = start + (held.sizes[0] if held.sizes else 1)
                if held.key == move.key and start <= low < stop:
                    parts.append(_rows(held.tensor, start, (low, min(stop, high))).to("cpu"))
                    low = min(stop, high)
                    break
            else:
                raise SessionError(f"the plan has rank {self.rank} send rows {move.rows} of {move.key}, which it "
                                   "does not hold")
        return parts[0] if len(parts) == 1 else torch.cat(parts)


def announce(group: Any, *, held: Sequence[Holding], specs: dict[str, tuple[TensorSpec, torch.dtype]],
             replicated: Sequence[int], newest: int, shard_width: int) -> Exchange:
    """Say what this rank holds, at which steps, learn what every rank holds, pick the step to
    rebuild at (:func:`~elastictrain.train.fsdp.rollback.choose_rebuild`) and plan the moves; a
    collective over the gloo ``group``.

    Args:
        group: The new generation's gloo group.
        held: This rank's holdings, each with its step.
        specs: The tensors of the state, as this rank knows them (:func:`state_specs`; a rank
            that holds nothing passes ``{}`` and learns them from the holders).
        replicated: The steps whose replicated state (sampler cursor, scheduler, ...) this rank holds.
        newest: The agreed newest step (what the log says is lacking when no step is covered).
        shard_width: Ranks per shard group in the new layout (see
            :func:`~elastictrain.train.fsdp.regions.needed_regions`).

    Raises:
        SessionError: No rank announced the state's tensors, or a peer announced bad metadata.
        RuntimeError: The collective failed (a peer died).
    """
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    keys: dict[str, int] = {}
    flat: list[int] = []
    for h in held:  # each region as integers: step, key index, rank of the box, offsets, sizes
        flat += (h.step, keys.setdefault(h.key, len(keys)), len(h.sizes), *h.offsets, *h.sizes)
    mine = {"version": _VERSION, "replicated": sorted(set(replicated)), "keys": list(keys), "regions": flat,
            "specs": [[s.key, list(s.shape), s.sharded, str(d)] for s, d in specs.values()]}
    everyone = _gather_json(group, mine)
    regions: dict[int, list[Region]] = {}
    holding: dict[int, list[int]] = {}
    known: dict[str, tuple[TensorSpec, torch.dtype]] = {}
    for peer, said in enumerate(everyone):
        if said.get("version") != _VERSION:
            raise SessionError(f"rank {peer} announced its holdings in another version ({said.get('version')!r}, "
                               f"this rank speaks {_VERSION})")
        try:
            for step, region in _regions(peer, said["keys"], said["regions"]):
                regions.setdefault(step, []).append(region)
            for step in said["replicated"]:
                holding.setdefault(int(step), []).append(peer)
            for key, shape, sharded, dtype in said["specs"]:
                known.setdefault(str(key), (TensorSpec(str(key), tuple(map(int, shape)), bool(sharded)),
                                            _dtype(dtype)))
        except (KeyError, TypeError, ValueError) as exc:
            raise SessionError(f"rank {peer} announced malformed holdings: {exc!r}") from exc
    if not known:
        raise SessionError(f"no rank announced the sharded state of step {newest}")
    needs = needed_regions((s for s, _ in known.values()), world, shard_width)
    rebuild = choose_rebuild(regions, holding, needs)
    mine_needed = tuple(n for n in needs if n.rank == rank)
    if rebuild is None:
        plan = plan_exchange(regions.get(newest, ()), needs)
        first = plan.uncovered[0] if plan.uncovered else None
        logger.info("the ranks' memory holds no step whole; of step %d it lacks %d region(s)%s", newest,
                    len(plan.uncovered), f" (first: {first.key} rows {first.rows} of rank {first.rank}'s share)"
                    if first is not None else "")
        return Exchange(rank, None, plan, (), mine_needed, known, ())
    if rebuild.step != newest:
        logger.info("the ranks' memory holds step %d whole, not the newest (%d): every rank rolls back to it",
                    rebuild.step, newest)
    return Exchange(rank, rebuild.step, rebuild.plan, rebuild.holders, mine_needed, known,
                    tuple(h for h in held if h.step == rebuild.step))
