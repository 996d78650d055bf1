"""Finding checkpoints and their order: our run directories, folders, globs, single files, Hugging Face folders.

Order is by the step a checkpoint's own metadata records when every checkpoint has one, else by
the number in its name (the last number in its file or folder name, looking up the folders
below the common root when the name has none, as in ``checkpoint-500/model.safetensors``).
"""

from __future__ import annotations

import glob
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import torch

from ..errors import BadInput, shown
from ..inputs import SafetensorsFile, examine, load_json, open_input
from ..runs.checkpoint import Checkpoint
from ..runs.run import MANIFEST, Run
from ..runs.steplog import is_step
from . import dcp, torch_file, zero
from .entries import MODEL, OPTIMIZER
from .source import CheckpointSource, lightning_parts

FILE_SUFFIXES = (".pt", ".pth", ".ckpt", ".safetensors")
_STEP_KEYS = ("step", "global_step")
_DIGITS = re.compile(r"[0-9]{1,19}")  # ASCII only: str.isdigit also takes "²", which int() refuses
# The Trainer's optimizer.pt, accelerate's save_state optimizer.bin; the model beside it is model.safetensors
# (or its shards), or accelerate's pytorch_model.bin when it was saved without safetensors.
_OPTIMIZER_FILES = ("optimizer.pt", "optimizer.pth", "optimizer.bin")
_TORCH_MODEL_FILE = "pytorch_model.bin"
# Files that may hold tensors: when a folder holds some that are not read, the report names them.
_DATA_SUFFIXES = (".bin", ".pkl", ".pickle", ".pt", ".pth", ".ckpt", ".safetensors", ".npy", ".npz", ".h5")
_PYTORCH_MAGIC = (b"PK\x03\x04", b"\x80")  # torch.save's zip format; a legacy pickle


@dataclass
class Skipped:
    """Why a file beside the checkpoints was not read, by its name."""

    prefix: str
    suffix: str
    why: str


_UNREAD = (
    Skipped("random_states", ".pkl", "accelerate's RNG states, a pickle: refused by name, since nanforensics never "
                                     "unpickles, and they hold no parameters or optimizer state"),
    Skipped("rng_state", "", "RNG states, no parameters or optimizer state"),
    Skipped("scheduler", "", "LR scheduler state, no parameters or optimizer state"),
    Skipped("sampler", "", "data sampler state, no parameters or optimizer state"),
    Skipped("scaler", "", "loss scaler state, no parameters or optimizer state"),
    Skipped("training_args", "", "the Trainer's arguments, no parameters or optimizer state"),
    Skipped("", ".pkl", "a pickle: nanforensics never unpickles"),
    Skipped("", ".pickle", "a pickle: nanforensics never unpickles"),
)


@dataclass
class Collection:
    """Checkpoints in the order bisection walks them, and what that order came from."""

    checkpoints: list[CheckpointSource]
    order: str  # "metadata": the steps recorded inside them; "name": the numbers in their names
    skipped: list[str] = field(default_factory=list)  # "path: why" for files in the folders given left unread


def open_checkpoint(path: Path) -> CheckpointSource:
    """One checkpoint: a tensor file, one of our checkpoint folders, or a Hugging Face folder."""
    if not path.exists():
        raise BadInput(path, "no such file or directory")
    examine(path)
    if path.is_dir():
        if (path / MANIFEST).exists():
            count = len(Run(path).checkpoints())
            raise BadInput(path, f"is a run directory with {count} checkpoints: scan one of them "
                                 f"({path / 'checkpoints'}/step_...), or bisect the run")
        source = _folder_checkpoint(path)
        saved = sorted(p.name for p in path.iterdir() if zero.is_zero(p)) if source is None else []
        if saved:
            raise BadInput(path, f"is a DeepSpeed save folder holding {len(saved)} ZeRO checkpoints ({saved[0]} ... "
                                 f"{saved[-1]}): scan one of them, or bisect the folder")
        if source is None:
            raise BadInput(path, "not a checkpoint folder (no meta.json of a nanforensics checkpoint, "
                                 "no *.index.json, no model.safetensors, no .metadata of torch.distributed.checkpoint, "
                                 "no model and optimizer states of DeepSpeed ZeRO)")
        return _with_own_step(source)
    return _with_own_step(_file_checkpoint(path))


def discover(targets: Sequence[str | Path]) -> Collection:
    """Every checkpoint the targets name, deduplicated and ordered."""
    found: dict[str, CheckpointSource] = {}
    skipped: list[str] = []
    for target in targets:
        for source in _expand(str(target), skipped):
            found.setdefault(os.path.realpath(source.path), source)
    if not found:
        raise BadInput(", ".join(map(str, targets)) or None, "no checkpoints given")
    collection = _ordered(_without_last_copies(list(found.values()), skipped))
    collection.skipped = skipped
    return collection


def _without_last_copies(sources: list[CheckpointSource], skipped: list[str]) -> list[CheckpointSource]:
    """Lightning's ``last.ckpt`` (``ModelCheckpoint(save_last=True)``) is a copy of the newest checkpoint: left
    out, and named, when another checkpoint records its step."""
    steps = {s.meta_step for s in sources if s.format == "lightning" and not s.path.stem.startswith("last")}
    out = []
    for s in sources:
        if s.format == "lightning" and s.path.stem.startswith("last") and s.meta_step in steps:
            skipped.append(f"{s.path}: Lightning's copy of the checkpoint of step {s.meta_step} (save_last)")
        else:
            out.append(s)
    return out


def _expand(target: str, skipped: list[str]) -> list[CheckpointSource]:
    """The checkpoints ``target`` names; the data files among its entries that are none go to ``skipped``."""
    if not os.path.exists(target) and any(c in target for c in "*?["):
        paths = [Path(m) for m in sorted(glob.glob(target))]
        for p in paths:
            examine(p)
        matches = _candidates(paths, skipped)
        if not matches:
            raise BadInput(target, "the pattern matches no checkpoint")
        return matches
    path = Path(target)
    if not path.exists():
        raise BadInput(path, "no such file or directory")
    examine(path)
    if not path.is_dir():
        return [_file_checkpoint(path)]
    if (path / MANIFEST).exists():
        run = Run(path)
        sources = [_ours(c, run.path) for c in run.checkpoints()]
        if not sources:
            raise BadInput(path / "checkpoints", "the run has no checkpoints")
        return sources
    own = _folder_checkpoint(path)
    if own is not None:
        return [own]
    children = _candidates(sorted(path.iterdir()), skipped)
    if not children:
        raise BadInput(path, f"holds no checkpoints (looked for {', '.join(FILE_SUFFIXES)} files and checkpoint "
                             "folders)")
    return children


def _candidates(paths: list[Path], skipped: list[str]) -> list[CheckpointSource]:
    """The checkpoints among some paths; other files (logs, configs, hidden temporaries) are passed over, and
    those that may hold tensors are named in ``skipped``."""
    out = []
    for p in paths:
        if p.name.startswith("."):
            continue
        if p.is_dir():
            source = _folder_checkpoint(p)
            if source is not None:
                out.append(source)
        elif p.suffix in FILE_SUFFIXES:
            out.append(_file_checkpoint(p))
        elif p.suffix in _DATA_SUFFIXES:
            skipped.append(f"{p}: {_why_unread(p.name)}")
    return out


def _why_unread(name: str, other: str | None = None) -> str:
    return next((u.why for u in _UNREAD if name.startswith(u.prefix) and name.endswith(u.suffix)),
                other or f"not a checkpoint file ({', '.join(FILE_SUFFIXES)}) nor part of a checkpoint folder's layout")


def _unread(folder: Path, read: list[Path], other: str | None = None) -> list[str]:
    """The files of a checkpoint folder that may hold tensors and were not read, each with why (``other``: for a file
    no known name explains)."""
    return [f"{p.name}: {_why_unread(p.name, other)}" for p in sorted(folder.iterdir())
            if p.suffix in _DATA_SUFFIXES and p.is_file() and not p.name.startswith(".") and p not in read]


def _file_checkpoint(path: Path) -> CheckpointSource:
    """A single file: safetensors by its suffix, a PyTorch file (a plain one or Lightning's ``.ckpt``) through
    the weights-only loader, anything else refused as no checkpoint before a loader sees it."""
    if path.suffix == ".safetensors":
        return CheckpointSource(path, "safetensors", [(path, None)], meta_step=_step_of(SafetensorsFile(path).metadata, path))
    if zero.rank_file(path) and zero.is_zero(path.parent):
        raise BadInput(path, f"is one file of a DeepSpeed ZeRO checkpoint, read with the others: scan its folder "
                             f"{path.parent}")
    _refuse_non_pytorch(path)
    obj, _ = torch_file.load(path)
    return CheckpointSource(path, "lightning" if lightning_parts(obj) is not None else "pytorch", [(path, None)],
                            meta_step=_step_of(obj, path))


def _refuse_non_pytorch(path: Path) -> None:
    """A file that starts as neither of torch.save's formats (a report, a log, a config) is not a checkpoint."""
    with open_input(path) as f:  # a FIFO named .pt is refused here, never waited on
        head = f.read(64)
    if not head or head.startswith(_PYTORCH_MAGIC):
        return
    text = head.lstrip()
    what = ("a JSON document" if text[:1] in (b"{", b"[") else
            "a text file" if all(32 <= b < 127 or b in b"\t\r\n" for b in head) else "not a PyTorch file")
    raise BadInput(path, f"is not a checkpoint ({what}): scan and bisect read PyTorch files (.pt, .pth, .ckpt, .bin), "
                         ".safetensors files and checkpoint folders")


def _folder_checkpoint(path: Path) -> CheckpointSource | None:
    run_dir = path.parent.parent if (path.parent.parent / MANIFEST).is_file() else None
    if (path / "meta.json").is_file() and os.path.lexists(path / "model.safetensors"):  # a FIFO there: refused on opening
        return _ours(Checkpoint(path, step=-1), run_dir)
    if run_dir is not None and (path / "meta.json").is_file() and (path / dcp.METADATA).is_file():
        return _ours(Checkpoint(path, step=-1), run_dir)  # a distributed run's FSDP2 checkpoint
    if (path / dcp.METADATA).is_file():
        return CheckpointSource(path, "dcp", [(path / dcp.METADATA, None)],
                                meta_step=_step_of(dcp.values(path / dcp.METADATA, _STEP_KEYS), path / dcp.METADATA))
    if zero.is_zero(path):
        return _zero(path, path)
    tagged = zero.tagged(path)
    if tagged is not None:
        return _zero(path, tagged)
    return _huggingface(path)


def _zero(path: Path, folder: Path) -> CheckpointSource:
    """A DeepSpeed ZeRO ``global_stepN`` folder: its step and buffers from the model states (formats.zero); given as
    the folder holding it (the HF Trainer's ``checkpoint-N``), that folder's other files are named as not read."""
    states = zero.model_states_file(folder)
    model = zero.load(states)
    names = model.get("param_shapes")
    params = [n for g in (names if isinstance(names, list) else [names]) if isinstance(g, dict) for n in g]
    return CheckpointSource(path, zero.FORMAT, [(states, None)],
                            meta_step=_step_of({"global_step": model.get("global_steps")}, states),
                            buffer_names=_names(model.get("buffer_names")), param_names=_names(params),
                            skipped=_unread(folder, [p for p in folder.iterdir() if zero.rank_file(p)])
                            + (_unread(path, [], f"beside the DeepSpeed ZeRO checkpoint {folder.name}, whose fp32 master "
                                                 "weights and optimizer state were read instead") if path != folder else []))


def _ours(c: Checkpoint, run_dir: Path | None) -> CheckpointSource:
    meta = c.meta()
    step = meta.get("step")
    if not is_step(step):
        raise BadInput(c.path / "meta.json", f"step {shown(step)} is not a step number (an integer from 0 to 2^63-1)")
    # A distributed run's FSDP2 checkpoint holds torch.distributed.checkpoint's shards, model and optimizer told apart
    # by their keys ("model.fc.weight"); any other, the run format's two files.
    files = [(c.layout_file, None)] if c.sharded else [(c.model_file, MODEL), (c.optimizer_file, OPTIMIZER)]
    prefix = "model." if c.sharded else ""
    return CheckpointSource(c.path, "dcp" if c.sharded else "nanforensics", files, meta_step=step, run_dir=run_dir,
                            buffer_names=_names(meta.get("buffer_names"), prefix),
                            param_names=_names(meta.get("param_names"), prefix))


def _names(value: Any, prefix: str = "") -> frozenset[str] | None:
    """A list of names from meta.json (``buffer_names`` is missing from checkpoints older than the buffer stage)."""
    return frozenset(prefix + str(v) for v in value) if isinstance(value, list) else None


def _huggingface(path: Path) -> CheckpointSource | None:
    """A folder holding a ``*.index.json`` over shards, or ``model.safetensors``; ``optimizer.pt`` beside it
    and ``trainer_state.json``'s ``global_step`` as the Trainer writes them. Or an accelerate ``save_state``
    folder: ``model.safetensors`` (or ``pytorch_model.bin``) and ``optimizer.bin``, read weights-only; its
    ``random_states_*.pkl`` pickles and scheduler are named as skipped, never loaded."""
    indexes = sorted(path.glob("*.index.json"))
    if len(indexes) > 1:
        indexes = [p for p in indexes if p.name.endswith(".safetensors.index.json")] or indexes
    if len(indexes) > 1:
        raise BadInput(path, f"holds several index files ({', '.join(p.name for p in indexes)}); name one shard set")
    step = None
    if indexes:
        files, index_meta = _shards(indexes[0])
        step = _step_of(index_meta, indexes[0])
        kind = "safetensors-sharded"
    elif (path / "model.safetensors").is_file():
        files, kind = [path / "model.safetensors"], "safetensors"
        step = _step_of(SafetensorsFile(files[0]).metadata, files[0])
    elif (path / _TORCH_MODEL_FILE).is_file() and (path / "optimizer.bin").is_file():
        files, kind = [path / _TORCH_MODEL_FILE], "accelerate"
    else:
        return None
    if (path / "optimizer.bin").is_file() or any(path.glob("random_states_*.pkl")):
        kind = "accelerate"
    state = path / "trainer_state.json"
    if os.path.lexists(state):  # a FIFO there is refused on opening, not passed over
        step = _step_of(load_json(state), state) if step is None else step
    tensor_files: list[tuple[Path, str | None]] = [(f, MODEL) for f in files]
    tensor_files += [(path / n, OPTIMIZER) for n in _OPTIMIZER_FILES if (path / n).is_file()][:1]
    return CheckpointSource(path, kind, tensor_files, meta_step=step, skipped=_unread(path, [f for f, _ in tensor_files]))


def _shards(index: Path) -> tuple[list[Path], dict[str, Any]]:
    raw = load_json(index)
    weight_map = raw.get("weight_map") if isinstance(raw, dict) else None
    if not isinstance(weight_map, dict) or not weight_map:
        raise BadInput(index, "not a sharded-checkpoint index (no weight_map)")
    shards = []
    for name in sorted(set(map(str, weight_map.values()))):
        shard = index.parent / name
        if Path(name).is_absolute() or ".." in Path(name).parts:
            raise BadInput(index, f"shard {name!r} lies outside the checkpoint folder")
        if not shard.is_file():
            raise BadInput(shard, f"is missing (named by {index.name})")
        shards.append(shard)
    meta = raw.get("metadata")
    return shards, meta if isinstance(meta, dict) else {}


def _step_of(meta: Any, where: Path) -> int | None:
    """``step`` or ``global_step`` at the top of a metadata mapping or a checkpoint dict (``where``, for the error
    when it holds something else than a step number)."""
    if not isinstance(meta, dict):
        return None
    for key in _STEP_KEYS:
        value = found = meta.get(key)
        if value is None:
            continue
        if isinstance(value, torch.Tensor) and value.numel() == 1:
            value = value.item()
        if isinstance(value, float) and value.is_integer():
            value = int(value)
        if isinstance(value, str) and _DIGITS.fullmatch(value.strip()):
            value = int(value)
        if not is_step(value):
            raise BadInput(where, f"{key} {shown(found)} is not a step number (an integer from 0 to 2^63-1)")
        return value
    return None


def _name_number(path: Path, root: Path) -> int | None:
    """The last number in the name; failing that, in the folders between it and ``root``."""
    try:
        parts = path.absolute().relative_to(root).parts
    except ValueError:
        parts = (path.name,)
    for part in reversed(parts or (path.name,)):
        numbers = re.findall(r"\d+", part.removesuffix(".index.json").removesuffix(path.suffix))
        if numbers:
            return int(numbers[-1])
    return None


def _with_own_step(source: CheckpointSource) -> CheckpointSource:
    """A checkpoint on its own: its metadata step, else the number in its name or its folder's
    (``checkpoint-500/model.safetensors``)."""
    if source.meta_step is not None:
        source.step, source.step_source = source.meta_step, "metadata"
    else:
        root = source.path.parent if source.path.is_dir() else source.path.parent.parent
        source.step = _name_number(source.path, root.absolute())
        source.step_source = "name" if source.step is not None else None
    return source


def _ordered(sources: list[CheckpointSource]) -> Collection:
    if len(sources) == 1:
        only = _with_own_step(sources[0])
        return Collection([only], only.step_source or "name")
    if all(s.meta_step is not None for s in sources):
        order = "metadata"
        for s in sources:
            s.step, s.step_source = s.meta_step, order
    else:
        order = "name"
        root = Path(os.path.commonpath([str(s.path.absolute().parent) for s in sources]))
        for s in sources:
            s.step, s.step_source = _name_number(s.path, root), order
            if s.step is None:
                raise BadInput(s.path, "cannot order the checkpoints: this one records no step in its metadata "
                                       "and has no number in its name")
    sources.sort(key=lambda s: s.step)  # type: ignore[arg-type, return-value]
    for a, b in zip(sources, sources[1:]):
        if a.step == b.step:
            raise BadInput(b.path, f"cannot order the checkpoints: it and {a.path} both are step {a.step} "
                                   f"(by {order})")
    return Collection(sources, order)
