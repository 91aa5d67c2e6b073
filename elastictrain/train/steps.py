"""One optimizer step of a :class:`~elastictrain.train.session.Session`'s loop (:class:`~elastictrain.train.step_loop.StepLoop`), and its micro-batches.

A :class:`Step` hands out its micro-batches (each but the last without gradient
synchronization, the strategy's ``no_sync()``, and inside autocast); :meth:`MicroStep.backward` runs one backward. Under
in-process recovery a backward whose gradient all-reduce fails (a peer died) does
not raise into the training loop: the step is marked failed, its remaining
micro-batches are not handed out, and the session re-forms the group and plans the
step again at the new world size. So does a collective of the forward that the strategy
swallowed (a sharded model's all-gather, see ``ParallelStrategy.swallowing``): the
micro-batch's forward runs to its end on garbage, no backward runs, and the step is discarded
after it; one that fails inside :meth:`MicroStep.backward` stops that backward there
(``ParallelStrategy.abandoning``).
"""

from __future__ import annotations

import collections
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from elastictrain._control import Section
from elastictrain.train.accumulation import accumulate_with
from elastictrain.errors import ConfigError, SessionError
from elastictrain.train.sampler import ElasticBatchSampler, ElasticSampler, MicroBatch, StepPlan
from elastictrain.train.recovery import is_collective_failure

if TYPE_CHECKING:
    from elastictrain.train.step_loop import StepLoop

__all__ = ["END", "MicroStep", "PlanFeed", "Step", "to_device"]


def to_device(obj: Any, device: torch.device, non_blocking: bool) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.to(device, non_blocking=non_blocking)
    if isinstance(obj, dict):
        return type(obj)((k, to_device(v, device, non_blocking)) for k, v in obj.items())
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):  # namedtuple
        return type(obj)(*(to_device(v, device, non_blocking) for v in obj))
    if isinstance(obj, (list, tuple)):
        return type(obj)(to_device(v, device, non_blocking) for v in obj)
    return obj



END = object()


class PlanFeed(ElasticBatchSampler):
    """``ElasticBatchSampler`` that also queues each plan for the session, so it is computed once.

    The DataLoader pulls index lists from it (ahead of time with workers); the
    plan of a step is queued before its first micro-batch is handed out, so it
    is there once the session has fetched that micro-batch.
    """

    def __init__(self, sampler: ElasticSampler) -> None:
        super().__init__(sampler, pad_empty=True)
        self.plans: collections.deque[StepPlan] = collections.deque()

    def __iter__(self) -> Iterator[list[int]]:
        """See base class."""
        for plan in self.sampler.iter_steps():
            self.plans.append(plan)
            for micro in plan.micro_batches:
                yield list(micro.indices) if micro.indices else [plan.pad_index]


class MicroStep:
    """One micro-batch of a step on this rank: its data (on the device) and how to weight its loss.

    Attributes:
        batch: The collated micro-batch, already on the session's device.
        index: Position in the step, from 0.
        is_last: True for the micro-batch whose backward all-reduces the gradients.
        loss_scale: What :meth:`backward` multiplies the loss by (see :class:`~elastictrain.train.sampler.MicroBatch`).
        weight: This micro-batch's share of the global batch, ``len / step_size``.
        is_padding: True when this rank's share was empty and ``batch`` is a stand-in
            sample whose loss counts for nothing (``loss_scale == 0``).
    """

    __slots__ = ("_step", "batch", "index", "is_last", "is_padding", "loss_scale", "weight", "_micro")

    def __init__(self, step: Step, micro: MicroBatch, batch: Any, index: int, is_last: bool) -> None:
        self._step, self._micro = step, micro
        self.batch, self.index, self.is_last = batch, index, is_last
        self.loss_scale, self.weight = micro.loss_scale, micro.weight
        self.is_padding = not micro.indices

    @property
    def indices(self) -> tuple[int, ...]:
        """Dataset indices of this micro-batch (empty when padding)."""
        return self._micro.indices

    def backward(self, loss: torch.Tensor) -> None:
        """Backpropagate this micro-batch's *mean* loss, scaled for the global batch.

        Multiplies by :attr:`loss_scale` (and the GradScaler's scale in fp16) and
        runs backward outside autocast. Call it once per micro-batch.

        Raises:
            ConfigError: ``loss`` is not a scalar tensor.
        """
        if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
            raise ConfigError("backward() takes the micro-batch's mean loss, a scalar tensor")
        # A scale of exactly 1 (even shares, one micro-batch) needs no extra op in the graph.
        scaled = loss if self.loss_scale == 1.0 else loss * self.loss_scale
        loop = self._step._loop
        if self.is_last:
            loop.reach_collective()
        try:
            # A collective of its forward failed (a sharded unit's all-gather): the loss is garbage and
            # the step is discarded below; its backward would cost a step's compute for nothing, on the
            # recovery's path (the peers wait for this rank to re-form) and on cores a replacement shares.
            # One that fails in the backward stops it there (the strategy's abandoning(), raising a
            # collective failure): the rest of it would be as wasted.
            if loop.swallowed() is None:
                with loop.collective(), loop.abandoning():  # the gradients' all-reduce
                    loop.precision.backward(scaled)
        except Exception as exc:
            if loop.recovers_in_process and is_collective_failure(exc):
                # Discarded; the session re-forms the group and plans it again. The failure the
                # strategy recorded is the cause (an abandoned backward raised after it).
                self._step.fail(loop.swallowed() or exc)
                return
            raise
        finally:
            if self.is_last:
                loop.enter(Section.BETWEEN)  # the script's code until it asks for the next step
        swallowed = loop.swallowed()  # a collective of its forward or backward failed: garbage
        if swallowed is not None:
            self._step.fail(swallowed)
            return
        self._step._record(self, loss)


class Step:
    """One optimizer step: iterate over it to get its :class:`MicroStep` s.

    Each micro-batch but the last runs without gradient synchronization (DDP's
    ``no_sync()``) and all of them inside autocast; the optimizer step, sampler commit, hooks and
    checkpointing happen when the session's ``steps()`` loop moves on.

    Attributes:
        number: This step's number, from 1 (the first step of the run).
        epoch: The epoch it belongs to.
        plan: This rank's :class:`~elastictrain.train.sampler.StepPlan`.
        loss: The step's mean loss once it is applied, if hooks, logging or
            ``sync_loss`` asked for it (see ``SessionConfig.sync_loss``); else None.
    """

    def __init__(self, loop: StepLoop, plan: StepPlan, batches: Iterator[Any], number: int) -> None:
        self._loop, self._batches = loop, batches
        self.plan, self.number, self.epoch = plan, number, plan.epoch
        self._iterated = False
        self._done = 0  # micro-batches whose backward ran
        self._last_backward = False
        self._losses: list[tuple[torch.Tensor, float]] = []  # (detached mean loss, weight); summed only if needed
        self.loss: float | None = None
        self.failure: BaseException | None = None
        """The collective failure that discarded this step (in-process recovery), if one did."""

    def fail(self, error: BaseException) -> None:
        """Discard this step: a collective failed; no further micro-batch is handed out."""
        self.failure = error

    @property
    def discarded(self) -> bool:
        """True when a collective failed during this step (in-process recovery): it is not
        applied, and runs again once the group has re-formed. Code in the loop body after
        the micro-batches still runs for it: check this before recording anything about
        the step (or use the ``on_step_end`` hook, which runs only for applied steps)."""
        return self.failure is not None

    def __len__(self) -> int:
        """Micro-batches in this step (the same on every rank)."""
        return len(self.plan.micro_batches)

    @property
    def step_size(self) -> int:
        """Samples this step consumes over all ranks."""
        return self.plan.step_size

    def __iter__(self) -> Iterator[MicroStep]:
        """The micro-batches, each with its gradient sync and autocast context active while it is current."""
        if self._iterated:
            raise SessionError(f"step {self.number}'s micro-batches can be iterated only once")
        self._iterated = True
        loop = self._loop
        loop.inject(self.number)
        count = len(self.plan.micro_batches)
        for index, micro in enumerate(accumulate_with(loop.no_sync, self.plan.micro_batches)):
            if self.failure is not None:
                return
            try:
                batch = next(self._batches)
            except StopIteration:
                raise SessionError(f"the DataLoader ran out in step {self.number}") from None
            failed = loop.before_forward()
            if failed is not None:
                self.fail(failed)  # discarded before its forward: nothing of it ran
                return
            loop.count_forwards()
            with loop.precision.autocast(), loop.swallowing():
                yield MicroStep(self, micro, loop.to_device(batch), index, index == count - 1)
            swallowed = loop.swallowed()
            if swallowed is not None:
                self.fail(swallowed)  # it ran on garbage: discarded, no further micro-batch
                return
            if self.failure is None and index == count - 1 and loop.wrapped and loop.forwards == 0:
                raise SessionError(
                    f"step {self.number}: the last micro-batch ran no forward pass through session.model, "
                    "so its gradients were not synchronized; call session.model, not the unwrapped module"
                )

    def mean_loss(self, *, sync: bool, all_reduce: bool, group: Any = None) -> float:
        """The step's mean loss: this rank's, or with ``sync`` the global batch's (summed over
        the ranks by an all-reduce over ``group`` when ``all_reduce``)."""
        # sum(weight * mean loss) over this rank's micro-batches is its share of
        # the global-batch mean; over all ranks it is the global-batch mean.
        total = torch.zeros((), device=self._loop.device, dtype=torch.float64)
        for loss, weight in self._losses:
            total += loss.double() * weight
        if sync:
            if all_reduce:
                dist.all_reduce(total, group=group)
            return float(total)
        weight = sum(w for _, w in self._losses)
        return float(total) / weight if weight else float("nan")

    def _record(self, micro: MicroStep, loss: torch.Tensor) -> None:
        self._done += 1
        if micro.is_last:
            self._last_backward = True
        if micro.weight:
            self._losses.append((loss.detach(), micro.weight))

    def _check_complete(self) -> None:
        if not self._last_backward:
            raise SessionError(
                f"step {self.number}: {self._done} of {len(self)} micro-batches ran backward(); iterate over "
                "every micro-batch of a step and call micro.backward(loss) (the last one synchronizes gradients)"
            )


