"""A Lightning fit written without nanforensics: ModelCheckpoint saves a ``.ckpt`` every 2 steps (the module's
``state_dict``, ``optimizer_states``, ``lr_schedulers``, ``global_step``, and the callbacks' bookkeeping).

The callables replay needs mirror Lightning's automatic optimization of ``RegressorModule`` (the LightningModule
of the integration tests, here so that only what fits one imports Lightning):
its Adam, its step-wise StepLR schedule, backward and step on each batch. The batches are the fit's, in order,
so ``batch_at(step)`` gives the batch of any step again (the defect at ``integration_models.DEFECT_STEP``).
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import torch
import torch.nn.functional as F

import integration_models as models
import scenarios


class RegressorModule(pl.LightningModule):
    """A LightningModule with a step-wise LR schedule: replay must follow it from the recorded batches."""

    def __init__(self, lr: float = 1e-2) -> None:
        super().__init__()
        self.save_hyperparameters()
        torch.manual_seed(0)
        self.net = scenarios.Regressor()

    def net_loss(self, batch: dict[str, Any]) -> torch.Tensor:
        return F.mse_loss(self.net(batch["x"]), batch["y"])

    def training_step(self, batch: dict[str, Any], batch_idx: int) -> torch.Tensor:
        loss = self.net_loss(batch)
        self.log("train_loss", loss)  # replayed outside a Trainer, where Lightning warns about it
        return loss

    def configure_optimizers(self) -> Any:
        opt = torch.optim.Adam(self.parameters(), lr=self.hparams.lr)
        schedule = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}


def build_model() -> torch.nn.Module:
    return RegressorModule()


def make_optimizer(module: Any) -> torch.optim.Optimizer:
    return torch.optim.Adam(module.parameters(), lr=module.hparams.lr)


def make_scheduler(optimizer: torch.optim.Optimizer) -> Any:
    return torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)


def train_step(module: Any, optimizer: torch.optim.Optimizer, batch: dict[str, Any], *,
               scheduler: Any = None) -> torch.Tensor:
    optimizer.zero_grad()
    loss = module.net_loss(batch)
    loss.backward()
    optimizer.step()
    if scheduler is not None:
        scheduler.step()
    return loss


def batch_at(step: int) -> dict[str, Any]:
    return scenarios.make_batch(step, defect="near_zero" if step == models.DEFECT_STEP else None,
                                batch_size=scenarios.BATCH)
