"""Reading a run directory: manifest, step log, checkpoints, batches; rebuilding the user's objects."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, NamedTuple, Sequence

import torch

from ..errors import BadInput
from . import imports
from .batches import read_batch
from .checkpoint import Checkpoint
from .files import load_json
from .steplog import LoggedStep, read_steps

RUN_FORMAT = "nanforensics.run/1"
MANIFEST = "manifest.json"
STEPS = "steps.jsonl"
_CHECKPOINT_DIR = re.compile(r"^step_(\d{8})$")


def batch_path(run_dir: Path, step: int) -> Path:
    return run_dir / "batches" / f"step_{step:08d}.safetensors"


@dataclass
class Manifest:
    model_factory: str
    step_fn: str
    model_kwargs: dict[str, Any]
    optimizer_class: str
    optimizer_factory: str | None
    checkpoint_every: int
    start_step: int
    num_threads: int | None
    raw: dict[str, Any] = field(repr=False)
    scaler_enabled: bool | None = None  # None: the run recorded no GradScaler
    scheduler_factory: str | None = None

    @classmethod
    def read(cls, path: Path) -> "Manifest":
        raw = load_json(path)
        if not isinstance(raw, dict):
            raise BadInput(path, "manifest is not a JSON object")
        fmt = raw.get("format")
        if fmt != RUN_FORMAT:
            if isinstance(fmt, str) and fmt.startswith("nanforensics.run/"):
                raise BadInput(path, f"format {fmt!r} is newer than this nanforensics reads ({RUN_FORMAT}); upgrade it")
            raise BadInput(path, f"not a nanforensics run manifest (format {fmt!r})")
        try:
            opt = raw["optimizer"]
            m = cls(model_factory=str(raw["model_factory"]), step_fn=str(raw["step_fn"]),
                    model_kwargs=dict(raw.get("model_kwargs") or {}), optimizer_class=str(opt["class"]),
                    optimizer_factory=opt.get("factory"), checkpoint_every=int(raw["checkpoint_every"]),
                    start_step=int(raw.get("start_step", 0)), num_threads=raw.get("num_threads"), raw=raw,
                    scaler_enabled=bool(raw["scaler"]["enabled"]) if raw.get("scaler") is not None else None,
                    scheduler_factory=raw["scheduler"]["factory"] if raw.get("scheduler") is not None else None)
        except (KeyError, TypeError, ValueError) as e:
            raise BadInput(path, f"manifest field missing or malformed: {e}") from None
        return m


class Run:
    """A recorded run, opened read-only."""

    def __init__(self, path: Path | str) -> None:
        self.path = Path(path)
        if not self.path.exists():
            raise BadInput(self.path, "no such run directory")
        if not self.path.is_dir():
            raise BadInput(self.path, "not a directory")
        self.manifest = Manifest.read(self.path / MANIFEST)
        self._steps: list[LoggedStep] | None = None

    @property
    def steps(self) -> list[LoggedStep]:
        if self._steps is None:
            self._steps = read_steps(self.path / STEPS)
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

    def batch_file(self, step: int) -> Path:
        return batch_path(self.path, step)

    def batch(self, step: int) -> Any:
        path = self.batch_file(step)
        if not path.exists():
            raise BadInput(path, f"batch of step {step} is missing (needed to replay that step)")
        return read_batch(path)

    def batch_origin(self, step: int) -> str | None:
        path = self.batch_file(step)
        return str(path) if path.exists() else None


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
    optimizer_class: type
    imported: list[str]
    scheduler_factory: Callable[[torch.optim.Optimizer], Any] | None = None
    step_name: str = ""  # the step function's import string, for its errors
    loaded: None = None  # a run's own checkpoints need no account of how they were loaded

    @classmethod
    def load(cls, run: Run, code_paths: Sequence[Path] = (), trust_run_dir: bool = False) -> "UserCode":
        where = run.path / MANIFEST
        m = run.manifest
        resolve = lambda spec: imports.resolve(  # noqa: E731
            spec, where=where, search_paths=code_paths, forbidden=None if trust_run_dir else run.path)
        opt_factory = resolve(m.optimizer_factory) if m.optimizer_factory else None
        imported = [m.model_factory, m.step_fn, m.optimizer_class] + ([m.optimizer_factory] if m.optimizer_factory else [])
        imported += [m.scheduler_factory] if m.scheduler_factory else []
        return cls(resolve(m.model_factory), resolve(m.step_fn), opt_factory, resolve(m.optimizer_class), imported,
                   resolve(m.scheduler_factory) if m.scheduler_factory else None, step_name=m.step_fn)

    def build(self, run: Run, checkpoint: Checkpoint, device: torch.device) -> Rebuilt:
        """Model, optimizer, scaler and scheduler as they were at ``checkpoint``, and the checkpoint meta."""
        where = run.path / MANIFEST
        try:
            model = self.model_factory(**run.manifest.model_kwargs)
        except Exception as e:
            raise BadInput(where, f"model factory {run.manifest.model_factory} raised {e.__class__.__name__}: {e}") from None
        if not isinstance(model, torch.nn.Module):
            raise BadInput(where, f"model factory {run.manifest.model_factory} returned {type(model).__name__}, not a Module")
        model.to(device)
        meta = checkpoint.meta()
        if self.optimizer_factory is not None:
            optimizer = self.optimizer_factory(model)
        else:
            named = dict(model.named_parameters(remove_duplicate=False))
            missing = [n for g in meta["param_groups"] for n in g["params"] if n not in named]
            if missing:
                raise BadInput(checkpoint.path / "meta.json", f"optimizer parameters {missing[:3]} are not in the model")
            groups = [{**g, "params": [named[n] for n in g["params"]]} for g in meta["param_groups"]]
            try:
                optimizer = self.optimizer_class(groups)
            except Exception as e:
                raise BadInput(where, f"cannot rebuild optimizer {run.manifest.optimizer_class}: {e}") from None
        scheduler = None
        if self.scheduler_factory is not None:  # before the state is loaded: building a scheduler sets the groups' lr
            try:
                scheduler = self.scheduler_factory(optimizer)
            except Exception as e:
                raise BadInput(where, f"scheduler factory {run.manifest.scheduler_factory} raised "
                                      f"{e.__class__.__name__}: {e}") from None
        enabled = run.manifest.scaler_enabled
        scaler = torch.amp.GradScaler(device.type, enabled=enabled) if enabled is not None else None
        checkpoint.load_into(model, optimizer, scaler=scaler, scheduler=scheduler)
        return Rebuilt(model, optimizer, scaler, scheduler, meta)
