"""A sharded ``Session`` trains a model built on the meta device (no storage: a model that does not
fit one device), its values set by ``init_weights`` unit by unit. On real gloo processes.

One spawn of four processes. fsdp at 3 ranks (uneven shares) and hsdp at 2x2: a session of the
meta-built model starts with exactly ``torch.manual_seed(seed); model.apply(init_weights)`` of the
full model (a tied weight, a ``nn.MultiheadAttention`` whose init sets its child's bias, a
non-persistent buffer), and trains to the same parameters as a session of that model built for
real; a meta-built session restores a checkpoint (its non-persistent buffer from ``init_weights``,
the rest from the checkpoint) and trains on as the real one does. An ``init_weights`` that leaves a
parameter unset (or a complex buffer), a meta model under DDP and one without
``init_weights`` are refused in one line.

Run as a script, this module is the worker the test spawns.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path
from typing import Any, cast

import pytest
import torch
from torch import nn

from tests.support.ranks import run_ranks

WORLD = 4
SEED = 11
TOLERANCE = 1e-12
pytestmark = pytest.mark.timeout(120)


def test_a_meta_built_model_starts_as_init_weights_makes_it_and_trains_as_the_real_one(tmp_path: Path) -> None:
    run_ranks(__file__, WORLD, str(tmp_path))
    checks = json.loads((tmp_path / "rank0.json").read_text())
    for case in ("fsdp3", "hsdp"):
        assert checks[f"{case}/start"] == 0.0, checks  # bit for bit: the same draws in the same order
        assert checks[f"{case}/trained"] <= TOLERANCE, checks
    assert checks["restored"] <= TOLERANCE, checks
    assert checks["rebuilt_scale"] == [0.5] * 16, checks["rebuilt_scale"]
    assert checks["refused"] == [
        "init_weights left block.linear1.weight unset: it must set each module's own parameters and buffers "
        "(as a Module.apply function does; reset_parameters() where a module has one)",
        "the model is on the meta device: DDP trains a model with values; build it on a real device, or shard it "
        "(sharding='fsdp' or 'hsdp', with init_weights)",
        "the model is on the meta device: sharding='fsdp' needs init_weights (a Module.apply function that sets "
        "each module's parameters) to give it values",
    ], checks["refused"]


def test_a_meta_built_model_alone_in_its_world_is_allocated_whole_and_set_as_its_shards_would_be() -> None:
    # A world of one (no process group: a chaos run's reference) trains the whole model, unsharded.
    alone, real = (_train(meta, "fsdp", None, steps=3) for meta in (True, False))
    assert _error(alone["start"], real["start"]) == 0.0
    assert _error(alone["end"], real["end"]) <= TOLERANCE


def test_reset_parameters_gives_a_meta_built_model_the_values_its_constructors_would() -> None:
    import elastictrain
    from elastictrain.train.meta_init import materialize

    def build() -> nn.Module:
        return nn.Sequential(nn.Embedding(10, 16), nn.TransformerEncoderLayer(16, 2, 32, batch_first=True),
                             nn.MultiheadAttention(16, 2, kdim=6, vdim=6, add_bias_kv=True), nn.LayerNorm(16),
                             nn.Conv1d(16, 4, 3), nn.Linear(4, 3))

    torch.manual_seed(SEED)
    real = build()
    with torch.device("meta"):
        meta = build()
    materialize(meta, elastictrain.reset_parameters, seed=SEED, device=torch.device("cpu"))
    assert _error(meta.state_dict(), real.state_dict()) == 0.0


def test_a_complex_tensor_init_weights_leaves_unset_is_refused_as_a_real_one_is() -> None:
    from elastictrain.errors import ConfigError
    from elastictrain.train.meta_init import materialize

    class Rotary(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.linear = nn.Linear(4, 4)
            self.register_buffer("freqs", torch.empty(4, dtype=torch.complex64))

    with torch.device("meta"):
        model = Rotary()
    with pytest.raises(ConfigError, match="^init_weights left freqs unset"):
        materialize(model, leaves_linear1_unset, seed=SEED, device=torch.device("cpu"))


class Net(nn.Module):
    """A tied embedding and head (one parameter, held by the root's unit), a transformer block (a unit
    of its own), and a non-persistent buffer no checkpoint holds."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(10, 16)
        self.block = nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True)
        self.head = nn.Linear(16, 10, bias=False)
        self.head.weight = self.embed.weight
        self.register_buffer("scale", torch.ones(16), persistent=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.block(self.embed(ids)) * self.scale)


def init_weights(module: nn.Module) -> None:
    import elastictrain

    if isinstance(module, Net):
        module.scale.fill_(0.5)
    else:  # nn.MultiheadAttention's sets its child out_proj's bias too
        elastictrain.reset_parameters(module)


def leaves_linear1_unset(module: nn.Module) -> None:
    if not (isinstance(module, nn.Linear) and module.out_features == 32):
        init_weights(module)


def _dataset() -> Any:
    from torch.utils.data import TensorDataset

    data = torch.Generator().manual_seed(5)
    return TensorDataset(torch.randint(0, 10, (24, 6), generator=data), torch.randint(0, 10, (24, 6), generator=data))


def _model(meta: bool) -> nn.Module:
    if meta:
        with torch.device("meta"):
            return Net().double()
    model = Net().double()
    torch.manual_seed(SEED)
    model.apply(init_weights)
    return model


def _train(meta: bool, sharding: str, group: Any, *, steps: int, checkpoint_dir: Path | None = None,
           init: Any = init_weights) -> dict[str, Any]:
    """One session: rank 0's full tensors at its start and at its end (``{}`` elsewhere)."""
    import dataclasses

    import elastictrain
    from elastictrain.train.worker import WorkerContext

    context = dataclasses.replace(WorkerContext.from_env({}), local_world_size=2)  # hsdp: 2 ranks a node
    torch.manual_seed(0)  # each rank's own draws differ from the session's seed
    model = _model(meta)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    with elastictrain.Session(model, optimizer, _dataset(), global_batch_size=12, micro_batch_size=3, seed=SEED,
                              log_every=None, epochs=2, max_steps=steps, process_group=group, sharding=sharding,
                              checkpoint_dir=str(checkpoint_dir) if checkpoint_dir else None, context=context,
                              init_weights=init if meta else None) as session:
        start = session.full_state_dict()
        for step in session.steps():
            for micro in step:
                inputs, targets = micro.batch
                micro.backward(nn.functional.cross_entropy(session.model(inputs).flatten(0, 1), targets.flatten()))
        end = session.full_state_dict()
    return {"start": start, "end": end}


def _error(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert list(a) == list(b), (list(a), list(b))
    return max((x - y).abs().max().item() for x, y in zip(a.values(), b.values(), strict=True))


def _rebuilt_buffer(rank: int, groups: tuple[Any, Any]) -> list[float]:
    """A meta-built model initialised in one generation, then left and rebuilt from the skeleton, as a
    survivor's module is before it restores a checkpoint in place (which holds no non-persistent
    buffer): its non-persistent buffer once the next generation has wrapped it."""
    from elastictrain.train import process_group as pg
    from elastictrain.train.fsdp.strategy import FsdpStrategy
    from elastictrain.train.strategy import GroupView

    placement = pg.Placement(torch.device("cpu"), "gloo", pg.resolve_timeout(30), rank, WORLD, owned=False)
    strategy = FsdpStrategy(init_weights=init_weights)
    model = _model(meta=True)
    optimizer = torch.optim.AdamW(model.parameters())
    module = model
    for group in groups:  # a generation each
        view = GroupView(placement=placement, group=group, in_process=True, local_world_size=2)
        module = strategy.wrap(strategy.unwrapped(module, optimizer), optimizer, view, identical=True)
        if module is model:
            strategy.initialize(module, seed=SEED)
        strategy.leave()
    return cast(torch.Tensor, module.scale).tolist()


def _refusal(call: Any) -> str:
    from elastictrain.errors import ConfigError

    try:
        call()
    except ConfigError as exc:
        return str(exc)
    raise AssertionError("not refused")


def _worker(rank: int, out: Path) -> None:
    import torch.distributed as dist

    from tests.support.leave import leave_together

    dist.init_process_group("gloo", init_method=f"file://{out / 'store'}", rank=rank, world_size=WORLD)
    three = dist.new_group([0, 1, 2])
    generations = (dist.new_group(list(range(WORLD))), dist.new_group(list(range(WORLD))))
    checks: dict[str, Any] = {}
    if rank < 3:
        meta, real = (_train(m, "fsdp", three, steps=3) for m in (True, False))
        if rank == 0:
            checks["fsdp3/start"] = _error(meta["start"], real["start"])
            checks["fsdp3/trained"] = _error(meta["end"], real["end"])
    dist.barrier()
    meta, real = (_train(m, "hsdp", dist.group.WORLD, steps=2, checkpoint_dir=out / f"hsdp_{m}")
                  for m in (True, False))
    if rank == 0:
        checks["hsdp/start"] = _error(meta["start"], real["start"])
        checks["hsdp/trained"] = _error(meta["end"], real["end"])
        for copy in ("restore_meta", "restore_real"):
            shutil.copytree(out / "hsdp_False", out / copy)
    dist.barrier()
    restored, continued = (_train(m, "fsdp", dist.group.WORLD, steps=4, checkpoint_dir=out / f"restore_{name}")
                           for m, name in ((True, "meta"), (False, "real")))
    refused = [_refusal(lambda: _train(True, "fsdp", dist.group.WORLD, steps=1, init=leaves_linear1_unset))]
    if rank == 0:
        checks["restored"] = _error(restored["end"], continued["end"])
        refused.append(_refusal(lambda: _train(True, "ddp", None, steps=1, init=None)))
        refused.append(_refusal(lambda: _train(True, "fsdp", None, steps=1, init=None)))
        checks["refused"] = refused
    scale = _rebuilt_buffer(rank, generations)
    if rank == 0:
        checks["rebuilt_scale"] = scale
        (out / "rank0.json").write_text(json.dumps(checks))
    leave_together()


if __name__ == "__main__":
    _worker(int(sys.argv[1]), Path(sys.argv[2]))
