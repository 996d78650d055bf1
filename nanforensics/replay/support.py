"""What replay supports, checked once before the first replayed step: a run outside it is refused up front, in one
line naming the feature, instead of failing half-way through in a way that reads as the user's step function.

An allow-list of what replay runs (``OPTIMIZERS``, a table from each to why it can be replayed): supporting a new one is
a row here and a test that replays it (tests/oracle, whose generator draws it). Sparse gradients, torch.func transforms
and per-batch tensors were refused here until the one reader of tensors (finite.stored) and sample attribution's rows
rule supported them.
"""

from __future__ import annotations

from typing import Any

import torch

from ..errors import BadInput
from ..runs.optimizers import members_of

# the torch.optim optimizers replay runs, checks and explains; each was replayed in agreement with the reference
# monitor on generated programs (tests/oracle). A subclass of one of them is replayed as its base is.
OPTIMIZERS: dict[str, str] = {
    "SGD": "update from grad and momentum_buffer",
    "Adam": "update from grad, exp_avg, exp_avg_sq",
    "AdamW": "update from grad, exp_avg, exp_avg_sq",
    "Adamax": "update from grad, exp_avg, exp_inf",
    "NAdam": "update from grad, exp_avg, exp_avg_sq, mu_product",
    "RAdam": "update from grad, exp_avg, exp_avg_sq",
    "RMSprop": "update from grad, square_avg",
    "Adagrad": "update from grad, sum",
    "Adadelta": "update from grad, square_avg, acc_delta",
    "ASGD": "update from grad, ax, eta, mu",
    "Rprop": "update from grad's sign, prev, step_size",
    "Adafactor": "update from grad, row_var, col_var",
    "Muon": "update from grad, momentum_buffer",
    "SparseAdam": "update from a sparse grad's stored values, exp_avg, exp_avg_sq",
}
# why the others are refused, for the one-line message
REFUSED_OPTIMIZERS: dict[str, str] = {
    "LBFGS": "it calls the step function's closure inside optimizer.step(), so the forward and backward run inside "
             "the update",
}


class Unsupported(BadInput):
    """A run replay does not support, refused before any step is replayed (exit code 2); ``feature`` names the kind
    of thing refused (today only "optimizer"), for tallies."""

    def __init__(self, where: Any, feature: str, problem: str) -> None:
        super().__init__(where, f"replay does not support {problem}")
        self.feature = feature


def check_supported(where: Any, optimizer: torch.optim.Optimizer) -> None:
    """Refuse a run whose optimizer (each of several) replay does not support, naming it."""
    for member in members_of(optimizer):
        problem = _optimizer(member)
        if problem is not None:
            raise Unsupported(where, "optimizer", problem)


def _optimizer(optimizer: torch.optim.Optimizer) -> str | None:
    known = next((c.__name__ for c in type(optimizer).__mro__ if c.__module__.startswith("torch.optim")
                  and c.__name__ in OPTIMIZERS), None)
    if known is not None:
        return None
    name = type(optimizer).__name__
    why = REFUSED_OPTIMIZERS.get(name, "it is not one of the optimizers replay was tested on: "
                                 + ", ".join(sorted(OPTIMIZERS)))
    return f"the optimizer {name}: {why}"
