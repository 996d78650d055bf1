"""Tiny models for the integration tests, at module level so that replay can import them again.

Both wrap the scenarios' regressor, whose log-features layer turns a near-zero reading into a finite loss
and an infinite gradient: the loss is NaN a step after the defective batch.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

import scenarios

DEFECT_STEP = 6


def batches(steps: int, batch_size: int = scenarios.BATCH) -> list[dict[str, Any]]:
    return [scenarios.make_batch(s, defect="near_zero" if s == DEFECT_STEP else None, batch_size=batch_size)
            for s in range(steps)]


class TrainerRegressor(torch.nn.Module):
    """What a Hugging Face Trainer trains: keyword inputs in, ``{"loss": ...}`` out."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = scenarios.Regressor()

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"loss": F.mse_loss(self.net(x), y)}


def build_trainer_regressor() -> TrainerRegressor:
    return TrainerRegressor()


try:
    import lightning.pytorch as pl
except ImportError:
    pl = None

if pl is not None:
    class RegressorModule(pl.LightningModule):
        """A LightningModule with a step-wise LR schedule: replay must follow it from the recorded batches."""

        def __init__(self, lr: float = 1e-2) -> None:
            super().__init__()
            self.save_hyperparameters()
            torch.manual_seed(0)
            self.net = scenarios.Regressor()

        def training_step(self, batch: dict[str, Any], batch_idx: int) -> torch.Tensor:
            return F.mse_loss(self.net(batch["x"]), batch["y"])

        def configure_optimizers(self) -> Any:
            opt = torch.optim.Adam(self.parameters(), lr=self.hparams.lr)
            schedule = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
            return {"optimizer": opt, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}
