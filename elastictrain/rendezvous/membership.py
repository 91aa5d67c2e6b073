"""What a node knows of the run's membership, kept current by etcd watches.

- :class:`ControlView`: the control keys (the last round, the closer, closed), which
  every node watches: a few events per round.
- :class:`Closer`: the one node that forms the next round. It alone reads and
  watches every membership key while nodes gather, decides when the round is
  complete (the same rules as torch's dynamic rendezvous: ``max_nodes`` reached,
  or ``min_nodes`` and a last call, or every live node in), and closes it with one
  transaction.
- :class:`RoundWatch`: a training node's view of the members of its round: it
  learns from etcd events, not polls, that a member lost its lease, asks for a new
  round, or that a node waits to join.

The rules, written once here:

- a node *waits* when it is alive (its member key exists) and it asked for a round newer
  than the current one (``after >= round``: it re-entered the rendezvous), or it is not a
  member of the current round and wrote its key after the membership that round was
  decided on (it came later). A node the round left out although its key was there is
  not waiting: either it was a member that never asked again (a dead node whose lease
  runs on, which a later round must not take in), or a spare left out for want of room,
  which asks again for the next round at once;
- the current round stands until a member is gone or waits again; only then can
  the next round form ("open");
- the next round takes the waiting nodes, members of the current round first,
  then by registration (``create_revision``) order, at most ``max_nodes``; ranks
  follow registration order. It forms at once when ``max_nodes`` wait, unless a live
  member of the current round has not asked yet: then it waits for it up to the last call;
- a node whose key lives but that has not asked for a re-forming round is probed (a TCP connect
  to the probe port in its record): one whose port is refused is dead (its process is gone,
  its lease not yet expired), and the round does not wait the last call for it. One that
  answers, or does not answer at all (a host down or cut off), is waited for as before.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import timedelta

from elastictrain import errors
from elastictrain._fault import Fault, node_name_of
from elastictrain.etcd import kv
from elastictrain.etcd.client import EtcdClient
from elastictrain.etcd.lease import RunLease
from elastictrain.etcd.watch import Watch, WatchEvent
from elastictrain.rendezvous.keys import RunKeys
from elastictrain.rendezvous.reachability import Answer, probe_all
from elastictrain.rendezvous.records import (
    FORMED_ALL_IN,
    FORMED_FULL,
    FORMED_LAST_CALL,
    FORMED_PEERS_DEAD,
    AllReadyRecord,
    ClosedRecord,
    CloserRecord,
    MemberRecord,
    RoundRecord,
    decode,
    describe_node,
    encode,
    node_where,
)

logger = logging.getLogger(__name__)

__all__ = ["PROBE_AGAIN", "STORES_KEPT", "Closer", "Closing", "ControlView", "Member", "RoundWatch", "absent_members",
           "choose_members", "close_rendezvous", "closing", "is_open", "member_of", "read_members", "waiting"]

PROBE_AGAIN = timedelta(seconds=0.25)
"""How soon the closer probes again a member it waits for whose last probe was answered (or went
unanswered): a member's agent may die a moment after its workers did."""

STORES_KEPT = 3
"""Rounds whose store keys stay: the newest and the two before it (an agent may still be starting
a round that two newer ones superseded; it must not wait on a store that is gone)."""


@dataclass(frozen=True, slots=True)
class Member:
    """A live member key: the record and its registration revision."""

    record: MemberRecord
    created: int
    """``create_revision`` of the member key: the node's place in rank order."""
    modified: int
    """``mod_revision`` of the member key: when the node last asked for a round."""


def waiting(members: dict[str, Member], current: RoundRecord | None) -> list[Member]:
    """The live nodes that want to be in the next round (see the module's rules)."""
    if current is None:
        return list(members.values())
    return [m for m in members.values()
            if m.record.after >= current.round
            or (current.rank_of(m.record.node) is None and m.modified > current.snapshot)]


def member_of(item: kv.KeyValue) -> Member:
    """The member a member key holds.

    Raises:
        UnreadableRecordError: The key holds no member record (a foreign key).
    """
    return Member(decode(MemberRecord, item.key, item.value), item.create_revision, item.mod_revision)


def read_members(client: EtcdClient, keys: RunKeys) -> dict[str, Member]:
    """The live member keys, read once (a foreign key among them is skipped: the closer says so)."""
    _, found = kv.range_(client, keys.members, prefix=True, what="reading the rendezvous members")
    members: dict[str, Member] = {}
    for item in found:
        with contextlib.suppress(errors.UnreadableRecordError):
            member = member_of(item)
            members[member.record.node] = member
    return members


def is_open(members: dict[str, Member], current: RoundRecord | None) -> bool:
    """Whether the next round may form: there is no round, or a member of the current one is
    gone or asked for a new round."""
    if current is None:
        return True
    for node in current.nodes:
        member = members.get(node)
        if member is None or member.record.after >= current.round:
            return True
    return False


def absent_members(members: dict[str, Member], current: RoundRecord | None, candidates: list[Member]) -> list[str]:
    """Members of the current round whose key lives but that have not asked for the next round yet.

    A full set of candidates does not close the round before the last call while there are
    any: a node re-entering after its own worker failed must not let a spare take the seat
    of a healthy member that is a moment from re-entering too (its workers hold the live
    state; a round without them restores the checkpoint). A dead member whose lease runs on
    costs the last call, as it does without a spare."""
    if current is None:
        return []
    asked = {m.record.node for m in candidates}
    return [node for node in current.nodes if node in members and node not in asked]


def choose_members(candidates: list[Member], current: RoundRecord | None, max_nodes: int) -> list[Member]:
    """At most ``max_nodes`` of ``candidates`` (current members first, then registration order),
    in rank order (registration order)."""
    previous = set(current.nodes) if current is not None else set()
    chosen = sorted(candidates, key=lambda m: (m.record.node not in previous, m.created))[:max_nodes]
    return sorted(chosen, key=lambda m: m.created)


@dataclass(frozen=True, slots=True)
class Closing:
    """The closer's verdict at one look (:func:`closing`)."""

    chosen: list[Member] | None
    """The members of the round to form now, in rank order (``None``: not now)."""
    wake: float | None
    """When to look again at the latest (the last call's end), or ``None``: only an etcd event
    can change the verdict."""
    quorum_since: float | None
    """Since when ``min_nodes`` have waited (the last call counts from then)."""
    reason: str = ""
    """Why the round forms now (one of :data:`~elastictrain.rendezvous.records.FORMED_REASONS`)."""
    found_dead: list[str] = field(default_factory=list)
    """The live keys not waited for because their probe was refused (in the round's record)."""
    unasked: list[str] = field(default_factory=list)
    """While a re-formation waits (``chosen`` is ``None``): the live nodes that have not asked for
    the round and are not known dead, whose arrival or death would form it sooner (the closer
    probes them)."""


def closing(members: dict[str, Member], current: RoundRecord | None, *, now: float, quorum_since: float | None,
            min_nodes: int, max_nodes: int, last_call: float, dead: frozenset[str] = frozenset()) -> Closing:
    """Whether the closer forms the next round at ``now`` (the module's rules): the current round
    is open, ``min_nodes`` wait, and either ``max_nodes`` wait and no live member of the current
    round is still to ask, or the last call is over, or every live node is in.

    ``dead``: nodes whose key lives but whose probe port was refused (their process is gone, see
    :class:`~elastictrain.rendezvous.reachability.Answer`). In a re-formation they count as gone:
    the round forms once every other live node is in, without waiting the last call for them. A
    node that asked for the round is a candidate whatever its probe said."""
    if not is_open(members, current):
        return Closing(None, None, None)
    candidates = waiting(members, current)
    if len(candidates) < min_nodes:
        return Closing(None, None, None)
    since = now if quorum_since is None else quorum_since
    due = since + last_call
    # A re-formation does not wait for nodes nobody knows of once every live node is in
    # (survivors train again at once). The first round does, as torch's does, and so does
    # a round with no survivor in it (the job launched again after all its nodes died):
    # nodes start at slightly different times, and one a moment late would otherwise wait
    # for a round that forms only when the others next re-enter (a join, or a restart).
    survivors = current is not None and not set(current.nodes).isdisjoint(m.record.node for m in candidates)
    asked = {m.record.node for m in candidates}
    found_dead = sorted(node for node in members if node in dead and node not in asked) if survivors else []
    live = {node: m for node, m in members.items() if node not in found_dead}

    def due_now(alive: dict[str, Member]) -> str:
        if survivors and len(candidates) == len(alive):
            return FORMED_ALL_IN
        if len(candidates) >= max_nodes and not absent_members(alive, current, candidates):
            return FORMED_FULL
        return ""

    reason = due_now(members)
    if not reason and found_dead and due_now(live):
        reason = FORMED_PEERS_DEAD
    if not reason and now >= due:
        reason = FORMED_LAST_CALL
    if not reason:
        unasked = [node for node in live if node not in asked] if survivors else []
        return Closing(None, due, since, unasked=unasked)
    return Closing(choose_members(candidates, current, max_nodes), None, since, reason=reason, found_dead=found_dead)


class ControlView:
    """The run's control keys as etcd last told this node, updated by a watch.

    Waiters use :attr:`cond`; every update notifies it, and calls :attr:`on_change`.
    """

    def __init__(self, client: EtcdClient, keys: RunKeys) -> None:
        self._client = client
        self._keys = keys
        self.cond = threading.Condition()
        self.round: RoundRecord | None = None
        self.round_kv: kv.KeyValue | None = None
        self.closer: str | None = None
        self.closer_kv: kv.KeyValue | None = None
        self.closed: ClosedRecord | None = None
        self.all_ready: int | None = None
        """The last round whose nodes all said their workers are ready (``rdzv/ctl/ready``)."""
        self.problem: errors.CorruptRendezvousStateError | None = None
        self.version = 0
        """Bumped on every change (and by :meth:`touch`): waiters wait for it to move."""
        self.loaded = False
        """Whether the view was read from etcd yet."""
        self.stopped = False
        """Whether this node left (:meth:`close`): the view is no longer kept current."""
        self._loaded_at = 0  # the revision of the last full read: older events are in it
        self._seen = 0  # the newest revision this view reflects (a read's, or the watch's last event's)
        self._closer_changed = 0  # the revision of the closer key's last change in the view
        self._watch: Watch | None = None
        self.on_change: Callable[[], None] | None = None
        """Called after each update (on the thread that made it, the watch's most often)."""

    @contextlib.contextmanager
    def _update(self) -> Iterator[None]:
        """Hold the lock while the view changes; then bump :attr:`version`, wake the waiters and
        call :attr:`on_change` (outside the lock)."""
        with self.cond:
            yield
            self.version += 1
            self.cond.notify_all()
        if self.on_change is not None:
            self.on_change()

    def moved_since(self, version: int) -> bool:
        """Whether the view changed since it was at ``version`` (call it holding :attr:`cond`)."""
        return self.version != version

    def touch(self) -> None:
        """Wake every waiter: something it depends on (not a control key) changed."""
        with self._update():
            pass

    @property
    def incarnation(self) -> int:
        """``create_revision`` of the round key: changes when the run's keys were purged and it
        started again, so store keys of an earlier incarnation are never read."""
        return self.round_kv.create_revision if self.round_kv is not None else 0

    def load(self, kvs: list[kv.KeyValue], revision: int) -> None:
        """Replace the view with a read of the control prefix made at ``revision``, and keep it
        current from there on (starting the watch on first use)."""
        with self._update():
            # A read made before the watch's newest event is older than this view: the watch
            # has applied every change up to that event, so the read is taken as seen. (A node
            # that joins reads here, and the round formed just after its read may already
            # have arrived by the watch: replacing the view would lose it for good.)
            if revision >= self._seen:
                self.round = self.round_kv = self.closer = self.closer_kv = self.closed = self.all_ready = None
                self.problem = None
                self._closer_changed = 0  # events up to the read's revision are skipped anyway
                for item in kvs:
                    self._apply(item, deleted=False)
                self._loaded_at = self._seen = revision
            self.loaded = True
        if self._watch is None:
            self._watch = Watch(self._client, self._keys.ctl, prefix=True, start_revision=revision + 1,
                                on_events=self._on_events, on_compacted=self._reload, name="control-watch").start()

    def _reload(self) -> int:
        revision, kvs = kv.range_(self._client, self._keys.ctl, prefix=True, what="reading the rendezvous")
        self.load(kvs, revision)
        return revision

    def _on_events(self, events: list[WatchEvent], _revision: int) -> None:
        with self._update():
            for event in events:
                if event.revision > self._loaded_at:  # older ones are in the last load already
                    self._apply(event.kv, deleted=event.deleted)
                    self._seen = max(self._seen, event.revision)

    def apply_own_write(self, item: kv.KeyValue) -> None:
        """Take a write this node made (e.g. the round it formed) before its watch event arrives."""
        with self._update():
            current = self.round_kv if item.key == self._keys.round else None
            if current is None or current.mod_revision < item.mod_revision:
                self._apply(item, deleted=False)
                if item.key == self._keys.round:
                    # The same transaction deleted the closer key: no event needed to know it.
                    self.closer = self.closer_kv = None
                    self._closer_changed = max(self._closer_changed, item.mod_revision)

    def _apply(self, item: kv.KeyValue, *, deleted: bool) -> None:
        try:
            if item.key == self._keys.round:
                if deleted:
                    self.round, self.round_kv = None, None
                elif self.round_kv is None or item.mod_revision >= self.round_kv.mod_revision:
                    self.round, self.round_kv = decode(RoundRecord, item.key, item.value), item
            elif item.key == self._keys.closer:
                if item.mod_revision < self._closer_changed:
                    return  # older than a write of this node's that the view took before its event
                self._closer_changed = item.mod_revision
                self.closer = None if deleted else decode(CloserRecord, item.key, item.value).node
                self.closer_kv = None if deleted else item
            elif item.key == self._keys.closed:
                self.closed = None if deleted else decode(ClosedRecord, item.key, item.value)
            elif item.key == self._keys.all_ready:
                self.all_ready = None if deleted else decode(AllReadyRecord, item.key, item.value).round
        except errors.UnreadableRecordError as exc:
            self.problem = errors.CorruptRendezvousStateError(str(exc))  # for torch's agent

    def close(self) -> None:
        """Stop watching, and wake the waiters: they must not wait on a view nothing updates."""
        if self._watch is not None:
            self._watch.close()
            self._watch = None
        with self.cond:
            self.stopped = True
            self.version += 1
            self.cond.notify_all()


class Closer:
    """Forms the next round, while this node holds the closer key.

    Args:
        client: The etcd front.
        keys: The run's keys.
        control: This node's control view (the current round comes from it).
        run_lease: The lease the round record is attached to.
        min_nodes: Fewest nodes of a round.
        max_nodes: Most nodes of a round.
        last_call: How long to wait for more nodes once ``min_nodes`` wait.
        closer_created: ``create_revision`` of this node's closer key (the fencing token:
            a node that lost the key can no longer form a round).
    """

    def __init__(self, client: EtcdClient, keys: RunKeys, control: ControlView, run_lease: RunLease, *,
                 min_nodes: int, max_nodes: int, last_call: float, closer_created: int) -> None:
        self._client = client
        self._keys = keys
        self._control = control
        self._run_lease = run_lease
        self._min, self._max, self._last_call = min_nodes, max_nodes, last_call
        self._token = closer_created
        self._lock = threading.Lock()
        self._members: dict[str, Member] = {}
        self._revision = 0
        self._quorum_since: float | None = None
        self._reported: set[str] = set()
        self._answers: dict[Member, tuple[Answer, float]] = {}
        """What the probe of each version of a member key met, and when it ended. Keyed by the whole
        :class:`Member` (its revisions too): an answer about one version never speaks for a later one."""
        self._probing: set[Member] = set()
        self._closed = False
        revision, found = kv.range_(client, keys.members, prefix=True, what="reading the rendezvous members")
        with self._lock:
            for item in found:
                self._put(item)
            self._revision = revision
        self._watch = Watch(client, keys.members, prefix=True, start_revision=revision + 1,
                            on_events=self._on_events, on_compacted=self._reload, name="members-watch").start()

    def _reload(self) -> int:
        revision, found = kv.range_(self._client, self._keys.members, prefix=True,
                                    what="reading the rendezvous members")
        with self._lock:
            self._members.clear()
            for item in found:
                self._put(item)
            self._revision = revision
        return revision

    def _put(self, item: kv.KeyValue) -> None:
        try:
            member = member_of(item)
        except errors.UnreadableRecordError as exc:
            if item.key not in self._reported:  # a foreign key among the members: left out, said once
                self._reported.add(item.key)
                logger.warning("ignoring %s", exc)
            return
        self._members[member.record.node] = member

    def _on_events(self, events: list[WatchEvent], revision: int) -> None:
        with self._lock:
            for event in events:
                node = event.key[len(self._keys.members):]
                if event.deleted:
                    self._members.pop(node, None)
                else:
                    self._put(event.kv)
            self._revision = max(self._revision, events[-1].revision)
        self._control.touch()  # the waiting loop re-evaluates

    def summary(self) -> tuple[int, int]:
        """How many live nodes wait, and how many are alive."""
        with self._lock:
            members = dict(self._members)
        return len(waiting(members, self._control.round)), len(members)

    def step(self, now: float) -> float | None:
        """Form the next round if it is due.

        Returns:
            When to look again at the latest (a last-call deadline, or the next probe of a
            member it waits for), or ``None``: only an etcd event can change the decision.

        Raises:
            EtcdError: etcd failed.
        """
        current, current_kv = self._control.round, self._control.round_kv
        with self._lock:
            members, snapshot = dict(self._members), self._revision
            dead = frozenset(node for node, m in members.items()
                             if (answer := self._answers.get(m)) is not None and answer[0] is Answer.REFUSED)
        verdict = closing(members, current, now=now, quorum_since=self._quorum_since, min_nodes=self._min,
                          max_nodes=self._max, last_call=self._last_call, dead=dead)
        self._quorum_since = verdict.quorum_since
        if verdict.chosen is not None:
            self._form(verdict.chosen, current, current_kv, snapshot, reason=verdict.reason,
                       found_dead=verdict.found_dead)
            return None
        again = self._probe([members[node] for node in verdict.unasked], now)
        return min((t for t in (verdict.wake, again) if t is not None), default=None)

    def _probe(self, unasked: list[Member], now: float) -> float | None:
        """Probe, on a thread of their own, the members the round waits for that publish a probe
        port and were not probed in the last :data:`PROBE_AGAIN` (one found dead stays dead);
        return when the next of them is due again."""
        due: list[float] = []
        with self._lock:
            if self._closed:
                return None
            fresh = []
            for member in unasked:
                if not member.record.probe_port or member in self._probing:
                    continue
                answer = self._answers.get(member)
                if answer is not None and answer[0] is Answer.REFUSED:
                    continue
                if answer is None or now >= answer[1] + PROBE_AGAIN.total_seconds():
                    fresh.append(member)
                else:
                    due.append(answer[1] + PROBE_AGAIN.total_seconds())
            self._probing.update(fresh)
        if fresh:
            threading.Thread(target=self._probe_now, args=(fresh,), name="elastictrain-closer-probe",
                             daemon=True).start()
        return min(due, default=None)

    def _probe_now(self, members: list[Member]) -> None:
        answers = probe_all({m.record.node: (m.record.addr, m.record.probe_port) for m in members})
        ended = time.monotonic()
        with self._lock:
            for member in members:
                self._answers[member] = (answers[member.record.node], ended)
                self._probing.discard(member)
            closed = self._closed
        for member in members:
            if answers[member.record.node] is Answer.REFUSED:
                logger.info("node %s has not asked for the next round and its probe port %s:%d refused a "
                            "connection: its process is gone (its lease lives on); not waiting the last call for it",
                            describe_node(member.record.node), member.record.addr, member.record.probe_port)
        if not closed:
            self._control.touch()  # the waiting loop looks again (and the closer steps)

    def _form(self, chosen: list[Member], current: RoundRecord | None, current_kv: kv.KeyValue | None,
              snapshot: int, *, reason: str, found_dead: list[str]) -> None:
        first = chosen[0].record
        record = RoundRecord(
            round=(current.round + 1) if current is not None else 0,
            nodes=[m.record.node for m in chosen], nproc=[m.record.nproc for m in chosen],
            master_addr=first.addr, master_port=first.port, snapshot=snapshot,
            min_nodes=self._min, max_nodes=self._max, reason=reason, found_dead=found_dead,
        )
        keys = self._keys
        compare = [
            # The round this node read is still the last one ...
            kv.compare_mod(keys.round, "==", current_kv.mod_revision) if current_kv is not None
            else kv.compare_create(keys.round, "==", 0),
            # ... this node is still the closer ...
            kv.compare_create(keys.closer, "==", self._token),
            # ... no member key changed since the membership it decided on ...
            kv.compare_mod(keys.members, "<", snapshot + 1, prefix=True),
            # ... and nobody closed the rendezvous.
            kv.compare_create(keys.closed, "==", 0),
        ]
        value = encode(record)
        # A round's store keys (torch's agents exchange their ranks there) outlive it: the round
        # that forms deletes those of the round STORES_KEPT before it, or every re-formation of a
        # long job would add a store's keys that status and every node starting read again.
        cleanup = ([kv.delete(keys.store(current_kv.create_revision, record.round - STORES_KEPT), prefix=True)]
                   if current_kv is not None and record.round >= STORES_KEPT else [])
        result = self._run_lease.write(lambda lease: kv.txn(
            self._client, compare,
            [kv.put(keys.round, value, lease), kv.delete(keys.closer), kv.get(keys.round), *cleanup],
            what="forming a rendezvous round"))
        if result.succeeded:
            logger.info("formed round %d of run '%s' with %d node(s) (%s): %s%s", record.round, keys.run_id,
                        len(record.nodes), record.reason,
                        ", ".join(describe_node(node, rank) for rank, node in enumerate(record.nodes[:8]))
                        + (" ..." if len(record.nodes) > 8 else ""),
                        "; found dead (probe refused), not waited for: "
                        + ", ".join(describe_node(node) for node in record.found_dead) if record.found_dead else "")
            self._control.apply_own_write(result.ranges[0][0])
        # Otherwise something changed under us; the watches say what, and step() runs again.

    def close(self) -> None:
        with self._lock:
            self._closed = True
        self._watch.close()


class RoundWatch:
    """A member's view of its round while it trains: who left, who wants a new round, who waits.

    It watches the member keys from the revision the round was formed from, so a
    member that died just before the round was written is seen too. Once it has seen
    a reason to re-form the round it stops watching (the count stays).

    Args:
        client: The etcd front.
        keys: The run's keys.
        joined: The round this node is a member of.
        on_change: Called after each update (on the watch thread).
    """

    def __init__(self, client: EtcdClient, keys: RunKeys, joined: RoundRecord,
                 on_change: Callable[[], None] | None = None) -> None:
        self._keys = keys
        self._joined = joined
        self._members = set(joined.nodes)
        self._on_change = on_change
        self._lock = threading.Lock()
        self.lost: set[str] = set()
        self.rejoining: set[str] = set()
        """Members that asked for a new round (a failure on their node, or a round they missed)."""
        self.taking_in: set[str] = set()
        """Members that re-entered only to take in joining nodes (:attr:`MemberRecord.for_joiners`)."""
        self.joiners: set[str] = set()
        self.faults: dict[str, tuple[int, str]] = {}
        """The worker failure each rejoining member said made it ask for a new round: its global rank
        and how it ended (:attr:`MemberRecord.fault_rank`, :attr:`MemberRecord.fault_how`)."""
        self._watch = Watch(client, keys.members, prefix=True, start_revision=joined.snapshot + 1,
                            on_events=self._on_events, name="round-watch")
        self._watch.start()

    def _on_events(self, events: list[WatchEvent], _revision: int) -> None:
        with self._lock:
            for event in events:
                node = event.key[len(self._keys.members):]
                if event.deleted:
                    if node in self._members:
                        self.lost.add(node)
                    else:
                        self.joiners.discard(node)
                    continue
                try:
                    record = decode(MemberRecord, event.key, event.kv.value)
                except errors.UnreadableRecordError:
                    continue
                if node in self._members:
                    if record.after >= self._joined.round:
                        (self.taking_in if record.for_joiners else self.rejoining).add(node)
                        if record.fault_rank >= 0 and record.fault_how:
                            self.faults[node] = (record.fault_rank, record.fault_how)
                else:
                    self.joiners.add(node)
            triggered = self._waiting_locked() > 0
        if self._on_change is not None:
            self._on_change()
        if triggered:
            self._watch.close()  # enough to re-form the round: no need for more events

    def _waiting_locked(self) -> int:
        gone = len(self.lost)
        room = self._joined.max_nodes - (len(self._members) - gone)
        return gone + len(self.rejoining) + len(self.taking_in) + min(len(self.joiners), max(0, room))

    def waiting(self) -> int:
        """Reasons to re-form the round: members lost or asking for a new round, and nodes that
        wait to join and fit under ``max_nodes``."""
        with self._lock:
            return self._waiting_locked()

    def seen_faults(self) -> list[Fault]:
        """What made the members that left or asked for a new round do so, as far as they said:
        a rejoining member's worker failure, a lost member as lost. Named by name and node rank in
        this round."""
        with self._lock:
            faults, lost = dict(self.faults), set(self.lost)
        nodes = self._joined.nodes
        found = [Fault(rank=rank, node=node_name_of(node), node_rank=nodes.index(node), how=how)
                 for node, (rank, how) in faults.items()]
        found += [Fault(rank=None, node=node_name_of(node), node_rank=nodes.index(node),
                        how=" ".join(filter(None, (node_where(node),
                                                   "is gone: its agent stopped or lost its etcd lease"))))
                  for node in sorted(lost, key=nodes.index)]
        return found

    def only_joins(self) -> bool:
        """Whether there are reasons to re-form the round and every one of them is a node
        that waits to join (no member lost, none asking for a new round; members that re-entered
        to take in the joining nodes do not count)."""
        with self._lock:
            return not self.lost and not self.rejoining and self._waiting_locked() > 0

    def close(self) -> None:
        self._watch.close()



def close_rendezvous(client: EtcdClient, keys: RunKeys, lease: RunLease, *, by: str, reason: str = "") -> None:
    """Mark the run's rendezvous closed (idempotent): no round forms after it.

    Raises:
        EtcdError: etcd failed.
    """
    value = encode(ClosedRecord(by=by, reason=reason))
    lease.write(lambda lease_id: kv.txn(client, [kv.compare_create(keys.closed, "==", 0)],
                                        [kv.put(keys.closed, value, lease_id)], what="closing the rendezvous"))
