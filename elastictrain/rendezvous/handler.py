"""``Etcd3RendezvousHandler``: torch's ``RendezvousHandler`` written on etcd v3's primitives.

torch's dynamic rendezvous keeps every node in one pickled key that each join and
each heartbeat rewrites with a compare-and-swap: quadratic in the number of
nodes (it stops completing at 64 here), liveness judged by comparing the
writers' wall clocks, and code execution for anyone who can write the key. This
handler keeps the interface (so torch's agent, ``elastictrain run`` and stock
``torchrun --rdzv-backend etcd3`` drive it unchanged) and replaces the inside:

- **Liveness is an etcd lease per node**, refreshed over etcd's keep-alive
  stream. A node is gone when etcd expires its lease (its member key vanishes),
  judged by the server's clock alone.
- **No hot key.** A node joins with one transaction that writes its own member
  key (and, if nobody holds it, the closer key). One node, the closer, watches
  the members and closes the round with one transaction; everyone else watches
  only the small control prefix. Ranks follow etcd's revision order.
- **Nothing waits on a dead member.** The round record carries rank 0's address
  and port (picked by rank 0 when it joined), so no one waits for rank 0 to
  publish them; and members watch each other's keys, so a member whose lease
  expires makes the others re-form the round at once.
- **Data, never code.** Every value is JSON with a schema version.

The protocol's rules live in :mod:`elastictrain.rendezvous.membership`.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from collections.abc import Callable
from datetime import timedelta

from torch.distributed.elastic.rendezvous import (
    RendezvousClosedError,
    RendezvousGracefulExitError,
    RendezvousHandler,
    RendezvousInfo,
    RendezvousParameters,
    RendezvousStoreInfo,
    RendezvousTimeoutError,
)

from elastictrain.etcd.conf import etcd_settings_from
from elastictrain.events import NODE_ENV
from elastictrain.rendezvous.config import RendezvousConfig
from elastictrain.errors import ConfigError, EtcdError, EtcdLeaseNotFoundError
from elastictrain.etcd import kv
from elastictrain.etcd.client import EtcdClient
from elastictrain.etcd.lease import KeptLease, RunLease
from elastictrain.rendezvous.reachability import PeerProbe, is_cut_off, reach_all
from elastictrain.rendezvous import BACKEND_NAME
from elastictrain.rendezvous.keys import RunKeys
from elastictrain.rendezvous.membership import Closer, ControlView, RoundWatch, close_rendezvous, is_open, read_members
from elastictrain.rendezvous.ready import ReadyWord
from elastictrain.rendezvous.records import FINISHED, CloserRecord, MemberRecord, RoundRecord, encode, node_id_for
from elastictrain.rendezvous.store import Etcd3Store

logger = logging.getLogger(__name__)

__all__ = ["Etcd3RendezvousHandler", "create_handler"]

_LOG_EVERY = 5.0
_GOODBYE_DEADLINE = timedelta(seconds=5)
"""How long this node's goodbyes retry, all of them together, once its job has ended
(:meth:`~Etcd3RendezvousHandler.set_finished`, :meth:`~Etcd3RendezvousHandler.shutdown`, and the
agent's last record after them): with etcd down at the end, a node exited only after its goodbyes
had each waited out the retry deadline (92 s with the default 30 s), and later after each had
waited 5 s (17 s)."""
LOCAL_WORLD_SIZE_KEY = "local_world_size"
"""``RendezvousParameters`` key: workers this node starts (``elastictrain run`` passes it)."""


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("", 0))
        return int(sock.getsockname()[1])


class Etcd3RendezvousHandler(RendezvousHandler):
    """A rendezvous of node agents on etcd v3 (see the module docstring).

    Args:
        client: The etcd front; the handler owns it from now on.
        run_id: The run id.
        min_nodes: Fewest nodes of a round.
        max_nodes: Most nodes of a round; more nodes wait as spares.
        config: Timing (join timeout, last call, liveness lease, run keys' TTL).
        local_addr: Where other nodes reach this node (default: the FQDN).
        nproc: Workers this node starts (0: unknown to the rendezvous).
    """

    def __init__(self, client: EtcdClient, run_id: str, *, min_nodes: int, max_nodes: int,
                 config: RendezvousConfig, local_addr: str | None = None, nproc: int = 0) -> None:
        if not 1 <= min_nodes <= max_nodes:
            raise ConfigError(f"need 1 <= min_nodes ({min_nodes}) <= max_nodes ({max_nodes})")
        self.client = client
        self.keys = RunKeys.of(run_id)
        self._config = config
        self._min, self._max = min_nodes, max_nodes
        self._addr = local_addr or socket.getfqdn()
        self._nproc = nproc
        self.node_id = node_id_for(os.environ.get(NODE_ENV) or socket.gethostname(), self._addr)
        """This node's id in the rendezvous (``name@addr_pid_random``, see :func:`node_id_for`)."""
        self._alive = KeptLease(client, config.liveness_ttl, interval=config.keep_alive_interval,
                                name="liveness lease", on_lost=self._on_lease_lost)
        self.run_lease = RunLease(client, config.state_ttl, key=self.keys.lease)
        """The lease of the run's shared keys (status records and the store use it too)."""
        self._control = ControlView(client, self.keys)
        self._closer: Closer | None = None
        self._joined: RoundRecord | None = None
        self._joined_revision = 0
        """The revision that wrote the round key of :attr:`_joined` (it fences words for that round)."""
        self._round_watch: RoundWatch | None = None
        self._watch_lock = threading.Lock()
        self._spare = False
        self.on_spare: Callable[[int], None] | None = None
        """Called with the round's node count each time this node starts to wait as a spare (the
        round it waits on is full); ``elastictrain run`` records it as an event and in ``status``."""
        self._registered = 0
        """The revision of this node's last write of its member key (see :meth:`_join`)."""
        self._ready = ReadyWord(client, self.keys, self.node_id, alive=self._alive, run_lease=self.run_lease,
                                control=self._control)
        self._for_joiners = False
        self._probe: PeerProbe | None = None
        self._withdrawn = False
        """This node left its round because it cannot reach its peers (:meth:`withdraw`)."""

    # --- torch's interface --------------------------------------------------------------------

    def get_backend(self) -> str:
        """See base class."""
        return BACKEND_NAME

    def get_run_id(self) -> str:
        """See base class."""
        return self.keys.run_id

    @property
    def use_agent_store(self) -> bool:
        """See base class. ``False``: no agent hosts a store that outlives a round; each round's
        rank-0 worker hosts the workers' store on the port in the round record."""
        return False

    def connect(self) -> None:
        """Grant this node's liveness lease: fails at once, naming the endpoints, if etcd is out of reach.

        Raises:
            EtcdError: etcd is unreachable or refused us.
        """
        if self._alive.id is None or self._alive.lost:
            self._alive.grant(what="connecting")
        if self._probe is None:
            self._probe = PeerProbe()

    def next_rendezvous(self) -> RendezvousInfo:
        """See base class."""
        try:
            return self._wait_for_round()
        except (RendezvousClosedError, RendezvousGracefulExitError):
            raise
        except Exception as exc:
            if not self._control.stopped:
                raise
            # leave() closed the etcd client under one of this wait's requests: the wait ends
            # as the node left, whatever that request's failure looked like.
            self._release_closer()
            raise RendezvousClosedError(
                f"node {self.node_id} left the rendezvous of run '{self.keys.run_id}'") from exc

    def _wait_for_round(self) -> RendezvousInfo:
        started = time.monotonic()
        deadline = started + self._config.join_timeout.total_seconds()
        for_joiners, self._for_joiners = self._for_joiners, False
        self._leave_round()
        if self._withdrawn:
            self._await_peers()
        self.connect()
        after = self._latest_round()
        self._join(after, for_joiners=for_joiners)
        logged = started
        control = self._control
        open_at_last_look = False
        while True:
            if self._alive.lost:  # etcd dropped this node while it waited (a stall, a cut link)
                logger.warning("node %s lost its lease while waiting; registering again", self.node_id)
                self._release_closer()
                self.connect()
                self._join(after, for_joiners=for_joiners)
            left_out = None
            full_without_me = None  # the current round, when it is full and this node not in it
            with control.cond:
                seen = control.version
                if control.problem is not None:
                    raise control.problem
                if control.stopped:  # left (leave() or shutdown() from another thread)
                    self._release_closer()
                    raise RendezvousClosedError(f"node {self.node_id} left the rendezvous of run '{self.keys.run_id}'")
                current, current_kv = control.round, control.round_kv
                if control.closed is not None:
                    self._release_closer()
                    if self._spare:
                        raise RendezvousGracefulExitError(
                            f"run '{self.keys.run_id}' ended while this node waited as a spare")
                    raise RendezvousClosedError(f"the rendezvous of run '{self.keys.run_id}' is closed")
                if current is not None and current.round > after and current.rank_of(self.node_id) is not None:
                    break
                if (current is not None and current.rank_of(self.node_id) is None
                        and len(current.nodes) >= current.max_nodes):
                    full_without_me = current
                if (current is not None and current.round > after and current.rank_of(self.node_id) is None
                        and current.snapshot >= self._registered):
                    # A round decided with this node's key in view left it out (for want of
                    # room): ask for the round after it, or no later round would count this
                    # node among those waiting (see membership.waiting).
                    left_out = current.round
                closer_free = control.closer is None
                mine = control.closer == self.node_id
                key = control.closer_kv  # this node's own, on its current lease (see below)
                held_key = key if mine and key is not None and key.lease == self._alive.id else None
            if full_without_me is not None and not self._spare and self._round_stands(full_without_me):
                # The round is full without this node and its members train: a newcomer, or a
                # member that re-entered once a spare had taken its seat. It waits as a spare
                # (and past the join timeout). A full round whose members are gone (the job
                # launched again after they all died) only waits to be re-formed.
                self._spare = True
                self._announce_spare(len(full_without_me.nodes))
            if left_out is not None:
                after = left_out
                self._join(after)
                continue
            if self._closer is not None and not mine:
                self._release_closer()  # it formed a round, or lost the key
            if held_key is not None and self._closer is None:
                # The key is this node's, but it has no closer (it let it go on a view that an
                # older event had made wrong): no other node can take the key while it lives.
                logger.info("node %s holds the closer key of run '%s': gathering the round again", self.node_id,
                            self.keys.run_id)
                self._become_closer(held_key.create_revision)
            if closer_free and self._closer is None:
                self._try_to_close()
            wake = self._closer.step(time.monotonic()) if self._closer is not None else None
            now = time.monotonic()
            if now >= deadline and self._spare and current is not None:
                # A spare waits for a seat, not for a round to form: it waits as long as the job
                # trains (one etcd read per join timeout), since timing out would end the run. It
                # gives up only once a round that lost a member has not re-formed for that long.
                stands = self._round_stands(current)
                if stands or not open_at_last_look:
                    open_at_last_look = not stands
                    deadline = now + self._config.join_timeout.total_seconds()
            if now >= deadline:
                self._release_closer()
                raise RendezvousTimeoutError(
                    f"the rendezvous of run '{self.keys.run_id}' did not complete within "
                    f"{self._config.join_timeout.total_seconds():g}s ({self._progress()})")
            if now - logged >= _LOG_EVERY:
                logged = now
                timeout_s = "" if self._spare else f"; join timeout {self._config.join_timeout.total_seconds():g} s"
                logger.info("%s for %.0f s%s (round %d of run '%s')", self._waiting_for(), now - started, timeout_s,
                            after + 1, self.keys.run_id)
            timeout = min(1.0, deadline - now, (wake - now) if wake is not None else 1.0)
            with control.cond:
                control.cond.wait_for(lambda: control.version != seen, max(0.0, timeout))
        self._release_closer()
        assert current_kv is not None  # noqa: S101 - it holds current
        return self._enter_round(current, current_kv.mod_revision)

    def is_closed(self) -> bool:
        """See base class."""
        with self._control.cond:
            if self._control.loaded:
                return self._control.closed is not None
        _, found = kv.range_(self.client, self.keys.closed, keys_only=True, what="reading whether the run is closed")
        return bool(found)

    def set_closed(self) -> None:
        """See base class."""
        close_rendezvous(self.client, self.keys, self.run_lease, by=self.node_id)

    def set_finished(self) -> None:
        """Close the rendezvous because this node's workers finished training: the job is done.
        Nodes still forming a group (one that joined as the job ended) then stop instead of
        waiting for ranks that have exited; nodes still training finish as usual."""
        self.begin_goodbyes()
        close_rendezvous(self.client, self.keys, self.run_lease, by=self.node_id, reason=FINISHED)

    def wake_on_change(self, callback: Callable[[], None]) -> None:
        """Call ``callback`` whenever what :meth:`num_nodes_waiting` and :meth:`ready_nodes` say
        may have changed (a node waits, a member left, a round formed, all nodes said they are
        ready, this node lost its lease), so that an agent acts on it at once instead of at its
        next monitor tick. It is called on the rendezvous' watch threads: it must not block."""
        self._control.on_change = callback

    def num_nodes_waiting(self) -> int:
        """See base class. Counts every reason to re-form this node's round, from etcd events
        (no etcd request): nodes that wait to join and fit under ``max_nodes``, members that
        lost their lease or asked for a new round, and 1 if rounds moved on without this node
        (its own lease expired: it was cut off)."""
        joined = self._joined
        if joined is None:
            return 0
        with self._watch_lock:
            watch = self._round_watch
            if watch is None:  # started on first use: next_rendezvous returns sooner
                watch = self._round_watch = RoundWatch(self.client, self.keys, joined, on_change=self._control.touch)
        with self._control.cond:
            current, closed = self._control.round, self._control.closed
        if closed is not None:
            return 0
        if self._alive.lost or self._withdrawn or (current is not None and current.round != joined.round):
            return max(1, watch.waiting())
        return watch.waiting()

    def only_nodes_joining(self) -> bool:
        """Whether :meth:`num_nodes_waiting` counts nodes that wait to join and nothing else
        (every member of this node's round is alive and stays in it). No etcd request."""
        watch, joined = self._round_watch, self._joined
        if watch is None or joined is None or self._alive.lost or self._withdrawn:
            return False
        with self._control.cond:
            current, closed = self._control.round, self._control.closed
        if closed is not None or (current is not None and current.round != joined.round):
            return False
        return watch.only_joins()

    def reenter_for_joiners(self) -> None:
        """Say that this node's next :meth:`next_rendezvous` only takes in nodes that wait to join
        (:meth:`only_nodes_joining`, and nothing failed on this node): its member key says so,
        and the other members, seeing it re-enter, still count the change as joins only.
        Otherwise a member that re-entered first would pass for one that asks for a new round
        after a failure, and the others would re-form without training on (their workers would
        then form a group that waits on any member that dies meanwhile until its lease expires)."""
        self._for_joiners = True

    def shutdown(self) -> bool:
        """See base class. Closes the rendezvous (as torch's handlers do) and leaves it; once the
        node has left, it does nothing and returns ``False``."""
        if self._control.stopped:
            return False
        self.begin_goodbyes()
        try:
            self.set_closed()
            return True
        except EtcdError as exc:
            logger.warning("could not close the rendezvous of run '%s': %s", self.keys.run_id, exc)
            return False
        finally:
            self.leave()

    # --- elastictrain's additions -------------------------------------------------------------

    def begin_goodbyes(self) -> None:
        """Say that this node's job has ended: from now on its etcd requests (its last status
        record, closing the rendezvous, revoking its lease) retry for :data:`_GOODBYE_DEADLINE`
        in all, not each for the retry deadline (see :meth:`EtcdClient.wind_down`)."""
        self.client.wind_down(_GOODBYE_DEADLINE)

    def leave(self) -> None:
        """Leave the rendezvous without closing it: stop watching, and revoke this node's lease,
        so that the others see at once that it is gone. The handler is done afterwards."""
        self._leave_round()
        self._control.close()  # first: a next_rendezvous waiting in another thread ends
        self._release_closer()
        self._alive.revoke()
        self._alive.close()
        self.run_lease.close()
        if self._probe is not None:
            self._probe.close()
        self.client.close()

    def peers_reached(self) -> dict[str, bool]:
        """Whether this node reaches each other member of the round it joined (a probe each, at
        once, each for at most :data:`~elastictrain.rendezvous.reachability.PROBE_TIMEOUT_S`).
        Members that publish no probe port, or have left, are not counted.

        Raises:
            EtcdError: The members could not be read.
        """
        joined = self._joined
        if joined is None:
            return {}
        members = read_members(self.client, self.keys)
        peers = {node: (m.record.addr, m.record.probe_port) for node in joined.nodes
                 if node != self.node_id and (m := members.get(node)) is not None and m.record.probe_port}
        return reach_all(peers)

    def withdraw(self) -> None:
        """Leave the round because this node cannot reach its peers (see
        :func:`~elastictrain.rendezvous.reachability.is_cut_off`): revoke its lease, so that the
        others see at once that it is gone and re-form without it, and re-register at its next
        :meth:`next_rendezvous` only once it reaches them again. Its etcd link is fine."""
        self._withdrawn = True
        self._release_closer()
        self._alive.revoke()
        self._control.touch()

    def _await_peers(self) -> None:
        """Wait until a withdrawn node reaches the members of the run again (a probe a second), or
        until the run closes (then the wait raises as :meth:`next_rendezvous` does)."""
        logger.warning("node %s waits until it reaches its peers again before it rejoins run '%s'", self.node_id,
                       self.keys.run_id)
        control = self._control
        while True:
            with control.cond:
                if control.stopped:
                    raise RendezvousClosedError(f"node {self.node_id} left the rendezvous of run '{self.keys.run_id}'")
                if control.closed is not None:
                    raise RendezvousClosedError(f"the rendezvous of run '{self.keys.run_id}' is closed")
            members = read_members(self.client, self.keys)
            peers = {node: (m.record.addr, m.record.probe_port) for node, m in members.items()
                     if node != self.node_id and m.record.probe_port}
            if not peers or not is_cut_off(self.node_id, reach_all(peers)):
                break
            time.sleep(1.0)
        logger.warning("node %s reaches its peers again: it rejoins run '%s'", self.node_id, self.keys.run_id)
        self._withdrawn = False

    def say_ready(self) -> None:
        """Say that this node's workers can form the group of the round it joined now (they
        train and can stop at their next step, or they were started and wait for their peers).
        Nodes that train on until a joining node is ready count these (:meth:`ready_nodes`; see
        :mod:`~elastictrain.rendezvous.ready`).

        Raises:
            EtcdError: etcd is unreachable or refused us.
        """
        joined, revision = self._joined, self._joined_revision
        if joined is not None:
            self._ready.say(joined, revision)

    def ready_nodes(self) -> int:
        """How many nodes of the round this node joined said their workers can form its group:
        learnt from the control watch once all did, else counted again every few seconds
        (:mod:`~elastictrain.rendezvous.ready`). Every node asks at each monitor tick while a
        node joins.

        Raises:
            EtcdError: etcd is unreachable or refused us.
        """
        joined, revision = self._joined, self._joined_revision
        return 0 if joined is None else self._ready.count(joined, revision)

    @property
    def round(self) -> int | None:
        """The round this node last joined (``None`` before its first)."""
        return self._joined.round if self._joined is not None else None

    @property
    def joined(self) -> RoundRecord | None:
        """The round record this node last joined."""
        return self._joined

    @property
    def closed_seen(self) -> bool:
        """Whether this node has seen the rendezvous closed (no etcd call)."""
        with self._control.cond:
            return self._control.closed is not None

    @property
    def finished_seen(self) -> bool:
        """Whether this node has seen the rendezvous closed because a node finished training."""
        with self._control.cond:
            return self._control.closed is not None and self._control.closed.reason == FINISHED

    # --- internals ----------------------------------------------------------------------------

    def _latest_round(self) -> int:
        rounds = [r.round for r in (self._joined, self._control.round) if r is not None]
        return max(rounds, default=-1)

    def _join(self, after: int, *, for_joiners: bool = False) -> None:
        """Say that this node wants a round newer than ``after``; take the closer key if free."""
        keys = self.keys
        record = MemberRecord(node=self.node_id, addr=self._addr, host=socket.gethostname(), pid=os.getpid(),
                              nproc=self._nproc, port=_free_port(), after=after, for_joiners=for_joiners,
                              probe_port=self._probe.port if self._probe is not None else 0)
        for attempt in range(2):
            lease = self._alive.id or self._alive.grant()
            try:
                result = kv.txn(
                    self.client,
                    [kv.compare_create(keys.closer, "==", 0)],
                    [kv.put(keys.member(self.node_id), encode(record), lease),
                     kv.put(keys.closer, encode(CloserRecord(self.node_id)), lease),
                     kv.get(keys.ctl, prefix=True)],
                    [kv.put(keys.member(self.node_id), encode(record), lease), kv.get(keys.ctl, prefix=True)],
                    what="joining the rendezvous",
                )
                break
            except EtcdLeaseNotFoundError:
                if attempt:
                    raise
                self._alive.grant()  # etcd expired it while we were away: register anew
        self._registered = result.revision  # the member key's write: both branches make it
        self._control.load(result.ranges[0], result.revision)
        if result.succeeded:
            self._become_closer(result.revision)

    def _try_to_close(self) -> None:
        lease = self._alive.id
        if lease is None:
            return
        try:
            result = kv.txn(self.client, [kv.compare_create(self.keys.closer, "==", 0)],
                            [kv.put(self.keys.closer, encode(CloserRecord(self.node_id)), lease),
                             kv.get(self.keys.closer)],
                            what="taking the closer role")
        except EtcdLeaseNotFoundError:
            self._alive.mark_lost()  # etcd expired it: the waiting loop registers anew
            return
        if result.succeeded:
            # Into the view now, not when the watch reports it: until then the waiting loop
            # would take this node for one that lost the key, and drop its closer while the
            # key stays, held by a node that forms nothing (no round could form while it lives).
            self._control.apply_own_write(result.ranges[0][0])
            self._become_closer(result.revision)

    def _become_closer(self, created: int) -> None:
        self._release_closer()  # one this node held before (it formed a round that left it out)
        self._closer = Closer(self.client, self.keys, self._control, self.run_lease, min_nodes=self._min,
                              max_nodes=self._max, last_call=self._config.last_call_timeout.total_seconds(),
                              closer_created=created)

    def _release_closer(self) -> None:
        closer, self._closer = self._closer, None
        if closer is not None:
            closer.close()

    def _announce_spare(self, nodes: int) -> None:
        logger.info("the round is full (%d node(s), max %d): this node waits as a spare, to replace a node that "
                    "leaves", nodes, self._max)
        if self.on_spare is not None:
            try:
                self.on_spare(nodes)
            except Exception:  # noqa: BLE001 - a report must not end the wait
                logger.warning("reporting this node as a spare failed", exc_info=True)

    def _round_stands(self, current: RoundRecord) -> bool:
        """Whether every member of ``current`` is alive and none asked for a new round (one etcd read)."""
        return not is_open(read_members(self.client, self.keys), current)

    def _waiting_for(self) -> str:
        """``waiting for 1 more node (1 of 2)``, as far as this node knows (the closer counts)."""
        if self._spare:
            return f"waiting as a spare (round full: max {self._max} node(s)) to replace a node that leaves"
        if self._closer is not None:
            waiting, _alive = self._closer.summary()
            more = self._min - waiting
            if more > 0:
                return f"waiting for {more} more node{'s' if more > 1 else ''} ({waiting} of {self._min})"
            return f"{waiting} node(s) here (min {self._min}, max {self._max}): waiting for the last call"
        with self._control.cond:
            closer = self._control.closer
        if closer is None:
            return f"waiting for the round to form (min {self._min} node(s))"
        return f"waiting for the round to form (min {self._min} node(s); node {closer} gathers it)"

    def _progress(self) -> str:
        if self._closer is not None:
            waiting, alive = self._closer.summary()
            return f"{waiting} node(s) waiting of {alive} alive (min {self._min}, max {self._max})"
        with self._control.cond:
            closer = self._control.closer
        return f"closer {closer or 'not yet chosen'}; min {self._min} node(s), max {self._max}"

    def _enter_round(self, current: RoundRecord, revision: int) -> RendezvousInfo:
        rank = current.rank_of(self.node_id)
        assert rank is not None  # noqa: S101 - checked by the caller
        self._joined, self._joined_revision, self._spare = current, revision, False
        store = Etcd3Store(self.client, self.keys.store(self._control.incarnation, current.round), self.run_lease,
                           timeout=self._config.join_timeout)
        logger.info("joined round %d of run '%s' as node rank %d of %d", current.round, self.keys.run_id, rank,
                    len(current.nodes))
        return RendezvousInfo(store, rank, len(current.nodes),
                              RendezvousStoreInfo(current.master_addr, current.master_port))

    def _leave_round(self) -> None:
        with self._watch_lock:
            watch, self._round_watch = self._round_watch, None
        if watch is not None:
            watch.close()

    def _on_lease_lost(self) -> None:
        logger.warning("node %s of run '%s' lost its liveness lease: the others count it as gone; it "
                       "rejoins at its next rendezvous", self.node_id, self.keys.run_id)
        self._control.touch()


def create_handler(params: RendezvousParameters, *, client: EtcdClient | None = None) -> Etcd3RendezvousHandler:
    """Create the ``etcd3`` rendezvous handler from torch's rendezvous parameters.

    ``params.endpoint`` is ``host:port[,host:port...]``. Keys of ``params.config``
    (``--rdzv-conf`` in torchrun) are those of :class:`RendezvousConfig` (seconds),
    of :func:`elastictrain.etcd.conf.etcd_settings_from` (TLS, auth, timeouts) and
    ``local_world_size``.

    Args:
        params: torch's rendezvous parameters.
        client: An etcd client to use instead of a new one from ``params`` (the
            simulated nodes of a benchmark process share one connection). The handler
            closes it when it leaves (``leave()``, ``shutdown()``), for good: handlers
            that share one must not leave while the others go on.

    Raises:
        ConfigError: A parameter is invalid.
        EtcdUnavailableError: No etcd endpoint answered.
    """
    if not params.endpoint:
        raise ConfigError("the etcd3 rendezvous backend needs an endpoint (--rdzv-endpoint HOST:PORT)")
    RunKeys.of(params.run_id)
    config = RendezvousConfig.from_mapping(params.config)
    nproc = params.config.get(LOCAL_WORLD_SIZE_KEY) or 0
    try:
        nproc = int(nproc)
    except (TypeError, ValueError):
        raise ConfigError(f"{LOCAL_WORLD_SIZE_KEY} must be an integer, got {nproc!r}") from None
    client = client or EtcdClient(etcd_settings_from(params.config, params.endpoint))
    handler = Etcd3RendezvousHandler(client, params.run_id, min_nodes=params.min_nodes, max_nodes=params.max_nodes,
                                     config=config, local_addr=params.local_addr, nproc=nproc)
    try:
        handler.connect()
    except BaseException:
        client.close()
        raise
    return handler
