"""What torch 2.13 raises when a collective's peer dies, and that
:func:`elastictrain._torch_compat.is_collective_failure` tells it from a bug.

Real 2-process gloo groups on CPU: the classification was written from what these show (see
``_torch_compat._UNTYPED_MARKERS``).
"""

from __future__ import annotations

import contextlib
import datetime
import os
import time
from typing import Any

import pytest
import torch
import torch.distributed as dist

from elastictrain._torch_compat import COLLECTIVE_ERRORS, is_collective_failure
from tests.support.ranks import next_report, rank_context

pytestmark = pytest.mark.timeout(90)


def _group(rank: int, ports: Any, timeout: datetime.timedelta = datetime.timedelta(seconds=20)) -> dist.TCPStore:
    """Form the group of 2 on a store rank 0 hosts, at a port it binds (0: the system's pick) and
    passes to rank 1: a free port picked for them could be taken by another test meanwhile."""
    if rank == 0:
        store = dist.TCPStore("127.0.0.1", 0, 2, True, timeout=timeout, wait_for_workers=False)
        ports.put(store.port)
    else:
        store = dist.TCPStore("127.0.0.1", ports.get(timeout=60), 2, False, timeout=timeout)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2, timeout=timeout)
    return store


def _report(results: Any, exc: BaseException) -> None:
    results.put((type(exc).__name__, isinstance(exc, COLLECTIVE_ERRORS), str(exc)[:300],
                 is_collective_failure(exc)))


def _peer_dies_in_all_reduce(rank: int, ports: Any, results: Any) -> None:
    _group(rank, ports)
    tensor = torch.ones(1000)
    dist.all_reduce(tensor)
    if rank == 1:
        time.sleep(0.3)
        os._exit(1)  # a worker that dies: no goodbye to its peer
    try:
        for _ in range(1_000_000):
            dist.all_reduce(tensor)
    except RuntimeError as exc:
        _report(results, exc)
    time.sleep(0.5)  # the queue's feeder thread sends the report
    os._exit(0)


def _store_host_dies(rank: int, ports: Any, results: Any) -> None:
    store = _group(rank, ports)
    dist.all_reduce(torch.ones(1))
    if rank == 0:
        time.sleep(0.3)
        os._exit(1)  # rank 0 hosts the group's store
    time.sleep(1.0)
    try:
        store.get("never-set")
    except RuntimeError as exc:
        _report(results, exc)
    time.sleep(0.5)
    os._exit(0)


def _collective_after_a_timeout(rank: int, ports: Any, results: Any) -> None:
    """Rank 1 times out waiting for rank 0 (which runs no collective), then runs the next one on
    the same group: gloo closed the pairs on the timeout, and says so without naming itself."""
    _group(rank, ports, timeout=datetime.timedelta(seconds=1))
    dist.all_reduce(torch.ones(1))
    if rank == 0:
        time.sleep(6)
        os._exit(0)
    with contextlib.suppress(RuntimeError):
        dist.all_reduce(torch.ones(10))  # "Timed out waiting 1000ms for recv operation" (names gloo's source)
    try:
        dist.broadcast(torch.ones(10), src=0)
    except RuntimeError as exc:
        _report(results, exc)
    time.sleep(0.5)
    os._exit(0)


def _run(target: Any, reporter: int) -> tuple[str, bool, str, bool]:
    """Run ``target`` as ranks 0 and 1; the report of rank ``reporter`` (the other one dies)."""
    ctx = rank_context()
    results, ports = ctx.Queue(), ctx.Queue()
    procs = [ctx.Process(target=target, args=(rank, ports, results), name=f"rank {rank}") for rank in range(2)]
    for proc in procs:
        proc.start()
    try:
        return next_report(results, [procs[reporter]], timeout=60)
    finally:
        for proc in procs:
            proc.join(10)
            if proc.is_alive():
                proc.kill()


def test_gloo_raises_a_plain_runtime_error_naming_gloo_when_a_peer_dies_and_it_is_a_collective_failure() -> None:
    name, typed, message, classified = _run(_peer_dies_in_all_reduce, reporter=0)
    # torch 2.13's gloo gives no DistError: only its words tell (hence _UNTYPED_MARKERS' "gloo").
    assert name == "RuntimeError" and not typed, (name, message)
    assert "gloo" in message.lower(), message
    assert classified, message


def test_a_group_whose_store_host_died_raises_a_typed_dist_error_and_it_is_a_collective_failure() -> None:
    name, typed, message, classified = _run(_store_host_dies, reporter=1)
    assert typed, (name, message)  # DistNetworkError ("Broken pipe")
    assert classified, (name, message)


def test_a_collective_on_a_group_that_timed_out_raises_gloos_pair_closure_and_it_is_a_collective_failure() -> None:
    # Seen in the in-process fsdp soak (a rank's next collective after one that timed out): it
    # escaped the step and restarted the worker, the words naming no "gloo".
    name, typed, message, classified = _run(_collective_after_a_timeout, reporter=1)
    assert name == "RuntimeError" and not typed, (name, message)
    assert message == "Application timeout caused pair closure", message
    assert classified, message


def test_a_collective_failure_is_told_from_a_bug() -> None:
    assert is_collective_failure(RuntimeError("[../third_party/gloo/gloo/transport/tcp/pair.cc:534] Read error"))
    assert is_collective_failure(dist.DistNetworkError("Connection closed by peer [127.0.0.1]:1234"))
    assert is_collective_failure(dist.DistBackendError("NCCL communicator was aborted"))
    assert is_collective_failure(dist.DistStoreError("wait timeout"))
    wrapped = ValueError("save failed")
    wrapped.__cause__ = RuntimeError("Connection reset by peer")
    assert is_collective_failure(wrapped)
    assert not is_collective_failure(RuntimeError("mat1 and mat2 shapes cannot be multiplied (4x3 and 4x5)"))
    assert not is_collective_failure(KeyError("gloo"))
    try:  # an error its raiser declared unrelated to the failed collective it was handling
        try:
            raise dist.DistNetworkError("Connection closed by peer")
        except dist.DistNetworkError:
            raise ValueError("the model does not fit the checkpoint") from None
    except ValueError as exc:
        assert not is_collective_failure(exc)
