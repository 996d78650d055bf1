"""Mixed precision in a replay: the loss scaler as the control loop it is, and the overflows it caught kept
apart from the non-finite values that got through to the optimizer state.

A GradScaler that finds an inf or NaN gradient skips ``optimizer.step()`` and backs off its scale: the
moments are never written, one step is lost and the run is intact. That is routine while the scale
settles, and benign. What kills a mixed-precision run is a non-finite value that reaches the optimizer
state. Replay runs each step through ``AmpLog.run_step``, which reads the scale around the step and
whether ``optimizer.step()`` ran; a skipped step whose state, parameters and buffers stayed finite is
*caught*, and its events leave the propagation chain, so they neither start a rewind nor decide the
verdict.
"""

from __future__ import annotations

from typing import Any

import torch

from ..report import AmpReport, Event, ScalerStep
from ..rootcause.findings import describe
from ..runs.optimizers import members_of
from ..words import count, numbered
from .monitor import StepMonitor
from .session import Session

FP16_MAX = torch.finfo(torch.float16).max  # 65504

# The stage a step's first non-finite value arose in, as an overflow's name.
_OVERFLOW = {"batch": "data", "forward": "forward", "loss": "loss", "grad": "backward", "optimizer_grad": "unscale",
             "optimizer_state": "optimizer", "param": "update", "buffer": "buffer"}
_REACHED_STATE = ("optimizer_state", "param", "buffer")  # what persists into the next step


def _adjustment(scale: float | None, next_scale: float | None) -> str:
    if scale is None or next_scale is None or next_scale == scale:
        return "hold"
    return "backoff" if next_scale < scale else "growth"


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def skipped(optimizer: torch.optim.Optimizer, stepped: list[torch.optim.Optimizer]) -> bool:
    """Whether ``optimizer.step()`` did not run this step, ``stepped`` the optimizers whose step ran: of several, any
    one's (one GradScaler steps each of them whose own gradients are finite, and skips the others)."""
    ran = {id(o) for o in stepped}
    return any(id(o) not in ran for o in members_of(optimizer))


def scaler_caught(scaler: Any, optimizer: torch.optim.Optimizer, stepped: list[torch.optim.Optimizer],
                  events: list[Event]) -> bool:
    """Whether the GradScaler caught this step's non-finite values: it skipped ``optimizer.step()`` (of several, the
    step of each whose gradients were not finite, while the others' stepped finite) and none reached the state (a
    skipped step can still have written BatchNorm statistics from an overflowed forward: stage buffer).
    The one rule for the replay's steps and for sample attribution's passes."""
    return scaler is not None and skipped(optimizer, stepped) and bool(events) \
        and all(e.stage not in _REACHED_STATE for e in events)


class AmpLog:
    """What the scaler did at each replayed step, and the overflows it caught (keyed by step: a step
    replayed again after a rewind replaces its first record)."""

    def __init__(self) -> None:
        self.steps: dict[int, ScalerStep] = {}
        self.caught: dict[int, Event] = {}
        self.autocast: str | None = None

    def run_step(self, session: Session, monitor: StepMonitor | None, locate: bool) -> tuple[float, list[Event]]:
        """``session.run_step``, watched; the events of an overflow the scaler caught are kept here, not returned."""
        step, scaler, device_type = session.step, session.scaler, session.device.type
        scale = scaler.get_scale() if scaler is not None else None
        stepped: list[torch.optim.Optimizer] = []
        handles = [session.optimizer.register_step_post_hook(lambda o, *_: stepped.append(o)),
                   session.model.register_forward_pre_hook(lambda *_: self._note_autocast(device_type))]
        try:
            loss, events = session.run_step(monitor, locate)
        finally:
            for h in handles:
                h.remove()
        next_scale = scaler.get_scale() if scaler is not None else None
        caught = scaler_caught(scaler, session.optimizer, stepped, events)
        self.steps[step] = ScalerStep(step, scale, next_scale, _adjustment(scale, next_scale),
                                      skipped(session.optimizer, stepped),
                                      _OVERFLOW[events[0].stage] if events else None, caught)
        self.caught.pop(step, None)
        if caught:
            self.caught[step] = events[0]
            return loss, []
        return loss, events

    def _note_autocast(self, device_type: str) -> None:
        if torch.is_autocast_enabled(device_type):
            self.autocast = _dtype_name(torch.get_autocast_dtype(device_type))

    def report(self, model: torch.nn.Module, events: list[Event]) -> AmpReport | None:
        """None for a run with neither a scaler, nor autocast, nor half-precision parameters."""
        steps = [self.steps[s] for s in sorted(self.steps)]
        scaler = any(s.scale is not None for s in steps)
        param_dtype = next((_dtype_name(p.dtype) for p in model.parameters() if p.is_floating_point()), "float32")
        if not scaler and self.autocast is None and param_dtype == "float32":
            return None
        poisoned = next((e for e in events if e.stage == "optimizer_state"), None)
        return AmpReport(self.autocast, param_dtype, scaler, steps, [self.caught[s] for s in sorted(self.caught)],
                         poisoned)


_PLAIN = {"data": "a non-finite value in the batch", "forward": "a non-finite activation",
          "loss": "a non-finite loss", "backward": "a non-finite gradient in the backward pass",
          "unscale": "a gradient made non-finite between backward and optimizer.step()",
          "optimizer": "an overflow in the optimizer's own update of its state",
          "update": "a non-finite parameter update",
          "buffer": "a non-finite buffer (running statistics, say), the parameters and optimizer state finite"}


def overflow_text(kind: str | None, amp: AmpReport, scaled: bool) -> str:
    """An overflow in words; in float16 a forward overflow and a (scaled) backward-only one are told apart."""
    half = amp.autocast == "float16" or amp.param_dtype == "float16"
    if kind == "forward" and half:
        return f"a forward overflow: an activation past float16's largest value, {FP16_MAX:.0f}"
    if kind == "backward" and half:
        return (f"a {'scaled ' if scaled else ''}backward overflow: the forward and the loss stayed within float16, "
                f"a gradient did not")
    return _PLAIN.get(kind or "", "no non-finite value")


def _control_text(amp: AmpReport) -> str:
    """``backed off at steps 14, 17, grew at step 13``, or ``held throughout``."""
    moves = [f"{verb} at {numbered('step', steps)}" for verb, steps in (
        ("backed off", [s.step for s in amp.steps if s.adjustment == "backoff"]),
        ("grew", [s.step for s in amp.steps if s.adjustment == "growth"])) if steps]
    return ", ".join(moves) or "held throughout"


def findings(amp: AmpReport | None) -> list[str]:
    """The scaler's control loop, its caught overflows, and the failure that got through, in plain words."""
    if amp is None:
        return []
    out: list[str] = []
    by_step = {s.step: s for s in amp.steps}
    if amp.scaler and amp.steps:
        first, last = amp.steps[0], amp.steps[-1]
        out.append(f"Loss scale {first.scale:g} before step {first.step}, {last.next_scale:g} after step {last.step}: "
                   f"{_control_text(amp)}.")
    if amp.caught:
        parts = [f"step {e.step} ({overflow_text(by_step[e.step].overflow, amp, True)}; {describe(e)})"
                 for e in amp.caught]
        each = "each step was" if len(amp.caught) > 1 else "the step was"
        out.append(f"The scaler caught {count(len(amp.caught), 'overflow')} before optimizer.step() wrote the moments: "
                   f"benign, {each} skipped with the optimizer state intact: {'; '.join(parts)}.")
    e = amp.state_poisoned_by
    if e is not None:
        step = by_step.get(e.step)
        kind = overflow_text(step.overflow if step else None, amp, amp.scaler)
        guard = ("" if amp.scaler else " No GradScaler checked the gradients, so nothing skipped the step before "
                                        "the moments took the non-finite value.")
        out.append(f"The real failure: non-finite values reached the optimizer state at step {e.step} ({describe(e)}), "
                   f"after {kind}.{guard}")
    return out
