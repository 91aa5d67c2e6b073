"""The parts of in-process recovery, one at a time: control channel, hang detector, budget,
the boundary flag in DDP's all-reduce, and the state transfer between live ranks."""

from __future__ import annotations

import hashlib
import multiprocessing as mp
import os
import socket
import threading
import time
import types
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

import elastictrain
from elastictrain._addresses import free_port
from elastictrain._control import (
    Assignment, AssignmentWatch, Doorbell, Progress, ProgressTable, WorkerState, write_assignment,
)
from elastictrain._process import proc_stat
from elastictrain.checkpoint import load_state_into
from elastictrain.train.control import JobEnded, WorkerControl
from elastictrain.errors import SessionError
from elastictrain.train.recovery import describe
from elastictrain.launch.hang_detector import HangDetector
from elastictrain.launch.worker_group import Channel, FailureBudget
from tests.support.leave import leave_together
from tests.support.ranks import next_report, rank_context


def _assignment(generation: int, **changes: Any) -> Assignment:
    return Assignment(generation=generation, round=generation - 1, world_size=2, master_addr="127.0.0.1",
                      master_port=1234, ranks={"0": 1}, **changes)


def test_an_assignment_is_read_again_only_when_it_changed(tmp_path: Path) -> None:
    watch = AssignmentWatch(tmp_path)
    assert watch.current() is None
    write_assignment(tmp_path, _assignment(1))
    first = watch.current()
    assert first is not None and first.generation == 1 and first.rank_of(0) == 1 and first.rank_of(3) is None
    assert watch.current() is first  # no change, no read
    write_assignment(tmp_path, _assignment(2, pending=True, cause="a node joined"))
    second = watch.current()
    assert second is not None and second.generation == 2 and second.pending and second.cause == "a node joined"


def test_progress_slots_written_by_a_worker_are_read_by_the_agent(tmp_path: Path) -> None:
    agent = ProgressTable(tmp_path, 2, create=True)
    worker = ProgressTable(tmp_path, 2)
    worker.write(1, pid=42, step=7, step_at=1.5, step_s=0.05, alive_at=2.5, state=WorkerState.TRAINING, generation=3)
    assert agent.read(1) == Progress(42, 7, 1.5, 0.05, 2.5, WorkerState.TRAINING, 3)
    assert agent.read(0).pid == 0
    worker.close()
    agent.close()


def _waited(channel: Channel, ends: dict[int, int] | None = None, timeout: float = 60.0) -> bool:
    """Whether ``channel.wait`` ended before its ``timeout``."""
    started = time.monotonic()
    channel.wait(timeout, ends)
    return time.monotonic() - started < timeout / 2


def test_a_worker_wakes_its_agent_when_its_slot_opens_its_state_changes_or_its_process_ends() -> None:
    channel = Channel(1)
    try:
        assert not _waited(channel, timeout=0.1)
        control = WorkerControl(channel.directory, 0, 1)
        try:
            assert _waited(channel), "opening the slot did not wake the agent"
            assert not _waited(channel, timeout=0.1), "one wake per change: the rings were not drained"
            control.set_state(WorkerState.RECOVERING)
            assert _waited(channel), "a collective's failure did not wake the agent"
            control.step_done(1)
            assert not _waited(channel, timeout=0.3), "a step woke the agent"
        finally:
            control.close()
        channel.wait(0.0)
        # Rings never block a worker: not when the agent has not read them (a full FIFO)...
        worker = Doorbell(channel.directory)
        for _ in range(100_000):
            worker.ring()
        assert _waited(channel) and not _waited(channel, timeout=0.1)
        # A worker process that ends wakes the agent once.
        process = mp.get_context("fork").Process(target=time.sleep, args=(1.0,))
        process.start()
        assert process.pid is not None
        ends = {process.pid: process.sentinel}
        assert not _waited(channel, ends, timeout=0.1)
        assert _waited(channel, ends), "a worker's end did not wake the agent"
        assert not _waited(channel, ends, timeout=0.1), "an ended worker woke the agent again"
        process.join()
        # An agent with many descriptors open (select() takes none numbered 1024 or more).
        read, write = os.pipe()
        high = os.dup2(read, 4000)
        os.close(read)
        os.close(write)  # its end: readable at once
        try:
            assert _waited(channel, {1: high}), "the end of a worker whose descriptor is numbered 4000 was missed"
        finally:
            os.close(high)
    finally:
        channel.close()
    # ... nor when the agent is gone.
    worker.ring()
    worker.close()


def test_worker_control_adopts_the_next_generation_and_refuses_a_closed_group(tmp_path: Path) -> None:
    ProgressTable(tmp_path, 1, create=True).close()
    write_assignment(tmp_path, _assignment(1))
    control = WorkerControl(str(tmp_path), 0, 1)
    try:
        assert control.generation == 1 and control.due() is None
        time.sleep(0.5)
        table = ProgressTable(tmp_path, 1)
        assert time.monotonic() - table.read(0).alive_at < 0.5  # the liveness thread runs
        write_assignment(tmp_path, _assignment(1, pending=True, cause="x"))
        assert control.due() is not None  # stop at the next boundary
        with pytest.raises(TimeoutError):
            control.wait_for_next(0.2)  # the same generation, still pending: nothing to adopt yet
        write_assignment(tmp_path, _assignment(2))
        adopted = control.wait_for_next(1.0)
        assert adopted.generation == 2 and control.generation == 2 and table.read(0).state == WorkerState.BUSY
        write_assignment(tmp_path, _assignment(3, closed=True, cause="stopped"))
        with pytest.raises(JobEnded, match="stopped"):
            control.wait_for_next(1.0)
        table.close()
    finally:
        control.close()


def _progress(step_s: float = 0.0, alive_at: float = 0.0, state: int = WorkerState.TRAINING,
              pid: int = 10) -> Progress:
    return Progress(pid, 5, alive_at, step_s, alive_at, state, 1)


LIVE = {0: 10}  # slot 0's running worker is pid 10 (_progress's default)


FROZEN = {10: (4.0, "T")}.get  # pid 10 is stopped, after 4 s of CPU


def _judged(detector: HangDetector, progress: Progress, now: float, live: dict[int, int] = LIVE) -> list[int]:
    """What ``detector`` says of ``progress`` at ``now``, after seeing it ``confirm_s`` earlier too."""
    detector.hung([progress], now - detector.confirm_s, live)
    return detector.hung([progress], now, live)


def test_a_stopped_worker_is_hung_one_waiting_in_a_collective_is_not() -> None:
    detector = HangDetector(floor_s=2.0, factor=10.0, startup_s=60.0, confirm_s=1.0, activity=FROZEN)
    t = 100.0
    # 50 ms steps: the deadline is the 2 s floor.
    assert detector.deadline(_progress(step_s=0.05)) == 2.0
    # Stopped (SIGSTOP): its liveness thread silent for 3 s, then still for 4 s, no CPU time used.
    assert detector.hung([_progress(step_s=0.05, alive_at=t)], t + 3.0, LIVE) == []  # a suspect, not yet
    assert detector.hung([_progress(step_s=0.05, alive_at=t)], t + 4.0, LIVE) == [0]
    assert "process state T" in detector.reason(0)  # what the agent's warning says
    assert _judged(detector, _progress(step_s=0.05, alive_at=t), t + 2.5) == []  # within its deadline at first
    # Blocked in a collective on a hung peer: no step, but its liveness thread runs.
    assert _judged(detector, _progress(step_s=0.05, alive_at=t + 2.9), t + 3.0) == []
    # Busy (forming a group, receiving the state): judged only by being stopped (below).
    assert _judged(detector, _progress(step_s=0.05, alive_at=t + 29.9, state=WorkerState.BUSY), t + 30) == []
    # Recovering: judged as training. It waits for the next generation with its liveness thread
    # running, unless it froze as it left its group (it says it recovers before it leaves).
    assert _judged(detector, _progress(step_s=0.05, alive_at=t, state=WorkerState.RECOVERING), t + 4.0) == [0]
    assert _judged(detector, _progress(step_s=0.05, alive_at=t + 29.9, state=WorkerState.RECOVERING), t + 30) == []
    assert _judged(detector, _progress(pid=0, step_s=0.05, alive_at=t), t + 30) == []  # an empty slot
    # The slot still holds a killed worker's last words; its replacement (pid 11) is starting.
    assert _judged(detector, _progress(step_s=0.05, alive_at=t), t + 30, {0: 11}) == []


def test_a_worker_stopped_while_it_starts_or_forms_a_group_is_hung_one_that_waits_there_is_not() -> None:
    # Seen in chaos: a worker stopped while its group formed was never killed (a forming worker
    # was never judged); its peers waited for it in the formation until it was continued, 70 s.
    asleep = HangDetector(floor_s=2.0, factor=10.0, startup_s=60.0, confirm_s=1.0, blocked_s=30.0,
                          activity=lambda _pid: (4.0, "S"))
    frozen = HangDetector(floor_s=2.0, factor=10.0, startup_s=60.0, confirm_s=1.0, blocked_s=30.0,
                          activity=FROZEN)
    for state in (WorkerState.BUSY, WorkerState.STARTING):
        # Waiting for its peers or building its model, however long: left alone.
        assert _judged(asleep, _progress(alive_at=100.0, state=state), 500.0) == []
        # Stopped: hung once its liveness thread has been silent past the floor.
        assert _judged(frozen, _progress(alive_at=100.0, state=state), 101.5) == []
        assert _judged(frozen, _progress(alive_at=100.0, state=state), 103.5) == [0]
    assert frozen.reason(0) == "its process is stopped (state T) while it starts"
    assert _judged(frozen, _progress(alive_at=100.0, state=WorkerState.DONE), 500.0) == []  # on its way out
    # Stopped before it wrote its slot (which still holds its predecessor's last words): hung
    # once seen stopped for the floor, without using CPU time.
    fresh = {0: 10}
    old_words = _progress(pid=9, alive_at=0.0, state=WorkerState.DONE)
    assert frozen.hung([old_words], 200.0, fresh) == []
    assert frozen.hung([old_words], 201.5, fresh) == []
    assert frozen.hung([old_words], 202.0, fresh) == [0]
    assert asleep.hung([old_words], 200.0, fresh) == asleep.hung([old_words], 300.0, fresh) == []
    # A plain script writes no slot: never judged, stopped or not (a debugger may hold it).
    never_written = _progress(pid=0, alive_at=0.0, state=WorkerState.STARTING)
    assert [frozen.hung([never_written], t, fresh) for t in (300.0, 302.0, 304.0, 400.0)] == [[]] * 4


def test_a_worker_starved_of_cpu_is_not_hung() -> None:
    # A loaded machine: the liveness thread did not get to run for 3 s, but the process runs
    # (its CPU time grows). It used to be killed, and its replacement too: a crash loop that
    # spent the node's budget.
    used = iter([(4.0, "R"), (4.3, "R"), (4.6, "R"), (4.6, "T")])
    detector = HangDetector(floor_s=2.0, factor=10.0, startup_s=60.0, confirm_s=1.0,
                            activity=lambda _pid: next(used))
    slot = [_progress(step_s=0.05, alive_at=100.0)]
    assert detector.hung(slot, 103.0, LIVE) == []
    assert detector.hung(slot, 104.0, LIVE) == []  # it ran in the meantime
    assert detector.hung(slot, 105.0, LIVE) == []
    assert detector.hung(slot, 106.0, LIVE) == [0]  # now it was stopped
    assert "process state T" in detector.reason(0)
    assert detector.hung([_progress(step_s=0.05, alive_at=105.9)], 106.0, LIVE) == []


def test_a_worker_asleep_in_a_call_that_holds_the_interpreter_gets_longer() -> None:
    # Seen under load: a worker blocked a few seconds in a native wait for its peer that holds
    # the GIL (its liveness thread silent, no CPU used) was killed as hung; its peer then waited
    # 60 s for it in the next group. Asleep is not stopped: it gets blocked_s.
    detector = HangDetector(floor_s=2.0, factor=10.0, startup_s=60.0, confirm_s=1.0, blocked_s=30.0,
                            activity=lambda _pid: (4.0, "S"))
    assert _judged(detector, _progress(step_s=0.05, alive_at=100.0), 104.0) == []
    assert _judged(detector, _progress(step_s=0.05, alive_at=100.0), 131.0) == [0]


def test_slow_steps_and_first_steps_get_more_time() -> None:
    detector = HangDetector(floor_s=2.0, factor=10.0, startup_s=60.0, confirm_s=1.0, activity=FROZEN)
    assert _judged(detector, _progress(alive_at=0.0), 30.0) == []  # before its second step
    assert _judged(detector, _progress(alive_at=0.0), 62.0) == [0]
    assert detector.deadline(_progress(step_s=1.0)) == pytest.approx(10.0)  # 1 s steps
    assert _judged(detector, _progress(step_s=1.0, alive_at=0.0), 10.5) == []
    assert _judged(detector, _progress(step_s=1.0, alive_at=0.0), 12.0) == [0]


def test_a_worker_measures_its_typical_step_and_pauses_do_not_stretch_it(tmp_path: Path,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    from elastictrain.train import control as control_module

    ProgressTable(tmp_path, 1, create=True).close()
    clock = [100.0]
    monkeypatch.setattr(control_module, "now", lambda: clock[0])
    control = WorkerControl(str(tmp_path), 0, 1)
    table = ProgressTable(tmp_path, 1)
    try:
        control.step_done(1)
        assert table.read(0).step_s == 0.0  # one step: no interval yet
        for step in range(2, 9):  # 50 ms steps, with a 20 s pause (an evaluation) before step 5
            clock[0] += 20.0 if step == 5 else 0.05
            control.step_done(step)
        assert table.read(0).step_s == pytest.approx(0.05)
        clock[0] += 0.5
        control.step_done(10)  # two steps at once (a slot read between them): 0.25 s each
        assert table.read(0).step_s == pytest.approx(0.05)
    finally:
        control.close()
        table.close()


def _sleep_a_while() -> None:
    time.sleep(120)


def test_a_worker_killed_before_its_forkserver_reports_it_is_not_taken_as_finished(tmp_path: Path) -> None:
    """A SIGKILLed worker is a zombie before its parent (the forkserver) reaps it and reports its
    exit: in that window how it ended is unknown, not a clean exit. The forkserver is stopped here
    to hold the window open; a node on a GPU machine fell into it on its own and ended a job at
    step 445 of 4000 with success, taking the killed worker (and, in another run, two that had
    failed) for finished."""
    import os
    import signal

    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, start_processes

    from elastictrain.launch.worker_group import WorkerProcesses

    workers = WorkerProcesses(lambda _: start_processes(
        name="sleeper", entrypoint=_sleep_a_while, args={0: ()}, envs={0: {}},
        logs_specs=DefaultLogsSpecs(log_dir=str(tmp_path)), start_method="forkserver"))
    pid = workers.start([0])[0]
    forkserver = int(proc_stat(pid)[1])
    os.kill(forkserver, signal.SIGSTOP)
    try:
        os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while proc_stat(pid)[0] != "Z" and time.monotonic() < deadline:
            time.sleep(0.01)
        assert proc_stat(pid)[0] == "Z"  # dead, and not reported by its parent yet
        assert workers.poll() == {}
    finally:
        os.kill(forkserver, signal.SIGCONT)
    try:
        deadline = time.monotonic() + 20
        while not (ended := workers.poll()) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert ended and ended[0].is_failed()
        assert ended[0].failures[0].signal_name() == "SIGKILL"
    finally:
        workers.close()


def test_the_budget_counts_failures_in_a_window_and_backs_off() -> None:
    budget = FailureBudget(limit=3, window_s=60.0, backoff_first_s=1.0, backoff_max_s=3.0)
    assert budget.spend(0.0) == 0.0  # the first failure: replaced at once
    assert budget.spend(1.0) == 1.0
    assert budget.spend(2.0) == 2.0
    assert budget.spend(3.0) is None  # a fourth within the window: the job fails
    assert budget.used(3.0) == 3
    assert budget.spend(70.0) == 0.0  # the first three left the window
    assert FailureBudget(limit=0).spend(0.0) is None


def test_only_a_crash_loop_backs_off_a_worker_that_trained_is_replaced_at_once() -> None:
    budget = FailureBudget(limit=10, window_s=60.0, backoff_first_s=1.0, backoff_max_s=30.0)
    assert [budget.spend(t, trained=True) for t in (0.0, 1.0, 2.0)] == [0.0, 0.0, 0.0]
    # Then replacements that fail before their first step: a crash loop, backed off.
    assert [budget.spend(t) for t in (3.0, 4.0, 5.0)] == [1.0, 2.0, 4.0]
    assert budget.spend(6.0, trained=True) == 0.0  # one trained again: the loop is over
    assert budget.spend(7.0) == 1.0
    assert budget.used(7.0) == 8  # every failure spends the budget all the same


def _file_init(tmp_path: Path) -> str:
    """An ``init_method`` of this test's own: a free port, released and passed to the ranks, can be
    taken by another test before rank 0 binds it (rank 0 then dies and its peers wait)."""
    return f"file://{tmp_path / 'group-init'}"


def _run_ranks(world: int, target: Any, args_of: Any, port: int | None = None, *,
               init_method: str | None = None) -> dict[int, tuple]:
    """Run ``target(rank, WHERE, *args_of(rank), results)`` in ``world`` forked ranks (rank_context), WHERE
    being ``init_method`` if given, else ``port`` (a free one if none), for workers that form their group
    the product's way; each puts ``(rank, *report)`` on ``results``. Returns every rank's report, by
    rank; fails as soon as a rank exits without reporting."""
    ctx = rank_context()
    results = ctx.Queue()
    where = init_method if init_method is not None else port if port is not None else free_port()
    procs = [ctx.Process(target=target, args=(rank, where, *args_of(rank), results), name=f"rank {rank}")
             for rank in range(world)]
    for p in procs:
        p.start()
    out: dict[int, tuple] = {}
    try:
        while len(out) < world:
            rank, *report = next_report(results, [p for r, p in enumerate(procs) if r not in out], timeout=120)
            out[rank] = tuple(report)
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    return out


class _DictOut(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))

    def forward(self, x: torch.Tensor) -> dict[str, Any]:
        out = self.body(x)
        return {"out": out, "aux": (out * 2, "label")}

    def describe(self) -> str:
        return "a method of the user's model"


def _ddp_worker(rank: int, init_method: str, results: Any) -> None:
    from torch.nn.parallel import DistributedDataParallel

    from elastictrain.train.ddp import BoundaryFlag

    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=2)
    torch.manual_seed(0)
    model = _DictOut()
    plain = DistributedDataParallel(model)
    flagged_model = _DictOut()
    flagged_model.load_state_dict(model.state_dict())
    flag = BoundaryFlag(flagged_model)
    flagged = DistributedDataParallel(flag, bucket_cap_mb=0.0001)  # several buckets
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(rank))
    plain(x)["out"].sum().backward()
    raised = []
    for wanted in ((False, False), (rank == 1, rank == 1), (True, True)):
        flag.arm(wanted[0])
        flagged_model.zero_grad()
        flagged(x)["out"].sum().backward()
        raised.append(flag.raised)
    same = all(torch.equal(a.grad, b.grad) for a, b in zip(model.parameters(), flagged_model.parameters()))
    # Three micro-batches, the first two without synchronizing: one vote per step, not per backward.
    flag.arm(rank == 0)
    flagged_model.zero_grad()
    with flagged.no_sync():
        for _ in range(2):
            flagged(x)["aux"][0].sum().backward()
    flagged(x)["out"].sum().backward()
    raised.append(flag.raised)
    results.put((rank, same, raised, flagged.module.describe(), sorted(flagged_model.state_dict())))
    # Not torch's teardown: freeing DDP's reducer with the interpreter held joined a gloo thread that
    # waited for the interpreter to free its last all-reduce (pytorch#75097), and the queue's feeder
    # thread, which needs it too, never sent the report: the test's 120 s timeout.
    results.close()
    results.join_thread()
    leave_together()


def test_the_boundary_flag_rides_on_ddps_all_reduce_and_leaves_the_gradients_as_ddps_own(tmp_path: Path) -> None:
    out = _run_ranks(2, _ddp_worker, lambda rank: (), init_method=_file_init(tmp_path))
    for rank in (0, 1):
        same, raised, described, keys = out[rank]
        assert same, f"rank {rank}: gradients differ from DDP's default all-reduce"
        assert raised == [0, 1, 2, 1], f"rank {rank} saw flags {raised}"
        assert described == "a method of the user's model"
        assert keys == ["body.0.bias", "body.0.weight", "body.2.bias", "body.2.weight"]


def test_the_boundary_flag_says_which_outputs_it_cannot_carry() -> None:
    from elastictrain.train.ddp import BoundaryFlag

    class Opaque(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.linear = torch.nn.Linear(2, 1)

        def forward(self, x: torch.Tensor) -> object:
            return types.SimpleNamespace(out=self.linear(x))

    flag = BoundaryFlag(Opaque())
    with pytest.raises(SessionError, match="returned SimpleNamespace"):
        flag(torch.zeros(1, 2))
    with torch.no_grad():
        assert flag(torch.zeros(1, 2)).out.shape == (1, 1)  # no backward follows: nothing to carry


def _refused_worker(rank: int, init_method: str, results: Any) -> None:
    from elastictrain.train.state_transfer import agree, transfer

    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=2,
                            timeout=timedelta(seconds=60))
    state = {"extras": {"handle": object()} if rank == 0 else {}}  # nothing weights-only can load
    agreement = agree(None, holds=rank == 0, step=3 if rank == 0 else 0)
    started = time.monotonic()
    try:
        transfer(None, agreement, state, step=agreement.step or 0)
        results.put((rank, "sent", 0.0))
    except Exception as exc:  # noqa: BLE001 - reported to the test
        results.put((rank, f"{type(exc).__name__}: {exc}", time.monotonic() - started))
    dist.destroy_process_group()


def test_a_state_that_cannot_be_sent_fails_every_rank_at_once(tmp_path: Path) -> None:
    out = _run_ranks(2, _refused_worker, lambda rank: (), init_method=_file_init(tmp_path))
    assert out[0][0].startswith("ConfigError") and "builtins.object" in out[0][0], out[0]
    assert out[1][0].startswith("ConfigError: rank 0 could not send"), out[1]
    assert out[1][1] < 30, f"the receiver waited {out[1][1]:.0f}s"


def _transfer_worker(rank: int, init_method: str, holds: bool, results: Any) -> None:
    from elastictrain.train.sampler import ElasticSampler
    from elastictrain.train.state_transfer import agree, transfer

    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=3)
    torch.manual_seed(rank)  # different weights on every rank
    model = torch.nn.Linear(1024, 512)  # its weight and Adam's moments of it (2 MiB each) go on their own
    optimizer = torch.optim.Adam(model.parameters())
    sampler = ElasticSampler(100, global_batch_size=10, rank=rank, world_size=3)
    extras = {"note": f"rank {rank}"}
    step = {0: 7, 1: 6, 2: 0}[rank]
    if holds:
        model(torch.ones(1, 1024)).sum().backward()
        optimizer.step()  # Adam state exists on holders only
        sampler.commit_step()
    state = {"model": model, "optimizer": optimizer, "sampler": sampler, "extras": extras}
    agreement = agree(None, holds=holds, step=step)
    received = transfer(None, agreement, state, step=step)
    results.put((rank, agreement.step, agreement.source, agreement.receivers, received,
                 [hashlib.sha256(p.detach().numpy().tobytes()).hexdigest() for p in model.parameters()] + [
                     hashlib.sha256(t.numpy().tobytes()).hexdigest() for entry in optimizer.state.values()
                     for t in entry.values()], sampler.cursor, dict(extras),
                 len(optimizer.state_dict()["state"])))
    dist.destroy_process_group()


def test_the_newest_state_goes_from_a_live_holder_to_the_ranks_without_it(tmp_path: Path) -> None:
    # Rank 0 holds step 7, rank 1 holds step 6 (it missed the last step), rank 2 is new.
    holds = {0: True, 1: True, 2: False}
    out = _run_ranks(3, _transfer_worker, lambda rank: (holds[rank],), init_method=_file_init(tmp_path))
    for rank in range(3):
        step, source, receivers, received, params, cursor, extras, optimizer_entries = out[rank]
        assert (step, source, receivers) == (7, 0, (1, 2))
        assert received == (rank != 0)
        assert params == out[0][4], f"rank {rank} has other weights"
        assert cursor == out[0][5] and extras == {"note": "rank 0"} and optimizer_entries == 2


def _routing_worker(rank: int, init_method: str, step: int, results: Any) -> None:
    from elastictrain.train.state_transfer import agree, transfer

    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=5)
    torch.manual_seed(rank)
    model = torch.nn.Linear(1024, 512)  # 2 MiB of weight: a message of its own
    extras = {"from": rank}
    agreement = agree(None, holds=step > 0, step=step)
    received = transfer(None, agreement, {"model": model, "extras": extras}, step=step)
    results.put((rank, received, extras["from"], hashlib.sha256(model.weight.detach().numpy().tobytes()).hexdigest()))
    dist.destroy_process_group()


def test_each_rank_without_the_state_receives_it_from_one_holder_the_holders_taking_turns(tmp_path: Path) -> None:
    # Ranks 0 and 2 hold step 7 (here with different weights and extras, to tell whose arrives),
    # rank 1 holds step 6 and ranks 3 and 4 are new: 1 and 4 receive from 0, 3 from 2.
    steps = {0: 7, 1: 6, 2: 7, 3: 0, 4: 0}
    out = _run_ranks(5, _routing_worker, lambda rank: (steps[rank],), init_method=_file_init(tmp_path))
    got = {rank: (received, source) for rank, (received, source, _) in out.items()}
    assert got == {0: (False, 0), 1: (True, 0), 2: (False, 2), 3: (True, 2), 4: (True, 0)}, got
    assert out[1][2] == out[4][2] == out[0][2] != out[3][2] == out[2][2]


def test_the_transferred_state_comes_back_equal_in_tensors_of_its_own() -> None:
    from elastictrain.train.state_transfer import _decode, _encode

    class Holder:
        def __init__(self, state: dict) -> None:
            self.state = state

        def state_dict(self) -> dict:
            return self.state

    odd = torch.arange(12, dtype=torch.float64).reshape(3, 4).t()  # not contiguous
    held = {
        "scalar": torch.tensor(3.5),  # 0-dim, like Adam's step
        "mask": torch.tensor([True, False, True]),
        "ids": torch.arange(5, dtype=torch.int64),
        "half": torch.randn(7, dtype=torch.bfloat16),
        "odd": odd,
        "empty": torch.empty(0, 3),
        "sparse": torch.eye(3).to_sparse(),
        "rng": torch.get_rng_state(),
        "nested": [(1, "a", torch.ones(2, 2, dtype=torch.uint8)), {"x": None}],
        "big": torch.randn(512, 1024),  # 2 MiB: sent on its own
        "big_odd": torch.randn(1024, 512).t(),
    }
    payload, direct = _encode({"holder": Holder(held), "extras": {"note": "n"}}, 9)
    content, slots = _decode(payload)
    assert [t.shape for t in slots] == [t.shape for t in direct] == [(512, 1024), (512, 1024)]
    for slot, sent in zip(slots, direct, strict=True):
        slot.copy_(sent)  # what the broadcasts do
    assert content["step"] == 9 and content["extras"] == {"extras": {"note": "n"}}
    got = content["stateful"]["holder"]
    assert payload.numel() < 1 << 20, "the large tensors are not in the buffer"
    for key in ("scalar", "mask", "ids", "half", "odd", "empty", "rng", "big", "big_odd"):
        assert got[key].dtype == held[key].dtype and torch.equal(got[key], held[key]), key
        assert got[key].untyped_storage().data_ptr() != payload.untyped_storage().data_ptr(), key
    assert torch.equal(got["sparse"].to_dense(), torch.eye(3))
    assert got["nested"][0][:2] == (1, "a") and torch.equal(got["nested"][0][2], torch.ones(2, 2, dtype=torch.uint8))
    assert got["nested"][1] == {"x": None}


class _TiedLM(torch.nn.Module):
    """An embedding whose output projection is the embedding's own weight (a tied LM head)."""

    def __init__(self, vocab: int) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(vocab, 64)
        self.out = torch.nn.Linear(64, vocab, bias=False)
        self.out.weight = self.emb.weight


@pytest.mark.parametrize("vocab", [16, 8192], ids=["in_the_buffer", "sent_on_its_own"])
def test_a_tied_weight_is_sent_once_and_arrives_tied(vocab: int) -> None:
    from elastictrain.train.state_transfer import _decode, _encode

    def sent(model: torch.nn.Module) -> tuple[int, torch.Tensor, list[torch.Tensor]]:
        payload, direct = _encode({"model": model}, 3)
        return payload.numel() + sum(t.numel() * t.element_size() for t in direct), payload, direct

    torch.manual_seed(0)
    sender, receiver, untied = _TiedLM(vocab), _TiedLM(vocab), _TiedLM(vocab)
    untied.out.weight = torch.nn.Parameter(sender.emb.weight.detach().clone())
    tied_bytes, payload, direct = sent(sender)
    # The same values under two weights of their own cost one weight more: tied, one copy travels.
    weight_bytes = vocab * 64 * 4
    assert tied_bytes <= sent(untied)[0] - weight_bytes + 512, (tied_bytes, sent(untied)[0], weight_bytes)
    content, slots = _decode(payload)
    for slot, tensor in zip(slots, direct, strict=True):
        slot.copy_(tensor)
    got = content["stateful"]["model"]
    assert got["emb.weight"] is got["out.weight"]
    load_state_into({"model": receiver}, content["stateful"], content["extras"], 3)
    assert receiver.out.weight is receiver.emb.weight
    assert torch.equal(receiver.emb.weight, sender.emb.weight)


def test_nobody_holding_state_means_every_rank_reads_the_checkpoint(tmp_path: Path) -> None:
    out = _run_ranks(3, _transfer_worker, lambda rank: (False,), init_method=_file_init(tmp_path))
    assert all(out[rank][:4] == (None, None, (), False) for rank in range(3))


def test_workers_still_running_long_after_the_job_finished_elsewhere_are_reported_once(caplog) -> None:
    import logging
    import types

    from elastictrain.launch.inprocess_agent import _LINGER, InProcessAgent
    from elastictrain.launch.worker_group import WorkerProcesses

    agent = object.__new__(InProcessAgent)  # only the state this check reads
    agent._finished_elsewhere_at, agent._lingering_said = None, False
    agent._workers = WorkerProcesses(lambda _: None)
    training = types.SimpleNamespace(finished_seen=False)
    finished = types.SimpleNamespace(finished_seen=True)
    with caplog.at_level(logging.WARNING, logger="elastictrain.launch.inprocess_agent"):
        agent._say_if_lingering(training, 0.0)
        agent._say_if_lingering(finished, 10.0)
        agent._say_if_lingering(finished, 10.0 + _LINGER.total_seconds() / 2)
        assert not caplog.records
        for now in (11.0 + _LINGER.total_seconds(), 20.0 + _LINGER.total_seconds()):
            agent._say_if_lingering(finished, now)
    assert len(caplog.records) == 1 and "destroy_process_group" in caplog.records[0].getMessage()


def _inprocess_worker(rank: int, port: int, control: str) -> None:
    """Form a group of 2 and point this process at ``control``, as an in-process agent would."""
    import os

    import elastictrain
    from elastictrain._control import CONTROL_DIR_ENV

    context = elastictrain.WorkerContext(rank=rank, world_size=2, master_addr="127.0.0.1", master_port=port)
    elastictrain.init_process_group(context, backend="gloo")
    os.environ[CONTROL_DIR_ENV] = control


def _control_dirs(tmp_path: Path, port: int) -> list[str]:
    """One agent control directory per rank (per node), at generation 1 of a world of 2."""
    controls = []
    for rank in range(2):
        control = tmp_path / f"node{rank}"
        control.mkdir()
        ProgressTable(control, 1, create=True).close()
        write_assignment(control, Assignment(generation=1, round=0, world_size=2, master_addr="127.0.0.1",
                                             master_port=port, ranks={"0": rank}))
        controls.append(str(control))
    return controls


def _buffers_worker(rank: int, port: int, control: str, ddp_kwargs: dict, results: Any) -> None:
    from torch.utils.data import TensorDataset

    import elastictrain

    _inprocess_worker(rank, port, control)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8), torch.nn.Linear(8, 1))
    data = TensorDataset(torch.randn(64, 4), torch.randn(64, 1))
    with elastictrain.Session(model, torch.optim.SGD(model.parameters(), lr=0.1), data, global_batch_size=8,
                              seed=0, max_steps=3, log_every=None, ddp_kwargs=ddp_kwargs) as session:
        for step in session.steps():
            for micro in step:
                x, y = micro.batch
                micro.backward(torch.nn.functional.mse_loss(session.model(x), y))
    results.put((rank, model[1].running_mean.tolist()))


@pytest.mark.parametrize("ddp_kwargs", [{}, {"broadcast_buffers": False}, {"forward_sync_buffers": True}],
                         ids=["default", "broadcast_buffers=False", "forward_sync_buffers=True"])
def test_in_process_training_synchronizes_buffers_as_the_user_asked_ddp(tmp_path: Path, ddp_kwargs: dict) -> None:
    # DDP's buffer broadcast (inside the forward) is replaced by one at each step boundary;
    # a user who turned it off keeps rank-local buffers.
    port = free_port()
    controls = _control_dirs(tmp_path, port)
    out = _run_ranks(2, _buffers_worker, lambda rank: (controls[rank], ddp_kwargs), port=port)
    means = {rank: report[0] for rank, report in out.items()}
    synchronized = means[0] == means[1]
    assert synchronized == ddp_kwargs.get("broadcast_buffers", True), means


def _peer_lost_worker(rank: int, port: int, control: str, results: Any) -> None:
    import os

    from torch.utils.data import TensorDataset

    import elastictrain

    _inprocess_worker(rank, port, control)

    def agent() -> None:  # what the agent does once its worker says it recovers: here, end the job
        table = ProgressTable(control, 1)
        while table.read(0).state != WorkerState.RECOVERING:
            time.sleep(0.01)
        write_assignment(control, Assignment(generation=2, round=1, world_size=1, master_addr="127.0.0.1",
                                             master_port=1, ranks={"0": 0}, closed=True, cause="test over"))

    threading.Thread(target=agent, daemon=True).start()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    data = TensorDataset(torch.randn(64, 4), torch.randn(64, 1))
    applied = []
    try:
        with elastictrain.Session(model, torch.optim.SGD(model.parameters(), lr=0.1), data, global_batch_size=8,
                                  seed=0, max_steps=6, log_every=None) as session:
            for step in session.steps():
                if rank == 0 and step.number == 2:
                    os._exit(3)  # rank 0 dies at the start of the group's second step
                for micro in step:
                    x, y = micro.batch
                    micro.backward(torch.nn.functional.mse_loss(session.model(x), y))
                if not step.discarded:
                    applied.append(step.number)
    except Exception as exc:  # noqa: BLE001 - reported to the test
        results.put((rank, applied, f"{type(exc).__name__}: {describe(exc)}"))
        return
    results.put((rank, applied, "finished"))


def test_a_peer_lost_after_a_groups_first_step_discards_the_next_step_and_does_not_fail_training(
        tmp_path: Path) -> None:
    # DDP broadcasts rank 0's bucket order in the forward after its first synchronized backward:
    # a collective inside the user's forward, whose failure would escape the step loop. The
    # session rebuilds the buckets at the step boundary instead, where a failure is a recovery.
    ctx = rank_context()
    results = ctx.Queue()
    port = free_port()
    controls = _control_dirs(tmp_path, port)
    procs = [ctx.Process(target=_peer_lost_worker, args=(rank, port, controls[rank], results)) for rank in range(2)]
    for p in procs:
        p.start()
    try:
        rank, applied, outcome = next_report(results, procs[1:], timeout=120)  # rank 0 dies on purpose
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    assert procs[0].exitcode == 3
    assert rank == 1 and applied == [1]
    assert outcome.startswith("JobEnded"), f"the survivor's training failed: {outcome}"


class _Recoveries:
    def __init__(self) -> None:
        self.after_steps: list[int] = []

    def on_recovery(self, *, step: int, cause: str, generation: int, world_size: int, seconds: float) -> None:
        self.after_steps.append(step)


def _launched_as(rank: int, port: int, control: str) -> None:
    """The environment an in-process agent gives its worker: rank ``rank`` of a world of 2 (one
    worker per node) at ``port``, its node's control directory ``control``."""
    import os

    from elastictrain._control import CONTROL_DIR_ENV

    os.environ.update(RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1",
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), **{CONTROL_DIR_ENV: control})


def _save_in_flight_worker(rank: int, port: int, control: str, ckpt: str, port2: int, results: Any) -> None:
    from torch.utils.data import TensorDataset

    import elastictrain

    _launched_as(rank, port, control)
    release = Path(ckpt) / "release"
    deadline = time.monotonic() + 75  # a safety net: then the save is written and the test fails

    def slow_write(stage: str) -> None:  # the save of step 4 is written once rank 0 has trained step 7
        while stage == "during_write" and not release.exists() and time.monotonic() < deadline:
            time.sleep(0.01)

    recoveries = _Recoveries()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    data = TensorDataset(torch.randn(64, 4), torch.randn(64, 1))
    # One save in flight only (no checkpoint_every): later saves, slow on busy cores, would
    # rightly keep the ranks training on too, for up to group_keeper.SAVE_GRACE. Five epochs of 8
    # steps: in one, the job ended at step 8, as the vote to re-form was cast, and sometimes before.
    with elastictrain.Session(model, torch.optim.SGD(model.parameters(), lr=0.1), data, global_batch_size=8,
                              seed=0, epochs=5, max_steps=40, log_every=None, checkpoint_dir=ckpt,
                              async_save=True, hooks=[recoveries]) as session:
        for step in session.steps():
            if step.number == 1:
                session.checkpoints._fault_hook = slow_write
            if step.number == 5:  # a node joins while the save of step 4 is being written
                session.save()
                write_assignment(control, Assignment(generation=2, round=1, world_size=2, master_addr="127.0.0.1",
                                                     master_port=port2, ranks={"0": rank}, cause="a node joins"))
            if step.number == 7 and rank == 0:
                release.touch()
            time.sleep(0.05)
            for micro in step:
                x, y = micro.batch
                micro.backward(torch.nn.functional.mse_loss(session.model(x), y))
    results.put((rank, recoveries.after_steps))


@pytest.mark.timeout(180)
def test_the_ranks_train_on_while_a_checkpoint_save_is_in_flight_before_re_forming_for_a_join(
        tmp_path: Path) -> None:
    # Re-forming closes the checkpoint manager, which waits for the save in flight to be
    # written: the ranks and a joining node's workers would all wait for it. The ranks vote to
    # re-form only once it is written (here: once rank 0 trains step 7), training on meanwhile.
    port, port2 = free_port(), free_port()
    controls = _control_dirs(tmp_path, port)
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    out = _run_ranks(2, _save_in_flight_worker, lambda rank: (controls[rank], str(ckpt), port2), port=port)
    for rank, (after_steps,) in out.items():
        assert len(after_steps) == 1 and 7 <= after_steps[0] < 40, (rank, after_steps)


def test_commit_outside_the_loop_run_elastic_runs_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    """Before, a commit() before run_elastic() counted a step that never ran, silently."""
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    state = elastictrain.ElasticState(model=torch.nn.Linear(2, 1))
    with pytest.raises(SessionError, match="called outside it"):
        state.commit()
    assert state.step == 0

    def train(s: elastictrain.ElasticState) -> int:
        s.commit()
        s.commit()
        return s.step

    assert elastictrain.run_elastic(train, state) == 2
    with pytest.raises(SessionError):
        state.commit()  # after the loop, too


def _leaving_worker(rank: int, port: int, results: Any) -> None:
    from elastictrain.train import process_group as pg
    from elastictrain.train.ddp import DDPStrategy
    from elastictrain.train.generation import Generation
    from elastictrain.train.worker import WorkerContext

    context = WorkerContext(rank=rank, world_size=2, master_addr="127.0.0.1", master_port=port)
    generation = Generation(pg.init_process_group(context, backend="gloo", timeout=10), None, in_process=True,
                            strategy=DDPStrategy())
    module = torch.nn.Linear(4, 4)
    generation.wrap(module, torch.optim.SGD(module.parameters(), lr=0.1), identical=False, control=None)
    held = generation.model  # as a failed step's traceback may hold it past the leave
    waiting = torch.zeros(4)
    if rank == 0:  # blocked on rank 1, which has moved on
        try:
            dist.broadcast(waiting, src=1)
            results.put((rank, "the broadcast returned"))
        except RuntimeError as exc:
            results.put((rank, str(exc)))
        pg.destroy_process_group()
        return
    queued = dist.all_reduce(waiting, async_op=True)  # a collective its peer never joins (a DDP bucket)
    time.sleep(0.5)
    generation.leave()
    try:
        queued.wait()
        results.put((rank, "the queued all-reduce returned"))
    except RuntimeError as exc:
        results.put((rank, str(exc)))
    del held


def test_a_rank_that_leaves_its_group_frees_the_peers_blocked_on_it_at_once() -> None:
    """gloo cannot abort a collective, and a group that something still holds (DDP, a queued
    collective) keeps its connections after it is destroyed: without severing them, the peer
    and the queued collective both waited out the 10 s timeout ("Timed out waiting")."""
    reports = _run_ranks(2, _leaving_worker, lambda rank: ())
    for rank, (message,) in reports.items():
        assert "closed" in message.lower() or "reset" in message.lower(), (rank, message)


def _foreign_connection_worker(rank: int, port: int, results: Any) -> None:
    from elastictrain.train import peer_connections, process_group as pg
    from elastictrain.train.worker import WorkerContext

    pg.init_process_group(WorkerContext(rank=rank, world_size=2, master_addr="127.0.0.1", master_port=port),
                          backend="gloo", timeout=10)
    if rank == 1:
        time.sleep(1.0)  # rank 0 waits in new_group meanwhile
        pg.new_gloo_group()
        dist.barrier()
        results.put((rank, None, None))
        pg.destroy_process_group()
        return
    server = socket.create_server(("127.0.0.1", 0))
    opened: list[socket.socket] = []
    threading.Timer(0.3, lambda: opened.append(socket.create_connection(server.getsockname()))).start()
    group = pg.new_gloo_group()  # the user's thread connects somewhere while it forms
    accepted, _ = server.accept()
    severed = peer_connections.sever(group)
    opened[0].sendall(b"still open")
    received = accepted.recv(10)
    dist.barrier()
    results.put((rank, severed, received))
    pg.destroy_process_group()


def test_a_connection_another_thread_opens_while_a_group_forms_is_never_taken_for_the_groups() -> None:
    """Every TCP connection opened while a gloo group formed was taken for one of its own: a
    user's thread connecting meanwhile (a metrics client) had its connection shut down when
    the rank left the group."""
    reports = _run_ranks(2, _foreign_connection_worker, lambda rank: ())
    severed, received = reports[0]
    assert received == b"still open" and severed == 0


def _short_session(ckpt: str, max_steps: int) -> elastictrain.Session:
    from torch.utils.data import TensorDataset

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    data = TensorDataset(torch.randn(32, 4), torch.randn(32, 1))
    return elastictrain.Session(model, torch.optim.SGD(model.parameters(), lr=0.1), data, global_batch_size=8,
                                seed=0, max_steps=max_steps, log_every=None, checkpoint_dir=ckpt, checkpoint_every=1)


def _train(session: elastictrain.Session) -> None:
    for step in session.steps():
        for micro in step:
            x, y = micro.batch
            micro.backward(torch.nn.functional.mse_loss(session.model(x), y))


def _abandoned_worker(port: int, control: str, ckpt: str, results: Any) -> None:
    """Rank 1 of generation 1 (world 2), started by its agent: a Session that forms its group,
    with a checkpoint of step 2 to restore when no rank holds state."""
    _launched_as(1, port, control)
    try:
        with _short_session(ckpt, max_steps=3) as session:
            _train(session)
            restored = session.restored.step if session.restored else None
            results.put((session.context.rank, session.context.world_size, session.step, restored, "finished"))
    except Exception as exc:  # noqa: BLE001 - reported to the test
        results.put((None, None, None, None, f"{type(exc).__name__}: {describe(exc)}"))


def _plain_loop_worker(port: int, control: str, ckpt: str, results: Any) -> None:
    """Rank 1 of generation 1 (world 2), started by its agent: a plain loop under run_elastic,
    with a checkpoint to restore when no rank holds state."""
    _launched_as(1, port, control)
    state = elastictrain.ElasticState(model=torch.nn.Linear(4, 1))
    restored = []

    def restore() -> None:
        restored.append(state.context.world_size)

    def train(state: elastictrain.ElasticState) -> tuple[int, int]:
        return state.context.rank, state.context.world_size

    try:
        rank, world = elastictrain.run_elastic(train, state, restore=restore)
        results.put((rank, world, restored, "finished"))
    except Exception as exc:  # noqa: BLE001 - reported to the test
        results.put((None, None, restored, f"{type(exc).__name__}: {describe(exc)}"))


def _rank_0_that_forms_and_dies(port: int) -> None:
    """Rank 0 of generation 1: forms the group with rank 1, then dies before the state goes round."""
    import os

    from elastictrain.train import process_group as pg

    context = elastictrain.WorkerContext(rank=0, world_size=2, master_addr="127.0.0.1", master_port=port)
    pg.init_process_group(context, backend="gloo", generation=(f"round0-world2-127.0.0.1:{port}", lambda: False))
    os._exit(0)


def _abandon_round_once_rank_1_waits(port: int, round_: int, worker: Any, deadline: float) -> None:
    """Host rank 0's store of ``round_`` (world 2) as rank 0's worker does (process_group._meet),
    start ``worker`` if it has not started, and close the store once rank 1 waits at it: rank 0
    leaves the round."""
    server = dist.TCPStore("127.0.0.1", port, None, True, timedelta(seconds=30), wait_for_workers=False,
                           multi_tenant=True)
    rounds = dist.PrefixStore(f"elastictrain/round{round_}-world2-127.0.0.1:{port}", server)
    if worker.pid is None:
        worker.start()
    while rounds.add("arrived", 0) < 1:
        assert time.monotonic() < deadline and worker.is_alive()
        time.sleep(0.05)
    del rounds, server


def _wait_until_recovering(control: Path, generation: int, worker: Any, deadline: float) -> None:
    """Until the worker's progress slot says it recovers from ``generation``: what its agent waits
    for to re-form."""
    table = ProgressTable(control, 1)
    try:
        while (table.read(0).state, table.read(0).generation) != (WorkerState.RECOVERING, generation):
            assert time.monotonic() < deadline and worker.is_alive(), "the worker did not wait for a generation"
            time.sleep(0.02)
    finally:
        table.close()


@pytest.mark.parametrize(("rank_0", "loop"), [("leaves while rank 1 waits at its store", "session"),
                                              ("dies once the group formed", "session"),
                                              ("leaves while rank 1 waits at its store", "run_elastic"),
                                              ("dies once the group formed", "run_elastic")])
def test_a_new_worker_whose_first_group_fails_to_form_joins_the_next_generation(tmp_path: Path, rank_0: str,
                                                                                loop: str) -> None:
    # A new worker's first group fails while it forms: rank 0 follows the agents to a newer
    # generation (or dies) and its store goes with it, or a peer dies while the state goes
    # round, before this worker's agent has said anything. That is no failure of this worker:
    # it waits for the next generation (chaos, stop 28: it exited with code 1, which spent
    # its node's budget and backed off its replacement by up to 30 s).
    port, next_port = free_port(), free_port()
    control = Path(_control_dirs(tmp_path, port)[1])  # rank 1's node, at generation 1
    ctx = rank_context()
    results = ctx.Queue()
    ckpt = tmp_path / "ckpt"
    with _short_session(str(ckpt), max_steps=2) as session:  # a checkpoint of step 2 (world 1)
        _train(session)
    worker = _abandoned_worker if loop == "session" else _plain_loop_worker
    procs = [ctx.Process(target=worker, args=(port, str(control), str(ckpt), results))]
    deadline = time.monotonic() + 60
    try:
        if rank_0.startswith("leaves"):
            _abandon_round_once_rank_1_waits(port, 0, procs[0], deadline)
        else:
            procs.append(ctx.Process(target=_rank_0_that_forms_and_dies, args=(port,)))
            for proc in procs:
                proc.start()
        _wait_until_recovering(control, 1, procs[0], deadline)
        write_assignment(control, Assignment(generation=2, round=1, world_size=1, master_addr="127.0.0.1",
                                             master_port=next_port, ranks={"0": 0}))
        # The first group failed before any rank held state: the next one, where still none
        # does, restores the checkpoint (rather than take the fresh model for a step's).
        expected = (0, 1, 3, 2, "finished") if loop == "session" else (0, 1, [1], "finished")
        assert next_report(results, procs[:1], timeout=60) == expected
    finally:
        for proc in procs:
            proc.join(timeout=30)
            if proc.is_alive():
                proc.kill()


def test_a_worker_whose_groups_keep_failing_to_form_fails_after_a_few(tmp_path: Path) -> None:
    # A peer that can never be reached must not keep the job re-forming for ever: after
    # FORMATION_ATTEMPTS failures in a row the worker fails (and spends its node's budget).
    from elastictrain.train.recovery import FORMATION_ATTEMPTS

    port = free_port()
    control = Path(_control_dirs(tmp_path, port)[1])  # rank 1's node, at generation 1
    ckpt = tmp_path / "ckpt"
    ctx = rank_context()
    results = ctx.Queue()
    proc = ctx.Process(target=_abandoned_worker, args=(port, str(control), str(ckpt), results))
    deadline = time.monotonic() + 90
    try:
        for generation in range(1, FORMATION_ATTEMPTS + 1):
            _abandon_round_once_rank_1_waits(port, generation - 1, proc, deadline)  # rank 0 leaves each round
            if generation == FORMATION_ATTEMPTS:
                break
            _wait_until_recovering(control, generation, proc, deadline)
            port = free_port()
            write_assignment(control, Assignment(generation=generation + 1, round=generation, world_size=2,
                                                 master_addr="127.0.0.1", master_port=port, ranks={"0": 1}))
        outcome = next_report(results, [proc], timeout=60)
        assert outcome[-1].startswith("DistNetworkError"), outcome
    finally:
        proc.join(timeout=30)
        if proc.is_alive():
            proc.kill()


def test_run_elastic_takes_its_recovery_timeout_as_a_timedelta() -> None:
    import inspect
    from datetime import timedelta

    from elastictrain.errors import ConfigError

    assert inspect.signature(elastictrain.run_elastic).parameters["recovery_timeout"].default == timedelta(seconds=600)
    with pytest.raises(ConfigError, match=r"recovery_timeout must be a datetime.timedelta, got 30.0"):
        elastictrain.run_elastic(lambda state: None, elastictrain.ElasticState(), recovery_timeout=30.0)  # type: ignore[arg-type]
