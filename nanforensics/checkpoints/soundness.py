"""Optimizer state that is finite but unsound: values the optimizer's own arithmetic cannot produce, and
hyperparameters that make the next update non-finite.

A run resumed from such a checkpoint reads finite weights and a finite first loss, then goes NaN at the first
update (or a few later). What is checked, by optimizer (recognised by its state keys and group hyperparameters):

- every second-moment-like tensor is >= 0 (Adam's ``exp_avg_sq`` and ``max_exp_avg_sq``, Adamax's ``exp_inf``,
  RMSprop's ``square_avg``, Adagrad's ``sum``, Adadelta's ``acc_delta``, torch's Adafactor ``row_var``,
  ``col_var`` and ``variance``, transformers' Adafactor ``exp_avg_sq_row`` and ``exp_avg_sq_col``);
- amsgrad: ``max_exp_avg_sq >= exp_avg_sq`` (torch keeps the running maximum);
- Adam's bound (Adam, AdamW, NAdam, RAdam: ``exp_avg`` and ``exp_avg_sq`` with the group's ``betas``). With
  m_t = (1-b1) sum_k b1^(t-k) g_k and v_t = (1-b2) sum_k b2^(t-k) g_k^2, Cauchy-Schwarz on
  sum_k (b1^(t-k) / b2^((t-k)/2)) * (b2^((t-k)/2) g_k) gives
  |m_t| <= (1-b1) sqrt(sum_j (b1^2/b2)^j) sqrt(v_t/(1-b2)) <= (1-b1) / sqrt((1-b2)(1-b1^2/b2)) * sqrt(v_t),
  whatever the gradients were (7.27 sqrt(v) at the defaults; it needs b1^2 < b2). Clipping, weight decay,
  unscaling and fused or foreach kernels change the gradients, not the averages, so the bound holds for them;
  a pair that breaks it did not come from the same gradients (one moment restored without the other, rescaled,
  corrupted), or the run changed its betas;
- each state tensor's shape and dtype against its parameter's, where the checkpoint names the parameters: torch
  keeps state in the parameter's dtype, and state saved in a narrower one lost its precision on the way;
- ``step``: a number >= 0, the same across a group, not past the checkpoint's own step, and not 0 beside moments
  that hold values (a counter reset with the moments kept);
- hyperparameters (lr, eps, weight_decay, betas, momentum, ...) finite and in range; a loss scale finite and > 0;
- the latent hazard of ``eps = 0`` beside second moments that hold exact zeros: the first zero gradient there
  makes the update 0/0.

SGD's momentum buffer is bounded by nothing else the checkpoint holds: for SGD with momentum, shape, dtype and the
hyperparameters are checked. Tensors are held only until their parameter's state is complete, then read in the
scan's own pass (``chunks.walk``): each chunk once, for its finiteness and these checks, its pages handed back.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Iterator, Mapping

import torch

from ..formats import MODEL, OPTIMIZER, CheckpointSource, TensorInfo, torch_file, zero
from ..formats.source import BUFFER_NAMES, Release, lightning_parts
from ..formats.training_state import MODEL_KEYS
from ..inputs import TensorFile
from ..numbers import pair, real, root
from ..report import Event, Unsound
from ..runs.checkpoint import EXTRAS_FILE, Checkpoint, param_names, state_from_json
from ..words import count
from .chunks import walk

# The checks, as named in findings
NEGATIVE, AMSGRAD, BOUND, SHAPE, DTYPE, STEP, HYPERPARAMETER, LOSS_SCALE, EPS_ZERO = (
    "negative_second_moment", "amsgrad_max_below_second_moment", "adam_bound", "shape", "dtype", "step",
    "hyperparameter", "loss_scale", "eps_zero")
ELEMENTWISE = (NEGATIVE, AMSGRAD, BOUND)  # the checks whose flagged coordinates a reset can zero

NONNEGATIVE = ("exp_avg_sq", "max_exp_avg_sq", "exp_inf", "square_avg", "sum", "acc_delta", "row_var", "col_var",
               "variance", "exp_avg_sq_row", "exp_avg_sq_col")
PER_ELEMENT = ("exp_avg", "exp_avg_sq", "max_exp_avg_sq", "momentum_buffer", "exp_inf", "square_avg", "sum",
               "acc_delta", "grad_avg", "ax", "eta", "prev")  # laid out like the parameter
FACTORED = ("row_var", "col_var", "variance")  # torch's Adafactor: the parameter's shape with some dims 1
SCALER_KEYS = ("scaler", "grad_scaler", "scaler_state_dict", "amp_scaler", "native_amp_scaling_state")
_RANGES: dict[str, tuple[float, float, bool]] = {  # key: (low, high, high included)
    "lr": (0.0, math.inf, False), "initial_lr": (0.0, math.inf, False), "eps": (0.0, math.inf, False),
    "weight_decay": (0.0, math.inf, False), "momentum": (0.0, 1.0, True), "dampening": (-math.inf, math.inf, False),
    "alpha": (0.0, math.inf, False), "rho": (0.0, 1.0, True), "beta2_decay": (-math.inf, 0.0, True),
    "d": (0.0, math.inf, False), "lr_decay": (0.0, math.inf, False), "lambd": (0.0, math.inf, False),
}


@dataclass
class Soundness:
    """How one checkpoint's optimizer state was checked beyond finiteness (the findings are ``unsound`` beside it)."""

    optimizers: list[str]  # recognised, per param group: "Adam-family ...", "SGD with momentum", "Adafactor ..."
    notes: list[str] = field(default_factory=list)  # what was not checked, and why
    matched_by_order: bool = False  # the state names no parameters: matched by the optimizer's order (the notes say
    # whether the model's state dict named them, verified by shapes, or they stay #i)


def adam_bound(beta1: float, beta2: float) -> float | None:
    """(1-b1)/sqrt((1-b2)(1-b1^2/b2)): |exp_avg| <= this * sqrt(exp_avg_sq) for any gradients; None where b1^2 >= b2
    (no such bound) or the betas are out of range."""
    if not (0 <= beta1 < 1 and 0 < beta2 < 1) or beta1 * beta1 >= beta2:
        return None
    return (1 - beta1) / math.sqrt((1 - beta2) * (1 - beta1 * beta1 / beta2))


CHECK_ROUNDING = 16 * 2.0 ** -24  # the check's own float32 arithmetic, with room for the screen (``_suspect``)


def _tolerance(dtype: torch.dtype, beta1: float, beta2: float, bound: float) -> tuple[float, float]:
    """Relative and absolute slack for rounding: a few units in the last place of the state's dtype, and the
    moments of gradients so small that (1-b2) g^2 falls below the dtype's smallest normal number.

    The relative slack: each step rounds m once (lerp) and v twice (mul, addcmul), by at most u = eps/2 of the state's
    dtype. The bound is reached only by gradients growing as (b2/b1)^t, where each step's terms outweigh the decayed
    older ones: the rounding errors of step t-j weigh (b1^2/b2)^j against m_t and sqrt(v_t) (v's two roundings halved
    by the root), so m and sqrt(v) are each off by at most u / (1 - b1^2/b2) relative, 2u / (1 - b1^2/b2) in all
    (5 units in the last place at the default betas: 6e-7 in float32, 0.04 in bfloat16), plus the float32 arithmetic
    of the check."""
    info = torch.finfo(dtype)
    return info.eps / (1 - beta1 * beta1 / beta2) + CHECK_ROUNDING, bound * math.sqrt(info.tiny / (1 - beta2))


def _betas(hyper: Mapping[str, Any]) -> tuple[float, float] | None:
    return pair(hyper.get("betas"))


def optimizer_kind(hyper: Mapping[str, Any], keys: Iterable[str]) -> str:
    """What a param group's state is checked as, by its state keys (its hyperparameters alone before any step)."""
    keys = set(keys)
    if "exp_avg_sq_row" in keys or "row_var" in keys or "beta2_decay" in hyper or "decay_rate" in hyper:
        return "Adafactor (factored second moments)"
    if "exp_inf" in keys:
        return "Adamax"
    if _betas(hyper) is not None and ({"exp_avg", "exp_avg_sq"} <= keys or not keys - {"step"}):
        return "Adam-family (Adam, AdamW, NAdam, RAdam)" + (" with amsgrad" if hyper.get("amsgrad") else "")
    if "momentum_buffer" in keys or (not keys and (real(hyper.get("momentum")) or 0) > 0):
        return "SGD with momentum"
    return "other (checked: non-negative second moments, shapes, dtypes, step, hyperparameters)"


# ---- the layout: param groups, parameter names and state scalars, from the checkpoint's own metadata ----------


@dataclass
class _Param:
    label: str  # model name, or "#i"
    group: int
    scalars: dict[str, Any] = field(default_factory=dict)  # non-tensor state (an int step of older torch)


@dataclass
class _Layout:
    groups: list[dict[str, Any]]  # hyperparameters, per group
    params: dict[str, _Param]  # by the stream-name prefix of its state tensors
    named: bool
    scaler: Any = None
    exact_step: bool = False  # the checkpoint's step counts the optimizer steps before it (our run format)
    by_order: bool = False  # the names come from the model's order (verified by shapes), not from the state
    why_unnamed: str = ""  # where the parameters are ``#i``: why the model's order could not name them
    misfit: "Misfit | None" = None  # the first position whose state does not fit the model's parameter there


def _hyper(group: Mapping[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in group.items() if k not in ("params", "param_names")}


def _layout(source: CheckpointSource, order_names: list[str] | None) -> _Layout | None:
    """Param groups and parameter names as the checkpoint records them; None where it records none (a bare
    safetensors file, a torch.distributed.checkpoint folder of another tool)."""
    if (source.path / "meta.json").is_file() and source.format in ("nanforensics", "dcp"):
        return _ours(source)
    if source.format == zero.FORMAT:
        return _zero(zero.read(source.files[0][0].parent))  # the global_stepN folder, given or named by latest
    files = [f for f, group in source.files if group in (None, OPTIMIZER) and f.suffix != ".safetensors"
             and f.name != ".metadata"]
    layouts = [_of_object(torch_file.load(f)[0], order_names) for f in files]
    found = [lay for lay in layouts if lay is not None]
    return found[0] if len(found) == 1 else None


def _ours(source: CheckpointSource) -> _Layout:
    """From ``meta.json`` (``Checkpoint.meta`` checked its schema: groups of named parameters, scalars by name)."""
    ck = Checkpoint(source.path, -1)
    meta = ck.meta()
    prefix = "optim.state." if source.format == "dcp" else ""
    groups, params = [], {}
    scalars = meta["state_scalars"]
    for g, group in enumerate(meta["param_groups"]):
        groups.append(_hyper(group))
        for name in group["params"]:
            own = scalars.get(str(name))
            params[prefix + str(name)] = _Param(str(name), g, dict(own) if isinstance(own, dict) else {})
    scaler = state_from_json(meta["scaler"], lambda: TensorFile(ck.path / EXTRAS_FILE), ck.path / "meta.json") \
        if "scaler" in meta else None
    return _Layout(groups, params, True, scaler, exact_step=True)


def _zero(z: zero.Layout) -> _Layout:
    """A DeepSpeed ZeRO checkpoint: the base optimizer's groups, each parameter named by ``param_shapes`` with the
    step of the flat partition it lies in (formats.zero)."""
    params = {s.name: _Param(s.name, s.group, {"step": zero.step_of(s, z)}) for s in z.slots}
    return _Layout(z.hyper, params, True, z.scaler)


def _of_object(obj: Any, order_names: list[str] | None) -> _Layout | None:
    """The layout of the one optimizer state dict in a loaded checkpoint; a parameter the state does not name is
    ``#i`` by its position in the optimizer's order, or ``order_names[i]`` where the caller matched them by order."""
    parts = lightning_parts(obj)
    found = list(_optimizer_dicts(parts[1] if parts else obj, ("optimizer_states",) if parts else ()))
    if len(found) != 1:
        return None
    prefix, sd = found[0]
    groups, params, named, states = [], {}, True, []
    if not _groups_shaped(sd["param_groups"]):
        return None
    for g, group in enumerate(sd["param_groups"]):
        groups.append(_hyper(group))
        names = group.get("param_names") if isinstance(group.get("param_names"), list) else None
        named = named and names is not None and len(names) == len(group["params"])
        for i, pid in enumerate(group["params"]):
            label = str(names[i]) if names is not None and i < len(names) else str(pid)
            state = sd["state"].get(pid, {}) if isinstance(pid, (int, str)) else {}
            state = state if isinstance(state, dict) else {}
            states.append(state)
            own = label if names is not None else order_names[len(states) - 1] \
                if order_names is not None and len(states) <= len(order_names) else f"#{len(states) - 1}"
            params[".".join(prefix + ("state", label))] = _Param(
                own, g, scalars={k: v for k, v in state.items() if not isinstance(v, torch.Tensor)})
    scaler = next((obj[k] for k in SCALER_KEYS if isinstance(obj, dict) and isinstance(obj.get(k), dict)), None)
    layout = _Layout(groups, params, named, scaler)
    if not named and order_names is None:
        _name_by_order(layout, states, _model_dict(obj, parts))
    return layout


@dataclass(frozen=True)
class Misfit:
    """A position of the optimizer's order whose state does not fit the model's parameter at that position."""

    position: int
    key: str
    state_shape: list[int]
    param: str
    param_shape: list[int]


def fits(key: str, state: tuple[int, ...], param: tuple[int, ...]) -> bool:
    """Whether state ``key`` of this shape can be a parameter's of that shape: torch lays the per-element state out
    like the parameter, a factored moment (Adafactor's) with some dims 1; other keys are not known, so they fit."""
    if key in PER_ELEMENT:
        return state == param
    if key in FACTORED:
        return len(state) == len(param) and all(s in (1, p) for s, p in zip(state, param))
    return True


def per_element(key: str, t: torch.Tensor) -> bool:
    """Whether a state tensor is one the elementwise checks read and a reset zeroes: floating point, strided, laid out
    like its parameter (of rank 1 or more, or a known per-element key: a scalar parameter's moments are 0-d like the
    step counter beside them, which is not one)."""
    return t.is_floating_point() and t.layout == torch.strided and (t.dim() > 0 or key in PER_ELEMENT or key in FACTORED)


def _model_dict(obj: Any, parts: tuple[dict[str, Any], Any] | None) -> dict[str, torch.Tensor] | None:
    """The model's state dict beside the optimizer's in one ``torch.save`` object (Lightning's ``state_dict``), in
    the order ``state_dict()`` wrote it; None where there is none."""
    if parts is not None:
        return {k: v for k, v in parts[0].items() if isinstance(v, torch.Tensor)}
    for key in MODEL_KEYS:
        value = obj.get(key) if isinstance(obj, dict) else None
        if isinstance(value, dict) and value and all(isinstance(v, torch.Tensor) for v in value.values()):
            return value
    return None


MAX_SKIPPED = 64  # model tensors beyond the optimizer's positions that the order match tells apart by shape


def _name_by_order(layout: _Layout, states: list[dict[str, Any]], model: dict[str, torch.Tensor] | None) -> None:
    """Name the parameters as ``optimizer.load_state_dict`` matches them, by order: the model's tensors in its state
    dict's order, buffers skipped (BatchNorm's by name; others, as many as the model holds beyond the optimizer's
    positions, wherever the state's shapes fit), each position's state shapes verified against its parameter. Named
    only where exactly one such alignment exists; where none does, the first position no alignment reaches is a
    misfit (a finding with one group: a group built from ``model.parameters()`` follows its order; with several,
    their order need not be the model's)."""
    if model is None:
        layout.why_unnamed = "the checkpoint holds no model state dict beside it to match them with"
        return
    candidates = [(n, tuple(t.shape)) for n, t in model.items() if n.rpartition(".")[2] not in BUFFER_NAMES]
    surplus = len(candidates) - len(states)
    if not 0 <= surplus <= MAX_SKIPPED:
        layout.why_unnamed = (f"the optimizer holds {len(states)} parameters, the model's state dict {len(candidates)} "
                              "tensors besides BatchNorm's buffers: too " + ("few" if surplus < 0 else "many others")
                              + " to match them by order")
        return
    shapes = [{k: tuple(v.shape) for k, v in state.items() if isinstance(v, torch.Tensor)} for state in states]

    def fit(i: int, skipped: int) -> bool:
        return all(fits(k, shape, candidates[i + skipped][1]) for k, shape in shapes[i].items())

    # ways[i][s]: alignments of positions i.. with s model tensors skipped before them (counted up to 2)
    n = len(states)
    ways = [[0] * (surplus + 1) for _ in range(n)] + [[1] * (surplus + 1)]
    for i in range(n - 1, -1, -1):
        for skipped in range(surplus, -1, -1):
            here = ways[i + 1][skipped] if fit(i, skipped) else 0
            ways[i][skipped] = min(2, here + (ways[i][skipped + 1] if skipped < surplus else 0))
    if n and ways[0][0] == 0:
        _misfit(layout, shapes, candidates, surplus, fit)
        return
    if n and ways[0][0] > 1:
        layout.why_unnamed = (f"the model's state dict holds {surplus} tensors beyond the optimizer's parameters, and "
                              "more than one choice of them as buffers fits the state's shapes")
        return
    names, skipped = [], 0
    for i in range(n):
        while skipped < surplus and ways[i][skipped + 1]:
            skipped += 1  # the one alignment skips a buffer here
        names.append(candidates[i + skipped][0])
    for param, name in zip(layout.params.values(), names):
        param.label = name
    layout.named = layout.by_order = True


def _misfit(layout: _Layout, shapes: list[dict[str, tuple[int, ...]]], candidates: list[tuple[str, tuple[int, ...]]],
            surplus: int, fit: Callable[[int, int], bool]) -> None:
    """The first position no alignment reaches, against the model's tensor the fewest skips put there."""
    reach = set(range(surplus + 1))
    position = 0
    while True:
        matched = {s for s in reach if fit(position, s)}
        if not matched:
            break
        reach = set(range(min(matched), surplus + 1))
        position += 1
    skipped = min(reach)
    name, shape = candidates[position + skipped]
    bad = next(k for k, s in shapes[position].items() if not fits(k, s, shape))
    if len(layout.groups) == 1:
        layout.misfit = Misfit(position, bad, list(shapes[position][bad]), name, list(shape))
    layout.why_unnamed = (f"matched by order to the model's state dict, position {position}'s {bad} "
                          f"{list(shapes[position][bad])} does not fit {name} {list(shape)}"
                          + ("" if len(layout.groups) == 1 else
                             ", and with several groups their order need not be the model's"))


def _groups_shaped(groups: Any) -> bool:
    return isinstance(groups, list) and all(isinstance(g, dict) and isinstance(g.get("params"), list) for g in groups)


def _optimizer_dicts(obj: Any, prefix: tuple[str, ...] = ()) -> Iterator[tuple[tuple[str, ...], dict[str, Any]]]:
    """Every dict shaped like ``optimizer.state_dict()`` with the path ``formats.source.tree_tensors`` names its
    tensors by."""
    if isinstance(obj, dict):
        if isinstance(obj.get("state"), dict) and isinstance(obj.get("param_groups"), list):
            yield prefix, obj
            return
        for key, value in obj.items():
            yield from _optimizer_dicts(value, prefix + (str(key),))
    elif isinstance(obj, (list, tuple)):
        for i, value in enumerate(obj):
            yield from _optimizer_dicts(value, prefix + (str(i),))


def _split(name: str) -> tuple[str, str]:
    """A state tensor's name as (its parameter's prefix, its state key): ``fc1.weight/exp_avg``,
    ``optimizer.state.0.exp_avg``."""
    head, sep, key = name.rpartition("/")
    return (head, key) if sep else name.rpartition(".")[::2]


# ---- the checks -----------------------------------------------------------------------------------------------


@dataclass
class _Held:
    info: TensorInfo
    tensor: torch.Tensor
    release: Release


@dataclass
class _Tally:
    """A check's count over a tensor, and its first flagged coordinate with the values there."""

    count: int = 0
    first: int | None = None
    values: dict[str, float] = field(default_factory=dict)


def _adam_terms(state: Mapping[str, torch.Tensor], hyper: Mapping[str, Any]) -> tuple[float, float, float] | None:
    """Adam's bound on |m| / sqrt(v) for these betas with its relative and absolute slack, where the state holds both
    moments and the betas bound them: one place, so ``flags`` and its screen ``_suspect`` hold the same bound."""
    betas = _betas(hyper)
    limit = adam_bound(*betas) if betas is not None and "exp_avg" in state and "exp_avg_sq" in state else None
    if betas is None or limit is None:
        return None
    return (limit, *_tolerance(hyper.get("_dtype", torch.float32), betas[0], betas[1], limit))


def flags(state: Mapping[str, torch.Tensor], hyper: Mapping[str, Any]) -> dict[str, torch.Tensor]:
    """The elementwise checks on one parameter's state (whole tensors or matching chunks, float32): a mask per
    ``check:key`` of the coordinates that break it."""
    out = {}
    for key in NONNEGATIVE:
        if key in state:
            out[f"{NEGATIVE}:{key}"] = state[key] < 0
    if "max_exp_avg_sq" in state and "exp_avg_sq" in state:
        out[f"{AMSGRAD}:max_exp_avg_sq"] = state["max_exp_avg_sq"] < state["exp_avg_sq"]
    bound = _adam_terms(state, hyper)
    if bound is not None:
        limit, rtol, atol = bound
        v = state["exp_avg_sq"]
        # a negative v is its own finding
        out[f"{BOUND}:exp_avg"] = (state["exp_avg"].abs() > limit * v.clamp(min=0).sqrt() * (1 + rtol) + atol) & (v >= 0)
    return out


def _suspect(state: Mapping[str, torch.Tensor], minima: Mapping[str, float], hyper: Mapping[str, Any],
             scratch: torch.Tensor) -> bool:
    """Whether ``flags`` could flag anything in this chunk (finite float32 state), by reductions over one reused
    ``scratch`` buffer: at most two passes over a chunk still in cache where the masks take a dozen, and fresh
    allocations would fault in their pages every chunk (the masks are built only for a chunk found suspect).
    ``minima``: each tensor's minimum over the chunk as stored, which the scan's finiteness pass computed already: the
    signs of the second moments cost no pass (rounding to the compared dtype is monotone and keeps 0, so a stored
    minimum >= 0 leaves every compared value >= 0).

    Adam's bound is screened as min(v - m^2/K^2) >= -atol^2/(2K^2), K = k(1 + r/2) (half the slack ``flags``
    allows): a coordinate that ``flags`` marks has |m| > k(1+r) sqrt(v) + atol, so v - m^2/K^2 < -r(k/K)^2 v -
    atol^2/K^2, a margin float32's rounding (relative 2^-24 a product, three of them; r/2 >= 8 * 2^-24) cannot
    close. An m^2/K^2 that overflows gives -inf, suspect. A slack below 2^-140 (float64 state) is not screened:
    beside it, float32's underflow (2^-149) is no longer small."""
    if any(minima[key] < 0 for key in NONNEGATIVE if key in state):
        return True
    out = scratch[:next(iter(state.values())).numel()]
    v = state.get("exp_avg_sq")
    bound = _adam_terms(state, hyper)
    if bound is not None:
        limit, rtol, atol = bound
        k = limit * (1 + rtol / 2)
        slack = atol * atol / (2 * k * k)
        m = state["exp_avg"]
        if slack < 2.0 ** -140 or float(torch.addcmul(v, m, m, value=-1 / (k * k), out=out).amin()) < -slack:
            return True
    # exact: a finite x > y never rounds x - y to 0 (gradual underflow)
    return "max_exp_avg_sq" in state and v is not None and bool(
        torch.sub(v, state["max_exp_avg_sq"], out=out).amax() > 0)


class _Elementwise:
    """The elementwise checks over same-sized state tensors of one parameter, fed their chunks as the scan reads them
    (``chunks.walk``): flags, zeros at eps = 0, and (for a step of 0) whether any moment holds a value."""

    def __init__(self, held: Mapping[str, _Held], hyper: Mapping[str, Any], step: float | None) -> None:
        self.held, self.hyper, self.step = held, hyper, step
        self.typed = {**hyper, "_dtype": held["exp_avg_sq"].tensor.dtype if "exp_avg_sq" in held else torch.float32}
        self.eps = real(hyper.get("eps"))
        self.denominator = "max_exp_avg_sq" if hyper.get("amsgrad") and "max_exp_avg_sq" in held else "exp_avg_sq"
        self.tallies: dict[str, _Tally] = {}
        self.zeros = _Tally()
        self.nonzero = False
        # tensors saved in different dtypes are compared at the coarsest one's precision: rounding is monotone, so an
        # order that held before the cast holds after it
        self.coarsest = max((h.tensor.dtype for h in held.values()), key=lambda d: torch.finfo(d).eps)
        # float32 chunks of other dtypes, and the screen's scratch, land in buffers reused chunk after chunk: fresh
        # ones would fault their pages in (made at the first chunk, the largest)
        self.buffers: dict[str, torch.Tensor] = {}

    def chunk(self, start: int, views: list[torch.Tensor], minima: list[float]) -> None:
        if not self.buffers:
            self.buffers = {k: torch.empty(views[0].numel(), dtype=torch.float32) for k, h in self.held.items()
                            if h.tensor.dtype != torch.float32 or self.coarsest != torch.float32}
            self.buffers[""] = torch.empty(views[0].numel(), dtype=torch.float32)
        chunk = {k: self.buffers[k][:v.numel()].copy_(v.to(self.coarsest)) if k in self.buffers else v
                 for k, v in zip(self.held, views)}
        if _suspect(chunk, dict(zip(self.held, minima)), self.typed, self.buffers[""]):
            for name, mask in flags(chunk, self.typed).items():
                _tally(self.tallies.setdefault(name, _Tally()), mask, start, chunk)
        if self.eps == 0 and self.denominator in chunk:
            _tally(self.zeros, chunk[self.denominator] == 0, start, chunk)
        if self.step == 0 and not self.nonzero:
            self.nonzero = any(bool(c.any()) for c in chunk.values())

    def report(self, found: Found) -> bool:
        """The findings; returns whether any moment holds a value (for a step of 0)."""
        shape = tuple(next(iter(self.held.values())).tensor.shape)
        for name, t in self.tallies.items():
            if t.count:
                check, key = name.split(":")
                found.add(check, key, _unravel(t.first, shape), t.values, _message(
                    check, key, found.label, _unravel(t.first, shape), t, self.hyper))
        zeros, denominator = self.zeros, self.denominator
        if zeros.count:
            where = _unravel(zeros.first, shape)
            both = zeros.values.get("exp_avg") == 0
            found.add(EPS_ZERO, denominator, where, zeros.values,
                      f"{denominator} of {found.label} holds {count(zeros.count, 'exact zero')} (first at {where}) and "
                      f"the group's eps is 0: the update divides by sqrt(v)+eps = 0 there, so the first zero gradient "
                      f"at such a coordinate makes it {'0/0 = NaN' if both else 'inf (and 0/0 = NaN where exp_avg is 0)'}")
        return self.nonzero


def _unravel(i: int, shape: tuple[int, ...]) -> list[int]:
    out = []
    for size in reversed(shape):
        out.append(i % size if size else 0)
        i //= size or 1
    return out[::-1]


class Checker:
    """Fed the checkpoint's tensors as the scan streams them; holds a parameter's state tensors until all have come,
    then hands them over together (``ParamState``), to be read once and checked."""

    def __init__(self, source: CheckpointSource, infos: list[TensorInfo], order_names: list[str] | None = None) -> None:
        self.source = source
        self.layout = _layout(source, order_names)
        self.expected: dict[str, int] = {}
        for info in infos:
            if info.group == OPTIMIZER:
                prefix = _split(info.name)[0]
                self.expected[prefix] = self.expected.get(prefix, 0) + 1
        self.model = {i.name: i for i in infos if i.group == MODEL}
        self.held: dict[str, dict[str, _Held]] = {}
        self.unsound: list[Unsound] = []
        self.steps: dict[int, list[tuple[float, str]]] = {}  # group: (step, param)
        self.kinds: dict[int, str] = {}
        self.unmatched: dict[str, list[str]] = {}  # a named parameter without one model tensor: the tensors it could be
        self.notes: list[str] = []
        if self.layout is None:
            self.notes.append("the checkpoint records no parameter groups: Adam's bound, the step and the "
                              "hyperparameters are not checked, only non-negative second moments and amsgrad's maximum")
        elif self.layout.by_order:
            self.notes.append("the optimizer state names no parameters: their names come from the model's state dict "
                              "by order (as optimizer.load_state_dict matches them), verified by the shapes of every "
                              "state tensor")
        elif not self.layout.named:
            self.notes.append("the optimizer state names no parameters (matched to them by order): shapes and dtypes "
                              "are not checked against the parameters, and a parameter is named by its position (#i)"
                              + (f": {self.layout.why_unnamed}" if self.layout.why_unnamed else ""))

    def feed(self, info: TensorInfo, tensor: torch.Tensor, release: Release) -> ParamState | None:
        """Holds an optimizer state tensor until its parameter's state is complete, and then returns that state, to be
        read and concluded."""
        if info.group != OPTIMIZER:
            return None
        prefix, key = _split(info.name)
        self.held.setdefault(prefix, {})[key] = _Held(info, tensor, release)
        if len(self.held[prefix]) == self.expected.get(prefix, 0):
            return ParamState(self, prefix, self.held.pop(prefix))
        return None

    def finish(self) -> Soundness:
        """The group checks once every tensor has come (parameters left incomplete by a scan that stopped early are
        not checked)."""
        if self.layout is not None:
            self._groups()
            self._scaler()
            self._misfit()
        self.notes += _unmatched_notes(self.unmatched, bool(self.model))
        kinds = [self.kinds.get(g, optimizer_kind(h, ())) for g, h in enumerate(self.layout.groups)] \
            if self.layout else []
        return Soundness(kinds, self.notes, matched_by_order=self.layout is not None and (
            not self.layout.named or self.layout.by_order))

    def _misfit(self) -> None:
        m = self.layout.misfit if self.layout else None
        if m is None:
            return
        tensor = f"{list(self.layout.params)[m.position]}.{m.key}"
        self.unsound.append(Unsound(
            SHAPE, tensor, f"#{m.position}", 0, None,
            {"position": m.position, "state_shape": m.state_shape, "param": m.param, "param_shape": m.param_shape},
            f"the optimizer state at position {m.position} ({m.key} {m.state_shape}) does not fit the model's parameter "
            f"at that position, {m.param} {m.param_shape}: optimizer.load_state_dict matches state to parameters by "
            "order, so a resume hands it a state of another shape (an error at the next update, or a wrong broadcast); "
            "the state belongs to another model, or parameters were added, removed or reordered since it was saved"))

    # -- per parameter --

    def _layout_checks(self, found: Found, entry: _Param, held: dict[str, _Held]) -> None:
        param = self._model_tensor(entry.label)
        if param is None:
            return
        for key, h in held.items():
            t = h.info
            # only the state torch lays out like the parameter: other keys (an 8-bit optimizer's, say) are not known
            if key not in PER_ELEMENT and key not in FACTORED or not t.dtype.is_floating_point \
                    or not param.dtype.is_floating_point:
                continue
            if not fits(key, tuple(t.shape), tuple(param.shape)):
                found.add(SHAPE, key, None, {"state_shape": list(t.shape), "param_shape": list(param.shape)},
                          f"{key} of {entry.label} is {list(t.shape)}, its parameter {list(param.shape)}: it belongs to "
                          "another parameter (or another model); torch's load_state_dict takes it unchecked, and the "
                          "next update fails to broadcast it or broadcasts it into a wrong update")
            narrower = torch.finfo(t.dtype).eps > torch.finfo(param.dtype).eps or \
                torch.finfo(t.dtype).max < torch.finfo(param.dtype).max
            if narrower:
                dt, pt = str(t.dtype).removeprefix("torch."), str(param.dtype).removeprefix("torch.")
                info = torch.finfo(t.dtype)
                flushed = f", values below {info.tiny:.1g} flushed towards 0" if info.max < 1e38 else ""
                found.add(DTYPE, key, None, {"state_dtype": dt, "param_dtype": pt},
                          f"{key} of {entry.label} is {dt}, its parameter {pt}: torch keeps state in the parameter's "
                          f"dtype, so this was converted on the way (on saving, or by a tool since) and lost precision "
                          f"(relative rounding up to {info.eps / 2:.1g}{flushed}); "
                          f"load_state_dict casts it back, and the next update runs on the rounded moments")

    def _model_tensor(self, label: str) -> TensorInfo | None:
        """The model's tensor of a parameter's name, else the one of the fewest parts whose name ends in "." and it (a
        wrapper's or the checkpoint's prefix: ``model.a.weight`` is a's, not the top-level ``weight``); None where none
        or several such do, the parameter then kept for the notes (``finish``): never skipped silently."""
        if label in self.model:
            return self.model[label]
        hits = [n for n in self.model if n.endswith("." + label)]
        fewest = [n for n in hits if n.count(".") == min(h.count(".") for h in hits)]
        if len(fewest) == 1:
            return self.model[fewest[0]]
        self.unmatched[label] = fewest
        return None

    def _step(self, found: Found, step: float, nonzero: bool, hyper: Mapping[str, Any]) -> None:
        ck_step = self.source.meta_step
        if not _is_count(step):
            found.add(STEP, "step", None, {"step": step},
                      f"step of {found.label} is {step}: not a count of updates; the next update's bias correction "
                      "1 - beta^step is then meaningless (NaN or a negative divisor)")
        elif step == 0 and nonzero:
            betas = _betas(hyper)
            scale = f" (the update scaled by sqrt(1-b2)/(1-b1) = {root(1 - betas[1]) / (1 - betas[0]):.2g} of " \
                    "what the moments' age gives)" if betas and betas[0] < 1 and 0 <= betas[1] <= 1 else ""
            found.add(STEP, "step", None, {"step": step, "checkpoint_step": ck_step},
                      f"step of {found.label} is 0 while its moments hold values: the counter was reset with the "
                      f"moments kept; the next update's bias correction divides them as if they held one gradient"
                      f"{scale}")
        elif ck_step is not None and step > ck_step + (0 if self.layout and self.layout.exact_step else 1):
            found.add(STEP, "step", None, {"step": step, "checkpoint_step": ck_step},
                      f"step of {found.label} is {step:g}, past the checkpoint's own step {ck_step}: the optimizer "
                      "state comes from a later point of training (or another run) than the weights beside it")

    # -- per group and checkpoint --

    def _groups(self) -> None:
        assert self.layout is not None
        for g, hyper in enumerate(self.layout.groups):
            for key, value in hyper.items():
                self._hyperparameter(g, key, value)
            betas = _betas(hyper)
            if betas is not None and self.kinds.get(g, "").startswith("Adam-family") and adam_bound(*betas) is None:
                self.notes.append(f"group {g}: betas {betas[0]:g}, {betas[1]:g} give no bound on |exp_avg| "
                                  "(it needs 0 <= b1 < 1, 0 < b2 < 1 and b1^2 < b2): Adam's bound not checked")
            steps = [(s, param) for s, param in self.steps.get(g, []) if _is_count(s)]  # the others: their own finding
            if steps and min(s for s, _ in steps) != max(s for s, _ in steps):
                lo, hi = min(steps), max(steps)
                self.unsound.append(Unsound(
                    STEP, f"param_groups[{g}].step", hi[1], g, None, {"min": lo[0], "max": hi[0], "min_param": lo[1]},
                    f"group {g}'s step counters differ: {lo[1]} at {lo[0]:g}, {hi[1]} at {hi[0]:g}: unless some "
                    "parameters had no gradient at some steps (torch skips them), the state was put together from "
                    "different points of training, and the next update corrects each bias by its own count"))

    def _hyperparameter(self, g: int, key: str, value: Any) -> None:
        values = value if key in ("betas", "eps") and isinstance(value, (list, tuple)) else [value]
        for i, item in enumerate(values):
            x = real(item)
            name = f"{key}[{i}]" if len(values) > 1 or key == "betas" else key
            if x is None:
                continue
            if key != "betas" and key not in _RANGES:
                continue
            lo, hi, closed = (0.0, 1.0, False) if key == "betas" else _RANGES[key]
            inside = math.isfinite(x) and lo <= x and (x <= hi if closed else x < hi)
            if not inside:
                self.unsound.append(Unsound(HYPERPARAMETER, f"param_groups[{g}].{name}", None, g, None, {name: x},
                                            f"group {g}'s {name} is {x:g}{_range(lo, hi, closed)}: "
                                            f"{_hyper_effect(key, x)}"))

    def _scaler(self) -> None:
        state = self.layout.scaler if self.layout else None
        scale = real(state.get("scale")) if isinstance(state, dict) else None
        if scale is None or (math.isfinite(scale) and scale > 0):
            return
        effect = ("every scaled gradient is inf or NaN, so the scaler skips every step and backs off to inf times its "
                  "backoff factor, still inf: training stops making progress, silently"
                  if math.isinf(scale) or math.isnan(scale) else
                  "every scaled loss is 0 and unscaling divides by it: the gradients are NaN, every step is skipped and "
                  "the scale never grows back from 0")
        self.unsound.append(Unsound(LOSS_SCALE, "scaler.scale", None, None, None, {"scale": scale},
                                    f"the loss scale is {scale:g}, not finite and positive: {effect}"))


class ParamState:
    """One parameter's optimizer state, complete: ``read`` reads its tensors once (their extremes, for the scan's
    finiteness) while the elementwise checks see each chunk; ``conclude`` makes the findings."""

    def __init__(self, checker: Checker, prefix: str, held: dict[str, _Held]) -> None:
        self.checker, self.held = checker, held
        layout = checker.layout
        self.entry = layout.params.get(prefix) if layout else None
        self.group = self.entry.group if self.entry else None
        self.hyper = layout.groups[self.group] if layout and self.group is not None else {}
        self.label = self.entry.label if self.entry else prefix
        self.step = real(held["step"].tensor) if "step" in held else \
            real(self.entry.scalars.get("step")) if self.entry else None
        tensors = {k: h for k, h in held.items() if per_element(k, h.tensor)}
        same = {k: h for k, h in tensors.items() if h.tensor.numel() == max(t.tensor.numel() for t in tensors.values())}
        # the same-sized tensors together; a factored moment on its own
        self.passes = ([_Elementwise(same, self.hyper, self.step)] if same else []) + [
            _Elementwise({k: h}, self.hyper, None) for k, h in tensors.items() if k not in same and k in NONNEGATIVE]

    def read(self) -> list[tuple[TensorInfo, tuple[float, float] | None]]:
        """Each tensor with its min and max where the checks read it (None: not read, as a step counter)."""
        extremes = {}
        for part in self.passes:
            held = list(part.held.values())
            extremes |= zip(part.held, walk([h.tensor for h in held], [h.release for h in held], part.chunk))
        return [(h.info, extremes.get(k)) for k, h in self.held.items()]

    def conclude(self, finite: bool) -> None:
        """The findings, unless a state tensor holds a non-finite value: the scan reports those."""
        if not finite:
            return
        checker, held, group, hyper = self.checker, self.held, self.group, self.hyper
        if group is not None:
            checker.kinds.setdefault(group, optimizer_kind(hyper, held))
        found = Found(checker, self.label, group, {k: h.info.name for k, h in held.items()})
        if self.entry is not None and checker.layout is not None and checker.layout.named:
            checker._layout_checks(found, self.entry, held)
        nonzero = any([part.report(found) for part in self.passes])  # only the first pass is given the step
        if self.step is not None and group is not None:
            checker._step(found, self.step, nonzero, hyper)
            checker.steps.setdefault(group, []).append((self.step, self.label))


def _unmatched_notes(unmatched: Mapping[str, list[str]], model: bool) -> list[str]:
    """What the shape and dtype checks left out: the parameters whose name no model tensor has, and those whose name
    several end in (two wrapped copies of a module, say: which one is its parameter, the checkpoint does not tell)."""
    if not model:
        return ["the checkpoint holds no model tensors: shapes and dtypes are not checked against the parameters"] \
            if unmatched else []
    missing = [label for label, hits in unmatched.items() if not hits]
    several = [f"{label} ({', '.join(hits)})" for label, hits in unmatched.items() if hits]
    return ([f"shapes and dtypes not checked for {count(len(missing), 'parameter')} the model's state dict holds no "
             f"tensor of: {_first(missing, ', ')}"] if missing else []) + (
        [f"shapes and dtypes not checked for {count(len(several), 'parameter')} whose name several model tensors end "
         f"in: {_first(several, '; ')}"] if several else [])


def _first(items: list[str], sep: str) -> str:
    """The first three, and "..." for the rest: a note stays one line however large the model."""
    return sep.join(items[:3]) + (" ..." if len(items) > 3 else "")


def _is_count(step: float) -> bool:
    """Whether a step counter counts updates: one that does not is a finding of its own, and compares with nothing
    (a NaN differs even from itself)."""
    return math.isfinite(step) and step >= 0 and step == int(step)


def _range(lo: float, hi: float, closed: bool) -> str:
    if math.isinf(lo) and math.isinf(hi):
        return ", not finite"
    high = f", {hi:g}{']' if closed else ')'}"
    return f", outside [{lo:g}{high}" if not math.isinf(lo) else f", outside (-inf{high}"


def _hyper_effect(key: str, x: float) -> str:
    if math.isnan(x):
        return "every update of the group computes with NaN: its parameters turn NaN at the next step"
    if key in ("lr", "initial_lr"):
        return ("the next update moves every parameter of the group by inf times its step direction: inf, and "
                "NaN (inf * 0) where the direction is 0" if math.isinf(x) else
                "a negative learning rate climbs the loss")
    if key == "eps":
        return "the update m/(sqrt(v)+eps) is 0: the group stops learning" if math.isinf(x) else \
            "a negative eps can make the denominator sqrt(v)+eps 0 or negative: inf or a step uphill"
    if key == "weight_decay":
        return "decoupled decay multiplies the parameters by 1 - lr*wd = -inf: they turn inf or NaN at the next step" \
            if math.isinf(x) else "negative weight decay grows the weights every step (torch's constructor refuses it)"
    return "the optimizer's averages no longer average (torch's constructor refuses it); the next update is not " \
           "the optimizer's"


def _tally(t: _Tally, mask: torch.Tensor, start: int, chunk: Mapping[str, torch.Tensor]) -> None:
    n = int(mask.sum())
    if n and t.first is None:
        i = int(mask.nonzero()[0, 0])
        t.first = start + i
        t.values = {k: float(c[i]) for k, c in chunk.items()}
    t.count += n


def _message(check: str, key: str, label: str, where: list[int], t: _Tally, hyper: Mapping[str, Any]) -> str:
    more = f" ({count(t.count, 'coordinate')} in all)" if t.count > 1 else ""
    v = t.values
    if check == NEGATIVE:
        return (f"{key} of {label} is {v[key]:.4g} at {where}{more}: a second moment is an average of squares and "
                "cannot be negative; the next update takes its square root there: NaN, unless that step's gradient "
                "outweighs it")
    if check == AMSGRAD:
        return (f"max_exp_avg_sq of {label} is {v['max_exp_avg_sq']:.4g} at {where}{more}, below exp_avg_sq "
                f"{v['exp_avg_sq']:.4g}: amsgrad keeps the running maximum, so these were not saved together; the next "
                "update takes the larger and goes on, from a state training did not produce")
    betas = _betas(hyper)
    assert betas is not None
    limit = adam_bound(*betas)
    assert limit is not None
    lr, eps = real(hyper.get("lr")), real(hyper.get("eps")) or 0.0
    m, s = v["exp_avg"], v["exp_avg_sq"]
    ratio = abs(m) / max(eps, math.sqrt(max(s, 0.0)), 1e-45)
    size = f" (about {lr * ratio:.3g} from this pair alone; a sound pair moves it at most about {lr * limit:.3g})" \
        if lr is not None and math.isfinite(lr) else ""
    return (f"exp_avg of {label} breaks Adam's bound at {where}{more}: |m| = {abs(m):.4g} > {limit:.3g} * sqrt(v) = "
            f"{limit * math.sqrt(max(s, 0.0)):.4g} (v = {s:.4g}, betas {betas[0]:g}, {betas[1]:g}): these moments did "
            f"not come from the same gradients (one restored without the other, rescaled or corrupted), unless the "
            f"run changed its betas; the next update there is m/(sqrt(v)+eps) = {ratio:.3g} times lr{size}")


class Found:
    """Findings about one parameter's state, named alike."""

    def __init__(self, checker: Checker, label: str, group: int | None, names: Mapping[str, str]) -> None:
        self.checker, self.label, self.group, self.names = checker, label, group, names

    def add(self, check: str, key: str, index: list[int] | None, values: dict[str, Any], message: str) -> None:
        self.checker.unsound.append(Unsound(check, self.names.get(key, key), self.label, self.group, index, values,
                                            message))


def check(source: CheckpointSource, order_names: list[str] | None = None) -> tuple[Soundness, list[Unsound]]:
    """The soundness checks alone, reading only the optimizer's tensors (the replay's start checkpoint, already
    scanned for finiteness). ``order_names``: the parameters' names in the optimizer's order, which name the state of
    a checkpoint that records none (as a replay matched it)."""
    stream = source.open()
    checker = Checker(source, stream.infos, order_names)
    first = next((i for i, info in enumerate(stream.infos) if info.group == OPTIMIZER), len(stream.infos))
    for info, tensor, release in stream.tensors(first):
        state = checker.feed(info, tensor, release)
        if state is not None:
            state.read()
            state.conclude(True)
        del tensor
    return checker.finish(), checker.unsound


def unsound_coordinates(optimizer: torch.optim.Optimizer) -> dict[torch.Tensor, torch.Tensor]:
    """A live optimizer's parameters whose state breaks an elementwise check (or whose step is 0 beside moments that
    hold values), each with the mask of its coordinates to reset."""
    out = {}
    for group in optimizer.param_groups:
        for p in group["params"]:
            state = optimizer.state.get(p, {})
            tensors = {k: v.detach().float() for k, v in state.items()
                       if isinstance(v, torch.Tensor) and per_element(k, v) and v.shape == p.shape}
            if not tensors:
                continue
            v_dtype = state["exp_avg_sq"].dtype if isinstance(state.get("exp_avg_sq"), torch.Tensor) else torch.float32
            masks = list(flags(tensors, {**group, "_dtype": v_dtype}).values())
            mask = torch.stack(masks).any(dim=0) if masks else torch.zeros(p.shape, dtype=torch.bool, device=p.device)
            step = real(state.get("step"))
            if step == 0 and any(bool(t.any()) for t in tensors.values()):
                mask = torch.ones_like(mask)
            if bool(mask.any()):
                out[p] = mask
    return out


# ---- a replay from a checkpoint: the start's soundness beside the origin ------------------------------------------


def start_soundness(source: CheckpointSource, model: torch.nn.Module, optimizer: torch.optim.Optimizer
                    ) -> list[Unsound]:
    """The soundness findings of a replay's start checkpoint, the parameters named as the replay's model names them
    (a checkpoint that records no names by the order the replay matched its state in)."""
    return check(source, param_names(model, optimizer))[1]


def _params(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, tuple[int, tuple[int, ...]]]:
    """Each parameter's name: its group and shape."""
    names = iter(param_names(model, optimizer))
    return {next(names): (g, tuple(p.shape)) for g, group in enumerate(optimizer.param_groups) for p in group["params"]}


def _on(u: Unsound, origin: Event, params: Mapping[str, tuple[int, tuple[int, ...]]]) -> bool:
    """Whether the origin lies on what ``u`` flags: its coordinate (or its parameter, for a whole-tensor finding;
    either end of a group's differing step counters), its group (a hyperparameter), or anywhere (the loss scale)."""
    if u.param is not None:
        if origin.tensor not in {u.param, u.values.get("min_param")}:
            return False
        return u.index is None or list(u.index) == list(origin.index)
    if u.group is not None:
        return origin.tensor in params and params[origin.tensor][0] == u.group
    return True


def resume_findings(unsound: list[Unsound], origin: Event | None, start: int, model: torch.nn.Module,
                    optimizer: torch.optim.Optimizer, matched_by_order: bool) -> tuple[list[str], bool]:
    """What the start checkpoint's soundness says about the replay: the findings, and whether the origin lies on a
    coordinate a reset could zero (so the what-if ``reset-state`` shows whether resetting would have saved the run)."""
    params = _params(model, optimizer)
    out = []
    if unsound:
        checks = sorted({f"{u.check} ({u.param or u.tensor})" for u in unsound})
        out.append(f"The start checkpoint (step {start}) is finite but its optimizer state is unsound: "
                   f"{count(len(unsound), 'finding')}, {', '.join(checks[:4])}{' ...' if len(checks) > 4 else ''} "
                   "(each under unsound, with what it does at the next update).")
    if origin is None:
        return out, False
    hits = [u for u in unsound if _on(u, origin, params)]
    where = f"{origin.tensor}{origin.index}"
    for u in hits[:3]:
        out.append(f"The origin, {where} at step {origin.step}, lies on what the start checkpoint's {u.check} check "
                   f"flagged: {u.message}.")
    if matched_by_order and origin.tensor in params:
        group, shape = params[origin.tensor]
        twins = [n for n, (g, s) in params.items() if g == group and s == shape and n != origin.tensor]
        if twins:
            pair = any(u.check == BOUND for u in hits)
            out.append(f"The optimizer state was matched to the parameters by order (the checkpoint names none), and "
                       f"{origin.tensor} shares its shape {list(shape)} with {', '.join(twins[:3])}"
                       f"{' (+more)' if len(twins) > 3 else ''}: had training listed them in another order, the moments "
                       f"it was given would be one of those's, and nothing in the checkpoint tells" +
                       ("; here they break Adam's bound against each other, so they may well belong to another "
                        "parameter of the same shape" if pair else "") + ".")
    resettable = any(u.check in ELEMENTWISE or (u.check == STEP and u.values.get("step") == 0) for u in hits)
    return out, resettable
