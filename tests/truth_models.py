"""Runs whose report is easy to get half right (issue 20): a NaN that waits many steps before a loss shows it, a
NaN made by the step function's own code after ``optimizer.step()``, a learning rate that spiked for one step, a
recurrent LM whose loss overflows a step before its state does, and gradient accumulation in a plain loop.

Each is a small real model trained under the project's recorder; every defect comes from the data, the optimizer's
settings or the user's own step function, never from a hook that writes a NaN.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn.functional as F
from nanforensics import Recorder
from torch import nn

VOCAB, DIM, USED = 16, 8, 8  # tokens 0..USED-1 appear in every batch; the others wait
LATE_ROW = 12  # a token no batch holds until ``late``
EMB_BATCH, EMB_LEN = 8, 4


class TokenRegressor(nn.Module):
    """The mean of a bag of token embeddings, read out by a linear head; ``padding_idx`` keeps row 0 at zero."""

    def __init__(self, padding_idx: int | None = None) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(VOCAB, DIM, padding_idx=padding_idx)
        self.head = nn.Linear(DIM, 1)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.emb(tokens).mean(dim=1)).squeeze(1)


def build_regressor(**kwargs: Any) -> nn.Module:
    return TokenRegressor(**kwargs)


def train_step_regress(model: nn.Module, optimizer: torch.optim.Optimizer, batch: dict[str, Any]) -> torch.Tensor:
    optimizer.zero_grad(set_to_none=True)
    loss = F.mse_loss(model(batch["tokens"]), batch["y"])
    loss.backward()
    optimizer.step()
    return loss


def train_step_renormalised(model: nn.Module, optimizer: torch.optim.Optimizer,
                            batch: dict[str, Any]) -> torch.Tensor:
    """After the update, the rows this batch looked up are put back to unit norm: the padding row's norm is 0."""
    loss = train_step_regress(model, optimizer, batch)
    with torch.no_grad():
        rows = batch["tokens"].unique()
        w = model.emb.weight
        w[rows] = w[rows] / w[rows].norm(dim=1, keepdim=True)
    return loss


def adamw_eps0(model: nn.Module) -> torch.optim.Optimizer:
    """eps=0: a row whose gradient is exactly zero gets the update 0/(sqrt(0)+0) = NaN."""
    return torch.optim.AdamW(model.parameters(), lr=1e-2, eps=0.0)


def adam(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.Adam(model.parameters(), lr=1e-2)


def token_batch(step: int, *, late: int | None = None, pad_from: int | None = None) -> dict[str, Any]:
    """Every one of tokens 0..USED-1 four times (1..USED-1 with ``pad_from``: 0 is the padding token); from step
    ``late`` on, one sample holds LATE_ROW; from step ``pad_from`` on, one sample is padded."""
    g = torch.Generator().manual_seed(step)
    first = 0 if pad_from is None else 1
    tokens = torch.arange(first, USED).repeat(EMB_BATCH * EMB_LEN // (USED - first) + 1)[:EMB_BATCH * EMB_LEN]
    tokens = tokens[torch.randperm(tokens.numel(), generator=g)].view(EMB_BATCH, EMB_LEN)
    if late is not None and step >= late:
        tokens[2, 1] = LATE_ROW
    if pad_from is not None and step >= pad_from:
        tokens[3, EMB_LEN - 1] = 0
    y = torch.randn(EMB_BATCH, generator=g)
    return {"tokens": tokens, "y": y, "ids": [f"s{step}-{i}" for i in range(EMB_BATCH)]}


# -- a learning rate that spiked for one step ---------------------------------------------------------------------

SPIKE_STEP = 12


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(8, 16), nn.LeakyReLU(0.1), nn.Linear(16, 16), nn.LeakyReLU(0.1),
                                 nn.Linear(16, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x).squeeze(1)


def build_mlp() -> nn.Module:
    return MLP()


def adam_mlp(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.Adam(model.parameters(), lr=0.05)


def spike_factor(step: int) -> float:
    """A warm-up written with a slip: one step's factor is 1e6."""
    return 1e6 if step == SPIKE_STEP else 1.0


def one_step_spike(optimizer: torch.optim.Optimizer) -> Any:
    return torch.optim.lr_scheduler.LambdaLR(optimizer, spike_factor)


def doubling(optimizer: torch.optim.Optimizer) -> Any:
    """An LR range test: the learning rate doubles every step, a rise with no spike."""
    return torch.optim.lr_scheduler.ExponentialLR(optimizer, gamma=2.0)


def train_step_scheduled(model: nn.Module, optimizer: torch.optim.Optimizer, batch: dict[str, Any], *,
                         scheduler: Any) -> torch.Tensor:
    optimizer.zero_grad(set_to_none=True)
    loss = F.mse_loss(model(batch["x"]), batch["y"])
    loss.backward()
    optimizer.step()
    scheduler.step()
    return loss


def regression_batch(step: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(step)
    x = torch.randn(8, 8, generator=g)
    return {"x": x, "y": x.sum(dim=1) + 0.1 * torch.randn(8, generator=g), "ids": list(range(8 * step, 8 * step + 8))}


# -- a recurrent LM whose loss overflows before its state does ------------------------------------------------

LM_VOCAB, LM_DIM, LM_LEN, LONG_LEN = 16, 16, 12, 219


class RecurrentLM(nn.Module):
    """A ReLU RNN whose recurrent weight starts at 1.5 times the identity (an IRNN initialised a little hot): on a
    short sequence the state stays small, on a long one it grows as 1.5**t."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(LM_VOCAB, LM_DIM)
        self.rnn = nn.RNN(LM_DIM, LM_DIM, batch_first=True, nonlinearity="relu")
        self.head = nn.Linear(LM_DIM, LM_VOCAB)
        with torch.no_grad():
            self.rnn.weight_hh_l0.copy_(torch.eye(LM_DIM) * 1.5)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h, _ = self.rnn(self.emb(tokens))
        return self.head(h)


def build_rnn_lm() -> nn.Module:
    return RecurrentLM()


def sgd_momentum(model: nn.Module) -> torch.optim.Optimizer:
    """No second moment: a gradient of 1e37 is finite state here, where Adam's square of it would not be."""
    return torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)


def train_step_lm(model: nn.Module, optimizer: torch.optim.Optimizer, batch: dict[str, Any]) -> torch.Tensor:
    optimizer.zero_grad(set_to_none=True)
    logits = model(batch["tokens"])
    loss = F.cross_entropy(logits[:, :-1].reshape(-1, LM_VOCAB), batch["labels"][:, 1:].reshape(-1),
                           ignore_index=-100)
    loss.backward()
    optimizer.step()
    return loss


def lm_batch(step: int, defect: str | None = None) -> dict[str, Any]:
    """``long``: one packed document of LONG_LEN tokens; ``no_labels``: every label -100."""
    g = torch.Generator().manual_seed(step)
    tokens = torch.randint(0, LM_VOCAB, (4, LONG_LEN if defect == "long" else LM_LEN), generator=g)
    labels = torch.full_like(tokens, -100) if defect == "no_labels" else tokens.clone()
    return {"tokens": tokens, "labels": labels}


# -- recording ------------------------------------------------------------------------------------------------

def record(path: Path, model: nn.Module, optimizer: torch.optim.Optimizer, step_fn: Callable[..., Any],
           batches: Callable[[int], dict[str, Any]], steps: int, *, factory: Callable[..., nn.Module],
           model_kwargs: dict[str, Any] | None = None, scheduler: Callable[..., Any] | None = None,
           checkpoint_every: int = 10) -> list[float]:
    """Train ``steps`` steps under the recorder, as a user's loop would; returns the logged losses."""
    sched = scheduler(optimizer) if scheduler is not None else None
    extras = {"scheduler": sched} if sched is not None else {}
    losses = []
    with Recorder(path, model, optimizer, model_factory=factory, model_kwargs=model_kwargs or {}, step_fn=step_fn,
                  checkpoint_every=checkpoint_every, scheduler=sched, scheduler_factory=scheduler) as rec:
        for step in range(steps):
            batch = batches(step)
            loss = step_fn(model, optimizer, batch, **extras)
            rec.log(step, batch, loss)
            losses.append(float(loss.detach()))
    return losses
