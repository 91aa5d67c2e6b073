"""accumulate(): no_sync on every micro-batch but the last."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import pytest
import torch

from elastictrain.train.accumulation import accumulate

pytestmark = pytest.mark.timeout(10)


class FakeDDP(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.syncing = True

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        self.syncing = False
        try:
            yield
        finally:
            self.syncing = True


@pytest.mark.parametrize("count", [1, 2, 5])
def test_only_the_last_micro_batch_synchronizes(count: int) -> None:
    model = FakeDDP()
    seen = [(item, model.syncing) for item in accumulate(model, range(count))]
    assert seen == [(i, i == count - 1) for i in range(count)]
    assert model.syncing


def test_a_zip_with_the_plan_first_pulls_no_extra_batch() -> None:
    batches = iter(range(10))
    list(accumulate(FakeDDP(), zip("abc", batches)))
    assert next(batches) == 3


def test_a_plain_module_and_an_empty_step_are_fine() -> None:
    assert list(accumulate(torch.nn.Linear(1, 1), [1, 2])) == [1, 2]
    assert list(accumulate(FakeDDP(), [])) == []
