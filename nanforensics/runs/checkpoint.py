"""Checkpoints of the run format: model, full optimizer state and RNG states, before a step."""

from __future__ import annotations

import base64
import math
import random
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator

import torch

from ..distributed.tensors import shard_like, whole
from ..errors import BadInput, shown
from ..finite import decode_float, encode_float
from ..inputs import TensorFile, hyperparameter_problem, load_json, one_line
from ..numbers import is_count
from ..schema import load
from .files import json_bytes, make_build_dir, publish_dir_atomic, safetensors_parts, write_bytes_atomic
from .optimizers import group_owners, loose_params, optimizer_params, optimizer_set

CHECKPOINT_FORMAT = "nanforensics.checkpoint/1"
EXTRAS_FILE = "extras.safetensors"  # tensors of the scaler's and scheduler's state, when they hold any
LOOSE_GRADS = "loose_grads"  # meta.json's key, and the prefix of those gradients' keys in EXTRAS_FILE


@dataclass
class GroupParams:
    """What a reader takes from each of meta.json's ``param_groups``: its parameters, by name (the rest of a group
    is the optimizer's hyperparameters, passed on as they are)."""

    params: list[str]


@dataclass
class CheckpointMeta:
    """meta.json's schema: a checkpoint's bookkeeping beside its tensors."""

    format: str
    param_names: list[str]
    param_groups: list[GroupParams]
    state_scalars: dict[str, dict[str, Any]]
    rng: dict[str, Any]
    step: int | None = None
    buffer_names: list[str] | None = None
    rank_rng: list[dict[str, Any]] | None = None
    scaler: Any = None
    scheduler: Any = None
    group_optimizers: list[str] | None = None  # several optimizers: the one each of param_groups belongs to
    loose_grads: list[str] | None = None  # the parameters no optimizer holds whose gradients are in EXTRAS_FILE


def checkpoint_name(step: int) -> str:
    return f"step_{step:08d}"


def param_names(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> list[str]:
    """The model's name for each parameter, in the optimizer's order (its state-dict indices)."""
    by_id = {id(p): n for n, p in model.named_parameters(remove_duplicate=False)}
    return [by_id.get(id(p), f"param.{i}") for i, p in enumerate(optimizer_params(optimizer))]


def b64(t: torch.Tensor) -> str:
    """A generator's state (a uint8 tensor) as JSON text; numpy is optional."""
    return base64.b64encode(bytes(t.tolist())).decode()


def rng_state() -> dict[str, Any]:
    state: dict[str, Any] = {"torch": b64(torch.get_rng_state()), "cuda": [], "numpy": None}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = [b64(s) for s in torch.cuda.get_rng_state_all()]
    version, internal, gauss = random.getstate()
    state["python"] = [version, list(internal), gauss]
    if "numpy" in sys.modules:
        kind, keys, pos, has_gauss, cached = sys.modules["numpy"].random.get_state()
        state["numpy"] = [kind, keys.tolist(), pos, has_gauss, cached]
    return state


def restore_rng(state: Any, where: Path | None = None) -> None:
    """Set every RNG as ``state`` (from ``rng_state``) holds it; a malformed state is a ``BadInput`` naming ``where``
    and the field."""
    part = "rng.torch"
    try:
        torch.set_rng_state(_unb64(state["torch"]))
        part = "rng.cuda"
        cuda = [_unb64(s) for s in state.get("cuda") or []]
        if cuda and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(cuda[: torch.cuda.device_count()])
        part = "rng.python"
        version, internal, gauss = state["python"]
        random.setstate((version, tuple(internal), gauss))
        part = "rng.numpy"
        if state.get("numpy") and "numpy" in sys.modules:
            np = sys.modules["numpy"]
            kind, keys, pos, has_gauss, cached = state["numpy"]
            np.random.set_state((kind, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached))
    except (KeyError, TypeError, ValueError, RuntimeError, OverflowError, AttributeError) as e:
        raise BadInput(where, f"{part} is not an RNG state recorded by nanforensics ({one_line(e)[:100]})") from None


# The dtypes of a tensor meta.json holds inline (``state_to_json``'s ``{"$bytes"}`` tag), by name: the real, bool and
# complex ones of whole bytes (the inputs' gate says which a hyperparameter may be).
INLINE_DTYPES: dict[str, torch.dtype] = {str(d).removeprefix("torch."): d for d in (
    torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2, torch.int64,
    torch.int32, torch.int16, torch.int8, torch.uint8, torch.uint16, torch.uint32, torch.uint64, torch.bool,
    torch.complex64, torch.complex128)}
_INLINE_SAID = "float64/32/16, bfloat16, float8_e4m3fn/e5m2, (u)int8-64, bool or complex64/128"


def _unb64(text: str) -> torch.Tensor:
    data = bytearray(base64.b64decode(text, validate=True))
    return torch.frombuffer(data, dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8)  # none: a 0-element one


def _inline(tensor: torch.Tensor, path: str) -> dict[str, Any]:
    """``state_to_json``'s inline tensor: its bytes (little-endian, as the safetensors files), dtype and shape."""
    name = str(tensor.dtype).removeprefix("torch.")
    if INLINE_DTYPES.get(name) != tensor.dtype or tensor.layout != torch.strided:
        raise ValueError(f"{path} is a {name} {str(tensor.layout).removeprefix('torch.')} tensor: a checkpoint holds a "
                         f"strided tensor of {_INLINE_SAID} here")
    raw = tensor.detach().to("cpu", copy=True).contiguous().reshape(-1).view(torch.uint8)
    return {"$bytes": b64(raw), "dtype": name, "shape": list(tensor.shape)}


def _from_inline(value: dict[str, Any], path: Path) -> torch.Tensor:
    """The tensor ``_inline`` wrote; a tag whose dtype, shape and bytes do not agree is an error naming ``path``."""
    dtype, shape = INLINE_DTYPES.get(value["dtype"]) if isinstance(value["dtype"], str) else None, value["shape"]
    if dtype is None or not (isinstance(shape, list) and all(is_count(n) for n in shape)):
        raise BadInput(path, f"holds an inline tensor of dtype {shown(value['dtype'])} and shape {shown(shape)}, not "
                             f"{_INLINE_SAID} and a list of sizes")
    try:
        raw = _unb64(value["$bytes"])
    except (TypeError, ValueError) as e:
        raise BadInput(path, f"holds an inline tensor whose bytes are not base64 ({one_line(e)[:100]})") from None
    if raw.numel() != math.prod(shape) * dtype.itemsize or (dtype == torch.bool and bool(raw.gt(1).any())):
        raise BadInput(path, f"holds an inline {value['dtype']} tensor of shape {shape} in {raw.numel()} bytes that "
                             "are not its values")
    try:
        return raw.view(dtype).reshape(shape).clone()
    except (RuntimeError, TypeError) as e:  # a size beyond int64 beside a 0
        raise BadInput(path, f"holds an inline tensor of shape {shown(shape)}: {one_line(e)[:100]}") from None


def state_to_json(state: Any, tensors: dict[str, torch.Tensor] | None, path: str,
                  _inlined: dict[int, int] | None = None) -> Any:
    """A state as plain JSON, without pickle: the one writer of meta.json's tags. A tensor is moved to ``tensors`` and
    referenced as ``{"$tensor": key}``, or with ``tensors`` None (hyperparameters, state scalars: a tensor lr, a
    user's mask, LBFGS's history) written inline as ``{"$bytes": base64, "dtype": "float32", "shape": []}``: the
    reader rebuilds the very tensor, as no number does (Adam steps with a float32 lr of 0.01 otherwise than with
    the float it holds, and a float of shape ``[]`` is not a tensor of shape ``[1]``). A tensor met again (one lr
    tensor, the optimizer's default, held by every group: a scheduler's ``fill_`` of one group's sets all) is
    ``{"$same": n}``, the n-th inline tensor back, which stays true when another stage's groups come before. inf and
    nan, which JSON lacks, become ``{"$float": "inf"}`` (LBFGS keeps its last loss as a float: nan once it was)."""
    inlined = {} if _inlined is None else _inlined  # id of each tensor written inline -> its place among them
    if isinstance(state, torch.Tensor):
        if tensors is None:
            if id(state) in inlined:
                return {"$same": len(inlined) - inlined[id(state)]}
            inlined[id(state)] = len(inlined)
            return _inline(state, path)
        tensors[path] = state
        return {"$tensor": path}
    if isinstance(state, float) and not math.isfinite(state):
        return {"$float": encode_float(state)}
    if isinstance(state, dict):
        if not all(isinstance(k, str) for k in state):
            raise TypeError(f"{path}: state_dict keys must be strings to be recorded")
        return {k: state_to_json(v, tensors, f"{path}.{k}", inlined) for k, v in state.items()}
    if isinstance(state, (list, tuple)):
        return [state_to_json(v, tensors, f"{path}.{i}", inlined) for i, v in enumerate(state)]
    return state


def state_from_json(value: Any, tensors: Callable[[], TensorFile] | None, path: Path,
                    _inlined: list[torch.Tensor] | None = None) -> Any:
    """The inverse of ``state_to_json``: the one reader of meta.json's tags. ``tensors`` opens the
    extras file, only when a tensor is referenced (None where the recorder writes plain numbers); a tag that does not
    decode is an error naming ``path``."""
    inlined = [] if _inlined is None else _inlined  # the inline tensors read so far, in order
    if isinstance(value, dict):
        if value.keys() == {"$tensor"}:
            if tensors is None:
                raise BadInput(path, "refers to a tensor where the recorder writes plain numbers")
            if not isinstance(value["$tensor"], str):
                raise BadInput(path, "holds a tensor reference that is not a name")
            return tensors().get(value["$tensor"])
        if value.keys() == {"$float"}:
            try:
                return decode_float(value["$float"])
            except ValueError as e:
                raise BadInput(path, f"holds {one_line(e)}") from None
        if value.keys() == {"$bytes", "dtype", "shape"}:
            inlined.append(_from_inline(value, path))
            return inlined[-1]
        if value.keys() == {"$same"}:
            back = value["$same"]
            if not (is_count(back) and 0 < back <= len(inlined)):
                raise BadInput(path, f"holds {{\"$same\": {shown(back)}}}, but {len(inlined)} inline tensors come before it")
            return inlined[-back]
        return {k: state_from_json(v, tensors, path, inlined) for k, v in value.items()}
    if isinstance(value, list):
        return [state_from_json(v, tensors, path, inlined) for v in value]
    return value


# (build folder, model state dict, optimizer state tensors keyed "<name>/<key>", file metadata)
TensorWriter = Callable[[Path, dict[str, torch.Tensor], dict[str, torch.Tensor], dict[str, str]], None]


def optimizer_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer
                    ) -> tuple[list[str], dict[str, torch.Tensor], dict[str, dict[str, Any]], dict[str, Any]]:
    """Parameter names (optimizer order), the state's tensors keyed ``"<name>/<key>"``, its other values per name,
    and the optimizer's state dict. A sparse state tensor is refused in one line before anything is written: the
    files hold strided tensors, and a densified one would not replay the update bit for bit."""
    names = param_names(model, optimizer)
    sd = optimizer.state_dict()
    tensors: dict[str, torch.Tensor] = {}
    scalars: dict[str, dict[str, Any]] = {}
    for index, state in sd["state"].items():
        for key, value in state.items():
            if isinstance(value, torch.Tensor) and value.layout != torch.strided:
                raise ValueError(f"optimizer state {names[index]}/{key} is a sparse tensor (SGD's momentum on a sparse "
                                 "gradient keeps one): a checkpoint holds dense optimizer state only; train the sparse "
                                 "parameters with momentum=0, Adagrad or SparseAdam")
            if isinstance(value, torch.Tensor):
                tensors[f"{names[index]}/{key}"] = value
            else:
                scalars.setdefault(names[index], {})[key] = state_to_json(value, None, f"optimizer state {names[index]}/{key}")
    return names, tensors, scalars, sd


def _write_safetensors(build: Path, model_sd: dict[str, torch.Tensor], tensors: dict[str, torch.Tensor],
                       file_meta: dict[str, str]) -> None:
    write_bytes_atomic(build / "model.safetensors", safetensors_parts(model_sd, file_meta))
    write_bytes_atomic(build / "optimizer.safetensors", safetensors_parts(tensors, file_meta))


def state_meta(model: torch.nn.Module, optimizer: torch.optim.Optimizer
               ) -> tuple[dict[str, Any], dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """meta.json's names of the state (``param_names``, ``param_groups``, ``state_scalars``, ``buffer_names``), the
    model's state dict and the optimizer's state tensors keyed ``"<name>/<key>"``."""
    names, tensors, scalars, sd = optimizer_state(model, optimizer)
    hyper = state_to_json([{k: v for k, v in g.items() if k != "params"} for g in sd["param_groups"]], None,
                          "optimizer param_groups")  # at once: a tensor several groups hold is written once
    groups = [{**h, "params": [names[p] for p in g["params"]]} for h, g in zip(hyper, sd["param_groups"])]
    # the gate meta.json's reader passes them through, here, while the training loop can still be told: never a
    # checkpoint replay refuses (a nested list, a complex tensor, a string for a rate)
    problem = hyperparameter_problem(state_from_json(groups, None, Path("meta.json")), "param_groups")
    if problem is not None:
        raise ValueError(f"optimizer {problem}: the checkpoint could not hold it as replay reads it back")
    model_sd = model.state_dict()
    buffers = {n for n, _ in model.named_buffers(remove_duplicate=False)}
    return ({"param_names": names, "param_groups": groups, "state_scalars": scalars,
             "buffer_names": [k for k in model_sd if k in buffers]},  # scan tells buffers from parameters by it
            model_sd, tensors)


def loose_grads(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """The gradients of the parameters no optimizer holds, by name, each whole: they carry over into the next step, so
    a replay from this checkpoint must start from them. A sharded one (FSDP2's) is gathered, a collective: in a
    multi-rank run every rank calls this, in the same order (``distributed.checkpoint.gathered_loose_grads``)."""
    return {name: whole(p.grad).detach() for name, p in loose_params(model, optimizer)
            if p.grad is not None and p.grad.layout == torch.strided}


@dataclass
class CheckpointState:
    """What a checkpoint's files hold, taken from the live model and optimizer (``checkpoint_state``): meta.json's
    bytes, already encoded (a value JSON cannot hold is refused while the loop can still be told), and the tensors of
    each file. ``write_checkpoint`` writes it, now or on the recorder's writer thread from private copies."""

    step: int
    meta: bytes
    model: dict[str, torch.Tensor]
    optimizer: dict[str, torch.Tensor]
    extras: dict[str, torch.Tensor]  # the scaler's and scheduler's tensors and the loose gradients (EXTRAS_FILE)


def checkpoint_state(step: int, model: torch.nn.Module, optimizer: torch.optim.Optimizer, *, scaler: Any = None,
                     scheduler: Any = None, rank_rng: list[dict[str, Any]] | None = None,
                     merge_meta: Callable[[dict[str, Any]], None] | None = None,
                     grads: dict[str, torch.Tensor] | None = None) -> CheckpointState:
    """The state before step ``step`` as ``save_checkpoint`` writes it. Its tensors are the live ones (the model's
    parameters, the optimizer's state): the next step changes them in place."""
    names, model_sd, tensors = state_meta(model, optimizer)
    meta = {"format": CHECKPOINT_FORMAT, "step": step, **{k: names[k] for k in ("param_names", "param_groups",
            "state_scalars")}, "rng": rng_state(), "buffer_names": names["buffer_names"]}  # the shipped files' order
    if (owners := group_owners(optimizer)) is not None:
        meta["group_optimizers"] = owners
    if merge_meta is not None:
        merge_meta(meta)
    if rank_rng is not None:
        meta["rank_rng"] = rank_rng
    extras: dict[str, torch.Tensor] = {}
    for key, holder in (("scaler", scaler), ("scheduler", scheduler)):
        if holder is not None:
            meta[key] = state_to_json(holder.state_dict(), extras, key)
    if grads is None:
        grads = loose_grads(model, optimizer)
    if grads:
        meta[LOOSE_GRADS] = list(grads)
        extras.update({f"{LOOSE_GRADS}/{name}": grad for name, grad in grads.items()})
    return CheckpointState(step, json_bytes(meta, indent=None), model_sd, tensors, extras)


def write_checkpoint(folder: Path, state: CheckpointState, write_tensors: TensorWriter | None = None) -> Path:
    """Write ``folder/step_XXXXXXXX`` atomically: a killed writer leaves the older checkpoints intact."""
    file_meta = {"format": CHECKPOINT_FORMAT, "step": str(state.step)}
    folder.mkdir(parents=True, exist_ok=True)
    final = folder / checkpoint_name(state.step)
    build = make_build_dir(final)
    try:
        (write_tensors or _write_safetensors)(build, state.model, state.optimizer, file_meta)
        if state.extras:
            write_bytes_atomic(build / EXTRAS_FILE, safetensors_parts(state.extras, file_meta))
        write_bytes_atomic(build / "meta.json", state.meta)
        publish_dir_atomic(build, final)
    except OSError as e:  # no hidden half-built folder left behind; the error names the file as it would be
        shutil.rmtree(build, ignore_errors=True)
        named = final / Path(e.filename).name if e.filename and Path(e.filename).parent == build else e.filename
        raise OSError(e.errno, e.strerror or str(e), str(named) if named else None) from e
    except BaseException:
        shutil.rmtree(build, ignore_errors=True)
        raise
    return final


def save_checkpoint(folder: Path, step: int, model: torch.nn.Module, optimizer: torch.optim.Optimizer, *,
                    scaler: Any = None, scheduler: Any = None, rank_rng: list[dict[str, Any]] | None = None,
                    write_tensors: TensorWriter | None = None,
                    merge_meta: Callable[[dict[str, Any]], None] | None = None,
                    grads: dict[str, torch.Tensor] | None = None) -> Path:
    """Take the state (``checkpoint_state``) and write it (``write_checkpoint``), here and now.

    A GradScaler's and an LR scheduler's state, when given, go to meta.json under ``scaler`` and ``scheduler``; the
    gradients of the parameters no optimizer holds (``loose_grads``) to ``EXTRAS_FILE``.
    A distributed run adds every rank's RNG state (``rank_rng``) and may write the tensors its own way
    (``write_tensors``: FSDP2's shards through torch.distributed.checkpoint); ``merge_meta`` adds the other ranks'
    names to meta.json (pipeline stages, each holding other parameters); ``grads`` are every rank's loose gradients,
    gathered by the ranks together before.
    """
    state = checkpoint_state(step, model, optimizer, scaler=scaler, scheduler=scheduler, rank_rng=rank_rng,
                             merge_meta=merge_meta, grads=grads)
    return write_checkpoint(folder, state, write_tensors)


_PARTS = {"model": 2, "optim": 4}  # path length of a model tensor ("model", fqn) and a state tensor ("optim", ...)


def _read_sharded(metadata: Path, part: str) -> Iterator[tuple[str, torch.Tensor]]:
    """The model's state dict (``part`` "model") or the optimizer's state tensors keyed ``"<name>/<key>"``
    ("optim"), each tensor whole, one at a time."""
    from ..formats.dcp import Layout, assemble  # formats reads runs: imported when used

    layout = Layout(metadata)
    for t in layout.tensors:
        path = tuple(map(str, t.path))
        if not ((len(path) == 2 and path[0] == "model") or (len(path) == 4 and path[:2] == ("optim", "state"))):
            raise BadInput(metadata, f"entry {t.fqn!r} is neither model nor optimizer state of a nanforensics checkpoint")
        if path[0] == part and len(path) == _PARTS[part]:
            yield (path[1] if part == "model" else f"{path[2]}/{path[3]}"), assemble(t)


@dataclass
class Checkpoint:
    """A checkpoint on disk; tensors are read only when asked for."""

    path: Path
    step: int

    @property
    def layout_file(self) -> Path:
        """torch.distributed.checkpoint's ``.metadata``, present when the tensors were written that way."""
        from ..formats.dcp import METADATA  # formats reads runs: imported when used

        return self.path / METADATA

    @property
    def sharded(self) -> bool:
        """Tensors written through torch.distributed.checkpoint, a shard per rank (an FSDP2 run), not safetensors."""
        return self.layout_file.is_file()

    @property
    def model_file(self) -> Path:
        """The file that holds (or, for a sharded checkpoint, lays out) the model's tensors."""
        return self.layout_file if self.sharded else self.path / "model.safetensors"

    @property
    def optimizer_file(self) -> Path:
        return self.layout_file if self.sharded else self.path / "optimizer.safetensors"

    def model_tensors(self) -> dict[str, torch.Tensor]:
        """The model's state dict, each tensor whole."""
        if self.sharded:
            return dict(_read_sharded(self.layout_file, "model"))
        return TensorFile(self.model_file).load_all()

    def optimizer_tensors(self) -> Iterable[tuple[str, torch.Tensor]]:
        """The optimizer's state tensors keyed ``"<name>/<key>"``, each whole, one at a time."""
        if self.sharded:
            return _read_sharded(self.layout_file, "optim")
        return TensorFile(self.optimizer_file).items()

    def meta(self) -> dict[str, Any]:
        """meta.json, checked against ``CheckpointMeta`` and returned as read, its hyperparameters and state scalars
        decoded (``state_from_json``: non-finite floats, inline tensors) and the hyperparameters through the gate."""
        path = self.path / "meta.json"
        meta = load_json(path)
        if not isinstance(meta, dict) or meta.get("format") != CHECKPOINT_FORMAT:
            raise BadInput(path, f"not a {CHECKPOINT_FORMAT} checkpoint")
        load(CheckpointMeta, meta, path)
        for key in ("param_groups", "state_scalars"):
            meta[key] = state_from_json(meta[key], None, path)
        problem = hyperparameter_problem(meta["param_groups"], "param_groups")
        if problem is not None:
            raise BadInput(path, problem)
        return meta

    def optimizer_state(self, meta: dict[str, Any], params: list[torch.Tensor] | None = None) -> dict[str, Any]:
        """The optimizer's state dict in torch's layout (its indices in the order of ``meta["param_names"]``).

        ``params``: the optimizer's parameters, each state tensor then laid out like its own (a model sharded for a
        replay at world size takes its own shard)."""
        names = meta["param_names"]
        index = {n: i for i, n in enumerate(names)}
        state: dict[int, dict[str, Any]] = {}
        for key, tensor in self.optimizer_tensors():
            name, _, skey = key.rpartition("/")
            if name not in index:
                raise BadInput(self.optimizer_file, f"state {key!r} names no parameter of the optimizer")
            if params is not None and index[name] < len(params):
                tensor = shard_like(tensor, params[index[name]])
            state.setdefault(index[name], {})[skey] = tensor
        for name, values in meta["state_scalars"].items():
            state.setdefault(index[name], {}).update(values)
        groups = [{**g, "params": [index[n] for n in g["params"]]} for g in meta["param_groups"]]
        return {"state": state, "param_groups": groups}

    def check_owners(self, meta: dict[str, Any], owners: list[str] | None) -> None:
        """That the optimizers the groups were recorded in (``group_optimizers``, absent for one) are those
        ``owners`` names, group by group: else a state would load into another optimizer's parameters."""
        if meta.get("group_optimizers") != owners:
            raise BadInput(self.path / "meta.json", f"its parameter groups belong to optimizers "
                                                    f"{meta.get('group_optimizers') or 'one'}, the run's are "
                                                    f"{owners or 'one'}")

    def loose_grads(self, meta: dict[str, Any]) -> dict[str, torch.Tensor]:
        """The gradients ``save_checkpoint`` kept of the parameters no optimizer holds, by name: state the next step
        starts from, so a checkpoint holding a non-finite one is not a clean start."""
        if not (names := meta.get(LOOSE_GRADS)):
            return {}
        extras = TensorFile(self.path / EXTRAS_FILE)
        return {name: extras.get(f"{LOOSE_GRADS}/{name}") for name in names}

    def put_back_loose_grads(self, meta: dict[str, Any], model: torch.nn.Module, optimizer: Any,
                             stage: bool = False) -> None:
        """``loose_grads``, each onto its parameter; for a pipeline's ``stage``, those of its own parameters (the
        other stages hold the rest)."""
        loose = dict(loose_params(model, optimizer))
        own = {n for n, _ in model.named_parameters(remove_duplicate=False)}
        for name, grad in self.loose_grads(meta).items():
            if stage and name not in own:
                continue
            if name not in loose:
                raise BadInput(self.path / "meta.json", f"holds the gradient of {name!r}, which is not a parameter "
                                                        f"the model requires grad for and no optimizer holds")
            if grad.shape != loose[name].shape or grad.dtype != loose[name].dtype:
                raise BadInput(self.path / EXTRAS_FILE, f"the gradient of {name!r} is {grad.dtype} "
                                                        f"{list(grad.shape)}, the parameter "
                                                        f"{loose[name].dtype} {list(loose[name].shape)}")
            # a parameter sharded for a replay at world size takes its own shard of the whole gradient
            loose[name].grad = shard_like(grad.to(loose[name].device), loose[name]).clone()

    def load_into(self, model: torch.nn.Module, optimizer: Any, *, scaler: Any = None,
                  scheduler: Any = None) -> dict[str, Any]:
        """Restore model and optimizer state (and the scaler's and scheduler's, when the run recorded them);
        returns the meta (for the RNG states). Several optimizers may be given as the Recorder took them (a list or a
        dict), to resume a run of several."""
        optimizer = optimizer_set(optimizer)
        meta = self.meta()
        model_sd = self.model_tensors()
        # load_state_dict casts silently: a float16 file would replay a run that never was
        expected = model.state_dict()
        for name, tensor in model_sd.items():
            if name in expected and tensor.dtype != expected[name].dtype:
                raise BadInput(self.model_file, f"tensor {name!r} is {tensor.dtype}, the model built by the "
                                                f"manifest's factory holds {expected[name].dtype}")
            if name in expected:  # a model sharded for a replay at world size takes its own shard of each tensor
                model_sd[name] = shard_like(tensor, expected[name])
        try:
            model.load_state_dict(model_sd)
        except RuntimeError as e:
            raise BadInput(self.model_file, f"does not fit the model built by the manifest's factory: "
                                            f"{' '.join(str(e).split())[:300]}") from None
        self.check_owners(meta, group_owners(optimizer))
        try:
            optimizer.load_state_dict(self.optimizer_state(meta, optimizer_params(optimizer)))
        except (ValueError, KeyError, RuntimeError) as e:
            raise BadInput(self.optimizer_file, f"does not fit the optimizer: {e}") from None
        self.put_back_loose_grads(meta, model, optimizer)
        for key, holder in (("scaler", scaler), ("scheduler", scheduler)):
            if holder is None:
                continue
            if key not in meta:
                raise BadInput(self.path / "meta.json", f"holds no {key} state, but the run recorded a {key}")
            try:
                holder.load_state_dict(state_from_json(meta[key], lambda: TensorFile(self.path / EXTRAS_FILE),
                                                      self.path / "meta.json"))
            except (ValueError, KeyError, RuntimeError, TypeError) as e:
                raise BadInput(self.path / "meta.json", f"{key} state does not fit: {e}") from None
        return meta
