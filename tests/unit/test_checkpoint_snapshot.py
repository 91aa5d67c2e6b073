"""Snapshots: CPU copies that keep aliasing, refuse what weights_only loading cannot read, and reuse memory."""

from __future__ import annotations

import io
import random
from collections import OrderedDict
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from elastictrain.checkpoint._snapshot import (
    CopyPool,
    capture,
    capture_rng,
    fallback_seed,
    materialize,
    restore_rng,
    snapshot,
)
from elastictrain.errors import ConfigError

pytestmark = pytest.mark.timeout(30)

scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(),
    st.floats(allow_nan=False),
    st.complex_numbers(allow_nan=False),
    st.text(max_size=5),
    st.sampled_from([torch.float16, torch.int64, torch.device("cpu")]),
)
tensors = st.lists(st.floats(-1e3, 1e3), min_size=0, max_size=4).map(torch.tensor)
plain_state = st.recursive(
    st.one_of(scalars, tensors, st.sets(st.integers(), max_size=3)),
    lambda inner: st.one_of(
        st.lists(inner, max_size=3),
        st.lists(inner, max_size=3).map(tuple),
        st.dictionaries(st.one_of(st.text(max_size=4), st.integers()), inner, max_size=3),
        st.dictionaries(st.text(max_size=4), inner, max_size=3).map(OrderedDict),
    ),
    max_leaves=12,
)


def round_trip(obj: Any) -> Any:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


def same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, dict):
        return type(a) is type(b) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, set):
        return type(b) is set and a == b
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return a == b


@settings(max_examples=60, deadline=None)
@given(plain_state)
def test_whatever_snapshot_accepts_loads_back_with_weights_only(state: Any) -> None:
    pool = CopyPool()
    pool.begin()
    copied = snapshot(state, copy=True, pool=pool)
    assert same(round_trip(copied), state)


def saved_bytes(obj: Any) -> bytes:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


@settings(max_examples=40, deadline=None)
@given(plain_state)
def test_a_capture_copied_later_saves_the_bytes_of_a_snapshot_taken_at_capture_time(state: Any) -> None:
    pool = CopyPool()
    pool.begin()
    expected = saved_bytes(snapshot(state, copy=True, pool=pool))
    pool.begin()
    captured, references = capture(state, pool=pool)
    for tensor in references:
        pool.copy_of(tensor)
    for tensor in references:  # the originals change once copied: the copies must not
        tensor.add_(1)
    assert saved_bytes(materialize(captured, pool)) == expected


def test_a_set_saves_in_its_own_order_whether_snapshotted_or_captured_and_materialized() -> None:
    seen: set[int] = set()
    seen.add(-19)
    seen.add(-11)  # collides with -19: iterates first here, second in a set rebuilt element by element
    pool = CopyPool()
    pool.begin()
    expected = saved_bytes(snapshot({"seen": seen}, copy=True, pool=pool))
    pool.begin()
    captured, _ = capture({"seen": seen}, pool=pool)
    assert saved_bytes(materialize(captured, pool)) == expected == saved_bytes({"seen": seen})


def test_a_capture_keeps_tied_tensors_tied_once_materialized() -> None:
    weight = torch.randn(4, 3)
    state = {"embed": weight, "head": weight.detach(), "row": weight[1], "sparse": weight.to_sparse()}
    pool = CopyPool()
    pool.begin()
    captured, references = capture(state, pool=pool)
    assert len(references) == 3 and not any(t.is_sparse for t in references)  # sparse: copied at once
    for tensor in references:
        pool.copy_of(tensor)
    copied = materialize(captured, pool)
    assert copied["embed"].untyped_storage().data_ptr() == copied["row"].untyped_storage().data_ptr()
    assert copied["embed"].untyped_storage().data_ptr() != weight.untyped_storage().data_ptr()
    assert copied["row"].storage_offset() == 3 and torch.equal(copied["sparse"].to_dense(), weight)


def test_snapshot_copy_keeps_tied_tensors_tied_and_is_independent_of_the_originals() -> None:
    weight = torch.randn(4, 3)
    state = {"embed": weight, "head": weight.detach(), "row": weight[1]}
    pool = CopyPool()
    pool.begin()
    copied = snapshot(state, copy=True, pool=pool)
    weight.add_(1.0)
    assert torch.equal(copied["embed"] + 1.0, weight)
    assert copied["embed"].untyped_storage().data_ptr() == copied["head"].untyped_storage().data_ptr()
    assert copied["row"].storage_offset() == 3
    loaded = round_trip(copied)
    assert loaded["embed"].untyped_storage().data_ptr() == loaded["row"].untyped_storage().data_ptr()


def test_copy_pool_reuses_the_previous_snapshots_memory() -> None:
    state = {"w": torch.randn(256, 256)}
    pool = CopyPool()
    pool.begin()
    first = snapshot(state, copy=True, pool=pool)["w"].untyped_storage().data_ptr()
    pool.begin()
    assert snapshot(state, copy=True, pool=pool)["w"].untyped_storage().data_ptr() == first


def test_copy_pool_serves_the_first_snapshot_from_reserved_memory() -> None:
    state = {"w": torch.randn(256, 256), "b": torch.randn(3)}
    pool = CopyPool()
    pool.reserve([(256 * 256 * 4, False), (3 * 4, False)])
    reserved = {storage.data_ptr() for _, _, storage in pool._taken}
    pool.begin()
    copied = snapshot(state, copy=True, pool=pool)
    assert {t.untyped_storage().data_ptr() for t in copied.values()} == reserved
    assert torch.equal(copied["w"], state["w"])


@pytest.mark.parametrize(
    ("bad", "named"),
    [
        ({"x": np.float32(1.0)}, "numpy.float32"),
        ({"x": np.zeros(2)}, "numpy.ndarray"),
        ({"x": {1.5j: 1}}, None),
        ({(1, 2): 1}, "key"),
        ({"x": object()}, "builtins.object"),
        ({"x": b""}, "builtins.bytes"),
    ],
)
def test_snapshot_refuses_values_weights_only_loading_would_reject(bad: dict[Any, Any], named: str | None) -> None:
    pool = CopyPool()
    pool.begin()
    if named is None:  # complex keys are plain data: accepted
        assert same(round_trip(snapshot(bad, copy=True, pool=pool)), bad)
        return
    with pytest.raises(ConfigError, match=named):
        snapshot(bad, copy=False, pool=pool)


def test_captured_rng_restores_torch_numpy_and_python_streams() -> None:
    saved = round_trip(snapshot({"rng": capture_rng()}, copy=False, pool=CopyPool()))
    expected = (torch.rand(2), np.random.rand(), random.random(), np.random.randn())
    torch.manual_seed(1), np.random.seed(1), random.seed(1)
    restore_rng(saved, where="test")
    got = (torch.rand(2), np.random.rand(), random.random(), np.random.randn())
    assert torch.equal(got[0], expected[0]) and got[1:] == expected[1:]


def test_fallback_seed_is_deterministic_and_distinct_per_rank() -> None:
    seeds = [fallback_seed("abc", rank) for rank in range(8)]
    assert seeds == [fallback_seed("abc", rank) for rank in range(8)]
    assert len(set(seeds)) == 8 and all(0 <= s < 2**63 for s in seeds)
    assert fallback_seed("abd", 0) != seeds[0]
