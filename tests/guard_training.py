"""Guarded training loops with a known answer, for tests/test_guard.py (module level, so replay can import them).

A tiny transformer regresses a target from a sequence of float features; three rare bad batches each hold one bad
sample: an infinite input, a label that overflows the loss's gradient, a huge value. ``train`` runs the same loop
guarded, or unguarded with ``optimizer.step()`` simply not called at the steps given.
"""

from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator

import nanforensics
import torch
import torch.nn.functional as F
from torch import nn

FEATURES, WIDTH, SEQ, BATCH = 4, 8, 6, 8
BAD_SAMPLE = 5
DEFECTS = {137: "inf_input", 290: "overflowing_label", 444: "huge_value"}


class TinyTransformer(nn.Module):
    def __init__(self, eps: float = 1e-8) -> None:
        super().__init__()
        self.embed = nn.Linear(FEATURES, WIDTH)
        self.block = nn.TransformerEncoderLayer(WIDTH, nhead=2, dim_feedforward=16, dropout=0.0, batch_first=True)
        self.head = nn.Linear(WIDTH, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.block(self.embed(x)).mean(dim=1))


def build_model() -> nn.Module:
    torch.manual_seed(0)
    return TinyTransformer()


def train_step(model: nn.Module, optimizer: torch.optim.Optimizer, batch: dict[str, Any]) -> torch.Tensor:
    optimizer.zero_grad(set_to_none=True)
    loss = (model(batch["x"]) - batch["y"]).pow(2).mean()
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    return loss


def make_batch(step: int, defects: dict[int, str] = DEFECTS) -> dict[str, Any]:
    g = torch.Generator().manual_seed(step)
    x = torch.randn(BATCH, SEQ, FEATURES, generator=g)
    y = x.mean(dim=(1, 2)).unsqueeze(1)
    defect = defects.get(step)
    if defect == "inf_input":
        x[BAD_SAMPLE, 2, 1] = float("inf")
    elif defect == "overflowing_label":
        y[BAD_SAMPLE, 0] = 3e38          # the square overflows the loss, and 2 * (prediction - label) its gradient
    elif defect == "huge_value":
        x[BAD_SAMPLE, 3, 0] = 1e38        # finite, but the layer norm's variance of it is not
    return {"x": x, "y": y, "ids": [f"s{step:04d}-{i}" for i in range(BATCH)]}


@contextmanager
def stepping(optimizer: torch.optim.Optimizer, step: bool) -> Iterator[None]:
    """The reference loop's skip: ``optimizer.step()`` not called inside unless ``step``."""
    real = optimizer.step
    if not step:
        optimizer.step = lambda *a, **k: None  # type: ignore[method-assign]
    try:
        yield
    finally:
        optimizer.step = real  # type: ignore[method-assign]


def loop(rec: nanforensics.Recorder | None, model: nn.Module, optimizer: torch.optim.Optimizer,
         step_fn: Callable[..., torch.Tensor], batches: Iterable[tuple[int, dict[str, Any]]],
         skip: tuple[int, ...] = ()) -> None:
    """Each batch through ``step_fn``, logged to ``rec`` (None: unrecorded, ``optimizer.step()`` not called at
    ``skip``), then ``rec`` closed."""
    for step, batch in batches:
        with stepping(optimizer, step not in skip):
            loss = step_fn(model, optimizer, batch)
        if rec is not None:
            rec.log(step, batch, loss)
    if rec is not None:
        rec.close()


def mlp_step(model: nn.Module, optimizer: torch.optim.Optimizer, batch: dict[str, Any]) -> torch.Tensor:
    """A plain regression step, no clipping: a huge finite gradient reaches the optimizer as it is."""
    optimizer.zero_grad(set_to_none=True)
    loss = (model(batch["x"]) - batch["y"]).pow(2).mean()
    loss.backward()
    optimizer.step()
    return loss


def make_optimizer(model: nn.Module, eps: float = 1e-8, fused: bool = False) -> torch.optim.Optimizer:
    return torch.optim.Adam(model.parameters(), lr=1e-3, eps=eps, fused=fused or None)


def train(run_dir: Path | None, steps: int, *, skip: tuple[int, ...] = (), fused: bool = False,
          defects: dict[int, str] = DEFECTS, **options: Any) -> nn.Module:
    """The loop: guarded when ``run_dir`` is given, else unguarded with ``optimizer.step()`` not called at ``skip``."""
    model = build_model()
    optimizer = make_optimizer(model, fused=fused)
    rec = None
    if run_dir is not None:
        rec = nanforensics.Recorder(run_dir, model, optimizer, model_factory=build_model, step_fn=train_step,
                                    guard=True, **options)
    loop(rec, model, optimizer, train_step, ((step, make_batch(step, defects)) for step in range(steps)), skip)
    return model


def zero_grad_step(model: nn.Module, optimizer: torch.optim.Optimizer, batch: dict[str, Any]) -> torch.Tensor:
    """A step whose update makes the NaN from finite gradients: the head's bias is frozen (no gradient, so Adam keeps
    no state for it) until the batch says ``thaw``; then its first gradient is exactly zero, and Adam with eps=0
    divides 0 by sqrt(0)."""
    optimizer.zero_grad(set_to_none=True)
    loss = F.mse_loss(model(batch["x"]), batch["y"])
    loss.backward()
    if batch["thaw"]:
        model.head.bias.grad.zero_()
    else:
        model.head.bias.grad = None
    optimizer.step()
    return loss


def build_adam_eps0(model: nn.Module) -> torch.optim.Optimizer:
    """Adam with eps=0 for the head's bias alone (attention's key bias has an exactly zero gradient at every step)."""
    rest = [p for n, p in model.named_parameters() if n != "head.bias"]
    return torch.optim.Adam([{"params": rest}, {"params": [model.head.bias], "eps": 0.0}], lr=1e-3)


THAW = 23  # the step whose update makes the NaN in train_update_nan


def train_update_nan(run_dir: Path | None, steps: int, guard: Any = True, skip: tuple[int, ...] = (),
                     **options: Any) -> nn.Module:
    """Adam with eps=0; the head's bias first gets a gradient, exactly zero, at step THAW: no gradient is non-finite,
    the update is (0/0). Unguarded without ``run_dir``, ``optimizer.step()`` not called at ``skip``."""
    model = build_model()
    optimizer = build_adam_eps0(model)
    rec = nanforensics.Recorder(run_dir, model, optimizer, model_factory=build_model, step_fn=zero_grad_step,
                                optimizer_factory=build_adam_eps0, guard=guard, **options) if run_dir else None
    loop(rec, model, optimizer, zero_grad_step,
         ((step, {**make_batch(step, {}), "thaw": step == THAW}) for step in range(steps)), skip)
    return model


def flip_step(model: nn.Module, optimizer: torch.optim.Optimizer, batch: dict[str, Any]) -> torch.Tensor:
    """A step followed by code that writes a NaN into a parameter at the step the batch says (a bit flip, a buggy
    hook): nothing before ``optimizer.step()`` shows it, so no skip can prevent it."""
    loss = train_step(model, optimizer, batch)
    if batch["flip"]:
        with torch.no_grad():
            model.head.bias.mul_(float("nan"))
    return loss


def train_flip(run_dir: Path, steps: int, guard: Any = True, at: int = THAW, **options: Any) -> nn.Module:
    """A NaN written after the step ``at`` (THAW): found by the state check, the run stopped (or rolled back)."""
    model = build_model()
    optimizer = make_optimizer(model)
    with nanforensics.Recorder(run_dir, model, optimizer, model_factory=build_model, step_fn=flip_step,
                               guard=guard, **options) as rec:
        for step in range(steps):
            batch = {**make_batch(step, {}), "flip": step == at}
            rec.log(step, batch, flip_step(model, optimizer, batch))
    return model
