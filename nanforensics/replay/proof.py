"""What a detect-mode step need not read: finiteness that follows from what the step reads anyway.

For an optimizer whose update rule is known, the new state is a function of the old state and the gradient, and the
new parameter one of the old parameter and the new state. A bound ``|x| <= b`` on each old state tensor and on the
parameter, and the gradient's largest magnitude ``G`` (its ``aminmax``, which the gradient check reads in place of a
``sum`` when a proof is kept), bound the new ones. While every bound, and every intermediate value the update
computes, stays below an eighth of the dtype's largest value, the new values are finite and are not read. The step
where that fails (a non-finite or huge gradient, a bound grown too large, a tensor written by anything but the
optimizer's step) reads them exactly as before, which keeps the first non-finite coordinate exact; an exact read
also renews the bound. Each bound is rounded up by ``(1 + eps)**4`` a step (rounding of the coefficients, the
products and the sum, ``eps`` the dtype's machine epsilon), plus four times the smallest normal value (a subnormal
result rounds by an absolute amount).

The rules (``torch.optim``'s single-tensor and foreach code alike):

- Adam, AdamW: ``m' = lerp(m, g', 1 - beta1)`` and ``v' = beta2 v + (1 - beta2) g'^2`` with ``g' = -g`` under
  ``maximize`` (the same magnitude), so ``|m'| <= beta1 |m| + (1 - beta1) G`` (its intermediate ``g' - m`` is at
  most ``G + |m|``), ``v' <= beta2 v + (1 - beta2) G^2`` (its intermediate ``g'^2 <= G^2``); with ``amsgrad``,
  ``max_exp_avg_sq' = max(max_exp_avg_sq, v')``; the step count (a float tensor) grows by one. Fresh state starts
  at zeros. The parameter:
  ``p' = p (1 - lr wd) - lr / (1 - beta1^t) * m' / (sqrt(v') / sqrt(1 - beta2^t) + eps)`` (the decay factor only
  for decoupled weight decay). The denominator is at least ``eps`` as the dtype holds it (a rounded sum of
  non-negative values is at least each of them), and ``1 - beta1^t >= 1 - beta1``, so
  ``|p'| <= |1 - lr wd| |p| + lr / (1 - beta1) * |m'| / eps``. That needs ``eps`` non-zero in the dtype (float16
  rounds 1e-8 to 0, and ``0 / 0`` is NaN where ``m' = v' = 0``), ``beta1 < 1``, and ``sqrt(1 - beta2)`` a normal
  number of the dtype (else ``sqrt(v') / 0``); where they fail the parameter is read. Adam's L2 weight decay adds
  ``weight_decay * p`` to the gradient, whose magnitude nothing read bounds: no proof. Neither for ``fused`` (the
  kernel unscales a GradScaler's gradient itself), ``capturable`` nor ``differentiable``.
- SGD: ``buf' = momentum buf + (1 - dampening) g'`` (fresh: ``buf' = g'``); the parameter moves by ``lr`` times
  ``buf'``, ``g' + momentum buf'`` under nesterov, or ``g'`` without momentum (no state). Weight decay: no proof,
  as for Adam.
- Any other optimizer, state key, or a subclass (its ``step`` may differ): read every step.

What is assumed: only the optimizer's own ``step()`` writes its state and, between the monitor's reads, the
parameters. A tensor replaced, or written in place by anything else (its version counter moved: ``clamp_`` after
the step, a weight tied and rewritten), is read; a write through ``.data``, which moves no counter, is not seen. The
proof runs on CPU in detect mode; locate mode and the deferred (accelerator) checks read everything.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Any, Callable

import torch

from ..distributed.tensors import is_dtensor
from ..finite import locate, min_max
from ..numbers import pair, real

Old = Callable[[str], "float | None"]  # a state key's bound before the step, None where none is known
_HEADROOM = 8.0  # every bound and intermediate stays below the dtype's largest value / _HEADROOM


@functools.lru_cache(maxsize=16)
def _limits(dtype: torch.dtype) -> tuple[float, float, float, float]:
    """``dtype``'s largest bound kept, a step's rounding factor and absolute rounding, and its smallest normal."""
    info = torch.finfo(dtype)
    return info.max / _HEADROOM, (1 + info.eps) ** 4, 4 * info.tiny, info.tiny


def _up(x: float, dtype: torch.dtype) -> float:
    """``x`` rounded up for one step's arithmetic in ``dtype``: up to four roundings, and a subnormal result's
    absolute one."""
    _, grow, slack, _ = _limits(dtype)
    return x * grow + slack


@dataclass(frozen=True)
class Update:
    """What one parameter's step is bounded by, given the old bounds and ``G``."""

    state: dict[str, float]  # each new state tensor's bound
    peak: float  # the largest intermediate value of the state's update
    scale: float | None  # |p'| <= scale |p| + move; None: the rule does not bound the parameter (it is read)
    move: float = 0.0


@functools.lru_cache(maxsize=64)
def _as_held(x: float, dtype: torch.dtype) -> float:
    """``x`` as ``dtype`` holds it (float16 rounds 1e-8 to 0)."""
    return float(torch.tensor(x, dtype=dtype))


def _adam(group: dict[str, Any], fresh: bool, g: float, old: Old, decoupled: bool, dtype: torch.dtype) -> Update | None:
    if group.get("fused") or group.get("capturable") or group.get("differentiable") or \
            (group.get("weight_decay") and not decoupled):
        return None
    betas, lr, wd, eps = pair(group.get("betas")), real(group.get("lr")), real(group.get("weight_decay") or 0.0), \
        real(group.get("eps"))
    m, v = (0.0, 0.0) if fresh else (old("exp_avg"), old("exp_avg_sq"))
    if m is None or v is None or betas is None or lr is None or wd is None or eps is None or \
            not (0 <= betas[0] <= 1 and 0 <= betas[1] <= 1):
        return None
    b1, b2 = betas
    count = 0.0 if fresh else old("step")  # a float tensor that counts the steps
    if count is None:
        return None
    new = {"exp_avg": b1 * m + (1 - b1) * g, "exp_avg_sq": b2 * v + (1 - b2) * g * g, "step": count + 1}
    if group.get("amsgrad"):
        top = 0.0 if fresh else old("max_exp_avg_sq")
        if top is None:
            return None
        new["max_exp_avg_sq"] = max(top, new["exp_avg_sq"])
    peak = max(g + m, g * g, v)
    eps = _as_held(eps, dtype)  # the denominator's floor
    if not (eps > 0 and b1 < 1 and math.sqrt(1 - b2) >= _limits(dtype)[3]  # beta2 = 1 too: sqrt(0) is no normal
            and math.isfinite(lr) and math.isfinite(lr * wd)):
        return Update(new, peak, None)
    ratio = _up(new["exp_avg"], dtype) / eps  # |m' / denominator|, with m' as large as its rounded-up bound
    move = abs(lr) / (1 - b1) * ratio
    return Update(new, max(peak, ratio, move), abs(1 - lr * wd), move)


def _sgd(group: dict[str, Any], fresh: bool, g: float, old: Old, decoupled: bool, dtype: torch.dtype) -> Update | None:
    if group.get("fused") or group.get("differentiable") or group.get("weight_decay"):
        return None
    lr, momentum, dampening = real(group.get("lr")), real(group.get("momentum")), real(group.get("dampening") or 0.0)
    if lr is None or momentum is None or dampening is None:
        return None
    lr, momentum = abs(lr), abs(momentum)
    if momentum == 0:
        return Update({}, lr * g, 1.0, lr * g)
    if fresh:
        buf = g
    else:
        held = old("momentum_buffer")
        if held is None:
            return None
        buf = momentum * held + abs(1 - dampening) * g  # its intermediates, each at most buf, are bounded with it
    direction = g + momentum * _up(buf, dtype) if group.get("nesterov") else _up(buf, dtype)
    return Update({"momentum_buffer": buf}, max(direction, lr * direction), 1.0, lr * direction)


_RULES = {torch.optim.Adam: _adam, torch.optim.AdamW: _adam, torch.optim.SGD: _sgd}


def provable(optimizer: torch.optim.Optimizer) -> bool:
    """Whether a proof can be kept for this optimizer: a known class (not a subclass), parameters not sharded."""
    return type(optimizer) in _RULES and not any(is_dtensor(p) for g in optimizer.param_groups for p in g["params"])


class StepProof:
    """Bounds on one optimizer's state tensors and parameters, carried through each ``step()`` by its update rule."""

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.optimizer = optimizer
        self.rule = _RULES[type(optimizer)]
        self.decoupled = type(optimizer) is torch.optim.AdamW
        # param -> key -> (the tensor, its version counter, a bound on its magnitude) when last known; key: a state
        # key, or None for the parameter itself (an event's state_key for it)
        self._known: dict[torch.Tensor, dict[str | None, tuple[torch.Tensor, int, float]]] = {}
        # the bounds of what the running step writes: its state by key, and the parameter (None: not bounded)
        self._expected: dict[torch.Tensor, tuple[dict[str, float], float | None]] = {}
        self.unproven: list[torch.Tensor] = []  # after before_step: what it could not prove finite

    def _bound(self, p: torch.Tensor, key: str) -> float | None:
        held = self._known.get(p, {}).get(key)
        t = self.optimizer.state.get(p, {}).get(key)
        if held is None or held[0] is not t or held[0]._version != held[1]:
            return None
        return held[2]

    def covers(self, group: dict[str, Any]) -> bool:
        """Whether the rule bounds this group's update at all (not: L2 weight decay, fused, capturable, ...),
        whatever the magnitudes."""
        decoupled = self.decoupled or bool(group.get("decoupled_weight_decay"))
        return self.rule(group, True, 0.0, lambda key: 0.0, decoupled, torch.float32) is not None

    def before_step(self, grad_max: dict[torch.Tensor, float]) -> None:
        """In the optimizer's pre-hook: the bounds of what this step writes, from ``grad_max`` (each parameter's
        largest gradient magnitude, as the optimizer sees it). What has no proof is read after the step; ``unproven``
        lists the parameters with a gradient whose new state and parameter are not both proven finite."""
        self._expected = {}
        unproven = self.unproven = []
        for group in self.optimizer.param_groups:
            decoupled = self.decoupled or bool(group.get("decoupled_weight_decay"))
            for p in group["params"]:
                if p.grad is None:
                    continue  # the optimizer skips it: it, its state, and what is known of them stay as they are
                g = grad_max.get(p)
                new = None if g is None or p.is_complex() or not math.isfinite(g) else \
                    self.rule(group, not self.optimizer.state.get(p), g, lambda key: self._bound(p, key), decoupled,
                              p.dtype)
                held = self._known.pop(p, {}).get(None)  # the step writes the state and the parameter: what held before
                limit = _limits(p.dtype)[0]
                bounds = {k: _up(b, p.dtype) for k, b in new.state.items()} if new is not None else {}
                if new is None or not all(b <= limit for b in [*bounds.values(), _up(new.peak, p.dtype)]):  # NaN too
                    unproven.append(p)
                    continue
                param = None
                if new.scale is not None and held is not None and held[1] == p._version:
                    param = _up(_up(held[2] * new.scale + new.move, p.dtype), p.dtype)  # decay, then the move
                self._expected[p] = bounds, param if param is not None and param <= limit else None
                if self._expected[p][1] is None:
                    unproven.append(p)

    def after_step(self) -> None:
        """In the optimizer's post-hook: the state and parameters the step wrote, with their proven bounds."""
        for p, (bounds, param) in self._expected.items():
            state = self.optimizer.state.get(p, {})
            self._known[p] = {k: (state[k], state[k]._version, b) for k, b in bounds.items()
                              if isinstance(state.get(k), torch.Tensor)}
            if param is not None:
                self._known[p][None] = (p, p._version, param)
        self._expected = {}

    def proven(self, p: torch.Tensor, key: str | None, t: torch.Tensor) -> bool:
        """True when ``t``, ``p``'s state ``key`` (``p`` itself where ``key`` is None), is proven finite: need not be
        read."""
        held = self._known.get(p, {}).get(key)
        return held is not None and held[0] is t and t._version == held[1] and held[2] <= _limits(t.dtype)[0]

    def learn(self, p: torch.Tensor, key: str | None, t: torch.Tensor, max_abs: float) -> None:
        """An exact read of a finite state tensor (of ``p`` itself where ``key`` is None): its bound from now on."""
        self._known.setdefault(p, {})[key] = (t, t._version, max_abs)

    def forget(self) -> None:
        """Nothing is known any more (a step checked in locate mode, where no bound is kept)."""
        self._known.clear()
        self._expected = {}


# ---- the guard's use: skip an update that would make a non-finite value from finite gradients --------------------


@dataclass(frozen=True)
class Hazard:
    """What the update of ``param`` (its position in the optimizer's order) would make non-finite: ``state`` is the
    state key, or ``"param"`` for the parameter itself; the first such coordinate and the value it would hold."""

    param: int
    state: str
    index: list[int]
    value: str  # "nan", "inf" or "-inf"


def max_abs(tensors: list[torch.Tensor]) -> list[float]:
    """Each tensor's largest magnitude (NaN where it holds a NaN, inf an infinity), read with one host
    synchronisation: ``aminmax`` per tensor (exact; on CPU 1.4x the gradient check's read, where ``_foreach_norm`` of
    order inf takes 7x)."""
    out = []
    for t in tensors:
        lo, hi = min_max(t)  # a sparse tensor's stored values
        out.append(torch.maximum(hi, -lo).float())
    return torch.stack([m.to(out[0].device) for m in out]).tolist() if out else []  # .tolist(): the one wait


class UpdateCheck:
    """The proof, as the guard uses it before a step: where ``StepProof`` bounds the update below the dtype's
    largest value, the step is finite; where it cannot (a huge gradient, a bound grown large, ``eps`` 0 in the dtype),
    the real optimizer's step runs on a copy of that parameter and its state, and its result decides: exact, so a
    healthy step is never skipped. Groups the rule does not cover (``covers``) are checked for finite gradients
    alone. The bounds are carried from step to step; an unknown one (the first step, a tensor written by anything but
    the step) is read exactly first."""

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.optimizer = optimizer
        self.proof = StepProof(optimizer)
        self.trials = 0  # steps run on a copy: the proof could not decide

    def uncovered(self) -> list[int]:
        """The groups checked for finite gradients alone."""
        return [g for g, group in enumerate(self.optimizer.param_groups) if not self.proof.covers(group)]

    def hazard(self, grad_max: dict[torch.Tensor, float]) -> Hazard | None:
        """Before the step: the first non-finite value it would make from these finite gradients, or None."""
        covered = [p for group in self.optimizer.param_groups if self.proof.covers(group) for p in group["params"]
                   if p.grad is not None]
        unknown = [(p, key, t) for p in covered for key, t in self._tensors(p) if not self.proof.proven(p, key, t)]
        for (p, key, t), m in zip(unknown, max_abs([t for _, _, t in unknown])):
            self.proof.learn(p, key, t, m)
        self.proof.before_step({p: grad_max[p] for p in covered if p in grad_max})
        unproven = set(self.proof.unproven) & set(covered)
        position = 0
        for group in self.optimizer.param_groups:
            for p in group["params"]:
                if p in unproven:
                    self.trials += 1
                    found = self._trial(group, p)
                    if found is not None:
                        return Hazard(position, *found)
                position += 1
        return None

    def after_step(self) -> None:
        self.proof.after_step()

    def _tensors(self, p: torch.Tensor) -> list[tuple[str | None, torch.Tensor]]:
        state = self.optimizer.state.get(p, {})
        return [(None, p)] + [(k, v) for k, v in state.items() if isinstance(v, torch.Tensor) and v.is_floating_point()]

    def _trial(self, group: dict[str, Any], p: torch.Tensor) -> tuple[str, list[int], str] | None:
        """The real step of this optimizer class on a copy of ``p``, its gradient and its state: the first non-finite
        value it makes (state first, then the parameter), or None."""
        q = p.detach().clone()
        q.grad = p.grad.detach().clone()
        try:
            copy = type(self.optimizer)([{**group, "params": [q]}])
            copy.state[q] = {k: v.clone() if isinstance(v, torch.Tensor) else v
                             for k, v in self.optimizer.state.get(p, {}).items()}
            with torch.no_grad():
                copy.step()
        except (ValueError, TypeError, RuntimeError):
            return None  # settings the constructor refuses now: the real step meets them itself, as unguarded
        for key, t in [*copy.state[q].items(), ("param", q)]:
            if isinstance(t, torch.Tensor) and t.is_floating_point():
                where = locate(t)  # None where it is finite
                if where is not None:
                    return key, list(where.index), where.value
        return None
