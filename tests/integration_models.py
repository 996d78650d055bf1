"""Tiny models for the integration tests, at module level so that replay can import them again. The
LightningModule is lightning_training's, so that only the tests that fit one import Lightning (seconds).

They wrap the scenarios' regressor, whose log-features layer turns a near-zero reading into a finite loss
and an infinite gradient: the loss is NaN a step after the defective batch.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

import scenarios

DEFECT_STEP = 6


def batches(steps: int, batch_size: int = scenarios.BATCH, accumulate: int = 1,
            defect: bool = True) -> list[dict[str, Any]]:
    """``accumulate`` micro-batches per optimizer step; the defect in the last micro-batch of step DEFECT_STEP."""
    bad = (DEFECT_STEP + 1) * accumulate - 1 if defect else -1
    return [scenarios.make_batch(s, defect="near_zero" if s == bad else None, batch_size=batch_size)
            for s in range(steps * accumulate)]


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


class LabelsRegressor(torch.nn.Module):
    """Takes loss keyword arguments as Hugging Face models do: the Trainer then passes ``num_items_in_batch``, the
    labels of the whole optimizer step, and does not divide the loss by the number of micro-batches."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = scenarios.Regressor()

    def forward(self, x: torch.Tensor, labels: torch.Tensor, num_items_in_batch: Any = None,
                **kwargs: Any) -> dict[str, torch.Tensor]:
        errors = (self.net(x) - labels) ** 2
        return {"loss": errors.mean() if num_items_in_batch is None else errors.sum() / num_items_in_batch}


def build_labels_regressor() -> LabelsRegressor:
    return LabelsRegressor()


def accumulating_step(module: Any, optimizer: torch.optim.Optimizer, batch: dict[str, Any]) -> torch.Tensor:
    """A user's own step function for the Lightning callback: it gets each optimizer step's micro-batches."""
    for group, lr in zip(optimizer.param_groups, batch["lr"]):
        group["lr"] = lr
    optimizer.zero_grad()
    losses = []
    for micro in batch["micro_batches"]:
        loss = module.net_loss(micro["batch"]) / batch["accumulate"]
        loss.backward()
        losses.append(loss.detach())
    optimizer.step()
    return sum(losses[1:], losses[0])
