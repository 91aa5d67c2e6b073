"""Build torch's ``DynamicRendezvousHandler`` on the etcd v3 backend and store.

This is the function torch's handler registry calls for ``--rdzv-backend etcd3``
(from ``elastictrain run`` and from stock ``torchrun`` alike).
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator

from torch.distributed.elastic.rendezvous import RendezvousInfo, RendezvousParameters
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import (
    DynamicRendezvousHandler,
    RendezvousSettings,
    RendezvousTimeout,
    _BackendRendezvousStateHolder,
)

from elastictrain.config import RendezvousConfig, etcd_settings_from
from elastictrain.errors import ConfigError
from elastictrain.etcd.client import EtcdClient
from elastictrain.etcd.keys import validate_run_id
from elastictrain.etcd.lease import RunLease
from elastictrain.rendezvous.etcd3_backend import Etcd3RendezvousBackend
from elastictrain.rendezvous import _state_watch
from elastictrain.rendezvous.etcd3_store import Etcd3Store

logger = logging.getLogger(__name__)

__all__ = ["Etcd3RendezvousHandler", "create_handler"]

_NO_SHARED_STORE = "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"


@contextlib.contextmanager
def _unshared_tcp_store() -> Iterator[None]:
    # torch 2.13 reads this variable inside next_rendezvous() to decide whether
    # rank 0's *agent* hosts the workers' TCPStore for the whole job. That store
    # dies with that agent and keeps dead workers' keys across restarts
    # (pytorch/pytorch#135712). Unshared, each round's global rank-0 worker hosts a
    # fresh store on a fresh port, announced through etcd.
    previous = os.environ.get(_NO_SHARED_STORE)
    os.environ[_NO_SHARED_STORE] = "1"
    try:
        yield
    finally:
        if previous is None:
            os.environ.pop(_NO_SHARED_STORE, None)
        else:
            os.environ[_NO_SHARED_STORE] = previous


class _FreshStateHolder(_BackendRendezvousStateHolder):
    """torch's state holder, minus its one-second cache during rendezvous operations, and
    slower to judge a node dead right after an etcd outage."""

    def __init__(self, backend: Etcd3RendezvousBackend, settings: RendezvousSettings, client: EtcdClient) -> None:
        super().__init__(backend, settings)
        self._client = client

    def _sanitize(self) -> None:
        # torch drops every node whose heartbeat is older than the window. While etcd
        # was unreachable nobody could heartbeat, so the first node to sync after an
        # outage longer than the window would drop every participant, itself
        # included, and open an empty round while their workers train on. So a node
        # judges others only once it has reached etcd for a whole window itself:
        # enough for every live node to have heartbeated again. (A new node waits one
        # window after its start before it drops the nodes of a job that died.)
        window = self._settings.keep_alive_interval * self._settings.keep_alive_max_attempt
        if self._client.answering_for() < window.total_seconds():
            self._dead_nodes = []
            return
        super()._sanitize()

    def sync(self) -> bool | None:
        if _state_watch.in_rendezvous_operation():
            self._last_sync_time = -1  # we were woken because the state changed: read it
        return super().sync()

    @property
    def token(self) -> int:
        """The ``mod_revision`` of the state this holder last read or wrote (0: none)."""
        return self._token or 0


class Etcd3RendezvousHandler(DynamicRendezvousHandler):
    """torch's dynamic rendezvous, bootstrapped from etcd alone and woken by etcd watches."""

    _state_holder: _FreshStateHolder
    _watch: _state_watch.StateWatch
    client: EtcdClient
    """The etcd front this handler talks through (shared with its store)."""
    lease: RunLease
    """The lease this node's keys are attached to."""
    _joined_round: int | None = None
    """The round this node's last completed rendezvous belongs to."""

    @property
    def use_agent_store(self) -> bool:
        """See base class. Always ``False``: no agent hosts a store that outlives a round."""
        return False

    def next_rendezvous(self) -> RendezvousInfo:
        """See base class."""
        holder = self._state_holder
        with _unshared_tcp_store(), _state_watch.waiting_on(
            lambda seconds: self._watch.wait_newer(holder.token, seconds)
        ):
            info = super().next_rendezvous()
        self._joined_round = holder.state.round
        return info

    def num_nodes_waiting(self) -> int:
        """See base class. Also counts the nodes rendezvousing in a round past this node's.

        torch counts only the wait list of the current round. If the rendezvous has
        moved past the round this node trains in without it (its heartbeats lapsed:
        a stalled agent, a cut link), nodes gathering in the new round are waiting for
        it too, and nobody else will ever tell its agent: without this, they would
        wait out their join timeout while this node trains on.
        """
        waiting = super().num_nodes_waiting()
        state = self._state_holder.state
        if self._joined_round is None or state.round == self._joined_round:
            return waiting
        gathering = len(state.participants) + len(state.wait_list)
        if gathering:  # the agent restarts at once: said once
            logger.warning(
                "rendezvous '%s' moved on to round %d without this node (its heartbeats lapsed "
                "in round %d); %d node(s) gather there: restarting to rejoin",
                self._settings.run_id, state.round, self._joined_round, gathering,
            )
        return max(waiting, gathering)

    @property
    def round(self) -> int:
        """The rendezvous round this node last saw."""
        return self._state_holder.state.round

    @property
    def node_id(self) -> str:
        """This node's id in the rendezvous state (``addr_pid_localid``)."""
        return repr(self._this_node)

    @property
    def closed_seen(self) -> bool:
        """Whether the state this node last synced says the rendezvous is closed (no etcd call)."""
        return self._state_holder.state.closed

    def shutdown(self) -> bool:
        """See base class."""
        try:
            return super().shutdown()
        finally:
            self._watch.close()

    def shutdown_without_closing(self) -> None:
        """Release this handler without closing the rendezvous (it may belong to another job)."""
        self._stop_heartbeats()
        self._watch.close()


def create_handler(params: RendezvousParameters) -> Etcd3RendezvousHandler:
    """Create the ``etcd3`` rendezvous handler from torch's rendezvous parameters.

    ``params.endpoint`` is ``host:port[,host:port...]``. Keys of ``params.config``
    (``--rdzv-conf`` in torchrun) are those of :class:`RendezvousConfig` (seconds)
    and of :func:`elastictrain.config.etcd_settings_from` (TLS, auth, timeouts).

    Raises:
        ConfigError: A parameter is invalid.
        EtcdUnavailableError: No etcd endpoint answered.
    """
    if not params.endpoint:
        raise ConfigError("the etcd3 rendezvous backend needs an endpoint (--rdzv-endpoint HOST:PORT)")
    validate_run_id(params.run_id)
    rdzv = RendezvousConfig.from_mapping(params.config)
    client = EtcdClient(etcd_settings_from(params.config, params.endpoint))
    # Fail here, with the endpoint named, rather than deep inside the first join.
    client.call(lambda c: c.status(), what="connecting")
    lease = RunLease(client, rdzv.state_ttl)
    backend = Etcd3RendezvousBackend(client, params.run_id, lease=lease)
    store = Etcd3Store(client, params.run_id, lease, timeout=rdzv.join_timeout)
    timeout = RendezvousTimeout(
        join=rdzv.join_timeout,
        last_call=rdzv.last_call_timeout,
        close=rdzv.close_timeout,
        heartbeat=rdzv.heartbeat_timeout,
    )
    # torch's from_backend(), with our state holder in place of its own.
    settings = RendezvousSettings(
        params.run_id,
        params.min_nodes,
        params.max_nodes,
        timeout,
        keep_alive_interval=rdzv.keep_alive_interval,
        keep_alive_max_attempt=rdzv.keep_alive_max_attempt,
    )
    node = Etcd3RendezvousHandler._node_desc_generator.generate(params.local_addr)  # noqa: SLF001
    handler = Etcd3RendezvousHandler(node, settings, backend.name, store, _FreshStateHolder(backend, settings, client))
    handler._watch = _state_watch.StateWatch(client, backend.key)  # noqa: SLF001
    handler.client = client
    handler.lease = lease
    _state_watch.install()
    return handler
