"""A tiny diffusion model (MLP denoiser, epsilon prediction) whose loss is weighted by 1/sigma_t^2 per timestep; the
data loader draws the timesteps, and one batch draws t = 0.

Defect: the cosine schedule's alpha_bar(0) is exactly 1.0 in float32, so sigma_0^2 = 1 - alpha_bar(0) = 0 and the
weight 1/sigma^2 is inf; the weighted loss is inf and its gradient inf. Expected report: origin at DEFECT_STEP in the
loss (the weighting's division), the sample with t = 0.
"""

from __future__ import annotations

import math
import sys

import recording
import torch
import torch.nn.functional as F
from torch import nn

DEFECT_STEP, AT_ZERO, T = 8, 5, 1000
ALPHA_BAR = torch.cos((torch.arange(T + 1, dtype=torch.float64) / T + 0.008) / 1.008 * math.pi / 2) ** 2
ALPHA_BAR = (ALPHA_BAR / ALPHA_BAR[0]).float()  # alpha_bar[0] == 1.0 exactly


class Denoiser(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(9, 64), nn.SiLU(), nn.Linear(64, 64), nn.SiLU(), nn.Linear(64, 8))

    def forward(self, x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        return self.net(torch.cat([x, (t.float() / T).unsqueeze(1)], dim=1))


def build_model() -> nn.Module:
    return Denoiser()


def train_step(model: nn.Module, optimizer: torch.optim.Optimizer, batch: dict) -> torch.Tensor:
    optimizer.zero_grad(set_to_none=True)
    t, x0, eps = batch["t"], batch["x0"], batch["noise"]
    ab = ALPHA_BAR[t].unsqueeze(1)
    xt = ab.sqrt() * x0 + (1 - ab).sqrt() * eps
    weight = 1.0 / (1 - ALPHA_BAR[t])                    # 1/sigma_t^2: inf at t = 0
    loss = (weight * F.mse_loss(model(xt, t), eps, reduction="none").mean(1)).mean()
    loss.backward()
    optimizer.step()
    return loss


def make_batch(step: int) -> dict:
    g = torch.Generator().manual_seed(step)
    t = torch.randint(1, T, (16,), generator=g)
    if step == DEFECT_STEP:
        t[AT_ZERO] = 0  # the sampler's range was [0, T)
    return {"x0": torch.randn(16, 8, generator=g), "noise": torch.randn(16, 8, generator=g), "t": t}


def record(path: str, steps: int = DEFECT_STEP + 3) -> None:
    recording.record(path, build_model, train_step, make_batch, steps)


if __name__ == "__main__":
    record(sys.argv[1])
