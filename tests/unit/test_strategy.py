"""The parallelism strategy seam: its factory and errors, and the step-boundary vote, carried on
DDP's all-reduce or taken in an all-reduce of its own (the base class's default), with real gloo
processes."""

from __future__ import annotations

import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

import elastictrain
from elastictrain._addresses import free_port
from elastictrain._control import Assignment, ProgressTable, WorkerState, write_assignment
from elastictrain.errors import ConfigError, SessionError
from elastictrain.train import strategy as strategy_module
from elastictrain.train.ddp import DDPStrategy
from elastictrain.train.session_config import SessionConfig
from elastictrain.train.strategy import GroupView, create_strategy, register_strategy
from tests.support.leave import leave_together
from tests.unit.test_inprocess_parts import _control_dirs, _launched_as, _run_ranks

pytestmark = pytest.mark.timeout(120)


def _model() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))


def test_ddp_is_the_default_and_the_factory_builds_its_strategy_with_the_ddp_kwargs() -> None:
    config = SessionConfig(global_batch_size=8, ddp_kwargs={"bucket_cap_mb": 1})
    assert config.sharding == "ddp"
    strategy = create_strategy(config)
    assert isinstance(strategy, DDPStrategy) and strategy.name == "ddp" and strategy.live_transfer
    assert strategy._kwargs == {"bucket_cap_mb": 1}


@pytest.mark.parametrize("value", ["zero3", "DDP", None, 3])
def test_an_unknown_sharding_is_refused_in_one_line_naming_it(value: Any) -> None:
    model = _model()
    with pytest.raises(ConfigError) as raised:
        elastictrain.Session(model, torch.optim.SGD(model.parameters(), lr=0.1), list(range(8)),
                             global_batch_size=8, sharding=value)
    message = str(raised.value)
    assert "\n" not in message and repr(value) in message and "sharding" in message, message


@pytest.mark.parametrize("name", ["fsdp", "hsdp"])
def test_a_sharding_whose_module_is_not_there_yet_is_refused_as_not_available(
        name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # Its home made absent, whether or not elastictrain.train.fsdp has landed meanwhile.
    monkeypatch.setattr(strategy_module, "_registry", {k: v for k, v in strategy_module._registry.items() if k != name})
    monkeypatch.setitem(strategy_module._HOMES, name, "elastictrain.train._no_such_strategy")
    model = _model()
    with pytest.raises(ConfigError, match=f"sharding='{name}' is not available yet"):
        elastictrain.Session(model, torch.optim.SGD(model.parameters(), lr=0.1), list(range(8)),
                             global_batch_size=8, sharding=name)


def test_a_strategy_module_that_lacks_a_dependency_says_so_rather_than_not_available(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "broken_strategy_home.py").write_text("import no_such_dependency_of_a_strategy\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(strategy_module, "_registry", {})
    monkeypatch.setitem(strategy_module._HOMES, "fsdp", "broken_strategy_home")
    with pytest.raises(ModuleNotFoundError, match="no_such_dependency_of_a_strategy"):
        create_strategy(SessionConfig(global_batch_size=8, sharding="fsdp"))
    sys.modules.pop("broken_strategy_home", None)


def test_a_registered_strategy_is_built_by_its_factory_and_only_known_names_register(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(strategy_module, "_registry", dict(strategy_module._registry))
    built: list[SessionConfig] = []

    def factory(config: SessionConfig) -> DDPStrategy:
        built.append(config)
        return DDPStrategy(piggyback_vote=False)

    register_strategy("hsdp", factory)
    config = SessionConfig(global_batch_size=8, sharding="hsdp")
    assert isinstance(create_strategy(config), DDPStrategy) and built == [config]
    with pytest.raises(ValueError, match="'zero3'"):
        register_strategy("zero3", factory)


def test_a_strategy_refuses_per_step_calls_before_it_wraps_a_group_and_a_group_that_is_not_distributed() -> None:
    from elastictrain.train import process_group as pg

    strategy = DDPStrategy()
    for call in (lambda: strategy.arm_vote(True), strategy.votes, lambda: strategy.after_step(1), strategy.no_sync):
        with pytest.raises(SessionError, match="not wrapped"):
            call()
    strategy.leave()  # a no-op when not wrapped
    model = _model()
    alone = pg.Placement(torch.device("cpu"), None, pg.resolve_timeout(10), 0, 1, owned=False)
    with pytest.raises(SessionError, match="there is none"):
        strategy.wrap(model, torch.optim.SGD(model.parameters(), lr=0.1),
                      GroupView(placement=alone, group=None, in_process=True, local_world_size=1), identical=False)
    with pytest.raises(SessionError, match="no replicated state"):
        class Sharded(DDPStrategy):
            @property
            def live_transfer(self) -> bool:
                return False

        Sharded().transfer_state(None, None, {}, step=0)  # type: ignore[arg-type]


def _vote_worker(rank: int, port: int, piggyback: bool, results: Any) -> None:
    from torch.nn.parallel import DistributedDataParallel

    from elastictrain.train import process_group as pg
    from elastictrain.train.worker import WorkerContext

    placement = pg.init_process_group(WorkerContext(rank=rank, world_size=2, master_addr="127.0.0.1",
                                                    master_port=port), backend="gloo", timeout=30)
    torch.manual_seed(0)
    reference, model = _model(), _model()
    model.load_state_dict(reference.state_dict())
    plain = DistributedDataParallel(reference)
    strategy = DDPStrategy({"bucket_cap_mb": 0.0001}, piggyback_vote=piggyback)  # several buckets
    wrapped = strategy.wrap(model, torch.optim.SGD(model.parameters(), lr=0.1),
                            GroupView(placement=placement, group=None, in_process=True, local_world_size=1),
                            identical=False)
    explicit = []
    all_reduce = dist.all_reduce

    def counted(*args: Any, **kwargs: Any) -> Any:  # what Python calls; DDP's own bucket all-reduce is C++'s
        explicit.append(1)
        return all_reduce(*args, **kwargs)

    dist.all_reduce = counted
    x = torch.randn(4, 4, generator=torch.Generator().manual_seed(rank))
    plain(x).sum().backward()
    counts = []
    for wanted in (False, rank == 1, True):
        strategy.arm_vote(wanted)
        model.zero_grad()
        wrapped(x).sum().backward()
        strategy.after_step(1)
        counts.append(strategy.votes())
    same = all(torch.equal(a.grad, b.grad) for a, b in zip(reference.parameters(), model.parameters()))
    # Three micro-batches, the first two without synchronizing: one vote per step, not per backward.
    strategy.arm_vote(rank == 0)
    model.zero_grad()
    for _ in range(2):
        with strategy.no_sync():
            wrapped(x).sum().backward()
    wrapped(x).sum().backward()
    strategy.after_step(2)
    counts.append(strategy.votes())
    dist.all_reduce = all_reduce
    strategy.leave()
    results.put((rank, counts, same, len(explicit)))
    # Not torch's teardown: with DDP's reducers alive it can deadlock (pytorch#75097; this test hung
    # to its 120 s timeout in a suite run), as in test_inprocess_parts' boundary-flag rank.
    results.close()
    results.join_thread()
    leave_together()


@pytest.mark.parametrize("piggyback", [True, False], ids=["on-ddps-all-reduce", "explicit-all-reduce"])
def test_every_rank_counts_the_same_votes_whether_they_ride_on_ddps_all_reduce_or_take_one_of_their_own(
        piggyback: bool) -> None:
    out = _run_ranks(2, _vote_worker, lambda rank: (piggyback,))
    for rank in (0, 1):
        counts, same, explicit = out[rank]
        assert counts == [0, 1, 2, 1], f"rank {rank} counted {counts}"
        assert same, f"rank {rank}: gradients differ from plain DDP's"
        # Piggybacking adds no collective; the explicit vote is one all-reduce per boundary.
        assert explicit == (0 if piggyback else 4), (rank, explicit)


class _Recoveries:
    def __init__(self) -> None:
        self.seen: list[tuple[int, str]] = []

    def on_recovery(self, *, step: int, cause: str, generation: int, world_size: int, seconds: float) -> None:
        self.seen.append((step, cause))


def _explicit_session_worker(rank: int, port: int, control: str, port2: int, results: Any) -> None:
    from torch.utils.data import TensorDataset

    _launched_as(rank, port, control)
    # DDP forced to take the vote apart, as a strategy that cannot carry it on its gradients does.
    register_strategy("ddp", lambda config: DDPStrategy(config.ddp_kwargs, piggyback_vote=False))
    new = Assignment(generation=2, round=1, world_size=2, master_addr="127.0.0.1", master_port=port2,
                     ranks={"0": rank}, cause="a node joins")
    if rank == 1:  # its agent says nothing until this rank recovers: it learns of the change from the vote only
        def agent() -> None:
            table = ProgressTable(control, 1)
            while table.read(0).state != WorkerState.RECOVERING:
                time.sleep(0.01)
            write_assignment(control, new)

        threading.Thread(target=agent, daemon=True).start()
    recoveries = _Recoveries()
    torch.manual_seed(0)
    model = _model()
    data = TensorDataset(torch.randn(64, 4), torch.randn(64, 1))
    with elastictrain.Session(model, torch.optim.SGD(model.parameters(), lr=0.1), data, global_batch_size=8,
                              micro_batch_size=2, seed=0, max_steps=8, log_every=None,
                              hooks=[recoveries]) as session:
        for step in session.steps():
            if step.number == 3 and rank == 0:
                write_assignment(control, new)
            for micro in step:
                x, y = micro.batch
                micro.backward(torch.nn.functional.mse_loss(session.model(x), y))
        steps = session.step
        full = session.full_state_dict()  # DDP's: the module's own, whole on every rank
        whole = sorted(full) == sorted(model.state_dict()) and all(
            torch.equal(full[name], tensor) for name, tensor in model.state_dict().items())
    results.put((rank, recoveries.seen, steps, [p.detach().tolist() for p in model.parameters()], whole))


def test_a_session_whose_strategy_takes_the_vote_apart_stops_every_rank_after_the_same_step(tmp_path: Path) -> None:
    # Only rank 0's agent announces the next generation: rank 1 stops at that boundary because the
    # vote told it so (not because a collective failed once rank 0 had left).
    port, port2 = free_port(), free_port()
    controls = _control_dirs(tmp_path, port)
    out = _run_ranks(2, _explicit_session_worker, lambda rank: (controls[rank], port2), port=port)
    seen = {rank: report[0] for rank, report in out.items()}
    assert len(seen[0]) == len(seen[1]) == 1 and seen[0][0][0] == seen[1][0][0], seen
    step = seen[0][0][0]
    assert 3 <= step < 8, seen
    assert seen[0][0][1] == f"a node joins (at the boundary after step {step})", seen
    assert seen[1][0][1] == f"the agent re-forms the group (at the boundary after step {step})", seen
    assert out[0][1] == out[1][1] == 8
    assert out[0][2] == out[1][2], "the replicas diverged"
    assert out[0][3] and out[1][3], "full_state_dict() is not the module's whole state"


def test_full_state_dict_needs_a_started_session() -> None:
    model = _model()
    session = elastictrain.Session(model, torch.optim.SGD(model.parameters(), lr=0.1), list(range(8)),
                                   global_batch_size=8)
    with pytest.raises(SessionError, match="inside `with Session"):
        session.full_state_dict()
