"""Architectures beyond the scenarios' feed-forward ones, as small real runs: a recurrent model and a compiled one.

The recurrent model reads variable-length sequences the way users write it: padded batches with their lengths,
packed for the LSTM (``pack_padded_sequence``), its output unpacked and mean-pooled over time. An empty sequence
(length 0) cannot be packed, so the lengths are clamped to 1 for packing and the pooling guards its division with
``torch.where(lengths > 0, total / lengths, 0)``: the forward is finite, the loss too, but the backward of the
discarded branch is 0/0 = NaN, and it reaches every LSTM weight's gradient (the trap ``where`` sets for a derivative).
Adam writes the NaN into the weights, and the loss is NaN one step later.

The compiled model is the scenarios' regressor under ``torch.compile``: the loop trains the compiled module, the
recorder is given it, and replay rebuilds it with the same factory.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from nanforensics import Recorder
from torch import nn
from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence

import scenarios

FEATURES, HIDDEN, SEQ, SEQ_BATCH = 3, 8, 6, 8
EMPTY_SAMPLE = 5  # the sample whose sequence is empty in the defective batch


class SequenceRegressor(nn.Module):
    """An LSTM over packed padded sequences, mean-pooled over each sequence's own length, and a linear head."""

    def __init__(self, features: int = FEATURES, hidden: int = HIDDEN, cell: str = "lstm", packed: bool = True) -> None:
        super().__init__()
        self.packed = packed
        self.rnn = (nn.LSTM if cell == "lstm" else nn.GRU)(features, hidden, batch_first=True)
        self.head = nn.Linear(hidden, 1)

    def forward(self, x: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        if self.packed:
            packed = pack_padded_sequence(x, lengths.clamp(min=1), batch_first=True, enforce_sorted=False)
            out, _ = pad_packed_sequence(self.rnn(packed)[0], batch_first=True, total_length=x.shape[1])
        else:
            out = self.rnn(x)[0] * (torch.arange(x.shape[1])[None, :, None] < lengths[:, None, None])
        total = out.sum(dim=1)
        n = lengths[:, None].to(total.dtype)
        return self.head(torch.where(n > 0, total / n, torch.zeros_like(total)))


def build_sequence_model(**kwargs: Any) -> nn.Module:
    torch.manual_seed(0)
    return SequenceRegressor(**kwargs)


def train_step_sequence(model: nn.Module, optimizer: torch.optim.Optimizer, batch: dict[str, Any]) -> torch.Tensor:
    optimizer.zero_grad(set_to_none=True)
    loss = F.mse_loss(model(batch["x"], batch["lengths"]), batch["y"])
    loss.backward()
    optimizer.step()
    return loss


def make_sequence_batch(step: int, defect: bool = False) -> dict[str, Any]:
    """Padded sequences of random lengths 2..SEQ (zeros past each length); ``defect``: sample EMPTY_SAMPLE empty."""
    g = torch.Generator().manual_seed(step)
    lengths = torch.randint(2, SEQ + 1, (SEQ_BATCH,), generator=g)
    if defect:
        lengths[EMPTY_SAMPLE] = 0
    x = torch.randn(SEQ_BATCH, SEQ, FEATURES, generator=g)
    x[torch.arange(SEQ)[None, :] >= lengths[:, None]] = 0.0
    y = torch.randn(SEQ_BATCH, 1, generator=g)
    return {"x": x, "lengths": lengths, "y": y, "ids": [f"seq{step:05d}-{i:02d}" for i in range(SEQ_BATCH)]}


def record_sequence(run_dir: Path, steps: int, defect_step: int, checkpoint_every: int, **kwargs: Any) -> list[float]:
    """Train the LSTM regressor with Adam under the recorder; the batch of ``defect_step`` holds an empty sequence."""
    model = build_sequence_model(**kwargs)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    losses = []
    with Recorder(run_dir, model, optimizer, model_factory=build_sequence_model, model_kwargs=kwargs, step_fn=train_step_sequence,
                  checkpoint_every=checkpoint_every) as rec:
        for step in range(steps):
            batch = make_sequence_batch(step, defect=step == defect_step)
            loss = train_step_sequence(model, optimizer, batch)
            rec.log(step, batch, loss)
            losses.append(float(loss.detach()))
    return losses


def build_compiled_model(backend: str = "aot_eager") -> nn.Module:
    """The scenarios' regressor, compiled: the factory a loop that trains ``torch.compile(model)`` hands the recorder."""
    return torch.compile(scenarios.build_model(), backend=backend)


def record_compiled(run_dir: Path, steps: int, defect_step: int, checkpoint_every: int,
                    backend: str = "aot_eager") -> list[float]:
    """Train the compiled regressor with Adam under the recorder; a near-zero reading at ``defect_step``."""
    model = build_compiled_model(backend)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    losses = []
    with Recorder(run_dir, model, optimizer, model_factory=build_compiled_model, model_kwargs={"backend": backend},
                  step_fn=scenarios.train_step, checkpoint_every=checkpoint_every) as rec:
        for step in range(steps):
            batch = scenarios.make_batch(step, defect="near_zero" if step == defect_step else None)
            loss = scenarios.train_step(model, optimizer, batch)
            rec.log(step, batch, loss)
            losses.append(float(loss.detach()))
    return losses
