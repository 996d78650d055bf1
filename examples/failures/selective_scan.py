"""A Mamba-style selective state-space layer whose scan is computed in parallel in log space; one batch packs a
long sequence.

Defect: the scan h_t = a_t h_{t-1} + u_t is written as h_t = P_t * cumsum(u_s / P_s), P_t = prod(a) = exp(cumsum(log
a)). On a long sequence P_t underflows to 0 and 1/P_s = exp(-cumsum) overflows to inf: inf * 0 = NaN. Expected
report: origin forward at DEFECT_STEP in the scan layer, the exp overflow named as the root, the long sample.
"""

from __future__ import annotations

import sys

import recording
import torch
import torch.nn.functional as F
from torch import nn

DEFECT_STEP, LONG = 8, 1
VOCAB, DIM, STATE = 32, 16, 8


class SelectiveScan(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.dt = nn.Linear(DIM, DIM)
        self.B, self.C = nn.Linear(DIM, STATE), nn.Linear(DIM, STATE)
        self.A_log = nn.Parameter(torch.zeros(DIM, STATE))

    def forward(self, x: torch.Tensor) -> torch.Tensor:          # x: [B, L, D]
        dt = F.softplus(self.dt(x)).unsqueeze(-1)                  # [B, L, D, 1]
        log_a = dt * -torch.exp(self.A_log)                        # log of the decay, <= 0
        u = dt * self.B(x).unsqueeze(2) * x.unsqueeze(-1)          # [B, L, D, N]
        s = torch.cumsum(log_a, dim=1)
        h = torch.exp(s) * torch.cumsum(u * torch.exp(-s), dim=1)  # the parallel scan, in log space
        return (h * self.C(x).unsqueeze(2)).sum(-1)


class MambaLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(VOCAB, DIM)
        self.scan = SelectiveScan()
        self.norm = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.emb(tokens)
        return self.head(self.norm(x + self.scan(x)))


def build_model() -> nn.Module:
    return MambaLM()


def train_step(model: nn.Module, optimizer: torch.optim.Optimizer, batch: dict) -> torch.Tensor:
    optimizer.zero_grad(set_to_none=True)
    logits = model(batch["tokens"])
    loss = F.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), batch["tokens"][:, 1:].reshape(-1), ignore_index=0)
    loss.backward()
    optimizer.step()
    return loss


def make_batch(step: int) -> dict:
    """Documents padded (token 0) to the longest in the batch; at DEFECT_STEP one is a long one."""
    g = torch.Generator().manual_seed(step)
    lengths = torch.randint(16, 33, (4,), generator=g)
    if step == DEFECT_STEP:
        lengths[LONG] = 400
    tokens = torch.randint(1, VOCAB, (4, int(lengths.max())), generator=g)
    tokens = tokens * (torch.arange(tokens.shape[1]) < lengths.view(-1, 1))
    return {"tokens": tokens, "doc": [f"doc-{step}-{i}" for i in range(4)]}


def record(path: str, steps: int = DEFECT_STEP + 3) -> None:
    recording.record(path, build_model, train_step, make_batch, steps, torch.optim.AdamW, 3e-3)


if __name__ == "__main__":
    record(sys.argv[1])
