"""The model and step function the shipped sample runs were trained with (their manifests name this file): the code
replay imports, shipped beside the runs, so an installed nanforensics replays them outside a checkout with
``--code-path sample_runs/code``. tests/scenarios.py builds its failure scenarios on the same model.

The model log-transforms positive features with a learnable per-feature gain, ``log(softplus(gain) * x)``:
autograd's log backward divides by its input, so a near-zero reading such as 3e-45 gives a finite loss and an
infinite gradient in exactly one coordinate of ``features.gain``.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

N_FEATURES = 16


class LogFeatures(nn.Module):
    def __init__(self, n_features: int, masked: bool = False) -> None:
        super().__init__()
        self.gain = nn.Parameter(torch.zeros(n_features))
        self.masked = masked

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        u = F.softplus(self.gain) * x
        if self.masked:  # zero readings mean "absent": the classic masked branch, whose gradient is still 0/0
            return torch.where(u > 0, torch.log(u), torch.zeros_like(u))
        return torch.log(u)


class ExpLink(nn.Module):
    """The exp link of a Poisson regression: overflows past 88.7 in fp32."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.exp(x)


class SquaredReLU(nn.Module):
    """relu(x)**2, the activation of Primer: squares magnitudes, so overflow comes twice as fast."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(x) ** 2


class Regressor(nn.Module):
    def __init__(self, n_features: int = N_FEATURES, hidden: int = 32, log_features: bool = True,
                 poisson: bool = False, act: str = "tanh", masked_log: bool = False, batchnorm: bool = False,
                 dtype: str = "float32") -> None:
        super().__init__()
        self.features: nn.Module = LogFeatures(n_features, masked_log) if log_features else nn.Identity()
        self.fc1 = nn.Linear(n_features, hidden)
        self.norm: nn.Module = nn.BatchNorm1d(hidden) if batchnorm else nn.Identity()
        self.act = {"tanh": nn.Tanh, "relu": nn.ReLU, "relu2": SquaredReLU}[act]()
        self.fc2 = nn.Linear(hidden, hidden)
        self.head = nn.Linear(hidden, 1)
        self.link: nn.Module = ExpLink() if poisson else nn.Identity()
        self.to(getattr(torch, dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.act(self.norm(self.fc1(self.features(x))))
        return self.link(self.head(self.act(self.fc2(h))))


def build_model(**kwargs: Any) -> nn.Module:
    torch.manual_seed(0)
    return Regressor(**kwargs)


def train_step(model: nn.Module, optimizer: torch.optim.Optimizer, batch: dict[str, Any]) -> torch.Tensor:
    optimizer.zero_grad(set_to_none=True)
    loss = F.mse_loss(model(batch["x"]), batch["y"])
    loss.backward()
    optimizer.step()
    return loss
