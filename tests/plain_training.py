"""A training script written without nanforensics, saving checkpoints the way users do: ``torch.save`` of the model's
and the optimizer's state dicts and the step, every few steps, at the top of the step (the state before it).

It trains the seed scenario of ``scenarios`` (a near-zero reading at step DEFECT_STEP, whose log's backward is
-inf), with batches from a function seeded by the step, so the same run recorded by the recorder is its twin.
Replay imports it for its callables; the main block, which trains, runs only as a script:

    python tests/plain_training.py OUT [--steps N] [--every N] [--named] [--rng] [--dropout]
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import torch

import scenarios

DEFECT_STEP = 17

build_model = scenarios.build_model
train_step = scenarios.train_step


def batch_at(step: int) -> dict[str, Any]:
    return scenarios.make_batch(step, 0, "near_zero" if step == DEFECT_STEP else None)


def batch_without_defect(step: int) -> dict[str, Any]:
    """The data as it should have been: the replay of these batches stays finite."""
    return scenarios.make_batch(step, 0)


def batch_from_a_short_file(step: int) -> dict[str, Any]:
    """Rows read at offsets from a file holding 12 steps: past its end, the slices are empty."""
    batch = scenarios.make_batch(step, 0)
    return {k: v[:0] if step >= 12 else v for k, v in batch.items()}


def batch_unseeded(step: int) -> dict[str, Any]:
    """Drawn from the global RNG, not seeded by the step: a different batch each time it is asked."""
    return {"x": torch.rand(scenarios.BATCH, scenarios.N_FEATURES) + 0.5, "y": torch.rand(scenarios.BATCH, 1)}


def build_batchnorm_model() -> torch.nn.Module:
    """Another model: a BatchNorm layer the checkpoint has no state for."""
    return scenarios.build_model(batchnorm=True)


def build_model_with_dropout() -> torch.nn.Module:
    """The same parameters, with dropout after each activation: its masks come from the torch RNG."""
    model = scenarios.build_model()
    model.act = torch.nn.Sequential(model.act, torch.nn.Dropout(0.2))
    return model


def make_optimizer(model: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.Adam(model.parameters(), lr=1e-2)


def make_named_optimizer(model: torch.nn.Module) -> torch.optim.Optimizer:
    """Built from named parameters (torch >= 2.5): its state dict records their names."""
    return torch.optim.Adam(model.named_parameters(), lr=1e-2)


def make_sgd(model: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=1e-2, momentum=0.9)


# Two other models a loop may train, for the stages beyond the gradient's: a decoder whose batch of step
# SHORT_DEFECT has every label -100 (a NaN loss that never reaches the model: loss_only), and a CNN whose batch of
# that step holds a 1e30 pixel (BatchNorm's running_var turns inf: the buffer stage).
SHORT_DEFECT = 2
build_decoder, train_step_lm = scenarios.build_decoder, scenarios.train_step_lm
build_cnn, train_step_classify = scenarios.build_cnn, scenarios.train_step_classify


def tokens_at(step: int) -> dict[str, Any]:
    return scenarios.make_token_batch(step, defect="no_labels" if step == SHORT_DEFECT else None)


def images_at(step: int) -> dict[str, Any]:
    return scenarios.make_image_batch(step, defect="huge_pixel" if step == SHORT_DEFECT else None)


def make_adamw(model: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=1e-3)


def train(out: Path, *, steps: int = 24, every: int = 10, named: bool = False, rng: bool = False,
          dropout: bool = False) -> list[float]:
    """The training loop: a checkpoint at the top of every ``every``-th step, the state before it; the losses."""
    model = (build_model_with_dropout if dropout else build_model)()
    optimizer = (make_named_optimizer if named else make_optimizer)(model)
    out.mkdir(parents=True, exist_ok=True)
    losses = []
    for step in range(steps):
        if step % every == 0:
            state = {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "step": step}
            torch.save({**state, "rng_state": torch.get_rng_state()} if rng else state, out / f"step_{step:06d}.pt")
        losses.append(train_step(model, optimizer, batch_at(step)).item())
        print(f"step {step} loss {losses[-1]:.6g}")
    return losses


def train_accelerate(out: Path, *, steps: int = 11, every: int = 10) -> None:
    """The same loop under accelerate, each checkpoint an ``Accelerator.save_state`` folder (model.safetensors,
    optimizer.bin, random_states_0.pkl) named by its step."""
    import accelerate

    acc = accelerate.Accelerator(cpu=True)
    model = build_model()
    model, optimizer = acc.prepare(model, make_optimizer(model))
    for step in range(steps):
        if step % every == 0:
            acc.save_state(out / f"step_{step:06d}")
        train_step(model, optimizer, batch_at(step))


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("out", type=Path)
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--every", type=int, default=10)
    parser.add_argument("--named", action="store_true", help="build the optimizer from named parameters")
    parser.add_argument("--rng", action="store_true", help="save the torch RNG state too")
    parser.add_argument("--dropout", action="store_true", help="train the model with dropout")
    args = parser.parse_args()
    train(args.out, steps=args.steps, every=args.every, named=args.named, rng=args.rng, dropout=args.dropout)
