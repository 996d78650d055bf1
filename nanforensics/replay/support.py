"""What replay supports, checked once before the first replayed step: a run outside it is refused up front, in one
line naming the feature, instead of failing half-way through in a way that reads as the user's step function.

One allow-list per kind of thing (``OPTIMIZERS``, ``GRADIENT_LAYOUTS``, ``BATCH_LAYOUTS``), each a table from what is
supported to why it can be replayed: supporting a new one is a row here and a test that replays it
(tests/oracle, whose generator draws it).
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from ..errors import BadInput

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
}
# why the others are refused, for the one-line message
REFUSED_OPTIMIZERS: dict[str, str] = {
    "LBFGS": "it calls the step function's closure inside optimizer.step(), so the forward and backward run inside "
             "the update",
    "SparseAdam": "it updates from sparse gradients, which replay does not read",
}
# gradient layouts replay reads: a dense (strided) gradient
GRADIENT_LAYOUTS = {torch.strided: "dense gradients"}
# module types that make sparse gradients, named in the refusal
SPARSE_MODULES = (torch.nn.Embedding, torch.nn.EmbeddingBag)
# torch.func transforms: the monitor's hooks would see functorch's wrapped tensors
FUNC_TRANSFORMS = frozenset({"vmap", "grad", "grad_and_value", "functional_call", "jacrev", "jacfwd", "vjp", "jvp"})


class Unsupported(BadInput):
    """A run replay does not support, refused before any step is replayed (exit code 2); ``feature`` names the kind
    of thing refused (optimizer, gradients, transforms, batch), for tallies."""

    def __init__(self, where: Any, feature: str, problem: str) -> None:
        super().__init__(where, f"replay does not support {problem}")
        self.feature = feature


def check_supported(where: Any, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                    step_fn: Callable[..., Any], batch: Any) -> None:
    """Refuse what replay does not support, naming it (``CHECKS``, in order)."""
    for feature, check in CHECKS.items():
        problem = check(model, optimizer, step_fn, batch)
        if problem is not None:
            raise Unsupported(where, feature, problem)


def _optimizer(optimizer: torch.optim.Optimizer) -> str | None:
    known = next((c.__name__ for c in type(optimizer).__mro__ if c.__module__.startswith("torch.optim")
                  and c.__name__ in OPTIMIZERS), None)
    if known is not None:
        return None
    name = type(optimizer).__name__
    why = REFUSED_OPTIMIZERS.get(name, "it is not one of the optimizers replay was tested on: "
                                 + ", ".join(sorted(OPTIMIZERS)))
    return f"the optimizer {name}: {why}"


def _gradients(model: torch.nn.Module) -> str | None:
    for name, module in model.named_modules():
        if isinstance(module, SPARSE_MODULES) and module.sparse:
            return f"sparse gradients ({name or '<root>'} is {type(module).__name__}(sparse=True)): only " \
                   f"{', '.join(GRADIENT_LAYOUTS.values())} are read"
    return None


def _transforms(step_fn: Callable[..., Any]) -> str | None:
    code = getattr(step_fn, "__code__", None)
    names: set[str] = set()
    stack = [code] if code is not None else []
    while stack:  # the step function's code and the functions defined inside it
        c = stack.pop()
        names |= set(c.co_names)
        stack += [k for k in c.co_consts if hasattr(k, "co_names")]
    if "func" in names and names & FUNC_TRANSFORMS:
        return f"a step function under torch.func transforms ({', '.join(sorted(names & FUNC_TRANSFORMS))}): the " \
               "checks would read functorch's wrapped tensors"
    return None


def _batch(batch: Any) -> str | None:
    from ..runs.batches import leaves

    tensors = [(path, t) for path, t in leaves(batch) if isinstance(t, torch.Tensor) and t.dim()]
    sizes = [t.shape[0] for _, t in tensors]
    if len(set(sizes)) > 1:
        rows = max(set(sizes), key=sizes.count)  # the batch dimension: the size most tensors share
        path, t = next((p, t) for p, t in tensors if t.shape[0] != rows)
        return f"a batch whose tensors do not share their first dimension ({path} of shape {list(t.shape)}): a " \
               "per-batch tensor beside per-sample rows, which sample attribution would split as rows"
    return None


# What is checked, by feature, each from (model, optimizer, step function, first batch): supporting a feature is
# deleting its row (tests/test_oracle.py then replays what it refused).
CHECKS: dict[str, Callable[[torch.nn.Module, torch.optim.Optimizer, Callable[..., Any], Any], str | None]] = {
    "optimizer": lambda model, optimizer, step_fn, batch: _optimizer(optimizer),
    "gradients": lambda model, optimizer, step_fn, batch: _gradients(model),
    "transforms": lambda model, optimizer, step_fn, batch: _transforms(step_fn),
    "batch": lambda model, optimizer, step_fn, batch: _batch(batch),
}
