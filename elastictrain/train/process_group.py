"""The worker's default process group: formed from the elastic environment, always torn down.

Each rendezvous round starts fresh worker processes, and each forms its group
from that round's ``MASTER_ADDR``/``MASTER_PORT`` (a store the round's rank-0
worker hosts). This module owns that group's life in the process:

- backend by device: NCCL with one GPU per local rank when CUDA is there,
  gloo otherwise; ``backend=`` or ``ELASTICTRAIN_BACKEND`` overrides;
- a collective timeout short enough to notice a dead peer (60 s default;
  ``timeout=`` or ``ELASTICTRAIN_PG_TIMEOUT`` in seconds overrides). Gloo
  notices a peer whose process died at once (its sockets close); the timeout
  covers a peer that hangs or a network that drops;
- on GPU, ``TORCH_NCCL_ASYNC_ERROR_HANDLING=1`` (unless set), so that NCCL's
  watchdog aborts a collective that times out instead of hanging forever;
- ``destroy_process_group`` on every exit path: the context manager's exit
  (normal or exception) and an ``atexit`` handler, so nothing in this process
  ever meets a stale group. A process killed by a signal takes its group with it;
- each gloo group's connections to its peers on record
  (:mod:`elastictrain.train.peer_connections`), for a worker that leaves its group
  and lives on (in-process recovery) to sever them.
"""

from __future__ import annotations

import atexit
import logging
import os
import socket
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from elastictrain._durations import parse_duration
from elastictrain.errors import ConfigError
from elastictrain.train import peer_connections
from elastictrain.train.worker import STANDALONE_RUN_ID, WorkerContext

__all__ = [
    "BACKEND_ENV",
    "DEFAULT_TIMEOUT",
    "TIMEOUT_ENV",
    "GroupSuperseded",
    "Placement",
    "default_backend",
    "destroy_process_group",
    "device_for",
    "init_process_group",
    "new_gloo_group",
    "process_group_scope",
    "resolve_timeout",
]

logger = logging.getLogger(__name__)

DEFAULT_TIMEOUT = timedelta(seconds=60)
"""Collective (and store connect) timeout: long enough for a slow checkpoint write, short enough to notice a hang."""

BACKEND_ENV = "ELASTICTRAIN_BACKEND"
TIMEOUT_ENV = "ELASTICTRAIN_PG_TIMEOUT"
_NCCL_ASYNC_ENV = "TORCH_NCCL_ASYNC_ERROR_HANDLING"

_POLL = timedelta(milliseconds=250)

_SAY_WAITING = timedelta(seconds=10)
"""How long a rank waits for the others, as the group forms, before it says so."""


class GroupSuperseded(Exception):  # noqa: N818 - a signal to follow the newer group, not an error
    """A newer group was announced while this one was forming: join that one instead."""


# True while this module's init_process_group created the default group that exists now.
_owned = False
_atexit_registered = False


@dataclass(frozen=True, slots=True)
class Placement:
    """Where this worker computes and how it talks to its peers."""

    device: torch.device
    """The device the model and batches go to."""

    backend: str | None
    """Backend of the default group; ``None`` when there is no group (a single process)."""

    timeout: timedelta
    """Collective timeout of the group."""

    rank: int
    """Rank in the default group (0 without one)."""

    world_size: int
    """Size of the default group (1 without one)."""

    owned: bool
    """True if :func:`init_process_group` created the group (and will destroy it)."""

    @property
    def distributed(self) -> bool:
        """True when a process group exists."""
        return self.backend is not None


def default_backend() -> str:
    """``"nccl"`` when CUDA and NCCL are available, else ``"gloo"``."""
    if torch.cuda.is_available() and dist.is_nccl_available():
        return "nccl"
    return "gloo"


def _resolve_backend(backend: str | None) -> str:
    chosen = backend or os.environ.get(BACKEND_ENV) or default_backend()
    chosen = chosen.strip().lower()
    if "nccl" in chosen and not torch.cuda.is_available():
        raise ConfigError(f"backend {chosen!r} needs CUDA, which is not available; use gloo")
    return chosen


def resolve_timeout(timeout: timedelta | float | None = None) -> timedelta:
    """The collective timeout: ``timeout``, else ``ELASTICTRAIN_PG_TIMEOUT`` (seconds), else 60 s.

    Raises:
        ConfigError: Not a positive number of seconds.
    """
    source, value = "timeout", timeout
    if value is None:
        source, value = TIMEOUT_ENV, os.environ.get(TIMEOUT_ENV)
        if value is None or str(value).strip() == "":
            return DEFAULT_TIMEOUT
    return parse_duration(source, value, minimum=0.001)


def device_for(context: WorkerContext, backend: str | None = None) -> torch.device:
    """The device of this worker: its GPU for a CUDA job, else the CPU.

    One GPU per local rank: ``cuda:<local_rank>``, or ``cuda:0`` when each
    process sees a single GPU (``CUDA_VISIBLE_DEVICES`` set per worker).
    ``backend="gloo"`` on a CUDA machine means CPU training: the CPU.

    Raises:
        ConfigError: More local ranks than visible GPUs.
    """
    if not torch.cuda.is_available() or (backend or "").strip().lower() == "gloo":
        return torch.device("cpu")
    count = torch.cuda.device_count()
    if count == 1:
        return torch.device("cuda", 0)
    if context.local_rank >= count:
        raise ConfigError(
            f"local rank {context.local_rank} has no GPU: {count} visible for {context.local_world_size} "
            "local workers; start at most one worker per GPU (--nproc-per-node)"
        )
    return torch.device("cuda", context.local_rank)


def _check_a_gpu_per_rank(context: WorkerContext) -> None:
    """Refuse local workers that all see the same one GPU (none has ``CUDA_VISIBLE_DEVICES`` to give
    it a GPU of its own): NCCL needs a GPU per rank, and its own error when the group forms
    ("invalid usage", with "Duplicate GPU detected" only in its log) does not say what to do."""
    if (context.local_world_size > 1 and torch.cuda.device_count() == 1
            and not os.environ.get("CUDA_VISIBLE_DEVICES", "").strip()):
        raise ConfigError(
            f"{context.local_world_size} local workers share this machine's one GPU, and NCCL needs a GPU "
            "per rank: start one worker per GPU (--nproc-per-node 1 here), or train on the CPU "
            f"with {BACKEND_ENV}=gloo"
        )


def init_process_group(
    context: WorkerContext | None = None,
    *,
    backend: str | None = None,
    timeout: timedelta | float | None = None,
    device: torch.device | str | None = None,
    generation: tuple[str, Callable[[], bool]] | None = None,
) -> Placement:
    """Form the default process group from the launcher's environment.

    - If ``torch.distributed`` is already initialized, that group is used as it
      is and left for its creator to destroy.
    - If no launcher set ``MASTER_ADDR``/``MASTER_PORT``, no group is formed: a
      single process trains alone.
    - Otherwise the group is created at the context's store address with the
      chosen backend and timeout, the CUDA device is set, and an ``atexit``
      handler destroys it.

    Args:
        context: This worker; default :meth:`WorkerContext.from_env`.
        backend: ``"nccl"``, ``"gloo"`` or torch's ``"cpu:gloo,cuda:nccl"`` form;
            default ``ELASTICTRAIN_BACKEND``, else by device.
        timeout: Collective timeout (a ``timedelta`` or seconds); default
            ``ELASTICTRAIN_PG_TIMEOUT``, else 60 s.
        device: Overrides the device :func:`device_for` picks.
        generation: ``(tag, superseded)`` for a group re-formed in place: the ranks
            meet at a barrier under ``tag`` (unique to the round) before the group
            forms, and give up as soon as ``superseded()`` says a newer group was
            announced, instead of waiting ``timeout`` for peers that went there.

    Returns:
        The device, backend and world of this worker.

    Raises:
        ConfigError: A bad backend, timeout or device.
        GroupSuperseded: ``superseded()`` turned true before every rank arrived.
        torch.distributed.DistError: The group could not be formed (e.g. a
            peer never arrived within ``timeout``).
    """
    global _owned
    context = WorkerContext.from_env() if context is None else context
    resolved_timeout = resolve_timeout(timeout)
    if dist.is_available() and dist.is_initialized():
        chosen = dist.get_backend()
        place = torch.device(device) if device is not None else device_for(context, chosen)
        return Placement(place, chosen, resolved_timeout, dist.get_rank(), dist.get_world_size(), owned=False)
    if not context.launched:
        wanted = backend or os.environ.get(BACKEND_ENV)
        place = torch.device(device) if device is not None else device_for(context, wanted)
        return Placement(place, None, resolved_timeout, 0, 1, owned=False)

    chosen = _resolve_backend(backend)
    # Only a gloo the user asked for means CPU training; gloo chosen for want of
    # NCCL on a CUDA machine still trains on the GPU.
    wanted = backend or os.environ.get(BACKEND_ENV)
    place = torch.device(device) if device is not None else device_for(context, wanted)
    device_id = None
    if place.type == "cuda":
        if "nccl" in chosen:
            _check_a_gpu_per_rank(context)
        torch.cuda.set_device(place)
        if "nccl" in chosen:
            # Without it a collective that a dead peer never joins hangs past
            # the timeout; with it NCCL's watchdog aborts the communicator and
            # the worker fails, so the agent can restart the group.
            os.environ.setdefault(_NCCL_ASYNC_ENV, "1")
            device_id = place  # eager NCCL init: errors surface here, not at the first step
    _register_atexit()
    # gloo's connections to its peers, to sever if this worker leaves the group and lives on
    # (NCCL's communicators are aborted instead); the store's own connections are left alone.
    record = (peer_connections.recording(context.world_size - 1, context.master_port) if chosen == "gloo"
              else nullcontext([]))
    if generation is not None:
        store = _meet(context, resolved_timeout, *generation)
        with record as connections:
            dist.init_process_group(backend=chosen, store=store, rank=context.rank, world_size=context.world_size,
                                    timeout=resolved_timeout, device_id=device_id)
    else:
        host = f"[{context.master_addr}]" if ":" in str(context.master_addr) else context.master_addr
        # torch waits for the other ranks in C++, silently, for the whole timeout.
        waiting = threading.Timer(_SAY_WAITING.total_seconds(), _say_waiting, (context, resolved_timeout))
        waiting.daemon = True
        waiting.start()
        try:
            with record as connections:
                dist.init_process_group(
                    backend=chosen,
                    # tcp:// from the context rather than env://, so that an explicit
                    # context is honoured; both share torch's store logic (rank 0 hosts
                    # it, or the agent does under TORCHELASTIC_USE_AGENT_STORE).
                    init_method=f"tcp://{host}:{context.master_port}",
                    rank=context.rank,
                    world_size=context.world_size,
                    timeout=resolved_timeout,
                    device_id=device_id,
                )
        finally:
            waiting.cancel()
    peer_connections.forget_all()
    peer_connections.keep(None, connections)
    _owned = True
    logger.debug("process group formed: backend %s, rank %d of %d, device %s, timeout %ss",
                 chosen, context.rank, context.world_size, place, resolved_timeout.total_seconds())
    return Placement(place, chosen, resolved_timeout, context.rank, context.world_size, owned=True)


def _say_waiting(context: WorkerContext, timeout: timedelta) -> None:
    """Say what a rank waits for while the group forms (and, outside a launcher, why it may wait
    in vain: variables left over in the environment)."""
    leftover = "" if context.run_id != STANDALONE_RUN_ID else (
        "; no launcher started this process: are RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT left over in "
        "its environment? (unset them to train in one process)")
    logger.warning("rank %d of %d still waits for the other ranks at %s:%s (for up to %gs in all)%s", context.rank,
                   context.world_size, context.master_addr, context.master_port, timeout.total_seconds(), leftover)


def _meet(context: WorkerContext, timeout: timedelta, tag: str, superseded: Callable[[], bool]) -> dist.Store:
    """The round's store, once every rank of it has arrived; :class:`GroupSuperseded` as soon as
    a newer group is announced.

    torch's own store rendezvous blocks in C++ for the whole timeout: a worker that
    joined a round its peers already left behind (two generations in quick
    succession) would hold them all up that long. Here each wait is short and checks
    ``superseded`` in between. Rank 0 hosts the store (torch's multi-tenant server, as
    ``tcp://`` does); the tag keeps rounds that share a port apart.
    """
    assert context.master_addr is not None and context.master_port is not None  # noqa: S101 - launched
    deadline = time.monotonic() + timeout.total_seconds()

    def check(waiting_for: str) -> None:
        if superseded():
            raise GroupSuperseded(f"a newer group was announced while waiting for {waiting_for}")
        if time.monotonic() > deadline:
            raise dist.DistStoreError(f"{waiting_for} did not arrive within {timeout.total_seconds():g}s")

    if context.rank == 0:
        server: dist.Store = dist.TCPStore(context.master_addr, context.master_port, None, True, timeout,
                                           wait_for_workers=False, multi_tenant=True)
    else:
        # Probe with a plain socket: a TCPStore client that cannot connect yet logs a C++ stack per try.
        while True:
            try:
                socket.create_connection((context.master_addr, context.master_port),
                                         timeout=_POLL.total_seconds()).close()
                break
            except OSError:
                check(f"rank 0's store at {context.master_addr}:{context.master_port}")
                time.sleep(0.05)
        server = dist.TCPStore(context.master_addr, context.master_port, None, False, timeout)
    store = dist.PrefixStore(f"elastictrain/{tag}", server)
    if store.add("arrived", 1) == context.world_size:
        store.set("all", b"1")
    while True:
        try:
            store.wait(["all"], _POLL)
            return store
        except dist.DistError:
            check(f"{context.world_size - store.add('arrived', 0)} rank(s) of {context.world_size}")


def new_gloo_group(timeout: timedelta | None = None) -> dist.ProcessGroup:
    """A gloo group over every rank of the default group (a collective), whose connections
    :func:`~elastictrain.train.peer_connections.sever` can shut down."""
    with peer_connections.recording(dist.get_world_size() - 1) as connections:
        group = dist.new_group(backend="gloo", timeout=timeout)
    peer_connections.keep(group, connections)
    return group


def destroy_process_group() -> None:
    """Destroy the default group if :func:`init_process_group` created it. Idempotent; never raises.

    A group someone else created is left alone.
    """
    global _owned
    if not _owned:
        return
    _owned = False
    peer_connections.forget_all()
    if not (dist.is_available() and dist.is_initialized()):
        return
    try:
        dist.destroy_process_group()
    except Exception as exc:  # noqa: BLE001 - teardown after a failure must not mask it
        logger.warning("destroying the process group failed: %s", exc)


def _register_atexit() -> None:
    global _atexit_registered
    if not _atexit_registered:
        atexit.register(destroy_process_group)
        _atexit_registered = True


@contextmanager
def process_group_scope(
    context: WorkerContext | None = None,
    *,
    backend: str | None = None,
    timeout: timedelta | float | None = None,
    device: torch.device | str | None = None,
) -> Iterator[Placement]:
    """:func:`init_process_group` on entry, :func:`destroy_process_group` on any exit.

    Example::

        with elastictrain.process_group_scope() as place:
            model = DDP(model.to(place.device))
            ...
    """
    placement = init_process_group(context, backend=backend, timeout=timeout, device=device)
    try:
        yield placement
    finally:
        if placement.owned:
            destroy_process_group()
