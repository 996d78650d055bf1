"""A trainer's own checkpoint read as training state, and loaded into the model and optimizer the user's code builds.

What loads (a layout ``open_checkpoint`` reads that holds both model and optimizer state):

- a ``torch.save`` dict (weights-only): the model's state dict under ``model``, ``model_state_dict``,
  ``state_dict``, ...; the optimizer's under ``optimizer``, ``optimizer_state_dict``, ``optimizer_states``, ...;
  a scheduler's and the RNG's where it holds them;
- a Lightning ``.ckpt`` (``ModelCheckpoint``): its ``state_dict`` and ``optimizer_states`` (a list of one), as
  scan reads them (``formats.source.lightning_parts``), its ``lr_schedulers``; the callbacks' bookkeeping is not
  state;
- a Hugging Face Trainer folder (``checkpoint-N``): ``model.safetensors`` or its shards, ``optimizer.pt``,
  ``scheduler.pt``, ``rng_state.pth``, the step from ``trainer_state.json``;
- an accelerate ``save_state`` folder: ``model.safetensors`` (or ``pytorch_model.bin``), ``optimizer.bin``,
  ``scheduler.bin``, ``random_states_0.pkl`` (weights-only, which refuses its numpy state);
- a checkpoint folder of a nanforensics run.

What does not: a lone ``.safetensors`` file (tensors only: no optimizer parameter groups), a
``torch.distributed.checkpoint`` folder (``dcp_to_torch_save`` makes it a ``torch.save`` file), and any file
without optimizer state (replaying Adam from zeroed moments would replay a run that never was).

The model is loaded by name. The optimizer is loaded by name where the file records names (optimizers built
from ``named_parameters()`` on torch >= 2.5, checkpoints of this tool, FQN-keyed distributed state dicts), else
by order, as torch's own ``load_state_dict`` and the Trainer's resume do: accepted only when every group's size
and every state tensor's shape agree with the parameter at its position. Equal shapes cannot tell apart two
parameters listed in another order, so the report says how many parameters share a shape.
"""

from __future__ import annotations

import random
import sys
from collections import Counter
from dataclasses import dataclass
from itertools import chain
from pathlib import Path
from typing import Any, Iterable

import torch

from ..errors import BadInput
from ..inputs import TensorFile, optimizer_problem
from ..numbers import real, spoken, unrepresentable
from ..runs.checkpoint import Checkpoint, b64, restore_rng, rng_state, state_from_json
from . import torch_file, zero
from .entries import MODEL, OPTIMIZER, OPTIMIZER_KEYS
from .source import CheckpointSource, lightning_parts

MODEL_KEYS = ("model", "model_state_dict", "state_dict", "model_state", "module", "net", "network")
SCHEDULER_KEYS = ("scheduler", "lr_scheduler", "scheduler_state_dict", "lr_scheduler_state_dict", "lr_schedulers",
                  "schedulers")
RNG_KEYS = ("rng_state", "rng_states", "rng", "torch_rng_state", "cpu_rng_state")
# Written beside the weights by the Trainer (one per process when there are several) and by accelerate.
SCHEDULER_FILES = ("scheduler.pt", "scheduler.bin")
RNG_FILES = ("rng_state.pth", "rng_state_0.pth", "random_states_0.pkl")
WRAPPER_PREFIXES = ("module.", "_orig_mod.")  # DistributedDataParallel's and torch.compile's
SCHEDULER_GROUP_KEYS = {"initial_lr"}  # what an LR scheduler adds to the groups
# Hyperparameters a newer torch added to an optimizer class, each with the value that keeps the older behaviour: a
# checkpoint the newer torch saved holds them; at that value they mean nothing to the older class and are left out,
# at another it asks for what the older class cannot do. (Adam's decoupled_weight_decay came with torch 2.6.)
NEWER_TORCH_KEYS: dict[str, Any] = {"decoupled_weight_decay": False}
NAME, ORDER = "name", "order"
RNG_SEED = 0  # what replays start from when the checkpoint holds no RNG state


@dataclass
class TrainingState:
    """Model and optimizer state dicts (torch's layouts), and what else the checkpoint holds."""

    layout: str  # "torch.save dict", "nanforensics checkpoint", or the files of a folder
    model: dict[str, torch.Tensor]
    model_file: Path
    optimizer: dict[str, Any]
    optimizer_file: Path
    scheduler: Any | None
    scheduler_file: Path | None
    rng: dict[str, Any]  # the generators found, in ``runs.checkpoint.rng_state()``'s layout
    rng_missing: str | None  # why none was, or why the RNG file was not read


def read_state(source: CheckpointSource) -> TrainingState:
    """The training state of one checkpoint, or a one-line refusal saying what it lacks."""
    if source.format == "nanforensics":
        return _ours(source)
    if source.format == "dcp":
        raise BadInput(source.path, "a torch.distributed.checkpoint folder cannot be loaded into a model built here; "
                                    "convert it with torch.distributed.checkpoint.format_utils.dcp_to_torch_save "
                                    "and replay the .pt file")
    if source.format == zero.FORMAT:
        raise BadInput(source.path, "a DeepSpeed ZeRO checkpoint's flat partitions cannot be loaded into torch's "
                                    "optimizer built here (scan and bisect read it); zero_to_fp32.py beside it converts "
                                    "the weights, without the optimizer state a replay needs")
    if source.path.is_dir():
        return _folder(source)
    return _file(source.path)


def _ours(source: CheckpointSource) -> TrainingState:
    ck = Checkpoint(source.path, source.meta_step if source.meta_step is not None else -1)
    meta = ck.meta()
    optimizer = ck.optimizer_state(meta)
    for group, named in zip(optimizer["param_groups"], meta["param_groups"]):
        group["param_names"] = list(named["params"])
    scheduler = state_from_json(meta["scheduler"], lambda: TensorFile(ck.path / "extras.safetensors"), ck.path / "meta.json") \
        if "scheduler" in meta else None
    return TrainingState("nanforensics checkpoint", TensorFile(ck.model_file).load_all(), ck.model_file, optimizer,
                         ck.optimizer_file, scheduler, ck.path / "meta.json" if scheduler is not None else None,
                         meta["rng"], None)


def _folder(source: CheckpointSource) -> TrainingState:
    """The Trainer's layout: weights, ``optimizer.pt`` beside them, scheduler and RNG files if present."""
    model: dict[str, torch.Tensor] = {}
    for file, group in source.files:
        if group == MODEL:
            model.update(_tensors(file))
    optimizer_file = next((f for f, group in source.files if group == OPTIMIZER), None)
    if optimizer_file is None:
        raise BadInput(source.path, "holds no optimizer state (no optimizer.pt, nor accelerate's optimizer.bin, beside "
                                    "the weights): replaying from fresh optimizer state would replay a run that never "
                                    "was")
    optimizer = _optimizer_of(torch_file.load(optimizer_file)[0], optimizer_file)
    scheduler_file = next((source.path / n for n in SCHEDULER_FILES if (source.path / n).is_file()), None)
    scheduler = _scheduler_of(torch_file.load(scheduler_file)[0], scheduler_file) if scheduler_file else None
    rng_file = next((source.path / n for n in RNG_FILES if (source.path / n).is_file()), None)
    rng, missing = _rng_parts(None)
    if rng_file is not None:
        try:
            rng, missing = _rng_parts(torch_file.load(rng_file)[0])
        except torch_file.Refused as e:
            missing = f"{rng_file.name} was not loaded: {e.reason}, which weights-only loading does not run"
    read = [f for f, _ in source.files] + [f for f in (scheduler_file, rng_file) if f is not None]
    read += [source.path / "trainer_state.json"] if (source.path / "trainer_state.json").is_file() else []
    return TrainingState(f"folder of {', '.join(f.name for f in read)}", model, source.files[0][0], optimizer,
                         optimizer_file, scheduler, scheduler_file, rng, missing)


def _tensors(file: Path) -> dict[str, torch.Tensor]:
    if file.suffix == ".safetensors":
        return TensorFile(file).load_all()
    obj = torch_file.load(file)[0]
    if not _tensor_dict(obj):
        raise BadInput(file, "is not a state dict of tensors")
    return obj


def _file(path: Path) -> TrainingState:
    if path.suffix == ".safetensors":
        raise BadInput(path, "a .safetensors file holds tensors only, without the optimizer's parameter groups, so "
                             "its optimizer state cannot be loaded; replay the checkpoint the trainer resumes from")
    obj = torch_file.load(path)[0]
    if not isinstance(obj, dict):
        raise BadInput(path, f"holds a {type(obj).__name__}, not a dict of state dicts")
    scheduler = next((obj[k] for k in SCHEDULER_KEYS if obj.get(k) is not None), None)
    rng, missing = _rng_parts(next((obj[k] for k in RNG_KEYS if obj.get(k) is not None), None))
    lightning = lightning_parts(obj)  # the LightningModule's state_dict and optimizer_states, as scan reads them
    if lightning is not None:
        layout, model, optimizer = "Lightning checkpoint", lightning[0], _optimizer_of(
            {"optimizer_states": lightning[1]}, path)
        if not _tensor_dict(model):
            raise BadInput(path, "its state_dict is not a dict of tensors")
    else:
        layout, model, optimizer = "torch.save dict", _model_of(obj, path), _optimizer_of(obj, path)
    return TrainingState(layout, model, path, optimizer, path,
                         _scheduler_of(scheduler, path) if scheduler is not None else None,
                         path if scheduler is not None else None, rng, missing)


def _tensor_dict(value: Any) -> bool:
    return isinstance(value, dict) and bool(value) and all(isinstance(v, torch.Tensor) for v in value.values())


def _keys(obj: dict[Any, Any]) -> str:
    keys = list(map(str, obj))
    return ", ".join(keys[:8]) + (f" (+{len(keys) - 8} more)" if len(keys) > 8 else "")


def _model_of(obj: dict[Any, Any], path: Path) -> dict[str, torch.Tensor]:
    found = next((obj[k] for k in MODEL_KEYS if _tensor_dict(obj.get(k))), None)
    if found is not None:
        return found
    if _tensor_dict(obj):
        raise BadInput(path, "holds a model's state dict alone, without optimizer state: replaying from fresh "
                             "optimizer state would replay a run that never was")
    raise BadInput(path, f"holds no model state dict (looked under {', '.join(MODEL_KEYS)}; its keys are {_keys(obj)})")


def _optimizer_shaped(value: Any) -> bool:
    return isinstance(value, dict) and isinstance(value.get("state"), dict) and isinstance(value.get("param_groups"),
                                                                                          list)


def _optimizer_of(obj: Any, path: Path) -> dict[str, Any]:
    if _optimizer_shaped(obj):
        return obj
    found: list[tuple[str, dict[str, Any]]] = []
    for key, value in (obj.items() if isinstance(obj, dict) else ()):
        if str(key).lower() not in OPTIMIZER_KEYS:
            continue
        if _optimizer_shaped(value):
            found.append((str(key), value))
        elif isinstance(value, (list, tuple)) and value and all(_optimizer_shaped(v) for v in value):
            found += [(f"{key}[{i}]", v) for i, v in enumerate(value)]
    if not found:
        raise BadInput(path, "holds no optimizer state dict (no 'state' and 'param_groups' under "
                             f"{', '.join(sorted(OPTIMIZER_KEYS))}): replaying from fresh optimizer state would "
                             "replay a run that never was")
    if len(found) > 1:
        raise BadInput(path, f"holds the state of {len(found)} optimizers ({', '.join(k for k, _ in found)}); "
                             "replay drives one")
    return found[0][1]


def _scheduler_of(value: Any, path: Path) -> dict[str, Any]:
    if isinstance(value, (list, tuple)) and len(value) == 1:
        value = value[0]
    if not isinstance(value, dict):
        raise BadInput(path, "its LR scheduler state is not a single scheduler's state_dict")
    return value


def _rng_parts(value: Any) -> tuple[dict[str, Any], str | None]:
    """The generator states a checkpoint holds (a CPU generator's uint8 tensor, or the Trainer's dict of
    ``python``, ``numpy``, ``cpu`` and ``cuda``), in ``rng_state()``'s layout; and why there are none."""
    if value is None:
        return {}, "the checkpoint holds no RNG state"
    found = _generators(value)
    return found, None if found else f"its RNG state (a {type(value).__name__}) holds no generator state known here"


def _generators(value: Any) -> dict[str, Any]:
    if isinstance(value, torch.Tensor):
        return {"torch": b64(value)} if value.dtype == torch.uint8 else {}
    if not isinstance(value, dict):
        return {}
    out: dict[str, Any] = {}
    cpu = next((value[k] for k in ("torch", "cpu", "cpu_rng_state", "torch_rng_state")
                if isinstance(value.get(k), torch.Tensor)), None)
    if cpu is not None:
        out["torch"] = b64(cpu)
    cuda = value.get("cuda")
    cuda = [cuda] if isinstance(cuda, torch.Tensor) else cuda
    if isinstance(cuda, (list, tuple)) and cuda and all(isinstance(c, torch.Tensor) for c in cuda):
        out["cuda"] = [b64(c) for c in cuda]
    python = value.get("python")
    if isinstance(python, (list, tuple)) and len(python) == 3:
        out["python"] = [python[0], list(python[1]), python[2]]
    numpy_state = value.get("numpy")
    if isinstance(numpy_state, (list, tuple)) and len(numpy_state) == 5 and hasattr(numpy_state[1], "tolist"):
        kind, keys, pos, has_gauss, cached = numpy_state
        out["numpy"] = [kind, keys.tolist(), pos, has_gauss, cached]
    return out


def full_rng(parts: dict[str, Any]) -> dict[str, Any]:
    """Every generator's state: the checkpoint's where it has one, else seeded with ``RNG_SEED``, so that each
    re-run of the replay (rewinds, what-ifs) draws the same numbers."""
    saved = rng_state()
    torch.manual_seed(RNG_SEED)
    random.seed(RNG_SEED)
    if "numpy" in sys.modules:
        sys.modules["numpy"].random.seed(RNG_SEED)
    seeded = rng_state()
    restore_rng(saved)
    return {**seeded, **parts}


# ---- into the model and optimizer ------------------------------------------------------------------------


def _aliases(model: torch.nn.Module) -> dict[str, set[str]]:
    """Every name of each parameter and buffer: a tied weight answers to all of its names."""
    groups: dict[int, set[str]] = {}
    for name, t in chain(model.named_parameters(remove_duplicate=False), model.named_buffers(remove_duplicate=False)):
        groups.setdefault(id(t), set()).add(name)
    return {name: names for names in groups.values() for name in names}


def _listed(names: Iterable[str], limit: int = 4) -> str:
    names = list(names)
    return ", ".join(names[:limit]) + (f" (+{len(names) - limit} more)" if len(names) > limit else "")


def _strip_wrappers(sd: dict[str, torch.Tensor], expected: Iterable[str]) -> tuple[dict[str, torch.Tensor], str | None]:
    """Keys saved from a wrapped model (``module.``, ``_orig_mod.``) without the wrapper's prefix."""
    expected = set(expected)
    stripped = ""
    while True:
        prefix = next((p for p in WRAPPER_PREFIXES if sd and all(k.startswith(p) for k in sd)
                       and not any(k.startswith(p) for k in expected)), None)
        if prefix is None:
            return sd, stripped or None
        sd = {k[len(prefix):]: v for k, v in sd.items()}
        stripped += prefix


def load_model(model: torch.nn.Module, sd: dict[str, torch.Tensor], where: Path, factory: str) -> str | None:
    """Load by name, refusing any key, shape or dtype that does not match; returns the wrapper prefix stripped."""
    expected = model.state_dict()
    sd, stripped = _strip_wrappers(sd, expected)
    aliases = _aliases(model)
    missing = [k for k in expected if k not in sd and not (aliases.get(k, {k}) & sd.keys())]
    unexpected = [k for k in sd if k not in expected]
    problems = [f"missing {_listed(missing)}"] if missing else []
    problems += [f"unexpected {_listed(unexpected)}"] if unexpected else []
    shapes = [f"{k} is {list(sd[k].shape)} in the file, {list(expected[k].shape)} in the model"
              for k in sd if k in expected and sd[k].shape != expected[k].shape]
    problems += shapes[:2]
    if problems:
        raise BadInput(where, f"model state does not match the model {factory} builds, by name: {'; '.join(problems)}")
    dtypes = [k for k in sd if sd[k].dtype != expected[k].dtype]
    if dtypes:  # load_state_dict would cast silently and replay a run that never was
        k = dtypes[0]
        raise BadInput(where, f"tensor {k!r} is {sd[k].dtype}, the model {factory} builds holds {expected[k].dtype}: "
                              "build it in the dtype training used")
    model.load_state_dict(sd, strict=False)
    return stripped


def _fits(state: torch.Tensor, param: torch.Tensor) -> bool:
    """A per-element state tensor has the parameter's shape (a factored one, Adafactor's, a 1 along some dims)."""
    return state.dim() == 0 or (state.dim() == param.dim()
                                and all(s in (1, p) for s, p in zip(state.shape, param.shape)))


def _saved_names(groups: list[dict[str, Any]]) -> list[list[str]] | None:
    """Each saved group's parameter names, when the file records them."""
    if all(isinstance(g.get("param_names"), list) and len(g["param_names"]) == len(g["params"]) for g in groups):
        return [list(map(str, g["param_names"])) for g in groups]
    if all(isinstance(p, str) for g in groups for p in g["params"]):  # FQN-keyed (distributed state dicts)
        return [list(g["params"]) for g in groups]
    return None


def _hyperparameters(group: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in group.items() if k not in ("params", "param_names")}


def load_optimizer(model: torch.nn.Module, optimizer: torch.optim.Optimizer, sd: dict[str, Any], where: Path,
                   factory: str) -> tuple[str, int]:
    """Load by name when the file names the parameters, else by order; returns (NAME or ORDER, and for ORDER the
    parameters that share their shape with another of their group)."""
    problem = optimizer_problem(sd)
    if problem is not None:
        raise BadInput(where, problem)
    unsteppable = _unsteppable(sd)
    if unsteppable is not None:
        raise BadInput(where, f"optimizer state holds {unsteppable}: torch cannot step with it (`nanforensics scan` "
                              "reports it as unsound)")
    named = _saved_names(sd["param_groups"])
    state, groups = (_by_name(model, optimizer, sd, named, where, factory) if named is not None
                     else _by_order(optimizer, sd, where, factory))
    # Another optimizer class loads without complaint (torch replaces the hyperparameters wholesale) and then
    # ignores state it does not know: its groups' keys tell it apart (newer torch versions only add keys).
    foreign = sorted({k for g in groups for k in g} - {k for g in optimizer.param_groups for k in g} - SCHEDULER_GROUP_KEYS)
    newer = [k for k in foreign if k in NEWER_TORCH_KEYS]
    neutral = {k for k in newer if all(g.get(k, NEWER_TORCH_KEYS[k]) == NEWER_TORCH_KEYS[k] for g in groups)}
    groups = [{k: v for k, v in g.items() if k not in neutral} for g in groups]
    cls = type(optimizer).__name__
    if set(newer) - neutral:
        asked = ", ".join(f"{k}={next(g[k] for g in groups if k in g)!r}" for k in newer if k not in neutral)
        raise BadInput(where, f"optimizer state holds {asked}, which {cls} of torch {torch.__version__} cannot do: a "
                              "newer torch saved it; replay with the torch the run was trained with")
    foreign = [k for k in foreign if k not in newer]
    if foreign:
        raise BadInput(where, f"optimizer state holds hyperparameters {', '.join(foreign)}, which the {cls} {factory} "
                              f"builds has not: another optimizer class saved it, or a torch newer than this one "
                              f"({torch.__version__})")
    labels = _labels(model)
    params = [p for g in optimizer.param_groups for p in g["params"]]
    bad = [f"{key} of {labels.get(id(params[i]), f'param {i}')} is {list(v.shape)}, the parameter "
           f"{list(params[i].shape)}" for i, st in state.items() for key, v in st.items()
           if isinstance(v, torch.Tensor) and not _fits(v, params[i])]
    if bad:
        how = "by name" if named is not None else "by order (the file records no parameter names)"
        raise BadInput(where, f"optimizer state matched {how} does not fit the parameters {factory} builds: "
                              f"{'; '.join(bad[:2])}")
    try:
        optimizer.load_state_dict({"state": state, "param_groups": groups})
    except (ValueError, KeyError, RuntimeError, TypeError) as e:
        raise BadInput(where, f"optimizer state does not fit the optimizer {factory} builds: {e}") from None
    if named is not None:
        return NAME, 0
    shared = sum(n for g in optimizer.param_groups
                 for n in Counter(tuple(p.shape) for p in g["params"]).values() if n > 1)
    return ORDER, shared


def _unsteppable(sd: dict[str, Any]) -> str | None:
    """The first hyperparameter or state value torch's step raises on, named; None when there is none: an int no
    float holds (``lr = 10**400``, OverflowError) or a negative step count (Adam's bias correction then takes the
    square root of a negative number, a complex one the parameters cannot hold). Its type passed ``optimizer_problem``;
    its value is ``scan``'s finding."""
    for g, group in enumerate(sd["param_groups"]):
        for key, value in _hyperparameters(group).items():
            for item in value if isinstance(value, (list, tuple)) else [value]:
                if unrepresentable(item):
                    return f"{key} = {spoken(item)} in group {g}, an integer too large for a float"
    for pid, state in sd["state"].items():  # dicts of dicts: optimizer_problem passed it first
        for key, value in state.items():
            if unrepresentable(value):
                return f"{key} = {spoken(value)} for parameter {pid}, an integer too large for a float"
            if key == "step" and (count := real(value)) is not None and count < 0:
                return f"step = {count:g} for parameter {pid}, a negative count of updates"
    return None


def _labels(model: torch.nn.Module) -> dict[int, str]:
    return {id(p): n for n, p in reversed(list(model.named_parameters(remove_duplicate=False)))}


def _by_name(model: torch.nn.Module, optimizer: torch.optim.Optimizer, sd: dict[str, Any], named: list[list[str]],
             where: Path, factory: str) -> tuple[dict[int, Any], list[dict[str, Any]]]:
    """The saved state re-indexed to the built optimizer's order; each built group takes its saved group's
    hyperparameters, so the two must group the parameters alike."""
    aliases, labels = _aliases(model), _labels(model)
    saved_at = {n: (j, pid) for j, (g, names) in enumerate(zip(sd["param_groups"], named))
                for pid, n in zip(g["params"], names)}
    state: dict[int, Any] = {}
    homes: list[set[int]] = []  # per built group, the saved groups its parameters come from
    missing: list[str] = []
    used: set[str] = set()
    index = 0
    for g in optimizer.param_groups:
        homes.append(set())
        for p in g["params"]:
            label = labels.get(id(p), f"param {index}")
            hit = next((n for n in sorted(aliases.get(label, {label})) if n in saved_at), None)
            if hit is None:
                missing.append(label)
            else:
                j, pid = saved_at[hit]
                used.add(hit)
                homes[-1].add(j)
                if pid in sd["state"]:
                    state[index] = sd["state"][pid]
            index += 1
    unexpected = [n for n in saved_at if n not in used]
    if missing or unexpected:
        problems = ([f"missing {_listed(missing)}"] if missing else []) + (
            [f"unexpected {_listed(unexpected)}"] if unexpected else [])
        raise BadInput(where, f"optimizer state does not match the parameters of the optimizer {factory} builds, by "
                              f"name: {'; '.join(problems)}")
    if not all(homes):
        raise BadInput(where, f"the optimizer {factory} builds has an empty parameter group")
    if any(len(h) > 1 for h in homes):
        raise BadInput(where, f"{factory} puts in one group parameters the checkpoint keeps in several (each with "
                              "its own hyperparameters): build the groups training built")
    saved_group = [h.pop() for h in homes]
    if len(set(saved_group)) != len(saved_group):
        raise BadInput(where, f"{factory} splits into several groups parameters the checkpoint keeps in one")
    start, out = 0, []
    for g, j in zip(optimizer.param_groups, saved_group):
        out.append({**_hyperparameters(sd["param_groups"][j]), "params": list(range(start, start + len(g["params"])))})
        start += len(g["params"])
    return state, out


def _by_order(optimizer: torch.optim.Optimizer, sd: dict[str, Any], where: Path,
              factory: str) -> tuple[dict[int, Any], list[dict[str, Any]]]:
    saved = [len(g["params"]) for g in sd["param_groups"]]
    built = [len(g["params"]) for g in optimizer.param_groups]
    if saved != built:
        raise BadInput(where, f"optimizer state records no parameter names, so it can only be matched by order, and "
                              f"its groups hold {saved} parameters where the optimizer {factory} builds holds {built}")
    state: dict[int, Any] = {}
    out = []
    index = 0
    for g in sd["param_groups"]:
        ids = []
        for pid in g["params"]:
            if pid in sd["state"]:
                state[index] = sd["state"][pid]
            ids.append(index)
            index += 1
        out.append({**_hyperparameters(g), "params": ids})
    return state, out
