"""A training script that knows nothing of nanforensics, and the run it left behind: ``ckpts/``.

Readings of 16 sensors predict a target; the model takes the log of each reading times a learnable gain. The data
is a fixed table read 64 rows a step, so ``batch_at(step)`` gives the rows of any step again. A faulty converter
squashed one reading (row 1093, feature 3) to 3e-45: its log is a finite -103, but log's backward divides by it,
the gradient of the gain is -inf, and Adam writes it into both moments. The loop saves a checkpoint with
``torch.save`` at the top of every 10th step and, like many loops, trains on through the NaN.

    python sample_runs/unrecorded/train.py [OUT]    # trains, writing OUT (default: ckpts/ beside this file)

Diagnosed after the fact, from the checkpoints and this file's functions (its main block does not run):

    nanforensics replay --checkpoint sample_runs/unrecorded/ckpts/step_000010.pt --code sample_runs/unrecorded/train.py
    nanforensics bisect sample_runs/unrecorded/ckpts --code sample_runs/unrecorded/train.py
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

ROWS_PER_STEP, FEATURES, STEPS, SAVE_EVERY = 64, 16, 30, 10


def _table() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(2024)
    readings = torch.exp(0.5 * torch.randn(STEPS * ROWS_PER_STEP, FEATURES, generator=g))
    targets = torch.log(readings).mean(dim=1, keepdim=True) + 0.1 * torch.randn(STEPS * ROWS_PER_STEP, 1, generator=g)
    readings[1093, 3] = 3e-45  # the faulty conversion
    return readings, targets


READINGS, TARGETS = _table()


def batch_at(step: int) -> dict[str, Any]:
    """The rows of ``step``, and their row numbers."""
    rows = range(step * ROWS_PER_STEP, (step + 1) * ROWS_PER_STEP)
    return {"x": READINGS[rows.start:rows.stop], "y": TARGETS[rows.start:rows.stop], "row": list(rows)}


class SensorNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.gain = nn.Parameter(torch.zeros(FEATURES))
        self.mlp = nn.Sequential(nn.Linear(FEATURES, 32), nn.Tanh(), nn.Linear(32, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(torch.log(F.softplus(self.gain) * x))


def build_model() -> nn.Module:
    torch.manual_seed(0)
    return SensorNet()


def make_optimizer(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.Adam(model.parameters(), lr=1e-2)


def train_step(model: nn.Module, optimizer: torch.optim.Optimizer, batch: dict[str, Any]) -> torch.Tensor:
    optimizer.zero_grad(set_to_none=True)
    loss = F.mse_loss(model(batch["x"]), batch["y"])
    loss.backward()
    optimizer.step()
    return loss


def main(out: Path) -> None:
    model = build_model()
    optimizer = make_optimizer(model)
    out.mkdir(parents=True, exist_ok=True)
    for step in range(STEPS):
        if step % SAVE_EVERY == 0:
            torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "step": step},
                       out / f"step_{step:06d}.pt")
        loss = train_step(model, optimizer, batch_at(step))
        print(f"step {step:3d}  loss {loss.item():.4f}")


if __name__ == "__main__":
    main(Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).parent / "ckpts")
