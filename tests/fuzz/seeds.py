"""The fuzzer's seeds: real artifacts of every layout the commands read, made by the project's own recorder (a run, a
guarded run with an incident, a distributed run; the sample of a run nobody recorded, its checkpoints and training
script; DeepSpeed's ZeRO-2 save folder, shipped as sample_runs/zero2) and converted from its checkpoints into every other format
(``checkpoint_formats`` for torch zip files, safetensors and Hugging Face folders; torch's own writers for Lightning's
``.ckpt``, accelerate's ``save_state`` folder, a legacy pickle and DCP). Each layout names the tree a command examines
and the command lines run on every mutant of it; ``{in}`` is the examined tree, ``{out}`` a folder for outputs."""

from __future__ import annotations

import fcntl
import json
import shutil
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file

import conftest  # noqa: F401 - first: one torch thread, as the suite records its runs (manifests say 1)
import scenarios
from checkpoint_formats import state_of, write_checkpoint

STEPS, DEFECT, EVERY = 12, 7, 5  # checkpoints at 0, 5, 10: the defect between the last two
ROOT = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class Layout:
    name: str
    commands: dict[str, tuple[str, ...]]  # command name -> its arguments, with {in} and {out}


LAYOUTS = (
    Layout("run", {"replay": ("replay", "{in}", "--json", "{out}/r.json"),
                   "bisect": ("bisect", "{in}", "--json", "{out}/b.json"),
                   "postmortem": ("postmortem", "{in}", "--json", "{out}/p.json", "--markdown", "{out}/p.md"),
                   "repair": ("repair", "{in}", "--out", "{out}/fixed", "--verify-steps", "2")}),
    Layout("checkpoint", {"scan": ("scan", "{in}", "--full", "--json", "{out}/s.json")}),
    Layout("incident", {"replay": ("replay", "{in}/incidents/step_00000023", "--json", "{out}/r.json")}),
    Layout("distributed", {"bisect": ("bisect", "{in}", "--json", "{out}/b.json"),
                           "postmortem": ("postmortem", "{in}", "--json", "{out}/p.json")}),
    Layout("pt", {"scan": ("scan", "{in}/ckpt_10.pt", "--full"), "bisect": ("bisect", "{in}", "--linear")}),
    Layout("legacy", {"scan": ("scan", "{in}/legacy.pth", "--full")}),
    Layout("safetensors", {"scan": ("scan", "{in}/weights-10.safetensors", "--full"),
                           "bisect": ("bisect", "{in}", "--linear")}),
    Layout("hf", {"scan": ("scan", "{in}/checkpoint-10", "--full"), "bisect": ("bisect", "{in}")}),
    Layout("lightning", {"scan": ("scan", "{in}/epoch=0-step=10.ckpt", "--full"), "bisect": ("bisect", "{in}"),
                         "postmortem": ("postmortem", "{in}", "--json", "{out}/p.json")}),
    Layout("accelerate", {"scan": ("scan", "{in}/checkpoint_2", "--full")}),
    Layout("dcp", {"scan": ("scan", "{in}/ckpt-10", "--full"), "bisect": ("bisect", "{in}", "--linear")}),
    Layout("unrecorded", {"replay": ("replay", "--checkpoint", "{in}/ckpts/step_000010.pt", "--code", "{in}/train.py",
                                     "--json", "{out}/r.json"),
                          "bisect": ("bisect", "{in}/ckpts", "--code", "{in}/train.py", "--json", "{out}/b.json")}),
    Layout("zero", {"scan": ("scan", "{in}/global_step3", "--full"), "bisect": ("bisect", "{in}")}),
    Layout("report", {"report": ("report", "{in}/r.json", "--markdown", "{out}/r.md", "--html", "{out}/r.html")}),
)
BY_NAME = {layout.name: layout for layout in LAYOUTS}


def _state(run: Path, step: int) -> tuple[dict, dict]:
    """A recorded checkpoint's model and optimizer state dicts, the optimizer's param groups whole (betas, eps,
    weight decay: what a soundness check reads) as torch's state_dict has them."""
    model, optim, _ = state_of(run, step)
    meta = json.loads((run / "checkpoints" / f"step_{step:08d}" / "meta.json").read_text())
    names = optim["param_groups"][0]["param_names"]
    optim["param_groups"] = [{**g, "params": [names.index(n) for n in g["params"]], "param_names": g["params"]}
                             for g in meta["param_groups"]]
    return model, optim


def _recorded(root: Path) -> Path:
    run = root / "run"
    scenarios.record(run, "adam_near_zero", steps=STEPS, defect_step=DEFECT, checkpoint_every=EVERY)
    return run


def _incident(dest: Path) -> None:
    from nanforensics.runs.guard import GuardPolicy

    import guard_training as gt

    gt.train_update_nan(dest, 40, checkpoint_every=10, guard=GuardPolicy(state_check_every=5))
    # the update at THAW would make a NaN from finite gradients: the guard skips it and files its incident there
    assert (dest / "incidents" / f"step_{gt.THAW:08d}").is_dir(), f"the guarded run left no incident at step {gt.THAW}"


def _lightning(dest: Path, run: Path) -> None:
    dest.mkdir()
    for step in (5, 10):
        model, optim = _state(run, step)
        ckpt = {"state_dict": model, "optimizer_states": [optim], "global_step": step, "epoch": 0,
                "lr_schedulers": [], "callbacks": {"ModelCheckpoint": {"kth_value": float("inf"), "best_model_score": None}},
                "hyper_parameters": {"lr": 0.01, "name": "regressor"}}
        torch.save(ckpt, dest / f"epoch=0-step={step}.ckpt")
    shutil.copy(dest / "epoch=0-step=10.ckpt", dest / "last.ckpt")


def _accelerate(dest: Path, run: Path) -> None:
    folder = dest / "checkpoint_2"
    folder.mkdir(parents=True)
    model, optim = _state(run, 10)
    save_file(model, folder / "model.safetensors", metadata={"format": "pt"})
    torch.save(optim, folder / "optimizer.bin")
    torch.save({"step": 2}, folder / "random_states_0.pkl")
    torch.save({"last_epoch": 10}, folder / "scheduler.bin")


def _dcp(dest: Path, run: Path) -> None:
    import torch.distributed.checkpoint as dcp

    for step in (5, 10):
        model, optim, _ = state_of(run, step)
        names = optim["param_groups"][0]["param_names"]
        state = {"model": model, "step": step, "optim": {"state": {names[i]: s for i, s in optim["state"].items()},
                                                          "param_groups": [{"params": names, "lr": 0.01}]}}
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "torch.distributed is disabled ... assuming a single process"
            dcp.save(state, checkpoint_id=dest / f"ckpt-{step}")


def _report(dest: Path, run: Path) -> None:
    from conftest import run_cli

    dest.mkdir()
    result = run_cli("replay", run, "--json", dest / "r.json", "-q")
    assert result.code == 1, result.stderr


def build(root: Path) -> dict[str, Path]:
    """Every layout's seed tree under ``root`` (built once; later calls find it): layout name -> examined tree."""
    root.mkdir(parents=True, exist_ok=True)
    out = {layout.name: root / layout.name for layout in LAYOUTS}
    with open(root / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        done = root / "done"
        if done.exists() and done.read_text() == " ".join(out):
            return out
        for path in (*out.values(), root / "work"):  # an older set of seeds
            shutil.rmtree(path, ignore_errors=True)
        run = _recorded(root / "work")
        shutil.copytree(run, out["run"])
        shutil.copytree(run / "checkpoints" / "step_00000005", out["checkpoint"])
        _incident(out["incident"])
        shutil.copytree(ROOT / "sample_runs" / "ddp_two_ranks", out["distributed"])
        shutil.copytree(ROOT / "sample_runs" / "unrecorded", out["unrecorded"])
        shutil.copytree(ROOT / "sample_runs" / "zero2", out["zero"])
        for fmt in ("safetensors", "hf"):
            for step in (0, 5, 10):
                write_checkpoint(out[fmt], fmt, run, step, step)
        out["pt"].mkdir()
        for step in (0, 5, 10):
            model, optim = _state(run, step)
            torch.save({"model": model, "optimizer": optim, "global_step": step}, out["pt"] / f"ckpt_{step}.pt")
        out["legacy"].mkdir()
        model, optim = _state(run, 10)
        torch.save({"model": model, "optimizer": optim, "step": 10}, out["legacy"] / "legacy.pth",
                   _use_new_zipfile_serialization=False)
        _lightning(out["lightning"], run)
        _accelerate(out["accelerate"], run)
        _dcp(out["dcp"], run)
        _report(out["report"], run)
        done.write_text(" ".join(out))
    return out
