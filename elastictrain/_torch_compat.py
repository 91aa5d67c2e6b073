"""The one home of the torch private names elastictrain depends on, checked at import.

elastictrain is built on ``torch.distributed.elastic``: its agent class is meant
to be extended by overriding underscored methods (``_rendezvous``,
``_monitor_workers``, ...), and a few pieces of state have no public accessor.
Every such name is listed here and checked against the installed torch when
this module is imported. A torch release that renames or reshapes one fails
loudly, at start-up, naming it, instead of silently changing behaviour
(an override that torch no longer calls is skipped without a word).

Nothing outside this module spells a torch private name; the agent imports
:data:`AGENT_OVERRIDES` to document and check its overrides.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import multiprocessing.synchronize as _mp_synchronize
import multiprocessing.util as _mp_util
import threading
import time
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch.distributed.elastic.agent.server.api import SimpleElasticAgent
from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
from torch.distributed.elastic.events import handlers as _event_handlers
from torch.distributed import distributed_c10d as _c10d
from torch.distributed.elastic.multiprocessing.api import MultiprocessContext

from elastictrain.errors import TorchCompatError

if TYPE_CHECKING:
    from torch.distributed.tensor import DTensor
    from torch.nn.parallel import DistributedDataParallel

_Reducer = torch._C._distributed_c10d.Reducer  # noqa: SLF001 - checked in _check

__all__ = [
    "AGENT_OVERRIDES",
    "DDP_MODULES",
    "DYNAMIC_STATE_GLOBALS",
    "LOCAL_AGENT_OVERRIDES",
    "PINNED_TORCH",
    "COLLECTIVE_ERRORS",
    "clear_dtensor_caches",
    "event_log_handlers",
    "foreach_copy",
    "import_ddp_modules",
    "check_dtensor",
    "is_collective_failure",
    "local_tensor",
    "process_context",
    "python_group_name",
    "rebuild_ddp_buckets",
    "release_semaphore_names",
    "remaining_restarts",
    "set_local_rank_env",
    "spare_restart",
    "worker_exit_codes",
    "worker_group",
    "worker_sentinels",
]

PINNED_TORCH = "2.13"
"""The torch minor version these names were checked against (``pyproject.toml`` pins it)."""

AGENT_OVERRIDES: dict[str, tuple[str, ...]] = {
    # SimpleElasticAgent's extension points that elastictrain.launch.agent and .inprocess_agent override or call,
    # with the parameters torch 2.13 gives them.
    "_rendezvous": ("self", "worker_group"),
    "_assign_worker_ranks": ("self", "store", "group_rank", "group_world_size", "spec"),
    "_monitor_workers": ("self", "worker_group"),
    "_restart_workers": ("self", "worker_group"),
    "_stop_workers": ("self", "worker_group"),
    "_exit_barrier": ("self",),
    "_invoke_run": ("self", "role"),
    "_initialize_workers": ("self", "worker_group"),
}

LOCAL_AGENT_OVERRIDES: dict[str, tuple[str, ...]] = {
    # LocalElasticAgent's, for the in-process agent's one process context per worker.
    "_start_workers": ("self", "worker_group"),
    "_stop_workers": ("self", "worker_group"),
    "_shutdown": ("self", "death_sig", "timeout"),
    "_monitor_workers": ("self", "worker_group"),
    # Called, not overridden: LOCAL_RANK and CUDA_VISIBLE_DEVICES of one worker.
    "_set_local_rank_env": ("self", "worker_env", "local_rank", "spec"),
}

DYNAMIC_STATE_GLOBALS = frozenset({
    ("torch.distributed.elastic.rendezvous.dynamic_rendezvous", "_RendezvousState"),
    ("torch.distributed.elastic.rendezvous.dynamic_rendezvous", "_NodeDesc"),
    ("datetime", "datetime"),
    ("datetime", "timezone"),
    ("datetime", "timedelta"),
})
"""The globals a pickled torch dynamic-rendezvous state refers to, and the only ones the
``etcd3-dynamic`` backend lets an unpickler resolve."""

_AGENT_STATE = ("_remaining_restarts", "_worker_group")
"""Attributes of a SimpleElasticAgent instance read through this module."""

DDP_MODULES = ("torch.nn.parallel", "torch._dynamo")
"""What building a DDP model imports (``torch._dynamo``: about 1.4 s here); a node's worker
forkserver imports them once (:mod:`elastictrain.launch._worker_preload`) instead of every worker."""


COLLECTIVE_ERRORS: tuple[type[BaseException], ...] = (
    dist.DistBackendError, dist.DistNetworkError, dist.DistStoreError, dist.DistError)
"""torch's exception types of a failed collective, process group or store (a peer died or hung,
the network broke, a communicator was aborted). In torch 2.13 the first three subclass
``DistError``: NCCL raises ``DistBackendError``, the ``TCPStore`` of a group ``DistNetworkError``
("Broken pipe" once its host is gone, a timeout trying to connect) and ``DistStoreError`` (a key
that never came). gloo's transport raises none of them (see :data:`_UNTYPED_MARKERS`)."""

_UNTYPED_MARKERS = ("gloo", "nccl", "connection closed", "connection reset", "broken pipe", "connection refused",
                    "closed by peer", "timeout caused pair closure")
"""Words of a failed collective in a plain ``RuntimeError``, for the failures torch does not type.

Seen with torch 2.13 (a 2-process gloo group on CPU, ``tests/unit/test_collective_failure.py``):
every failure of gloo's TCP transport is a plain ``RuntimeError`` whose message starts with gloo's
source path (``[.../third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by peer
[127.0.0.1]:port``, ``pair.cc:537] Read error [...]: Connection reset by peer`` for a peer killed
mid-transfer, ``unbound_buffer.cc:78] Timed out waiting 3000ms for recv operation`` for a hung
one): "gloo" is the word that tells them, but for the next collective on a group after one timed out:
gloo closed its pairs on the timeout and says ``Application timeout caused pair closure``, with no
source path (seen in the in-process fsdp soak; the test runs it). "nccl": a plain ``RuntimeError`` naming NCCL (NCCL's
own errors are ``DistBackendError``; no GPU here to see one). The socket words were not seen
without "gloo" or a ``DistError`` in torch 2.13; they stay so that classifying errors does not
change (issue 42 moved this list here unchanged) and may go when torch older than 2.13's
messages no longer matter."""


def is_collective_failure(exc: BaseException) -> bool:
    """Whether ``exc`` (or what caused it) is a failed collective: a peer died or hung, the
    network broke, the communicator was aborted.

    By type (:data:`COLLECTIVE_ERRORS`) where torch gives one, else by the words of gloo's plain
    ``RuntimeError`` s (:data:`_UNTYPED_MARKERS`). The chain of causes is followed, except past an
    error its raiser declared unrelated (``raise ... from None``).
    """
    seen: set[int] = set()
    err: BaseException | None = exc
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        if isinstance(err, COLLECTIVE_ERRORS):
            return True
        if isinstance(err, RuntimeError) and any(m in str(err).lower() for m in _UNTYPED_MARKERS):
            return True
        err = err.__cause__ or (None if err.__suppress_context__ else err.__context__)
    return False


def _fail(what: str) -> TorchCompatError:
    return TorchCompatError(
        f"elastictrain needs torch {PINNED_TORCH}.*: torch {torch.__version__} {what}; "
        f"install it with: pip install 'torch=={PINNED_TORCH}.*'"
    )


def _check() -> None:
    for name, params in AGENT_OVERRIDES.items():
        method = getattr(SimpleElasticAgent, name, None)
        if method is None:
            raise _fail(f"has no SimpleElasticAgent.{name}")
        found = tuple(inspect.signature(method).parameters)
        if found != params:
            raise _fail(f"changed SimpleElasticAgent.{name}{params} to {found}")
    for name, params in LOCAL_AGENT_OVERRIDES.items():
        method = getattr(LocalElasticAgent, name, None)
        if method is None:
            raise _fail(f"has no LocalElasticAgent.{name}")
        found = tuple(inspect.signature(method).parameters)
        if found != params:
            raise _fail(f"changed LocalElasticAgent.{name}{params} to {found}")
    init = inspect.getsource(SimpleElasticAgent.__init__)
    for attr in _AGENT_STATE:
        if f"self.{attr}" not in init:
            raise _fail(f"no longer sets SimpleElasticAgent.{attr}")
    if "if self._remaining_restarts > 0:" not in inspect.getsource(SimpleElasticAgent._invoke_run):  # noqa: SLF001
        raise _fail("no longer decides on SimpleElasticAgent._remaining_restarts whether to restart failed workers")
    if "self._pcontext" not in inspect.getsource(LocalElasticAgent.__init__):
        raise _fail("no longer sets LocalElasticAgent._pcontext (its workers' process context)")
    for attr in ("self._pc", "self._ret_vals", "self._worker_finished_event"):
        if attr not in inspect.getsource(MultiprocessContext.__init__):
            raise _fail(f"no longer sets MultiprocessContext.{attr[5:]} (its workers' process context and semaphores)")
    if "self._pc" not in inspect.getsource(MultiprocessContext.__init__):
        raise _fail("no longer sets MultiprocessContext._pc (its torch.multiprocessing ProcessContext)")
    if "self.processes" not in inspect.getsource(importlib.import_module("torch.multiprocessing.spawn").ProcessContext):
        raise _fail("no longer sets torch.multiprocessing ProcessContext.processes")
    if not isinstance(getattr(_event_handlers, "_log_handlers", None), dict):
        raise _fail("has no torch.distributed.elastic.events.handlers._log_handlers")
    for module_name, name in DYNAMIC_STATE_GLOBALS:
        if not hasattr(importlib.import_module(module_name), name):
            raise _fail(f"has no {module_name}.{name}")
    if not callable(getattr(_Reducer, "_rebuild_buckets", None)):
        raise _fail("has no Reducer._rebuild_buckets (DistributedDataParallel's bucket rebuild)")
    for module in DDP_MODULES:
        if importlib.util.find_spec(module) is None:
            raise _fail(f"has no module {module}")
    if not callable(getattr(torch, "_foreach_copy_", None)):
        raise _fail("has no torch._foreach_copy_ (the redundancy's copy of many shards in one call)")
    _check_python_groups()


def _check_python_groups() -> None:
    """What a process group written in Python (a ``ProcessGroup`` subclass a registered backend's
    creator returns, :mod:`elastictrain.train.fsdp.failsafe_group`) relies on."""
    helper = inspect.getsource(_c10d._new_process_group_helper)  # noqa: SLF001 - checked here
    if "issubclass(type(backend_class), ProcessGroup)" not in helper:
        raise _fail("no longer adopts a ProcessGroup subclass that a registered backend's creator returns as the group")
    if not isinstance(getattr(_c10d._world, "pg_names", None), dict):  # noqa: SLF001 - checked here
        raise _fail("has no distributed_c10d._world.pg_names (the registered name of each process group)")


_check()


def python_group_name(group: dist.ProcessGroup) -> str:
    """The name torch registered a process group written in Python under (``new_group`` names it).

    torch keeps a group's name in its C++ backends, which a ``ProcessGroup`` subclass written in
    Python has none of: its ``group_name`` raises ("ProcessGroup name not set"), and
    ``DeviceMesh.from_group`` needs it. torch's own Python group (``multi_threaded_pg``) reads it
    here too.

    Raises:
        KeyError: ``group`` was not made by ``new_group`` (or was destroyed).
    """
    return str(_c10d._world.pg_names[group])  # noqa: SLF001 - checked above


def foreach_copy(into: list[torch.Tensor], sources: list[torch.Tensor], *, non_blocking: bool = False) -> None:
    """``into[i].copy_(sources[i])`` for every ``i``, in one call (``torch._foreach_copy_``): the
    loop runs in C++ with the GIL released, not one Python call per tensor (the redundancy copies
    a few hundred shards per refresh, :mod:`elastictrain.train.fsdp.redundancy`)."""
    torch._foreach_copy_(into, sources, non_blocking=non_blocking)  # checked in _check


def check_dtensor() -> None:
    """Check the DTensor private names used here; called when the sharded path is imported
    (``elastictrain.train.fsdp``), not at this module's import: ``torch.distributed.tensor`` takes
    ~0.5 s to import, which the agent and DDP jobs do not pay."""
    from torch.distributed.tensor import DTensor

    if "_local_tensor" not in getattr(DTensor, "__slots__", ()):
        raise _fail("has no DTensor._local_tensor slot (a shard's local tensor, read without to_local's dispatch)")


def local_tensor(value: DTensor) -> torch.Tensor:
    """``value``'s local tensor, as ``value.to_local()`` gives it outside autograd, read from its
    slot: without ``to_local``'s autograd function, a tenth of the time (the redundancy's check
    of its shards, every refresh on the training thread, reads a few hundred)."""
    return value._local_tensor  # noqa: SLF001 - checked by check_dtensor


def import_ddp_modules() -> None:
    """Import :data:`DDP_MODULES` (a worker forkserver does, once)."""
    for module in DDP_MODULES:
        importlib.import_module(module)


def clear_dtensor_caches() -> None:
    """Forget DTensor's cached sharding decisions (its Python and C++ sharding-propagation caches).

    torch compares device meshes by shape, dimension names and device type, not by rank or process
    group: a mesh of a group re-formed in place equals the last group's when the world size is the
    same, and a decision cached for the old mesh (its coordinate: where this rank's shard starts)
    would be reused with the rank's old place (tests/unit/test_fsdp_reform.py). Call it before
    sharding over a mesh of a shape sharded over before in this process.

    Raises:
        TorchCompatError: torch no longer has ``torch.distributed.tensor.debug._clear_sharding_prop_cache``.
    """
    from torch.distributed.tensor import debug  # DTensor's debug module: only sharded jobs import it

    clear = getattr(debug, "_clear_sharding_prop_cache", None)
    if clear is None:
        raise _fail("has no torch.distributed.tensor.debug._clear_sharding_prop_cache")
    clear()


def remaining_restarts(agent: SimpleElasticAgent) -> int:
    """Restarts the agent may still make after worker failures."""
    return int(agent._remaining_restarts)  # noqa: SLF001 - checked above


def spare_restart(agent: SimpleElasticAgent) -> None:
    """Make the agent's next restart after a worker failure not count against ``max_restarts``
    (its run loop takes one off before restarting)."""
    agent._remaining_restarts += 1  # noqa: SLF001 - checked above


def forgo_restarts(agent: SimpleElasticAgent) -> None:
    """Make the agent's run loop fail the job at the next worker failure instead of restarting."""
    agent._remaining_restarts = 0  # noqa: SLF001 - checked above


def worker_group(agent: SimpleElasticAgent) -> Any:
    """The agent's ``WorkerGroup``."""
    return agent._worker_group  # noqa: SLF001 - checked above


def process_context(agent: LocalElasticAgent) -> Any:
    """The process context (``PContext``) of the agent's workers, or None before they start."""
    return agent._pcontext  # noqa: SLF001 - checked above


def release_semaphore_names(context: Any, *, timeout: float = 5.0) -> None:
    """Unlink the names of the POSIX semaphores of a torch ``MultiprocessContext`` once its workers
    hold them, in a thread of their own (the agent goes on at once).

    The context makes a ``SimpleQueue`` per worker and one ``Event`` for all (7 named semaphores
    for one worker) under the forkserver start method, whose workers open them by name; their
    names stay in ``/dev/shm`` for the workers' whole life. An agent killed by SIGKILL cannot
    unlink them: its resource tracker did, with ``resource_tracker: There appear to be 7 leaked
    semaphore objects`` on the terminal, and a tracker killed with it (``killpg``) left them in
    ``/dev/shm`` for good. A worker opens them (maps ``/dev/shm/sem.NAME``) while it unpickles
    its process object, before it runs anything: once every live worker has, the names are
    unlinked through multiprocessing's own finalizer of each (it also tells the tracker), and the
    open semaphores keep working. A worker that has not opened them within ``timeout`` seconds
    (Linux's ``/proc`` missing) leaves them as before.
    """
    if not isinstance(context, MultiprocessContext) or context._pc is None:  # noqa: SLF001 - checked above
        return
    locks = [lock for queue in context._ret_vals.values()  # noqa: SLF001 - checked above
             for lock in _semlocks(queue)] + _semlocks(context._worker_finished_event)  # noqa: SLF001
    names = {str(lock._semlock.name) for lock in locks if lock._semlock.name}  # noqa: SLF001 - multiprocessing's
    pids = list(context.pids().values())
    if names:
        threading.Thread(target=_unlink_when_open, args=(names, pids, timeout), daemon=True,
                         name="elastictrain-semaphore-names").start()


def _semlocks(obj: Any, depth: int = 0) -> list[Any]:
    """The multiprocessing semaphores (``SemLock``) in ``obj`` (a queue, an event) and its parts."""
    if isinstance(obj, _mp_synchronize.SemLock):
        return [obj]
    if depth >= 3 or not hasattr(obj, "__dict__"):
        return []
    return [lock for value in vars(obj).values() for lock in _semlocks(value, depth + 1)]


def _unlink_when_open(names: set[str], pids: list[int], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    waiting = list(pids)
    while waiting:
        pid = waiting[0]
        try:
            with open(f"/proc/{pid}/maps", encoding="utf-8", errors="replace") as maps:
                mapped = maps.read()
        except FileNotFoundError:  # ended: it needs nothing any more
            waiting.pop(0)
            continue
        except OSError:
            return
        if all(f"/dev/shm/sem.{name.lstrip('/')}" in mapped for name in names):  # noqa: S108 - a path we read
            waiting.pop(0)
            continue
        if time.monotonic() > deadline:
            return
        time.sleep(0.005)
    for finalizer in list(_mp_util._finalizer_registry.values()):  # noqa: SLF001 - multiprocessing's own cleanup
        if finalizer._callback is _mp_synchronize.SemLock._cleanup and finalizer._args[0] in names:  # noqa: SLF001
            try:
                finalizer()  # unlinks the name and tells the resource tracker; runs once
            except OSError:
                pass


def _worker_processes(context: Any) -> list[Any] | None:
    """The ``multiprocessing`` processes of a torch process context that runs functions
    (``MultiprocessContext``); None for another kind of context, or one not started."""
    if not isinstance(context, MultiprocessContext) or context._pc is None:  # noqa: SLF001 - checked above
        return None
    return list(context._pc.processes)  # noqa: SLF001 - checked above


def worker_exit_codes(context: Any) -> list[int | None] | None:
    """The exit code of each process of a torch process context that runs functions, as the
    process's parent reported it: None for one still running or whose end is not reported yet.
    None for another kind of context, or one not started."""
    processes = _worker_processes(context)
    return None if processes is None else [process.exitcode for process in processes]


def worker_sentinels(context: Any) -> dict[int, int]:
    """The ``multiprocessing`` sentinel of each process of a torch process context that runs
    functions, by pid: a file descriptor that becomes readable once the process's parent reported
    its end (what the context's ``wait`` learns it from). Empty for another kind of context, or
    one not started."""
    return {process.pid: process.sentinel for process in _worker_processes(context) or []}


def set_local_rank_env(agent: LocalElasticAgent, env: dict[str, str | None], local_rank: int, spec: Any) -> None:
    """Set ``LOCAL_RANK`` (and ``CUDA_VISIBLE_DEVICES`` in torch's virtual-local-rank mode) in
    ``env`` as ``LocalElasticAgent._start_workers`` does for a worker."""
    agent._set_local_rank_env(env, local_rank, spec)  # noqa: SLF001 - checked above


def event_log_handlers() -> dict[str, Any]:
    """torch elastic's table of event destinations (name -> ``logging.Handler``)."""
    return _event_handlers._log_handlers  # noqa: SLF001 - checked above


def rebuild_ddp_buckets(ddp: DistributedDataParallel) -> bool:
    """Rebuild ``ddp``'s gradient buckets now, in the order its first synchronized backward
    produced the gradients, if it has not yet (returns whether it did).

    DDP does this itself at the start of its next forward, broadcasting rank 0's order:
    a collective inside the user's forward. Called between steps instead, the broadcast
    happens where a failure can be handled, and the forward has no collective left.
    """
    return bool(ddp.reducer._rebuild_buckets())  # noqa: SLF001 - checked above
