"""DeepSpeed ZeRO checkpoints (stages 1, 2 and 3), read as whole parameters with their Adam state.

A ``global_stepN`` folder as ``engine.save_checkpoint`` writes it (HF Trainer, accelerate and Megatron-DeepSpeed
alike): the model states (``mp_rank_00_model_states.pt``, or one ``zero_pp_rank_R_mp_rank_00_model_states.pt`` per
rank at stage 3) hold each parameter's name and shape (``param_shapes``), the buffers and the frozen parameters; each
rank's ``zero_pp_rank_R_mp_rank_00_optim_states.pt`` holds its flat fp32 partition of every group and the base
optimizer's state (``exp_avg``, ``exp_avg_sq``) laid out like it. Each parameter is put back together from the ranks'
partitions by the rules of DeepSpeed's own ``zero_to_fp32`` (a test compares them coordinate for coordinate):

- stages 1 and 2: a group's partitions, concatenated in rank order, hold its parameters one after the other in
  ``param_shapes`` order, each followed by its ``param_alignment_paddings``; the group ends on padding to a multiple
  of 2 x the world size;
- stage 3: every rank holds ``ceil(numel / world)`` elements of every parameter, at the same offset of its flat
  (sub-)groups taken one after the other; a parameter is its ranks' pieces, concatenated, cut to its size.

So a scan names a non-finite coordinate by its parameter and coordinate, and the soundness screen sees each
parameter's ``exp_avg``/``exp_avg_sq`` with its group's betas. Every file is loaded weights-only; the few DeepSpeed
objects those pickles hold (the loss scaler, the stage enum, the fragment addresses) are allow-listed by name and built
as inert records (``Record``), never imported: any other global is refused, naming the file and the global. Sizes are
checked against each other before any tensor is put together.
"""

from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import torch

from ..errors import BadInput, shown
from ..inputs import read_input
from ..numbers import is_count
from . import torch_file
from .entries import MODEL, OPTIMIZER, Entry, Release, TensorInfo

FORMAT = "deepspeed-zero"
MODEL_STATES = "mp_rank_00_model_states.pt"  # stages 1 and 2
_RANK_FILE = re.compile(r"(?:bf16_)?zero_pp_rank_([0-9]{1,9})_mp_rank_00_(model|optim)_states\.pt")
# tensor or pipeline parallel parts (model parallel ranks past 0, Megatron-DeepSpeed's layer files): not read, so refused
_PARALLEL = re.compile(r"(?:.*_)?mp_rank_(?!00_)[0-9]+_.*\.pt|layer_[0-9]+-model_.*\.pt")
STATE_KEYS = ("exp_avg", "exp_avg_sq", "max_exp_avg_sq")  # the base optimizer's state laid out like the partition


class Record:
    """What this tool builds for an allow-listed DeepSpeed object: its constructor's arguments and its state, inert."""

    args: tuple[Any, ...]
    state: Any

    def __new__(cls, *args: Any) -> Record:
        record = object.__new__(cls)
        record.args, record.state = args, None
        return record

    def __init__(self, *args: Any) -> None:
        """Built from arguments alone (``__new__``): a call runs nothing else."""

    def __setstate__(self, state: Any) -> None:
        self.state = state


# The globals a ZeRO checkpoint's pickles name besides tensors and plain containers, each built as a Record.
ALLOWED = {name: Record for name in (
    "deepspeed.runtime.fp16.loss_scaler.LossScaler", "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler",
    "deepspeed.runtime.zero.config.ZeroStageEnum", "deepspeed.utils.tensor_fragment.fragment_address")}


def is_zero(folder: Path) -> bool:
    """Whether a folder holds a ZeRO checkpoint's model states and optimizer states."""
    names = [p.name for p in folder.iterdir()] if folder.is_dir() else []
    return any(n == MODEL_STATES or _kind(n) == "model" for n in names) and any(_kind(n) == "optim" for n in names)


def tagged(folder: Path) -> Path | None:
    """The ZeRO checkpoint ``latest`` names in a folder holding just that one (an HF Trainer ``checkpoint-N``:
    ``global_stepN`` beside the 16-bit ``model.safetensors``); None elsewhere (DeepSpeed's save directory with
    several: each one is a checkpoint)."""
    if not (folder / "latest").is_file():
        return None
    found = [p for p in folder.iterdir() if p.is_dir() and is_zero(p)]
    tag = read_input(folder / "latest", 4096).decode(errors="replace").strip()
    return found[0] if len(found) == 1 and found[0].name == tag else None


def rank_file(path: Path) -> bool:
    """Whether a file is one of a ZeRO checkpoint's (read with its folder, never alone)."""
    return path.name == MODEL_STATES or _kind(path.name) is not None


def _kind(name: str) -> str | None:
    m = _RANK_FILE.fullmatch(name)
    return m.group(2) if m else None


def model_states_file(folder: Path) -> Path:
    """The model states file that names the parameters: the only one (stages 1, 2) or rank 0's (stage 3; ``is_zero``
    found one). Whatever stands at the name (a folder, a socket, a dangling link) is it, for its reader to refuse."""
    own = folder / MODEL_STATES
    return own if os.path.lexists(own) else _rank_files(folder, "model")[0]


def _rank_files(folder: Path, kind: str) -> list[Path]:
    """A kind's files by rank, refused where a rank is missing between 0 and the highest."""
    found: dict[int, Path] = {}
    for p in folder.iterdir():
        m = _RANK_FILE.fullmatch(p.name)
        if m and m.group(2) == kind:
            found[int(m.group(1))] = p
    for r in range(max(found, default=-1) + 1):
        if r not in found:
            raise BadInput(folder / f"zero_pp_rank_{r}_mp_rank_00_{kind}_states.pt",
                           f"is missing: the folder holds ranks {sorted(found)} of a DeepSpeed ZeRO checkpoint")
    return [found[r] for r in sorted(found)]


def load(path: Path) -> dict[str, Any]:
    """One of the checkpoint's files, weights-only with DeepSpeed's allow-listed objects as Records."""
    obj, _ = torch_file.load(path, ALLOWED)
    if not isinstance(obj, dict):
        raise BadInput(path, f"holds a {type(obj).__name__}, not the dict a DeepSpeed checkpoint file holds")
    return obj


def step_of(slot: Slot, layout: Layout) -> Any:
    """The base optimizer's step of the flat partition holding a parameter (its first piece's)."""
    return layout.steps.get(slot.pieces[0].flat) if slot.pieces else None


@dataclass(frozen=True)
class _Piece:
    """Elements [start, start + length) of one rank's flat tensor ``flat`` (a group, or a stage-3 sub-group)."""

    rank: int
    flat: int
    start: int
    length: int


@dataclass
class Slot:
    """A trainable parameter: where its elements lie in the ranks' flat partitions."""

    name: str
    shape: tuple[int, ...]
    group: int  # the base optimizer's param group
    pieces: list[_Piece]


@dataclass
class Frozen:
    """A frozen parameter: its shape and its fragments (one per rank at stage 3), in the model states."""

    shape: tuple[int, ...]
    parts: list[torch.Tensor]
    file: Path


@dataclass
class Layout:
    """A ZeRO checkpoint folder: its files read, and each parameter's place in the flat partitions."""

    stage: int
    files: list[Path]  # the optimizer states, by rank
    optims: list[dict[str, Any]]  # each rank's optimizer_state_dict
    base: list[dict[str, Any]]  # each rank's base optimizer state dict (torch's, over the flat partitions)
    flats: list[list[torch.Tensor]]  # each rank's fp32 partitions
    releases: list[Release]
    model: dict[str, Any]  # rank 0's model states
    slots: list[Slot]
    hyper: list[dict[str, Any]]  # the base optimizer's param groups, ``params`` left out
    steps: dict[int, Any]  # flat index: the base optimizer's step
    frozen: dict[str, Frozen]

    @property
    def buffer_names(self) -> list[str]:
        return [str(n) for n in self.model.get("buffer_names") or []]

    @property
    def scaler(self) -> dict[str, Any] | None:
        """The loss scaler's scale, as torch's GradScaler names it (the soundness screen checks it)."""
        scaler = self.optims[0].get("loss_scaler")
        state = scaler.state if isinstance(scaler, Record) else None
        return {"scale": state.get("cur_scale")} if isinstance(state, dict) else None


def read(folder: Path) -> Layout:
    """The folder's files, checked against each other: the ranks, the partitions' sizes against the shapes."""
    parallel = sorted(p for p in folder.iterdir() if _PARALLEL.fullmatch(p.name))
    if parallel:
        raise BadInput(parallel[0], "is part of a tensor- or pipeline-parallel DeepSpeed checkpoint, which this "
                                    "nanforensics does not read (only model parallel rank 00 is): the checkpoint would "
                                    "be read in part")
    model_file = model_states_file(folder)
    model = load(model_file)
    files = _rank_files(folder, "optim")
    loaded = [torch_file.load(f, ALLOWED) for f in files]
    optims = []
    for f, (obj, _) in zip(files, loaded):
        sd = obj.get("optimizer_state_dict") if isinstance(obj, dict) else None
        if not isinstance(sd, dict):
            raise BadInput(f, "holds no optimizer_state_dict: not a DeepSpeed ZeRO optimizer states file")
        optims.append(sd)
    stage = _stage(optims[0], files[0])
    count = optims[0].get("partition_count")
    counts = set(count) if isinstance(count, list) and all(is_count(c) for c in count) else {count} \
        if is_count(count) else None
    if counts != {len(files)}:
        raise BadInput(files[0], f"partition_count {shown(count)} does not match the {len(files)} optimizer states "
                                 f"files in {folder}")
    key = "fp32_flat_groups" if stage == 3 else "single_partition_of_fp32_groups"
    flats = [_flats(sd.get(key), f, key) for sd, f in zip(optims, files)]
    if len({len(x) for x in flats}) != 1:
        raise BadInput(files[-1], f"holds {len(flats[-1])} {key}, rank 0 {len(flats[0])}")
    shapes = _shapes(model.get("param_shapes"), model_file)
    base = [sd.get("optimizer_state_dict" if stage == 3 else "base_optimizer_state") for sd in optims]
    hyper, group_of = _groups(base[0], len(flats[0]), files[0])
    slots = (_stage3 if stage == 3 else _stage12)(shapes, flats, files, optims, group_of)
    for f, sd, b, fl in zip(files, optims, base, flats):
        if not isinstance(b, dict):
            raise BadInput(f, "holds no base optimizer state dict")
        _check_state(b, fl, [0 if stage == 3 else _padding(sd, k) for k in range(len(fl))], f)
    return Layout(stage, files, optims, base, flats, [r for _, r in loaded], model, slots, hyper,
                  _steps(base[0], len(flats[0])), _frozen(folder, stage, model, model_file, shapes, len(files)))


def _stage(sd: dict[str, Any], where: Path) -> int:
    value = sd.get("zero_stage")
    stage = value.args[0] if isinstance(value, Record) and len(value.args) == 1 else value
    if not isinstance(stage, int) or stage not in (1, 2, 3):
        raise BadInput(where, f"zero_stage {shown(stage)} is not a ZeRO stage (1, 2 or 3)")
    return stage


def _flats(value: Any, where: Path, key: str) -> list[torch.Tensor]:
    if not isinstance(value, list) or not value or not all(isinstance(t, torch.Tensor) and t.dim() == 1
                                                           and t.is_floating_point() for t in value):
        raise BadInput(where, f"{key} is not a list of flat floating-point tensors")
    return value


def _shapes(value: Any, where: Path) -> list[list[tuple[str, tuple[int, ...]]]]:
    """``param_shapes``: per group, each parameter's name and shape, every dimension a non-negative int."""
    if isinstance(value, dict):
        value = [value]
    if not isinstance(value, list) or not all(isinstance(g, dict) for g in value):
        raise BadInput(where, "param_shapes is not a list of name-to-shape mappings per group")
    return [[(str(name), _shape(shape, name, "param_shapes", where)) for name, shape in group.items()] for group in value]


def _shape(value: Any, name: Any, key: str, where: Path) -> tuple[int, ...]:
    """A recorded shape: a sequence of non-negative ints, checked before any size is computed from it."""
    if not isinstance(value, (tuple, list)) or len(value) > 64 or not all(is_count(d) and 0 <= d < 1 << 62
                                                                          for d in value):
        raise BadInput(where, f"{key} gives {shown(name)} the shape {shown(value)}")
    return tuple(value)


def _ceil(n: int, d: int) -> int:
    """ceil(n / d) in integers: a doctored shape's element count may pass a float's range."""
    return -(-n // d)


def _groups(base: Any, flats: int, where: Path) -> tuple[list[dict[str, Any]], dict[int, int]]:
    """The base optimizer's param groups' hyperparameters, and each flat tensor's group (torch numbers the flats in
    order: ``params`` lists their indices)."""
    groups = base.get("param_groups") if isinstance(base, dict) else None
    if not isinstance(groups, list) or not all(isinstance(g, dict) and isinstance(g.get("params"), list) for g in groups):
        raise BadInput(where, "the base optimizer's state has no param_groups")
    group_of = {p: g for g, group in enumerate(groups) for p in group["params"] if isinstance(p, int)}
    if set(group_of) != set(range(flats)):
        raise BadInput(where, f"the base optimizer's param groups hold {shown(sorted(group_of))}, not the "
                              f"{flats} flat partitions")
    return [{k: v for k, v in g.items() if k != "params"} for g in groups], group_of


def _state(base: dict[str, Any], k: int) -> dict[str, Any]:
    """The base optimizer's state of flat ``k`` (empty before the first step)."""
    state = base.get("state")
    own = state.get(k) if isinstance(state, dict) else None
    return own if isinstance(own, dict) else {}


def _steps(base: dict[str, Any], flats: int) -> dict[int, Any]:
    return {k: _state(base, k)["step"] for k in range(flats) if "step" in _state(base, k)}


def _check_state(base: dict[str, Any], flats: list[torch.Tensor], paddings: list[int], where: Path) -> None:
    """Each flat's Adam state as long as its partition, or with the padding the saved partition leaves off."""
    for k, (flat, pad) in enumerate(zip(flats, paddings)):
        for key in STATE_KEYS:
            t = _state(base, k).get(key)
            if t is None:
                continue
            if not isinstance(t, torch.Tensor) or t.dim() != 1 or t.numel() not in (flat.numel(), flat.numel() + pad):
                got = f"{list(t.shape)}" if isinstance(t, torch.Tensor) else type(t).__name__
                raise BadInput(where, f"{key} of flat group {k} is {got}, its fp32 partition holds {flat.numel()} "
                                      "elements")


def _stage12(shapes: list[list[tuple[str, tuple[int, ...]]]], flats: list[list[torch.Tensor]], files: list[Path],
             optims: list[dict[str, Any]], group_of: dict[int, int]) -> list[Slot]:
    """One flat per group; the ranks' partitions concatenated; parameters in order, each with its alignment padding."""
    if len(shapes) != len(flats[0]):
        raise BadInput(files[0], f"holds {len(flats[0])} fp32 groups, param_shapes {len(shapes)}")
    paddings = optims[0].get("param_alignment_paddings")
    world = len(files)
    slots = []
    for g, group in enumerate(shapes):
        sizes = [f[g].numel() for f in flats]
        starts = [sum(sizes[:r]) for r in range(world)]
        pads = paddings[g] if isinstance(paddings, list) and g < len(paddings) else None
        if pads is not None and (not isinstance(pads, list) or len(pads) != len(group)
                                 or not all(is_count(p) and p >= 0 for p in pads)):
            raise BadInput(files[0], f"param_alignment_paddings of group {g} do not give one padding per parameter")
        offset = 0
        for i, (name, shape) in enumerate(group):
            numel = math.prod(shape)
            pieces = [_Piece(r, g, max(offset, s) - s, min(offset + numel, s + n) - max(offset, s))
                      for r, (s, n) in enumerate(zip(starts, sizes)) if max(offset, s) < min(offset + numel, s + n)]
            slots.append(Slot(name, shape, group_of[g], pieces))
            offset += numel + (pads[i] if pads else 0)
        padding = sum(_padding(sd, g) for sd in optims)  # a partition saved with its padding (older DeepSpeed)
        if sum(sizes) not in (offset, offset + padding):
            raise BadInput(files[0], f"the shapes of group {g} in param_shapes add up to {shown(offset)} elements, its fp32 "
                                     f"partitions hold {sum(sizes)} ({sizes} by rank)")
    return slots


def _padding(sd: dict[str, Any], g: int) -> int:
    """The padding a rank's partition of group ``g`` ends in (``group_paddings``: the last rank's, mostly)."""
    pads = sd.get("group_paddings")
    pad = pads[g] if isinstance(pads, list) and g < len(pads) else 0
    return pad if isinstance(pad, int) and pad >= 0 else 0


def _stage3(shapes: list[list[tuple[str, tuple[int, ...]]]], flats: list[list[torch.Tensor]], files: list[Path],
            optims: list[dict[str, Any]], group_of: dict[int, int]) -> list[Slot]:
    """Every rank holds ceil(numel / world) of each parameter at the same offset of its (sub-)groups, one after the
    other; a parameter's group is its first piece's flat's."""
    world = len(files)
    sizes = [t.numel() for t in flats[0]]
    for f, fl in zip(files, flats):
        if [t.numel() for t in fl] != sizes:
            raise BadInput(f, f"its fp32_flat_groups hold {[t.numel() for t in fl]} elements, rank 0's {sizes}")
    bounds = [sum(sizes[:k]) for k in range(len(sizes) + 1)]
    params = [p for group in shapes for p in group]
    need = sum(_ceil(math.prod(s), world) for _, s in params)
    if need != bounds[-1]:
        raise BadInput(files[0], f"the shapes in param_shapes take {shown(need)} elements of each rank's partition, its "
                                 f"fp32_flat_groups hold {bounds[-1]}")
    slots, offset = [], 0
    for name, shape in params:
        numel = math.prod(shape)
        part = _ceil(numel, world)
        pieces = []
        for r in range(world):
            want = min(part, numel - r * part)  # the last rank's piece ends in padding
            for k in range(len(sizes)):
                lo, hi = max(offset, bounds[k]), min(offset + max(want, 0), bounds[k + 1])
                if lo < hi:
                    pieces.append(_Piece(r, k, lo - bounds[k], hi - lo))
        first = pieces[0].flat if pieces else next(k for k in range(len(sizes)) if offset < bounds[k + 1] or k == len(sizes) - 1)
        slots.append(Slot(name, shape, group_of[first], pieces))
        offset += part
    return slots


def _frozen(folder: Path, stage: int, model: dict[str, Any], model_file: Path,
            shapes: list[list[tuple[str, tuple[int, ...]]]], world: int) -> dict[str, Frozen]:
    """Frozen parameters, by name: their fragments (stage 3: one per rank's model states, cut to the recorded shape),
    else the model's tensors that neither ``param_shapes`` nor the buffers name (stage 1 records no
    frozen_param_shapes); each checked to hold its shape's elements."""
    named = model.get("frozen_param_shapes")
    named = named if isinstance(named, dict) else {}
    if stage == 3:
        models = [(f, load(f)) for f in _rank_files(folder, "model")[1:]] if world > 1 else []
        found = {str(n): [(f, _fragments(m).get(n)) for f, m in [(model_file, model), *models]] for n in named}
    elif _fragments(model):
        found = {str(n): [(model_file, t)] for n, t in _fragments(model).items()}
    else:
        module = model.get("module") if isinstance(model.get("module"), dict) else {}
        trained = {n for group in shapes for n, _ in group} | set(map(str, model.get("buffer_names") or []))
        found = {str(n): [(model_file, t)] for n, t in module.items() if str(n) not in trained}
    out = {}
    for name, parts in found.items():
        for f, t in parts:
            if not isinstance(t, torch.Tensor):
                raise BadInput(f, f"holds no tensor for the frozen parameter {shown(name)}")
        shape = _shape(named[name], name, "frozen_param_shapes", model_file) if name in named else tuple(parts[0][1].shape)
        held = sum(t.numel() for _, t in parts)
        if held < math.prod(shape):
            raise BadInput(parts[-1][0], f"the fragments of the frozen parameter {shown(name)} hold {held} elements, "
                                         f"its shape {list(shape)} {shown(math.prod(shape))}")
        out[name] = Frozen(shape, [t for _, t in parts], parts[0][0])
    return out


def _fragments(model: dict[str, Any]) -> dict[Any, Any]:
    fragments = model.get("frozen_param_fragments")
    return fragments if isinstance(fragments, dict) else {}


def entries(folder: Path) -> list[Entry]:
    """The checkpoint as the scan reads it: trainable parameters (fp32 master weights), buffers, the 16-bit working
    copies (``module.name``: an fp16 copy overflows to inf where the master weight passed 65504) and frozen parameters
    as model tensors; each parameter's ``name/exp_avg`` and ``name/exp_avg_sq`` as optimizer state."""
    layout = read(folder)
    model_file = model_states_file(folder)
    out: list[Entry] = []
    for slot in layout.slots:
        out.append(_entry(layout, slot, None, MODEL))
    module = layout.model.get("module") if isinstance(layout.model.get("module"), dict) else {}
    for name in layout.buffer_names:
        t = module.get(name)
        if isinstance(t, torch.Tensor):
            out.append(_held(name, t, model_file))
    for slot in layout.slots:  # the 16-bit working copy the forward pass computes with (stages 1 and 2 save it whole)
        t = module.get(slot.name)
        if layout.stage < 3 and isinstance(t, torch.Tensor) and t.dtype != layout.flats[0][0].dtype:
            if tuple(t.shape) != slot.shape:
                raise BadInput(model_file, f"module's {shown(slot.name)} is {list(t.shape)}, param_shapes says "
                                           f"{list(slot.shape)}")
            out.append(_held(f"module.{slot.name}", t, model_file))
    for name, frozen in layout.frozen.items():
        out.append(_frozen_entry(name, frozen))
    for key in STATE_KEYS:
        if all(key in _state(b, k) for b, f in zip(layout.base, layout.flats) for k in range(len(f))):
            out += [_entry(layout, slot, key, OPTIMIZER) for slot in layout.slots]
    return out


def _entry(layout: Layout, slot: Slot, key: str | None, group: str) -> Entry:
    tensors = layout.flats if key is None else [[_state(b, k)[key] for k in range(len(f))]
                                                for b, f in zip(layout.base, layout.flats)]
    dtype = tensors[0][0].dtype
    name = slot.name if key is None else f"{slot.name}/{key}"
    file = layout.files[slot.pieces[0].rank] if slot.pieces else layout.files[0]
    numel = math.prod(slot.shape)
    info = TensorInfo(name, group, dtype, slot.shape, numel * dtype.itemsize, file)
    release = layout.releases[slot.pieces[0].rank] if len(slot.pieces) == 1 else _keep
    return Entry(info, partial(_gather, tensors, slot), release)


def _gather(tensors: list[list[torch.Tensor]], slot: Slot) -> torch.Tensor:
    """The parameter's elements: a view of its one piece, or its pieces copied together."""
    views = [tensors[p.rank][p.flat].narrow(0, p.start, p.length) for p in slot.pieces]
    flat = views[0] if len(views) == 1 else torch.cat(views) if views else torch.empty(0, dtype=tensors[0][0].dtype)
    return flat.view(slot.shape)


def _frozen_entry(name: str, frozen: Frozen) -> Entry:
    dtype = frozen.parts[0].dtype
    info = TensorInfo(name, MODEL, dtype, frozen.shape, math.prod(frozen.shape) * dtype.itemsize, frozen.file)
    return Entry(info, partial(_joined, frozen.parts, frozen.shape), _keep)


def _joined(parts: list[torch.Tensor], shape: tuple[int, ...]) -> torch.Tensor:
    flat = parts[0].reshape(-1) if len(parts) == 1 else torch.cat([t.reshape(-1) for t in parts])
    return flat[:math.prod(shape)].view(shape)


def _held(name: str, t: torch.Tensor, file: Path) -> Entry:
    """A model tensor the model states hold whole (a buffer, a 16-bit working copy)."""
    return Entry(TensorInfo(name, MODEL, t.dtype, tuple(t.shape), t.numel() * t.element_size(), file), partial(_same, t),
                 _keep)


def _same(t: torch.Tensor) -> torch.Tensor:
    return t


def _keep(view: torch.Tensor) -> None:
    """A tensor put together from pieces is a private copy: its memory goes with it."""

