"""Sharded training (FSDP2, HSDP) against DDP on real gloo processes, and its pure parts.

One spawn of four processes forms subgroups of 1 to 4 ranks; on each it trains the same model
with DDP and sharded, and compares gradients (after clipping) at every step and the parameters
at the end: float64 throughout, so the only difference is summation order (~1e-16 relative).
The model's row counts (7 and 3) leave uneven shares at 2, 3 and 4 ranks, and an empty one at 4.

The process tests fork :func:`_worker` as every rank from the ranks' forkserver (``fork_ranks``).
"""

from __future__ import annotations

import contextlib
import copy
import json
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from elastictrain.errors import ConfigError
from elastictrain.train.fsdp import (
    ShardingConfig, mesh_shape, optimizer_state_by_fqn, optimizer_state_by_id, sharding_units,
)
from elastictrain.train.fsdp.optimizer import check_unstepped, parameter_fqns
from tests.support.ranks import fork_ranks

WORLD = 4
TOLERANCE = 1e-12
CLOSE = 2e-3
"""bf16 and fp16 against fp32 DDP: a bound on the parameters' drift after a few steps."""
pytestmark = pytest.mark.timeout(180)


class Block(torch.nn.Module):
    """A stand-in for a transformer block: two layers and a norm-like scale of its own."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.inner = torch.nn.Linear(width, width)
        self.outer = torch.nn.Linear(width, width)
        self.gain = torch.nn.Parameter(torch.ones(width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.gain * self.outer(torch.tanh(self.inner(x)))


class Net(torch.nn.Module):
    """Rows of 7 and 3 (uneven shares at 2-4 ranks, an empty one at 4), a parameter of the root's
    own, two blocks under one child (one unit by default, two with ``units=Block``)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Linear(5, 7)
        self.blocks = torch.nn.Sequential(Block(7), Block(7))
        self.head = torch.nn.Linear(7, 3)
        self.scale = torch.nn.Parameter(torch.full((3,), 0.5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(torch.tanh(self.embed(x)))) * self.scale


def _net(dtype: torch.dtype = torch.float64, seed: int = 0) -> Net:
    torch.manual_seed(seed)
    return Net().to(dtype)


# --- pure parts ---------------------------------------------------------------------------------


def test_default_units_are_the_children_with_parameters_and_a_block_class_selects_every_block() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.ReLU(), _net())
    assert [fqn for fqn, _ in sharding_units(model)] == ["0", "2"]
    assert [fqn for fqn, _ in sharding_units(model, Block)] == ["2.blocks.0", "2.blocks.1"]
    # A predicate on (fqn, module); nested matches come before what holds them.
    chosen = sharding_units(model, lambda fqn, m: fqn.startswith("2.blocks"))
    assert [fqn for fqn, _ in chosen][:3] == ["2.blocks.0.inner", "2.blocks.0.outer", "2.blocks.0"]
    assert [fqn for fqn, _ in chosen][-1] == "2.blocks"
    with pytest.raises(ConfigError, match="units must be"):
        sharding_units(model, "Block")  # type: ignore[arg-type]


def test_the_dtensor_slot_read_for_local_shards_is_checked_and_the_agent_does_not_import_dtensor(
        monkeypatch: pytest.MonkeyPatch) -> None:
    import subprocess
    import sys

    from torch.distributed.tensor import DTensor

    from elastictrain._torch_compat import check_dtensor
    from elastictrain.errors import TorchCompatError

    check_dtensor()
    monkeypatch.setattr(DTensor, "__slots__", ["_spec"])
    with pytest.raises(TorchCompatError, match="DTensor._local_tensor"):
        check_dtensor()
    # torch.distributed.tensor takes ~0.5 s to import: the agent (and a DDP job) must not pay it.
    code = "import sys, elastictrain.launch.agent; print('torch.distributed.tensor' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout == "False\n"


def test_the_mesh_shape_is_checked_against_the_world() -> None:
    assert mesh_shape("fsdp", 3) == (3,)
    assert mesh_shape("hsdp", 6, 3) == (2, 3)
    for args, words in [(("hsdp", 4, 3), "4 ranks do not fill nodes of 3"), (("hsdp", 4, None), "nproc_per_node"),
                        (("zero3", 4), "sharding must be one of"), (("fsdp", 0), "at least 1")]:
        with pytest.raises(ConfigError, match=words) as caught:
            mesh_shape(*args)
        assert "\n" not in str(caught.value)
    with pytest.raises(ConfigError, match="sharding must be one of"):
        ShardingConfig(sharding="ddp")


def test_an_optimizer_that_has_stepped_or_trains_another_model_is_refused() -> None:
    model = _net()
    optimizer = torch.optim.AdamW(model.parameters())
    check_unstepped(optimizer, parameter_fqns(model))
    model(torch.randn(2, 5, dtype=torch.float64)).sum().backward()
    optimizer.step()
    with pytest.raises(ConfigError, match="already has state"):
        check_unstepped(optimizer, parameter_fqns(model))
    with pytest.raises(ConfigError, match="not the model's"):
        check_unstepped(torch.optim.SGD(_net().parameters(), lr=0.1), parameter_fqns(model))


def test_ddp_optimizer_state_converts_to_fqn_keys_and_back_by_the_optimizers_order() -> None:
    model = _net()
    # Groups reorder the parameters: ids follow the optimizer's order, not named_parameters'.
    head, rest = list(model.head.parameters()), [p for n, p in model.named_parameters() if not n.startswith("head")]
    optimizer = torch.optim.SGD([{"params": head, "lr": 0.5}, {"params": rest}], lr=0.1, momentum=0.9)
    model(torch.randn(2, 5, dtype=torch.float64)).sum().backward()
    optimizer.step()
    ddp_form = optimizer.state_dict()
    order = [n for n, _ in model.head.named_parameters(prefix="head")] + [
        n for n, _ in model.named_parameters() if not n.startswith("head")]
    by_fqn = optimizer_state_by_fqn(ddp_form, order)
    assert by_fqn["param_groups"][0]["params"] == ["head.weight", "head.bias"]
    buffer = optimizer.state[model.head.weight]["momentum_buffer"]
    assert torch.equal(by_fqn["state"]["head.weight"]["momentum_buffer"], buffer)
    assert str(optimizer_state_by_id(by_fqn, order)) == str(ddp_form)
    with pytest.raises(ConfigError, match="do not hold this optimizer's"):
        optimizer_state_by_fqn(ddp_form, order[:-1])
    with pytest.raises(ConfigError, match="names parameter 99"):
        optimizer_state_by_fqn({"state": {99: {}}, "param_groups": ddp_form["param_groups"]}, order)


def test_session_shardings_build_the_fsdp_and_hsdp_strategies() -> None:
    from elastictrain.train.fsdp import FsdpStrategy, HsdpStrategy
    from elastictrain.train.session_config import SessionConfig
    from elastictrain.train.strategy import create_strategy

    for name, kind in (("fsdp", FsdpStrategy), ("hsdp", HsdpStrategy)):
        strategy = create_strategy(SessionConfig(global_batch_size=8, sharding=name))
        assert type(strategy) is kind and strategy.name == name and strategy.live_transfer


def test_a_sharded_strategy_keeps_an_unsharded_module_and_refuses_calls_before_it_wraps() -> None:
    from elastictrain.errors import SessionError
    from elastictrain.train.fsdp import FsdpStrategy

    model = _net()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    strategy = FsdpStrategy()
    assert strategy.unwrapped(model, optimizer) is model  # nothing to rebuild: the first generation's
    for call in (strategy.no_sync, lambda: strategy.after_step(1)):  # nothing wrapped
        with pytest.raises(SessionError, match="not wrapped"):
            call()


def test_a_skeleton_holds_no_storage_and_builds_fresh_modules_of_the_same_structure() -> None:
    from elastictrain.train.fsdp.skeleton import Skeleton

    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4), torch.nn.Linear(4, 3))
    model[1].register_buffer("table", torch.arange(3.0), persistent=False)
    model[2].bias.requires_grad_(False)
    skeleton = Skeleton(model)
    kept = skeleton._model  # what it holds: no storage but the non-persistent buffer
    assert all(t.is_meta for t in kept.state_dict(keep_vars=True).values()) and not kept[1].table.is_meta
    first, second = skeleton.build(torch.device("cpu")), skeleton.build(torch.device("cpu"))
    assert [(n, p.shape, p.requires_grad) for n, p in first.named_parameters()] == [
        (n, p.shape, p.requires_grad) for n, p in model.named_parameters()]
    assert not any(p.is_meta for p in first.parameters()) and list(first.state_dict()) == list(model.state_dict())
    assert torch.equal(first[1].table, model[1].table) and "1.table" not in first.state_dict()
    assert first[0].weight is not second[0].weight and first[0].weight is not model[0].weight
    unallocated = skeleton.build(torch.device("cpu"), allocate=False)  # for shard() to allocate the shards alone
    assert all(t.is_meta for t in unallocated.state_dict(keep_vars=True).values())
    assert torch.equal(unallocated[1].table, model[1].table)


def test_a_skeleton_keeps_a_shared_parameter_shared() -> None:
    from elastictrain.train.fsdp.skeleton import Skeleton

    model = torch.nn.Sequential(torch.nn.Linear(3, 3, bias=False), torch.nn.Linear(3, 3, bias=False))
    model[1].weight = model[0].weight
    fresh = Skeleton(model).build(torch.device("cpu"))
    assert fresh[0].weight is fresh[1].weight and len(list(fresh.parameters())) == 1


# --- real processes on gloo ---------------------------------------------------------------------


def _spawn(tmp_path: Path, matrix: str) -> list[dict[str, Any]]:
    fork_ranks(_worker, WORLD, lambda rank: (rank, tmp_path, matrix), timeout=500 if matrix == "slow" else 160)
    return [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in range(WORLD)]


def _check(results: list[dict[str, Any]], expected: set[str]) -> None:
    seen = set()
    for rank, checks in enumerate(results):
        for name, error in checks.items():
            seen.add(name)
            limit = CLOSE if name.endswith("close_params") else TOLERANCE
            assert error <= limit, f"rank {rank}: {name}: max error {error}"
    assert seen == expected, sorted(seen ^ expected)


def _expected(matrix: str) -> set[str]:
    names = set()
    for world, sharding, cases in _CASES[matrix]:
        for case in cases:
            names |= {f"{case}/{sharding}/{world}/{what}" for what in _CASE_CHECKS[case]}
    return names


def test_fsdp_and_hsdp_train_as_ddp_does_on_1_to_4_ranks(tmp_path: Path) -> None:
    _check(_spawn(tmp_path, "default"), _expected("default"))


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_fsdp_and_hsdp_train_as_ddp_does_over_the_longer_matrix(tmp_path: Path) -> None:
    _check(_spawn(tmp_path, "slow"), _expected("slow"))


# --- the worker ---------------------------------------------------------------------------------


def _batches(rank: int, step: int, micro: int, dtype: torch.dtype) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    for m in range(micro):
        data = torch.Generator().manual_seed(1000 * rank + 10 * step + m)
        # Different sizes per rank: each rank's mean loss, averaged over ranks (as DDP does).
        size = 2 + (rank + m) % 3
        yield (torch.randn(size, 5, generator=data).to(dtype), torch.randn(size, 3, generator=data).to(dtype))


def _sgd_groups(model: torch.nn.Module) -> torch.optim.Optimizer:
    head = list(model.head.parameters())  # type: ignore[union-attr]
    rest = [p for n, p in model.named_parameters() if not n.startswith("head")]
    return torch.optim.SGD([{"params": head, "lr": 0.3, "weight_decay": 0.01}, {"params": rest}],
                           lr=0.1, momentum=0.9, nesterov=True)


def _adamw(model: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.05)


class Trainer:
    """One model trained step by step under DDP or sharded, recording what each step saw."""

    def __init__(self, kind: str, group: Any, make_optimizer: Callable[[torch.nn.Module], torch.optim.Optimizer], *,
                 sharding: str = "fsdp", units: Any = None, precision: str = "fp32",
                 dtype: torch.dtype = torch.float64, clip: float | None = 0.05, micro: int = 2,
                 factory: Callable[[Any], torch.optim.Optimizer] | None = None) -> None:
        import torch.distributed as dist
        from torch.nn.parallel import DistributedDataParallel

        from elastictrain.train.fsdp import ShardingConfig, shard
        from elastictrain.train.precision import MixedPrecision

        self.kind, self.clip, self.micro, self.dtype = kind, clip, micro, dtype
        self.rank = dist.get_rank(group)
        model = _net(dtype, seed=self.rank)  # each rank its own init: rank 0's is broadcast (DDP does the same)
        optimizer = make_optimizer(model)
        self.precision = MixedPrecision(precision, "cpu")
        self.sharded: Any = None
        if kind == "ddp":
            self.model: torch.nn.Module = DistributedDataParallel(model, process_group=group)
            self.module, self.optimizer = model, optimizer
        else:
            nproc = 2 if sharding == "hsdp" else None
            spec: Any = optimizer if factory is None else factory
            self.sharded = shard(model, spec, ShardingConfig(sharding=sharding, units=units, nproc_per_node=nproc),
                                 precision=self.precision, group=None if sharding == "hsdp" else group)
            # The same object, now over the shards, unless a callable built it.
            assert (self.sharded.optimizer is optimizer) == (factory is None)
            self.model = self.module = self.sharded.model
            self.optimizer = self.sharded.optimizer
        self.grads: list[list[torch.Tensor]] = []
        self.steps = 0

    def no_sync(self) -> Any:
        return self.model.no_sync() if self.kind == "ddp" else self.sharded.no_sync()  # type: ignore[operator]

    def train(self, steps: int) -> None:
        for _ in range(steps):
            self.optimizer.zero_grad()
            batches = list(_batches(self.rank, self.steps, self.micro, self.dtype))
            for index, (x, y) in enumerate(batches):
                last = index == len(batches) - 1
                with contextlib.nullcontext() if last else self.no_sync():
                    with self.precision.autocast():
                        loss = torch.nn.functional.mse_loss(self.model(x).to(y.dtype), y) / len(batches)
                    self.precision.backward(loss)
                if not last and self.sharded is not None:
                    # Nothing reduced yet: the gradients wait in FSDP's unsharded buffers.
                    assert all(p.grad is None for p in self.module.parameters())
            if self.clip is not None:
                if self.kind == "ddp":
                    norm = float(torch.nn.utils.clip_grad_norm_(self.module.parameters(), self.clip))
                else:
                    norm = self.sharded.clip_grad_norm_(self.clip)
                assert norm > self.clip  # clipping scaled the gradients
            self.grads.append([_full(p.grad) for p in self.module.parameters()])
            self.optimizer.step()
            self.steps += 1

    def params(self) -> list[torch.Tensor]:
        return [_full(p).detach() for p in self.module.parameters()]


def _full(tensor: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def _error(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    assert [x.shape for x in a] == [y.shape for y in b]
    return max((x.double() - y.double()).abs().max().item() for x, y in zip(a, b, strict=True))


def _grads_error(a: Trainer, b: Trainer) -> float:
    assert len(a.grads) == len(b.grads) > 0
    return max(_error(x, y) for x, y in zip(a.grads, b.grads, strict=True))


def _case_sgd(group: Any, sharding: str, steps: int, micro: int) -> dict[str, float]:
    """SGD with two param groups (nesterov momentum, weight decay on one), accumulation, clipping."""
    ddp = Trainer("ddp", group, _sgd_groups, micro=micro)
    sharded = Trainer("sharded", group, _sgd_groups, sharding=sharding, micro=micro)
    ddp.train(steps)
    sharded.train(steps)
    assert sharded.optimizer.param_groups[0]["lr"] == 0.3 and sharded.optimizer.defaults["momentum"] == 0.9
    return {"grads": _grads_error(ddp, sharded), "params": _error(ddp.params(), sharded.params())}


def _case_adamw(group: Any, sharding: str, steps: int, micro: int) -> dict[str, float]:
    """AdamW, one unit per block, and built by a callable; a checkpoint template taken before the
    first step; the DDP forms of both states; restores from DDP's state and from the sharded state train on as DDP."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    from elastictrain.train.fsdp import ModelState, OptimizerState, full_optimizer_state_dict, full_state_dict

    ddp = Trainer("ddp", group, _adamw, micro=micro)
    sharded = Trainer("sharded", group, _adamw, sharding=sharding, units=Block, micro=micro)
    # The template, taken in the middle of a step (gradients there, no state yet), is complete.
    x, y = next(_batches(sharded.rank, 0, 1, torch.float64))
    torch.nn.functional.mse_loss(sharded.model(x), y).backward()
    grads = [p.grad for p in sharded.module.parameters()]
    template = OptimizerState(sharded.model, sharded.optimizer).state_dict()
    assert all(p.grad is g for p, g in zip(sharded.module.parameters(), grads, strict=True))
    sharded.optimizer.zero_grad()
    # torch's id-keyed form, the keys of a DDP job's optimizer.state_dict().
    count = len(list(sharded.module.parameters()))
    assert set(template["state"]) == set(range(count))
    assert [g["params"] for g in template["param_groups"]] == [list(range(count))]
    assert all(set(s) == {"step", "exp_avg", "exp_avg_sq"} for s in template["state"].values())
    assert not sharded.optimizer.state  # building the template changed nothing (Adam's step count)
    built = Trainer("sharded", group, _adamw, sharding=sharding, micro=micro,
                    factory=lambda params: torch.optim.AdamW(params, lr=0.01, weight_decay=0.05))
    for trainer in (ddp, sharded, built):
        trainer.train(steps)
    checks = {"grads": _grads_error(ddp, sharded), "params": _error(ddp.params(), sharded.params()),
              "callable": max(_grads_error(ddp, built), _error(ddp.params(), built.params()))}

    full, ddp_optim = full_state_dict(sharded.model), full_optimizer_state_dict(sharded.model, sharded.optimizer)
    if ddp.rank == 0:
        expected = ddp.module.state_dict()
        checks["full_state_dict"] = _error(list(full.values()), list(expected.values()))
        assert list(full) == list(expected)
        reference = ddp.optimizer.state_dict()
        assert ddp_optim["param_groups"] == reference["param_groups"]
        checks["ddp_optimizer_form"] = max(
            _error(list(ddp_optim["state"][i].values()), list(reference["state"][i].values()))
            for i in reference["state"])
    else:
        assert full == {} and ddp_optim == {}

    # Sharded state (the optimizer's in get_optimizer_state_dict's FQN-keyed form; the id-keyed
    # one goes through a checkpoint manager in _case_checkpoint) loaded into a fresh sharded model.
    saved = copy.deepcopy({"model": ModelState(sharded.model).state_dict(),
                           "optimizer": get_optimizer_state_dict(sharded.model, sharded.optimizer)})
    from_sharded = Trainer("sharded", group, _adamw, sharding=sharding, units=Block, micro=micro)
    from_sharded.steps = steps
    ModelState(from_sharded.model).load_state_dict(saved["model"])
    OptimizerState(from_sharded.model, from_sharded.optimizer).load_state_dict(saved["optimizer"])
    # DDP's own state (full tensors, the optimizer's id-keyed form) loaded into another one.
    from_ddp = Trainer("sharded", group, _adamw, sharding=sharding, micro=micro)
    from_ddp.steps = steps
    ModelState(from_ddp.model).load_state_dict(copy.deepcopy(ddp.module.state_dict()))
    OptimizerState(from_ddp.model, from_ddp.optimizer).load_state_dict(copy.deepcopy(ddp.optimizer.state_dict()))
    for trainer in (ddp, from_sharded, from_ddp):
        trainer.grads.clear()
        trainer.train(2)
    checks["restored_sharded"] = max(_grads_error(ddp, from_sharded), _error(ddp.params(), from_sharded.params()))
    checks["restored_from_ddp"] = max(_grads_error(ddp, from_ddp), _error(ddp.params(), from_ddp.params()))
    return checks


def _case_bf16(group: Any, sharding: str, steps: int, micro: int) -> dict[str, float]:
    """bf16 through FSDP2's policy (fp32 master parameters) stays close to fp32 DDP (SGD: the drift
    follows the gradients' rounding; Adam's normalisation would make it about lr per step)."""
    ddp = Trainer("ddp", group, _sgd_groups, dtype=torch.float32, micro=micro)
    sharded = Trainer("sharded", group, _sgd_groups, sharding=sharding, precision="bf16", dtype=torch.float32,
                      micro=micro)
    assert all(p.dtype == torch.float32 for p in sharded.module.parameters())
    assert sharded.model(torch.zeros(1, 5)).dtype == torch.bfloat16  # computed in bf16 (no autocast here)
    ddp.train(steps)
    sharded.train(steps)
    assert all(p.grad is None or p.grad.dtype == torch.float32 for p in sharded.module.parameters())
    return {"close_params": _error(ddp.params(), sharded.params())}


def _case_fp16(group: Any, sharding: str, steps: int, micro: int) -> dict[str, float]:
    """fp16 with the GradScaler: unscale, clip and step over DTensor gradients, close to fp32 DDP."""
    ddp = Trainer("ddp", group, _sgd_groups, dtype=torch.float32, micro=micro, clip=None)
    sharded = Trainer("sharded", group, _sgd_groups, sharding=sharding, precision="fp16", dtype=torch.float32,
                      micro=micro, clip=None)
    ddp.train(steps)
    for _ in range(steps):
        sharded.optimizer.zero_grad()
        for index, (x, y) in enumerate(_batches(sharded.rank, sharded.steps, micro, torch.float32)):
            with sharded.no_sync() if index < micro - 1 else contextlib.nullcontext():
                with sharded.precision.autocast():
                    loss = torch.nn.functional.mse_loss(sharded.model(x).float(), y) / micro
                sharded.precision.backward(loss)
        outcome = sharded.precision.step(sharded.optimizer, sharded.module.parameters(), max_norm=100.0)
        assert not outcome.skipped and outcome.grad_norm is not None
        sharded.steps += 1
    # An inf in one shard skips the step on every rank (the scaler's check is reduced over the
    # shard dimension; replicas hold the same shard, inf included, after their all-reduce).
    x, y = next(_batches(sharded.rank, 0, 1, torch.float32))
    sharded.optimizer.zero_grad()
    sharded.precision.backward(torch.nn.functional.mse_loss(sharded.model(x).float(), y))
    before = sharded.params()
    if sharded.sharded.mesh.get_local_rank(mesh_dim=-1) == 0:
        sharded.module.head.weight.grad.to_local()[0, 0] = float("inf")  # type: ignore[union-attr]
    assert sharded.precision.step(sharded.optimizer, sharded.module.parameters(), max_norm=100.0).skipped
    assert _error(before, sharded.params()) == 0.0
    return {"close_params": _error(ddp.params(), sharded.params())}


def _optimizer_error(got: dict[str, Any], expected: dict[str, Any]) -> float:
    """How far two optimizer states of torch's id-keyed form with full tensors are apart."""
    assert got["param_groups"] == expected["param_groups"] and got["state"].keys() == expected["state"].keys()
    return max(_error(list(got["state"][i].values()), list(expected["state"][i].values())) for i in expected["state"])


def _case_checkpoint(group: Any, sharding: str, steps: int, micro: int) -> dict[str, float]:
    """Through a CheckpointManager: a sharded save at 4 ranks and a DDP one; at 3 ranks, sharded jobs
    restore either and a DDP job restores the sharded one, with the full tensors saved; each trains on
    as the DDP job restored from the DDP checkpoint does. ``group`` is every rank's."""
    import torch.distributed as dist

    from elastictrain.checkpoint import CheckpointManager, TorchDistributedCoordinator
    from elastictrain.train.fsdp import full_optimizer_state_dict, full_state_dict

    rank, directory = dist.get_rank(), Path(os.environ["FSDP_TEST_DIR"])
    three = _GROUPS[3]

    def manager(name: str, over: Any) -> CheckpointManager:
        return CheckpointManager(directory / name, coordinator=TorchDistributedCoordinator(over))

    fsdp4 = Trainer("sharded", group, _adamw, sharding=sharding, units=Block, micro=micro)
    ddp4 = Trainer("ddp", group, _adamw, micro=micro)
    for trainer in (fsdp4, ddp4):
        trainer.train(steps)
    with manager("sharded", group) as saving:
        saving.save(steps, fsdp4.sharded.state())
    with manager("ddp", group) as saving:
        saving.save(steps, {"model": ddp4.module, "optimizer": ddp4.optimizer})
    expected = copy.deepcopy({"model": ddp4.module.state_dict(), "optimizer": ddp4.optimizer.state_dict()})
    checks: dict[str, float] = {}
    if rank >= 3:
        return checks
    reference = Trainer("ddp", three, _adamw, micro=micro)
    ddp_from_sharded = Trainer("ddp", three, _adamw, micro=micro)
    from_sharded = Trainer("sharded", three, _adamw, micro=micro)  # other units than saved: keys are FQNs
    from_ddp = Trainer("sharded", three, _adamw, micro=micro, units=Block)
    for trainer, name in ((reference, "ddp"), (ddp_from_sharded, "sharded"), (from_sharded, "sharded"),
                          (from_ddp, "ddp")):
        state = trainer.sharded.state() if trainer.sharded is not None else {
            "model": trainer.module, "optimizer": trainer.optimizer}
        with manager(name, three) as restoring:
            info = restoring.restore(state)
        assert info is not None and info.step == steps and info.world_size == 4
        trainer.steps = steps
    for trainer, what in ((from_sharded, "sharded_4_to_3"), (from_ddp, "ddp_4_to_sharded_3")):
        model, optimizer = full_state_dict(trainer.model), full_optimizer_state_dict(trainer.model, trainer.optimizer)
        if rank == 0:
            checks[what] = max(_error(list(model.values()), list(expected["model"].values())),
                               _optimizer_error(optimizer, expected["optimizer"]))
    checks["sharded_4_to_ddp_3"] = max(
        _error(list(ddp_from_sharded.module.state_dict().values()), list(expected["model"].values())),
        _optimizer_error(ddp_from_sharded.optimizer.state_dict(), expected["optimizer"]))
    for trainer in (reference, ddp_from_sharded, from_sharded, from_ddp):
        trainer.train(2)
    checks["trained_on"] = max(max(_grads_error(reference, t), _error(reference.params(), t.params()))
                               for t in (ddp_from_sharded, from_sharded, from_ddp))
    return checks


_GROUPS: dict[int, Any] = {}
"""The worker's groups by size (the checkpoint case uses two)."""

_CASE_FUNCS = {"sgd": _case_sgd, "adamw": _case_adamw, "bf16": _case_bf16, "fp16": _case_fp16,
               "checkpoint": _case_checkpoint}
_CASE_CHECKS = {
    "sgd": ("grads", "params"),
    "adamw": ("grads", "params", "callable", "full_state_dict", "ddp_optimizer_form", "restored_sharded",
              "restored_from_ddp"),
    "bf16": ("close_params",),
    "fp16": ("close_params",),
    "checkpoint": ("sharded_4_to_3", "ddp_4_to_sharded_3", "sharded_4_to_ddp_3", "trained_on"),
}
_CASES: dict[str, list[tuple[int, str, tuple[str, ...]]]] = {
    "default": [(1, "fsdp", ("sgd",)), (2, "fsdp", ("sgd", "adamw", "bf16")), (3, "fsdp", ("sgd", "adamw")),
                (4, "fsdp", ("sgd", "adamw", "checkpoint")), (4, "hsdp", ("sgd", "adamw"))],
    "slow": [(w, "fsdp", ("sgd", "adamw", "bf16", "fp16")) for w in (1, 2, 3, 4)]
    + [(4, "hsdp", ("sgd", "adamw", "bf16", "fp16", "checkpoint"))],
}
_STEPS = {"default": (2, 2), "slow": (8, 3)}


def _worker(rank: int, out: Path, matrix: str) -> None:
    import torch.distributed as dist

    from tests.support.leave import leave_together

    torch.set_num_threads(1)  # one thread a rank, as OMP_NUM_THREADS=1 gave the ranks run as scripts
    dist.init_process_group("gloo", init_method=f"file://{out / 'store'}", rank=rank, world_size=WORLD)
    groups = _GROUPS
    groups.update({w: dist.new_group(list(range(w))) for w in (1, 2, 3)})
    groups[WORLD] = dist.group.WORLD
    os.environ["FSDP_TEST_DIR"] = str(out)
    steps, micro = _STEPS[matrix]
    checks: dict[str, float] = {}
    for world, sharding, cases in _CASES[matrix]:
        if rank >= world:
            continue
        for case in cases:
            for what, error in _CASE_FUNCS[case](groups[world], sharding, steps, micro).items():
                checks[f"{case}/{sharding}/{world}/{what}"] = error
    if rank == 0 and matrix == "default":
        # A world that the hsdp mesh does not tile: one line, before any collective.
        from elastictrain.train.fsdp import ShardingConfig, shard

        model = _net()
        try:
            shard(model, _adamw(model), ShardingConfig(sharding="hsdp", nproc_per_node=3))
        except ConfigError as exc:
            assert str(exc) == ("hsdp needs a world size that is a multiple of nproc_per_node: "
                                "4 ranks do not fill nodes of 3")
        else:
            raise AssertionError("hsdp on 4 ranks with 3 per node was not refused")
    (out / f"rank{rank}.json").write_text(json.dumps(checks))
    leave_together()
