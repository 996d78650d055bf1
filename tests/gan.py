"""A tiny GAN recorded as a user would: generator and discriminator in one ModuleDict, each with its own Adam,
stepping in turn inside one step function (issue 31, several optimizers).

Each fault comes from the data through the real forward and backward, in one real sample's feature ``FAULT_FEATURE``
at ``FAULT_STEP``:

- ``"huge"``: the reading is ``-1e25`` (finite). The discriminator's first-layer gradient in that feature's column is
  finite (~1e23) but its square is not: Adam's ``exp_avg_sq`` of ``discriminator.0.weight`` overflows to inf in that
  column only, while the update ``exp_avg / sqrt(inf)`` is 0 and every parameter stays finite.
- ``"near_zero"``: the discriminator reads ``log(softplus(gain) * x)`` (``log_input=True``) and the reading is 3e-45:
  the forward is finite (-103), log's backward divides by 2e-45 and ``discriminator.0.gain``'s gradient is inf in
  that feature. The discriminator's Adam step turns the gain NaN, and the generator's pass that follows in the same
  step runs through it: its forward is NaN too. The origin is the discriminator's gradient, in the first pass.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from nanforensics import Recorder
from torch import nn

NOISE, FEATURES, BATCH = 4, 6, 16
FAULT_STEP, FAULT_ROW, FAULT_FEATURE = 6, 3, 2
FAULTS = {"huge": -1e25, "near_zero": 3e-45}
STEPS, EVERY = 10, 4


class LogGain(nn.Module):
    """``log(softplus(gain) * x)`` per feature of positive readings, with a learnable gain."""

    def __init__(self) -> None:
        super().__init__()
        self.gain = nn.Parameter(torch.ones(FEATURES))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.log(F.softplus(self.gain) * x)


def build_gan(log_input: bool = False) -> nn.Module:
    torch.manual_seed(0)
    generator = nn.Sequential(nn.Linear(NOISE, 16), nn.ReLU(), nn.Linear(16, FEATURES), nn.Softplus())
    head = [nn.Linear(FEATURES, 16), nn.LeakyReLU(0.2), nn.Linear(16, 1)]
    return nn.ModuleDict({"generator": generator,
                          "discriminator": nn.Sequential(*([LogGain()] if log_input else []), *head)})


def _step(model: nn.Module, g_opt: torch.optim.Optimizer, d_opt: torch.optim.Optimizer,
          batch: dict[str, Any], scaler: torch.amp.GradScaler | None = None) -> torch.Tensor:
    """The discriminator's update, then the generator's, as a GAN loop makes them; under one ``scaler`` shared by
    both, torch's pattern for several optimizers: each steps through ``scaler.step``, one ``scaler.update()`` after."""
    g, d = model["generator"], model["discriminator"]
    scaled = scaler.scale if scaler is not None else (lambda loss: loss)
    stepped = scaler.step if scaler is not None else (lambda opt: opt.step())
    fake = g(batch["noise"])
    d_opt.zero_grad(set_to_none=True)
    real_logits, fake_logits = d(batch["real"]), d(fake.detach())
    d_loss = (F.binary_cross_entropy_with_logits(real_logits, torch.ones_like(real_logits))
              + F.binary_cross_entropy_with_logits(fake_logits, torch.zeros_like(fake_logits)))
    scaled(d_loss).backward()
    stepped(d_opt)
    g_opt.zero_grad(set_to_none=True)
    logits = d(fake)
    g_loss = F.binary_cross_entropy_with_logits(logits, torch.ones_like(logits))
    scaled(g_loss).backward()
    stepped(g_opt)
    if scaler is not None:
        scaler.update()
    return d_loss.detach() + g_loss.detach()


def train_step_gan(model: nn.Module, optimizers: dict[str, torch.optim.Optimizer], batch: dict[str, Any]) -> torch.Tensor:
    """Recorded with ``optimizer={"generator": ..., "discriminator": ...}``: replay passes the same dict."""
    return _step(model, optimizers["generator"], optimizers["discriminator"], batch)


def train_step_gan_list(model: nn.Module, optimizers: list[torch.optim.Optimizer], batch: dict[str, Any], *,
                        scheduler: list[Any] | None = None) -> torch.Tensor:
    """Recorded with ``optimizer=[d_opt, g_opt]``: the discriminator's is optimizer 0; ``scheduler``, where given, a
    list as long, None for an optimizer without one."""
    d_opt, g_opt = optimizers
    loss = _step(model, g_opt, d_opt, batch)
    for s in scheduler or []:
        if s is not None:
            s.step()
    return loss


def train_step_gan_scheduled(model: nn.Module, optimizers: dict[str, torch.optim.Optimizer], batch: dict[str, Any], *,
                             scheduler: dict[str, Any], scaler: torch.amp.GradScaler | None = None) -> torch.Tensor:
    """Recorded with an LR scheduler per optimizer (``scheduler={"generator": ..., "discriminator": ...}``) and
    optionally one GradScaler shared by both: replay passes them as given."""
    loss = _step(model, optimizers["generator"], optimizers["discriminator"], batch, scaler)
    for name in ("generator", "discriminator"):
        scheduler[name].step()
    return loss


def generator_steps(optimizer: torch.optim.Optimizer) -> Any:
    """The generator's schedule: its rate halved every 3 steps."""
    return torch.optim.lr_scheduler.StepLR(optimizer, step_size=3, gamma=0.5)


def discriminator_cosine(optimizer: torch.optim.Optimizer) -> Any:
    """The discriminator's schedule: a cosine over the run."""
    return torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=STEPS)


def gan_batch(step: int, fault: str) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(1000 + step)
    real = torch.rand(BATCH, FEATURES, generator=gen) + 0.5  # positive readings
    if step == FAULT_STEP:
        real[FAULT_ROW, FAULT_FEATURE] = FAULTS[fault]
    return {"real": real, "noise": torch.randn(BATCH, NOISE, generator=gen), "ids": list(range(step * BATCH,
                                                                                               (step + 1) * BATCH))}


def _adam(module: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.Adam(module.parameters(), lr=1e-3)


def generator_adam(model: nn.Module) -> torch.optim.Optimizer:
    """The generator's optimizer as the loop builds it: replay rebuilds it with this, over the rebuilt model."""
    return _adam(model["generator"])


def record_gan(run_dir: Path, *, fault: str = "huge", as_list: bool = False, steps: int = STEPS,
               scheduled: bool = False, scaler: bool = False) -> Path:
    """Record the GAN: as a dict of two optimizers (the generator's by a factory, the discriminator's by its class
    and recorded groups), or as a list ``[d_opt, g_opt]`` rebuilt from their classes. ``scheduled``: each optimizer
    with its own LR scheduler (in the list, the generator's alone); ``scaler``: one GradScaler shared by both."""
    model_kwargs = {"log_input": fault == "near_zero"}
    model = build_gan(**model_kwargs)
    g_opt, d_opt = generator_adam(model), _adam(model["discriminator"])
    step_kw: dict[str, Any] = {}
    if as_list:
        optimizers: Any = [d_opt, g_opt]
        kwargs: dict[str, Any] = {"step_fn": train_step_gan_list}
    else:
        optimizers = {"generator": g_opt, "discriminator": d_opt}
        kwargs = {"step_fn": train_step_gan, "optimizer_factory": {"generator": generator_adam, "discriminator": None}}
    if scheduled and as_list:  # the generator's schedule alone
        step_kw["scheduler"] = [None, generator_steps(g_opt)]
        kwargs["scheduler_factory"] = [None, generator_steps]
    elif scheduled:
        factories = {"generator": generator_steps, "discriminator": discriminator_cosine}
        step_kw["scheduler"] = {name: factories[name](opt) for name, opt in optimizers.items()}
        kwargs.update(step_fn=train_step_gan_scheduled, scheduler_factory=factories)
    if scaler:
        step_kw["scaler"] = torch.amp.GradScaler("cpu", init_scale=2.0 ** 16)
    with Recorder(run_dir, model, optimizers, model_factory=build_gan, model_kwargs=model_kwargs, checkpoint_every=EVERY,
                  **kwargs, **step_kw) as rec:
        for step in range(steps):
            batch = gan_batch(step, fault)
            loss = kwargs["step_fn"](model, optimizers, batch, **step_kw)
            rec.log(step, batch, loss)
    return run_dir
