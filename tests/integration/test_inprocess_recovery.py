"""In-process recovery with real agents and workers: survivors keep their processes, no step is redone.

Each node is its own ``elastictrain run`` process (its own session, so a node can be
killed whole). The job (``tests/scripts/inprocess_job.py``) writes one line per
step on every rank; the tests read who trained which step in which process.
"""

from __future__ import annotations

import collections
import contextlib
import itertools
import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from benchmarks.recovery import REFORMATION_PHASES
from elastictrain.chaos.processes import descendants, worker_pids
from elastictrain.etcd import kv
from elastictrain.rendezvous.keys import RunKeys
from elastictrain.train.group_keeper import RECOVERY_PHASES
from tests.conftest import REPO_ROOT, communicate_reporting_hangs, fail_with_stacks, hang_reporting_env

JOB = str(REPO_ROOT / "tests" / "scripts" / "inprocess_job.py")
STEPS = 40


def start_node(endpoint: str, run_id: str, out: Path, *job_args: str, min_nodes: int = 2, max_nodes: int = 2,
               extra: tuple[str, ...] = (), env: dict[str, str] | None = None) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "elastictrain", "run", "--etcd", endpoint, "--run-id", run_id, "--min-nodes",
         str(min_nodes), "--max-nodes", str(max_nodes), "--local-addr", "127.0.0.1", "--join",
         "--event-log", str(out / "events.jsonl"), *extra, JOB, str(out), "--steps", str(STEPS), *job_args],
        env={**hang_reporting_env(), **(env or {})}, cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        start_new_session=True)


def records(out: Path) -> list[dict[str, Any]]:
    path = out / "steps.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def wait_until(predicate: Callable[[], bool], what: str, nodes: list[subprocess.Popen[str]],
               timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        for node in nodes:
            if node.poll() is not None:
                output = node.stdout.read() if node.stdout else ""
                raise AssertionError(f"a node exited ({node.returncode}) before {what}:\n{output[-3000:]}")
        if time.monotonic() > deadline:
            fail_with_stacks(nodes, [], f"not within {timeout:g}s: {what}")
        time.sleep(0.05)


def finish(nodes: list[subprocess.Popen[str]], timeout: float = 180) -> list[str]:
    """Each node's output once it exits; a node still running after ``timeout`` fails the test with
    all output and its processes' stacks."""
    return [out for out, _ in communicate_reporting_hangs(nodes, timeout=timeout)]


def steps_by_rank(out: Path) -> dict[int, list[dict[str, Any]]]:
    by_rank: dict[int, list[dict[str, Any]]] = collections.defaultdict(list)
    for record in records(out):
        by_rank[record["rank"]].append(record)
    return by_rank


def latest_pid(out: Path, rank: int) -> int:
    return [r for r in records(out) if r["rank"] == rank][-1]["pid"]


def assert_every_step_once(out: Path, ranks: list[int]) -> None:
    by_rank = steps_by_rank(out)
    for rank in ranks:
        steps = [r["step"] for r in by_rank[rank]]
        duplicates = sorted({s for s in steps if steps.count(s) > 1})
        assert not duplicates, f"rank {rank} trained steps {duplicates} twice"
    assert {r["step"] for rs in by_rank.values() for r in rs} == set(range(1, STEPS + 1))


def phases(out: Path) -> list[tuple[int, dict[int, list[int]]]]:
    """Who trained, in order: each stretch of steps at one world size, with the pids of each rank."""
    said = []
    for world, stretch in itertools.groupby(records(out), key=lambda r: r["world"]):
        pids: dict[int, set[int]] = collections.defaultdict(set)
        for r in stretch:
            pids[r["rank"]].add(r["pid"])
        said.append((world, {rank: sorted(ps) for rank, ps in sorted(pids.items())}))
    return said


def events(out: Path, kind: str) -> list[dict[str, Any]]:
    path = out / "events.jsonl"
    lines = [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
    return [e for e in lines if e["kind"] == kind]


_REFERENCE: dict[str, torch.Tensor] = {}
"""The reference's parameters, once per test process: the same run for every test (4-5 s of CPU)."""


def reference(tmp_path: Path) -> dict[str, torch.Tensor]:
    """The parameters of an uninterrupted run of the job: one plain process (world 1, no launcher),
    whose global batches are those of any world size."""
    if not _REFERENCE:
        out = tmp_path / "reference"
        done = subprocess.run([sys.executable, JOB, str(out), "--steps", str(STEPS)], env=hang_reporting_env(),
                              cwd=REPO_ROOT, capture_output=True, text=True, timeout=90, check=False)
        assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
        _REFERENCE.update(torch.load(out / "final-0.pt", weights_only=True))
    return {name: tensor.clone() for name, tensor in _REFERENCE.items()}


def assert_same_parameters(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    for name in a:
        torch.testing.assert_close(a[name], b[name], atol=1e-5, rtol=1e-4)


@pytest.mark.timeout(300)
def test_a_killed_worker_is_replaced_alone_each_time_its_peer_keeps_its_process_and_no_step_is_redone(
        etcd_server: Any, run_id: str, tmp_path: Path) -> None:
    out = tmp_path / "job"
    nodes = [start_node(etcd_server.endpoint, run_id, out, "--step-sleep", "0.1", extra=("--max-restarts", "5"))
             for _ in range(2)]
    wait_until(lambda: len({r["rank"] for r in records(out) if r["step"] >= 10}) == 2, "step 10", nodes)
    # Three kills, each of a worker that trained: no crash loop, so no back-off before its
    # replacement (chaos, stop 28: 1, 2, 4 ... 30 s, the whole job waiting).
    for kill in range(3):
        victim = latest_pid(out, 1)
        os.kill(victim, signal.SIGKILL)
        if kill < 2:
            wait_until(lambda v=victim: latest_pid(out, 1) != v, "the replacement trains a step", nodes)
    outputs = finish(nodes)
    assert [n.returncode for n in nodes] == [0, 0], outputs[0][-3000:] + outputs[1][-3000:]
    assert not [line for o in outputs for line in o.splitlines() if "before replacing" in line]
    by_rank = steps_by_rank(out)
    assert len({r["pid"] for r in by_rank[0]}) == 1, "the survivor was restarted"
    assert len({r["pid"] for r in by_rank[1]}) == 4, "the killed worker was not replaced each time"
    assert_every_step_once(out, [0, 1])
    recoveries = events(out, "recovery")
    assert recoveries and all(e["world_size"] == 2 for e in recoveries)
    # Rank 0's event of each re-formation says where its seconds went (the recovery benchmark
    # reads the same fields).
    assert REFORMATION_PHASES == RECOVERY_PHASES
    formed = [e for e in recoveries if "seconds" in e]
    assert len(formed) == 3, recoveries
    for event in formed:
        spent = [event[phase] for phase in RECOVERY_PHASES]
        assert min(spent) >= 0 and 0.8 * event["seconds"] - 0.01 <= sum(spent) <= event["seconds"] + 0.001, event
    final = [torch.load(out / f"final-{r}.pt", weights_only=True) for r in (0, 1)]
    assert_same_parameters(final[0], final[1])
    assert_same_parameters(final[0], reference(tmp_path))


@pytest.mark.timeout(300)
def test_the_agents_act_on_a_killed_worker_at_once_not_at_their_next_monitor_tick(etcd_server: Any, run_id: str,
                                                                                  tmp_path: Path) -> None:
    # Ticks of 60 s: the killed worker's agent sees its end, and the survivor's agent its failed
    # collective, when it happens (a pidfd, the control channel's doorbell), not up to 60 s later.
    out = tmp_path / "job"
    nodes = [start_node(etcd_server.endpoint, run_id, out, "--step-sleep", "0.1",
                        extra=("--monitor-interval", "60")) for _ in range(2)]
    wait_until(lambda: len({r["rank"] for r in records(out) if r["step"] >= 10}) == 2, "step 10", nodes)
    victim = latest_pid(out, 1)
    os.kill(victim, signal.SIGKILL)
    wait_until(lambda: latest_pid(out, 1) != victim, "the replacement trains a step", nodes, timeout=20)
    outputs = finish(nodes)
    assert [n.returncode for n in nodes] == [0, 0], outputs[0][-3000:] + outputs[1][-3000:]
    assert len({r["pid"] for r in steps_by_rank(out)[0]}) == 1, "the survivor was restarted"
    assert_every_step_once(out, [0, 1])


@pytest.mark.timeout(300)
def test_a_node_whose_only_worker_is_killed_replaces_it_as_a_recovery_not_a_restart(
        etcd_server: Any, run_id: str, tmp_path: Path) -> None:
    # The dead worker was dropped before the agent judged whether its node's workers recover in
    # place: with one worker per node none was left, and the node took the plain-script branch
    # (a "restart" event, state "restarting", the restarts counter) though it recovered in place.
    out = tmp_path / "job"
    nodes = [start_node(etcd_server.endpoint, run_id, out, "--step-sleep", "0.1", extra=("--nproc-per-node", "1"))
             for _ in range(2)]
    wait_until(lambda: len({r["rank"] for r in records(out) if r["step"] >= 5}) == 2, "step 5", nodes)
    victim = latest_pid(out, 1)
    os.kill(victim, signal.SIGKILL)
    outputs = finish(nodes)
    assert [n.returncode for n in nodes] == [0, 0], outputs[0][-3000:] + outputs[1][-3000:]
    [agent] = [e["pid"] for e in events(out, "worker_failure")
               if victim in {f["pid"] for f in e["failures"].values()}]
    output = outputs[[n.pid for n in nodes].index(agent)]
    assert "restarting this node's workers" not in output, output[-3000:]
    assert "replaced local worker(s) [0]" in output, output[-3000:]
    assert not [e for e in events(out, "restart") if e["pid"] == agent], output[-3000:]
    assert [e["replaced_local_ranks"] for e in events(out, "recovery") if e["pid"] == agent] == [[0]]
    assert len({r["pid"] for r in steps_by_rank(out)[0]}) == 1, "the other node's worker was restarted"
    assert_every_step_once(out, [0, 1])


@pytest.mark.timeout(300)
def test_a_lost_node_leaves_the_survivors_training_in_their_processes(etcd_server: Any, run_id: str,
                                                                       tmp_path: Path) -> None:
    out = tmp_path / "job"
    nodes = [start_node(etcd_server.endpoint, run_id, out, "--step-sleep", "0.1", min_nodes=2, max_nodes=3)
             for _ in range(3)]
    wait_until(lambda: len({r["rank"] for r in records(out) if r["step"] >= 10}) == 3, "step 10 on 3 ranks", nodes)
    pids = {rank: latest_pid(out, rank) for rank in range(3)}
    victim = nodes[2]
    os.killpg(victim.pid, signal.SIGKILL)  # the node's agent and its worker: a machine dying
    victim.wait()
    seen = len(records(out))  # with --min-nodes 2 the job may have begun at world 2 before the third joined
    outputs = finish(nodes[:2])
    assert [n.returncode for n in nodes[:2]] == [0, 0], outputs[0][-3000:]
    after = [r for r in records(out)[seen:] if r["world"] == 2]
    assert after, "training did not go on at world size 2"
    survivors = {r["pid"] for r in after}
    assert survivors <= set(pids.values()) and len(survivors) == 2, \
        "a survivor was restarted:\n" + "\n".join(o[-6000:] for o in outputs)
    assert_every_step_once(out, [0, 1])
    # Each survivor's recovery names the node that left (probe, stop 29: only "a peer is gone").
    named = {e["pid"] for e in events(out, "recovery")
             if any(f"_{victim.pid}_" in node for node in e.get("nodes_left", []))}
    assert named == {nodes[0].pid, nodes[1].pid}, events(out, "recovery")


def start_two_nodes_and_a_spare(endpoint: str, run_id: str,
                                out: Path) -> tuple[list[subprocess.Popen[str]], subprocess.Popen[str]]:
    """Two nodes of a job of at most 2 that train, and a third that says it waits as a spare (event
    ``spare``). The two ranks hold inside step 13 until the spare said so, and the caller releases
    them (:func:`release_and_train_two_steps`): on busy cores the spare's start took longer than
    the whole job, which then ended before the spare had waited at all."""
    hold = ("--hold-before", f"{SPARE_HOLD}:{out / 'release'}")
    nodes = [start_node(endpoint, run_id, out, "--step-sleep", "0.1", *hold) for _ in range(2)]
    wait_until(lambda: len({r["rank"] for r in records(out) if r["step"] >= 3}) == 2, "step 3", nodes)
    spare = start_node(endpoint, run_id, out, "--step-sleep", "0.1", *hold)

    def spare_events() -> list[dict[str, Any]]:
        path = out / "events.jsonl"
        lines = path.read_text().splitlines() if path.exists() else []
        return [e for e in map(json.loads, lines) if e["kind"] == "spare" and e["pid"] == spare.pid]

    wait_until(lambda: bool(spare_events()), "the third node says it waits as a spare", nodes + [spare])
    assert spare_events()[0]["nodes"] == 2
    return nodes, spare


SPARE_HOLD = 13
"""The step inside which :func:`start_two_nodes_and_a_spare`'s ranks hold (step 10 is committed)."""


def release_and_train_two_steps(out: Path, nodes: list[subprocess.Popen[str]]) -> None:
    """Release the ranks held by :func:`start_two_nodes_and_a_spare` once both hold, and wait
    until both trained the held step and the next, with the spare waiting."""
    wait_until(lambda: all((out / f"release.held-{rank}").exists() for rank in (0, 1)),
               f"both ranks hold in step {SPARE_HOLD}", nodes)
    (out / "release").touch()
    wait_until(lambda: len({r["rank"] for r in records(out) if r["step"] >= SPARE_HOLD + 1}) == 2,
               "two more steps", nodes)


@pytest.mark.timeout(300)
def test_a_hot_spare_takes_a_lost_nodes_place_and_the_survivor_keeps_its_process(etcd_server: Any, run_id: str,
                                                                                  tmp_path: Path) -> None:
    out = tmp_path / "job"
    nodes, spare = start_two_nodes_and_a_spare(etcd_server.endpoint, run_id, out)
    assert {r["world"] for r in records(out)} == {2}
    status = subprocess.run([sys.executable, "-m", "elastictrain", "status", "--etcd", etcd_server.endpoint,
                             "--run-id", run_id], capture_output=True, text=True, timeout=60)
    assert "waiting to join: 1 (1 hot spare(s))" in status.stdout, status.stdout + status.stderr
    release_and_train_two_steps(out, nodes + [spare])
    survivor_pid = latest_pid(out, 0)
    victim = next(n for n in nodes if survivor_pid not in descendants(n.pid))
    os.killpg(victim.pid, signal.SIGKILL)
    victim.wait()
    seen = len(records(out))
    rest = [n for n in nodes if n is not victim] + [spare]
    outputs = finish(rest)
    assert [n.returncode for n in rest] == [0, 0], "\n".join(o[-2000:] for o in outputs)
    after = records(out)[seen:]
    assert after and {r["world"] for r in after} == {2}, "the spare did not take the lost node's place"
    assert survivor_pid in {r["pid"] for r in after if r["rank"] == 0}, "the survivor was restarted"
    assert len({r["pid"] for r in after}) == 2, "the survivor and the spare's worker trained on"
    assert_every_step_once(out, [0, 1])


@pytest.mark.timeout(300)
def test_with_a_spare_waiting_a_killed_worker_is_replaced_in_place_and_no_healthy_node_loses_its_seat(
        etcd_server: Any, run_id: str, tmp_path: Path) -> None:
    # Probe, stop 29: the killed worker's node and the spare formed the next round at once, the
    # healthy node was left out as a spare, and with no live state left the job restored its checkpoint.
    out = tmp_path / "job"
    nodes, spare = start_two_nodes_and_a_spare(etcd_server.endpoint, run_id, out)
    release_and_train_two_steps(out, nodes + [spare])
    healthy_pid = latest_pid(out, 0)
    os.kill(latest_pid(out, 1), signal.SIGKILL)
    seen = len(records(out))
    outputs = finish([*nodes, spare])
    assert [n.returncode for n in [*nodes, spare]] == [0, 0, 0], "\n".join(o[-2000:] for o in outputs)
    after = records(out)[seen:]
    assert healthy_pid in {r["pid"] for r in after}, \
        "the healthy node's worker was left out:\n" + "\n".join(o[-3000:] for o in outputs)
    assert "restored step" not in "".join(outputs), "the job went back to its checkpoint"
    assert_every_step_once(out, [0, 1])


@pytest.mark.timeout(300)
def test_a_node_lost_while_its_peers_wait_for_its_checkpoint_files_is_noticed_at_once(
        etcd_server: Any, run_id: str, tmp_path: Path) -> None:
    """A rank waiting for a peer's checkpoint files makes no collective, so a dead peer went
    unnoticed until its node's lease expired (30 s here: the agent then saw a membership change)."""
    out = tmp_path / "job"
    stalled = tmp_path / "stalled"
    long_lease = ("--rdzv-conf", "keep_alive_max_attempt=30")
    nodes = [start_node(etcd_server.endpoint, run_id, out, "--step-sleep", "0.1", "--ckpt-every", "5",
                        "--stall-save", f"0:{stalled}", min_nodes=1, extra=long_lease) for _ in range(2)]
    wait_until(stalled.exists, "rank 0's checkpoint write stalled", nodes)
    time.sleep(0.5)  # rank 1 has written its part, and waits for rank 0's
    writer = int(stalled.read_text())
    victim = next(n for n in nodes if writer in descendants(n.pid))
    survivor = next(n for n in nodes if n is not victim)
    survivor_pid = latest_pid(out, 1)
    seen = len(records(out))
    os.killpg(victim.pid, signal.SIGKILL)
    victim.wait()
    (output,) = finish([survivor])
    assert survivor.returncode == 0, output[-3000:]
    after = records(out)[seen:]
    assert after and {r["world"] for r in after} == {1} and {r["pid"] for r in after} == {survivor_pid}, \
        output[-3000:]
    causes = [e["cause"] for e in events(out, "recovery") if "duration_s" in e and e["world_size"] == 1]
    # The killed node's lease runs on (30 s): the round formed at once because its probe port was
    # refused, and the cause names it (docs/rendezvous.md, "A dead member's last call").
    assert len(causes) == 1 and causes[0].startswith("a worker's collective failed (a peer is gone): ") \
        and f"(pid {victim.pid}) is gone: its probe port refused a connection" in causes[0], causes


@pytest.mark.timeout(150)
def test_a_rank_whose_checkpoint_write_blocks_re_forms_when_its_peer_is_lost_without_waiting_out_the_write(
        etcd_server: Any, run_id: str, tmp_path: Path) -> None:
    """Issue 40, item 5: rank 1's write blocks (an hour: a hung NFS client) when rank 0's node is
    killed. Its save waited for the write for checkpoint_timeout (5 minutes) before the group could
    re-form; the write is now abandoned as soon as the peer is gone, and rank 1 trains on alone."""
    out = tmp_path / "job"
    stalled = tmp_path / "stalled"
    nodes = [start_node(etcd_server.endpoint, run_id, out, "--step-sleep", "0.1", "--ckpt-every", "5",
                        "--stall-save", f"1:{stalled}", min_nodes=1) for _ in range(2)]
    wait_until(stalled.exists, "rank 1's checkpoint write stalled", nodes)
    writer = int(stalled.read_text())
    victim = next(n for n in nodes if writer not in descendants(n.pid))
    survivor = next(n for n in nodes if n is not victim)
    seen = len(records(out))
    os.killpg(victim.pid, signal.SIGKILL)
    victim.wait()
    (output,) = finish([survivor], timeout=120)
    assert survivor.returncode == 0, output[-3000:]
    after = records(out)[seen:]
    assert after and {r["world"] for r in after} == {1} and {r["pid"] for r in after} == {writer}, output[-3000:]


def stalled_step(out: Path, every: int = 5) -> int:
    """The step whose save ``--stall-save`` stalled: the first checkpoint at world size 2. With
    ``min_nodes=1`` a node can train alone past step 5 before the other joins (a loaded machine)."""
    first = min(r["step"] for r in records(out) if r["world"] == 2)
    return -(-first // every) * every


def ready_nodes(etcd_client: Any, run_id: str, round_: int) -> int:
    """How many nodes said in etcd that their workers can form ``round_``'s group."""
    _, found = kv.range_(etcd_client, RunKeys.of(run_id).ready(round_), prefix=True, keys_only=True, what="test")
    return len(found)


def join_at(etcd_server: Any, run_id: str, out: Path, step: int, *, steps: int = STEPS,
            newcomer: tuple[str, ...] = (), job: tuple[str, ...] = (), once_held: bool = False,
            extra: tuple[str, ...] = ()) -> tuple[list[subprocess.Popen[str]], set[int], int]:
    """Two nodes train ``steps`` steps; every rank holds inside ``step`` until ``out/release``
    exists. A third node (with the extra job arguments ``newcomer``) starts once they trained
    step 1 (``once_held``: once both ranks hold inside ``step``, their vote on it cast); ``job``: job
    arguments for all three; ``extra``: ``elastictrain run`` options for all three. Returns the
    three nodes, the first two's worker pids and the round of three nodes, once formed."""
    release = out / "release"
    args = ("--steps", str(steps), "--step-sleep", "0.05", "--hold-before", f"{step}:{release}", *job)
    nodes = [start_node(etcd_server.endpoint, run_id, out, *args, min_nodes=2, max_nodes=3, extra=extra)
             for _ in range(2)]
    wait_until(lambda: len({r["rank"] for r in records(out) if r["step"] == 1}) == 2, "step 1", nodes)
    if once_held:
        wait_until(lambda: all((out / f"release.held-{rank}").exists() for rank in (0, 1)),
                   f"both ranks hold in step {step}", nodes)
    before = {latest_pid(out, rank) for rank in (0, 1)}
    nodes.append(start_node(etcd_server.endpoint, run_id, out, *args, *newcomer, min_nodes=2, max_nodes=3,
                            extra=extra))
    wait_until(lambda: any(e.get("nodes") == 3 for e in events(out, "rendezvous")), "a round of 3 nodes", nodes)
    round_ = next(e["round"] for e in events(out, "rendezvous") if e.get("nodes") == 3)
    return nodes, before, round_


SLOW_UNTIL_WORLD_3 = ("--step-sleep", "0.25", "--fast-at-world", "3")
"""Job arguments that keep a 150-step job training at world 2 for about 40 s (however busy the
cores) until a third node joins, and let it finish soon after."""


def assert_joined_at_one_boundary(out: Path, before: set[int], nodes: list[subprocess.Popen[str]],
                                  outputs: list[str]) -> list[dict[str, Any]]:
    """Every node exited 0, the first two kept their processes, every rank entered world 3 at the
    same step and trained no step twice. Returns the steps trained at world 3."""
    assert [n.returncode for n in nodes] == [0, 0, 0], "\n".join(o[-2000:] for o in outputs)
    at_three = [r for r in records(out) if r["world"] == 3]
    assert at_three, "the job never trained at world size 3"
    firsts = {rank: min(r["step"] for r in at_three if r["rank"] == rank) for rank in range(3)}
    assert len(set(firsts.values())) == 1, f"the ranks entered world 3 at different steps: {firsts}"
    assert before <= {r["pid"] for r in at_three}, "a node that was there before was restarted"
    assert len({r["pid"] for r in records(out)}) == 3
    for rank, rs in steps_by_rank(out).items():
        steps = [r["step"] for r in rs]
        assert len(steps) == len(set(steps)), f"rank {rank} trained a step twice"
    return at_three


@pytest.mark.timeout(300)
def test_a_joining_node_enters_at_a_step_boundary_without_restarting_anyone(etcd_server: Any, run_id: str,
                                                                            etcd_client: Any, tmp_path: Path) -> None:
    out = tmp_path / "job"
    nodes, before, round_ = join_at(etcd_server, run_id, out, 8)
    # Held inside step 8 until the newcomer's worker is up and both training nodes' agents have
    # published the generation of three (they poll the ready keys; releasing the ranks as soon as
    # the keys exist raced them on busy cores: world 3 from step 11): the ranks vote in step 9 and
    # train at world 3 from step 10.
    wait_until(lambda: ready_nodes(etcd_client, run_id, round_) == 3, "every node of the round ready", nodes)
    wait_until(lambda: len([e for e in events(out, "recovery") if "trained_on_s" in e]) == 2,
               "both training nodes published the generation they held", nodes)
    (out / "release").touch()
    outputs = finish(nodes)
    at_three = assert_joined_at_one_boundary(out, before, nodes, outputs)
    assert min(r["step"] for r in at_three) == 10, "the join did not take effect at the first agreed boundary"
    # The join says what happened, as a loss does: the agents' recovery and rank 0's.
    grown = [e for e in events(out, "recovery") if e.get("old_world_size") == 2 and e.get("world_size") == 3]
    assert [e["cause"].split(" (at the boundary")[0] for e in grown] == ["membership change: 1 node(s) joining"], grown
    assert [e["cause"] for e in events(out, "recovery") if "duration_s" in e] == ["membership change: 1 node(s) joining"] * 2


@pytest.mark.timeout(300)
def test_the_nodes_train_on_while_a_joining_nodes_workers_start(etcd_server: Any, run_id: str, etcd_client: Any,
                                                                 tmp_path: Path) -> None:
    # The newcomer's worker takes as long as the test wants to build its model: the two nodes
    # keep training at world 2 meanwhile (they used to stop at the next step boundary and wait
    # for it), then all three re-form at one boundary. The steps are slowed down at world 2 only,
    # so that the job lasts until the newcomer joins (however busy the cores) but no longer.
    out = tmp_path / "job"
    loaded = out / "model-loaded"
    nodes, before, round_ = join_at(etcd_server, run_id, out, 8, steps=150, job=SLOW_UNTIL_WORLD_3,
                                    newcomer=("--wait-before-session", str(loaded)))
    (out / "release").touch()
    wait_until(lambda: len([r for r in records(out) if r["world"] == 2 and r["step"] >= 8 + 5]) >= 2 * 6,
               "5 more steps at world 2 while the newcomer's worker starts", nodes, timeout=60)
    assert ready_nodes(etcd_client, run_id, round_) == 2, "the newcomer said it was ready before its worker was"
    loaded.touch()
    outputs = finish(nodes)
    assert_joined_at_one_boundary(out, before, nodes, outputs)
    held = [e for e in events(out, "recovery") if "trained_on_s" in e]
    assert len(held) == 2 and all(e["trained_on_s"] > 0 for e in held), held


@pytest.mark.timeout(300)
def test_the_agents_act_on_a_joining_node_at_once_not_at_their_next_monitor_tick(etcd_server: Any, run_id: str,
                                                                                  tmp_path: Path) -> None:
    # Ticks of 60 s: each step of the join that an agent took at its next tick (the training
    # nodes seeing the newcomer wait, the newcomer saying its worker is ready, the training
    # nodes publishing the generation of three) would take up to that long.
    out = tmp_path / "job"
    slow_ticks = ("--monitor-interval", "60")
    nodes, before, _ = join_at(etcd_server, run_id, out, 8, steps=150, job=SLOW_UNTIL_WORLD_3,
                               extra=slow_ticks)
    (out / "release").touch()
    wait_until(lambda: any(r["world"] == 3 for r in records(out)), "a step at world 3", nodes, timeout=40)
    outputs = finish(nodes)
    assert_joined_at_one_boundary(out, before, nodes, outputs)


@pytest.mark.timeout(300)
def test_a_node_that_joins_as_the_job_finishes_exits_zero_and_no_node_waits_for_it(etcd_server: Any, run_id: str,
                                                                                   tmp_path: Path) -> None:
    # The join is announced during the last step: the two ranks finish without forming a group
    # with the newcomer, whose worker waits for a rank 0 that has exited. Nodes used to wait in
    # torch's exit barrier for it (300 s), and it for them. The newcomer starts only once both
    # ranks hold in the last step: started earlier, on busy cores it was sometimes ready before
    # they got there, and the job trained its last steps at world 3.
    out = tmp_path / "job"
    nodes, _, _ = join_at(etcd_server, run_id, out, STEPS, once_held=True)
    (out / "release").touch()
    outputs = finish(nodes, timeout=90)
    assert [n.returncode for n in nodes] == [0, 0, 0], "\n".join(o[-2000:] for o in outputs)
    assert {r["world"] for r in records(out)} == {2}
    assert "finished on its other nodes" in outputs[2], outputs[2][-2000:]


@pytest.mark.timeout(300)
def test_a_hung_worker_is_killed_and_replaced_long_before_the_collective_timeout(
        etcd_server: Any, run_id: str, tmp_path: Path) -> None:
    out = tmp_path / "job"
    nodes = [start_node(etcd_server.endpoint, run_id, out, "--step-sleep", "0.05") for _ in range(2)]
    wait_until(lambda: len({r["rank"] for r in records(out) if r["step"] >= 10}) == 2, "step 10", nodes)
    hung = latest_pid(out, 1)
    os.kill(hung, signal.SIGSTOP)
    stopped_at = time.time()
    wait_until(lambda: any(r["rank"] == 1 and r["pid"] != hung for r in records(out)), "a replacement trains",
               nodes, timeout=60)
    recovered_at = min(r["t"] for r in records(out) if r["rank"] == 1 and r["pid"] != hung)
    outputs = finish(nodes)
    assert [n.returncode for n in nodes] == [0, 0], outputs[0][-3000:] + outputs[1][-3000:]
    # Far below the 60 s collective timeout a gloo peer would otherwise wait out.
    assert recovered_at - stopped_at < 30
    assert events(out, "hang"), "the hang was not reported"
    assert len({r["pid"] for r in steps_by_rank(out)[0]}) == 1
    assert_every_step_once(out, [0, 1])


@pytest.mark.timeout(300)
def test_a_worker_stopped_while_its_group_forms_is_killed_and_replaced_and_the_job_goes_on(
        etcd_server: Any, run_id: str, etcd_client: Any, tmp_path: Path) -> None:
    # Chaos found a worker stopped while its group formed left alone: only one that trains was
    # judged, and its peers waited for it in the formation until it was continued (70 s).
    # Here a joining node's worker is stopped once it opened its control slot (its node says
    # it is ready, and the others stop to form the group of three with it): it must be killed
    # and replaced, and the job go on at world size 3 (without the fix it waits for it forever).
    out = tmp_path / "job"
    # Slow steps at world 2 (a minute of them, however busy the cores), fast ones at world 3.
    args = ("--steps", "200", "--step-sleep", "0.25", "--fast-at-world", "3")
    nodes = [start_node(etcd_server.endpoint, run_id, out, *args, min_nodes=2, max_nodes=3) for _ in range(2)]
    wait_until(lambda: len({r["rank"] for r in records(out) if r["step"] >= 2}) == 2, "step 2", nodes)
    nodes.append(start_node(etcd_server.endpoint, run_id, out, *args, min_nodes=2, max_nodes=3))
    wait_until(lambda: any(e.get("nodes") == 3 for e in events(out, "rendezvous")), "a round of 3 nodes", nodes)
    round_ = next(e["round"] for e in events(out, "rendezvous") if e.get("nodes") == 3)
    stopped: list[int] = []
    try:
        wait_until(lambda: ready_nodes(etcd_client, run_id, round_) == 3, "every node of the round ready", nodes)
        stopped.extend(worker_pids(nodes[2].pid))
        assert len(stopped) == 1
        os.kill(stopped[0], signal.SIGSTOP)
        wait_until(lambda: any(r["world"] == 3 for r in records(out)), "training at world size 3", nodes,
                   timeout=90)
    finally:
        if stopped:
            with contextlib.suppress(ProcessLookupError):
                os.kill(stopped[0], signal.SIGKILL)
    outputs = finish(nodes)
    assert [n.returncode for n in nodes] == [0, 0, 0], "\n".join(o[-2000:] for o in outputs)
    assert stopped[0] not in {r["pid"] for r in records(out)}
    assert re.search(rf"rank \d+ on \S+ \(node rank \d+\) \(local worker \d+, pid {stopped[0]}\) is hung: "
                     r"its process is stopped "
                     r"\(state T\) while it "
                     r"(starts|forms a group)", outputs[2]), outputs[2][-3000:]
    assert [e["pid"] for e in events(out, "hang")] == [stopped[0]]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("sharding", ["ddp", "hsdp"])
def test_survivors_of_a_node_gone_silent_cut_their_stuck_collective_instead_of_waiting_out_its_timeout(
        etcd_server: Any, run_id: str, tmp_path: Path, sharding: str) -> None:
    # A node stopped whole (agent and worker): its connections stay open, as a host that lost
    # power or a network cut leaves them, so the survivors' gradient all-reduce waits for it
    # with no error. Its lease runs out (5 s) and the agents form a round without it; the
    # survivors must then end the wait themselves (gloo cannot abort a collective), not wait
    # out the group's 300 s collective timeout.
    # hsdp (a node of one worker: a replica of one shard) all-reduces the gradients across the
    # replicas in a sub-group of its mesh: the survivors shut down only the default group's
    # connections, and waited there for the timeout (the sharded soak's link_cut, 21 s at 20 s).
    out = tmp_path / "job"
    args = ("--steps", "2000", "--step-sleep", "0.05", "--sharding", sharding)
    env = {"ELASTICTRAIN_PG_TIMEOUT": "300"}
    nodes = [start_node(etcd_server.endpoint, run_id, out, *args, min_nodes=2, max_nodes=3, env=env)
             for _ in range(3)]
    try:
        wait_until(lambda: len({r["rank"] for r in records(out) if r["step"] >= 5 and r["world"] == 3}) == 3,
                   "step 5 at world size 3", nodes)
        gone = nodes[2]
        gone_workers = set(worker_pids(gone.pid))
        os.killpg(gone.pid, signal.SIGSTOP)
        stopped_at = time.time()
        survivors = nodes[:2]
        # Both survivors' records, not the first one's: each rank writes its own after the step,
        # and the SIGTERM below once came between the two (the slower rank's record missing).
        wait_until(lambda: len({r["rank"] for r in records(out) if r["world"] == 2 and r["t"] > stopped_at}) == 2,
                   "a step of each survivor at world size 2", survivors, timeout=90)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(nodes[2].pid, signal.SIGKILL)
    for node in survivors:
        os.kill(node.pid, signal.SIGTERM)  # enough: the job's 2000 steps would take minutes
    outputs = finish(survivors)
    said = "a collective is stuck on a peer that is gone: shut down this group's connections"
    assert any(said in output for output in outputs), "\n".join(o[-3000:] for o in outputs)
    before = {r["pid"] for r in records(out) if r["t"] < stopped_at and r["world"] == 3}
    after = {r["pid"] for r in records(out) if r["t"] > stopped_at}
    assert gone_workers and gone_workers <= before
    assert after == before - gone_workers, "a survivor's worker was restarted"


@pytest.mark.timeout(300)
def test_a_plain_loop_recovers_in_place_through_run_elastic(etcd_server: Any, run_id: str, tmp_path: Path) -> None:
    out = tmp_path / "job"
    nodes = [start_node(etcd_server.endpoint, run_id, out, "--api", "elastic", "--step-sleep", "0.1")
             for _ in range(2)]
    wait_until(lambda: len({r["rank"] for r in records(out) if r["step"] >= 10}) == 2, "step 10", nodes)
    os.kill(latest_pid(out, 1), signal.SIGKILL)
    outputs = finish(nodes)
    assert [n.returncode for n in nodes] == [0, 0], outputs[0][-3000:] + outputs[1][-3000:]
    by_rank = steps_by_rank(out)
    assert len({r["pid"] for r in by_rank[0]}) == 1
    assert_every_step_once(out, [0, 1])
    final = [torch.load(out / f"final-{r}.pt", weights_only=True) for r in (0, 1)]
    assert_same_parameters(final[0], final[1])


@pytest.mark.timeout(300)
def test_only_this_nodes_own_failures_spend_its_budget(etcd_server: Any, run_id: str, tmp_path: Path,
                                                       etcd_client: Any) -> None:
    # Rank 1 raises before step 5 in every process that gets there: a crash loop on node B.
    # Node A (--max-restarts 0) sees its peer fail again and again; that must not spend
    # its budget. Node B's own budget (2) runs out at the third failure, and B ends the job.
    out = tmp_path / "job"
    node_a = start_node(etcd_server.endpoint, run_id, out, "--fail-at", "1:5", extra=("--max-restarts", "0"))
    members = RunKeys.of(run_id).members
    wait_until(lambda: bool(kv.range_(etcd_client, members, prefix=True, keys_only=True, what="test")[1]),
               "node A registers (so that it is rank 0)", [node_a], timeout=60)
    node_b = start_node(etcd_server.endpoint, run_id, out, "--fail-at", "1:5", extra=("--max-restarts", "2"))
    output_a, output_b = finish([node_a, node_b])
    assert node_b.returncode != 0 and "--max-restarts 2 allows" in output_b, output_b[-3000:]
    # The first failure struck a worker that trained: replaced at once. Its replacement failed
    # before its first step: a crash loop, backed off.
    assert "waiting 1s before replacing (failure 2 of 2" in output_b, output_b[-3000:]
    assert "allows: the job fails" not in output_a, output_a[-3000:]
    assert len({r["pid"] for r in steps_by_rank(out)[0]}) == 1, "node A's worker was restarted for its peer's failures"
    failures = events(out, "worker_failure")
    assert not [e for e in failures if e["pid"] == node_a.pid], "node A saw a failure of its own"
    failed_workers = {f["pid"] for e in failures if e["pid"] == node_b.pid for f in e["failures"].values()}
    assert len(failed_workers) == 3, f"node B's worker failed in {len(failed_workers)} processes, not 3"


@pytest.mark.timeout(300)
@pytest.mark.parametrize("api", ["session", "elastic"])
def test_torchs_environment_follows_the_group_after_an_in_place_resize(etcd_server: Any, run_id: str,
                                                                       tmp_path: Path, api: str) -> None:
    """Issue 43: a worker kept through a re-formation has torch's environment of its new group
    (it kept RANK and WORLD_SIZE of the first: 'world 2 (env RANK 0 WORLD_SIZE 3)')."""
    out = tmp_path / "job"
    nodes = [start_node(etcd_server.endpoint, run_id, out, "--step-sleep", "0.1", "--api", api, min_nodes=2,
                        max_nodes=3) for _ in range(3)]
    wait_until(lambda: len({r["rank"] for r in records(out) if r["world"] == 3}) == 3, "a step at world 3", nodes)
    victim = nodes[2]
    os.killpg(victim.pid, signal.SIGKILL)  # the node's agent and its worker: a machine dying
    victim.wait()
    outputs = finish(nodes[:2])
    assert [n.returncode for n in nodes[:2]] == [0, 0], outputs[0][-3000:]
    # After the last step at world 3: with --min-nodes 2 a node a moment late (on busy cores) starts
    # the job at world 2 without it, and joins in place; the victim may have trained in that world 2.
    last_at_3 = max(i for i, r in enumerate(records(out)) if r["world"] == 3)
    resized = [r for r in records(out)[last_at_3 + 1:] if r["world"] == 2]
    said = f"who trained: {phases(out)}; recoveries, restarts and hangs: " + str(
        [e for kind in ("recovery", "restart", "hang") for e in events(out, kind)])
    assert {r["rank"] for r in resized} == {0, 1} and len({r["pid"] for r in resized}) == 2, said
    assert {r["pid"] for r in resized} <= {r["pid"] for r in records(out) if r["world"] == 3}, \
        "a survivor restarted: " + said
    for r in records(out):
        # One worker per node: its rank is its node's rank, the world its nodes' count.
        rank, world = str(r["rank"]), str(r["world"])
        assert r["env"] | {"MASTER_ADDR": None, "MASTER_PORT": None} == {
            "RANK": rank, "WORLD_SIZE": world, "ROLE_RANK": rank, "ROLE_WORLD_SIZE": world, "GROUP_RANK": rank,
            "GROUP_WORLD_SIZE": world, "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1", "MASTER_ADDR": None,
            "MASTER_PORT": None}, r
    # Both survivors name the same store of their new group, not the first group's.
    stores = {(r["env"]["MASTER_ADDR"], r["env"]["MASTER_PORT"]) for r in resized if r["step"] == resized[-1]["step"]}
    assert len(stores) == 1 and stores != {(r["env"]["MASTER_ADDR"], r["env"]["MASTER_PORT"])
                                           for r in records(out) if r["world"] == 3}


@pytest.mark.timeout(300)
def test_a_checkpoint_abandoned_because_a_peer_died_during_its_save_says_so_once_with_the_next_one_due(
        etcd_server: Any, run_id: str, tmp_path: Path) -> None:
    """Issue 43: a worker killed during the save of a step: the survivors recovered, and no line said
    that the step's checkpoint was not committed, nor when the next one comes."""
    out = tmp_path / "job"
    stalled = tmp_path / "stalled"
    nodes = [start_node(etcd_server.endpoint, run_id, out, "--step-sleep", "0.1", "--ckpt-every", "5",
                        "--stall-save", f"0:{stalled}", min_nodes=1) for _ in range(2)]
    wait_until(stalled.exists, "rank 0's checkpoint write stalled", nodes)
    writer = int(stalled.read_text())
    victim = next(n for n in nodes if writer in descendants(n.pid))
    survivor = next(n for n in nodes if n is not victim)
    os.killpg(victim.pid, signal.SIGKILL)
    victim.wait()
    (output,) = finish([survivor])
    assert survivor.returncode == 0, output[-3000:]
    step = stalled_step(out)
    abandoned = events(out, "checkpoint_abandoned")
    assert [(e["step"], e["next_step"]) for e in abandoned] == [(step, step + 5)], abandoned
    assert "CheckpointError" in abandoned[0]["reason"]
    lines = [line for line in output.splitlines() if f"checkpoint of step {step} was abandoned" in line]
    assert len(lines) == 1 and f"the next is due at step {step + 5}" in lines[0], output[-3000:]
    committed = [e["step"] for e in events(out, "checkpoint_commit")]
    assert step not in committed and step + 5 in committed, committed


@pytest.mark.timeout(120)
def test_an_async_save_abandoned_by_a_re_formation_says_so_once_with_its_step_and_the_next_one_due(
        etcd_server: Any, run_id: str, tmp_path: Path) -> None:
    """Issue 43, under ``async_save``: the first save at world size 2 (step 5; see stalled_step) runs in
    the background while the ranks train on; its writer's node is killed while the write is in flight. The survivor abandons the save as
    the group re-forms: one line and one ``checkpoint_abandoned`` event with the step, the reason and
    the next step due (the steps after it trained on, so that is the next multiple of 5 after the
    step it recovered at)."""
    out = tmp_path / "job"
    stalled = tmp_path / "stalled"
    nodes = [start_node(etcd_server.endpoint, run_id, out, "--step-sleep", "0.1", "--ckpt-every", "5", "--async-save",
                        "--stall-save", f"0:{stalled}", min_nodes=1) for _ in range(2)]
    wait_until(stalled.exists, "rank 0's background checkpoint write stalled", nodes, timeout=60)
    writer = int(stalled.read_text())
    victim = next(n for n in nodes if writer in descendants(n.pid))
    survivor = next(n for n in nodes if n is not victim)
    os.killpg(victim.pid, signal.SIGKILL)
    victim.wait()
    (output,) = finish([survivor], timeout=90)
    assert survivor.returncode == 0, output[-3000:]
    # The re-formation after the kill (2 nodes -> 1): on a loaded machine a node may train alone
    # first, and the other's joining (1 -> 2) is a re-formation too.
    (recovered,) = [e for e in events(out, "recovery")
                    if "step" in e and (e.get("old_world_size"), e.get("world_size")) == (2, 1)]
    due = (recovered["step"] // 5 + 1) * 5
    step = stalled_step(out)
    abandoned = events(out, "checkpoint_abandoned")
    assert [(e["step"], e["next_step"]) for e in abandoned] == [(step, due)], abandoned
    assert "CheckpointError" in abandoned[0]["reason"]
    lines = [line for line in output.splitlines() if f"checkpoint of step {step} was abandoned" in line]
    assert len(lines) == 1 and f"the next is due at step {due}" in lines[0], output[-3000:]
    committed = [e["step"] for e in events(out, "checkpoint_commit")]
    assert step not in committed, committed
