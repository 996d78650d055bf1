"""Precursors: per step, how close the run is to overflow — so a slow drift shows before the blow-up.

Measured only while replaying the window before and after the responsible step (the rewind after a
detection), never on the detection pass: the update size needs a copy of the parameters.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils._pytree import tree_leaves

from .. import finite
from ..distributed.tensors import whole
from ..numbers import real
from ..report import Precursor
from ..runs.checkpoint import optimizer_params


def _norm(grads: list[torch.Tensor], largest: torch.Tensor) -> torch.Tensor:
    """The total 2-norm of ``grads``, never non-finite where every gradient is finite: summed in the gradients'
    own dtype (one pass), and again in float64 when that came out below the largest |gradient| it must bound, an
    overflow (float32 squares overflow past 1.8e19) or underflow of the squares; float64 holds the norm of any
    finite float32 gradients."""
    norm = torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads)).float())
    if bool(torch.isfinite(largest)) and not (bool(torch.isfinite(norm)) and bool(norm >= largest)):
        norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g, dtype=torch.float64) for g in grads]))
    return norm


class PrecursorProbe:
    """Forward and optimizer hooks; ``take(step)`` returns that step's figures and starts the next."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
        self.model, self.optimizer = model, optimizer
        self._handles: list[Any] = []
        self._reset()

    def _reset(self) -> None:
        self._act: dict[torch.dtype, list[torch.Tensor]] = {}
        self._grad_norm: torch.Tensor | None = None
        self._grad_max: torch.Tensor | None = None
        self._before: list[torch.Tensor] = []
        self._update_max: torch.Tensor | None = None
        self._lr: float | None = None
        self._state: dict[str, list[torch.Tensor]] = {}

    def __enter__(self) -> "PrecursorProbe":
        for module in self.model.modules():
            self._handles.append(module.register_forward_hook(self._forward))
        self._handles.append(self.optimizer.register_step_pre_hook(self._pre))
        self._handles.append(self.optimizer.register_step_post_hook(self._post))
        return self

    def __exit__(self, *exc: object) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()

    def _forward(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        for t in tree_leaves(output):
            if finite.checkable(t):
                self._act.setdefault(t.dtype, []).append(finite.abs_max(t))  # inside torch.func transforms too

    def _pre(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        # sharded tensors (FSDP2 at world size) are measured whole; a sparse gradient by its stored values
        grads = [finite.stored(whole(p.grad)).values for p in optimizer_params(self.optimizer) if p.grad is not None]
        if grads:
            self._grad_max = torch.stack([finite.abs_max(g) for g in grads]).max()
            self._grad_norm = _norm(grads, self._grad_max)
        self._before = [whole(p).detach().clone() for p in optimizer_params(self.optimizer)]
        lrs = [lr for g in optimizer.param_groups if (lr := real(g.get("lr"))) is not None]  # None: Adafactor's own
        self._lr = max(lrs) if lrs else None

    def _post(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        params = [whole(p) for p in optimizer_params(self.optimizer)]
        if self._before:
            pairs = [(p.detach(), b) for p, b in zip(params, self._before) if p.numel()]
            self._update_max = torch.stack([(p - b).abs().max() for p, b in pairs]).max()
            if bool(torch.isinf(self._update_max)):  # two finite values can lie further apart than the dtype holds
                self._update_max = torch.stack([(p.double() - b.double()).abs().max() for p, b in pairs]).max()
        self._before = []
        for p in optimizer_params(self.optimizer):
            for key, value in optimizer.state.get(p, {}).items():
                if finite.checkable(value) and value.ndim > 0:
                    self._state.setdefault(key, []).append(finite.abs_max(whole(value)))

    def take(self, step: int) -> Precursor:
        value = lambda t: None if t is None else float(t)  # noqa: E731
        act_dtype, act_max, headroom = None, None, None
        for dtype, maxima in self._act.items():
            m = float(torch.stack(maxima).max())
            ratio = m / torch.finfo(dtype).max
            if headroom is None or ratio > headroom:
                act_dtype, act_max, headroom = str(dtype).removeprefix("torch."), m, ratio
        p = Precursor(step, value(self._grad_norm), value(self._grad_max), value(self._update_max),
                      {k: float(torch.stack(v).max()) for k, v in self._state.items()}, act_max, act_dtype, headroom,
                      self._lr)
        self._reset()
        return p
