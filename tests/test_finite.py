"""The fast finiteness checks are exact: no false clean (NaN, +inf, -inf anywhere, in every dtype), and no false
positive where finite values overflow a sum (float32 or bfloat16 near their largest value, float16 activations).
The monitor gives the same verdict whether it reads each check at once (CPU) or keeps them on the device until
the step ends (an accelerator; ``defer=True`` runs that path here)."""

from __future__ import annotations

import math

import pytest
import torch
from nanforensics import finite
from nanforensics.replay.monitor import StepMonitor
from torch import nn

FLOATS = [torch.float32, torch.float64, torch.float16, torch.bfloat16]
FP8 = [d for d in (getattr(torch, "float8_e4m3fn", None), getattr(torch, "float8_e5m2", None)) if d is not None]


def _filled(dtype: torch.dtype, n: int = 3000) -> torch.Tensor:
    """Finite values whose sum overflows: half of them at the dtype's largest value, the rest at its negative
    largest but fewer, so no cancellation saves the sum."""
    top = torch.finfo(dtype).max
    t = torch.full((n,), top, dtype=torch.float64)
    t[: n // 3] = -top
    return t.to(dtype)


@pytest.mark.parametrize("dtype", FLOATS + FP8, ids=str)
def test_finite_values_near_the_limit_are_finite(dtype):
    t = _filled(dtype)
    if dtype.itemsize > 1:
        assert not math.isfinite(float(t.double().sum().to(dtype))) or dtype == torch.float64
    assert finite.is_finite(t)
    assert finite.min_max_verdicts([finite.min_max(t)]) == [True]
    assert finite.locate(t) is None and finite.count_nonfinite(t) == 0


@pytest.mark.parametrize("dtype", FLOATS + [torch.complex64], ids=str)
@pytest.mark.parametrize("bad", ["nan", "inf", "-inf", "inf and -inf"])
@pytest.mark.parametrize("where", [0, 1234, 2999])
def test_every_non_finite_value_is_found(dtype, bad, where):
    t = torch.linspace(-1, 1, 3000).to(dtype)
    values = {"nan": [math.nan], "inf": [math.inf], "-inf": [-math.inf], "inf and -inf": [math.inf, -math.inf]}[bad]
    for offset, v in enumerate(values):
        t[(where + offset * 7) % 3000] = v
    assert not finite.is_finite(t)
    assert finite.min_max_verdicts([finite.min_max(t)]) == [False]
    located = finite.locate(t)
    assert located is not None and located.index == [min((where + o * 7) % 3000 for o in range(len(values)))]


@pytest.mark.parametrize("dtype", FP8, ids=str)
def test_fp8_non_finite(dtype):
    t = torch.zeros(64).to(dtype)
    t[5] = math.nan  # e4m3fn has no inf: NaN is its only non-finite value
    assert not finite.is_finite(t)
    assert finite.min_max_verdicts([finite.min_max(t)]) == [False]


def test_verdicts_of_mixed_dtypes_keep_each_value_exact():
    """One stack over float64 extremes beyond float32's range and float16 ones must not read either as inf."""
    pairs = [finite.min_max(torch.tensor([1e300, -1e300], dtype=torch.float64)),
             finite.min_max(torch.tensor([65504.0], dtype=torch.float16)),
             finite.min_max(torch.tensor([-math.inf], dtype=torch.bfloat16)),
             finite.min_max(torch.tensor([3e38], dtype=torch.float32))]
    assert finite.min_max_verdicts(pairs) == [True, True, False, True]


# ---- the monitor, both ways --------------------------------------------------------------------------------


class _MaskedFill(nn.Module):
    """Writes -inf where the mask says, as an attention mask does."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mask = torch.zeros_like(x, dtype=torch.bool)
        mask[0, 1] = True
        return x.masked_fill(mask, -math.inf)


class _Clamp(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.clamp(min=-5.0)


class _Net(nn.Module):
    """A Linear, then an -inf that the next module absorbs (clamp): loss, gradients and state stay finite.
    ``spare`` is a parameter no step touches, for values near the dtype's limit."""

    def __init__(self, absorb: bool, dtype: torch.dtype) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4).to(dtype)
        self.mask, self.clamp = (_MaskedFill(), _Clamp()) if absorb else (nn.Identity(), nn.Identity())
        self.spare = nn.Parameter(_filled(dtype, 300))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.clamp(self.mask(self.lin(x)))


def _step(model: nn.Module, optimizer: torch.optim.Optimizer, x: torch.Tensor, scale: float) -> torch.Tensor:
    optimizer.zero_grad(set_to_none=True)
    loss = (model(x).float() * scale).sum()
    loss.backward()
    optimizer.step()
    return loss


def _stages(defer: bool, locate: bool, *, absorb: bool = False, scale: float = 1.0, dtype: torch.dtype = torch.float32,
            x: torch.Tensor | None = None) -> list[tuple[str, str]]:
    torch.manual_seed(0)
    model = _Net(absorb, dtype)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    x = torch.ones(2, 4, dtype=dtype) if x is None else x
    with StepMonitor(model, optimizer, defer=defer) as monitor:
        monitor.begin(0, {"x": x}, locate)
        loss = _step(model, optimizer, x, scale)
        return [(e.stage, e.tensor) for e in monitor.end(loss)]


@pytest.mark.parametrize("defer", [False, True], ids=["at-once", "deferred"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_clean_step_near_the_limit_is_clean(defer, dtype):
    assert _stages(defer, False, dtype=dtype) == []


@pytest.mark.parametrize("defer", [False, True], ids=["at-once", "deferred"])
def test_an_absorbed_activation_is_flagged(defer):
    """The -inf never reaches the loss, a gradient or the state: only checking every module's output sees it."""
    assert _stages(defer, False, absorb=True) == [("forward", "mask")]
    assert _stages(defer, True, absorb=True) == [("forward", "mask")]


@pytest.mark.parametrize("defer", [False, True], ids=["at-once", "deferred"])
def test_state_overflow_alone_is_flagged(defer):
    """A finite gradient of 1e30 squares past float32 in Adam's v; m/sqrt(v) = 0 keeps the parameters finite."""
    assert _stages(defer, False, scale=1e30) == [("optimizer_state", "lin.weight")]


@pytest.mark.parametrize("defer", [False, True], ids=["at-once", "deferred"])
def test_minus_inf_in_the_batch(defer):
    x = torch.ones(2, 4)
    x[1, 2] = -math.inf
    stages = [s for s, _ in _stages(defer, False, x=x)]
    assert stages[0] == "batch"
