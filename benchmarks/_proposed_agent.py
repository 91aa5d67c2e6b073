"""``elastictrain`` with the product changes the recovery benchmark proposes, applied at start-up.

The ``elastictrain_proposed`` launcher of ``benchmarks/recovery.py`` runs node agents
as ``python benchmarks/_proposed_agent.py run ...`` so that each proposed change is
measured against the shipped defaults in the same run, on the same script, before
anyone edits the product. Nothing here is imported by elastictrain itself.

The changes (see benchmarks/README.md, "Recommended product changes"):

1. ``plain_elastic_log_formatter``: torch's ``TorchLogsFormatter`` runs
   ``from torch._dynamo import config`` to format any record that carries an
   exception. torch's agent logs every worker failure with ``logger.exception``,
   so the first failure an agent sees imports all of ``torch._dynamo`` (sympy
   included): 1.3 s on an idle core, 2-3 s on a busy one, before the agent even
   says "Worker group FAILED". A plain ``logging.Formatter`` on the
   ``torch.distributed.elastic`` loggers formats the same record in microseconds.
2. ``preload_dynamo``: the first ``torch.optim`` optimizer a worker builds imports
   ``torch._dynamo`` (800+ modules). Workers are forked from a forkserver that
   preloads only ``torch``, ``torch.distributed`` and ``torch.nn.parallel``, so
   every restarted worker pays that import again; preloading ``torch._dynamo``
   in the forkserver makes it a copy-on-write page instead.
3. ``end_round_on_exit``: torch ends a complete rendezvous round only when its
   *last* participant has left it. A node that died never leaves, so after a node
   loss the survivors wait in the wait list until the dead node's heartbeat
   expires (``keep_alive_interval x keep_alive_max_attempt``, 3 s) before a new
   round can even start. But a node runs the exit operation only when it wants a
   new round (its worker group failed, or a node is waiting): the round's world
   is broken for everyone at that moment. Ending the round at the first exit
   (clearing its participants; the wait list is kept) lets the survivors
   re-form at once, without waiting for the dead node to be declared dead. A
   healthy node learns that it must re-rendezvous from the round number having
   moved on (``num_nodes_waiting`` reports it), as it learns of a waiting node now.
4. ``precise_wakeups``: torch's rendezvous waits in one-second polls; elastictrain
   wakes on etcd watch events instead, but time-driven transitions (the last-call
   deadline, a peer's heartbeat expiring, our own heartbeat falling due) change no
   key, so they are still noticed up to a second late, once per transition. Waking
   at the earliest such instant removes that slack.

5. ``early_forkserver``: ``import elastictrain`` imports torch (the package
   re-exports the session API), so ``elastictrain run`` spends ~2 s importing torch
   before the agent starts its forkserver, which then imports torch again before
   it can fork the first worker. On a node that joins a running job, the
   rendezvous is over before that forkserver is ready: workers start ~2 s after
   it. Starting the forkserver first thing, before the agent's own imports, runs
   the two imports side by side (on a real node with idle cores: in parallel).
   In the product this needs a lazy ``elastictrain/__init__.py`` (PEP 562
   ``__getattr__``) and the forkserver start at the top of ``cli._cmd_run``; here
   the wrapper does it before importing elastictrain.

Set ``BENCH_PROPOSED`` to a comma-separated subset to measure one change alone
(default: changes 1-4; ``early_forkserver`` showed no gain on the shared 2-core
benchmark machine, where the two imports compete for the same cores, so it is opt-in).
"""

from __future__ import annotations

import logging
import os
import sys
from datetime import datetime, timezone

CHANGES = ("plain_elastic_log_formatter", "preload_dynamo", "end_round_on_exit", "precise_wakeups",
           "early_forkserver")
DEFAULT_CHANGES = CHANGES[:4]
# What elastictrain's agent sets before it starts its forkserver (elastictrain.agent.launch),
# copied so that the forkserver can start before elastictrain (and torch) is imported.
_FORKSERVER_PRELOAD = ["torch", "torch.distributed", "torch.nn.parallel", "elastictrain._worker_boot"]


def start_forkserver_early(argv: list[str], preload_dynamo: bool) -> None:
    """Start the forkserver the agent would start, with the environment it would give it."""
    import multiprocessing
    import multiprocessing.forkserver

    def flag(name: str) -> str | None:
        for i, arg in enumerate(argv):
            if arg == name and i + 1 < len(argv):
                return argv[i + 1]
            if arg.startswith(name + "="):
                return arg.split("=", 1)[1]
        return None

    run_id = flag("--run-id") or "local"
    event_log = flag("--event-log") or os.path.join("elastictrain-runs", run_id, "events.jsonl")
    os.environ["ELASTICTRAIN_AGENT_PID"] = str(os.getpid())
    os.environ["ELASTICTRAIN_EVENT_LOG"] = os.path.abspath(event_log)
    if flag("--node-name"):
        os.environ["ELASTICTRAIN_NODE_NAME"] = str(flag("--node-name"))
    preload = _FORKSERVER_PRELOAD + (["torch._dynamo"] if preload_dynamo else [])
    multiprocessing.set_forkserver_preload(preload)
    multiprocessing.forkserver.ensure_running()


def apply(changes: set[str]) -> None:
    if "plain_elastic_log_formatter" in changes:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(levelname).1s%(asctime)s %(process)d %(name)s] %(message)s"))
        elastic = logging.getLogger("torch.distributed.elastic")
        elastic.handlers = [handler]
        elastic.propagate = False
    if "preload_dynamo" in changes:
        from elastictrain import agent

        preload = getattr(agent, "_FORKSERVER_PRELOAD", None)
        if isinstance(preload, list) and "torch._dynamo" not in preload:
            preload.insert(preload.index("torch.nn.parallel") + 1 if "torch.nn.parallel" in preload else 0,
                           "torch._dynamo")
    if "precise_wakeups" in changes:
        from elastictrain.rendezvous import _state_watch, handler as etcd3_handler

        def next_rendezvous(self: etcd3_handler.Etcd3RendezvousHandler) -> object:
            holder, settings, me = self._state_holder, self._settings, self._this_node
            dead_after = settings.keep_alive_interval * settings.keep_alive_max_attempt

            def wait(seconds: float) -> bool:
                state, now = holder.state, datetime.now(timezone.utc)
                due = [state.deadline] if state.deadline is not None else []
                due += [beat + dead_after for beat in state.last_heartbeats.values()]
                if me in state.last_heartbeats:
                    due.append(state.last_heartbeats[me] + settings.keep_alive_interval)
                ahead = [(t - now).total_seconds() for t in due]
                timeout = min([seconds] + [a + 0.01 for a in ahead if a > 0])
                return self._watch.wait_newer(holder.token, timeout)

            with etcd3_handler._unshared_tcp_store(), _state_watch.waiting_on(wait):  # noqa: SLF001
                return super(etcd3_handler.Etcd3RendezvousHandler, self).next_rendezvous()

        etcd3_handler.Etcd3RendezvousHandler.next_rendezvous = next_rendezvous
    if "end_round_on_exit" in changes:
        from torch.distributed.elastic.rendezvous import dynamic_rendezvous as dr

        original = dr._DistributedRendezvousOpExecutor._remove_from_participants  # noqa: SLF001

        def remove_from_participants(self: dr._DistributedRendezvousOpExecutor) -> None:  # noqa: SLF001
            state = self._state
            was_complete = state.complete
            original(self)
            if was_complete and state.complete:
                state.participants.clear()
                state.complete = False
                state.deadline = None
                state.round += 1

        dr._DistributedRendezvousOpExecutor._remove_from_participants = remove_from_participants  # noqa: SLF001

        # torch tells a healthy node that it must re-rendezvous through the wait list
        # (``num_nodes_waiting``). A node that ended the round joins the next one as a
        # participant, not a waiter, so the round having moved on is the signal too.
        from elastictrain.rendezvous import handler as etcd3_handler

        cls = etcd3_handler.Etcd3RendezvousHandler
        joined, waiting = cls.next_rendezvous, cls.num_nodes_waiting

        def next_rendezvous(self: cls) -> object:
            info = joined(self)
            self._bench_round = self._state_holder.state.round
            return info

        def num_nodes_waiting(self: cls) -> int:
            count = waiting(self)
            mine = getattr(self, "_bench_round", None)
            return max(count, 1) if mine is not None and self._state_holder.state.round != mine else count

        cls.next_rendezvous, cls.num_nodes_waiting = next_rendezvous, num_nodes_waiting


if __name__ == "__main__":
    wanted = {c for c in os.environ.get("BENCH_PROPOSED", ",".join(DEFAULT_CHANGES)).split(",") if c}
    unknown = wanted - set(CHANGES)
    if unknown:
        raise SystemExit(f"unknown BENCH_PROPOSED change(s) {sorted(unknown)}; choose from {CHANGES}")
    if "early_forkserver" in wanted and len(sys.argv) > 1 and sys.argv[1] == "run" and "--local-nodes" not in sys.argv:
        start_forkserver_early(sys.argv[2:], preload_dynamo="preload_dynamo" in wanted)
    apply(wanted)
    from elastictrain.cli import main

    sys.exit(main(sys.argv[1:]))
