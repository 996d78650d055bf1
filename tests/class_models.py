"""Training programs of the kinds issue 31 found the replay could not handle, each a small real model the recorder
records: per-sample gradients through ``torch.func`` (DP-SGD), sparse embedding gradients with ``SparseAdam`` (a
recommender), a batch that carries per-batch tensors beside its per-sample rows (a label mask, class weights), and a
Poisson regression whose clipping spreads a NaN gradient into every parameter. Every defect comes from the data
through the real forward and backward, never from a hook.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn.functional as F
from nanforensics import Recorder
from torch import nn
from torch.func import functional_call, grad_and_value, vmap

import scenarios

DEFECT_STEP, STEPS, BATCH = 6, 8, 8
BAD_SAMPLE, BAD_FEATURE = 3, 2  # DP-SGD: the reading of 0 that log turns into -inf
BAD_USER_SAMPLE = 5  # the recommender: the sample whose exposure is 3e-45
CLASSES = 5


# -- per-sample gradients through torch.func (DP-SGD) ---------------------------------------------------------

class LogMLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.fc1, self.fc2 = nn.Linear(8, 16), nn.Linear(16, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.tanh(self.fc1(torch.log(x)))).squeeze(-1)


def build_log_mlp() -> nn.Module:
    return LogMLP()


def train_step_dpsgd(model: nn.Module, optimizer: torch.optim.Optimizer, batch: dict[str, Any]) -> torch.Tensor:
    """DP-SGD's step: per-sample gradients by ``vmap(grad_and_value(...))`` over ``functional_call``, each clipped to
    norm 1, averaged into ``p.grad``. The model's forward hooks run inside the transforms, on vmap's tensors."""
    params = {k: v.detach() for k, v in model.named_parameters()}

    def loss_one(p: dict[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(functional_call(model, p, (x[None],)), y[None])

    grads, losses = vmap(grad_and_value(loss_one), in_dims=(None, 0, 0))(params, batch["x"], batch["y"])
    optimizer.zero_grad(set_to_none=True)
    for name, p in model.named_parameters():
        g = grads[name]
        scale = (1.0 / (g.reshape(g.shape[0], -1).norm(dim=1) + 1e-6)).clamp(max=1.0)
        p.grad = (g * scale.view(-1, *[1] * (g.ndim - 1))).mean(0)
    optimizer.step()
    return losses.mean()


def dpsgd_batch(step: int) -> dict[str, Any]:
    """Positive readings; at DEFECT_STEP one of them is 0, and log makes it -inf inside the vmap."""
    g = torch.Generator().manual_seed(step)
    x = torch.exp(torch.randn(BATCH, 8, generator=g))
    if step == DEFECT_STEP:
        x[BAD_SAMPLE, BAD_FEATURE] = 0.0
    return {"x": x, "y": torch.randn(BATCH, generator=g), "ids": [f"s{step}-{i}" for i in range(BATCH)]}


# -- sparse embedding gradients with SparseAdam (a recommender) --------------------------------------------------

class Recommender(nn.Module):
    """User and item embeddings with sparse gradients; the user's vector is log-scaled by the exposure, so a reading
    of 3e-45 gives a finite loss and an infinite gradient in the user's row (log's backward divides by it)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.users, self.items = nn.Embedding(50, 8, sparse=True), nn.Embedding(40, 8, sparse=True)

    def forward(self, user: torch.Tensor, item: torch.Tensor, exposure: torch.Tensor) -> torch.Tensor:
        return (torch.log(F.softplus(self.users(user)) * exposure[:, None]) * self.items(item)).sum(-1)


def build_recommender() -> nn.Module:
    return Recommender()


def sparse_adam(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SparseAdam(list(model.parameters()), lr=0.01)


def train_step_recommend(model: nn.Module, optimizer: torch.optim.Optimizer, batch: dict[str, Any]) -> torch.Tensor:
    optimizer.zero_grad(set_to_none=True)
    loss = F.mse_loss(model(batch["user"], batch["item"], batch["exposure"]), batch["rating"])
    loss.backward()
    optimizer.step()
    return loss


def rating_batch(step: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(step)
    exposure = torch.rand(BATCH, generator=g) + 0.5
    if step == DEFECT_STEP:
        exposure[BAD_USER_SAMPLE] = 3e-45
    return {"user": torch.randint(0, 50, (BATCH,), generator=g), "item": torch.randint(0, 40, (BATCH,), generator=g),
            "exposure": exposure, "rating": torch.randn(BATCH, generator=g),
            "ids": [f"r{step}-{i}" for i in range(BATCH)]}


# -- per-batch tensors beside per-sample rows -----------------------------------------------------------------

class Classifier(nn.Module):
    def __init__(self, classes: int = CLASSES) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


def build_classifier(**kwargs: Any) -> nn.Module:
    return Classifier(**kwargs)


def adam(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.Adam(model.parameters(), lr=0.01)


def train_step_weighted(model: nn.Module, optimizer: torch.optim.Optimizer, batch: dict[str, Any]) -> torch.Tensor:
    """Cross-entropy over the labels the batch's mask allows, weighted per class: both are per-batch tensors of
    CLASSES entries beside the batch's BATCH rows."""
    optimizer.zero_grad(set_to_none=True)
    logits = model(batch["x"]).masked_fill(~batch["label_mask"], float("-inf"))
    loss = F.cross_entropy(logits, batch["y"], weight=batch["class_weight"])
    loss.backward()
    optimizer.step()
    return loss


def train_step_weighted_named(model: nn.Module, optimizer: torch.optim.Optimizer, batch: dict[str, Any]) -> torch.Tensor:
    """``train_step_weighted``, its per-batch tensors named: with as many classes as samples, their shape cannot
    tell them from rows."""
    return train_step_weighted(model, optimizer, batch)


train_step_weighted_named.nanforensics_whole = ["batch['label_mask']", "batch['class_weight']"]  # type: ignore[attr-defined]


def class_batch(step: int, defect: str | None = None, classes: int = CLASSES) -> dict[str, Any]:
    """``weights``: the class weights all 0 (a weighted mean over no weight, 0/0); ``rows``: a feature of every
    sample missing (NaN), a defect of the rows."""
    g = torch.Generator().manual_seed(step)
    x = torch.randn(BATCH, 6, generator=g)
    y = torch.randint(0, classes - 1, (BATCH,), generator=g)
    mask = torch.ones(classes, dtype=torch.bool)
    mask[classes - 1] = step % 2 == 0  # the last class, which no sample holds, allowed every other step
    weight = 1.0 / (torch.bincount(y, minlength=classes).float() + 1.0)
    if step == DEFECT_STEP and defect == "weights":
        weight.zero_()
    elif step == DEFECT_STEP and defect == "rows":
        x[:, 0] = float("nan")
    return {"x": x, "y": y, "label_mask": mask, "class_weight": weight, "ids": [f"c{step}-{i}" for i in range(BATCH)]}


# -- a Poisson regression whose clipping spreads a NaN ------------------------------------------------------------

def build_poisson() -> nn.Module:
    """The shipped regressor with an exp link and log features whose zero readings are masked out (``torch.where``):
    a reading of 3e-45 gives an -inf gradient, a reading of 0 a NaN one (the masked log's backward is 0/0)."""
    return scenarios.build_model(poisson=True, masked_log=True)


class _ClipFirst:
    """The optimizer as a clipping loop's step function drives it: ``step()`` clips the gradients to total norm 1,
    then steps. ``scenarios.train_step_poisson`` given it is that loop's step, clip_grad_norm_ between backward and
    ``optimizer.step()``, without a copy of the step."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        self.model, self.optimizer = model, optimizer

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def step(self) -> None:
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), max_norm=1.0)
        self.optimizer.step()


def train_step_poisson_clipped(model: nn.Module, optimizer: torch.optim.Optimizer, batch: dict[str, Any]) -> torch.Tensor:
    return scenarios.train_step_poisson(model, _ClipFirst(model, optimizer), batch)  # type: ignore[arg-type]


def count_batch(step: int) -> dict[str, Any]:
    """Counts drawn around the shipped regressor's targets; at DEFECT_STEP one sample reads 3e-45 and 0."""
    b = scenarios.make_batch(step, defect="near_zero" if step == DEFECT_STEP else None)
    b["y"] = torch.poisson(b["y"], generator=torch.Generator().manual_seed(step))
    if step == DEFECT_STEP:
        b["x"][scenarios.DEFECT_SAMPLE, 7] = 0.0
    return b


# -- recording ------------------------------------------------------------------------------------------------

def record(path: Path, factory: Callable[..., nn.Module], optimizer: Callable[[nn.Module], torch.optim.Optimizer],
           step_fn: Callable[..., torch.Tensor], batches: Callable[[int], dict[str, Any]], steps: int = STEPS,
           model_kwargs: dict[str, Any] | None = None) -> Path:
    """Train ``steps`` steps under the recorder, as a user's loop would."""
    model = factory(**(model_kwargs or {}))
    opt = optimizer(model)
    with Recorder(path, model, opt, model_factory=factory, model_kwargs=model_kwargs or {}, step_fn=step_fn,
                  checkpoint_every=5) as rec:
        for step in range(steps):
            batch = batches(step)
            rec.log(step, batch, step_fn(model, opt, batch))
    return path
