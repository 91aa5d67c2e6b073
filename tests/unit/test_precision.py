"""MixedPrecision: the device defaults, autocast, and the GradScaler path (run on CPU)."""

from __future__ import annotations

import pytest
import torch

from elastictrain.errors import ConfigError
from elastictrain.train.precision import MixedPrecision, resolve_precision

pytestmark = pytest.mark.timeout(20)


def test_auto_is_fp32_on_cpu() -> None:
    assert resolve_precision("auto", torch.device("cpu")) == "fp32"
    assert not MixedPrecision("auto", "cpu").enabled


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_auto_is_bf16_or_fp16_on_gpu() -> None:
    expected = "bf16" if torch.cuda.is_bf16_supported() else "fp16"
    assert resolve_precision("auto", torch.device("cuda", 0)) == expected


def test_unknown_precision_is_refused() -> None:
    with pytest.raises(ConfigError, match="fp8"):
        MixedPrecision("fp8", "cpu")


def test_bf16_autocasts_matmuls_and_backward_reaches_fp32_parameters() -> None:
    amp = MixedPrecision("bf16", "cpu")
    model = torch.nn.Linear(4, 2)
    with amp.autocast():
        out = model(torch.randn(3, 4))
    assert out.dtype == torch.bfloat16
    amp.backward(out.float().pow(2).mean())
    assert model.weight.grad is not None and model.weight.grad.dtype == torch.float32


def test_clipping_happens_after_unscaling_so_max_norm_means_the_same_in_fp16() -> None:
    torch.manual_seed(0)
    x = torch.randn(8, 4)
    norms = {}
    for precision in ("fp32", "fp16"):
        torch.manual_seed(1)
        model = torch.nn.Linear(4, 1)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        amp = MixedPrecision(precision, "cpu")
        if amp.scaler is not None:
            amp.scaler = torch.amp.GradScaler("cpu", init_scale=2.0**4)  # no overflow on this tiny problem
        with amp.autocast():
            loss = model(x).float().pow(2).mean()
        amp.backward(loss)
        outcome = amp.step(optimizer, max_norm=0.01)
        assert not outcome.skipped
        norms[precision] = outcome.grad_norm
    assert norms["fp16"] == pytest.approx(norms["fp32"], rel=1e-2)  # fp16 forward: ~3 significant digits


def test_an_overflowing_fp16_step_is_skipped_and_the_scale_lowered() -> None:
    model = torch.nn.Linear(2, 1)
    before = model.weight.detach().clone()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    amp = MixedPrecision("fp16", "cpu")
    with amp.autocast():
        loss = model(torch.full((1, 2), 1e4)).float().sum()
    amp.backward(loss)  # 65536 * grad overflows float16
    scale = amp.scaler.get_scale()  # type: ignore[union-attr]
    outcome = amp.step(optimizer)
    assert outcome.skipped and amp.scaler.get_scale() < scale  # type: ignore[union-attr]
    assert torch.equal(model.weight, before)
