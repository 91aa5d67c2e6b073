"""Sharded sessions recover in place (issue 41, part 2): survivors keep their processes and their
shards, and a re-formed group rebuilds its model from the ranks' memory when they hold it all.

Real node agents (each node its own ``elastictrain run``) run ``tests/scripts/inprocess_job.py``
sharded. fsdp 2 -> 3 -> 2 nodes: the joining node receives its shards from the survivors (0 steps
redone, no checkpoint read); the node killed takes its shards with it, so the survivors restore
the newest checkpoint in their processes and redo the steps since (the ``recovery`` event says how
many). hsdp, 2 nodes of 2 workers, a node killed: the other replica holds every shard, 0 redone,
no checkpoint read. Both end equal to an uninterrupted run.

With ``redundancy_every`` and no checkpoint at all, a rank lost with its shards costs no disk read:
the survivors roll back from memory to the newest step they hold whole (their snapshots and the
buddy's copy of the last refresh) and redo at most ``redundancy_every`` steps, in their first
processes, ending equal to an uninterrupted run with each sample once per epoch: a worker failing
in step 9 with copies every 3 steps (fast: back to step 6, 2 steps redone), and a node killed at
a random moment out of 3 with copies every step and every 3 steps (slow).
"""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path
from typing import Any

import pytest

from tests.integration.test_inprocess_recovery import (
    STEPS, assert_same_parameters, events, finish, records, reference, start_node, wait_until,
)

SAMPLES = 384
"""The job's dataset (``inprocess_job.py --samples``): 12 steps of 32 an epoch."""
SLOW_ALONE = ("--step-sleep", "0.25", "--fast-at-world", "2")
"""Job arguments: 0.25 s a step at world size 1, none at 2 (a peer can join before the job ends)."""


def _world_steps(out: Path, world: int) -> list[dict[str, Any]]:
    return [r for r in records(out) if r["world"] == world]


def _reformations(out: Path) -> list[dict[str, Any]]:
    """Rank 0's ``recovery`` events (the agents' own say what they saw, without the worlds)."""
    return [e for e in events(out, "recovery") if "old_world_size" in e]


def _say(out: Path) -> None:
    print()  # under -s, pytest's own line (the file's name) is not yet ended: the first line stands apart
    for event in _reformations(out):
        print(f"recovery: world {event['old_world_size']} -> {event['world_size']} at step {event['step']}, "
              f"{event['steps_redone']} committed step(s) redone, {event['seconds']} s ({event['cause'][:80]})")
    for event in events(out, "restore"):
        print(f"restore: step {event['step']} at world size {event['world_size']}")


def _final_attempts(out: Path) -> dict[int, list[dict[str, Any]]]:
    """Each step's records of the attempt that counted: a step redone after a roll back (or a
    restore) was recorded again; its last world size's last record of each rank stands."""
    by_step: dict[int, list[dict[str, Any]]] = {}
    for record in records(out):  # in the order they were written
        by_step.setdefault(record["step"], []).append(record)
    final = {}
    for step, said in by_step.items():
        world = said[-1]["world"]
        final[step] = list({r["rank"]: r for r in said if r["world"] == world}.values())
    return final


def _assert_each_sample_once_per_epoch(out: Path) -> None:
    final = _final_attempts(out)
    assert sorted(final) == list(range(1, STEPS + 1)), sorted(final)
    epochs: dict[int, list[int]] = {}
    for step in final.values():
        assert len(step) == step[0]["world"], step
        for record in step:
            epochs.setdefault(record["epoch"], []).extend(record["indices"])
    for epoch, seen in epochs.items():
        assert len(seen) == len(set(seen)), f"epoch {epoch}: a sample trained twice"
        if epoch < max(epochs):
            assert sorted(seen) == list(range(SAMPLES)), f"epoch {epoch}: samples left out"


def _assert_rolled_back_in_memory(out: Path, every: int, worlds: tuple[int, int]) -> dict[str, Any]:
    """The one re-formation took its state from the live ranks' memory, redid at most ``every``
    steps, and no checkpoint was read; returns its event."""
    [event] = [e for e in _reformations(out) if (e["old_world_size"], e["world_size"]) == worlds]
    assert event["state_from"] == "peers" and 0 <= event["steps_redone"] <= every, event
    assert not events(out, "restore"), "a checkpoint was read"
    assert not (out / "ckpt").exists()
    return event


def _fail_rank_1_in_step_9(etcd_server: Any, run_id: str, tmp_path: Path, *job_args: str) -> Path:
    """Two fsdp nodes of one worker each, rank 1 failing in step 9 (its agent replaces it in place);
    both nodes end 0. Returns the job's output directory."""
    out = tmp_path / "job"
    inject = {"ELASTICTRAIN_INJECT": "fail@1:9", "ELASTICTRAIN_INJECT_STATE": str(tmp_path / "injected")}
    (tmp_path / "injected").mkdir()
    nodes = [start_node(etcd_server.endpoint, run_id, out, "--step-sleep", "0.05", "--sharding", "fsdp", *job_args,
                        min_nodes=2, max_nodes=2, extra=("--nproc-per-node", "1"), env=inject) for _ in range(2)]
    outputs = finish(nodes)
    _say(out)
    assert [n.returncode for n in nodes] == [0, 0], "\n".join(o[-3000:] for o in outputs)
    return out


@pytest.mark.timeout(240)
def test_an_fsdp_worker_lost_with_its_shards_rolls_the_survivor_back_to_the_copies_in_memory(
        etcd_server: Any, run_id: str, tmp_path: Path) -> None:
    # Copies every 3 steps, no checkpoint: rank 1 fails in step 9 (its agent replaces it in place),
    # rank 0 had committed step 8, and the copies are of step 6: the survivor rolls back to step 6
    # from its memory (its snapshot, the copy of rank 1's shards, the sampler cursor and the
    # optimizer of step 6), the newcomer receives its shards from it, and steps 7-8 are redone.
    # The model is built on the meta device (init_weights gives it the real one's values): the
    # newcomer's never holds values but those it receives.
    out = _fail_rank_1_in_step_9(etcd_server, run_id, tmp_path, "--redundancy-every", "3", "--no-checkpoint",
                                 "--meta")
    event = _assert_rolled_back_in_memory(out, 3, (2, 2))
    assert (event["step"], event["steps_redone"]) == (6, 2), event
    assert len({r["pid"] for r in records(out) if r["rank"] == 0}) == 1, "the survivor was restarted"
    _assert_each_sample_once_per_epoch(out)
    assert_same_parameters(reference(tmp_path), __import__("torch").load(out / "final-0.pt", weights_only=True))


@pytest.mark.timeout(240)
def test_an_fsdp_worker_lost_with_its_shards_and_no_copies_is_restored_in_place_from_the_checkpoint(
        etcd_server: Any, run_id: str, tmp_path: Path) -> None:
    # No copies, a checkpoint every 4 steps: rank 1 fails in step 9 and its agent replaces it in place
    # (step 8 committed and saved: 0 redone). The survivor's module is
    # rebuilt storage-less and the newcomer's is the script's own: both shard first, then restore the
    # newest checkpoint into their shards. They must agree that no rank broadcasts before it (the
    # survivor has nothing to send): a newcomer that broadcast alone hung the group until its timeout.
    out = _fail_rank_1_in_step_9(etcd_server, run_id, tmp_path, "--ckpt-every", "4")
    [event] = [e for e in _reformations(out) if (e["old_world_size"], e["world_size"]) == (2, 2)]
    assert event["state_from"] == "checkpoint", event
    assert event["steps_redone"] == 0 and [e["step"] for e in events(out, "restore")] == [8], event
    assert len({r["pid"] for r in records(out) if r["rank"] == 0}) == 1, "the survivor was restarted"
    _assert_each_sample_once_per_epoch(out)
    assert_same_parameters(reference(tmp_path), __import__("torch").load(out / "final-0.pt", weights_only=True))


@pytest.mark.slow  # about 25 s each on 2 idle cores: the default suite keeps the worker's loss above
@pytest.mark.timeout(300)
@pytest.mark.parametrize("every", [1, 3])
def test_an_fsdp_node_killed_at_random_rebuilds_from_the_copies_with_at_most_redundancy_every_steps_redone(
        etcd_server: Any, run_id: str, tmp_path: Path, every: int) -> None:
    out = tmp_path / "job"
    nodes = [start_node(etcd_server.endpoint, run_id, out, "--step-sleep", "0.2", "--sharding", "fsdp",
                        "--redundancy-every", str(every), "--no-checkpoint", min_nodes=2, max_nodes=3)
             for _ in range(3)]
    wait_until(lambda: len({r["rank"] for r in _world_steps(out, 3) if r["step"] >= 10}) == 3, "step 10 at world 3",
               nodes)
    pids = {r["pid"] for r in _world_steps(out, 3)}
    victim = nodes[2]
    os.killpg(victim.pid, signal.SIGKILL)  # the node's agent and its worker, mid-step or mid-refresh
    victim.wait()
    outputs = finish(nodes[:2])
    _say(out)
    assert [n.returncode for n in nodes[:2]] == [0, 0], "\n".join(o[-3000:] for o in outputs)
    _assert_rolled_back_in_memory(out, every, (3, 2))
    survivors = {r["pid"] for r in _world_steps(out, 2)}
    assert survivors <= pids and len(survivors) == 2, "a survivor was restarted"
    _assert_each_sample_once_per_epoch(out)
    assert_same_parameters(reference(tmp_path), __import__("torch").load(out / "final-0.pt", weights_only=True))


@pytest.mark.slow  # about 55 s on 2 idle cores: the default suite keeps tests/unit/test_fsdp_exchange.py
@pytest.mark.timeout(300)
@pytest.mark.parametrize("built", ["for_real", "on_meta"])
def test_an_fsdp_job_resized_2_3_2_in_place_ends_equal_to_an_uninterrupted_run(
        etcd_server: Any, run_id: str, tmp_path: Path, built: str) -> None:
    # on_meta: the model built on the meta device (init_weights gives it the real one's values): the
    # joining node's workers hold only what the survivors send them.
    out = tmp_path / "job"
    meta = ("--meta",) if built == "on_meta" else ()

    def node() -> Any:
        return start_node(etcd_server.endpoint, run_id, out, "--step-sleep", "0.5", "--sharding", "fsdp", *meta,
                          min_nodes=2, max_nodes=3)

    nodes = [node(), node()]
    wait_until(lambda: len({r["rank"] for r in _world_steps(out, 2) if r["step"] >= 2}) == 2, "step 2 at world 2",
               nodes)
    pids = {r["pid"] for r in _world_steps(out, 2)}
    nodes.append(node())
    wait_until(lambda: len({r["rank"] for r in _world_steps(out, 3)}) == 3 and max(
        r["step"] for r in _world_steps(out, 3)) >= min(r["step"] for r in _world_steps(out, 3)) + 3,
        "3 steps at world 3", nodes)
    victim = nodes[2]
    os.killpg(victim.pid, signal.SIGKILL)  # the node's agent and its worker: a machine dying
    victim.wait()
    outputs = finish(nodes[:2])
    _say(out)
    assert [n.returncode for n in nodes[:2]] == [0, 0], "\n".join(o[-3000:] for o in outputs)
    grown, shrunk = ([e for e in _reformations(out) if (e["old_world_size"], e["world_size"]) == pair]
                     for pair in ((2, 3), (3, 2)))
    assert len(grown) == 1 and grown[0]["steps_redone"] == 0, grown
    assert grown[0]["cause"].startswith("membership change: 1 node(s) joining"), grown  # said as a loss is
    # The join read no checkpoint; the loss restored the newest one, and redid the steps since.
    restores = events(out, "restore")
    assert len(restores) == 1 and len(shrunk) == 1 and restores[0]["step"] == shrunk[0]["step"], (restores, shrunk)
    joined_at = min(r["step"] for r in _world_steps(out, 3))
    lost_at = max(r["step"] for r in _world_steps(out, 3))
    assert shrunk[0]["steps_redone"] == lost_at - restores[0]["step"] > 0, shrunk
    survivors = {r["pid"] for r in _world_steps(out, 2) if r["step"] > joined_at}
    assert survivors == pids and len(survivors) == 2, "a survivor was restarted"
    assert_same_parameters(reference(tmp_path), __import__("torch").load(out / "final-0.pt", weights_only=True))


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_an_hsdp_job_that_loses_a_node_trains_on_with_no_step_redone_and_no_checkpoint_read(
        etcd_server: Any, run_id: str, tmp_path: Path) -> None:
    out = tmp_path / "job"
    # A hang floor of 30 s: the first step after the re-formation took over 5 s on shared cores.
    nodes = [start_node(etcd_server.endpoint, run_id, out, "--step-sleep", "0.1", "--sharding", "hsdp",
                        "--hang-floor", "30", min_nodes=1, max_nodes=2, extra=("--nproc-per-node", "2"))
             for _ in range(2)]
    wait_until(lambda: len({r["rank"] for r in _world_steps(out, 4) if r["step"] >= 12}) == 4, "step 12 at world 4",
               nodes)
    pids = {r["pid"] for r in _world_steps(out, 4)}
    victim = nodes[1]
    os.killpg(victim.pid, signal.SIGKILL)
    victim.wait()
    outputs = finish(nodes[:1])
    _say(out)
    assert nodes[0].returncode == 0, outputs[0][-3000:]
    lost = [e for e in _reformations(out) if (e["old_world_size"], e["world_size"]) == (4, 2)]
    assert len(lost) == 1 and lost[0]["steps_redone"] == 0, lost
    assert not events(out, "restore"), "a checkpoint was read"
    assert {r["pid"] for r in _world_steps(out, 2)} <= pids, "a survivor was restarted"
    assert_same_parameters(reference(tmp_path), __import__("torch").load(out / "final-0.pt", weights_only=True))


@pytest.mark.timeout(300)
def test_a_rank_killed_while_its_peer_is_inside_the_forward_is_recovered_in_place_and_the_step_discarded(
        etcd_server: Any, run_id: str, tmp_path: Path) -> None:
    """The survivor's next unit gathers its parameters from the dead peer inside the user's forward:
    the failure is recorded (not raised there), the forward and backward finish on garbage, and the
    step is discarded at its end; the survivor keeps its process, re-forms alone, and ends equal to
    an uninterrupted run."""
    out, gate = tmp_path / "job", tmp_path / "gate"
    # Slow steps while a node trains alone: with min_nodes=1 one node can start alone (its peer late on
    # a loaded machine) and, at full speed, finish all 40 steps before its peer's workers are ready.
    nodes = [start_node(etcd_server.endpoint, run_id, out, "--sharding", "fsdp", "--hold-in-forward", f"12:{gate}",
                        "--hang-floor", "30", *SLOW_ALONE, min_nodes=1, max_nodes=2) for _ in range(2)]
    held = [Path(f"{gate}.held-{rank}") for rank in range(2)]
    wait_until(lambda: all(path.exists() for path in held), "both ranks inside a forward at world 2", nodes)
    pids = {int(path.read_text()) for path in held}
    victim = nodes[1]
    os.killpg(victim.pid, signal.SIGKILL)
    victim.wait()
    gate.touch()
    outputs = finish(nodes[:1])
    _say(out)
    assert nodes[0].returncode == 0, outputs[0][-3000:]
    lost = [e for e in _reformations(out) if (e["old_world_size"], e["world_size"]) == (2, 1)]
    assert len(lost) == 1 and "was discarded" in lost[0]["cause"], lost
    discarded = int(lost[0]["cause"].split("in step ")[1].split()[0])
    assert discarded >= 12 and not [r for r in _world_steps(out, 2) if r["step"] == discarded], "applied at world 2"
    survivors = {r["pid"] for r in _world_steps(out, 1) if r["step"] >= discarded}
    assert len(survivors) == 1 and survivors <= pids, "the survivor was restarted"
    # Its forward's all-gather failed: no backward ran on garbage (a whole step's compute, on the
    # path of the recovery, while a replacement starts on the same cores).
    ran = [json.loads(line) for line in (out / "discarded.jsonl").read_text().splitlines()]
    assert [(r["step"], r["backwards"]) for r in ran if r["pid"] in survivors] == [(discarded, 0)], ran
    assert_same_parameters(reference(tmp_path), __import__("torch").load(out / "final-0.pt", weights_only=True))
