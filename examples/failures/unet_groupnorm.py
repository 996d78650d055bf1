"""A small U-Net with GroupNorm(eps=0) trained to denoise 16x16 images; one frame of the data is blank (all zeros).

Defect: GroupNorm with eps=0 normalises by 1/sqrt(var); a blank frame makes the first convolution's output (no bias,
as usual before a norm) all zeros, var = 0, and (x - mean) * rsqrt(var) = 0 * inf = NaN in the forward.
Expected report: origin forward at DEFECT_STEP in module down1's GroupNorm, samples: the blank frame.
"""

from __future__ import annotations

import sys

import recording
import torch
import torch.nn.functional as F
from torch import nn

DEFECT_STEP, BLANK = 8, 3


def block(cin: int, cout: int) -> nn.Module:
    return nn.Sequential(nn.Conv2d(cin, cout, 3, padding=1, bias=False), nn.GroupNorm(4, cout, eps=0.0), nn.SiLU())


class UNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.down1, self.down2 = block(1, 8), block(8, 16)
        self.up = nn.ConvTranspose2d(16, 8, 2, stride=2)
        self.out = nn.Sequential(block(16, 8), nn.Conv2d(8, 1, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a = self.down1(x)
        b = self.down2(F.avg_pool2d(a, 2))
        return self.out(torch.cat([a, self.up(b)], dim=1))


def build_model() -> nn.Module:
    return UNet()


def train_step(model: nn.Module, optimizer: torch.optim.Optimizer, batch: dict) -> torch.Tensor:
    optimizer.zero_grad(set_to_none=True)
    loss = F.mse_loss(model(batch["noisy"]), batch["clean"])
    loss.backward()
    optimizer.step()
    return loss


def make_batch(step: int) -> dict:
    g = torch.Generator().manual_seed(step)
    clean = torch.rand(8, 1, 16, 16, generator=g)
    noise = 0.1 * torch.randn(clean.shape, generator=g)
    if step == DEFECT_STEP:  # a frame the loader could not decode: blank, and no noise added to it
        clean[BLANK], noise[BLANK] = 0.0, 0.0
    return {"noisy": clean + noise, "clean": clean, "file": [f"frame_{step:03d}_{i}.png" for i in range(8)]}


def record(path: str, steps: int = DEFECT_STEP + 3) -> None:
    recording.record(path, build_model, train_step, make_batch, steps, torch.optim.AdamW, 1e-3)


if __name__ == "__main__":
    record(sys.argv[1])
