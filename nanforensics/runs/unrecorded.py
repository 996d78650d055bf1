"""A run nobody recorded: one of the trainer's own checkpoints, and the user's training script, which builds the
model and the optimizer, runs a step, and gives the batch of any step again (a seeded or indexed data pipeline).

``UnrecordedRun`` and ``UnrecordedCode`` satisfy the protocols a recorded run does (``runs.source``), so the one
replay engine drives both. Such a run has no logged losses, so nothing says where it ends, and whether a replay
reproduces it cannot be judged. A checkpoint's step is the number of steps taken before it (the Trainer's
``global_step``, a loop that saves at the top of step ``step``): the replay runs ``batch_at(step)`` first.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import torch

from ..errors import BadInput
from ..formats import CheckpointSource, open_checkpoint
from ..formats.training_state import full_rng, load_model, load_optimizer, read_state
from ..report import CheckpointLoad
from . import imports
from .batches import has_tensor, leaves
from .run import MANIFEST, Rebuilt
from .steplog import LoggedStep

ROLES = {  # role: (default name, option naming it, which is also its role in the trust policy, imports.ROLES)
    "model": ("build_model", "--model"),
    "step": ("train_step", "--step"),
    "batches": ("batch_at", "--batches"),
    "optimizer": ("make_optimizer", "--optimizer"),
    "scheduler": (None, "--scheduler"),  # only when named: a step function that takes scheduler= gets it
}
_DROPOUT = (torch.nn.Dropout, torch.nn.Dropout1d, torch.nn.Dropout2d, torch.nn.Dropout3d, torch.nn.AlphaDropout,
            torch.nn.FeatureAlphaDropout)


@dataclass
class UserCheckpoint:
    """A checkpoint the trainer wrote: the state before step ``step``."""

    path: Path
    step: int
    step_from: str  # "metadata", "trainer_state.json", "name" or "--from-step"
    source: CheckpointSource


def user_checkpoint(path: str | Path, step: int | None = None, step_from: str = "--from-step") -> UserCheckpoint:
    """The checkpoint at ``path``; its step is ``step`` where given, else what its metadata or name records."""
    if (Path(path) / MANIFEST).is_file():
        raise BadInput(path, f"is a run recorded by nanforensics: replay it with `nanforensics replay {path}`, "
                             "which replays its own batches")
    source = open_checkpoint(Path(path))
    if step is None:
        if source.step is None:
            raise BadInput(path, "records no step in its metadata (step, global_step, trainer_state.json) and has "
                                 "no number in its name: give the step it was saved before with --from-step")
        step, step_from = source.step, source.step_source or "name"
        if step_from == "metadata" and source.path.is_dir() and (source.path / "trainer_state.json").is_file():
            step_from = "trainer_state.json"  # the Trainer's global_step: steps taken, the convention here
    if step < 0:
        raise BadInput(path, f"step {step} is negative")
    return UserCheckpoint(Path(path), step, step_from, source)


def _fingerprint(batch: Any) -> str:
    """A digest of every leaf: a batch function must give the same batch each time it is asked."""
    h = hashlib.blake2b(digest_size=16)
    for name, leaf in leaves(batch):
        h.update(name.encode())
        if isinstance(leaf, torch.Tensor):
            t = leaf.detach().cpu().contiguous()
            h.update(f"{t.dtype}{list(t.shape)}".encode())
            h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
        else:
            h.update(repr(leaf).encode())
    return h.hexdigest()


class UnrecordedRun:
    """The run's side: one checkpoint, and the batch of each step from the user's batch function."""

    steps: list[LoggedStep] = []  # nothing was logged
    last_step: int | None = None  # nor where the run ends
    num_threads: int | None = None
    device: str | None = None
    cpu: None = None  # nor on which CPU
    compiled: None = None  # nor whether under torch.compile
    world: None = None  # one process: the user's batch function gives the whole batch

    def __init__(self, checkpoint: UserCheckpoint, batch_fn: Callable[[int], Any], batch_name: str,
                 code_file: Path) -> None:
        self.checkpoint, self.batch_fn, self.batch_name, self.code_file = checkpoint, batch_fn, batch_name, code_file
        self.path = self.checkpoint_folder = checkpoint.path
        self._seen: dict[int, str] = {}

    def checkpoints(self) -> list[UserCheckpoint]:
        return [self.checkpoint]

    def batch(self, step: int, rank: None = None) -> Any:
        try:
            batch = self.batch_fn(step)
        except BadInput:
            raise
        except Exception as e:
            raise BadInput(self.code_file, f"batch function {self.batch_name} raised {e.__class__.__name__} at step "
                                           f"{step}: {e}") from None
        if not has_tensor(batch):
            raise BadInput(self.code_file, f"batch function {self.batch_name} returned no tensor for step {step} "
                                           f"(a {type(batch).__name__})")
        if all(t.numel() == 0 for _, t in leaves(batch) if isinstance(t, torch.Tensor)):
            raise BadInput(self.code_file, f"batch function {self.batch_name} returned an empty batch for step {step} "
                                           "(past the end of the data? --max-steps bounds the replay)")
        digest = _fingerprint(batch)
        if self._seen.setdefault(step, digest) != digest:
            raise BadInput(self.code_file, f"batch function {self.batch_name} returned another batch for step {step} "
                                           "when asked again: replay runs a step several times and needs the same "
                                           "batch each time (seed the data pipeline by step, and do not change "
                                           "batches in place)")
        return batch

    def batch_origin(self, step: int, rank: None = None) -> str:
        return f"{self.batch_name}({step})"


@dataclass
class UnrecordedCode:
    """The user's side: model and optimizer factories and the step function, the checkpoint loaded into them."""

    model_factory: Callable[[], torch.nn.Module]
    step_fn: Callable[..., Any]
    optimizer_factory: Callable[[torch.nn.Module], torch.optim.Optimizer]
    scheduler_factory: Callable[[torch.optim.Optimizer], Any] | None
    specs: dict[str, str]  # role: import string
    code_file: Path
    imported: list[str] = field(default_factory=list)
    loaded: CheckpointLoad | None = None  # what the last build found

    @property
    def step_name(self) -> str:
        return self.specs["step"]

    def build(self, run: UnrecordedRun, checkpoint: UserCheckpoint, device: torch.device) -> Rebuilt:
        """The user's model and optimizer (and scheduler) with the checkpoint's state, and its RNG states."""
        model = self._call("model", self.model_factory, torch.nn.Module)
        model.to(device)
        optimizer = self._call("optimizer", self.optimizer_factory, torch.optim.Optimizer, model)
        scheduler = self._call("scheduler", self.scheduler_factory, object, optimizer) \
            if self.scheduler_factory is not None else None  # before the state is loaded: it sets the groups' lr
        state = read_state(checkpoint.source)
        stripped = load_model(model, state.model, state.model_file, self.specs["model"])
        matched, shared = load_optimizer(model, optimizer, state.optimizer, state.optimizer_file,
                                         self.specs["optimizer"])
        if scheduler is not None:
            if state.scheduler is None:
                raise BadInput(checkpoint.path, f"holds no LR scheduler state for {self.specs['scheduler']}")
            try:
                scheduler.load_state_dict(state.scheduler)
            except (ValueError, KeyError, RuntimeError, TypeError, AttributeError) as e:
                raise BadInput(state.scheduler_file, f"LR scheduler state does not fit {self.specs['scheduler']}: "
                                                     f"{e}") from None
        self.loaded = CheckpointLoad(
            checkpoint=str(checkpoint.path), layout=state.layout, step=checkpoint.step,
            step_from=checkpoint.step_from, batches=run.batch_name, model_prefix_stripped=stripped,
            optimizer_matched=matched, optimizer_params=sum(len(g["params"]) for g in optimizer.param_groups),
            same_shape_params=shared,
            scheduler="restored" if scheduler is not None else "unused" if state.scheduler is not None else "none",
            rng_restored=sorted(state.rng), rng_missing=state.rng_missing,
            random_modules=[n for n, m in model.named_modules() if isinstance(m, _DROPOUT) and m.p > 0])
        return Rebuilt(model, optimizer, None, scheduler, {"rng": full_rng(state.rng)})

    def _call(self, role: str, fn: Callable[..., Any], kind: type, *args: Any) -> Any:
        spec = self.specs[role]
        try:
            made = fn(*args)
        except BadInput:
            raise
        except Exception as e:
            raise BadInput(self.code_file, f"{spec} raised {e.__class__.__name__}: {e}") from None
        if not isinstance(made, kind):
            raise BadInput(self.code_file, f"{spec} returned {type(made).__name__}, not a {kind.__name__}")
        return made


def _chosen(names: Mapping[str, str | None] | None) -> dict[str, str]:
    """The callables' names by role: those given, the defaults elsewhere (a scheduler only where named)."""
    given = names or {}
    return {role: name for role, (default, _) in ROLES.items() if (name := given.get(role) or default)}


def code_specs(code: str, names: Mapping[str, str | None] | None = None) -> list[tuple[str, str]]:
    """(option, import string) of each callable a replay with ``code`` imports, to show before it does."""
    return [(ROLES[role][1], f"{code}:{name}") for role, name in _chosen(names).items()]


def open_unrecorded(checkpoint: UserCheckpoint, code: str, names: Mapping[str, str | None] | None = None, *,
                    search_paths: Sequence[Path] = (), trust_checkpoint: bool = False, trust_code: bool = False,
                    trust_packages: Sequence[str] = ()) -> tuple[UnrecordedRun, UnrecordedCode]:
    """The run and code for a replay: ``code`` is a script (``train.py``) or a module (``pkg.train``), ``names``
    the callables' names by role (``model``, ``step``, ``batches``, ``optimizer``, ``scheduler``), defaults where
    not given. Each callable passes the trust policy under its option's role (``imports.load_callable``) before
    anything calls it; ``trust_code`` lifts the policy. Code inside the checkpoint's folder is refused unless
    ``trust_checkpoint``. A script named by ``code`` is a place the user chose, as a ``--code-path`` folder is."""
    chosen = _chosen(names)
    specs = {role: f"{code}:{name}" for role, name in chosen.items()}
    code_file = Path(code)
    chosen_paths = [*search_paths, code_file] if code.endswith(".py") else list(search_paths)
    found: dict[str, Any] = {}
    missing = []
    for role, spec in specs.items():
        try:
            found[role] = imports.load_callable(ROLES[role][1], spec, where=code_file, search_paths=chosen_paths,
                                                forbidden=None if trust_checkpoint else checkpoint.path,
                                                trust_code=trust_code, trust_packages=trust_packages)
        except imports.MissingName:
            missing.append(role)
    if missing:
        raise BadInput(code, f"defines no {', '.join(chosen[r] for r in missing)} (name "
                             f"{'them' if len(missing) > 1 else 'it'} with "
                             f"{', '.join(ROLES[r][1] + ' NAME' for r in missing)})")
    for role, fn in found.items():
        if not callable(fn):  # only under --trust-code: the policy refuses what is not a function or class
            raise BadInput(code, f"{specs[role]} is a {type(fn).__name__}, not a function")
    run = UnrecordedRun(checkpoint, found["batches"], specs["batches"], code_file)
    user = UnrecordedCode(found["model"], found["step"], found["optimizer"], found.get("scheduler"), specs, code_file,
                          imported=list(specs.values()))
    return run, user
