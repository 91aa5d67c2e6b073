"""Mixed precision: autocast for the forward pass, a GradScaler where fp16 needs one, clipping after unscale.

Precisions:

- ``"fp32"``: no autocast.
- ``"bf16"``: autocast to bfloat16. On GPU the usual choice; on CPU it helps
  only on CPUs with native bf16 (AVX-512 BF16/AMX), so it is never the default there.
- ``"fp16"``: autocast to float16 with a ``torch.amp.GradScaler``: float16
  gradients underflow without loss scaling. The scaler's state is part of the
  checkpoint. Meant for GPUs; on a CPU it runs (slowly), which lets the
  scaler's path be tested anywhere.
- ``"auto"`` (default): bf16 on a GPU that supports it, else fp16 on GPU;
  fp32 on CPU and other devices.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch

from elastictrain.errors import ConfigError

__all__ = ["PRECISIONS", "MixedPrecision", "OptimizerStep", "resolve_precision"]

PRECISIONS = ("auto", "fp32", "bf16", "fp16")
_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def resolve_precision(precision: str, device: torch.device) -> str:
    """``precision`` with ``"auto"`` replaced by this device's default.

    Raises:
        ConfigError: Unknown precision.
    """
    if precision not in PRECISIONS:
        raise ConfigError(f"precision must be one of {PRECISIONS}, got {precision!r}")
    if precision == "auto":
        if device.type != "cuda":
            return "fp32"
        return "bf16" if torch.cuda.is_bf16_supported() else "fp16"
    return precision


@dataclass(frozen=True, slots=True)
class OptimizerStep:
    """What :meth:`MixedPrecision.step` did."""

    grad_norm: float | None
    """Total gradient norm before clipping (after unscaling); None without clipping."""

    skipped: bool
    """True if the GradScaler found inf/NaN gradients and skipped the update (then lowered its scale)."""


class MixedPrecision:
    """Autocast, loss scaling and the optimizer step for one device.

    Piecemeal use::

        amp = MixedPrecision("auto", device)
        with amp.autocast():
            loss = loss_fn(model(x), y)
        amp.backward(loss)
        amp.step(optimizer, model.parameters(), max_norm=1.0)

    Args:
        precision: One of :data:`PRECISIONS`.
        device: Where the model runs.

    Raises:
        ConfigError: See :func:`resolve_precision`.
    """

    def __init__(self, precision: str = "auto", device: torch.device | str = "cpu") -> None:
        self.device = torch.device(device)
        self.precision = resolve_precision(precision, self.device)
        self.dtype: torch.dtype | None = _DTYPES.get(self.precision)
        self.scaler: torch.amp.GradScaler | None = (
            torch.amp.GradScaler(self.device.type) if self.precision == "fp16" else None
        )

    @property
    def enabled(self) -> bool:
        """True unless fp32."""
        return self.dtype is not None

    def autocast(self) -> contextlib.AbstractContextManager[Any]:
        """A context for the forward pass (and the loss): autocast, or nothing in fp32."""
        if self.dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.dtype)

    def backward(self, loss: torch.Tensor) -> None:
        """``loss.backward()``, scaled by the GradScaler in fp16, with autocast off (as torch advises)."""
        if self.scaler is not None:
            loss = self.scaler.scale(loss)
        if self.dtype is None:
            loss.backward()
            return
        with torch.autocast(self.device.type, enabled=False):
            loss.backward()

    def step(self, optimizer: torch.optim.Optimizer, parameters: Iterable[torch.Tensor] | None = None,
             *, max_norm: float | None = None,
             clip: Callable[[list[torch.Tensor], float], torch.Tensor] | None = None) -> OptimizerStep:
        """Unscale (fp16), clip to ``max_norm`` and step the optimizer; update the scaler.

        Clipping happens after unscaling, so ``max_norm`` means the same in
        every precision.

        Args:
            optimizer: The optimizer.
            parameters: What to clip; default every parameter of ``optimizer``.
            max_norm: Clip the total gradient 2-norm to this; None: no clipping.
            clip: Clips ``parameters``' gradients to a norm and returns the norm before (a
                sharded model's is global over its shards); default ``clip_grad_norm_``.
        """
        norm: float | None = None
        if max_norm is not None:
            if self.scaler is not None:
                self.scaler.unscale_(optimizer)
            params = list(parameters) if parameters is not None else [
                p for group in optimizer.param_groups for p in group["params"]]
            norm = float((clip or torch.nn.utils.clip_grad_norm_)(params, max_norm))
        if self.scaler is None:
            optimizer.step()
            return OptimizerStep(norm, skipped=False)
        before = self.scaler.get_scale()
        self.scaler.step(optimizer)
        self.scaler.update()
        return OptimizerStep(norm, skipped=self.scaler.get_scale() < before)
