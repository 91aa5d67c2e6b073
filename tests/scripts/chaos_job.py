"""Chaos test job: elastictrain's demo chaos job, with bugs that can be planted for tests.

Usage: the arguments of ``elastictrain/chaos/_demo_job.py``.

``CHAOS_JOB_BUG`` plants a bug in the worker, to show that the chaos
invariants catch it (test-only):

- ``resume_off_by_one``: a restored sampler resumes one sample early, so one
  sample is trained twice after every restore (a fault-free run is unaffected).
- ``stale_sampler_state``: checkpoints hold the sampler one step behind the
  model, so the step before each restored checkpoint is trained again.
- ``half_applied_step``: a step whose collective failed is applied on the ranks
  that got that far instead of being discarded.
- ``no_hang_deadline``: the worker never tells its agent how long it may stay in a step, so a
  hang detector that judges by progress never fires.
"""

from __future__ import annotations

import os

from elastictrain.chaos._demo_job import main
from elastictrain.train.sampler import ElasticSampler


def plant_bug(name: str | None) -> None:
    if not name:
        return
    if name == "resume_off_by_one":
        original_load = ElasticSampler.load_state_dict

        def load_state_dict(self: ElasticSampler, state: dict) -> None:  # type: ignore[type-arg]
            original_load(self, {**state, "cursor": max(0, int(state["cursor"]) - 1)})

        ElasticSampler.load_state_dict = load_state_dict  # type: ignore[method-assign]
    elif name == "stale_sampler_state":
        original_state = ElasticSampler.state_dict

        def state_dict(self: ElasticSampler) -> dict[str, int]:
            state = original_state(self)
            state["cursor"] = max(0, state["cursor"] - self.global_batch_size)
            return state

        ElasticSampler.state_dict = state_dict  # type: ignore[method-assign]
    elif name == "half_applied_step":
        _plant_half_applied_step()
    elif name == "no_hang_deadline":
        from elastictrain._control import Section
        from elastictrain.train.control import WorkerControl

        original_enter = WorkerControl.enter

        def enter(self: WorkerControl, section: int) -> float:
            return original_enter(self, Section.NONE)

        WorkerControl.enter = enter  # type: ignore[method-assign]
    else:
        raise SystemExit(f"unknown CHAOS_JOB_BUG {name!r}")


def _plant_half_applied_step() -> None:
    """A step whose collective failed is not discarded: the optimizer applies this rank's
    partial gradients (but the step is not counted)."""
    from elastictrain.train.step_loop import StepLoop

    original = StepLoop._finish

    def _finish(self, step):  # type: ignore[no-untyped-def]
        if step.failure is not None:
            self._state.optimizer.step()
        return original(self, step)

    StepLoop._finish = _finish  # type: ignore[method-assign]


if __name__ == "__main__":
    plant_bug(os.environ.get("CHAOS_JOB_BUG"))
    main()
