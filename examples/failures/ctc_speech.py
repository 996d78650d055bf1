"""A small acoustic model (conv subsampling, GRU, CTC) on synthetic log-mel frames; one utterance's transcript is
longer than its audio allows.

Defect: the convolution halves the frames; an utterance of 12 frames (6 after subsampling) carries a transcript of 9
labels, so no CTC alignment exists: its loss is inf (zero_infinity=False, the default) and CTC's backward of an
impossible alignment is NaN. Expected report: origin loss at DEFECT_STEP (inf, the ctc_loss op), samples: that
utterance; a gradient NaN after it.
"""

from __future__ import annotations

import sys

import recording
import torch
import torch.nn.functional as F
from torch import nn

DEFECT_STEP, SHORT = 8, 2
MELS, VOCAB, FRAMES = 16, 10, 40


class Acoustic(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.sub = nn.Conv1d(MELS, 32, 3, stride=2, padding=1)
        self.rnn = nn.GRU(32, 32, batch_first=True)
        self.head = nn.Linear(32, VOCAB + 1)  # class 0 is the CTC blank

    def forward(self, mels: torch.Tensor) -> torch.Tensor:
        h, _ = self.rnn(F.relu(self.sub(mels.transpose(1, 2))).transpose(1, 2))
        return self.head(h).log_softmax(-1)


def build_model() -> nn.Module:
    return Acoustic()


def train_step(model: nn.Module, optimizer: torch.optim.Optimizer, batch: dict) -> torch.Tensor:
    optimizer.zero_grad(set_to_none=True)
    logp = model(batch["mels"])                       # [B, T', C]
    frames = (batch["frames"] + 1) // 2               # after the stride-2 convolution
    loss = F.ctc_loss(logp.transpose(0, 1), batch["labels"], frames, batch["label_lengths"])
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 5.0)
    optimizer.step()
    return loss


def make_batch(step: int) -> dict:
    g = torch.Generator().manual_seed(step)
    frames = torch.randint(24, FRAMES + 1, (6,), generator=g)
    lengths = torch.randint(2, 6, (6,), generator=g)
    if step == DEFECT_STEP:
        frames[SHORT], lengths[SHORT] = 12, 9  # a clipped recording with the full transcript
    mels = torch.randn(6, FRAMES, MELS, generator=g)
    mels = mels * (torch.arange(FRAMES).view(1, -1, 1) < frames.view(-1, 1, 1))
    labels = torch.randint(1, VOCAB + 1, (6, 9), generator=g)
    return {"mels": mels, "frames": frames, "labels": labels, "label_lengths": lengths,
            "utt": [f"utt-{step}-{i}" for i in range(6)]}


def record(path: str, steps: int = DEFECT_STEP + 3) -> None:
    recording.record(path, build_model, train_step, make_batch, steps)


if __name__ == "__main__":
    record(sys.argv[1])
