"""Every form of hyperparameter torch takes, recorded and read back (the class: a value the recorder writes that its
reader refuses). torch takes an lr as a float, a 0-d tensor or a tensor of shape ``[1]``, and Adam's betas as
tensors; the recorder wrote the ``[1]`` one as ``[0.01]``, which meta.json's reader refuses as a list. Here each
optimizer class of torch.optim trains a few steps under the real Recorder, one param group per form, and the
checkpoint it wrote is read with no refusal and each rate as the number the tensor held."""

from __future__ import annotations

import inspect
from pathlib import Path
from typing import Any

import pytest
import torch
from nanforensics import Recorder
from nanforensics.runs.checkpoint import Checkpoint, checkpoint_name

# every form torch takes for an lr, each the same float32 value: the reader must give back that number
LR_FORMS: dict[str, Any] = {"float": 0.01, "0-d tensor": torch.tensor(0.01), "[1] tensor": torch.tensor([0.01])}
OPTIMIZERS = sorted((c for c in vars(torch.optim).values() if inspect.isclass(c) and issubclass(c, torch.optim.Optimizer)
                     and c not in (torch.optim.Optimizer, torch.optim.SparseAdam)),  # SparseAdam: sparse grads only
                    key=lambda c: c.__name__)
STEPS = 3


def build(groups: int = 1) -> torch.nn.Module:
    """One bias-free layer per param group (Muon takes 2-d parameters only)."""
    torch.manual_seed(0)
    return torch.nn.Sequential(*(torch.nn.Linear(3, 3, bias=False) for _ in range(groups)))


def step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, batch: dict[str, Any]) -> torch.Tensor:
    """Through a closure: LBFGS needs one, the others take it."""
    def closure() -> torch.Tensor:
        optimizer.zero_grad()
        loss = model(batch["x"]).pow(2).mean()
        loss.backward()
        return loss
    return optimizer.step(closure)


def _record(run: Path, cls: type[torch.optim.Optimizer], lrs: list[Any], **extra: Any) -> dict[str, Any]:
    """The meta.json of a run of ``cls`` with a param group per lr in ``lrs``, as the reader gives it."""
    model = build(len(lrs))
    groups = [{"params": layer.parameters(), "lr": lr, **extra} for layer, lr in zip(model, lrs)]
    optimizer = cls(groups)
    rec = Recorder(run, model, optimizer, model_factory=build, model_kwargs={"groups": len(lrs)}, step_fn=step,
                   checkpoint_every=STEPS - 1)
    for s in range(STEPS):
        batch = {"x": torch.randn(4, 3, generator=torch.Generator().manual_seed(s))}
        rec.log(s, batch, step(model, optimizer, batch))
    rec.close()
    return Checkpoint(run / "checkpoints" / checkpoint_name(STEPS - 1), STEPS - 1).meta()


@pytest.mark.parametrize("cls", OPTIMIZERS, ids=lambda c: c.__name__)
def test_every_lr_form_torch_takes_is_recorded_as_the_reader_takes_it(tmp_path, cls):
    forms = list(LR_FORMS.values())
    runs = [forms] if cls is not torch.optim.LBFGS else [[lr] for lr in forms]  # LBFGS: one param group
    read = [g["lr"] for i, lrs in enumerate(runs) for g in _record(tmp_path / str(i), cls, lrs)["param_groups"]]
    assert read == [lr.item() if isinstance(lr, torch.Tensor) else lr for lr in forms]


@pytest.mark.parametrize("cls", [torch.optim.Adam, torch.optim.AdamW], ids=lambda c: c.__name__)
def test_betas_as_tensors_are_recorded_as_the_reader_takes_them(tmp_path, cls):
    meta = _record(tmp_path / "run", cls, list(LR_FORMS.values()), betas=(torch.tensor([0.9]), torch.tensor(0.999)))
    assert all(g["betas"] == [torch.tensor(0.9).item(), torch.tensor(0.999).item()] for g in meta["param_groups"])
