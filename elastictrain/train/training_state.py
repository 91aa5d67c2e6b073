"""What a :class:`~elastictrain.train.session.Session` trains, and keeps through every generation
of its group: :class:`TrainingState`.

The model, optimizer, scheduler, GradScaler, sampler cursor, the user's extras and the
committed step outlive each group; a checkpoint writes them and a live peer's transfer
(:mod:`~elastictrain.train.state_transfer`) sends them, under the same names.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from elastictrain.checkpoint import RestoreInfo
from elastictrain.checkpoint import check_state, validate_state
from elastictrain.errors import ConfigError
from elastictrain.train.precision import MixedPrecision
from elastictrain.train.sampler import ElasticSampler

if TYPE_CHECKING:
    from elastictrain.train.strategy import ParallelStrategy

__all__ = ["TrainingState", "rank_seed", "seed_everything"]

RESERVED = ("model", "optimizer", "scheduler", "scaler", "sampler", "session")
"""The names of the state the session saves itself; ``extra_state`` may not use them."""

_PROGRESS_VERSION = 1


def rank_seed(seed: int, rank: int) -> int:
    """A seed of ``rank``'s own, from the run's ``seed``."""
    digest = hashlib.sha256(f"elastictrain-session:{seed}:{rank}".encode()).digest()
    return int.from_bytes(digest[:8], "big") >> 1  # < 2**63: every RNG accepts it


def seed_everything(seed: int) -> None:
    """Seed torch (every CUDA device too), ``random`` and numpy."""
    torch.manual_seed(seed)
    random.seed(seed)
    np.random.seed(seed % 2**32)


def _check_trains(model: torch.nn.Module, optimizer: Any) -> None:
    """Refuse an optimizer that would not train ``model``: training would change nothing,
    silently (an optimizer over another model's parameters, or a model with none to train)."""
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise ConfigError(f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
    trainable = {id(p) for p in model.parameters() if p.requires_grad}
    if not trainable:
        raise ConfigError("the model has no parameter that requires grad: there is nothing to train")
    if not any(id(p) in trainable for group in optimizer.param_groups for p in group["params"]):
        raise ConfigError("the optimizer updates none of the model's trainable parameters (was it built over "
                          "another model, or a copy of this one?): training would change nothing")


class TrainingState:
    """The state a session trains: checked once when the session is made.

    Attributes:
        module: The model, unwrapped.
        optimizer: Its optimizer.
        scheduler: The learning-rate scheduler, if any.
        extra: The user's extra state, by name.
        precision: The autocast/GradScaler helper (its scaler is state too).
        sampler: The elastic sampler, made once the world is known.
        step: The committed step: optimizer steps applied since the run began.
        saved_step: The step last checkpointed by this session, if any.
        restored: The checkpoint this session restored, if it restored one.

    Raises:
        ConfigError: The optimizer does not train the model, or ``extra_state`` uses a
            reserved name or holds what cannot be saved.
    """

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, scheduler: Any | None,
                 extra_state: Mapping[str, Any] | None) -> None:
        _check_trains(model, optimizer)
        extra = dict(extra_state or {})
        clash = sorted(set(extra) & set(RESERVED))
        if clash:
            raise ConfigError(f"extra_state names {clash} are reserved ({', '.join(RESERVED)})")
        # Now, not at the first save (checkpoint_every steps of training later).
        check_state(extra)
        for name, obj in extra.items():
            validate_state(obj if isinstance(obj, dict) else obj.state_dict(), where=f"extra_state[{name!r}]")
        self.module = model
        self.optimizer = optimizer
        self.scheduler = scheduler
        self.extra = extra
        self.precision = MixedPrecision("fp32")
        self.sampler: ElasticSampler | None = None
        self.step = 0
        self.saved_step: int | None = None
        self.restored: RestoreInfo | None = None
        # Saved as "session", updated in place by a restore or a transfer.
        self._progress: dict[str, int] = {"version": _PROGRESS_VERSION, "step": 0, "world_size": 1}

    def objects(self, world_size: int, strategy: ParallelStrategy) -> dict[str, Any]:
        """The state by name, as a checkpoint writes it and a peer sends it, recording the
        committed step and ``world_size`` in it; ``strategy`` names what stands for the model and
        the optimizer (:meth:`~elastictrain.train.strategy.ParallelStrategy.state_objects`)."""
        self._progress.update(step=self.step, world_size=world_size)
        model, optimizer = strategy.state_objects(self.module, self.optimizer)
        state: dict[str, Any] = {"model": model, "optimizer": optimizer, "sampler": self.sampler,
                                 "session": self._progress}
        if self.scheduler is not None:
            state["scheduler"] = self.scheduler
        if self.precision.scaler is not None:
            state["scaler"] = self.precision.scaler
        state.update(self.extra)
        return state
