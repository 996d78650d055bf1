"""A PyTorch Lightning callback that records the run for replay and runs the post-mortem when the loss
goes non-finite. Needs ``pip install 'nanforensics[lightning]'``.

Replay rebuilds the LightningModule with ``model_factory(**model_kwargs)``: by default its own class
with the hyperparameters ``save_hyperparameters()`` stored, so the class must be importable
(module level) and those hyperparameters JSON data. It re-runs each step with ``step_fn``: by
default ``training_step`` below, which does what Lightning's automatic optimization does (your
``training_step``, backward, the Trainer's gradient clipping, ``optimizer.step()``) at the learning
rate the loop used, recorded with each batch. Manual optimization, several optimizers and gradient
accumulation need a ``step_fn`` of your own.
"""

from __future__ import annotations

from typing import Any

import torch

from ._watch import Watcher, clip, loss_of, lrs, set_lrs

try:
    import lightning.pytorch as pl
except ImportError as e:  # pragma: no cover - exercised only without the extra
    raise ImportError("nanforensics.integrations.lightning needs PyTorch Lightning: "
                      "pip install 'nanforensics[lightning]'") from e


def training_step(module: pl.LightningModule, optimizer: torch.optim.Optimizer, batch: dict[str, Any]) -> torch.Tensor:
    """One automatic-optimization step as Lightning runs it, from a batch recorded by ``NanForensicsCallback``."""
    set_lrs(optimizer, batch["lr"])
    optimizer.zero_grad(set_to_none=True)
    loss = loss_of(module.training_step(batch["batch"], batch["batch_idx"]))
    if loss is None:
        raise ValueError("training_step returned no loss")
    loss.backward()
    clip(optimizer, batch["clip_val"], batch["clip_algorithm"])
    optimizer.step()
    return loss


class NanForensicsCallback(Watcher, pl.Callback):
    """``Trainer(callbacks=[NanForensicsCallback("runs/exp1")])``; options as ``Watcher``'s."""

    default_step_fn = staticmethod(training_step)
    _step_batch: dict[str, Any] | None = None

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if len(trainer.optimizers) != 1:
            raise ValueError(f"NanForensicsCallback records one optimizer; this module has {len(trainer.optimizers)}")
        if trainer.accumulate_grad_batches != 1:
            raise ValueError("NanForensicsCallback records one batch per optimizer step: use accumulate_grad_batches=1 "
                             "or a step_fn of your own")
        if self.model_factory is None:
            self.start_recording(pl_module, trainer.optimizers[0], type(pl_module), dict(pl_module.hparams))
        else:
            self.start_recording(pl_module, trainer.optimizers[0], self.model_factory, self.model_kwargs)

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        self._step_batch = {"batch": batch, "batch_idx": batch_idx, "lr": lrs(trainer.optimizers[0]),
                            "clip_val": trainer.gradient_clip_val,
                            "clip_algorithm": str(trainer.gradient_clip_algorithm or "norm")}

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        loss = loss_of(outputs)
        if self._step_batch is not None and loss is not None and self.record_step(self._step_batch, loss):
            trainer.should_stop = True

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.close_recording()

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        self.close_recording()
