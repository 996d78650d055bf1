"""A graph network with mean aggregation (dense adjacency, one small graph per sample); one graph of a batch has an
isolated node.

Defect: the mean over neighbours is (A @ H) / deg; a node with no edges has deg 0 and its message 0/0 = NaN.
Expected report: origin forward at DEFECT_STEP in the message-passing layer, the div op, the graph with the isolated
node.
"""

from __future__ import annotations

import sys

import recording
import torch
import torch.nn.functional as F
from torch import nn

DEFECT_STEP, LONELY, NODES, FEATS = 8, 4, 10, 6


class MeanConv(nn.Module):
    def __init__(self, cin: int, cout: int) -> None:
        super().__init__()
        self.self_lin, self.msg_lin = nn.Linear(cin, cout), nn.Linear(cin, cout)

    def forward(self, h: torch.Tensor, adj: torch.Tensor) -> torch.Tensor:
        deg = adj.sum(-1, keepdim=True)
        return F.relu(self.self_lin(h) + self.msg_lin(adj @ h / deg))


class GNN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.conv1, self.conv2 = MeanConv(FEATS, 32), MeanConv(32, 32)
        self.readout = nn.Linear(32, 1)

    def forward(self, x: torch.Tensor, adj: torch.Tensor) -> torch.Tensor:
        h = self.conv2(self.conv1(x, adj), adj)
        return self.readout(h.mean(1)).squeeze(1)


def build_model() -> nn.Module:
    return GNN()


def train_step(model: nn.Module, optimizer: torch.optim.Optimizer, batch: dict) -> torch.Tensor:
    optimizer.zero_grad(set_to_none=True)
    loss = F.mse_loss(model(batch["x"], batch["adj"]), batch["y"])
    loss.backward()
    optimizer.step()
    return loss


def make_batch(step: int) -> dict:
    g = torch.Generator().manual_seed(step)
    upper = (torch.rand(8, NODES, NODES, generator=g) < 0.4).float().triu(1)
    adj = upper + upper.transpose(1, 2)
    ring = torch.roll(torch.eye(NODES), 1, 0)
    adj = ((adj + ring + ring.T) > 0).float()  # every node has neighbours...
    if step == DEFECT_STEP:
        adj[LONELY, 3, :] = 0.0  # ...except one molecule's atom whose bonds the parser dropped
        adj[LONELY, :, 3] = 0.0
    x = torch.randn(8, NODES, FEATS, generator=g)
    return {"x": x, "adj": adj, "y": x.sum((1, 2)) / NODES, "mol": [f"mol-{step}-{i}" for i in range(8)]}


def record(path: str, steps: int = DEFECT_STEP + 3) -> None:
    recording.record(path, build_model, train_step, make_batch, steps)


if __name__ == "__main__":
    record(sys.argv[1])
