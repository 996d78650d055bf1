"""A Hugging Face Trainer run written without nanforensics: the Trainer saves ``checkpoint-N`` folders every
``save_steps`` steps (model.safetensors, optimizer.pt, scheduler.pt, rng_state.pth, trainer_state.json, whose
log history holds the loss of every step).

Its data is a stream read in order, 16 samples a step, so ``batch_at(step)`` gives the batch of any step again; a
near-zero reading at step DEFECT_STEP makes the gradient infinite. The callables replay needs mirror what the
Trainer does: AdamW with its two parameter groups, the linear warm-up schedule, clipping to norm 1. Replay imports
this file for them; the main block, which trains, runs only as a script:

    python tests/hf_training.py OUT
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, Iterator

import torch
import transformers

import integration_models as models
import scenarios

STEPS, SAVE_STEPS, BATCH, WARMUP, LR = 12, 4, 16, 2, 1e-2
build_model = models.build_trainer_regressor


def batch_at(step: int) -> dict[str, Any]:
    return scenarios.make_batch(step, defect="near_zero" if step == models.DEFECT_STEP else None, batch_size=BATCH)


def make_optimizer(model: torch.nn.Module) -> torch.optim.Optimizer:
    """The Trainer's AdamW: weight decay for every parameter but the biases, in two groups."""
    named = list(model.named_parameters())
    return torch.optim.AdamW([{"params": [p for n, p in named if not n.endswith("bias")]},
                              {"params": [p for n, p in named if n.endswith("bias")], "weight_decay": 0.0}], lr=LR)


def make_scheduler(optimizer: torch.optim.Optimizer) -> Any:
    return transformers.get_linear_schedule_with_warmup(optimizer, WARMUP, STEPS)


def train_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, batch: dict[str, Any], *,
               scheduler: Any = None) -> torch.Tensor:
    """The Trainer's step: backward, clip to norm 1, optimizer and schedule (when there is one)."""
    optimizer.zero_grad(set_to_none=True)
    loss = model(batch["x"], batch["y"])["loss"]
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    if scheduler is not None:
        scheduler.step()
    return loss


class Stream(torch.utils.data.IterableDataset):
    """The samples in order, as a token file read at offsets would give them."""

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        for step in range(STEPS):
            batch = batch_at(step)
            for x, y in zip(batch["x"], batch["y"]):
                yield {"x": x, "y": y}


def main(out: Path) -> None:
    args = transformers.TrainingArguments(
        output_dir=str(out), per_device_train_batch_size=BATCH, max_steps=STEPS, learning_rate=LR,
        warmup_steps=WARMUP, use_cpu=True, report_to=[], save_strategy="steps", save_steps=SAVE_STEPS,
        logging_steps=1, disable_tqdm=True, optim="adamw_torch", seed=0)
    transformers.Trainer(model=build_model(), args=args, train_dataset=Stream()).train()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
