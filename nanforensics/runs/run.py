"""Reading a run directory: manifest, step log, checkpoints, batches; rebuilding the user's objects."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any, Callable, NamedTuple, Sequence

import torch

from ..errors import BadInput, shown
from ..inputs import examine, load_json
from ..report import CpuIdentity
from ..schema import load
from . import imports
from .batches import read_batch
from .checkpoint import Checkpoint
from .compiled import eager, wrapped_names
from .layout import DISTRIBUTED_FORMAT, RANKS, World, merged_steps, rank_dir
from .optimizers import GIVEN, UNSUPPORTED, OptimizerSet, SchedulerSet, unsupported
from .paths import MANIFEST, run_directory
from .stages import PIPELINE, batch_pipelines, last_rank
from .steplog import LoggedStep, is_step, read_steps

RUN_FORMAT = "nanforensics.run/1"
# A run of several optimizers: a reader of RUN_FORMAT alone would look for its one "optimizer" and refuse it half-way
SEVERAL_OPTIMIZERS_FORMAT = "nanforensics.run/1+optimizers"
STEPS = "steps.jsonl"
_CHECKPOINT_DIR = re.compile(r"^step_(\d{8})$")
MAX_THREADS = 4096  # num_threads beyond any machine's cores is damage, not a setting to pin


def batch_path(run_dir: Path, step: int) -> Path:
    return run_dir / "batches" / f"step_{step:08d}.safetensors"


_BATCH_FILE = re.compile(r"^step_(\d{1,19})\.safetensors$")


def batch_gaps(run_dir: Path, first: int, end: int) -> list[tuple[int, int]]:
    """The spans [a, b] of steps in [first, end) whose batches the run directory lacks (any rank's, for a distributed
    run), from the listing of its folders: never a walk over every step of a range that a damaged step number can
    make 2^63 long."""
    held: set[int] | None = None
    for folder in sorted((run_dir / RANKS).glob("rank_*")) or [run_dir]:
        files = (folder / "batches").glob("step_*.safetensors") if (folder / "batches").is_dir() else []
        steps = {int(m.group(1)) for p in files if (m := _BATCH_FILE.match(p.name)) and p.is_file()}
        held = steps if held is None else held & steps
    gaps, at = [], first
    for s in sorted(s for s in held or () if first <= s < end):
        if s > at:
            gaps.append((at, s - 1))
        at = s + 1
    return gaps + [(at, end - 1)] if at < end else gaps


@dataclass
class OptimizerMember:
    """One optimizer of a run of several: its name, class and factory, and its LR scheduler's factory where it has
    one (import strings)."""

    name: str
    optimizer_class: str
    factory: str | None
    scheduler_factory: str | None = None


@dataclass
class Manifest:
    model_factory: str
    step_fn: str
    model_kwargs: dict[str, Any]
    optimizer_class: str | None  # None: a run of several optimizers (``optimizers``)
    optimizer_factory: str | None
    checkpoint_every: int
    start_step: int
    num_threads: int | None
    raw: dict[str, Any] = field(repr=False)
    scaler_enabled: bool | None = None  # None: the run recorded no GradScaler
    scheduler_factory: str | None = None
    world: World | None = None  # None: a single-process run
    cpu: CpuIdentity | None = None  # None: recorded before manifests named the CPU
    compiled: str | None = None  # the torch.compile backend the loop's model ran under; None: not compiled
    optimizers: list[OptimizerMember] | None = None  # several optimizers, in the order the loop passed them
    optimizers_given: str | None = None  # how it passed them (optimizers.GIVEN): what the step function is given

    @classmethod
    def read(cls, path: Path) -> "Manifest":
        raw = load_json(path)
        if not isinstance(raw, dict):
            raise BadInput(path, "manifest is not a JSON object")
        fmt = raw.get("format")
        if fmt not in (RUN_FORMAT, DISTRIBUTED_FORMAT, SEVERAL_OPTIMIZERS_FORMAT):
            if isinstance(fmt, str) and fmt.startswith("nanforensics.run/"):
                raise BadInput(path, f"format {fmt!r} is newer than this nanforensics reads ({RUN_FORMAT}); upgrade it")
            raise BadInput(path, f"not a nanforensics run manifest (format {fmt!r})")
        get = partial(_field, path, raw)
        threads = get("num_threads", int, optional=True)
        if threads is not None and not 1 <= threads <= MAX_THREADS:
            raise BadInput(path, f"num_threads {shown(threads)} is not a thread count from 1 to {MAX_THREADS}")
        every, start = get("checkpoint_every", int), get("start_step", int, optional=True) or 0
        for name, value, low in (("checkpoint_every", every, 1), ("start_step", start, 0)):
            if not (is_step(value) and value >= low):
                raise BadInput(path, f"{name} {shown(value)} is not an integer from {low} to 2^63-1")
        several = fmt == SEVERAL_OPTIMIZERS_FORMAT
        m = cls(model_factory=get("model_factory", str), step_fn=get("step_fn", str),
                model_kwargs=get("model_kwargs", dict, optional=True) or {},
                optimizer_class=None if several else get("optimizer.class", str),
                optimizer_factory=None if several else get("optimizer.factory", str, optional=True), checkpoint_every=every,
                start_step=start, num_threads=threads, raw=raw,
                scaler_enabled=get("scaler.enabled", bool) if raw.get("scaler") is not None else None,
                scheduler_factory=get("scheduler.factory", str) if raw.get("scheduler") is not None else None,
                cpu=load(CpuIdentity, raw["cpu"], path, "cpu") if raw.get("cpu") is not None else None,
                compiled=get("compiled.backend", str) if raw.get("compiled") is not None else None)
        if fmt == DISTRIBUTED_FORMAT:
            m.world = World.read(raw.get("distributed"), path)
        if several:
            m.optimizers_given, m.optimizers = _members(path, raw)
            if why := unsupported(k for k in UNSUPPORTED if raw.get(k) is not None):
                raise BadInput(path, why)
            if raw.get("scheduler") is not None:
                raise BadInput(path, f"scheduler beside optimizers: a run of several optimizers names each one's "
                                     f"scheduler in {MEMBERS}")
        return m

    def callables(self) -> list[tuple[str, str]]:
        """(field, import string) of every callable the run names, in the order they are imported."""
        named = [("model_factory", self.model_factory), ("step_fn", self.step_fn),
                 ("optimizer.class", self.optimizer_class), ("optimizer.factory", self.optimizer_factory),
                 *[(f"{MEMBERS}.{i}.{part}", spec) for i, o in enumerate(self.optimizers or ())
                   for part, spec in (("class", o.optimizer_class), ("factory", o.factory),
                                      ("scheduler.factory", o.scheduler_factory))],
                 ("scheduler.factory", self.scheduler_factory)]
        if self.world is not None and self.world.kind == PIPELINE:  # the loss function the schedule was built with
            named.append(("distributed.wrapping.loss_fn", self.world.wrapping["loss_fn"]))
        return [(f, spec) for f, spec in named if spec is not None]


_KINDS = {str: "an import string", dict: "a JSON object", int: "an integer", bool: "true or false", list: "a list"}
MEMBERS = "optimizers.members"  # the manifest's list of several optimizers


def _members(path: Path, raw: dict[str, Any]) -> tuple[str, list[OptimizerMember]]:
    """A run of several optimizers: how the loop passed them, and each by name, class and factory."""
    get = partial(_field, path, raw)
    given = get("optimizers.given", str)
    if given not in GIVEN:
        raise BadInput(path, f"optimizers.given {shown(given)} is not one of {', '.join(GIVEN)}")
    listed = get(MEMBERS, list)
    if not listed:
        raise BadInput(path, f"{MEMBERS} is empty")
    members = [OptimizerMember(get(f"{MEMBERS}.{i}.name", str), get(f"{MEMBERS}.{i}.class", str),
                               get(f"{MEMBERS}.{i}.factory", str, optional=True),
                               get(f"{MEMBERS}.{i}.scheduler.factory", str)
                               if isinstance(listed[i], dict) and listed[i].get("scheduler") is not None else None)
               for i in range(len(listed))]
    names = [o.name for o in members]
    expected = names if given == "dict" else [str(i) for i in range(len(names))]
    if len(set(names)) != len(names) or names != expected or not all(names):
        raise BadInput(path, f"{MEMBERS} names {shown(names)} are not distinct non-empty names (positions for a "
                             f"{given})")
    return given, members


def _field(path: Path, raw: dict[str, Any], name: str, kind: type, optional: bool = False) -> Any:
    """The manifest's field ``name`` (dotted: ``optimizer.class``) when it is a ``kind``; else a one-line error
    naming the field."""
    node: Any = raw
    for part in name.split("."):
        if isinstance(node, list):  # a list's entry by its position
            node = node[int(part)] if part.isdigit() and int(part) < len(node) else None
        else:
            node = node.get(part) if isinstance(node, dict) else None
    if node is None:
        if optional:
            return None
        raise BadInput(path, f"field {name} is missing")
    if not isinstance(node, kind) or (kind is int and isinstance(node, bool)):
        raise BadInput(path, f"{name} {shown(node)} is not {_KINDS[kind]}")
    return node


class Run:
    """A recorded run, opened read-only."""

    def __init__(self, path: Path | str) -> None:
        self.path = run_directory(Path(path))
        examine(self.path)
        self.manifest = Manifest.read(self.path / MANIFEST)
        self.world = self.manifest.world
        self._steps: list[LoggedStep] | None = None

    @property
    def ranks(self) -> list[int | None]:
        """The ranks whose batches and losses the run holds (on a DeviceMesh, its data-parallel groups): ``[None]`` for a
        single-process run."""
        return list(range(self.world.data_ranks)) if self.world else [None]

    def data_dir(self, rank: int | None = None) -> Path:
        """The folder of a rank's step log and batches (the run directory itself for a single-process run)."""
        if self.world is None:
            return self.path
        if rank is None or not 0 <= rank < self.world.data_ranks:
            raise ValueError(f"a distributed run of {self.world.data_ranks} data ranks keeps batches per rank, not {rank!r}")
        return rank_dir(self.path, rank)

    def rank_steps(self, rank: int | None) -> list[LoggedStep]:
        return read_steps(self.data_dir(rank) / STEPS)

    @property
    def steps(self) -> list[LoggedStep]:
        """The logged loss per step; for a distributed run, the mean over ranks (docs/run-format.md)."""
        if self._steps is None:
            if self.world is None:
                self._steps = read_steps(self.path / STEPS)
            else:  # a pipeline's losses are its last stage's (every rank of a pipeline logged them): one per pipeline
                wrapping = self.world.wrapping
                ranks = [last_rank(wrapping, j) for j in batch_pipelines(wrapping)] if self.world.kind == PIPELINE \
                    else self.ranks
                try:
                    self._steps = merged_steps([self.rank_steps(r) for r in ranks])
                except ValueError as e:
                    raise BadInput(self.path / "ranks", str(e)) from None
        return self._steps

    @property
    def last_step(self) -> int | None:
        return self.steps[-1].step if self.steps else None

    @property
    def num_threads(self) -> int | None:
        return self.manifest.num_threads

    @property
    def device(self) -> str | None:
        return self.manifest.raw.get("device")

    @property
    def cpu(self) -> CpuIdentity | None:
        return self.manifest.cpu

    @property
    def compiled(self) -> str | None:
        return self.manifest.compiled

    @property
    def checkpoint_folder(self) -> Path:
        return self.path / "checkpoints"

    @property
    def code_file(self) -> Path:
        return self.path / MANIFEST

    def checkpoints(self) -> list[Checkpoint]:
        folder = self.checkpoint_folder
        found = []
        if folder.is_dir():
            for entry in folder.iterdir():
                m = _CHECKPOINT_DIR.match(entry.name)
                if m and entry.is_dir():
                    found.append(Checkpoint(entry, int(m.group(1))))
        return sorted(found, key=lambda c: c.step)

    def batch_file(self, step: int, rank: int | None = None) -> Path:
        return batch_path(self.data_dir(rank), step)

    def batch(self, step: int, rank: int | None = None) -> Any:
        path = self.batch_file(step, rank)
        if not path.exists():
            raise BadInput(path, f"batch of step {step} is missing (needed to replay that step)")
        return read_batch(path)

    def batch_origin(self, step: int, rank: int | None = None) -> str | None:
        """The file of the batch of ``step`` (of ``rank``'s shard); for a distributed run without a rank, every
        rank's file as one pattern, when each is present."""
        if self.world is not None and rank is None:
            present = all(self.batch_file(step, r).is_file() for r in self.ranks)
            return str(self.path / RANKS / "rank_*" / "batches" / batch_path(Path(), step).name) if present else None
        path = self.batch_file(step, rank)
        return str(path) if path.is_file() else None


def run_code(directory: Path | str) -> list[tuple[str, str]]:
    """The callables a run directory names, (field, import string), for a command to show before it imports any;
    none where there is no readable manifest (the command says so itself)."""
    try:
        return Manifest.read(Path(directory) / MANIFEST).callables()
    except BadInput:
        return []


class Rebuilt(NamedTuple):
    """The run's objects as they were at a checkpoint; scaler and scheduler only where the run recorded them."""

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scaler: torch.amp.GradScaler | None
    scheduler: Any
    meta: dict[str, Any]


@dataclass
class UserCode:
    """The user's model factory, step function and optimizer, reached through the manifest's import strings."""

    model_factory: Callable[..., torch.nn.Module]
    step_fn: Callable[[torch.nn.Module, torch.optim.Optimizer, Any], Any]
    optimizer_factory: Callable[..., torch.optim.Optimizer] | None
    optimizer_class: type | None
    imported: list[str]
    scheduler_factory: Callable[[torch.optim.Optimizer], Any] | None = None
    step_name: str = ""  # the step function's import string, for its errors
    loaded: None = None  # a run's own checkpoints need no account of how they were loaded
    # several optimizers: (name, class, factory, scheduler factory) each, in the manifest's order; None for a run of one
    members: list[tuple[str, type, Callable[..., torch.optim.Optimizer] | None, Callable[..., Any] | None]] | None = None

    @classmethod
    def load(cls, run: Run, code_paths: Sequence[Path] = (), trust_run_dir: bool = False,
             trust_code: bool = False, trust_packages: Sequence[str] = ()) -> "UserCode":
        """Import the manifest's callables, each admitted by the trust policy (``imports.check_callable``) before
        anything calls it; ``trust_code`` lifts the policy, ``trust_run_dir`` allows code inside the run directory,
        ``trust_packages`` names installed distributions the run's code may come from."""
        loaded = {f: imports.load_callable(f, spec, where=run.path / MANIFEST, search_paths=code_paths,
                                           forbidden=None if trust_run_dir else run.path, trust_code=trust_code,
                                           trust_packages=trust_packages)
                  for f, spec in run.manifest.callables()}
        members = [(o.name, loaded[f"{MEMBERS}.{i}.class"], loaded.get(f"{MEMBERS}.{i}.factory"),
                    loaded.get(f"{MEMBERS}.{i}.scheduler.factory")) for i, o in enumerate(run.manifest.optimizers or ())]
        return cls(loaded["model_factory"], loaded["step_fn"], loaded.get("optimizer.factory"),
                   loaded.get("optimizer.class"), [spec for _, spec in run.manifest.callables()],
                   loaded.get("scheduler.factory"), step_name=run.manifest.step_fn, members=members or None)

    def build(self, run: Run, checkpoint: Checkpoint, device: torch.device,
              wrap: Callable[[torch.nn.Module], None] | None = None) -> Rebuilt:
        """Model, optimizer, scaler and scheduler as they were at ``checkpoint``, and the checkpoint meta.

        ``wrap`` shards the model in place before the optimizer is built over its parameters (FSDP2's ``fully_shard``).
        """
        where = run.path / MANIFEST
        try:
            model = self.model_factory(**run.manifest.model_kwargs)
        except Exception as e:
            raise BadInput(where, f"model factory {run.manifest.model_factory} raised {e.__class__.__name__}: {e}") from None
        if not isinstance(model, torch.nn.Module):
            raise BadInput(where, f"model factory {run.manifest.model_factory} returned {type(model).__name__}, not a Module")
        built, model = model, eager(model)  # replay's hooks see every module and operation only in eager execution
        model.to(device)
        if wrap is not None:
            wrap(model)
        meta = checkpoint.meta()
        # a run recorded before the recorder unwrapped torch.compile names its tensors "_orig_mod.x": they load through
        # the compiled wrapper, whose parameters are the module's own
        holder = built if built is not model and wrapped_names(n for g in meta["param_groups"] for n in g["params"]) \
            else model
        if self.members is None:
            optimizer = _optimizer(self.optimizer_class, self.optimizer_factory, holder, meta["param_groups"], run,
                                   checkpoint, "optimizer", (run.manifest.optimizer_class, run.manifest.optimizer_factory))
        else:
            owners = meta.get("group_optimizers") or []
            recorded = run.manifest.optimizers or []
            members = {name: _optimizer(
                kind, factory, holder, [g for g, o in zip(meta["param_groups"], owners) if o == name], run, checkpoint,
                f"{MEMBERS}.{i}", (recorded[i].optimizer_class, recorded[i].factory))
                for i, (name, kind, factory, _) in enumerate(self.members)}
            checkpoint.check_owners(meta, [name for name, o in members.items() for _ in o.param_groups])
            try:
                optimizer = OptimizerSet(members, run.manifest.optimizers_given or "list")
            except (TypeError, ValueError) as e:  # the factories built optimizers sharing a parameter
                raise BadInput(where, str(e)) from None
        scheduler = self.scheduler(run, optimizer)  # before the state is loaded: building one sets the groups' lr
        enabled = run.manifest.scaler_enabled
        scaler = torch.amp.GradScaler(device.type, enabled=enabled) if enabled is not None else None
        checkpoint.load_into(holder, optimizer, scaler=scaler, scheduler=scheduler)
        return Rebuilt(model, optimizer, scaler, scheduler, meta)

    def scheduler(self, run: Run, optimizer: torch.optim.Optimizer) -> Any:
        """The run's LR scheduler over ``optimizer``, as its factory builds it (None where the run recorded none); for
        several optimizers, each one's over it, as one ``SchedulerSet`` (None where none has one)."""
        if not isinstance(optimizer, OptimizerSet):
            return _scheduler(run, self.scheduler_factory, optimizer, "scheduler factory",
                              run.manifest.scheduler_factory)
        recorded = run.manifest.optimizers or []
        made = {name: _scheduler(run, factory, optimizer.members[name], f"{MEMBERS}.{i}.scheduler.factory",
                                 recorded[i].scheduler_factory)
                for i, (name, _, _, factory) in enumerate(self.members or ()) if factory is not None}
        return SchedulerSet(made, optimizer) if made else None


def _scheduler(run: Run, factory: Callable[..., Any] | None, optimizer: torch.optim.Optimizer, field: str,
               spec: str | None) -> Any:
    """One LR scheduler of the run, built by its factory over ``optimizer`` (None without a factory): one-line errors
    naming ``field`` and ``spec``, its import string, for a factory that raises or returns something else."""
    if factory is None:
        return None
    where = run.path / MANIFEST
    try:
        scheduler = factory(optimizer)
    except Exception as e:
        raise BadInput(where, f"{field} {spec} raised {e.__class__.__name__}: {e}") from None
    if not all(callable(getattr(scheduler, m, None)) for m in ("step", "state_dict", "load_state_dict")):
        raise BadInput(where, f"{field} {spec} returned {type(scheduler).__name__}, not an LR scheduler")
    return scheduler


def _optimizer(kind: Any, factory: Callable[..., torch.optim.Optimizer] | None, holder: torch.nn.Module,
               groups: list[dict[str, Any]], run: Run, checkpoint: Checkpoint, field: str,
               specs: tuple[str | None, str | None]) -> torch.optim.Optimizer:
    """One optimizer of the run, built by its factory over ``holder``, else its class over the checkpoint's groups
    (``field``: the manifest's, ``specs`` its class's and factory's import strings, named by its errors)."""
    where = run.path / MANIFEST
    if factory is not None:
        try:
            optimizer = factory(holder)
        except Exception as e:
            raise BadInput(where, f"{field}.factory {specs[1]} raised {e.__class__.__name__}: {e}") from None
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise BadInput(where, f"{field}.factory {specs[1]} returned {type(optimizer).__name__}, not a "
                                  "torch.optim.Optimizer")
        return optimizer
    named = dict(holder.named_parameters(remove_duplicate=False))
    missing = [n for g in groups for n in g["params"] if n not in named]
    if missing:
        raise BadInput(checkpoint.path / "meta.json", f"optimizer parameters {missing[:3]} are not in the model")
    try:
        return kind([{**g, "params": [named[n] for n in g["params"]]} for g in groups])
    except Exception as e:
        raise BadInput(where, f"cannot rebuild {field} {specs[0]}: {e}") from None
