"""Did the replay reproduce the run? The state at a recorded checkpoint, bit for bit, is the test.

A logged loss is a reduction: on another machine of the same kind a kernel may sum in another order and
round the last bit or two differently, while parameters, optimizer state and buffers stay bit-identical.
So where the replay passes a checkpoint the run recorded (the state before step N), every tensor of it is
compared bit for bit with the replayed one; losses are compared in float32 ulps (the recorder logs them as
float32) and decide only for the steps no exactly matched checkpoint follows. A distributed run's FSDP2 checkpoint
is read whole from its torch.distributed.checkpoint shards, and a replay at world size gathers its own shards whole
to compare them (every rank, in the same order). A replay on another kind of CPU than the run's (or a run that does
not say which) sums in another order, so there the state is compared within ``STATE_RTOL`` instead.
"""

from __future__ import annotations

import math
import struct
from typing import Iterator, Mapping, NamedTuple, Union

import torch

from .. import finite
from ..distributed.tensors import whole
from ..errors import BadInput
from ..inputs import TensorFile
from ..report import CheckpointComparison, StepRecord, TensorMismatch
from ..runs.checkpoint import Checkpoint, optimizer_params, param_names
from ..runs.compiled import ORIG_MOD, wrapped_names

LOSS_ULPS = 8  # a logged and a replayed loss this close (float32 ulps) match: rounding, not divergence
STATE_RTOL = 1e-3  # across CPUs a state value this close (relative) to the recorded one matches, as a loss does
STATE_ATOL = 1e-6  # ... or this close relative to its tensor's largest magnitude (a value near zero after cancelling)
_SIGNED = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _ordered(bits: int, nbits: int) -> int:
    """A float's sign-magnitude bit pattern as an integer that counts ulps: adjacent floats differ by 1."""
    sign = 1 << (nbits - 1)
    return bits if bits < sign else sign - bits


def float32_ulps(a: float, b: float) -> int | None:
    """|a - b| in units in the last place of float32; None when either is non-finite or beyond float32."""
    if not (math.isfinite(a) and math.isfinite(b)):
        return None
    try:
        x, y = (struct.unpack("<I", struct.pack("<f", v))[0] for v in (a, b))
    except OverflowError:
        return None
    return abs(_ordered(x, 32) - _ordered(y, 32))


def losses_match(logged: float, replayed: float, rtol: float, max_ulps: int = LOSS_ULPS) -> bool:
    """Both NaN, the same infinity, or within ``max_ulps`` float32 ulps or ``rtol`` of each other."""
    if math.isnan(logged) or math.isnan(replayed):
        return math.isnan(logged) and math.isnan(replayed)
    if math.isinf(logged) or math.isinf(replayed):
        return logged == replayed
    ulps = float32_ulps(logged, replayed)
    return (ulps is not None and ulps <= max_ulps) or abs(logged - replayed) <= rtol * abs(logged)


def judge(spread: list[StepRecord], compared: list[CheckpointComparison], rtol: float,
          max_ulps: int = LOSS_ULPS) -> int | None:
    """The first step where the replay parts from the run (None: reproduced).

    A checkpoint that differs parts them at its step. A loss parts them only after the last checkpoint that
    matched exactly: before it, a loss that differs is the reduction's rounding, since the state it came
    from and led to is the recorded one.
    """
    mismatch = next((c.step for c in compared if c.error is None and not c.matched), None)
    until = exact_until(compared)
    loss = next((s.step for s in spread if s.logged_loss is not None and (until is None or s.step >= until)
                 and not losses_match(s.logged_loss, s.replayed_loss, rtol, max_ulps)), None)
    found = [s for s in (mismatch, loss) if s is not None]
    return min(found) if found else None


def exact_until(compared: list[CheckpointComparison]) -> int | None:
    """The last recorded checkpoint the replay matched (bit for bit, or within the cross-CPU tolerance) before any it
    did not: a logged loss before it that differs is the reduction's rounding."""
    usable = [c for c in compared if c.error is None]
    mismatch = next((c.step for c in usable if not c.matched), None)
    return max((c.step for c in usable if c.matched and (mismatch is None or c.step < mismatch)), default=None)


# ---- the state against a checkpoint -----------------------------------------------------------------------


def compare_checkpoint(model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                       checkpoint: Checkpoint, rtol: float = 0.0, held_only: bool = False) -> CheckpointComparison:
    """Every model tensor (parameters and buffers) and optimizer-state tensor against ``checkpoint``'s files, bit
    for bit, or where ``rtol`` is above 0 within it (and ``STATE_ATOL`` of the tensor's largest magnitude).
    ``held_only``: only the tensors ``model`` holds (a pipeline stage's, of a checkpoint of every stage).

    A checkpoint that cannot be read is reported with its error rather than failing the replay: it decides nothing.
    """
    try:
        results = list(_compared(model, optimizer, checkpoint, rtol, held_only))
    except BadInput as e:
        return CheckpointComparison(checkpoint.step, str(checkpoint.path), 0, False, 0, None, error=str(e),
                                    tolerance=rtol)
    found = [r.mismatch for r in results if r.mismatch is not None]
    rounded = sum(r.rounded for r in results)
    return CheckpointComparison(checkpoint.step, str(checkpoint.path), len(results), not found and not rounded,
                                len(found), found[0] if found else None, sum(r.values for r in results),
                                sum(r.nan for r in results), tolerance=rtol, rounded=rounded,
                                max_ulps=max((r.max_ulps for r in results if r.max_ulps is not None), default=None))


class _Result(NamedTuple):
    mismatch: TensorMismatch | None  # None: equal (bit for bit, or within the tolerance)
    values: int        # compared
    nan: int = 0       # NaN in both
    rounded: int = 0   # differing within the tolerance
    max_ulps: int | None = None  # the largest of those differences, in ulps


def _compared(model: torch.nn.Module, optimizer: torch.optim.Optimizer, checkpoint: Checkpoint,
              rtol: float, held_only: bool = False) -> Iterator[_Result]:
    """Each tensor, in model then optimizer order."""
    buffers = {n for n, _ in model.named_buffers(remove_duplicate=False)}
    replayed = model.state_dict()
    recorded_model, recorded_state = _recorded(checkpoint)
    if held_only:
        recorded_model = {k: recorded_model.get(k) for k in recorded_model.keys() if k in replayed}
        recorded_state = {k: recorded_state.get(k) for k in recorded_state.keys() if k.rpartition("/")[0] in replayed}
    for name, recorded in _with_missing(recorded_model, replayed):
        yield _compare(name, "buffer" if name in buffers else "parameter", recorded, replayed.get(name), rtol)
    state = {f"{n}/{key}": value for n, p in zip(param_names(model, optimizer), optimizer_params(optimizer))
             for key, value in optimizer.state.get(p, {}).items() if isinstance(value, torch.Tensor)}
    for key, recorded in _with_missing(recorded_state, state):
        name, _, state_key = key.rpartition("/")
        yield _compare(f"{state_key} of {name}", "optimizer_state", recorded, state.get(key), rtol)


_Tensors = Union[TensorFile, Mapping[str, torch.Tensor]]  # keys() and get(key)


def _recorded(checkpoint: Checkpoint) -> tuple[_Tensors, _Tensors]:
    """The checkpoint's model and optimizer-state tensors: read one at a time from its safetensors files, or
    assembled whole from a distributed run's torch.distributed.checkpoint shards (FSDP2)."""
    if checkpoint.sharded:
        return checkpoint.model_tensors(), dict(checkpoint.optimizer_tensors())
    return TensorFile(checkpoint.model_file), TensorFile(checkpoint.optimizer_file)


def _with_missing(file: _Tensors, replayed: dict[str, torch.Tensor]) -> Iterator[tuple[str, torch.Tensor | None]]:
    """The recorded tensors one at a time, then the replayed names the file lacks (recorded as None)."""
    keys = list(file.keys())
    # a run recorded before the recorder unwrapped torch.compile: the file's names are the wrapper's, the replay's the module's
    strip = len(ORIG_MOD) if wrapped_names(keys) and not wrapped_names(replayed) else 0
    for key in keys:
        yield key[strip:], file.get(key)
    for key in sorted(set(replayed) - {k[strip:] for k in keys}):
        yield key, None


def _spec(t: torch.Tensor | None) -> str:
    return "missing" if t is None else f"{str(t.dtype).removeprefix('torch.')}{list(t.shape)}"


def _compare(name: str, kind: str, recorded: torch.Tensor | None, replayed: torch.Tensor | None,
             rtol: float = 0.0) -> _Result:
    if recorded is None or replayed is None or recorded.dtype != replayed.dtype or recorded.shape != replayed.shape:
        size = max(t.numel() for t in (recorded, replayed) if t is not None)
        return _Result(TensorMismatch(name, kind, [], _spec(recorded), _spec(replayed), size, None), size)
    a, b = recorded, whole(replayed).detach().cpu()  # a replay at world size holds FSDP2's shards: gathered
    if a.is_complex():
        a, b = torch.view_as_real(a), torch.view_as_real(b)
    if a.is_floating_point():
        both_nan = a.isnan() & b.isnan()
        differ = (a.view(_SIGNED[a.element_size()]) != b.view(_SIGNED[a.element_size()])) & ~both_nan
    else:
        both_nan, differ = None, a != b
    count, nan = int(differ.sum()), int(both_nan.sum()) if both_nan is not None else 0
    if count == 0:
        return _Result(None, a.numel(), nan)
    rounded, max_ulps = 0, None
    if rtol > 0 and a.is_floating_point():
        x, y = a.double(), b.double()
        finite = x[x.isfinite()].abs()
        scale = float(finite.max()) if finite.numel() else 0.0
        close = differ & ((x - y).abs() <= rtol * torch.maximum(x.abs(), y.abs()) + STATE_ATOL * scale)
        rounded = int(close.sum())
        if rounded:
            max_ulps = int((_ordered_tensor(a[close]) - _ordered_tensor(b[close])).abs().max())
        differ, count = differ & ~close, count - rounded
        if count == 0:
            return _Result(None, a.numel(), nan, rounded, max_ulps)
    flat = int(differ.reshape(-1).to(torch.uint8).argmax())
    index = [int(i) for i in torch.unravel_index(torch.tensor(flat), a.shape)]
    index = index[:-1] if recorded.is_complex() else index
    x, y = a.reshape(-1)[flat], b.reshape(-1)[flat]
    return _Result(TensorMismatch(name, kind, index, _text(x), _text(y), count, _ulps(x, y)), a.numel(), nan, rounded,
                   max_ulps)


def _ordered_tensor(t: torch.Tensor) -> torch.Tensor:
    """``_ordered`` of every value of a float tensor, as float64 (exact for the ulps of float32 and narrower)."""
    nbits = 8 * t.element_size()
    bits = t.view(_SIGNED[t.element_size()]).to(torch.int64)
    magnitude = (bits & ((1 << (nbits - 1)) - 1)).double()
    return torch.where(bits < 0, -magnitude, magnitude)


def _text(x: torch.Tensor) -> str:
    value = x.item()
    return finite.value_name(value) if isinstance(value, float) and not math.isfinite(value) else repr(value)


def _ulps(x: torch.Tensor, y: torch.Tensor) -> int | None:
    """The distance of two values of one floating dtype in its own ulps; None across a NaN or for integers."""
    if not x.is_floating_point() or x.isnan() or y.isnan():
        return None
    size = x.element_size()
    mask = (1 << (8 * size)) - 1
    bits = [int(v.view(_SIGNED[size]).item()) & mask for v in (x, y)]
    return abs(_ordered(bits[0], 8 * size) - _ordered(bits[1], 8 * size))
