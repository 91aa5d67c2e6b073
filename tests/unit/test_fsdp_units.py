"""The FSDP units option (``Session(..., shard_units=...)``, ``ShardingConfig.units``): per-block
units and tied weights, against DDP on real gloo processes, and its pure parts.

The process test runs two ranks (:func:`_worker`). Float64 throughout, so sharded and DDP runs agree
to summation order. Rows of 11 and 7 leave uneven shares at 2 ranks. It checks, for an untied and
a GPT-2-style tied model with one unit per block (and the tied one with the default units):
gradients at every step and parameters after the steps equal DDP's; the tied parameter stays one
``Parameter`` in the root's unit with one optimizer entry; a sharded checkpoint stores it once and
restores it tied (sharded, and into a DDP job's model); a ``Session`` with ``shard_units`` ends
equal to a DDP session; a module rebuilt from the skeleton (in-process recovery) gets the units of
the same FQNs, even from a predicate that judged modules by identity.

The process test forks :func:`_worker` as every rank from the ranks' forkserver (``fork_ranks``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from elastictrain.errors import ConfigError
from elastictrain.train.fsdp import ShardingConfig, sharding_units
from tests.support.ranks import fork_ranks

WORLD = 2
TOLERANCE = 1e-12
VOCAB, WIDTH = 11, 7
pytestmark = pytest.mark.timeout(120)


class Block(torch.nn.Module):
    """A stand-in for a transformer block."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = torch.nn.Linear(WIDTH, WIDTH)
        self.outer = torch.nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.outer(torch.tanh(self.inner(x)))


class LM(torch.nn.Module):
    """Embedding, two blocks, a norm and an output layer; ``tied``: the output layer holds the
    embedding's weight (GPT-2 style)."""

    def __init__(self, tied: bool) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, WIDTH)
        self.blocks = torch.nn.Sequential(Block(), Block())
        self.norm = torch.nn.LayerNorm(WIDTH)
        self.head = torch.nn.Linear(WIDTH, VOCAB, bias=False)
        if tied:
            self.head.weight = self.embed.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(self.blocks(self.embed(ids))))


def _lm(tied: bool, seed: int = 0) -> LM:
    torch.manual_seed(seed)
    return LM(tied).double()


# --- pure parts ---------------------------------------------------------------------------------


def test_per_block_units_come_from_a_class_a_collection_of_classes_or_a_predicate() -> None:
    model = _lm(tied=False)
    blocks = ["blocks.0", "blocks.1"]
    for spec in (Block, {Block}, frozenset({Block}), [Block], (Block, torch.nn.LayerNorm)):
        chosen = [fqn for fqn, _ in sharding_units(model, spec)]
        assert chosen == (blocks + ["norm"] if isinstance(spec, tuple) else blocks), spec
    assert [fqn for fqn, _ in sharding_units(model, lambda fqn, _m: fqn.startswith("blocks."))] == [
        "blocks.0.inner", "blocks.0.outer", "blocks.0", "blocks.1.inner", "blocks.1.outer", "blocks.1"]
    assert [fqn for fqn, _ in sharding_units(model)] == ["embed", "blocks", "norm", "head"]


def test_a_unit_never_splits_a_tied_parameter_which_goes_to_the_common_ancestor_unit() -> None:
    tied = _lm(tied=True)
    # Default units: the embedding and the output layer share a weight, so neither is a unit of
    # its own; the root holds it.
    assert [fqn for fqn, _ in sharding_units(tied)] == ["blocks", "norm"]
    assert [fqn for fqn, _ in sharding_units(tied, {Block, torch.nn.Embedding})] == ["blocks.0", "blocks.1"]
    # A unit holding every module that shares it keeps it; units nested in that unit stay.
    outer = torch.nn.Sequential(torch.nn.Linear(2, 2), tied)
    chosen = sharding_units(outer, lambda fqn, _m: fqn in {"1", "1.embed", "1.head", "1.blocks.0"})
    assert [fqn for fqn, _ in chosen] == ["1.blocks.0", "1"]
    # One module under two names (weights shared across blocks, ALBERT style): neither block alone.
    shared = _lm(tied=False)
    shared.blocks[1].inner = shared.blocks[0].inner
    assert [fqn for fqn, _ in sharding_units(shared, Block)] == []
    assert [fqn for fqn, _ in sharding_units(shared)] == ["embed", "blocks", "norm", "head"]


@pytest.mark.parametrize(("value", "words"), [
    ("Block", "shard_units must be a torch.nn.Module subclass, a collection of them or a predicate "
              "(fqn, module) -> bool, got str 'Block'"),
    (set(), "shard_units is an empty set: name at least one module class"),
    ({Block, int}, "got type <class 'int'>"),
    (3, "got int 3"),
    (Block(), "shard_units must name module classes, got a Block instance: pass Block itself"),
])
def test_a_bad_units_option_is_one_typed_line_naming_it(value: Any, words: str) -> None:
    from elastictrain.train.session_config import SessionConfig

    with pytest.raises(ConfigError) as caught:
        SessionConfig(global_batch_size=8, sharding="fsdp", shard_units=value)
    assert words in str(caught.value) and "\n" not in str(caught.value)
    with pytest.raises(ConfigError) as caught:
        ShardingConfig(units=value)
    assert "units" in str(caught.value) and "\n" not in str(caught.value)


def test_units_need_a_sharded_session() -> None:
    from elastictrain.train.session_config import SessionConfig

    with pytest.raises(ConfigError, match="shard_units needs sharding='fsdp' or 'hsdp', got sharding='ddp'"):
        SessionConfig(global_batch_size=8, shard_units=Block)
    assert SessionConfig(global_batch_size=8, sharding="hsdp", shard_units={Block}).shard_units == {Block}


# --- real processes on gloo ---------------------------------------------------------------------


def test_per_block_units_train_as_ddp_with_and_without_tied_weights_and_checkpoint_a_tied_weight_once(
        tmp_path: Path) -> None:
    fork_ranks(_worker, WORLD, lambda rank: (rank, tmp_path), timeout=110)
    checks = json.loads((tmp_path / "rank0.json").read_text())
    assert set(checks) == {
        "untied/grads", "untied/params", "tied/grads", "tied/params", "tied/restored", "tied/into_ddp",
        "tied/trained_on",
        "tied_default/grads", "tied_default/params", "session/untied", "session/tied", "rebuilt_units"}
    for name, error in checks.items():
        assert error <= TOLERANCE, f"{name}: max error {error}"


def _batches(rank: int, step: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    data = torch.Generator().manual_seed(100 * rank + step)
    for size in (2, 3):  # two micro-batches: accumulation, the first without a gradient sync
        yield torch.randint(0, VOCAB, (size, 5), generator=data), torch.randint(0, VOCAB, (size, 5), generator=data)


def _full(tensor: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def _error(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    assert [x.shape for x in a] == [y.shape for y in b]
    return max((x - y).abs().max().item() for x, y in zip(a, b, strict=True))


class Trainer:
    """One LM trained under DDP or sharded (one unit per block unless ``units`` says otherwise)."""

    def __init__(self, kind: str, tied: bool, units: Any = frozenset({Block})) -> None:
        import torch.distributed as dist
        from torch.nn.parallel import DistributedDataParallel

        from elastictrain.train.fsdp import shard

        self.rank = dist.get_rank()
        module = _lm(tied, seed=self.rank)  # rank 0's is broadcast
        self.optimizer = torch.optim.AdamW(module.parameters(), lr=0.01, weight_decay=0.05)
        self.sharded: Any = None
        self.module: torch.nn.Module = module
        if kind == "ddp":
            self.model: torch.nn.Module = DistributedDataParallel(module)
        else:
            self.sharded = shard(module, self.optimizer, ShardingConfig(units=units))
            self.model = module
        self.grads: list[list[torch.Tensor]] = []
        self.steps = 0

    def train(self, steps: int) -> None:
        for _ in range(steps):
            self.optimizer.zero_grad()
            batches = list(_batches(self.rank, self.steps))
            for index, (ids, targets) in enumerate(batches):
                last = index == len(batches) - 1
                sync = contextlib.nullcontext() if last else (
                    self.model.no_sync() if self.sharded is None else self.sharded.no_sync())  # type: ignore[operator]
                with sync:
                    logits = self.model(ids)
                    loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())
                    (loss / len(batches)).backward()
            self.grads.append([_full(p.grad) for p in self.module.parameters()])
            self.optimizer.step()
            self.steps += 1

    def params(self) -> list[torch.Tensor]:
        return [_full(p).detach() for p in self.module.parameters()]

    def grads_error(self, other: Trainer) -> float:
        assert len(self.grads) == len(other.grads) > 0
        return max(_error(a, b) for a, b in zip(self.grads, other.grads, strict=True))


def _units(module: torch.nn.Module) -> list[str]:
    from torch.distributed.fsdp import FSDPModule

    return [fqn for fqn, m in module.named_modules() if fqn and isinstance(m, FSDPModule)]


def _case_train(tied: bool, out: Path) -> dict[str, float]:
    """Per-block units against DDP; for the tied model, its checkpoint too."""
    import torch.distributed as dist

    from elastictrain.checkpoint import CheckpointManager

    name = "tied" if tied else "untied"
    ddp, sharded = Trainer("ddp", tied), Trainer("sharded", tied)
    assert _units(sharded.module) == ["blocks.0", "blocks.1"]
    lm = sharded.module
    assert isinstance(lm, LM)
    if tied:  # one Parameter, in the root's unit, one optimizer entry
        assert lm.head.weight is lm.embed.weight
    assert len(sharded.optimizer.param_groups[0]["params"]) == len(list(ddp.module.parameters())) == 12 - tied
    ddp.train(3)
    sharded.train(3)
    checks = {f"{name}/grads": ddp.grads_error(sharded), f"{name}/params": _error(ddp.params(), sharded.params())}
    if not tied:
        return checks
    directory = out / "ckpt"
    with CheckpointManager(directory) as manager:
        manager.save(3, sharded.sharded.state())
    manifest = json.loads((directory / "step_00000003" / "MANIFEST.json").read_text())
    index = manifest["tensors"]
    # Stored once: the two names point at the same chunks, and the shard files hold each float64
    # parameter and its two AdamW moments once (the step counts are plain tensors, replicated).
    assert index["model/head.weight"]["chunks"] == index["model/embed.weight"]["chunks"]
    unique = {(c["file"], c["byte_offset"]): c["byte_length"] for t in index.values() for c in t["chunks"]}
    stored = sum(f.stat().st_size for f in (directory / "step_00000003").glob("shards_*.bin"))
    assert stored == sum(unique.values()) == 3 * 8 * sum(p.numel() for p in ddp.module.parameters()), stored
    restored = Trainer("sharded", tied)
    with CheckpointManager(directory) as manager:
        info = manager.restore(restored.sharded.state())
    assert info is not None and info.step == 3
    restored.steps = 3
    restored_lm = restored.module
    assert isinstance(restored_lm, LM) and restored_lm.head.weight is restored_lm.embed.weight
    checks["tied/restored"] = _error(ddp.params(), restored.params())
    # Into a DDP job's plain tied model: its state_dict has both names, the index has both.
    plain = Trainer("ddp", tied)
    with CheckpointManager(directory) as manager:
        manager.restore({"model": plain.module, "optimizer": plain.optimizer})
    plain_lm = plain.module
    assert isinstance(plain_lm, LM) and plain_lm.head.weight is plain_lm.embed.weight
    checks["tied/into_ddp"] = _error(ddp.params(), plain.params())
    for trainer in (ddp, restored):
        trainer.grads.clear()
        trainer.train(2)
    checks["tied/trained_on"] = max(ddp.grads_error(restored), _error(ddp.params(), restored.params()))
    dist.barrier()
    return checks


def _session(sharding: str, tied: bool) -> dict[str, torch.Tensor]:
    """A session's full tensors on rank 0 after 3 steps (``{}`` elsewhere)."""
    import torch.distributed as dist
    from torch.utils.data import TensorDataset

    import elastictrain
    from elastictrain.train.worker import WorkerContext

    model = _lm(tied)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.9)
    data = torch.Generator().manual_seed(7)
    dataset = TensorDataset(torch.randint(0, VOCAB, (24, 5), generator=data),
                            torch.randint(0, VOCAB, (24, 5), generator=data))
    options = {} if sharding == "ddp" else {"shard_units": {Block}}
    context = dataclasses.replace(WorkerContext.from_env({}), local_world_size=WORLD)
    with elastictrain.Session(model, optimizer, dataset, global_batch_size=8, micro_batch_size=2, seed=1,
                              max_steps=3, grad_clip_norm=1.0, log_every=None, sharding=sharding,
                              process_group=dist.group.WORLD, context=context, **options) as session:
        for step in session.steps():
            for micro in step:
                ids, targets = micro.batch
                micro.backward(torch.nn.functional.cross_entropy(session.model(ids).flatten(0, 1), targets.flatten()))
        if sharding != "ddp":
            assert _units(session.model) == ["blocks.0", "blocks.1"]
        return session.full_state_dict()


def _case_default_units_tied() -> dict[str, float]:
    """Default units on the tied model: the embedding and the output layer are no units of their
    own (FSDP2 would refuse the shared weight in two), the root holds the weight."""
    ddp, sharded = Trainer("ddp", True), Trainer("sharded", True, units=None)
    assert _units(sharded.module) == ["blocks", "norm"]
    ddp.train(2)
    sharded.train(2)
    return {"tied_default/grads": ddp.grads_error(sharded),
            "tied_default/params": _error(ddp.params(), sharded.params())}


def _case_sessions() -> dict[str, float]:
    import torch.distributed as dist

    checks = {}
    for tied in (False, True):
        ddp, fsdp = _session("ddp", tied), _session("fsdp", tied)
        if dist.get_rank() == 0:
            assert list(ddp) == list(fsdp)  # the tied weight under both names, as DDP's state_dict
            checks[f"session/{'tied' if tied else 'untied'}"] = _error(list(ddp.values()), list(fsdp.values()))
    return checks


def _case_rebuilt_units() -> dict[str, float]:
    """In-process recovery shards a module rebuilt from the skeleton into the same units, even
    where the predicate judged modules by identity (it would choose none of the rebuilt ones)."""
    import torch.distributed as dist

    from elastictrain.train import process_group as pg
    from elastictrain.train.fsdp import FsdpStrategy
    from elastictrain.train.strategy import GroupView

    model = _lm(tied=True)
    originals = set(model.blocks)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    strategy = FsdpStrategy("fp32", units=lambda _fqn, module: module in originals)
    placement = pg.Placement(torch.device("cpu"), "gloo", pg.resolve_timeout(30), dist.get_rank(), WORLD, owned=False)
    view = GroupView(placement=placement, group=None, in_process=True, local_world_size=WORLD)
    first = _units(strategy.wrap(model, optimizer, view, identical=False))
    strategy.leave()
    fresh = strategy.unwrapped(model, optimizer)
    assert fresh is not model and not any(m in originals for m in fresh.modules())
    second = _units(strategy.wrap(fresh, optimizer, view, identical=True))
    strategy.leave()
    assert first == second == ["blocks.0", "blocks.1"], (first, second)
    rebuilt = fresh
    assert isinstance(rebuilt, LM) and rebuilt.head.weight is rebuilt.embed.weight
    return {"rebuilt_units": 0.0}


def _worker(rank: int, out: Path) -> None:
    import torch.distributed as dist

    from tests.support.leave import leave_together

    torch.set_num_threads(1)  # one thread a rank, as OMP_NUM_THREADS=1 gave the ranks run as scripts
    dist.init_process_group("gloo", init_method=f"file://{out / 'store'}", rank=rank, world_size=WORLD)
    checks = {**_case_train(False, out), **_case_train(True, out), **_case_default_units_tied(), **_case_sessions(),
              **_case_rebuilt_units()}
    if rank == 0:
        (out / "rank0.json").write_text(json.dumps(checks))
    leave_together()
