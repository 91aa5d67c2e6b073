"""In-memory redundancy of sharded state (issue 41, fsdp): buddies, coverage, and the copies on
real gloo processes.

The pure parts (who holds whose copy, which regions the survivors' holdings miss) are tested on
their own. One spawn of four processes, two per "node" (ranks 0-1 and 2-3), then:

- runs a ``Session(sharding="fsdp", redundancy_every=1)`` and one without copies: both end equal,
  and the copies were refreshed;
- holds a refresh back by a gate in the test: the refresh call returns, the next step trains
  (collectives on the training group) while the send is held, the next refresh due is skipped on
  every rank; released, each rank's copy equals its source's shards of the refreshed step;
- the skipped refresh leaves each rank's snapshot and copy of the refreshed step, a consistent pair;
- refreshes every step, then once at a known step (an AdamW state tensor replaced before it, as
  a restore does): each copy equals its source's shards there (parameters and AdamW state), and
  rank 0 gathers the full state of that step;
- on another model, a copy held back by a gate: the next optimizer step waits for it, and the
  snapshot holds the refreshed step's values; refreshes every ``RELEASE_FROM`` steps leave two
  shards per rank between refreshes (four at the peak), and the ranks' kept holdings cover the
  last refresh's step;
- a vote started before the optimizer step (``prepare``) is the one the refresh after it goes by;
- fails a refresh on one rank: the next due one ends the refreshes on every rank;
- kills rank 3 while its next refresh is held back (its holder, rank 1, sees the refresh fail).

The test then rebuilds, from the survivors' holdings alone, the full state of the last step
they all hold, compares it to the gathered one, checks that ranks 0 and 1 alone (node 1 lost
during that refresh, which rank 0 completed and rank 1 did not) still hold it whole, and that
losing rank 3 with its buddy rank 1 leaves exactly their shards uncovered. Run as a script, this module is the worker.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import threading
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch

from elastictrain.errors import ConfigError
from elastictrain.train.fsdp.buddies import buddies, missing
from elastictrain.train.fsdp.holdings import Holding, Region
from elastictrain.train.fsdp.redundancy import RELEASE_FROM
from tests.support.ranks import run_ranks

WORLD = 4
NODES = [0, 0, 1, 1]
TOLERANCE = 1e-12
pytestmark = pytest.mark.timeout(180)


def _holding(key: str, offsets: tuple[int, ...], sizes: tuple[int, ...], step: int = 5) -> Holding:
    return Holding(key=key, offsets=offsets, sizes=sizes, step=step, tensor=torch.zeros(sizes))


# --- pure parts ---------------------------------------------------------------------------------


@pytest.mark.parametrize("nodes", [[0, 0, 1, 1], [0, 1, 2], [0, 0, 0, 1, 1, 1], [5, 5, 9, 9, 7, 7, 7],
                                   [0, 1, 0, 1], [0, 0, 0, 1], [0, 0, 0], [0, 1]])
def test_every_rank_is_held_exactly_once_by_another_rank_on_another_node_when_there_is_one(nodes: list[int]) -> None:
    holders = buddies(nodes)
    assert sorted(h for h in holders if h is not None) == list(range(len(nodes)))  # a permutation
    assert all(h != rank for rank, h in enumerate(holders))
    largest = max(nodes.count(n) for n in set(nodes))
    if len(set(nodes)) > 1 and 2 * largest <= len(nodes):
        assert all(nodes[h] != nodes[rank] for rank, h in enumerate(holders) if h is not None), holders
    if len(set(nodes)) == 1:  # one node: the next rank
        assert holders == [(rank + 1) % len(nodes) for rank in range(len(nodes))]


def test_buddies_are_the_same_local_rank_on_the_next_node_and_none_for_one_rank() -> None:
    assert buddies([0, 0, 1, 1, 2, 2]) == [2, 3, 4, 5, 0, 1]
    assert buddies([3]) == [None]
    with pytest.raises(ValueError, match="empty"):
        buddies([])


def test_missing_subtracts_holdings_of_the_step_from_the_full_boxes() -> None:
    needed = [Region("model/w", (0, 0), (7, 4)), Region("optimizer/w/step", (), ())]
    held = {0: [_holding("model/w", (0, 0), (2, 4)), _holding("optimizer/w/step", (), ())],
            1: [_holding("model/w", (4, 0), (2, 4)), _holding("model/w", (2, 0), (2, 4), step=4)]}
    left = missing(held, needed, 5)
    assert left == [Region("model/w", (2, 0), (2, 4)), Region("model/w", (6, 0), (1, 4))]
    assert missing(held, needed, 4) == [Region("model/w", (0, 0), (2, 4)), Region("model/w", (4, 0), (3, 4)),
                                        Region("optimizer/w/step", (), ())]
    held[2] = [_holding("model/w", (2, 0), (5, 4))]
    assert missing(held, needed, 5) == []
    # A box cut out of the middle, in two dimensions: what is left tiles the rest exactly.
    left = missing({0: [_holding("model/w", (1, 1), (2, 2))]}, needed[:1], 5)
    mask = torch.zeros(7, 4, dtype=torch.int64)
    for box in left:
        mask[box.offsets[0]:box.offsets[0] + box.sizes[0], box.offsets[1]:box.offsets[1] + box.sizes[1]] += 1
    expected = torch.ones(7, 4, dtype=torch.int64)
    expected[1:3, 1:3] = 0
    assert torch.equal(mask, expected)
    assert missing({}, [Region("model/empty", (0,), (0,))], 5) == []  # an empty tensor needs nothing


def test_a_received_copys_metadata_is_checked_against_its_payload() -> None:
    from elastictrain.train.fsdp.redundancy import RedundancyError, _layout, _parse_slots

    slots, length = _layout([_holding("model/w", (0, 0), (2, 3)), _holding("optimizer/w/step", (), ())])
    meta = json.dumps([s.to_json() for s in slots]).encode()
    assert _parse_slots(meta, length) == slots and slots[1].at == 128 and length == 132  # after a 64-byte header
    good = json.loads(meta)
    for bad, words in [(b"{not json", "malformed"), (b'[{"key": "w"}]', "malformed"),
                       (json.dumps([{**good[0], "sizes": [2, 30]}]).encode(), "does not fit"),
                       (json.dumps([{**good[0], "dtype": "object"}]).encode(), "does not fit"),
                       (json.dumps([{**good[0], "sizes": [-2, 3]}]).encode(), "does not fit"),
                       (json.dumps([{**good[0], "at": 3}]).encode(), "does not fit"),
                       (json.dumps([{**good[0], "at": 0}]).encode(), "does not fit")]:
        with pytest.raises(RedundancyError, match=words):
            _parse_slots(bad, length)


def test_a_cpu_snapshot_is_copied_before_take_returns_and_is_of_its_step_once_complete() -> None:
    """On the CPU no stream orders anything: the copy is made by ``take`` itself (so the optimizer
    step pre-hook, released once ``take`` returns, cannot overwrite a shard being copied), no event
    is left for the pre-hook, and the buffer is a snapshot of a step only once ``complete``."""
    from elastictrain.checkpoint import SideStreams
    from elastictrain.train.fsdp.redundancy import _Layout, _mark_streams, _Snapshot

    sources = [Holding("model/w", (0, 0), (2, 3), 4, torch.randn(2, 3)),
               Holding("optimizer/w/exp_avg", (0, 0), (2, 3), 4, torch.randn(2, 3, dtype=torch.float64))]
    before = [h.tensor.clone() for h in sources]
    layout = _Layout.of((), sources)
    snapshot = _Snapshot(pin=False)
    ready = _mark_streams(layout.by_device)
    copied = snapshot.take(layout, ready, SideStreams())
    assert ready == {} and copied == {} and snapshot.step is None and not snapshot.buffer.is_pinned()
    for h in sources:
        h.tensor.add_(1)  # the next optimizer step's writes
    snapshot.complete(copied, 4, None)
    assert [(h.key, h.step) for h in snapshot.holdings()] == [("model/w", 4), ("optimizer/w/exp_avg", 4)]
    assert all(torch.equal(h.tensor, b) for h, b in zip(snapshot.holdings(), before, strict=True))


def test_a_refresh_is_one_message_while_its_layout_stays_and_its_metadata_goes_again_once_changed() -> None:
    """The exchange of one refresh, looped back on one process (this rank its own holder and
    source; each message lands in the receive posted with its tag, which must be its length):
    the first refresh sends a header-long first message, the metadata and the copy; the next, of
    the same tensors, the copy alone (its header in front), received into the views worked out
    the first time; a tensor replaced by a larger one sends, first, a message of the length the
    holder expects, then the metadata and the copy of the new layout. A header that says another
    length with no metadata is refused."""
    from elastictrain.checkpoint import SideStreams
    from elastictrain.train.fsdp.redundancy import (
        _FIRST, _HEADER_BYTES, _META, _PAYLOAD, Redundancy, RedundancyError, _Layout,
    )

    class Done:
        def wait(self) -> bool:
            return True

    class Looped(Redundancy):
        sent: list[tuple[int, int]] = []
        queued: dict[int, torch.Tensor] = {}

        tamper = False

        def _send(self, message: torch.Tensor, tag: int) -> Any:
            self.sent.append((tag, message.numel()))
            self.queued[tag] = message.clone()
            if self.tamper:
                self.queued[tag][:_HEADER_BYTES].view(torch.int64)[2] += 64  # the length its header says
            return Done()

        def _receive(self, into: torch.Tensor, tag: int) -> None:
            message = self.queued.pop(tag)
            assert message.numel() == into.numel()  # gloo's receive takes its message's length alone
            into.copy_(message)

    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    redundancy = Looped(model, optimizer, None, None, every=1, holder=None, source=None)  # type: ignore[arg-type]
    weight = torch.randn(2, 3)
    sources = [Holding("model/w", (0, 0), (2, 3), 0, weight),
               Holding("optimizer/w/step", (), (), 0, torch.tensor(4.0, dtype=torch.float64))]

    def refresh(step: int, layout: _Layout) -> list[Holding]:
        redundancy._sending.take(layout, {}, SideStreams())
        Looped.sent.clear()
        return redundancy._exchange(step)

    layout = _Layout.of((), sources)
    first = refresh(1, layout)
    assert Looped.sent == [(_FIRST, _HEADER_BYTES), (_META, layout.meta.numel()), (_PAYLOAD, layout.length)]
    assert [(h.key, h.step) for h in first] == [("model/w", 1), ("optimizer/w/step", 1)]
    assert torch.equal(first[0].tensor, weight) and first[1].tensor.item() == 4.0
    weight.add_(1)
    second = refresh(2, layout)
    assert Looped.sent == [(_FIRST, layout.length)] and torch.equal(second[0].tensor, weight)
    assert second[0].tensor.data_ptr() == first[0].tensor.data_ptr()  # the same buffer and view, refilled
    wider = torch.randn(2, 50)
    changed = _Layout.of((), [Holding("model/w", (0, 0), (2, 50), 0, wider), sources[1]])
    third = refresh(3, changed)
    assert Looped.sent == [(_FIRST, layout.length), (_META, changed.meta.numel()), (_PAYLOAD, changed.length)]
    assert third[0].sizes == (2, 50) and torch.equal(third[0].tensor, wider) and third[1].tensor.item() == 4.0
    Looped.tamper = True
    with pytest.raises(RedundancyError, match="without the metadata"):
        refresh(4, changed)


def test_the_next_optimizer_step_waits_for_the_copy_to_be_queued_then_its_stream_waits_on_the_copys_event(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The ordering on CUDA, with the streams and events stood in for (no GPU here): the optimizer
    step pre-hook returns only once the sending thread's copy is queued, then makes the step's
    stream wait on the event recorded after the copy (once: the step after does not wait again);
    the sending thread waits on the same event before it sends."""
    from elastictrain.train.fsdp.redundancy import Redundancy

    order: list[Any] = []
    device = torch.device("cuda", 0)

    class Event:
        def synchronize(self) -> None:
            order.append("synchronized")

    class Stream:
        def __init__(self, on: torch.device) -> None:
            self.on = on

        def wait_event(self, event: Any) -> None:
            order.append(("waits", self.on, event))

    copied = Event()

    class Queued(Redundancy):
        gate = threading.Event()

        def _copy(self, snapshot: Any, layout: Any, ready: Any) -> Any:
            assert self.gate.wait(30)
            order.append("queued")
            return {device: copied}

        def _exchange(self, step: int) -> list[Holding]:
            order.append("sent")
            return []

    monkeypatch.setattr(torch.cuda, "current_stream", Stream)
    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    optimizer.register_step_post_hook(lambda *_: order.append("stepped"))
    redundancy = Queued(model, optimizer, None, None, every=1, holder=0, source=0)  # type: ignore[arg-type]
    try:
        with redundancy._cond:  # what after_step hands the thread (past the vote, which needs a group)
            redundancy._copying, redundancy._due = (None, None, {}), 1  # type: ignore[assignment]
            redundancy._cond.notify_all()
        threading.Timer(0.3, Queued.gate.set).start()
        model(torch.randn(4, 3)).sum().backward()
        optimizer.step()
        assert order.index("queued") < order.index(("waits", device, copied)) < order.index("stepped")
        assert redundancy.stalled >= 0.2 and redundancy.wait(timedelta(seconds=30))
        assert order.index("synchronized") < order.index("sent")
        optimizer.step()
        assert order.count(("waits", device, copied)) == 1
    finally:
        redundancy.close()


def test_redundancy_every_is_a_positive_int_for_fsdp_only() -> None:
    from elastictrain.train.session_config import SessionConfig

    assert SessionConfig(global_batch_size=8, sharding="fsdp", redundancy_every=10).redundancy_every == 10
    for options, words in [({"redundancy_every": 0, "sharding": "fsdp"}, "redundancy_every must be a positive int"),
                           ({"redundancy_every": True, "sharding": "fsdp"}, "redundancy_every must be"),
                           ({"redundancy_every": 1}, "redundancy_every needs sharding='fsdp'"),
                           ({"redundancy_every": 1, "sharding": "hsdp"}, "needs sharding='fsdp'")]:
        with pytest.raises(ConfigError, match=words) as caught:
            SessionConfig(global_batch_size=8, **options)
        assert "\n" not in str(caught.value)


# --- real processes on gloo ---------------------------------------------------------------------


def _rows(holdings: list[Holding]) -> list[tuple[str, list[int], list[int], int, torch.Tensor]]:
    """Holdings as data ``torch.load(weights_only=True)`` reads, their tensors copied."""
    return [(h.key, list(h.offsets), list(h.sizes), h.step, h.tensor.detach().cpu().clone()) for h in holdings]


def _as_holdings(rows: list[Any]) -> list[Holding]:
    return [Holding(key=k, offsets=tuple(o), sizes=tuple(s), step=step, tensor=t) for k, o, s, step, t in rows]


def _same(a: list[Any], b: list[Any]) -> bool:
    return len(a) == len(b) and all(x[:4] == y[:4] and torch.equal(x[4], y[4]) for x, y in zip(a, b, strict=True))


def _assemble(holdings: list[Holding], step: int, shapes: dict[str, list[int]]) -> dict[str, torch.Tensor]:
    full = {key: torch.full(shape, float("nan"), dtype=torch.float64) for key, shape in shapes.items()}
    for h in holdings:
        if h.step == step:
            full[h.key][tuple(slice(o, o + s) for o, s in zip(h.offsets, h.sizes, strict=True))] = h.tensor
    return full


def test_copies_follow_their_buddies_do_not_block_the_step_and_rebuild_a_killed_ranks_shards(tmp_path: Path) -> None:
    run_ranks(__file__, WORLD, str(tmp_path))
    dumps = {r: torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in range(WORLD)}
    holders = buddies(NODES)
    source = {holders[r]: r for r in range(WORLD)}
    assert holders == [2, 3, 0, 1]
    # Training with copies refreshed ends where training without them does.
    session = dumps[0]["session"]
    assert session["error"] <= TOLERANCE and session["refreshed"] >= 1 and session["held_step"] >= 1
    for rank, dump in dumps.items():
        # The gated refresh: the step after it trained while it was held; the next due was skipped.
        assert dump["gated"] == {"started": True, "in_flight_after": True, "next_started": False, "skipped": 1}
        assert {row[3] for row in dump["held_gate"]} == {1}
        assert _same(dump["held_gate"], dumps[source[rank]]["own"][1]), rank
        # The skip left a consistent pair: this rank's snapshot of step 1 beside the copy of step 1.
        assert {row[3] for row in dump["kept_gate"]} == {1}
        assert _same(dump["kept_gate"][:len(dump["own"][1])], dump["own"][1]), rank
        # After refreshes every step, and one at step 7: the copy is the source's shards of 7.
        assert {row[3] for row in dump["held7"]} == {7} and _same(dump["held7"], dumps[source[rank]]["own"][7])
        assert {row[0].split("/")[0] for row in dump["held7"]} == {"model", "optimizer"}
        assert any(row[0].endswith("/exp_avg_sq") for row in dump["held7"])
    # The slow copy: the next optimizer step waited for it, and the snapshot is of the refreshed
    # step (not of the step that waited); the copy is its source's shards of that step.
    for rank, dump in dumps.items():
        slow = dump["slow"]
        assert _same(slow["snapshot"], slow["own"]), rank
        assert slow["waited"] >= 0.3, slow["waited"]
        assert _same(slow["held"], dumps[source[rank]]["slow"]["own"]), rank
        # Refreshes every RELEASE_FROM steps: between them, a rank holds its own snapshot and its
        # source's copy of the last refresh (two shards); four while one was in flight.
        own_bytes = sum(row[4].numel() * row[4].element_size() for row in slow["own_second"])
        theirs = sum(row[4].numel() * row[4].element_size() for row in dumps[source[rank]]["slow"]["own_second"])
        padding = 64 * len(slow["own_second"])
        for at_rest in (slow["host_bytes"], slow["host_bytes_second"]):
            assert own_bytes + theirs <= at_rest <= own_bytes + theirs + 2 * padding, (rank, at_rest)
        assert 2 * (own_bytes + theirs) <= slow["peak_host_bytes"] <= 2 * (own_bytes + theirs + 2 * padding)
        assert {row[3] for row in slow["kept_second"]} == {2 * RELEASE_FROM}
        assert _same(slow["held_second"], dumps[source[rank]]["slow"]["own_second"]), rank
    # ... and together the ranks' kept holdings cover the state of that step (a rank lost now rolls
    # back to it).
    kept = {r: _as_holdings(dumps[r]["slow"]["kept_second"]) for r in range(WORLD)}
    needed = [Region(k, tuple(o), tuple(s)) for k, o, s in dumps[0]["regions"]]
    assert missing(kept, needed, 2 * RELEASE_FROM) == []
    prepared = {"skipped": True, "started": True, "completed": True}
    assert [dumps[r]["prepared"] for r in range(WORLD)] == [prepared] * WORLD
    assert [dumps[r]["ended"] for r in range(WORLD)] == [
        {"next_started": False, "failed": True, "refreshed": 0 if r == 2 else 1} for r in range(WORLD)]
    # Rank 3 died during the refresh of step 8: its holder (rank 1) kept the copy of step 7.
    assert dumps[1]["failed"] and not dumps[0]["failed"] and not dumps[2]["failed"]
    survivors = {r: _as_holdings(dumps[r]["final"]) for r in (0, 1, 2)}
    shapes = {region.key: list(region.sizes) for region in needed}
    assert missing(survivors, needed, 7) == []
    rank3 = {(row[0], tuple(row[1]), tuple(row[2])) for row in dumps[3]["own"][7] if "step" not in row[0]}
    assert {(r.key, r.offsets, r.sizes) for r in missing(survivors, needed, 8)} == rank3
    # The state of step 7 rebuilt from the survivors' memory equals the one gathered before the kill.
    rebuilt = _assemble([h for holdings in survivors.values() for h in holdings], 7, shapes)
    full = dumps[0]["full7"]
    assert len(rebuilt) == len(full) > 10
    for key, value in full.items():
        torch.testing.assert_close(rebuilt[key], value.to(torch.float64), atol=0, rtol=0, msg=key)
    # Every rank's own holdings (uneven Shard(0) boxes, rank 3's empty ones left out) tile it too.
    tiled = _assemble([h for r in range(WORLD) for h in _as_holdings(dumps[r]["own"][7])], 7, shapes)
    assert all(torch.equal(tiled[key], value.to(torch.float64)) for key, value in full.items())
    assert {tuple(row[2]) for row in dumps[3]["own"][7] if row[0] == "model/embed.weight"} == {(1, 5)}
    assert not [row for row in dumps[3]["own"][7] if row[0].startswith(("model/head.", "model/scale"))]
    # Node 1 (ranks 2 and 3) lost during that refresh: rank 0 completed it (the copy of rank 2's
    # shards of 8) and rank 1 did not (rank 3's of 7); rank 0 still offers the copy of 7 it
    # replaced, so ranks 0 and 1 hold step 7 whole.
    assert {h.step for h in survivors[0] if h.key == "model/embed.weight" and h.offsets == (4, 0)} >= {7, 8}
    assert missing({r: survivors[r] for r in (0, 1)}, needed, 7) == []
    # Rank 3 and its buddy rank 1 both lost: exactly their shards are missing (the step counts are
    # on every rank), and the caller restores from the checkpoint.
    lost = missing({r: survivors[r] for r in (0, 2)}, needed, 7)
    assert lost
    mask = {key: torch.zeros(shape, dtype=torch.int64) for key, shape in shapes.items()}
    for region in lost:
        mask[region.key][tuple(slice(o, o + s) for o, s in zip(region.offsets, region.sizes, strict=True))] += 1
    expected = {key: torch.zeros(shape, dtype=torch.int64) for key, shape in shapes.items()}
    for rank in (1, 3):
        for key, offsets, sizes, _, _ in dumps[rank]["own"][7]:
            if not key.endswith("/step"):
                expected[key][tuple(slice(o, o + s) for o, s in zip(offsets, sizes, strict=True))] += 1
    for key in shapes:
        assert torch.equal(mask[key], expected[key]), key
    # Host memory: two snapshots of a rank's own shard and two of its source's.
    for rank, dump in dumps.items():
        own_bytes = sum(row[4].numel() * row[4].element_size() for row in dump["own"][7])
        theirs = sum(row[4].numel() * row[4].element_size() for row in dumps[source[rank]]["own"][7])
        assert 2 * (own_bytes + theirs) <= dump["host_bytes"] <= 2 * (own_bytes + theirs) + 4 * 64 * len(dump["own"][7])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_shards_are_snapshotted_into_pinned_buffers_and_copied_to_the_buddy(tmp_path: Path) -> None:
    """Two ranks on one GPU (gloo): a refresh copies a large shard on a side stream. Its copy
    waits for the refreshed step's writes (queued behind slow kernels on the training stream),
    and the next optimizer step (one fast kernel over the large shard) waits for the copy: the
    snapshot and the buddy's copy hold exactly the refreshed step's values, from pinned buffers."""
    run_ranks(__file__, 2, str(tmp_path), "cuda")
    dumps = {r: torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in range(2)}
    for rank, dump in dumps.items():
        assert dump["pinned"] and dump["streams"] == 1 and {row[3] for row in dump["held"]} == {2}
        assert _same(dump["snapshot"], dump["own"]), "the snapshot is not the refreshed step's shards"
        assert _same(dump["held"], dumps[1 - rank]["own"])
        assert not _same(dump["own"], dump["after"])  # the next step did change the shards


# --- the workers ----------------------------------------------------------------------------------


CUDA_BIG = 32 * 2**20
"""Elements of the CUDA worker's large parameter (128 MiB of fp32; momentum as much again)."""


def _cuda_worker(rank: int, out: Path) -> None:
    """Two ranks on the one GPU, gloo: plain CUDA parameters (each rank's whole model is its
    "shard", with a large one), momentum state, one refresh through pinned snapshot buffers on a
    side stream, raced by the optimizer step right after it."""
    import torch.distributed as dist

    from elastictrain.train import process_group as pg
    from elastictrain.train.fsdp.holdings import own_holdings
    from elastictrain.train.fsdp.redundancy import Redundancy

    dist.init_process_group("gloo", init_method=f"file://{out / 'store'}", rank=rank, world_size=2)
    torch.manual_seed(rank)
    model = torch.nn.Linear(5, 3).cuda()
    model.register_parameter("big", torch.nn.Parameter(torch.zeros(CUDA_BIG, device="cuda")))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)

    def train(step: int) -> None:  # queues kernels only: no CPU wait for the GPU
        model(torch.randn(4, 5, device="cuda")).sum().backward()
        model.big.grad = torch.full_like(model.big, float(step))
        optimizer.step()

    def rows(step: int) -> list[tuple[str, list[int], list[int], int, torch.Tensor]]:
        return [(h.key, list(h.offsets), list(h.sizes), h.step, h.tensor.detach().clone())  # on the GPU, queued
                for h in own_holdings(model, optimizer, step)]

    train(1)
    redundancy = Redundancy(model, optimizer, pg.new_gloo_group(), pg.new_gloo_group(), every=2,
                            holder=1 - rank, source=1 - rank)
    torch.cuda.synchronize()
    busy = torch.randn(4096, 4096, device="cuda")
    for _ in range(30):  # ~0.1 s of kernels on the training stream: step 2's writes come long after this line
        busy = busy @ busy
    train(2)
    assert redundancy.after_step(2)
    own = rows(2)
    train(3)  # its one kernel over the large shard must wait for the side stream's copy
    after = rows(3)
    assert redundancy.wait(timedelta(seconds=60))
    redundancy.close()
    assert redundancy.failure is None, redundancy.failure
    torch.cuda.synchronize()
    dump = {"own": [(*r[:4], r[4].cpu()) for r in own], "after": [(*r[:4], r[4].cpu()) for r in after],
            "snapshot": _rows(redundancy._sending.holdings()), "held": _rows(redundancy.held()),
            "pinned": redundancy._sending.buffer.is_pinned(), "streams": len(redundancy._streams._streams)}
    torch.save(dump, out / f"rank{rank}.pt")
    dist.barrier()
    os._exit(0)


def _session_run(redundancy_every: int | None) -> dict[str, Any]:
    import torch.distributed as dist
    from torch.utils.data import TensorDataset

    import elastictrain
    from elastictrain.train.worker import WorkerContext
    from tests.unit.test_fsdp import _net

    model = _net()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    data = torch.Generator().manual_seed(5)
    dataset = TensorDataset(torch.randn(32, 5, generator=data, dtype=torch.float64),
                            torch.randn(32, 3, generator=data, dtype=torch.float64))
    context = dataclasses.replace(WorkerContext.from_env({}), local_world_size=2)
    with elastictrain.Session(model, optimizer, dataset, global_batch_size=8, seed=3, log_every=None,
                              process_group=dist.group.WORLD, context=context, sharding="fsdp",
                              redundancy_every=redundancy_every) as session:
        for step in session.steps():
            for micro in step:
                inputs, targets = micro.batch
                micro.backward(torch.nn.functional.mse_loss(session.model(inputs), targets))
        full = session.full_state_dict()
        redundancy = session._keeper.strategy.redundancy
    return {"full": full, "redundancy": redundancy}


def _worker(rank: int, out: Path) -> None:
    import torch.distributed as dist

    from elastictrain.train import process_group as pg
    from elastictrain.train.fsdp import full_optimizer_state_dict, full_state_dict, optimizer_order, shard
    from elastictrain.train.fsdp.holdings import own_holdings, state_regions
    from elastictrain.train.fsdp.redundancy import Redundancy, RedundancyError
    from tests.unit.test_fsdp import _net

    dist.init_process_group("gloo", init_method=f"file://{out / 'store'}", rank=rank, world_size=WORLD)
    dump: dict[str, Any] = {}

    plain, copied = _session_run(None), _session_run(1)
    if rank == 0:
        error = max((a - b).abs().max().item() for a, b in zip(plain["full"].values(), copied["full"].values(),
                                                               strict=True))
        held = copied["redundancy"].held()
        dump["session"] = {"error": error, "refreshed": copied["redundancy"].refreshed,
                           "held_step": held[0].step if held else -1}

    class Gated(Redundancy):
        """Holds each refresh's send back until the test opens the gate."""

        gate = threading.Event()

        def _exchange(self, step: int) -> list[Holding]:
            assert self.gate.wait(60)
            return super()._exchange(step)

    model = _net()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.05)
    shard(model, optimizer)
    holders = buddies(NODES)
    timeout = timedelta(seconds=20)
    redundancy = Gated(model, optimizer, pg.new_gloo_group(timeout), pg.new_gloo_group(timeout), every=1,
                       holder=holders[rank], source=holders.index(rank))

    def train(step: int) -> None:
        x = torch.randn(6, 5, dtype=torch.float64, generator=torch.Generator().manual_seed(100 * step + rank))
        model(x).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()

    own: dict[int, Any] = {}
    Gated.gate.clear()
    train(1)
    started = redundancy.after_step(1)
    own[1] = _rows(own_holdings(model, optimizer, 1))
    train(2)  # its collectives run while the refresh of step 1 is held back
    in_flight_after = redundancy.in_flight
    next_started = redundancy.after_step(2)
    dump["gated"] = {"started": started, "in_flight_after": in_flight_after, "next_started": next_started,
                     "skipped": redundancy.skipped}
    Gated.gate.set()
    assert redundancy.wait(timeout)
    dump["held_gate"] = _rows(redundancy.held())
    dump["kept_gate"] = _rows(redundancy.kept_holdings())

    for step in range(3, 7):
        train(step)
        redundancy.after_step(step)
    assert redundancy.wait(timeout)
    # A state tensor replaced by a new one (a restore does so): the refresh copies the new tensor,
    # not the one it copied before.
    first = next(iter(optimizer.state.values()))
    first["exp_avg"] = first["exp_avg"].clone()
    train(7)  # every rank has waited before this step's collectives: the refresh of 7 starts everywhere
    assert redundancy.after_step(7)
    own[7] = _rows(own_holdings(model, optimizer, 7))
    assert redundancy.wait(timeout)
    dump["held7"] = _rows(redundancy.held())
    full = full_state_dict(model)
    optim = full_optimizer_state_dict(model, optimizer)
    if rank == 0:
        order = optimizer_order(model, optimizer)
        # Copies: a plain tensor of the state (Adam's step count) comes back as the live one.
        dump["full7"] = {f"model/{k}": v.clone() for k, v in full.items()} | {
            f"optimizer/{order[i]}/{name}": value.clone() for i, state in optim["state"].items()
            for name, value in state.items()}
    dump["regions"] = [(r.key, list(r.offsets), list(r.sizes)) for r in state_regions(model, optimizer)]
    dump["own"] = own
    dump["host_bytes"] = redundancy.host_bytes

    # A refresh whose copy is slow: the next optimizer step waits for it (the shards change
    # there), so the snapshot holds the refreshed step's values. Refreshes every RELEASE_FROM
    # steps: once every rank completed one, the buffers of the one before are released.
    class SlowCopy(Redundancy):
        gate = threading.Event()

        def _copy(self, snapshot: Any, layout: Any, ready: Any) -> Any:
            assert self.gate.wait(60)
            return super()._copy(snapshot, layout, ready)

    model2 = _net()
    optimizer2 = torch.optim.AdamW(model2.parameters(), lr=0.05)
    shard(model2, optimizer2)

    def train2(step: int) -> None:
        x = torch.randn(6, 5, dtype=torch.float64, generator=torch.Generator().manual_seed(7 * step + rank))
        model2(x).square().mean().backward()
        optimizer2.step()
        optimizer2.zero_grad()

    slow = SlowCopy(model2, optimizer2, pg.new_gloo_group(timeout), pg.new_gloo_group(timeout), every=RELEASE_FROM,
                    holder=holders[rank], source=holders.index(rank))
    first_due, second_due = RELEASE_FROM, 2 * RELEASE_FROM
    train2(first_due)
    SlowCopy.gate.clear()
    assert slow.after_step(first_due)
    own_first = _rows(own_holdings(model2, optimizer2, first_due))
    opener = threading.Timer(0.5, SlowCopy.gate.set)
    opener.start()
    before = slow.stalled
    train2(first_due + 1)  # its optimizer step waits for the copy of the step before
    waited = slow.stalled - before
    assert slow.wait(timeout)
    kept, held = slow.kept_holdings(), slow.held()
    dump["slow"] = {"waited": waited, "snapshot": _rows(kept[:len(kept) - len(held)]), "own": own_first,
                    "held": _rows(held), "host_bytes": slow.host_bytes}
    for step in range(first_due + 2, second_due + 1):
        train2(step)
        slow.after_step(step)
    assert slow.wait(timeout)
    dump["slow"] |= {"own_second": _rows(own_holdings(model2, optimizer2, second_due)),
                     "kept_second": _rows(slow.kept_holdings()), "held_second": _rows(slow.held()),
                     "host_bytes_second": slow.host_bytes, "peak_host_bytes": slow.peak_host_bytes}
    slow.close()

    # The vote started before the optimizer step (prepare) is the one after_step goes by: a refresh
    # in flight when it was cast skips the next due refresh, though it ended before after_step (a
    # vote of after_step's own would start it); with none in flight then, the refresh starts.
    prepared = Gated(model2, optimizer2, pg.new_gloo_group(timeout), pg.new_gloo_group(timeout), every=2,
                     holder=holders[rank], source=holders.index(rank))
    Gated.gate.clear()
    train2(second_due + 1)
    assert prepared.after_step(second_due + 2)  # the refresh of this step is held back at the gate
    prepared.prepare(second_due + 4)  # cast while it is in flight
    Gated.gate.set()
    assert prepared.wait(timeout)
    train2(second_due + 4)
    skipped_after_prepare = not prepared.after_step(second_due + 4) and prepared.skipped == 1
    prepared.prepare(second_due + 6)
    train2(second_due + 6)
    dump["prepared"] = {"skipped": skipped_after_prepare, "started": prepared.after_step(second_due + 6),
                        "completed": prepared.wait(timeout) and prepared.held()[0].step == second_due + 6}
    prepared.close()

    # A refresh that fails on one rank (rank 2: its copy is refused once received) ends the
    # refreshes on every rank at the next due step, none left waiting in the vote.
    class Refusing(Redundancy):
        def _exchange(self, step: int) -> list[Holding]:
            received = super()._exchange(step)
            if rank == 2:
                raise RedundancyError("refused by the test")
            return received

    refusing = Refusing(model, optimizer, pg.new_gloo_group(timeout), pg.new_gloo_group(timeout), every=1,
                        holder=holders[rank], source=holders.index(rank))
    assert refusing.after_step(100) and refusing.wait(timeout)
    dump["ended"] = {"next_started": refusing.after_step(101), "failed": refusing.failure is not None,
                     "refreshed": refusing.refreshed}
    refusing.close()

    if rank == 3:
        Gated.gate.clear()  # its refresh of step 8 never sends: it dies holding it back
    train(8)
    assert redundancy.after_step(8)
    if rank == 3:
        torch.save(dump, out / f"rank{rank}.pt")
        os._exit(0)
    assert redundancy.wait(timedelta(seconds=60))
    redundancy.close()
    dump["failed"] = redundancy.failure is not None
    dump["final"] = _rows(redundancy.holdings())
    torch.save(dump, out / f"rank{rank}.pt")
    os._exit(0)  # a peer is dead: no teardown of the groups


if __name__ == "__main__":
    (_cuda_worker if sys.argv[3:] == ["cuda"] else _worker)(int(sys.argv[1]), Path(sys.argv[2]))
