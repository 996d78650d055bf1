"""A Hugging Face ``transformers.TrainerCallback`` that records the run for replay and runs the post-mortem
when the loss goes non-finite. Needs ``pip install 'nanforensics[hf]'``.

The Trainer hands callbacks neither the batch nor the loss, so the callback reads both off the model:
a forward pre-hook keeps the keyword arguments of each training forward (each micro-batch, as the
Trainer passes it, with ``num_items_in_batch`` when the model takes loss keyword arguments), a forward
hook its loss. Each optimizer step is recorded as one batch holding its micro-batches. Replay rebuilds
the model with ``model_factory(**model_kwargs)`` (an importable callable you pass) and re-runs each
step with ``step_fn``: by default ``training_step`` below, which does what the Trainer does at the
learning rate the scheduler set, recorded with each step. A ``compute_loss`` of your own (or
``compute_loss_func``) needs a ``step_fn`` of your own: the loss the model returns is then not the one
the Trainer trains on.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

import torch

from ..runs.batches import MICRO_BATCHES
from ._watch import NonFiniteLoss, Watcher, clip, loss_of, lrs, micro_batch_total, set_lrs, unwrapped

try:
    from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments
except ImportError as e:  # pragma: no cover - exercised only without the extra
    raise ImportError("nanforensics.integrations.hf needs transformers: pip install 'nanforensics[hf]'") from e

__all__ = ["NanForensicsTrainerCallback", "NonFiniteLoss", "training_step"]


def _scaled(loss: torch.Tensor, divisor: int | None) -> torch.Tensor:
    return loss if divisor is None else loss / divisor


def training_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, batch: dict[str, Any]) -> torch.Tensor:
    """One Trainer optimizer step, from a step recorded by ``NanForensicsTrainerCallback``: for each micro-batch
    forward, the loss divided by the number of micro-batches (``loss_divisor``; None where the model already
    normalised it by ``num_items_in_batch``, which the Trainer then leaves alone), backward; then clipping to
    ``max_grad_norm`` and ``optimizer.step()``. Returns the step's loss: the scaled micro-batch losses added up."""
    set_lrs(optimizer, batch["lr"])
    optimizer.zero_grad(set_to_none=True)
    losses = []
    for inputs in batch[MICRO_BATCHES]:
        loss = loss_of(model(**inputs))
        if loss is None:
            raise ValueError("the model returned no loss (pass labels in the batch)")
        loss = _scaled(loss, batch["loss_divisor"])
        loss.backward()
        losses.append(loss)
    clip(optimizer, batch["max_grad_norm"])
    optimizer.step()
    return micro_batch_total(losses)


class NanForensicsTrainerCallback(Watcher, TrainerCallback):
    """``Trainer(..., callbacks=[NanForensicsTrainerCallback("runs/exp1", model_factory=build_model)])``;
    other options as ``Watcher``'s."""

    default_step_fn = staticmethod(training_step)

    def __init__(self, run_dir: str | Path, *, model_factory: Callable[..., torch.nn.Module], **options: Any) -> None:
        super().__init__(run_dir, model_factory=model_factory, **options)
        self._hooks: list[Any] = []
        self._micro: list[dict[str, Any]] = []  # the keyword inputs of the optimizer step's micro-batches so far
        self._losses: list[torch.Tensor] = []
        self._lr: list[float] = []

    def on_train_begin(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                       model: torch.nn.Module | None = None, optimizer: torch.optim.Optimizer | None = None,
                       **kwargs: Any) -> None:
        if model is None or optimizer is None:
            raise ValueError("NanForensicsTrainerCallback needs the Trainer's model and optimizer")
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
            if not self._micro:  # the scheduler steps after optimizer.step(): one rate for all micro-batches
                self._lr = lrs(self._optimizer)
            self._micro.append(dict(kwargs))

    def _keep_loss(self, model: torch.nn.Module, args: Any, output: Any) -> None:
        if model.training and torch.is_grad_enabled():
            loss = loss_of(output)
            if loss is not None:
                self._losses.append(loss.detach())

    def on_step_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                    **kwargs: Any) -> None:
        micro, losses, self._micro, self._losses = self._micro, self._losses, [], []
        if not micro or len(losses) != len(micro):
            return
        # The Trainer divides each micro-batch's loss by their number unless the model normalised it over the
        # whole step's items (it was given num_items_in_batch).
        divisor = None if any("num_items_in_batch" in m for m in micro) else len(micro)
        step = {MICRO_BATCHES: micro, "loss_divisor": divisor, "lr": self._lr, "max_grad_norm": self._max_grad_norm}
        try:
            stop = self.record_step(step, micro_batch_total([_scaled(loss, divisor) for loss in losses]))
        except NonFiniteLoss:
            self._remove_hooks()
            raise
        if stop:
            control.should_training_stop = True

    def on_train_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                     **kwargs: Any) -> None:
        self._remove_hooks()
        self.close_recording()

    def _remove_hooks(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks.clear()
