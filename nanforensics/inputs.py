"""The one way in: every file nanforensics reads is opened, bounded and parsed here.

A file is read only when it is a regular file reached without leaving the tree being examined (a run
directory, a checkpoint, a saved report: ``examine`` names them), so a symlink inside a run that points
at a credentials file is refused unread, and nothing of it is ever quoted. It is opened non-blocking and
checked again after opening, so a FIFO in a file's place never hangs a command. What a file claims is
checked against the limits below before anything is allocated for it: a header's tensor count, the
element count a shape or a stride claims, JSON nesting and size. The limits are in README's Security
section.

Safetensors is read here too: it is the run format's own, and its header is the first claim a checkpoint
makes. ``SafetensorsFile`` maps one tensor at a time (``safe_open``, and ``TensorFile`` over it, maps the
whole file for the life of the handle: a scan would end with the whole checkpoint resident); the header
is checked against the file's size first, so a truncated file is a ``BadInput`` naming the tensor that
runs past its end, never a bus error.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import json
import math
import mmap
import os
import stat
import struct
import threading
import warnings
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, BinaryIO, Callable, Iterator

from .errors import BadInput, shown

if TYPE_CHECKING:  # torch is imported where a tensor is read: the CLI's help and its refusals start without it
    import torch

# ---- the limits (README, Security: "Files nanforensics reads and writes") ---------------------------------------
MAX_TEXT_BYTES = 256 << 20  # a JSON or text file read whole: manifest, meta.json, steps.jsonl, a report
MAX_NESTING = 100  # no file this tool reads nests deeper; past it, recursive readers and writers would crash
MAX_JSON_OBJECTS = 1_000_000  # objects in one JSON document (a long run's report holds some thousands) or unpickled tree
MAX_HEADER_BYTES = 100 << 20  # a safetensors header: the format's own limit
MAX_TENSORS = 100_000  # tensors in one file (a safetensors header, a PyTorch pickle, a DCP checkpoint)
MAX_PICKLE_OBJECTS = 10_000_000  # objects a pickle stands for, every shared (memo) reference followed
MAX_EXPANDED_BYTES = 64 << 20  # how far a view (a stride of 0) may claim more bytes than its storage holds
MAX_STRIDE = (1 << 63) - 1  # a shape whose contiguous strides (in bytes) pass int64 cannot be laid out



@functools.cache
def _dtypes() -> dict[str, torch.dtype]:
    import torch

    return {
        "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
        "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2, "C64": torch.complex64,
        "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
        "U64": torch.uint64, "U32": torch.uint32, "U16": torch.uint16, "U8": torch.uint8, "BOOL": torch.bool,
    }


# ---- memory -----------------------------------------------------------------------------------------------------


@contextlib.contextmanager
def claiming(path: Path, what: str, nbytes: int) -> Iterator[None]:
    """Reading ``what`` of ``path``, which claims ``nbytes``: memory refused on the way (an address-space limit,
    ``ulimit -v``; a sparse file whose tensor is larger than memory) is one error naming the file and the claim, never
    a ``MemoryError`` naming nothing."""
    try:
        yield
    except MemoryError:
        raise BadInput(path, f"{what}: {nbytes} bytes claimed, more memory than this process may take") from None
    except OSError as e:
        if e.errno != errno.ENOMEM:
            raise
        raise BadInput(path, f"{what}: {nbytes} bytes claimed, more memory than this process may take") from None


# ---- the examined trees -----------------------------------------------------------------------------------------

_trees: list[tuple[Path, Path]] = []  # (as given, absolute; resolved): what this process examines
_lock = threading.Lock()


def examine(root: Path | str) -> None:
    """Declare ``root`` (a run directory, a checkpoint file or folder, a saved report) examined: a file below it is
    read only where it resolves inside it, and no output is written into it (``outputs``)."""
    given, real = Path(os.path.abspath(root)), Path(os.path.realpath(root))
    with _lock:
        if (given, real) not in _trees:
            _trees.append((given, real))


def examined() -> list[Path]:
    """The resolved roots of every tree examined in this process."""
    with _lock:
        return [real for _, real in _trees]


def _leaves_tree(path: Path) -> Path | None:
    """The examined root that ``path`` lies under by name but leaves when resolved (through a symlink), if any."""
    given_path = Path(os.path.abspath(path))
    with _lock:
        trees = list(_trees)
    for given, real in trees:
        if given_path != given and given_path.is_relative_to(given):
            if not Path(os.path.realpath(given_path)).is_relative_to(real):
                return given
    return None


# ---- opening ----------------------------------------------------------------------------------------------------

_KINDS = ((stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket"), (stat.S_ISCHR, "a character device"),
          (stat.S_ISBLK, "a block device"), (stat.S_ISDIR, "a directory"))


def not_regular(mode: int) -> str | None:
    """None for a regular file; else what the mode says it is."""
    return None if stat.S_ISREG(mode) else next((f"not a regular file ({kind})" for is_kind, kind in _KINDS
                                                  if is_kind(mode)), "not a regular file")


def check_regular(path: Path) -> None:
    """A ``BadInput`` unless ``path`` is a regular file, decided by ``stat`` alone: nothing is opened."""
    try:
        problem = not_regular(os.stat(path).st_mode)
    except FileNotFoundError:
        raise BadInput(path, "file is missing") from None
    except OSError as e:
        raise BadInput(path, f"cannot read ({e.strerror or e})") from None
    if problem is not None:
        raise BadInput(path, problem)


def open_input(path: Path) -> BinaryIO:
    """The one way an input file is opened: a file reached through a symlink out of its examined tree is refused
    unread (its content never quoted); a FIFO, socket or device in its place is refused at once, never read (a
    read from a FIFO waits for a writer that never comes)."""
    outside = _leaves_tree(path)
    if outside is not None:
        raise BadInput(path, f"leads outside {outside}, the tree being examined (a symlink): not read")
    check_regular(path)  # before any open: opening some devices acts on them
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC)
    except FileNotFoundError:
        raise BadInput(path, "file is missing") from None
    except OSError as e:
        raise BadInput(path, f"cannot read ({e.strerror or e})") from None
    problem = not_regular(os.fstat(fd).st_mode)  # replaced since the stat
    if problem is not None:
        os.close(fd)
        raise BadInput(path, problem)
    os.set_blocking(fd, True)
    return os.fdopen(fd, "rb")


def read_input(path: Path, limit: int = MAX_TEXT_BYTES) -> bytes:
    """A whole file of at most ``limit`` bytes (its size checked before it is read)."""
    with open_input(path) as f:
        size = os.fstat(f.fileno()).st_size
        if size > limit:
            raise BadInput(path, f"{size} bytes, more than the {limit} this nanforensics reads of such a file")
        try:
            data = f.read(limit + 1)
        except OSError as e:
            raise BadInput(path, f"cannot read ({e.strerror or e})") from None
        if len(data) > limit:  # grown since the fstat, or a size that says less than it holds (/proc)
            raise BadInput(path, f"more than the {limit} bytes this nanforensics reads of such a file (its size said {size})")
        return data


def excerpt(data: bytes | str, limit: int = 24) -> str:
    """At most ``limit`` characters of a file's content for an error line, escaped (``repr``): never a newline or
    an escape sequence, never more of a file than identifies the place."""
    return shown(data[:limit], 2 * limit)


# ---- JSON -------------------------------------------------------------------------------------------------------


def nesting_exceeds(obj: Any, limit: int = MAX_NESTING) -> bool:
    """Whether JSON data nests deeper than ``limit`` containers (iterative: deep data cannot crash the check)."""
    stack = [(obj, 1)] if isinstance(obj, (dict, list)) else []
    while stack:
        node, depth = stack.pop()
        if depth > limit:
            return True
        stack += [(c, depth + 1) for c in (node.values() if isinstance(node, dict) else node) if isinstance(c, (dict, list))]
    return False


class _TooMany(Exception):
    pass


def _bounded_loads(data: bytes | str, limit: int) -> Any:
    """``json.loads`` that stops once it has built ``limit`` objects, before it builds more."""
    count = 0

    def pairs(items: list[tuple[str, Any]]) -> dict[str, Any]:
        nonlocal count
        count += 1
        if count > limit:
            raise _TooMany
        return dict(items)

    return json.loads(data, object_pairs_hook=pairs)


def parse_json(data: bytes | str, where: Path, what: str = "", objects: int = MAX_JSON_OBJECTS) -> Any:
    """JSON input parsed, or a ``BadInput`` naming ``where`` (and ``what`` in it): malformed, an integer too long
    to convert, more than ``objects`` objects, or nested deeper than ``MAX_NESTING``."""
    field = f"{what}: " if what else ""
    try:
        obj = _bounded_loads(data, objects)
    except json.JSONDecodeError as e:
        raise BadInput(where, f"{field}not valid JSON ({e.msg} at line {e.lineno})") from None
    except RecursionError:
        raise BadInput(where, f"{field}JSON nested too deeply (more than {MAX_NESTING} levels)") from None
    except _TooMany:
        raise BadInput(where, f"{field}more than {objects} JSON objects") from None
    except (ValueError, UnicodeDecodeError) as e:  # an integer of thousands of digits, bytes that are not text
        raise BadInput(where, f"{field}not valid JSON ({one_line(e)[:120]})") from None
    if nesting_exceeds(obj):
        raise BadInput(where, f"{field}JSON nested too deeply (more than {MAX_NESTING} levels)")
    return obj


def load_json(path: Path) -> Any:
    return parse_json(read_input(path), path)


# ---- what tensors claim -----------------------------------------------------------------------------------------


def shape_problem(shape: tuple[int, ...], itemsize: int) -> str | None:
    """Why a shape cannot be laid out (a negative size, contiguous strides past int64), or None."""
    if any(n < 0 for n in shape):
        return f"shape {shown(list(shape))} has a negative size"
    if math.prod(n for n in shape if n) * itemsize > MAX_STRIDE:
        return f"shape {shown(list(shape))} has strides beyond 2^63 bytes"
    return None


_Trail = Any  # where a node lies in an unpickled tree: (its parent's trail, its key), None at the top


def check_tensors(obj: Any, where: Path) -> None:
    """Refuse an unpickled object whose tensors claim what no storage holds, before anything reads them: more than
    ``MAX_TENSORS`` of them, more than ``MAX_JSON_OBJECTS`` objects walked as a tree (a pickle's memo makes one
    container referenced a million times in a few bytes: every reader would walk it a million times), containers
    nested deeper than ``MAX_NESTING`` (a cycle among them), an optimizer state dict of another shape than torch's
    (``optimizer_problem``), a view claiming more than
    ``MAX_EXPANDED_BYTES`` beyond its storage (a stride of 0 over 2^40 elements), a sparse tensor whose stored
    values do not fit its claimed size."""
    import torch

    stack: list[tuple[Any, int, _Trail]] = [(obj, 0, None)]
    objects, tensors = 0, 0
    while stack:
        node, depth, trail = stack.pop()
        objects += 1  # every reference: the readers walk the object as a tree, a shared part once per reference
        if objects > MAX_JSON_OBJECTS:
            raise BadInput(where, f"holds more than {MAX_JSON_OBJECTS:,} objects, counting each reference to a shared one")
        if depth > MAX_NESTING:
            raise BadInput(where, f"its objects nest more than {MAX_NESTING} deep")
        if isinstance(node, torch.Tensor):
            tensors += 1
            if tensors > MAX_TENSORS:
                raise BadInput(where, f"holds more than {MAX_TENSORS} tensors")
            _check_claim(node, where)
        elif isinstance(node, (dict, list, tuple)):
            if isinstance(node, dict) and isinstance(node.get("state"), dict) and isinstance(node.get("param_groups"), list):
                problem = optimizer_problem(node, field_path(trail))
                if problem is not None:
                    raise BadInput(where, problem)
            children = node.items() if isinstance(node, dict) else enumerate(node)
            stack += [(c, depth + 1, (trail, k)) for k, c in children]


def field_path(trail: _Trail) -> str:
    """A node's place in an unpickled tree as an error names it: ``optimizer.param_groups[0]``."""
    steps: list[str] = []
    while trail is not None:
        trail, key = trail
        steps.append(_step(key))
    return "".join(reversed(steps)).lstrip(".")


def _step(key: Any) -> str:
    """One key of a field path: ``.name``, ``[3]``, or an excerpt of a key that is neither (``[b'\\xff']``)."""
    if isinstance(key, str) and key.isidentifier() and len(key) <= 40:
        return f".{key}"
    return f"[{shown(key)}]"  # an int too: a state id of 5,000 digits from the file, which ``str`` refuses to write


def _count(value: Any) -> bool:
    from .numbers import is_count  # torch's import with it: not for the CLI's help and refusals

    return is_count(value)


MALFORMED = "optimizer state is malformed: "  # a shape no torch optimizer writes; a field's wrong type names the field


def optimizer_problem(sd: dict[str, Any], name: str = "") -> str | None:
    """What makes an optimizer state dict (``state`` a dict, ``param_groups`` a list) unlike any torch writes, as
    the error says it after the file's name, or None. Every reader indexes it as torch lays it out (groups of
    hashable parameter ids or names, and hyperparameters of the types ``HYPERPARAMETERS`` allows; per parameter,
    named tensors and numbers), so the gate after unpickling refuses any other shape, wherever it lies in the file
    (``name``: where, ``optimizer`` or ``optimizer_states[0]``; empty for a file that is the state dict)."""
    for g in sd["param_groups"]:
        if not (isinstance(g, dict) and isinstance(g.get("params"), list)):
            return f"{MALFORMED}a parameter group without a 'params' list"
        if not all(_count(p) or isinstance(p, str) for p in g["params"]):
            return f"{MALFORMED}a parameter group's 'params' holds something other than parameter ids or names"
    for pid, entry in sd["state"].items():
        if not isinstance(entry, dict):
            return f"{MALFORMED}a parameter's state is a {type(entry).__name__}, not a dict of named values"
        for key, value in entry.items():
            if not isinstance(key, str):
                return f"{MALFORMED}a parameter's state holds a key that is not a name"
            kind = STATE.get(key, _OTHER_STATE)
            if not kind.holds(value):
                return f"{name + '.' if name else ''}state{_step(pid)}{_step(key)} is {_what(value)}, not {kind.said}"
    return hyperparameter_problem(sd["param_groups"], f"{name}.param_groups" if name else "param_groups")


def hyperparameter_problem(groups: list[dict[str, Any]], at: str) -> str | None:
    """The first hyperparameter of the param groups (dicts) at field path ``at`` of a type ``HYPERPARAMETERS`` does
    not allow, named by its field path and said with the type it has and the one it needs; None when all are. The
    readers take each as its type (``if group["amsgrad"]``, ``float(group["lr"])``): a complex tensor as a flag
    would end in ``bool()``'s RuntimeError, a string as a rate in the replayed step's ValueError blamed on the step
    function."""
    for g, group in enumerate(groups):
        for key, value in group.items():
            if not isinstance(key, str):
                return f"{at}[{g}] holds a key {shown(key)}, not a name"
            kind = HYPERPARAMETERS.get(key, _OTHER)
            if not kind.holds(value):  # ``params`` too: its ids or names, checked before, are a flat list of scalars
                return f"{at}[{g}]{_step(key)} is {_what(value)}, not {kind.said}"
    return None


# ---- the hyperparameters of a param group: an allow-list of the types torch's optimizers give each -----------------


@dataclass(frozen=True)
class _Kind:
    said: str  # what a value of the kind is, in an error: "a bool"
    holds: Callable[[Any], bool]


def _number(value: Any) -> bool:
    """An int or a float, NaN and infinities included (their values are findings, ``scan``'s); not a bool, which
    no optimizer writes where it means a number and which every check of the value would pass over."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _real_tensor(value: Any) -> bool:
    """A one-element tensor of a real dtype on the CPU: what torch takes for ``lr`` (capturable and fused steps),
    Adam's ``betas`` and SGD's ``weight_decay``, and reads with ``.item()``."""
    import torch

    return (isinstance(value, torch.Tensor) and value.layout == torch.strided and value.device.type == "cpu"
            and value.numel() == 1 and not value.is_complex() and value.dtype != torch.bool)


def _reals(n: int, each: Callable[[Any], bool] = _number) -> Callable[[Any], bool]:
    return lambda v: isinstance(v, (list, tuple)) and len(v) == n and all(each(x) for x in v)


def _scalar(value: Any) -> bool:
    """What a custom key may hold: a number, a bool, a name, None, or a real or bool tensor of any shape on the CPU
    (DeepSpeed's OnebitAdam keeps a mask, ``exp_avg_mask``); no reader interprets it beyond ``numbers.real``."""
    import torch

    return value is None or isinstance(value, (bool, int, float, str)) or (
        isinstance(value, torch.Tensor) and value.layout == torch.strided and value.device.type == "cpu"
        and not value.is_complex())


_FLAG = _Kind("a bool", lambda v: isinstance(v, bool))
_REAL = _Kind("a real number", _number)
_RATE = _Kind("a real number or a one-element real tensor", lambda v: _number(v) or _real_tensor(v))
_HYPERPARAMETER_KINDS: dict[_Kind, tuple[str, ...]] = {
    _FLAG: ("amsgrad", "capturable", "centered", "decoupled_weight_decay", "differentiable", "maximize", "nesterov"),
    _Kind("a bool or None", lambda v: v is None or isinstance(v, bool)): ("foreach", "fused"),
    _REAL: ("alpha", "beta2_decay", "d", "dampening", "initial_accumulator_value", "lambd", "lr_decay", "momentum",
            "momentum_decay", "rho", "t0", "tolerance_change", "tolerance_grad", "base_momentum", "max_momentum"),
    _Kind("a real number, a one-element real tensor or None", lambda v: v is None or _RATE.holds(v)): ("lr",),  # None:
    # transformers' Adafactor with relative_step=True computes its own; every reader of lr takes it (numbers.real)
    _RATE: ("weight_decay", "initial_lr", "max_lr", "min_lr", "swa_lr"),  # the last four: LR schedulers' own
    _Kind("an int", _count): ("max_iter", "max_eval", "history_size", "ns_steps"),
    _Kind("two or three real numbers or two one-element real tensors",  # three: bitsandbytes' AdEMAMix
          lambda v: _reals(2)(v) or _reals(3)(v) or _reals(2, _real_tensor)(v)): ("betas",),
    _Kind("a real number, or a pair of a real number or None and a real number (Adafactor's)",
          lambda v: _number(v) or _reals(2)(v) or (isinstance(v, (list, tuple)) and len(v) == 2 and v[0] is None
                                                   and _number(v[1]))): ("eps",),
    _Kind("a pair of real numbers", _reals(2)): ("etas", "step_sizes"),
    _Kind("three real numbers", _reals(3)): ("ns_coefficients",),
    _Kind("a name or None", lambda v: v is None or isinstance(v, str)): ("line_search_fn", "adjust_lr_fn"),
    _Kind("a list of names", lambda v: isinstance(v, list) and all(isinstance(n, str) for n in v)): ("param_names",),
}
HYPERPARAMETERS: dict[str, _Kind] = {key: kind for kind, keys in _HYPERPARAMETER_KINDS.items() for key in keys}
# A key no optimizer of torch's has (a custom optimizer's, a library's: ``correct_bias``, ``decay_rate``) reaches
# only that optimizer's own step; the readers take it as a scalar at most (``numbers.real``), so anything a
# hyperparameter can be passes, real and bool tensors of any shape too, and nested containers, bytes and complex
# numbers and tensors do not.
_OTHER = _Kind("a number, a bool, a name, None, a real or bool tensor or a flat list of these",
               lambda v: _scalar(v) or isinstance(v, (list, tuple)) and all(_scalar(x) for x in v))


# ---- a parameter's optimizer state: an allow-list of the types torch's optimizers keep under each key ---------------
# Each step reads them as these (``exp_avg.lerp_``, ``1 - beta ** step``): a list, a bool tensor or None there ended in
# the replayed step's error, blamed on the user's step function. Values are not checked here: a step of -5 or NaN
# is ``scan``'s finding. A key no torch optimizer keeps (a library's) may hold a tensor, a number or None, or a flat
# list of these (bitsandbytes' and transformers' own state).


def _state_tensor(value: Any) -> bool:
    """A tensor of a real dtype, of any shape and layout (a sparse momentum buffer is scanned by its values)."""
    import torch

    return isinstance(value, torch.Tensor) and not value.is_complex() and value.dtype != torch.bool


def _tensors(none: bool) -> Callable[[Any], bool]:
    return lambda v: isinstance(v, list) and all(_state_tensor(x) or none and x is None for x in v)


_STATE_KINDS: dict[_Kind, tuple[str, ...]] = {
    _Kind("a real tensor", _state_tensor): (
        "exp_avg", "exp_avg_sq", "max_exp_avg_sq", "exp_inf", "square_avg", "acc_delta", "grad_avg", "sum", "mu_product",
        "eta", "mu", "ax", "prev", "step_size", "row_var", "col_var", "variance", "d", "H_diag", "prev_flat_grad"),
    _Kind("a real tensor or None", lambda v: v is None or _state_tensor(v)): ("momentum_buffer",),
    _Kind("a real number or a one-element real tensor", _RATE.holds): ("step", "t", "prev_loss"),
    _Kind("an int", _count): ("func_evals", "n_iter"),
    _Kind("a list of real tensors", _tensors(False)): ("old_dirs", "old_stps", "ro"),
    _Kind("a list of real tensors or None", _tensors(True)): ("al",),
}
STATE: dict[str, _Kind] = {key: kind for kind, keys in _STATE_KINDS.items() for key in keys}
_OTHER_STATE = _Kind("a tensor, a number, None or a flat list of these", lambda v: all(
    x is None or isinstance(x, (int, float)) or _is_tensor(x) for x in (v if isinstance(v, (list, tuple)) else [v])))


def _is_tensor(value: Any) -> bool:
    import torch

    return isinstance(value, torch.Tensor)


def _what(value: Any) -> str:
    """A value's kind in words, never its content (it comes from the file)."""
    import torch

    if isinstance(value, torch.Tensor):
        dtype = "complex" if value.is_complex() else "bool" if value.dtype == torch.bool else "real"
        where = "" if value.device.type == "cpu" else f" on {value.device.type}"
        return f"a {dtype} tensor{where}" + (f" of {value.numel()} elements" if value.numel() != 1 else "")
    if isinstance(value, (list, tuple)):
        return f"a {type(value).__name__} of {len(value)}"
    words = {bool: "a bool", int: "an int", float: "a float", str: "a string", dict: "a dict", type(None): "None"}
    return words.get(type(value), f"a {type(value).__name__}")


def _check_claim(t: torch.Tensor, where: Path) -> None:
    import torch

    problem = shape_problem(tuple(t.shape), t.element_size())
    if problem is not None:
        raise BadInput(where, f"a tensor's {problem}")
    if t.layout == torch.strided:
        claimed, stored = t.numel() * t.element_size(), t.untyped_storage().nbytes()
        if claimed > stored + MAX_EXPANDED_BYTES:
            raise BadInput(where, f"a tensor of shape {shown(list(t.shape))} claims {claimed} bytes over a storage of "
                                  f"{stored} (a stride-0 or overlapping view); nanforensics reads at most "
                                  f"{MAX_EXPANDED_BYTES} more than a tensor stores")
    else:  # a sparse tensor claims only what its stored parts hold: those are views, checked as such
        for part in _sparse_parts(t):
            _check_claim(part, where)


def _sparse_parts(t: torch.Tensor) -> list[torch.Tensor]:
    """The strided tensors a sparse tensor stores (indices and values)."""
    import torch

    if t.layout == torch.sparse_coo:
        return [t._indices(), t._values()]
    if t.layout in (torch.sparse_csr, torch.sparse_bsr):
        return [t.crow_indices(), t.col_indices(), t.values()]
    if t.layout in (torch.sparse_csc, torch.sparse_bsc):
        return [t.ccol_indices(), t.row_indices(), t.values()]
    return []


# ---- safetensors ------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Entry:
    """One tensor of the file: absolute byte range [start, end)."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    start: int
    end: int


class SafetensorsFile:
    """Header parsed and validated on open; tensors mapped on demand by ``read``.

    The file stays open while the object lives: each tensor is mapped from the file whose header was checked (a
    file put in its place since is never read), without opening it again per tensor.
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        f = self._file = open_input(path)
        weakref.finalize(self, f.close)
        try:
            size = os.fstat(f.fileno()).st_size
            head = f.read(8)
            if len(head) < 8:
                raise BadInput(path, f"truncated: {size} bytes, too short for a safetensors header")
            (n,) = struct.unpack("<Q", head)
            if n > MAX_HEADER_BYTES:
                raise BadInput(path, f"not a safetensors file (header length {n})")
            if 8 + n > size:
                raise BadInput(path, f"truncated: the header needs {8 + n} bytes, the file has {size}")
            raw = f.read(n)
        except OSError as e:
            raise BadInput(path, f"cannot read ({e.strerror or e})") from None
        try:  # an entry is an object: counting objects bounds the tensors before they are built
            header = _bounded_loads(raw, MAX_TENSORS + 2)
        except RecursionError:
            raise BadInput(path, "not a safetensors file (its header is JSON nested too deeply)") from None
        except _TooMany:
            raise BadInput(path, f"its header lists more than {MAX_TENSORS} tensors") from None
        except ValueError:  # not JSON, not text, an integer of thousands of digits
            raise BadInput(path, "not a safetensors file (its header is not JSON)") from None
        if not isinstance(header, dict):
            raise BadInput(path, "not a safetensors file (its header is not a JSON object)")
        meta = header.pop("__metadata__", None) or {}
        if not isinstance(meta, dict) or nesting_exceeds(meta, 1):
            raise BadInput(path, "malformed safetensors header (__metadata__ is not an object of strings)")
        if len(header) > MAX_TENSORS:
            raise BadInput(path, f"its header lists more than {MAX_TENSORS} tensors")
        self.metadata: dict[str, str] = {str(k): str(v) for k, v in meta.items()}
        base, data_size = 8 + n, size - 8 - n
        self.entries = sorted((self._entry(name, spec, base, data_size) for name, spec in header.items()),
                              key=lambda e: e.start)

    def _entry(self, name: str, spec: object, base: int, data_size: int) -> Entry:
        try:
            dtype_name, shape, (begin, end) = spec["dtype"], spec["shape"], spec["data_offsets"]  # type: ignore[index]
            shape = tuple(shape)
        except (KeyError, TypeError, ValueError):
            raise BadInput(self.path, f"malformed safetensors header entry for tensor {name!r}") from None
        for field, values in (("shape", shape), ("data_offsets", (begin, end))):
            if not all(type(n) is int and 0 <= n <= MAX_STRIDE for n in values):  # not 1e400, nor 2.5
                raise BadInput(self.path, f"tensor {name!r}: {field} {shown(list(values))} is not a list of integers "
                                          "from 0 to 2^63-1")
        dtype = _dtypes().get(dtype_name) if isinstance(dtype_name, str) else None
        if dtype is None:
            raise BadInput(self.path, f"tensor {name!r} has dtype {shown(dtype_name)}, which this nanforensics cannot "
                                      "read")
        if not 0 <= begin <= end:
            raise BadInput(self.path, f"malformed safetensors header entry for tensor {name!r}")
        problem = shape_problem(shape, dtype.itemsize)
        if problem is not None:
            raise BadInput(self.path, f"tensor {name!r}: {problem}")
        if end > data_size:
            raise BadInput(self.path, f"truncated: tensor {name!r} ends at data byte {end}, "
                                      f"the file holds {data_size} data bytes")
        expected = math.prod(shape) * dtype.itemsize
        if end - begin != expected:
            raise BadInput(self.path, f"tensor {name!r} spans {end - begin} bytes, its shape {list(shape)} "
                                      f"of {dtype_name} needs {expected}")
        return Entry(name, dtype, shape, base + begin, base + end)

    def read(self, entry: Entry) -> torch.Tensor:
        """The tensor over a private read-only map of its bytes: unmapped when the tensor is freed.

        Read-only, so torch's warning about non-writable buffers is silenced: nothing here writes.
        """
        import torch

        if entry.end == entry.start:
            return torch.empty(entry.shape, dtype=entry.dtype)
        offset = entry.start - entry.start % mmap.ALLOCATIONGRANULARITY
        try:
            fd = self._file.fileno()
            if os.fstat(fd).st_size < entry.end:
                raise BadInput(self.path, f"truncated while being read: tensor {entry.name!r} is past its end")
            with claiming(self.path, f"tensor {entry.name!r}", entry.end - entry.start):
                region = mmap.mmap(fd, entry.end - offset, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ, offset=offset)
        except OSError as e:
            raise BadInput(self.path, f"cannot map tensor {entry.name!r} ({e.strerror or e})") from None
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="The given buffer is not writable")
            flat = torch.frombuffer(region, dtype=entry.dtype, count=math.prod(entry.shape),
                                    offset=entry.start - offset)
        return flat.view(entry.shape)


class TensorFile:
    """A safetensors file opened lazily: tensors are memory-mapped and read one at a time."""

    def __init__(self, path: Path) -> None:
        # The header checked first: safe_open calls a truncated file "incomplete metadata" and an unreadable
        # one "No such file"; SafetensorsFile names the problem and the tensor.
        from safetensors import SafetensorError, safe_open

        self.path = path
        checked = SafetensorsFile(path)
        self._claims = {e.name: e.end - e.start for e in checked.entries}
        try:
            with claiming(path, "its tensors", sum(self._claims.values())):  # safe_open maps the whole file
                self._handle = safe_open(str(path), framework="pt", device="cpu")
        except (SafetensorError, OSError, ValueError) as e:
            raise BadInput(path, f"not a readable safetensors file ({one_line(e)})") from None

    def keys(self) -> list[str]:
        return list(self._handle.keys())

    def metadata(self) -> dict[str, str]:
        return dict(self._handle.metadata() or {})

    def get(self, key: str) -> torch.Tensor:
        from safetensors import SafetensorError

        try:
            with claiming(self.path, f"tensor {key!r}", self._claims.get(key, 0)):
                return self._handle.get_tensor(key)
        except (SafetensorError, OSError, ValueError, RuntimeError) as e:
            raise BadInput(self.path, f"tensor {key!r} is unreadable ({one_line(e)})") from None

    def items(self) -> Iterator[tuple[str, torch.Tensor]]:
        for key in self.keys():
            yield key, self.get(key)

    def load_all(self) -> dict[str, torch.Tensor]:
        return dict(self.items())


def one_line(e: BaseException) -> str:
    return " ".join(str(e).split()) or e.__class__.__name__
