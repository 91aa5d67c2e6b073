"""Hang detection by progress, its parts without agents: the bounds a worker learns, the decision
its agent takes from a progress slot, the stacks it captures from a real process, the straggler
verdict and the in-loop fault injector."""

from __future__ import annotations

import math
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path

import pytest

from elastictrain._control import STACK_SIGNAL, Progress, ProgressTable, Section, WorkerState, stacks_path
from elastictrain.errors import ConfigError
from elastictrain.launch.hang_detector import HangDetector, Stacks, capture_stacks
from elastictrain.train.control import WorkerControl
from elastictrain.train.hang_bounds import HangBounds, SectionClock
from elastictrain.train.injector import Fault, FaultInjector, InjectedFault
from elastictrain.train.stragglers import StragglerWatch

BOUNDS = HangBounds(factor=10.0, step_floor=timedelta(seconds=5), first_step=timedelta(minutes=10),
                    save_floor=timedelta(minutes=10), between_floor=timedelta(seconds=60), warmup_steps=2)


def test_the_first_steps_have_the_start_up_bound_then_the_floor_or_ten_times_the_longest_step_seen() -> None:
    clock = SectionClock(BOUNDS)
    for _ in range(2):  # the warm-up: compiling, warming caches; nothing learnt from it
        clock.entered(Section.STEP)
        assert clock.bound(Section.STEP) == 600.0
        clock.observe(Section.STEP, 30.0)
    clock.entered(Section.STEP)
    assert clock.bound(Section.STEP) == 5.0  # 50 ms steps would give 0.5 s: the floor holds
    clock.observe(Section.STEP, 0.05)
    assert clock.bound(Section.STEP) == 5.0
    clock.observe(Section.STEP, 3.0)  # a 3 s step (a 30 s model would have many)
    assert clock.bound(Section.STEP) == 30.0
    assert clock.bound(Section.SAVE) == 600.0 and clock.bound(Section.BETWEEN) == 60.0
    clock.observe(Section.SAVE, 90.0)
    assert clock.bound(Section.SAVE) == 900.0
    assert clock.bound(Section.NONE) == 0.0


@pytest.mark.parametrize("changes", [{"factor": 0.5}, {"step_floor": timedelta(0)}, {"save_floor": 3},
                                     {"warmup_steps": 0}])
def test_hang_bounds_refuse_what_would_kill_every_rank_or_none(changes: dict[str, object]) -> None:
    with pytest.raises(ConfigError, match="hang_bounds"):
        HangBounds(**changes)  # type: ignore[arg-type]


def _slot(section: int, section_at: float, deadline: float, *, state: int = WorkerState.TRAINING,
          alive_at: float = 100.0) -> Progress:
    return Progress(10, 9, 99.0, 0.05, alive_at, state, 1, section, section_at, deadline)


LIVE = {0: 10}
RUNNING = {10: (4.0, "R")}.get  # a process that keeps running (spinning, or its liveness thread)


def test_a_rank_inside_a_step_past_its_deadline_is_hung_whatever_its_process_does() -> None:
    detector = HangDetector(activity=RUNNING)
    # Its liveness thread is alive (alive_at is now): only its progress tells.
    assert detector.hung([_slot(Section.STEP, 95.0, 100.0, alive_at=100.4)], 99.9, LIVE) == []
    assert detector.hung([_slot(Section.STEP, 95.0, 100.0, alive_at=100.4)], 100.5, LIVE) == [0]
    assert detector.reason(0) == ("inside step 10 (before its gradient collective) for 5.5s, past its bound of "
                                  "5.0s, while its peers wait for it")
    assert detector.hung([_slot(Section.SAVE, 0.0, 600.0, alive_at=601.0)], 601.0, LIVE) == [0]
    assert detector.reason(0).startswith("in the checkpoint save after step 9 for 601.0s")


def test_a_rank_between_steps_or_out_of_a_section_is_never_hung_by_its_progress() -> None:
    detector = HangDetector(activity=RUNNING)
    assert detector.hung([_slot(Section.BETWEEN, 0.0, 60.0, alive_at=500.0)], 500.0, LIVE) == []
    assert detector.hung([_slot(Section.NONE, 0.0, 0.0, alive_at=500.0)], 500.0, LIVE) == []
    # Recovering or forming a group: its section is not a training loop's.
    assert detector.hung([_slot(Section.STEP, 0.0, 5.0, state=WorkerState.BUSY, alive_at=500.0)], 500.0, LIVE) == []
    # A slot written by the worker a replacement took over from is not the replacement's.
    assert detector.hung([_slot(Section.STEP, 0.0, 5.0, alive_at=500.0)], 500.0, {0: 11}) == []


def test_a_rank_long_between_steps_is_said_once_per_stretch() -> None:
    detector = HangDetector(activity=RUNNING)
    between = _slot(Section.BETWEEN, 0.0, 60.0, alive_at=61.0)
    assert detector.overdue([between], 59.0, LIVE) == []
    assert detector.overdue([between], 61.0, LIVE) == [0]
    assert detector.overdue([between], 90.0, LIVE) == []  # said already
    assert detector.overdue([_slot(Section.BETWEEN, 200.0, 260.0)], 261.0, LIVE) == [0]  # the next stretch
    assert detector.overdue([_slot(Section.STEP, 0.0, 5.0)], 261.0, LIVE) == []


@pytest.fixture
def trained(tmp_path: Path,
            monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[WorkerControl, ProgressTable, list[float]]]:
    """A worker's control past its warm-up (3 steps of 0.05 s) on a clock of the test's, and its progress table."""
    from elastictrain.train import control as control_module

    ProgressTable(tmp_path, 1, create=True).close()
    clock = [100.0]
    monkeypatch.setattr(control_module, "now", lambda: clock[0])
    control = WorkerControl(str(tmp_path), 0, 1, hang_bounds=BOUNDS)
    table = ProgressTable(tmp_path, 1)
    try:
        control.set_state(WorkerState.TRAINING)
        for _ in range(3):
            control.enter(Section.STEP)
            clock[0] += 0.05
            control.enter(Section.NONE)
        yield control, table, clock
    finally:
        control.close()
        table.close()


def test_a_worker_says_its_section_and_deadline_and_a_long_call_widens_it(
        trained: tuple[WorkerControl, ProgressTable, list[float]]) -> None:
    control, table, clock = trained
    slot = table.read(0)
    assert (slot.section, slot.deadline) == (Section.NONE, 0.0)
    control.enter(Section.STEP)
    slot = table.read(0)
    assert (slot.section, slot.section_at, slot.deadline) == (Section.STEP, clock[0], clock[0] + 5.0)
    with control.long_call(120.0):
        assert table.read(0).deadline == clock[0] + 120.0
        clock[0] += 100.0
    slot = table.read(0)
    assert (slot.section_at, slot.deadline) == (clock[0], clock[0] + 5.0)  # the step's clock starts again
    control.enter(Section.NONE)  # the 100 s call taught the step bound nothing
    control.enter(Section.STEP)
    assert table.read(0).deadline == clock[0] + 5.0
    control.set_state(WorkerState.RECOVERING)
    assert (table.read(0).section, table.read(0).deadline) == (Section.NONE, 0.0)


def test_a_collective_inside_a_step_owes_no_deadline_and_the_step_clock_starts_again_after_it(
        trained: tuple[WorkerControl, ProgressTable, list[float]]) -> None:
    # The in-process fsdp soak: a peer waiting in the all-gather before its forward (inside its
    # step) for a rank hung in that step passed 5 s past its step bound and was killed as hung too.
    control, table, clock = trained
    detector = HangDetector(activity=RUNNING)
    control.enter(Section.STEP)
    with control.collective():  # waits 30 s for a peer hung in its step
        clock[0] += 30.0
        slot = table.read(0)
        assert (slot.section, slot.deadline) == (Section.NONE, 0.0)
        assert detector.hung([table.read(0)], clock[0], {0: table.read(0).pid}) == []
    slot = table.read(0)
    assert (slot.section, slot.section_at, slot.deadline) == (Section.STEP, clock[0], clock[0] + 5.0)
    clock[0] += 6.0  # its own compute past the bound: hung
    assert detector.hung([table.read(0)], clock[0], {0: table.read(0).pid}) == [0]
    control.enter(Section.NONE)
    with control.collective():  # a collective out of a step (the backward's) leaves the section be
        assert (table.read(0).section, table.read(0).deadline) == (Section.NONE, 0.0)
    assert table.read(0).section == Section.NONE


_STACKS = """\
Thread 0x00007f61543ff6c0 (most recent call first):
  File "/usr/lib/python3.11/threading.py", line 331 in wait
  File "/app/elastictrain/train/control.py", line 158 in _liveness
  File "/usr/lib/python3.11/threading.py", line 1002 in _bootstrap

Current thread 0x00007f61733d0b80 (most recent call first):
  File "/app/train.py", line 12 in load_batch
  File "/app/train.py", line 40 in main
  File "/app/train.py", line 50 in <module>
  File "<frozen runpy>", line 88 in _run_code
"""


def test_the_stacks_name_the_scripts_thread_innermost_frame_first() -> None:
    assert Stacks(_STACKS).main_thread(frames=2) == ["/app/train.py:12 in load_batch", "/app/train.py:40 in main"]
    assert Stacks("").main_thread() == []


@pytest.mark.parametrize("stuck", ["time.sleep(3600)", "while True: pass"])
@pytest.mark.timeout(60)
def test_the_stacks_of_a_process_blocked_in_a_call_or_spinning_say_where_it_is(tmp_path: Path, stuck: str) -> None:
    path = stacks_path(tmp_path, 0)
    script = textwrap.dedent(f"""
        import faulthandler, signal, sys, time
        faulthandler.register({int(STACK_SIGNAL)}, file=open({str(path)!r}, "w"), all_threads=True, chain=False)
        def stuck_here():
            print("ready", flush=True)
            {stuck}
        stuck_here()
    """)
    process = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        assert process.stdout is not None and process.stdout.readline() == "ready\n"
        time.sleep(0.1)
        stacks = capture_stacks(process.pid, path, timeout=5.0)
        assert stacks is not None
        assert stacks.main_thread()[0] == "<string>:6 in stuck_here", stacks.text
        assert process.poll() is None, "asking for the stacks ended the process"
    finally:
        process.kill()
        process.wait()


def test_no_stacks_from_a_process_that_cannot_answer(tmp_path: Path) -> None:
    process = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        assert capture_stacks(process.pid, tmp_path / "none", timeout=0.2) is None  # no stacks file
    finally:
        process.kill()
        process.wait()


def _times(value: float, window: int = 10) -> list[float]:
    return [value] * window


def test_a_rank_twice_as_slow_as_its_peers_for_a_whole_window_is_a_straggler_until_it_recovers() -> None:
    watch = StragglerWatch(window=10)
    assert watch.judge(1, [_times(0.05), _times(0.5)]).change == "started"  # type: ignore[union-attr]
    again = watch.judge(1, [_times(0.05), _times(0.5)])
    assert again is not None and again.change is None and again.factor == pytest.approx(10.0)  # said once
    assert watch.judge(1, [_times(0.05), _times(0.09)]).change is None  # type: ignore[union-attr]  # 1.8x
    assert watch.judge(1, [_times(0.05), _times(0.06)]).change == "ended"  # type: ignore[union-attr]


def test_no_straggler_from_one_slow_step_a_tiny_difference_or_no_peer() -> None:
    watch = StragglerWatch(window=10)
    spike = _times(0.05)
    spike[3] = 3.0  # one slow step (a long call, a first step): not slow throughout
    assert watch.judge(1, [_times(0.05), spike]).change is None  # type: ignore[union-attr]
    assert watch.judge(1, [_times(0.001), _times(0.005)]).change is None  # type: ignore[union-attr]  # 4 ms more
    assert watch.judge(0, [_times(0.5)]) is None
    joined = [math.nan] * 5 + [0.5] * 5  # a rank that joined mid-window judges only what it saw
    assert watch.judge(1, [_times(0.05), joined]).change is None  # type: ignore[union-attr]


def test_a_straggler_is_named_though_a_few_of_its_peers_steps_were_slow_too() -> None:
    # A loaded host: a straggler 0.5 s slower a step, while its peer's step met a CPU hog twice in the
    # window (0.4 s, not 2x under the straggler's). It was never named while every step had to read
    # 2x (the sharded hang test failed so, under the suite's load).
    peer = _times(0.1)
    peer[2] = peer[7] = 0.4
    assert StragglerWatch(window=10).judge(1, [peer, _times(0.6)]).change == "started"  # type: ignore[union-attr]
    # Slow in only 4 steps of 10 (a burst, not a slow rank): no straggler.
    burst = [0.6] * 4 + [0.1] * 6
    assert StragglerWatch(window=10).judge(1, [_times(0.1), burst]).change is None  # type: ignore[union-attr]


def test_a_straggler_back_at_its_peers_pace_recovers_though_one_of_its_steps_met_a_cpu_hog() -> None:
    # The window after the slow one, at the peer's pace but for one step 0.4 s long (the suite's load):
    # its mean reads 1.7x, its median 1x. It was said to recover a window late (test_hangs failed so).
    watch = StragglerWatch(window=10)
    assert watch.judge(1, [_times(0.05), _times(0.5)]).change == "started"  # type: ignore[union-attr]
    back = _times(0.05)
    back[4] = 0.4
    assert watch.judge(1, [_times(0.05), back]).change == "ended"  # type: ignore[union-attr]


def test_the_three_ranks_median_makes_the_one_slow_rank_the_straggler_not_its_peers() -> None:
    gathered = [_times(0.05), _times(0.06), _times(0.3)]
    assert StragglerWatch().judge(2, gathered).change == "started"  # type: ignore[union-attr]
    assert StragglerWatch().judge(0, gathered).change is None  # type: ignore[union-attr]


def test_faults_are_read_from_their_spec_and_a_bad_one_is_one_clear_error() -> None:
    assert Fault.parse("slow@0:20x12+0.6") == Fault("slow", 0, 20, 12, 0.6)
    assert Fault.parse("hang_spin@pid4242:7") == Fault("hang_spin", None, 7, pid=4242)
    assert str(Fault.parse(" hang_sleep@1:30 ")) == "hang_sleep@1:30"
    with pytest.raises(ConfigError, match="KIND@RANK:STEP"):
        Fault.parse("hang@1:30")


def test_a_fault_strikes_once_in_the_job_not_again_in_the_replacement(tmp_path: Path) -> None:
    faults = [Fault("fail", 1, 5)]
    with pytest.raises(InjectedFault, match="rank 1 in step 5"):
        FaultInjector(faults, tmp_path).at_step(1, 5)
    FaultInjector(faults, tmp_path).at_step(1, 5)  # the replacement runs step 5 again: no fault
    FaultInjector(faults, tmp_path).at_step(0, 5)  # another rank: none


def test_a_slow_fault_slows_each_of_its_steps() -> None:
    injector = FaultInjector([Fault("slow", 0, 3, 2, 0.2)], None)
    started = time.monotonic()
    for step in range(1, 7):
        injector.at_step(0, step)
    assert time.monotonic() - started >= 0.4


@pytest.mark.parametrize(("section", "fires"), [(Section.SAVE, True), (Section.BETWEEN, False)])
def test_a_save_stuck_on_a_peer_that_is_gone_is_cut_like_a_stuck_collective(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, section: int, fires: bool) -> None:
    # A link cut while the ranks saved: the survivors waited in the save's broadcast until the
    # link came back (20 s), as the stuck-collective callback only counted a step's collectives.
    control, clock = _training_in_generation_1(tmp_path, monkeypatch)
    stuck: list[bool] = []
    try:
        control.on_stuck(lambda: stuck.append(True), after=1.0, in_collective_only=True)
        control.set_state(WorkerState.TRAINING)
        control.step_done(6)
        control.enter(section)
        clock[0] += 5.0
        # The agent published the next generation (a node left): the peer this rank waits for is gone.
        _publish_generation_2(tmp_path)
        control._check_stuck()
        assert stuck == ([True] if fires else [])
    finally:
        control.close()


@pytest.mark.parametrize("lost", [True, False])
def test_a_collective_whose_peer_closed_its_connection_is_cut_at_once_once_the_next_generation_is_out(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, lost: bool) -> None:
    # An fsdp survivor's send, half written to a rank SIGKILLed mid-transfer, fails nothing in gloo: it
    # was cut 6 s later, at 3 of its 2 s steps. A connection the dead peer closed says so at once.
    control, clock = _training_in_generation_1(tmp_path, monkeypatch)
    stuck: list[bool] = []
    try:
        control.on_stuck(lambda: stuck.append(True), after=1.0, in_collective_only=True, lost=lambda: lost)
        control.set_state(WorkerState.TRAINING)
        for step in range(1, 4):  # steps of 2 s
            control.step_done(step)
            clock[0] += 2.0
        with control.collective():
            clock[0] += 0.3
            control._check_stuck()
            assert stuck == []  # the generation it trains in is the newest: nothing is gone
            _publish_generation_2(tmp_path)
            control._check_stuck()
            assert stuck == ([True] if lost else [])
    finally:
        control.close()


def _training_in_generation_1(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[WorkerControl, list[float]]:
    """A rank's control in generation 1 of a world of 2, and the clock its liveness reads."""
    from elastictrain._control import Assignment, write_assignment
    from elastictrain.train import control as control_module

    ProgressTable(tmp_path, 1, create=True).close()
    write_assignment(tmp_path, Assignment(generation=1, round=0, world_size=2, master_addr="127.0.0.1",
                                          master_port=1, ranks={"0": 0}))
    clock = [100.0]
    monkeypatch.setattr(control_module, "now", lambda: clock[0])
    return WorkerControl(str(tmp_path), 0, 1, hang_bounds=BOUNDS), clock


def _publish_generation_2(tmp_path: Path) -> None:
    """The agent's next generation, without the peer."""
    from elastictrain._control import Assignment, write_assignment

    write_assignment(tmp_path, Assignment(generation=2, round=1, world_size=1, master_addr="127.0.0.1",
                                          master_port=1, ranks={"0": 0}))
