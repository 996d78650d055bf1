"""The one recording loop every script of this folder runs: the project's recorder, a checkpoint every 5 steps."""

from __future__ import annotations

from typing import Any, Callable

import nanforensics
import torch


def record(path: str, build_model: Callable[[], torch.nn.Module], train_step: Callable[..., torch.Tensor],
           make_batch: Callable[[int], Any], steps: int, optimizer_class: type = torch.optim.Adam,
           lr: float = 1e-3) -> None:
    model = build_model()
    optimizer = optimizer_class(model.parameters(), lr=lr)
    with nanforensics.Recorder(path, model, optimizer, model_factory=build_model, step_fn=train_step,
                               checkpoint_every=5) as rec:
        for step in range(steps):
            batch = make_batch(step)
            rec.log(step, batch, train_step(model, optimizer, batch))
