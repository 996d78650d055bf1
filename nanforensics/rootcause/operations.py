"""Operation level: the operation where the origin's non-finite value was born, found by provenance.

The responsible step runs again under a dispatch mode that sees every aten operation (forward,
backward, optimizer). Each floating-point tensor an operation writes gets a small summary (min, max,
whether it holds NaN, whether ±inf), kept by tensor identity through weak references and
invalidated by any later write to its storage (through itself, a view or an alias); a tensor
holding a non-finite value also keeps a record of the operation that wrote it and of that
operation's inputs as they were before it ran. Views and copies take their input's summary without
a pass over the data, so the trace costs about one extra read of what the step writes.
From the origin the replay found (the first non-finite gradient, optimizer state, parameter,
activation or loss) the trace follows the value back along the data flow — through views, in-place
writes, autograd nodes, the optimizer's foreach lists — to the operation where it was born: its
output carries the value's kind while none of the inputs it came from did.

Why not the first non-finite output in time: a causal mask written as ``masked_fill(mask, -inf)``
puts -inf into every step's attention scores and softmax absorbs it into a 0 weight; a ``where``
discards a branch; ``empty_like`` holds whatever the memory held. None of them reaches the origin,
so none is on its data flow. Allocation outputs are never followed at all.

Kinds are followed separately. A NaN is born where an operation outputs NaN from inputs without NaN
(0/0, inf-inf, inf*0, softmax of an all -inf row, log of a negative); an inf where one outputs ±inf
from finite inputs. When the NaN's birth consumed ±inf, that inf is followed back too: written on
purpose (an inf scalar given to masked_fill/fill_/full/where, or held before the step) makes the
NaN's birth the culprit — the mask was meant, meeting a fully masked row is the failure; computed
from finite values (exp, pow, a sum, a cast past the dtype's largest value) makes that overflow the
root, with the NaN's birth reported downstream of it.

A backward operation is traced through its autograd node to the forward operation it
differentiates. When that forward operation had itself made a non-finite value from finite inputs
(``log(0)`` inside a ``torch.where`` that discards it), the forward operation is named: the forward
dropped its value, its derivative still reached the gradient.

Tracking is per tensor, not per element: an operation's output is taken to come from all its
floating inputs (for the optimizer's foreach and fused operations, from element i of every list).
Where several births reach the origin, the earliest is named, of either kind: where the origin's tensor carries the
other kind too, computed earlier in the step, that birth is named (an inf that NaN surrounds: a projection that
overflowed in the one finite row, beside rows holding the NaN an earlier overflow of the scores made; a value written
on purpose, a mask's -inf, is never taken so). Where NaN hides from min and max whether
a tensor also holds ±inf, a mask over that tensor says: an inf born beside NaN from finite inputs
(a matmul of weights an LR spike made huge) is a birth like any other.
"""

from __future__ import annotations

import math
import os
import sys
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.weak import WeakIdKeyDictionary

from .. import finite
from ..replay.monitor import output_module, output_tensors
from ..report import Event, InfSource, OperationCulprit, OpSite
from .findings import describe

_TORCH_DIR = os.path.dirname(torch.__file__)
NAN, INF = "nan", "inf"

# Outputs of these hold uninitialised memory: never a cause, never followed.
_ALLOCATION = frozenset({"empty", "empty_like", "new_empty", "empty_strided", "new_empty_strided", "empty_permuted",
                         "resize_", "resize_as_"})
# These replace their first argument's values without reading them.
_OVERWRITE = frozenset({"copy_", "fill_", "zero_", "_foreach_copy_", "_foreach_zero_", "normal_", "uniform_",
                        "bernoulli_", "random_", "exponential_", "geometric_", "log_normal_", "cauchy_"})
# These update BatchNorm's running statistics in place without saying so in their schemas.
_UNDECLARED_WRITES = {"native_batch_norm": ("running_mean", "running_var"),
                      "cudnn_batch_norm": ("running_mean", "running_var"),
                      "miopen_batch_norm": ("running_mean", "running_var"),
                      "batch_norm_update_stats": ("running_mean", "running_var")}
# Outputs of these hold exactly the values of their one floating input, no more, no fewer (views over every
# element, copies): when the dtype is kept, their summary is the input's, with no pass over the data.
_SAME_VALUES = frozenset({"view", "_unsafe_view", "reshape", "_reshape_alias", "transpose", "t", "permute", "expand",
                          "squeeze", "unsqueeze", "detach", "alias", "clone", "_to_copy", "copy_"})
# These turn a Python literal (``torch.tensor(-inf)``) into a tensor: what they output is written, not computed.
_LITERAL = frozenset({"lift_fresh", "lift_fresh_copy"})
# Along which dimensions an output element reads its input: the softmax family reads a whole row.
_ROW_OPS = frozenset({"_softmax", "_log_softmax", "_safe_softmax", "softmax", "log_softmax"})
# Ops that only move or alias values: left out of the provenance path shown in the report.
_MOVES = frozenset({"view", "_unsafe_view", "reshape", "_reshape_alias", "transpose", "t", "permute", "expand",
                    "slice", "select", "split", "split_with_sizes", "unbind", "squeeze", "unsqueeze", "as_strided",
                    "detach", "alias", "view_as_real", "view_as_complex", "unfold", "narrow", "clone", "contiguous"})
_PATH_MAX = 12


def _user_source() -> tuple[str, int, str] | None:
    """The innermost frame outside torch and this module: the user's line that issued the op."""
    frame = sys._getframe(1)
    while frame is not None:
        name = frame.f_code.co_filename
        if not name.startswith(_TORCH_DIR) and name != __file__:
            return name, frame.f_lineno, frame.f_code.co_name
        frame = frame.f_back
    return None


def _source_text(where: tuple[str, int, str] | None) -> str | None:
    """``file:line in function``: an installed library's file relative to its site-packages
    (``transformers/loss/loss_utils.py``), else relative to the working directory when under it."""
    if where is None:
        return None
    name, line, function = where
    for packages in ("site-packages", "dist-packages"):
        _, found, inside = name.rpartition(f"{os.sep}{packages}{os.sep}")
        if found:
            return f"{inside}:{line} in {function}"
    if not name.startswith("<") and not (relative := os.path.relpath(name)).startswith(os.pardir):
        name = relative
    return f"{name}:{line} in {function}"


def _fmt(x: float) -> str:
    return finite.value_name(x) if x != x or abs(x) == float("inf") else f"{x:.4g}"


def _dtype(t: torch.Tensor) -> str:
    return str(t.dtype).removeprefix("torch.")


def _op_name(func: Any) -> str:
    name = getattr(func, "__name__", None) or str(func)
    if hasattr(func, "_schema"):  # an OpOverload: aten.div.Tensor
        return f"aten::{func.__name__}"
    module = getattr(func, "__module__", "") or ""
    return f"{module.removeprefix('torch._C._nn').removeprefix('torch._C')}.{name}".lstrip(".") if module else name


@dataclass(eq=False)
class _Value:
    """What a tensor held when summarised (after operation ``seq``): its range and the non-finite kinds in it;
    for a non-finite one, the record of the operation that wrote it (None: it came from outside the step)."""

    seq: int
    storage: int | None
    lo: float
    hi: float
    nan: bool
    inf: bool
    dtype: str
    record: _Record | None = None
    name: str | None = None  # the parameter or buffer it is, for a value from outside the step
    uninitialised: bool = False

    def carries(self, kind: str) -> bool:
        return self.nan if kind == NAN else self.inf

    @property
    def finite(self) -> bool:
        return not (self.nan or self.inf)

    def range(self) -> list[str]:
        return ["uninitialised", "uninitialised"] if self.uninitialised else [_fmt(self.lo), _fmt(self.hi)]


@dataclass(eq=False)
class _Birth:
    """Where an operation made a kind its inputs did not carry: the first such coordinate of its output."""

    index: list[int]
    value: str
    inputs_at: list[list[str] | None]


@dataclass(eq=False)
class _Record:
    """One operation (one element of a foreach operation) that wrote a non-finite value; kept small: summaries,
    no tensors."""

    seq: int
    op: str
    phase: str
    module: str | None
    node: str | None          # autograd node running it, for a backward op
    forward: _Forward | None  # the forward op that node differentiates
    inputs: list[_Value]
    outputs: list[_Value]
    constant: bool            # an inf scalar among its arguments, or no floating input: it writes, not computes
    source: tuple[str, int, str] | None = None
    births: dict[str, _Birth] = field(default_factory=dict)
    shown: list[tuple[str, list[str]]] | None = None  # for a birth: every tensor input (integer targets, masks too)

    def site(self) -> OpSite:
        fwd = self.forward
        shown = self.shown if self.shown is not None else [(v.dtype, v.range()) for v in self.inputs]
        return OpSite(self.op, self.phase, fwd.module if fwd else self.module,
                      _source_text(fwd.source if fwd else self.source),
                      [d for d, _ in shown], [r for _, r in shown],
                      [v.dtype for v in self.outputs], [v.range() for v in self.outputs])


@dataclass(eq=False)
class _Forward:
    """A forward torch function that created an autograd node: what its backward is traced to."""

    op: str
    module: str | None
    source: tuple[str, int, str] | None
    inputs: list[_Value]
    outputs: list[_Value]

    def site(self) -> OpSite:
        return OpSite(self.op, "forward", self.module, _source_text(self.source), [v.dtype for v in self.inputs],
                      [v.range() for v in self.inputs], [v.dtype for v in self.outputs],
                      [v.range() for v in self.outputs])


@dataclass(frozen=True)
class _OpInfo:
    name: str
    allocation: bool
    grouped: bool                # foreach/fused: output i comes from element i of every list argument
    same_values: bool            # outputs hold the values of the one floating input (see _SAME_VALUES)
    read: tuple[int, ...]        # argument positions whose values the op reads
    written: tuple[int, ...]     # argument positions it writes in place: outputs too
    arg_names: tuple[str, ...]


def _op_info(func: Any) -> _OpInfo:
    """What an aten overload reads and writes, from its schema (and ``_UNDECLARED_WRITES``): computed once per op."""
    packet = func.overloadpacket.__name__
    args = func._schema.arguments
    overwrites = packet in _OVERWRITE
    read = () if packet in _LITERAL else tuple(i for i, a in enumerate(args)
                                               if not a.is_out and not (overwrites and i == 0))
    undeclared = _UNDECLARED_WRITES.get(packet, ())
    written = tuple(i for i, a in enumerate(args)
                    if (a.alias_info is not None and a.alias_info.is_write) or a.name in undeclared)
    grouped = packet.startswith(("_foreach_", "_fused_", "_amp_foreach_"))
    return _OpInfo(_op_name(func), packet in _ALLOCATION, grouped, packet in _SAME_VALUES, read, written,
                   tuple(a.name for a in args))


def _floating(t: Any) -> bool:
    """A tensor the trace summarises: floating or complex, with data (not on the meta device); a sparse one (an
    ``nn.Embedding(sparse=True)`` gradient) by its stored values (``finite.stored``)."""
    return isinstance(t, torch.Tensor) and (t.is_floating_point() or t.is_complex()) and t.device.type != "meta"


def _tensors(v: Any) -> Iterator[torch.Tensor]:
    if isinstance(v, torch.Tensor):
        yield v
    elif isinstance(v, (list, tuple)):
        yield from (t for t in v if isinstance(t, torch.Tensor))


def _storage_key(t: torch.Tensor) -> int | None:
    try:
        return finite.plain(t).untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):  # no storage: a wrapper subclass, a sparse tensor
        return None


def _first(t: torch.Tensor, kind: str) -> tuple[list[int], str]:
    """The first coordinate (row-major) of ``t`` holding ``kind``, and its value (of a complex element, the part
    that holds it)."""
    held = finite.stored(t)
    flat = held.values.reshape(-1)
    mask = torch.isnan(flat) if kind == NAN else torch.isinf(flat)
    i = int(torch.argmax(mask.to(torch.uint8)))
    return held.where(i), finite.value_name(float(flat[i]))


def _row_dims(op: str, args: tuple, kwargs: dict, ndim: int) -> set[int]:
    packet = op.removeprefix("aten::").split(".")[0]
    if packet in _ROW_OPS:
        dim = args[1] if len(args) > 1 else kwargs.get("dim", -1)
        return {dim % ndim} if ndim else set()
    if packet == "native_layer_norm":
        return set(range(ndim - len(args[1]), ndim))
    return set()


def _range(t: torch.Tensor) -> list[str]:
    """[min, max] of any tensor as strings: floating, integer (a target of -100) or boolean (a mask, 0 and 1)."""
    lo, hi = finite.extremes(t).tolist() if t.numel() else (math.nan, math.nan)
    return [_fmt(lo), _fmt(hi)]


def _inputs_at(inputs: list[torch.Tensor], out: torch.Tensor, index: list[int], rows: set[int],
               skip: set[int]) -> list[list[str] | None]:
    """Range of each input over the elements the output coordinate was computed from: the element itself for an
    elementwise op (broadcasting aligned from the right), the whole row for the softmax family; None where the
    output does not line up with the input (a matmul, a reduction) or the op overwrote it in place."""
    out_shape = tuple(out.shape)
    ranges: list[list[str] | None] = []
    for i, t in enumerate(inputs):
        shape = tuple(t.shape)
        if i in skip or len(shape) > len(out_shape) or t.layout != torch.strided:  # a sparse one: not by element
            ranges.append(None)
            continue
        offset = len(out_shape) - len(shape)
        key: list[Any] = []
        for d, size in enumerate(shape):
            od = d + offset
            if size == 1:
                key.append(0)
            elif size != out_shape[od]:
                break
            else:
                key.append(slice(None) if od in rows else index[od])
        else:
            ranges.append(_range(t.detach()[tuple(key)]))
            continue
        ranges.append(None)
    return ranges


def _input_groups(info: _OpInfo, bound: list[Any]) -> tuple[list[list[torch.Tensor]], int]:
    """The floating inputs of each output group, and the number of list elements (0 for an ungrouped op).

    A foreach or fused op has one group per list element: element i of every list, and each tensor argument
    that is not in a list (a scale). A tensor it writes outside its lists (the scaler's found_inf) forms a last
    group, read from all of its inputs."""
    read = [bound[i] for i in info.read]
    every = [t for v in read for t in _tensors(v) if _floating(t)]
    if not info.grouped:
        return [every], 0
    n = max((len(v) for i in (*info.read, *info.written) if isinstance(v := bound[i], (list, tuple))), default=0)
    groups = [[t for v in read for t in ([v[i]] if isinstance(v, (list, tuple)) else _tensors(v)) if _floating(t)]
              for i in range(n)]
    return groups + [every], n


def _output_groups(info: _OpInfo, bound: list[Any], out: Any, n: int) -> list[list[torch.Tensor]]:
    """What each input group wrote: the returned tensors and those written in place, each once."""
    written = [bound[i] for i in info.written]
    if not info.grouped:  # an in-place op returns the tensor it wrote: once
        return [list({id(t): t for t in [*(t for w in written for t in _tensors(w)), *tree_leaves(out)]
                      if _floating(t)}.values())]
    returned = list(out) if isinstance(out, (list, tuple)) else []
    lists = [w for w in written if isinstance(w, (list, tuple))]
    groups = [[t for t in [*(w[i] for w in lists), *returned[i:i + 1]] if _floating(t)] for i in range(n)]
    return groups + [[w for w in written if isinstance(w, torch.Tensor) and _floating(w)]]


class _ModuleStack:
    """Which module is running: forward pre/post hooks on every module."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.stack: list[str] = []
        self._handles = []
        for name, module in model.named_modules():
            self._handles.append(module.register_forward_pre_hook(self._push(name or "<root>")))
            self._handles.append(module.register_forward_hook(self._pop))

    def _push(self, name: str) -> Callable[..., None]:
        def hook(module: torch.nn.Module, args: Any) -> None:
            self.stack.append(name)
        return hook

    def _pop(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        if self.stack:
            self.stack.pop()

    def current(self) -> str | None:
        return self.stack[-1] if self.stack else None

    def remove(self) -> None:
        for h in self._handles:
            h.remove()


class _Provenance(TorchDispatchMode):
    """Summarises what every operation writes; keeps records only for the ones that write a non-finite value."""

    def __init__(self, modules: _ModuleStack, names: dict[int, str]) -> None:
        """``names``: storage address -> the parameter or buffer that owns it (a slice of a mask buffer is named)."""
        super().__init__()
        self.modules, self.names = modules, names
        self.values: WeakIdKeyDictionary = WeakIdKeyDictionary()  # tensor -> _Value; the tensor is not kept alive
        self.storages: dict[int, int] = {}  # storage address -> the seq of the last write to it
        # storage address -> the last operation that wrote a non-finite value into it, until a write covers it all
        self.held: dict[int, _Record] = {}
        self.forwards: dict[Any, _Forward] = {}  # autograd node -> the forward op that created it
        self.infos: dict[Any, _OpInfo] = {}
        self.in_optimizer = False
        self.updated = False  # optimizer.step() has returned in this step: what follows is the step's own code
        self.building = False  # the torch function running now builds an autograd graph (see _ForwardSites)
        self.seq = 0
        self.failed: str | None = None  # what ended the trace early, if anything did

    # -- summaries --------------------------------------------------------------------------------

    def _summaries(self, tensors: list[torch.Tensor]) -> list[tuple[float, float, bool, bool]]:
        """(min, max, holds NaN, holds ±inf) per tensor: one aminmax each, one host sync per device. Where NaN
        hides ±inf from min and max, a mask over the tensor's values says (only in the step that failed, on the
        tensors NaN reached: inferring it from the inputs missed an inf born beside a NaN)."""
        by_device: dict[torch.device, list[int]] = {}
        for i, t in enumerate(tensors):
            if t.numel():  # an empty tensor (a parameter of size 0) has no extremes: aminmax refuses it
                by_device.setdefault(t.device, []).append(i)
        bounds: list[list[float]] = [[math.nan, math.nan]] * len(tensors)
        for indices in by_device.values():
            rows = torch.stack([finite.extremes(tensors[i]) for i in indices]).tolist()
            for i, row in zip(indices, rows):
                bounds[i] = row
        out = []
        for t, (lo, hi) in zip(tensors, bounds):
            if not t.numel():
                out.append((lo, hi, False, False))
                continue
            nan = lo != lo or hi != hi
            inf = bool(torch.isinf(finite.stored(t).values).any()) if nan else (math.isinf(lo) or math.isinf(hi))
            out.append((lo, hi, nan, inf))
        return out

    def _valid(self, v: _Value | None) -> bool:
        """No write to the storage since ``v`` was taken. Storage, not the version counter: inside this mode an
        in-place op has not bumped the counter yet (autograd's ADInplaceOrView does it on the way out), and a
        ``.data`` alias writes the storage under a counter of its own."""
        if v is None:
            return False
        last = self.storages.get(v.storage) if v.storage is not None else None
        return last is None or last <= v.seq

    def lookup(self, t: torch.Tensor) -> _Value:
        """What ``t`` holds now: its summary while no write has changed it, else checked here and linked to the
        last operation that wrote its storage."""
        v = self.values.get(t)
        if self._valid(v):
            return v
        return self.check([t])[0]

    def check(self, tensors: list[torch.Tensor]) -> list[_Value]:
        """Summarise tensors whose summary is missing or stale; a non-finite one is linked to the last operation
        that wrote a non-finite value into its storage in this step (an alias autograd made of a saved output; a
        buffer a later finite write into a slice of it left holding NaN: ``_wrote``), else to none (from outside the
        step: a parameter, a buffer, the batch)."""
        out = []
        for t, (lo, hi, nan, inf) in zip(tensors, self._summaries(tensors)):
            record, name = None, None
            key = _storage_key(t)
            if nan or inf:  # the last operation that wrote a non-finite value into its storage, if any did
                record = self.held.get(key) if key is not None else None
                name = self.names.get(key) if key is not None else None
            v = _Value(self.seq, key, lo, hi, nan, bool(inf), _dtype(t), record, name)
            self.values[t] = v
            out.append(v)
        return out

    def _inputs(self, groups: list[list[torch.Tensor]]) -> list[list[_Value]]:
        missing: dict[int, torch.Tensor] = {}
        for g in groups:
            for t in g:
                if not self._valid(self.values.get(t)):
                    missing[id(t)] = t
        if missing:
            self.check(list(missing.values()))
        return [[self.values[t] for t in g] for g in groups]

    # -- the operations -------------------------------------------------------------------------------

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        """Run the op as the step would; the bookkeeping around it never fails the step: a tensor it cannot read
        (a sparse layout, a subclass) ends the trace, which then names no culprit rather than a wrong one."""
        kwargs = kwargs or {}
        if self.failed is not None:
            return func(*args, **kwargs)
        try:
            before = self._before(func, args, kwargs)
        except Exception as e:  # noqa: BLE001 - any failure of the trace's own reading
            self.failed = f"{func}: {e!r}"
            return func(*args, **kwargs)
        out = func(*args, **kwargs)
        try:
            self._after(before, out)
        except Exception as e:  # noqa: BLE001
            self.failed = f"{func}: {e!r}"
        return out

    def _before(self, func: Any, args: tuple, kwargs: dict) -> tuple:
        info = self.infos.get(func)
        if info is None:
            info = self.infos[func] = _op_info(func)
        bound = [args[i] if i < len(args) else kwargs.get(name) for i, name in enumerate(info.arg_names)]
        if info.allocation:
            return info, func, args, kwargs, bound, [], [], 0
        groups, n = _input_groups(info, bound)
        return info, func, args, kwargs, bound, groups, self._inputs(groups), n  # before the op overwrites them

    def _after(self, before: tuple, out: Any) -> None:
        info, func, args, kwargs, bound, groups, ins_groups, n = before
        if info.allocation:  # uninitialised memory: never a cause, never followed
            for t in tree_leaves(out):
                if _floating(t):
                    v = self.values[t] = _Value(self.seq, _storage_key(t), math.nan, math.nan, False, False,
                                                _dtype(t), uninitialised=True)
                    if v.storage is not None:
                        self._wrote(v.storage, t, v)
            return
        out_groups = _output_groups(info, bound, out, n)
        flat = [t for g in out_groups for t in g]
        if not flat:
            return
        if info.same_values and len(ins_groups[0]) == 1 and all(t.dtype == groups[0][0].dtype for t in flat):
            v = ins_groups[0][0]
            summaries = iter([(v.lo, v.hi, v.nan, v.inf)] * len(flat))
        else:
            summaries = iter(self._summaries(flat))
        self.seq += 1
        # A write to a storage makes every other summary of it stale; a view or alias of an input writes nothing.
        written = {id(t) for i in info.written for t in _tensors(bound[i])}
        aliased = {v.storage for g in ins_groups for v in g}
        for inputs, tensors, ins in zip(groups, out_groups, ins_groups):
            outs = []
            for t in tensors:
                lo, hi, nan, inf = next(summaries)
                outs.append(_Value(self.seq, _storage_key(t), lo, hi, nan, inf, _dtype(t)))
            if any(not v.finite for v in outs):
                record = self._record(info, func, args, kwargs, bound, inputs, ins, tensors, outs)
                for v in outs:
                    v.record = record
            for t, v in zip(tensors, outs):
                self.values[t] = v
                if v.storage is not None and (id(t) in written or v.storage not in aliased):
                    self._wrote(v.storage, t, v)

    def _wrote(self, key: int, t: torch.Tensor, v: _Value) -> None:
        """``t``'s storage (``key``) was written, ``v`` what ``t`` holds now. A write into part of it (autograd's CopySlices
        copies a slice's gradient into a buffer that already holds the whole's NaN) leaves the rest as it was: the
        record of the non-finite values there stays, unless this write made some of its own."""
        self.storages[key] = self.seq
        if v.record is not None:
            self.held[key] = v.record
        elif t.numel() * t.element_size() >= finite.plain(t).untyped_storage().nbytes():
            self.held.pop(key, None)

    def _phase(self, inputs: list[torch.Tensor]) -> str:
        """Outside autograd's backward: the optimizer's step, a module's forward, the step function's own code after
        optimizer.step() (renormalising rows, clamping, an EMA under no_grad), the forward's computation outside
        any module (a loss: it builds the graph, inside ``torch.func.grad`` too), or the step function's own code
        before the update."""
        if self.in_optimizer:
            return "optimizer"
        if self.modules.current() is not None:
            return "forward"
        if self.updated:
            return "after_update"
        if self.building or (torch.is_grad_enabled() and any(t.requires_grad for t in inputs)):
            return "forward"
        return "before_update"

    def _record(self, info: _OpInfo, func: Any, args: tuple, kwargs: dict, bound: list[Any],
                inputs: list[torch.Tensor], ins: list[_Value], tensors: list[torch.Tensor],
                outs: list[_Value]) -> _Record:
        node = torch._C._current_autograd_node()
        phase = "backward" if node is not None else self._phase(inputs)
        constant = not ins or any(isinstance(a, float) and not math.isfinite(a) for a in tree_leaves((args, kwargs)))
        record = _Record(self.seq, info.name, phase, self.modules.current() if node is None else None,
                         node.name() if node is not None else None,
                         self.forwards.get(node) if node is not None else None, ins, outs, constant)
        born = [k for k in (NAN, INF) if any(v.carries(k) for v in outs) and not any(v.carries(k) for v in ins)]
        if not born:
            return record
        shown = inputs
        if not info.grouped:  # a birth shows every tensor input: an all -100 target, a mask, a zero count
            shown = [t for i in info.read for t in _tensors(bound[i]) if _floating(t) or t.numel()]
            values = iter(ins)  # the floating ones, summarised before the op ran
            record.shown = []
            for t in shown:
                v = next(values) if _floating(t) else None
                record.shown.append((v.dtype, v.range()) if v is not None else (_dtype(t), _range(t)))
        written = {id(t) for t in tensors}
        skip = {i for i, t in enumerate(shown) if id(t) in written}  # overwritten in place: no longer there
        for kind in born:
            where = next(t for t, v in zip(tensors, outs) if v.carries(kind))
            index, value = _first(where, kind)
            rows = _row_dims(info.name, args, kwargs, where.dim())
            record.births[kind] = _Birth(index, value, _inputs_at(shown, where, index, rows, skip))
        if node is None:
            record.source = _user_source()
        return record


class _ForwardSites(TorchFunctionMode):
    """Remembers, for each autograd node created in the forward pass, the torch function that created it; and
    whether the torch function running builds a graph (the phase of the aten operations it issues)."""

    def __init__(self, modules: _ModuleStack, provenance: _Provenance) -> None:
        super().__init__()
        self.modules, self.provenance = modules, provenance

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        # Whether this call builds a graph is read here, above torch.func's transforms: below them, where the
        # provenance runs, grad()'s tensors are unwrapped and none of them requires grad.
        building = self.provenance.building
        self.provenance.building = torch.is_grad_enabled() and any(
            isinstance(t, torch.Tensor) and t.requires_grad for t in tree_leaves((args, kwargs)))
        try:
            out = func(*args, **kwargs)
        finally:
            self.provenance.building = building
        outs = [out] if isinstance(out, torch.Tensor) else (
            [t for t in out if isinstance(t, torch.Tensor)] if isinstance(out, (tuple, list)) else [])
        nodes = [t.grad_fn for t in outs if t.grad_fn is not None]
        fresh = [n for n in nodes if n not in self.provenance.forwards]
        if fresh:
            values = self.provenance.values
            ins = [v for v in (values.get(t) for t in tree_leaves((args, kwargs)) if _floating(t)) if v is not None]
            site = _Forward(_op_name(func), self.modules.current(), _user_source(), ins,
                            [v for v in (values.get(t) for t in outs if _floating(t)) if v is not None])
            for node in fresh:
                self.provenance.forwards[node] = site
        return out


# -- following a value back ---------------------------------------------------------------------------


def _walk(starts: list[_Value], kind: str) -> tuple[list[_Record], list[_Value], dict[_Record, _Record | None]]:
    """Births of ``kind`` upstream of ``starts``, the values that carried it in from outside the step, and each
    visited record's successor towards the start (to read a path off)."""
    after: dict[_Record, _Record | None] = {}
    stack: list[_Record] = []
    leaves: list[_Value] = []

    def follow(values: list[_Value], successor: _Record | None) -> None:
        for v in values:
            if v.record is None:
                leaves.append(v)
            elif v.record not in after:
                after[v.record] = successor
                stack.append(v.record)

    follow(starts, None)
    births = []
    while stack:
        r = stack.pop()
        carriers = [v for v in r.inputs if v.carries(kind)]
        if not carriers and kind in r.births:
            births.append(r)
        follow(carriers, r)
    return births, leaves, after


def _chain(record: _Record, after: dict[_Record, _Record | None]) -> list[_Record]:
    """``record`` and the records its value passed through on the way to the walk's start."""
    chain = []
    r: _Record | None = record
    while r is not None:
        chain.append(r)
        r = after.get(r)
    return chain


def _path(chain: list[_Record]) -> list[str]:
    """Op names along the chain, the culprit first; moves and repeats left out, a long middle elided."""
    names: list[str] = []
    for i, r in enumerate(chain):
        packet = r.op.removeprefix("aten::").split(".")[0]
        if (i == 0 or packet not in _MOVES) and (not names or names[-1] != r.op):
            names.append(r.op)
    if len(names) > _PATH_MAX:
        names = names[:_PATH_MAX // 2] + ["…"] + names[-(_PATH_MAX // 2 - 1):]
    return names


@dataclass
class _Trace:
    """What following one kind back from the origin found: the operation named, the kind it made, the records on the
    way, the NaN's birth downstream of an overflow or the backward birth of a forward op, where a written inf came
    from."""

    culprit: _Record
    kind: str
    chain: list[_Record]
    nan_site: _Record | None
    inf_source: InfSource | None


def _traced(origin: _Value, kind: str) -> _Trace | None:
    """The birth of ``origin``'s kind, then the two refinements: a NaN made from a computed inf names the overflow
    (NaN downstream), from a written one the NaN's op (with where the inf came from); a backward birth whose forward
    op had already made a non-finite value names that forward op (NaN in its backward)."""
    births, _, after = _walk([origin], kind)
    if not births:
        return None  # the value came into the step from outside: data, or state from before
    born = min(births, key=lambda r: r.seq)
    culprit, culprit_kind, chain = born, kind, _chain(born, after)
    nan_site: _Record | None = None
    inf_source: InfSource | None = None
    made_from = [v for v in born.inputs if v.inf]
    if kind == NAN and made_from:
        inf_births, inf_leaves, inf_after = _walk(made_from, INF)
        computed = [r for r in inf_births if not r.constant]
        if computed:  # an overflow upstream: the NaN arose downstream of it
            culprit, culprit_kind, nan_site = min(computed, key=lambda r: r.seq), INF, born
            chain = _chain(culprit, inf_after) + chain
        else:
            # Per tensor, not per element: every op on the way that wrote an inf scalar, and every tensor that
            # held inf before the step, may have put it there; the one nearest the culprit is named, and a held one.
            writers = [r for r in inf_after if r.constant and any(v.inf for v in r.outputs)]
            held = next((v.name for v in inf_leaves if v.name), None)
            if writers or inf_leaves:
                site = max(writers, key=lambda r: r.seq).site() if writers else None
                inf_source = InfSource("constant" if writers else "outside", site, held)
    elif culprit.phase == "backward" and culprit.forward is not None:
        # the forward op already made a non-finite value from finite inputs, dropped later (a where): name it
        made = next((v.record for v in culprit.forward.outputs if v.record is not None and v.record.births
                     and not v.record.constant), None)
        if made is not None:
            nan_site, culprit = culprit, made
            culprit_kind = next(iter(made.births))
            chain = [made] + chain
    return _Trace(culprit, culprit_kind, chain, nan_site, inf_source)


def _culprit(origin: _Value, kind: str, traced_from: str) -> OperationCulprit | None:
    """``_traced`` from the origin's own kind; where the origin's tensor carries the other kind too and an operation
    computed it earlier in the step (an inf that NaN surrounds: the rows around the origin's inf hold the NaN an
    earlier overflow made), that earlier operation: of the births that reach the origin, the step's first. So too where
    no operation of the step made the origin's own kind, which came in from before the step (a NaN gradient that no
    optimizer holds, so nothing zeroes, kept from a step the GradScaler skipped): an operation that made the other kind
    and whose value the origin's was computed from (a float16 sum that overflowed, accumulated into that NaN) is the
    step's birth that reaches it. A value written on purpose (a mask's -inf) is never taken from the other kind: it
    reaches the origin, it made nothing."""
    t = _traced(origin, kind)
    other = INF if kind == NAN else NAN
    earlier = _traced(origin, other) if origin.carries(other) or t is None else None
    if earlier is not None and not earlier.culprit.constant and (t is None or earlier.culprit.seq < t.culprit.seq):
        t = earlier
    if t is None:
        return None
    birth = t.culprit.births[t.kind]
    return OperationCulprit(
        t.culprit.site(), birth.value, birth.index,
        autograd_node=t.culprit.node, forward=t.culprit.forward.site() if t.culprit.forward else None,
        traced_from=traced_from, path=_path(t.chain), inputs_at_index=birth.inputs_at, inf_source=t.inf_source,
        nan_site=t.nan_site.site() if t.nan_site is not None else None,
        nan_node=t.nan_site.node if t.nan_site is not None else None)


# -- the origin in the traced step ---------------------------------------------------------------------


class _Origin:
    """Catches the origin's tensor in the traced step where the replay's monitor saw it: a module's output, a
    gradient after backward or before the optimizer step, the loss, optimizer state or a parameter after it."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, event: Event,
                 provenance: _Provenance) -> None:
        self.model, self.optimizer, self.event, self.provenance = model, optimizer, event, provenance
        self.kind = NAN if event.value == NAN else INF
        self.value: _Value | None = None
        self._handles: list[Any] = []
        params = dict(model.named_parameters(remove_duplicate=False))
        if event.stage == "forward":
            found = output_module(model, event.tensor)
            if found is not None:
                self._handles.append(found[1].register_forward_hook(self._module_hook(*found)))
        elif event.stage == "grad" and event.tensor in params:
            self._handles.append(params[event.tensor].register_post_accumulate_grad_hook(
                lambda p: self._catch(p.grad)))
        elif event.stage == "optimizer_grad" and event.tensor in params:
            p = params[event.tensor]
            self._handles.append(optimizer.register_step_pre_hook(lambda *_: self._catch(p.grad)))

    def _module_hook(self, name: str, module: torch.nn.Module) -> Callable[..., None]:
        def hook(module: torch.nn.Module, args: Any, output: Any) -> None:
            for label, t in output_tensors(name, output):
                if label == self.event.tensor:
                    self._catch(t)
        return hook

    def _catch(self, t: Any) -> None:
        if self.value is None and _floating(t) and t.numel():
            v = self.provenance.lookup(t)
            if not v.carries(self.kind) and v.finite:  # a write the trace did not see: what the tensor holds now
                v = self.provenance.check([t])[0]
            if v.carries(self.kind):
                self.value = v

    def after_step(self, loss: Any) -> None:
        """Stages the monitor checks once the step has returned."""
        e = self.event
        if e.stage == "loss":
            self._catch(loss)
        elif e.stage == "optimizer_state":
            p = dict(self.model.named_parameters(remove_duplicate=False)).get(e.tensor)
            if p is not None:
                self._catch(self.optimizer.state.get(p, {}).get(e.state_key))
        elif e.stage not in ("forward", "grad", "optimizer_grad", "batch"):  # param, buffer: the tensor itself
            named = {**dict(self.model.named_buffers(remove_duplicate=False)),
                     **dict(self.model.named_parameters(remove_duplicate=False))}
            self._catch(named.get(e.tensor))

    def remove(self) -> None:
        for h in self._handles:
            h.remove()


def trace_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, run_step: Callable[[], Any],
               origin: Event) -> OperationCulprit | None:
    """Run one step (``run_step``, which returns the loss) under the trace, stepping the model and optimizer as
    usual, and follow ``origin``'s value back to the operation where it was born. None when the value came from
    the batch or from before the step, or the traced step did not show it again."""
    if origin.stage == "batch":
        return None  # a data defect: no operation made it
    names = {key: n for n, t in [*model.named_parameters(), *model.named_buffers()]
             if (key := _storage_key(t)) is not None}
    modules = _ModuleStack(model)
    provenance = _Provenance(modules, names)
    sites = _ForwardSites(modules, provenance)
    catch = _Origin(model, optimizer, origin, provenance)

    def enter(*_: Any) -> None:
        provenance.in_optimizer = True

    def leave(*_: Any) -> None:
        provenance.in_optimizer, provenance.updated = False, True

    hooks = [optimizer.register_step_pre_hook(enter), optimizer.register_step_post_hook(leave)]
    try:
        with sites, provenance:
            loss = run_step()
            catch.after_step(loss)
    finally:
        modules.remove()
        catch.remove()
        for h in hooks:
            h.remove()
    if catch.value is None or provenance.failed is not None:
        return None
    return _culprit(catch.value, catch.kind, describe(origin))
