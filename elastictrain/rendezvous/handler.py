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

import functools
import logging
import os
import socket
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import NoReturn

from torch.distributed.elastic.rendezvous import (
    RendezvousClosedError,
    RendezvousGracefulExitError,
    RendezvousHandler,
    RendezvousInfo,
    RendezvousParameters,
    RendezvousStoreInfo,
    RendezvousTimeoutError,
)

from elastictrain._addresses import free_port
from elastictrain._fault import MAX_HOW, Fault, node_name_of
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
from elastictrain.rendezvous.records import (
    FINISHED,
    CloserRecord,
    MemberRecord,
    RoundRecord,
    encode,
    node_id_for,
    node_where,
)
from elastictrain.rendezvous.store import Etcd3Store
from elastictrain.rendezvous.waiting import Ending, Look, Me, decide, give_up

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
        self._previous: RoundRecord | None = None
        """The round this node was in before :attr:`_joined` (its members' node ranks name a fault)."""
        self._fault: tuple[int, str] | None = None
        """This node's worker failure that its next request for a round states (:meth:`say_fault`)."""

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
        """Join the rendezvous and wait until a round takes this node in: look at the control view,
        let :func:`~elastictrain.rendezvous.waiting.decide` choose, do what it says, wait for the
        next change (or the closer's next deadline, or a second)."""
        started = time.monotonic()
        join_timeout = self._config.join_timeout.total_seconds()
        deadline = started + join_timeout
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
            with control.cond:
                seen = control.version
                look = self._look()
                current_kv = control.round_kv
            me = Me(self.node_id, after, self._registered, self._alive.id, lease_lost=self._alive.lost,
                    spare=self._spare, closing=self._closer is not None)
            decision = decide(look, me)
            if decision.register_again:
                logger.warning("node %s lost its lease while waiting; registering again", self.node_id)
                self._release_closer()
                self.connect()
                self._join(after, for_joiners=for_joiners)
                continue
            if decision.ending is Ending.ENTER:
                break
            if decision.ending is not None:
                self._end_wait(decision.ending, look)
            if decision.spare_if_full is not None and self._round_stands(decision.spare_if_full):
                self._spare = True
                self._announce_spare(len(decision.spare_if_full.nodes))
            if decision.join_after is not None:
                after = decision.join_after
                self._join(after)
                continue
            if decision.release_closer:
                self._release_closer()
            if decision.resume_closer is not None:
                logger.info("node %s holds the closer key of run '%s': gathering the round again", self.node_id,
                            self.keys.run_id)
                self._become_closer(decision.resume_closer)
            if decision.try_to_close:
                self._try_to_close()
            wake = self._closer.step(time.monotonic()) if self._closer is not None else None
            now = time.monotonic()
            timing = give_up(now, deadline, join_timeout=join_timeout, spare=self._spare,
                             has_round=look.round is not None, open_at_last_look=open_at_last_look,
                             stands=functools.partial(self._round_stands, look.round))
            deadline, open_at_last_look = timing.deadline, timing.open_at_last_look
            if timing.timed_out:
                self._release_closer()
                raise RendezvousTimeoutError(
                    f"the rendezvous of run '{self.keys.run_id}' did not complete within "
                    f"{join_timeout:g}s ({self._progress()})")
            if now - logged >= _LOG_EVERY:
                logged = now
                timeout_s = "" if self._spare else f"; join timeout {join_timeout:g} s"
                logger.info("%s for %.0f s%s (round %d of run '%s')", self._waiting_for(), now - started, timeout_s,
                            after + 1, self.keys.run_id)
            timeout = min(1.0, deadline - now, (wake - now) if wake is not None else 1.0)
            with control.cond:
                control.cond.wait_for(functools.partial(control.moved_since, seen), max(0.0, timeout))
        self._release_closer()
        assert look.round is not None and current_kv is not None  # noqa: S101 - decide() entered it
        return self._enter_round(look.round, current_kv.mod_revision)

    def _look(self) -> Look:
        """The control view as one :class:`~elastictrain.rendezvous.waiting.Look` (under its lock)."""
        control = self._control
        key = control.closer_kv
        return Look(control.round, control.closer, key.lease if key is not None else None,
                    key.create_revision if key is not None else 0, closed=control.closed is not None,
                    problem=control.problem, stopped=control.stopped)

    def _end_wait(self, ending: Ending, look: Look) -> NoReturn:
        """Raise what ends the wait for ``ending`` (all but entering a round)."""
        self._release_closer()
        if ending is Ending.PROBLEM:
            assert look.problem is not None  # noqa: S101 - decide() saw it
            raise look.problem
        if ending is Ending.LEFT:
            raise RendezvousClosedError(f"node {self.node_id} left the rendezvous of run '{self.keys.run_id}'")
        if ending is Ending.CLOSED_AS_SPARE:
            raise RendezvousGracefulExitError(f"run '{self.keys.run_id}' ended while this node waited as a spare")
        raise RendezvousClosedError(f"the rendezvous of run '{self.keys.run_id}' is closed")

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

    def say_fault(self, rank: int, how: str) -> None:
        """Say, in this node's next request for a round, that its worker of global ``rank`` failed
        and ``how`` (``was killed by SIGKILL``): the other members then state that cause
        (:meth:`seen_faults`) rather than a membership change. Said once: the request after it
        states nothing unless this is called again."""
        self._fault = (rank, " ".join(how.split())[:MAX_HOW])

    def seen_faults(self) -> list[Fault]:
        """The faults that made members of this node's round leave it or ask for a new one, as
        they said them (a worker's failure) or as seen (a member gone), each with the node's name
        and its node rank in that round; empty when none is known. No etcd request."""
        self.num_nodes_waiting()  # starts the round's watch on first use
        watch = self._round_watch
        return watch.seen_faults() if watch is not None else []

    def round_faults(self) -> list[Fault]:
        """The worker failures that members of this node's new round said as they asked for it
        (their member records, read once: a fault said just before the round formed, which this
        node's watch of its previous round may not have delivered yet), each named by the node's
        name and its node rank in the previous round; then the members of the previous round that
        the closer found dead as it formed this one (:attr:`RoundRecord.found_dead`: their probe
        port refused). Empty when this node was in no round before.

        Raises:
            EtcdError: etcd failed.
        """
        joined, before = self._joined, self._previous
        if joined is None or before is None:
            return []
        members = read_members(self.client, self.keys)
        found = []
        for node in joined.nodes:
            member = members.get(node)
            if member is None or member.record.fault_rank < 0 or not member.record.fault_how:
                continue
            if member.record.after != before.round:  # said for another round than this one
                continue
            rank = before.rank_of(node)
            found.append(Fault(rank=member.record.fault_rank, node=node_name_of(node),
                               node_rank=rank if rank is not None else joined.rank_of(node),
                               how=member.record.fault_how))
        found += [Fault(rank=None, node=node_name_of(node), node_rank=before.rank_of(node),
                        how=" ".join(filter(None, (node_where(node), "is gone: its probe port refused a connection "
                                                   "(its process died; its lease had not expired yet)"))))
                  for node in joined.found_dead if before.rank_of(node) is not None]
        return found

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
        once, each for at most :data:`~elastictrain.rendezvous.reachability.PROBE_TIMEOUT`).
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
        fault, self._fault = self._fault, None
        record = MemberRecord(node=self.node_id, addr=self._addr, host=socket.gethostname(), pid=os.getpid(),
                              nproc=self._nproc, port=free_port(""), after=after, for_joiners=for_joiners,
                              probe_port=self._probe.port if self._probe is not None else 0,
                              fault_rank=fault[0] if fault is not None else -1,
                              fault_how=fault[1] if fault is not None else "")
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
            except Exception:  # a report must not end the wait
                logger.warning("reporting this node as a spare failed", exc_info=True)

    def _round_stands(self, current: RoundRecord | None) -> bool:
        """Whether every member of ``current`` is alive and none asked for a new round (one etcd read;
        none when there is no round: it does not stand)."""
        return current is not None and not is_open(read_members(self.client, self.keys), current)

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
        if self._joined is not None and self._joined.round != current.round:
            self._previous = self._joined
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
