"""What-if replays: the responsible step run again with one change, from the same checkpoint, to see
whether the run would have stayed finite for K steps after it.

A change acts around the user's own, unchanged step function: through optimizer step hooks (clip,
skip, reset-state, lr) or by handing the step another batch (drop-samples, drop-batch). Each what-if
starts from model, optimizer, scaler, scheduler and RNG rebuilt afresh from the checkpoint files, so it
shares nothing mutable with the replay or with the other what-ifs. Repair applies the same changes.
"""

from __future__ import annotations

import copy
import math
from typing import Any, Collection, Sequence

import torch

from .. import finite
from ..checkpoints.soundness import per_element, unsound_coordinates
from ..distributed.sessions import open_session
from ..errors import BadInput
from ..progress import SILENT, Progress
from ..report import Event, WhatIfResult
from ..rootcause.findings import describe
from ..rootcause.samples import batch_size, named_whole, select
from ..runs.checkpoint import optimizer_params
from ..runs.optimizers import OptimizerSet
from ..runs.source import StartPoint, StepCode, StepSource
from ..words import count, numbered, span
from .monitor import StepMonitor
from .session import Session

USAGE = "clip=MAX_NORM, skip, skip-after-moments, reset-state, lr=VALUE, drop-samples=I,J or drop-batch"


class Intervention:
    """A change to one step. ``batch`` may replace its batch (None: the step does not run); ``before`` and
    ``after`` bracket ``optimizer.step()`` as hooks; ``detail`` says what the change met."""

    acts_on_optimizer = True

    def __init__(self, spec: str, description: str) -> None:
        self.spec, self.description = spec, description
        self.detail: str | None = None

    def batch(self, batch: Any, whole: Collection[str] = ()) -> Any | None:
        """``whole``: the leaves the step function names per-batch (``samples.named_whole``)."""
        return batch

    def at_start(self, optimizer: torch.optim.Optimizer) -> str | None:
        """Acts on the state loaded from the checkpoint, before the first replayed step; says what it did."""
        return None

    def before(self, optimizer: torch.optim.Optimizer) -> None:
        pass

    def after(self, optimizer: torch.optim.Optimizer) -> None:
        pass


class Clip(Intervention):
    def __init__(self, spec: str, max_norm: float) -> None:
        super().__init__(spec, f"gradients clipped to total norm {max_norm:g} (clip_grad_norm_) before "
                               "optimizer.step()")
        self.max_norm = max_norm

    def before(self, optimizer: torch.optim.Optimizer) -> None:
        params = [p for p in optimizer_params(optimizer) if p.grad is not None]
        # clip_grad_norm_'s arithmetic, its norm over what each gradient holds (a sparse one's stored values); written
        # out because torch names its two halves (get_total_norm, clip_grads_with_norm_) only from 2.6 on
        norms = [torch.linalg.vector_norm(finite.stored(p.grad).values, 2.0) for p in params]
        total_norm = torch.linalg.vector_norm(torch.stack(norms), 2.0) if norms else torch.tensor(0.0)
        coefficient = torch.clamp(self.max_norm / (total_norm + 1e-6), max=1.0)
        for p in params:
            p.grad.mul_(coefficient.to(p.grad.device, p.grad.dtype))
        norm = float(total_norm)
        grads = [p.grad for p in params]
        factor = f"the clip factor {self.max_norm:g}/{finite.value_name(norm)}"
        if math.isnan(norm):  # max_norm/NaN is NaN: every gradient times it is NaN
            total = sum(finite.count_nonfinite(g) for g in grads)
            self.detail = (f"total gradient norm nan: {factor} is NaN, so clipping made all "
                           f"{count(total, 'gradient value')} NaN")
        elif math.isinf(norm):  # max_norm/inf is 0: finite gradients are zeroed, an infinite one becomes 0*inf = NaN
            made_nan = sum(finite.count_nonfinite(g) for g in grads)
            zeroed = sum(g.numel() for g in grads) - made_nan
            if made_nan:
                self.detail = (f"total gradient norm inf: {factor} is 0, and 0*inf = NaN, so clipping made "
                               f"{count(made_nan, 'infinite gradient value')} NaN and zeroed the other {zeroed:,}")
            else:
                self.detail = (f"total gradient norm inf from finite gradients (their squares overflow): {factor} is 0, "
                               f"so clipping zeroed all {count(zeroed, 'gradient value')}")
        elif norm > self.max_norm:
            self.detail = f"total gradient norm {norm:.4g}, scaled down to {self.max_norm:g}"
        else:
            self.detail = f"total gradient norm {norm:.4g}, within {self.max_norm:g}: nothing clipped"


class LearningRate(Intervention):
    def __init__(self, spec: str, lr: float) -> None:
        super().__init__(spec, f"learning rate {lr:g} for this step")
        self.lr = lr
        self._saved: list[Any] = []

    def before(self, optimizer: torch.optim.Optimizer) -> None:
        self._saved = [g["lr"] for g in optimizer.param_groups]
        for g in optimizer.param_groups:
            g["lr"] = torch.full_like(g["lr"], self.lr) if isinstance(g["lr"], torch.Tensor) else self.lr

    def after(self, optimizer: torch.optim.Optimizer) -> None:
        for g, lr in zip(optimizer.param_groups, self._saved):  # a scheduler after the step sees what it set
            g["lr"] = lr


class Undo(Intervention):
    """optimizer.step() undone: the parameters put back and, for ``skip``, the optimizer state too."""

    def __init__(self, spec: str, restore_state: bool) -> None:
        super().__init__(spec, "optimizer.step() skipped before the moments were written: parameters and optimizer "
                               "state restored (what GradScaler does)" if restore_state else
                               "the moments written, the parameter update abandoned (what a guard after "
                               "optimizer.step() does)")
        self.restore_state = restore_state
        self._params: list[torch.Tensor] = []
        self._state: dict[torch.Tensor, dict[str, Any]] = {}

    def before(self, optimizer: torch.optim.Optimizer) -> None:
        self._params = [p.detach().clone() for p in optimizer_params(optimizer)]
        if self.restore_state:
            self._state = {p: copy.deepcopy(optimizer.state.get(p, {})) for p in optimizer_params(optimizer)}

    def after(self, optimizer: torch.optim.Optimizer) -> None:
        with torch.no_grad():
            for p, saved in zip(optimizer_params(optimizer), self._params):
                p.copy_(saved)
        for p, state in self._state.items():
            optimizer.state[p] = state


class ResetState(Intervention):
    def __init__(self, spec: str = "reset-state") -> None:
        super().__init__(spec, "after optimizer.step(), every state tensor zeroed at the coordinates where one is "
                               "non-finite, and non-finite parameter values put back as they were before the step; "
                               "at the resume, the state zeroed where the checkpoint's is unsound (checkpoints.soundness)")
        self._params: list[torch.Tensor] = []

    def at_start(self, optimizer: torch.optim.Optimizer) -> str | None:
        """The coordinates whose loaded state breaks an elementwise soundness check (all of a parameter's, when its
        step counter was reset beside its moments) zeroed, every per-element state tensor of them together."""
        flagged = unsound_coordinates(optimizer)
        if not flagged:
            return None
        with torch.no_grad():
            for p, mask in flagged.items():
                for k, v in optimizer.state[p].items():
                    if isinstance(v, torch.Tensor) and per_element(k, v) and v.shape == p.shape:
                        v.masked_fill_(mask, 0)
        zeroed = sum(int(m.sum()) for m in flagged.values())
        return f"at the resume, zeroed the unsound optimizer state of {count(zeroed, 'coordinate')}"

    def before(self, optimizer: torch.optim.Optimizer) -> None:
        self._params = [p.detach().clone() for p in optimizer_params(optimizer)]

    def after(self, optimizer: torch.optim.Optimizer) -> None:
        zeroed = restored = 0
        with torch.no_grad():
            for p, saved in zip(optimizer_params(optimizer), self._params):
                # A coordinate's state is all its per-element tensors together (Adam's exp_avg and exp_avg_sq):
                # a finite exp_avg left over a reset exp_avg_sq would make the next update huge.
                coords = [v for v in optimizer.state.get(p, {}).values() if finite.checkable(v) and v.shape == p.shape]
                bad_flags = [not ok for ok in finite.all_finite_flags(coords)]
                if any(bad_flags):
                    bad = torch.stack([~torch.isfinite(v) for v, b in zip(coords, bad_flags) if b]).any(dim=0)
                    zeroed += int(bad.sum())
                    for v in coords:
                        v.masked_fill_(bad, 0)
                if not finite.is_finite(p):
                    bad = ~torch.isfinite(p)
                    restored += int(bad.sum())
                    p[bad] = saved[bad]
        self.detail = (f"zeroed the optimizer state of {count(zeroed, 'coordinate')}, put back "
                       f"{count(restored, 'parameter value')}")


class DropSamples(Intervention):
    acts_on_optimizer = False

    def __init__(self, spec: str, samples: Sequence[int]) -> None:
        super().__init__(spec, f"{numbered('sample', sorted(set(samples)))} left out of the batch")
        self.samples = sorted(set(samples))

    def batch(self, batch: Any, whole: Collection[str] = ()) -> Any | None:
        size = batch_size(batch, whole)
        if size is None:
            raise BadInput("--what-if", f"{self.spec}: the batch's tensors share no first dimension to drop along")
        outside = [i for i in self.samples if i >= size]
        if outside:
            raise BadInput("--what-if", f"{self.spec}: sample {outside[0]} is outside the batch of {size}")
        keep = [i for i in range(size) if i not in self.samples]
        return select(batch, keep, size, whole) if keep else None


class DropBatch(Intervention):
    acts_on_optimizer = False

    def __init__(self, spec: str = "drop-batch") -> None:
        super().__init__(spec, "the batch left out: the step function not called for it")

    def batch(self, batch: Any, whole: Collection[str] = ()) -> Any | None:
        return None


def _number(spec: str, text: str, positive: bool) -> float:
    try:
        value = float(text)
    except ValueError:
        raise BadInput("--what-if", f"{spec!r}: {text!r} is not a number") from None
    if not math.isfinite(value) or value < 0 or (positive and value == 0):
        raise BadInput("--what-if", f"{spec!r}: needs a finite {'positive' if positive else 'non-negative'} number")
    return value


def _indices(spec: str, text: str) -> list[int]:
    try:
        indices = [int(i) for i in text.split(",")]
    except ValueError:
        raise BadInput("--what-if", f"{spec!r}: samples are positions in the batch, as I,J,...") from None
    if any(i < 0 for i in indices):
        raise BadInput("--what-if", f"{spec!r}: sample positions start at 0")
    return indices


def parse(spec: str) -> Intervention:
    """``clip=1.0``, ``skip``, ... as an Intervention; anything else is a one-line BadInput."""
    name, has_value, text = spec.strip().partition("=")
    if name in ("skip", "skip-after-moments", "reset-state", "drop-batch") and not has_value:
        return {"skip": lambda: Undo(spec, restore_state=True),
                "skip-after-moments": lambda: Undo(spec, restore_state=False),
                "reset-state": lambda: ResetState(spec), "drop-batch": lambda: DropBatch(spec)}[name]()
    if name == "clip" and has_value:
        return Clip(spec, _number(spec, text, positive=True))
    if name == "lr" and has_value:
        return LearningRate(spec, _number(spec, text, positive=False))
    if name == "drop-samples" and has_value:
        return DropSamples(spec, _indices(spec, text))
    raise BadInput("--what-if", f"cannot read {spec!r}; use {USAGE}")


def _changed_step(session: Session, change: Intervention, monitor: StepMonitor) -> tuple[float | None, list[Event]]:
    """Run the session's next step with ``change``; no loss and no events when it drops the step."""
    batch = change.batch(session.batch(session.step), named_whole(session.code.step_fn))
    if batch is None:
        session.step += 1  # the batch is left out: this step does not happen
        return None, []
    fired: list[bool] = []

    def before(optimizer: torch.optim.Optimizer, *_: Any) -> None:  # a pre-hook's return value would replace args
        fired.append(True)
        change.before(optimizer)

    done: list[tuple[torch.optim.Optimizer, str | None]] = []  # each optimizer stepped, and what the change did there

    def after(optimizer: torch.optim.Optimizer, *_: Any) -> None:
        change.after(optimizer)
        done.append((optimizer, change.detail))

    handles = [session.optimizer.register_step_pre_hook(before), session.optimizer.register_step_post_hook(after)]
    try:
        result = session.run_step(monitor, batch=batch)
    finally:
        for h in handles:
            h.remove()
    if isinstance(session.optimizer, OptimizerSet):  # the change acted at each one's step(): say what, at which
        change.detail = session.optimizer.accounts(done)
    if change.acts_on_optimizer and not fired:
        change.detail = "optimizer.step() did not run at this step (the scaler skipped it): nothing to change"
    return result


def nonfinite_in(session: Session, loss: float | None) -> str | None:
    """The first non-finite thing after a step, by name: optimizer state, then parameters, then the loss."""
    names = {p: n for n, p in reversed(list(session.model.named_parameters(remove_duplicate=False)))}
    params = optimizer_params(session.optimizer)
    named = [(f"{key} of {names.get(p, 'param')}", v) for p in params
             for key, v in session.optimizer.state.get(p, {}).items() if finite.checkable(v)]
    named += [(f"param {names.get(p, 'param')}", p) for p in params]
    for (what, _), ok in zip(named, finite.all_finite_flags([t for _, t in named])):
        if not ok:
            return what
    return "loss" if loss is not None and not math.isfinite(loss) else None


def replay_with(session: Session, change: Intervention | None, last: int) -> WhatIfResult:
    """From the session's next step (the one to change) through ``last``: the change, then the logged steps,
    each checked for non-finite loss, parameters and optimizer state. The first step that leaves one is named
    by this replay's origin: the first stage of that step with a non-finite value, as the replay names it."""
    change = copy.copy(change)  # its notes are this replay's own
    step = session.step
    losses: list[float | None] = []
    first_step = first_what = nan_loss = None
    with StepMonitor(session.model, session.optimizer) as monitor:
        for s in range(step, last + 1):
            loss, events = (_changed_step(session, change, monitor) if s == step and change is not None
                            else session.run_step(monitor))
            losses.append(loss)
            what = nonfinite_in(session, loss)
            if what is not None and first_step is None:
                first_step, first_what = s, describe(events[0]) if events else what
            if loss is not None and not math.isfinite(loss) and nan_loss is None:
                nan_loss = s
    return WhatIfResult(change.spec if change else "none",
                        change.description if change else "the replay as recorded", step, last, first_step is None,
                        first_step, first_what, nan_loss, losses, change.detail if change else None)


def what_if_replays(run: StepSource, code: StepCode, checkpoint: StartPoint, device: torch.device, step: int,
                    changes: Sequence[Intervention], steps_after: int, rank: int | None = None,
                    progress: Progress = SILENT) -> list[WhatIfResult]:
    """The replay as recorded, then one replay per change, each from the model rebuilt afresh at ``checkpoint``; in a
    distributed run a change to the batch changes ``rank``'s shard (none on a rank that leaves them to another)."""
    last = step + steps_after if run.last_step is None else min(step + steps_after, run.last_step)
    results = []
    with open_session(run, code, checkpoint, device).focused(rank) as session:
        if session is None:
            return []
        for i, change in enumerate([None, *changes]):
            progress.phase(f"what-if {i + 1} of {len(changes) + 1}: {change.spec if change else 'as recorded'}, "
                           f"{span(checkpoint.step, last)}", None)
            if i:
                session.reset()  # each from the checkpoint files again: nothing mutable shared with the one before
            started = change.at_start(session.optimizer) if change is not None else None
            session.advance_to(step)
            result = replay_with(session, change, last)
            if started:
                result.detail = started + (f"; {result.detail}" if result.detail else "")
            results.append(result)
    return results


def findings(results: list[WhatIfResult], requested: bool) -> list[str]:
    if not results:
        return ["What-if replays not run: the replay found no responsible step to change."] if requested else []
    r0 = results[0]
    survived = [r.intervention for r in results[1:] if r.finite]
    failed = [f"{r.intervention} (step {r.first_nonfinite_step}: {r.first_nonfinite})" for r in results[1:]
              if not r.finite]
    outcomes = ([f"the run stays finite with {', '.join(survived)}"] if survived else []) + (
        [f"it still goes non-finite with {', '.join(failed)}"] if failed else [])
    return [f"What-if at step {r0.step}, checked through step {r0.last_step}: {'; '.join(outcomes)}."]
