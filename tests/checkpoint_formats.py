"""Real checkpoints in every format scan and bisect read, built from small recorded runs.

Three runs are recorded once per session with the project's own recorder: ``params`` (a
near-zero reading at step 17 poisons parameters and Adam state), ``state`` (a spike at step 17
overflows only ``exp_avg_sq``; the parameters stay finite) and ``clean``. Checkpoints every 5
steps over 40 steps: 0..15 clean, 20..40 poisoned. The other formats are conversions of those
checkpoints, so their poison is the real poison of a real run.
"""

from __future__ import annotations

import json
import math
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

import pytest
import torch
from nanforensics.inputs import TensorFile
from nanforensics.runs.run import Run
from safetensors.torch import save_file

import scenarios

STEPS, EVERY, DEFECT = 40, 5, 17
FIRST_POISONED, LAST_CLEAN = 20, 15
ALL_STEPS = list(range(0, STEPS + 1, EVERY))
RUNS = {"params": "adam_near_zero", "state": "adam_state_overflow", "clean": "clean"}
FORMATS = ("ours", "pt", "safetensors", "hf")


def recorded_runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The three recorded runs, made once per session: both test files find them in its base temp folder."""
    root = tmp_path_factory.getbasetemp() / "checkpoint_runs"
    out = {kind: root / kind for kind in RUNS}
    if not (root / "done").exists():
        for kind, scenario in RUNS.items():
            scenarios.record(out[kind], scenario, steps=STEPS, defect_step=DEFECT, checkpoint_every=EVERY)
        (root / "done").touch()
    return out


def state_of(run: Path, step: int) -> tuple[dict[str, torch.Tensor], dict, int]:
    """Model state dict, optimizer state dict (torch's layout, with param_names) and step of a recorded checkpoint."""
    ck = next(c for c in Run(run).checkpoints() if c.step == step)
    meta = ck.meta()
    names = meta["param_names"]
    state: dict[int, dict[str, torch.Tensor]] = {}
    for key, t in TensorFile(ck.optimizer_file).items():
        name, _, skey = key.rpartition("/")
        state.setdefault(names.index(name), {})[skey] = t.clone()
    groups = [{"params": list(range(len(names))), "param_names": names, "lr": 0.01}]
    model = {k: v.clone() for k, v in TensorFile(ck.model_file).items()}
    return model, {"state": state, "param_groups": groups}, step


def checkpoint_path(folder: Path, fmt: str, label: int) -> Path:
    """Where ``write_checkpoint`` puts the checkpoint labelled ``label``."""
    names = {"ours": f"step_{label:08d}", "pt": f"ckpt_{label}.pt", "safetensors": f"weights-{label}.safetensors",
             "hf": f"checkpoint-{label}"}
    return folder / names[fmt]


def write_checkpoint(dest: Path, fmt: str, run: Path, step: int, label: int, *, metadata: bool = True) -> Path:
    """Checkpoint ``step`` of ``run`` written in ``fmt`` under ``dest``, named (and, with metadata, stamped) ``label``."""
    model, optim, _ = state_of(run, step)
    dest.mkdir(parents=True, exist_ok=True)
    out = checkpoint_path(dest, fmt, label)
    if fmt == "ours":
        src = next(c for c in Run(run).checkpoints() if c.step == step).path
        shutil.copytree(src, out)
        meta = json.loads((out / "meta.json").read_text())
        (out / "meta.json").write_text(json.dumps({**meta, "step": label}))
        return out
    if fmt == "pt":
        torch.save({"model": model, "optimizer": optim, **({"global_step": label} if metadata else {})}, out)
        return out
    if fmt == "safetensors":
        names, flat = optim["param_groups"][0]["param_names"], dict(model)
        for i, state in optim["state"].items():
            flat.update({f"optimizer.{names[i]}.{k}": t for k, t in state.items()})
        save_file(flat, out, metadata={"step": str(label)} if metadata else None)
        return out
    if fmt == "hf":
        out.mkdir()
        keys = sorted(model)
        half = math.ceil(len(keys) / 2)
        weight_map = {}
        for i, part in enumerate((keys[:half], keys[half:]), 1):
            shard = f"model-0000{i}-of-00002.safetensors"
            save_file({k: model[k] for k in part}, out / shard, metadata={"format": "pt"})
            weight_map.update({k: shard for k in part})
        (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": 0},
                                                                       "weight_map": weight_map}))
        torch.save(optim, out / "optimizer.pt")
        if metadata:
            (out / "trainer_state.json").write_text(json.dumps({"global_step": label, "log_history": []}))
        return out
    raise ValueError(fmt)


def build(dest: Path, fmt: str, picks: Iterable[tuple[Path, int]], *, metadata: bool = True) -> Path:
    """A folder of checkpoints in ``fmt``: each pick is (run, step), labelled with its own step."""
    for run, step in picks:
        write_checkpoint(dest, fmt, run, step, step, metadata=metadata)
    return dest


def converted_folders(tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[str, str], Path]:
    """(run kind, format) -> a folder with every checkpoint of that run in that format."""
    root = tmp_path_factory.getbasetemp() / "checkpoint_folders"
    out = {}
    for kind, run in recorded_runs(tmp_path_factory).items():
        for fmt in FORMATS:
            out[kind, fmt] = root / kind / fmt
            if not out[kind, fmt].exists():
                build(out[kind, fmt], fmt, [(run, s) for s in ALL_STEPS])
    return out



@dataclass
class Checkpoints:
    runs: dict[str, Path]  # run kind -> recorded run directory
    folders: dict[tuple[str, str], Path]  # (run kind, format) -> folder of its checkpoints in that format

    @classmethod
    def make(cls, tmp_path_factory: pytest.TempPathFactory) -> Checkpoints:
        return cls(recorded_runs(tmp_path_factory), converted_folders(tmp_path_factory))
