"""Optimizer state a detect-mode step need not read: its finiteness follows from what the step reads anyway.

For an optimizer whose update rule is known, the new state is a function of the old state and the gradient. A bound
``|x| <= b`` on each old state tensor, and the gradient's largest magnitude ``G`` (its ``aminmax``, which the
gradient check reads in place of a ``sum`` when a proof is kept), bound the new state. While every bound, and every
intermediate value the update computes, stays below an eighth of the dtype's largest value, the new state is finite
and is not read. The step where that fails (a non-finite or huge gradient, a bound grown too large, a state tensor
written by anything but the optimizer's step) reads the state exactly as before, which keeps the first non-finite
state coordinate exact; an exact read also renews the bound. Each bound is rounded up by ``(1 + eps)**4`` a step
(rounding of the coefficients, the products and the sum, ``eps`` the dtype's machine epsilon), plus four times the
smallest normal value (a subnormal result rounds by an absolute amount).

The rules (``torch.optim``'s single-tensor, foreach and fused-free code alike):

- Adam, AdamW: ``m' = lerp(m, g', 1 - beta1)`` and ``v' = beta2 v + (1 - beta2) g'^2`` with ``g' = -g`` under
  ``maximize`` (the same magnitude), so ``|m'| <= beta1 |m| + (1 - beta1) G`` (its intermediate ``g' - m`` is at
  most ``G + |m|``), ``v' <= beta2 v + (1 - beta2) G^2`` (its intermediate ``g'^2 <= G^2``); with ``amsgrad``,
  ``max_exp_avg_sq' = max(max_exp_avg_sq, v')``. Fresh state starts at zeros. AdamW's (decoupled) weight decay
  scales the parameter, not the state. Adam's L2 weight decay adds ``weight_decay * p`` to the gradient, whose
  magnitude nothing read bounds: no proof. Neither for ``fused`` (the kernel unscales a GradScaler's gradient
  itself) nor ``differentiable``.
- SGD with momentum: ``buf' = momentum buf + (1 - dampening) g'`` (fresh: ``buf' = g'``); nesterov changes the
  update, not the buffer. Weight decay: no proof, as for Adam. Without momentum SGD keeps no state.
- Any other optimizer, state key, or a subclass (its ``step`` may differ): read every step.

What is assumed: only the optimizer's own ``step()`` writes its state. A state tensor replaced, or written in place
by anything else between the reads (its version counter moved), is read; a write through ``.data``, which moves no
counter, is not seen. Parameters are always read (``eps = 0`` makes 0/0 from finite state). The proof runs on CPU
in detect mode; locate mode and the deferred (accelerator) checks read everything.
"""

from __future__ import annotations

import math
from typing import Any, Callable

import torch

from ..distributed.tensors import is_dtensor

Old = Callable[[str], "float | None"]  # a state key's bound before the step, None where none is known
Bounds = "tuple[dict[str, float], float] | None"  # the new state's bounds by key, the largest intermediate value
_HEADROOM = 8.0  # every bound and intermediate stays below the dtype's largest value / _HEADROOM


def _adam(group: dict[str, Any], fresh: bool, g: float, old: Old, decoupled: bool) -> Bounds:
    if group.get("fused") or group.get("differentiable") or (group.get("weight_decay") and not decoupled):
        return None
    b1, b2 = (float(b) for b in group["betas"])
    m, v = (0.0, 0.0) if fresh else (old("exp_avg"), old("exp_avg_sq"))
    if m is None or v is None or not (0 <= b1 <= 1 and 0 <= b2 <= 1):
        return None
    new = {"exp_avg": b1 * m + (1 - b1) * g, "exp_avg_sq": b2 * v + (1 - b2) * g * g}
    if group.get("amsgrad"):
        top = 0.0 if fresh else old("max_exp_avg_sq")
        if top is None:
            return None
        new["max_exp_avg_sq"] = max(top, new["exp_avg_sq"])
    return new, max(g + m, g * g, v)


def _sgd(group: dict[str, Any], fresh: bool, g: float, old: Old, decoupled: bool) -> Bounds:
    momentum = abs(float(group["momentum"]))
    if momentum == 0:
        return {}, 0.0
    if group.get("fused") or group.get("differentiable") or group.get("weight_decay"):
        return None
    if fresh:
        return {"momentum_buffer": g}, g
    buf = old("momentum_buffer")
    if buf is None:
        return None
    damped = abs(1 - float(group["dampening"])) * g
    return {"momentum_buffer": momentum * buf + damped}, max(momentum * buf, damped)


_RULES = {torch.optim.Adam: _adam, torch.optim.AdamW: _adam, torch.optim.SGD: _sgd}


def provable(optimizer: torch.optim.Optimizer) -> bool:
    """Whether a proof can be kept for this optimizer: a known class (not a subclass), parameters not sharded."""
    return type(optimizer) in _RULES and not any(is_dtensor(p) for g in optimizer.param_groups for p in g["params"])


class StateProof:
    """Bounds on one optimizer's state tensors, carried through each ``step()`` by its update rule."""

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.optimizer = optimizer
        self.rule = _RULES[type(optimizer)]
        self.decoupled = type(optimizer) is torch.optim.AdamW
        # param -> key -> (the state tensor, its version counter, a bound on its magnitude) when last known
        self._known: dict[torch.Tensor, dict[str, tuple[torch.Tensor, int, float]]] = {}
        self._expected: dict[torch.Tensor, dict[str, float]] = {}  # bounds of the state the running step writes

    def _bound(self, p: torch.Tensor, key: str) -> float | None:
        held = self._known.get(p, {}).get(key)
        t = self.optimizer.state.get(p, {}).get(key)
        if held is None or held[0] is not t or held[0]._version != held[1]:
            return None
        return held[2]

    def before_step(self, grad_max: dict[torch.Tensor, float]) -> None:
        """In the optimizer's pre-hook: the bounds of the state this step writes, from ``grad_max`` (each parameter's
        largest gradient magnitude, as the optimizer sees it). A parameter without a proof is read after the step."""
        self._expected = {}
        for group in self.optimizer.param_groups:
            decoupled = self.decoupled or bool(group.get("decoupled_weight_decay"))
            for p in group["params"]:
                if p.grad is None:
                    continue  # the optimizer skips it: its state, and what is known of it, stay as they are
                g = grad_max.get(p)
                new = None if g is None or p.is_complex() or not math.isfinite(g) else \
                    self.rule(group, not self.optimizer.state.get(p), g, lambda key: self._bound(p, key), decoupled)
                self._known.pop(p, None)  # the step writes the state: what held before no longer does
                if new is None:
                    continue
                info = torch.finfo(p.dtype)
                limit, grow = info.max / _HEADROOM, (1 + info.eps) ** 4
                bounds = {k: b * grow + 4 * info.tiny for k, b in new[0].items()}  # subnormals round absolutely
                if all(b <= limit for b in [*bounds.values(), new[1] * grow]):  # NaN fails too
                    self._expected[p] = bounds

    def after_step(self) -> None:
        """In the optimizer's post-hook: the state the step wrote, with its proven bounds."""
        for p, bounds in self._expected.items():
            state = self.optimizer.state.get(p, {})
            self._known[p] = {k: (state[k], state[k]._version, b) for k, b in bounds.items()
                              if isinstance(state.get(k), torch.Tensor)}
        self._expected = {}

    def proven(self, p: torch.Tensor, key: str, t: torch.Tensor) -> bool:
        """True when ``t``, ``p``'s state ``key``, is proven finite: need not be read."""
        held = self._known.get(p, {}).get(key)
        return held is not None and held[0] is t and t._version == held[1] and held[2] <= torch.finfo(t.dtype).max \
            / _HEADROOM

    def learn(self, p: torch.Tensor, key: str, t: torch.Tensor, max_abs: float) -> None:
        """An exact read of a finite state tensor: its bound from now on."""
        self._known.setdefault(p, {})[key] = (t, t._version, max_abs)

    def forget(self) -> None:
        """Nothing is known any more (a step checked in locate mode, where no bound is kept)."""
        self._known.clear()
        self._expected = {}
