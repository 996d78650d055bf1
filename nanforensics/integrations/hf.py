"""A Hugging Face ``transformers.TrainerCallback`` that records the run for replay and runs the post-mortem
when the loss goes non-finite. Needs ``pip install 'nanforensics[hf]'``.

The Trainer hands callbacks neither the batch nor the loss, so the callback reads both off the model:
a forward pre-hook keeps the keyword arguments of each training forward (the batch, as the Trainer
passes it), a forward hook its loss. Replay rebuilds the model with ``model_factory(**model_kwargs)``
(an importable callable you pass) and re-runs each step with ``step_fn``: by default
``training_step`` below, which does what the Trainer does (forward, backward, clipping to
``max_grad_norm``, ``optimizer.step()``) at the learning rate the scheduler set, recorded with each
batch. Gradient accumulation needs a ``step_fn`` of your own.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

import torch

from ._watch import Watcher, clip, loss_of, lrs, set_lrs, unwrapped

try:
    from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments
except ImportError as e:  # pragma: no cover - exercised only without the extra
    raise ImportError("nanforensics.integrations.hf needs transformers: pip install 'nanforensics[hf]'") from e


def training_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, batch: dict[str, Any]) -> torch.Tensor:
    """One Trainer step, from a batch recorded by ``NanForensicsTrainerCallback``."""
    set_lrs(optimizer, batch["lr"])
    optimizer.zero_grad(set_to_none=True)
    loss = loss_of(model(**batch["inputs"]))
    if loss is None:
        raise ValueError("the model returned no loss (pass labels in the batch)")
    loss.backward()
    clip(optimizer, batch["max_grad_norm"])
    optimizer.step()
    return loss


class NanForensicsTrainerCallback(Watcher, TrainerCallback):
    """``Trainer(..., callbacks=[NanForensicsTrainerCallback("runs/exp1", model_factory=build_model)])``;
    other options as ``Watcher``'s."""

    default_step_fn = staticmethod(training_step)

    def __init__(self, run_dir: str | Path, *, model_factory: Callable[..., torch.nn.Module], **options: Any) -> None:
        super().__init__(run_dir, model_factory=model_factory, **options)
        self._hooks: list[Any] = []
        self._inputs: dict[str, Any] | None = None
        self._loss: torch.Tensor | None = None

    def on_train_begin(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                       model: torch.nn.Module | None = None, optimizer: torch.optim.Optimizer | None = None,
                       **kwargs: Any) -> None:
        if model is None or optimizer is None:
            raise ValueError("NanForensicsTrainerCallback needs the Trainer's model and optimizer")
        if args.gradient_accumulation_steps != 1:
            raise ValueError("NanForensicsTrainerCallback records one batch per optimizer step: use "
                             "gradient_accumulation_steps=1 or a step_fn of your own")
        self._optimizer = unwrapped(optimizer)
        self._max_grad_norm = args.max_grad_norm
        self._hooks = [model.register_forward_pre_hook(self._keep_inputs, with_kwargs=True),
                       model.register_forward_hook(self._keep_loss)]
        assert self.model_factory is not None
        self.start_recording(model, self._optimizer, self.model_factory, self.model_kwargs)

    def _keep_inputs(self, model: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        if model.training and torch.is_grad_enabled():
            if args:
                raise ValueError("the Trainer passed positional inputs; NanForensicsTrainerCallback records keyword "
                                 "inputs only")
            self._inputs = {"inputs": dict(kwargs), "lr": lrs(self._optimizer), "max_grad_norm": self._max_grad_norm}

    def _keep_loss(self, model: torch.nn.Module, args: Any, output: Any) -> None:
        if model.training and torch.is_grad_enabled():
            self._loss = loss_of(output)

    def on_step_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                    **kwargs: Any) -> None:
        if self._inputs is not None and self._loss is not None and self.record_step(self._inputs, self._loss):
            control.should_training_stop = True
        self._inputs, self._loss = None, None

    def on_train_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                     **kwargs: Any) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks.clear()
        self.close_recording()
