"""A run whose names are an attacker's: a module, sample ids and the run's folder spelled with every kind of
character that acts on a terminal, an HTML page or an XML parser. The training is the scenarios' own (a near-zero
reading at DEFECT_STEP), so the replay finds an origin, a batch, samples and an operation, each named with them."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import torch
from nanforensics import Recorder
from torch import nn

import scenarios

# Escape sequences (a window title, clear screen, CSI), C0 with NUL, BEL, CR and newline, DEL, C1 (NEL, CSI), a bidi
# override, rich markup (a style, a link), and HTML specials. No "." (a module name cannot hold one).
HOSTILE = ("\x1b]0;pwned\x07\x1b[2J\x1b[31m\x00\x08\r\n\t\x7f\x85\x9b\u202e\u2028"
           "[red]x[/red][link=https://evil]y[/link]<script>alert(1)</script><img src=x onerror=alert(1)>&amp;\"'")
DEFECT_STEP, STEPS = 7, 10


class Named(nn.Module):
    """The scenarios' regressor under a module of the given name: every tensor's name begins with it."""

    def __init__(self, name: str) -> None:
        super().__init__()
        self.add_module(name, scenarios.Regressor())
        self.inner = name

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return getattr(self, self.inner)(x)


def build_model(name: str) -> nn.Module:
    torch.manual_seed(0)
    return Named(name)


def make_optimizer(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.Adam(model.parameters(), lr=1e-2)


def batch(step: int) -> dict[str, Any]:
    b = scenarios.make_batch(step, defect="near_zero" if step == DEFECT_STEP else None, batch_size=16)
    b["ids"] = [f"{HOSTILE}{step}-{i}" for i in range(16)]
    return b


def record(run_dir: Path) -> Path:
    model = build_model(HOSTILE)
    optimizer = make_optimizer(model)
    with Recorder(run_dir, model, optimizer, model_factory=build_model, model_kwargs={"name": HOSTILE},
                  optimizer_factory=make_optimizer, step_fn=scenarios.train_step, checkpoint_every=5) as rec:
        for step in range(STEPS):
            b = batch(step)
            rec.log(step, b, scenarios.train_step(model, optimizer, b))
    return run_dir


# Fields the views look up a table by: a saved report with another value there is refused, not rendered.
LOOKED_UP = {"verdict", "first_poisoned_verdict", "kind", "schema", "status", "stage", "adjustment", "basis", "order", "mode"}


def appended(obj: Any, text: str) -> Any:
    """``obj`` with ``text`` appended to every string it holds (dict keys too), but the looked-up ones."""
    if dataclasses.is_dataclass(obj):
        return dataclasses.replace(obj, **{f.name: getattr(obj, f.name) if f.name in LOOKED_UP
                                           else appended(getattr(obj, f.name), text) for f in dataclasses.fields(obj)
                                           if f.init})
    if isinstance(obj, str):
        return obj + text
    if isinstance(obj, list):
        return [appended(v, text) for v in obj]
    if isinstance(obj, dict):
        return {appended(k, text): appended(v, text) for k, v in obj.items()}
    return obj
