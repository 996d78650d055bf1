"""A PyTorch Lightning callback that records the run for replay and runs the post-mortem when the loss
goes non-finite. Needs ``pip install 'nanforensics[lightning]'``.

Replay rebuilds the LightningModule with ``model_factory(**model_kwargs)``: by default its own class
with the hyperparameters ``save_hyperparameters()`` stored, so the class must be importable
(module level) and those hyperparameters JSON data. Each optimizer step is recorded as one batch
holding its micro-batches (one, or ``accumulate_grad_batches`` of them under gradient accumulation)
and re-run with ``step_fn``: by default ``training_step`` below, which does what Lightning's automatic
optimization does, at the learning rate the loop used, recorded with each step. Manual optimization
and several optimizers need a ``step_fn`` of your own.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch

from ..runs.batches import MICRO_BATCHES
from ._watch import NonFiniteLoss, Watcher, clip, loss_of, lrs, micro_batch_total, set_lrs

try:
    import lightning.pytorch as pl
except ImportError as e:  # pragma: no cover - exercised only without the extra
    raise ImportError("nanforensics.integrations.lightning needs PyTorch Lightning: "
                      "pip install 'nanforensics[lightning]'") from e

__all__ = ["NanForensicsCallback", "NonFiniteLoss", "training_step"]

# What LightningModule.log says when the module is not attached to a Trainer, as in replay: nothing is wrong.
_UNATTACHED_LOG = r"You are trying to `self\.log\(\)` but the `self\.trainer` reference is not registered"


def training_step(module: pl.LightningModule, optimizer: torch.optim.Optimizer, batch: dict[str, Any]) -> torch.Tensor:
    """One optimizer step as automatic optimization runs it, from a step recorded by ``NanForensicsCallback``:
    for each micro-batch your ``training_step``, its loss divided by ``accumulate_grad_batches`` (as Lightning
    divides it, also in a shorter last window of an epoch), backward; then the Trainer's gradient clipping and
    ``optimizer.step()``. Returns the step's loss: the divided micro-batch losses added up."""
    set_lrs(optimizer, batch["lr"])
    optimizer.zero_grad(set_to_none=True)
    losses = []
    for micro in batch[MICRO_BATCHES]:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=_UNATTACHED_LOG)
            loss = loss_of(module.training_step(micro["batch"], micro["batch_idx"]))
        if loss is None:
            raise ValueError("training_step returned no loss")
        loss = loss / batch["accumulate"]
        loss.backward()
        losses.append(loss)
    clip(optimizer, batch["clip_val"], batch["clip_algorithm"])
    optimizer.step()
    return micro_batch_total(losses)


class NanForensicsCallback(Watcher, pl.Callback):
    """``Trainer(callbacks=[NanForensicsCallback("runs/exp1")])``; options as ``Watcher``'s."""

    default_step_fn = staticmethod(training_step)
    _step: dict[str, Any] | None = None  # the optimizer step being accumulated
    _losses: list[torch.Tensor]
    _steps_before = 0  # trainer.global_step when it began

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if len(trainer.optimizers) != 1:
            raise ValueError(f"NanForensicsCallback records one optimizer; this module has {len(trainer.optimizers)}")
        if self.model_factory is None:
            self.start_recording(pl_module, trainer.optimizers[0], type(pl_module), dict(pl_module.hparams))
        else:
            self.start_recording(pl_module, trainer.optimizers[0], self.model_factory, self.model_kwargs)

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        if self._step is None:  # the first micro-batch of an optimizer step
            self._step = {MICRO_BATCHES: [], "accumulate": trainer.accumulate_grad_batches,
                          "lr": lrs(trainer.optimizers[0]), "clip_val": trainer.gradient_clip_val,
                          "clip_algorithm": str(trainer.gradient_clip_algorithm or "norm")}
            self._losses, self._steps_before = [], trainer.global_step
        self._step[MICRO_BATCHES].append({"batch": batch, "batch_idx": batch_idx})

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if self._step is None:
            return
        loss = loss_of(outputs)  # already divided by accumulate_grad_batches
        if loss is None:  # training_step returned None: Lightning ran no backward for it
            self._step[MICRO_BATCHES].pop()
        else:
            self._losses.append(loss)
        if trainer.global_step == self._steps_before:
            return  # accumulating: the optimizer has not stepped yet
        step, losses, self._step = self._step, self._losses, None
        if losses and self.record_step(step, micro_batch_total(losses)):
            trainer.should_stop = True

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.close_recording()

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        self.close_recording()
