"""A training script written without nanforensics, for resumes: the seed scenario's model under AdamW with two param
groups (weights decayed, biases and gains not), its data without defects, and ``torch.save`` checkpoints of the
state before a step. Replay imports it for its callables (``--code tests/resume_training.py``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

import scenarios

build_model = scenarios.build_model
train_step = scenarios.train_step


def batch_at(step: int) -> dict[str, Any]:
    return scenarios.make_batch(step, 0)


def make_optimizer(model: torch.nn.Module) -> torch.optim.Optimizer:
    """Two groups, as language-model recipes build them: decay for matrices only."""
    decay = [p for p in model.parameters() if p.dim() >= 2]
    rest = [p for p in model.parameters() if p.dim() < 2]
    return torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}],
                             lr=1e-2)


def train(steps: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """The model and optimizer after ``steps`` steps: their state dicts are the checkpoint of step ``steps``."""
    model = build_model()
    optimizer = make_optimizer(model)
    for step in range(steps):
        train_step(model, optimizer, batch_at(step))
    return model, optimizer


def save(path: Path, model: torch.nn.Module, optimizer_state: dict[str, Any], step: int) -> Path:
    torch.save({"model": model.state_dict(), "optimizer": optimizer_state, "step": step}, path)
    return path
