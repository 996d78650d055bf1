"""What the Lightning and Hugging Face callbacks share: the recorder under someone else's loop, the
learning rate and clipping the loop applied recorded with each batch (so replay repeats a scheduler
without rebuilding it), and the post-mortem when the loss goes non-finite."""

from __future__ import annotations

import logging
import math
from pathlib import Path
from typing import Any, Callable

import torch

from ..outputs import check_outputs, write_output
from ..postmortem import PostmortemReport, postmortem
from ..report import to_json
from ..runs.checkpoint import optimizer_params
from ..runs.guard import GuardPolicy, GuardStop
from ..runs.recorder import Recorder
from ..views.escaping import visible

log = logging.getLogger("nanforensics")


def lrs(optimizer: torch.optim.Optimizer) -> list[float | None]:
    """Each group's learning rate now: what the step about to run uses, whatever scheduler set it; None where the
    optimizer computes its own (transformers' Adafactor with ``relative_step=True``), and replayed as None."""
    return [None if g["lr"] is None else float(g["lr"]) for g in optimizer.param_groups]


def set_lrs(optimizer: torch.optim.Optimizer, values: list[float | None]) -> None:
    for group, lr in zip(optimizer.param_groups, values):
        group["lr"] = lr


def clip(optimizer: torch.optim.Optimizer, value: float | None, algorithm: str = "norm") -> None:
    """The clipping the loop applied, over the optimizer's parameters as the frameworks do."""
    if not value:
        return
    params = optimizer_params(optimizer)
    if algorithm == "value":
        torch.nn.utils.clip_grad_value_(params, value)
    else:
        torch.nn.utils.clip_grad_norm_(params, value)


def loss_of(output: Any) -> torch.Tensor | None:
    """The loss in what a training step or a model returned: a tensor, ``{"loss": ...}``, ``.loss`` or ``[0]``."""
    if isinstance(output, torch.Tensor):
        return output
    if isinstance(output, dict):
        return output.get("loss")
    if getattr(output, "loss", None) is not None:
        return output.loss
    if isinstance(output, (tuple, list)) and output and isinstance(output[0], torch.Tensor):
        return output[0]
    return None


def unwrapped(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """The torch optimizer under wrappers such as accelerate's, which replay could not rebuild."""
    while isinstance(getattr(optimizer, "optimizer", None), torch.optim.Optimizer):
        optimizer = optimizer.optimizer
    return optimizer


ON_NAN = ("fail", "stop", "continue")


class NonFiniteLoss(RuntimeError):
    """Raised by the callbacks at the first non-finite loss, after the post-mortem's reports are written, so that
    the job fails as CI sees it (a workflow's ``if: failure()`` steps run). ``report`` is the post-mortem (None
    with ``postmortem_on_nan=False``), ``report_dir`` where its reports are. ``on_nan="stop"`` ends training
    without it."""

    def __init__(self, message: str, report: PostmortemReport | None, report_dir: Path) -> None:
        super().__init__(message)
        self.report, self.report_dir = report, report_dir


def micro_batch_total(losses: list[torch.Tensor]) -> torch.Tensor:
    """The optimizer step's loss: its micro-batches' losses, each as the loop scaled it, added in order (the
    step functions add them the same way, so replayed losses equal logged ones bit for bit)."""
    total = losses[0].detach()
    for loss in losses[1:]:
        total = total + loss.detach()
    return total


class Watcher:
    """The part of both callbacks that is not the framework's: records optimizer steps into ``run_dir`` and, at
    the first non-finite loss, runs the post-mortem and writes its reports.

    ``step_fn`` defaults to the framework's own step (``default_step_fn`` of the callback class). Reports go to
    ``report_dir`` (default ``<run_dir>.postmortem``, beside the run: nothing is written into the run
    directory the post-mortem examines); ``report`` holds the post-mortem once one ran. ``on_nan`` says what
    follows: ``"fail"`` raises ``NonFiniteLoss`` (the job fails), ``"stop"`` ends training quietly,
    ``"continue"`` keeps training. ``on_loss_only`` (default ``"continue"``) takes its place when the post-mortem's
    verdict is ``loss_only``: the loss was non-finite but no gradient, parameter, optimizer-state or buffer value
    was (a batch with no valid target), so the model is intact and training can go on.

    ``guard`` and ``batches`` are the recorder's (``Recorder(guard=True, batches="memory")``): a step with a
    non-finite gradient is skipped and leaves an incident under ``run_dir/incidents``, training goes on, and a
    non-finite loss is the guard's to judge. When the guard stops the run, the post-mortem examines its incident,
    and ``on_nan`` says what follows (``"continue"`` ends training too: the recorder has stopped).
    """

    default_step_fn: Callable[..., Any]

    def __init__(self, run_dir: str | Path, *, model_factory: Callable[..., torch.nn.Module] | None = None,
                 model_kwargs: dict[str, Any] | None = None, step_fn: Callable[..., Any] | None = None,
                 checkpoint_every: int = 50, keep_checkpoints: int | None = None, postmortem_on_nan: bool = True,
                 on_nan: str = "fail", on_loss_only: str = "continue", report_dir: str | Path | None = None,
                 overwrite: bool = False, guard: bool | GuardPolicy = False, batches: str | None = None) -> None:
        for name, value in (("on_nan", on_nan), ("on_loss_only", on_loss_only)):
            if value not in ON_NAN:
                raise ValueError(f"{name} must be one of {', '.join(map(repr, ON_NAN))}, not {value!r}")
        self.run_dir = Path(run_dir)
        self.report_dir = Path(report_dir) if report_dir is not None else self.run_dir.with_name(
            self.run_dir.name + ".postmortem")
        check_outputs([self.run_dir], {"report_dir": self.report_dir / "postmortem.json"}, create_dirs=True)  # never into the run
        self.model_factory, self.model_kwargs = model_factory, model_kwargs
        self.step_fn = step_fn or type(self).default_step_fn
        self.checkpoint_every, self.keep_checkpoints, self.overwrite = checkpoint_every, keep_checkpoints, overwrite
        self.postmortem_on_nan, self.on_nan, self.on_loss_only = postmortem_on_nan, on_nan, on_loss_only
        self.guard, self.batches = guard, batches
        self.recorder: Recorder | None = None
        self.report: PostmortemReport | None = None
        self.steps_recorded = 0
        self._diagnosed = False  # a non-finite loss was met and acted on: later ones are only recorded

    def start_recording(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                        model_factory: Callable[..., torch.nn.Module], model_kwargs: dict[str, Any] | None) -> None:
        self.recorder = Recorder(self.run_dir, model, unwrapped(optimizer), model_factory=model_factory,
                                 model_kwargs=model_kwargs, step_fn=self.step_fn,
                                 checkpoint_every=self.checkpoint_every, keep_checkpoints=self.keep_checkpoints,
                                 overwrite=self.overwrite, guard=self.guard, batches=self.batches)

    def record_step(self, batch: Any, loss: torch.Tensor | float) -> bool:
        """Record one optimizer step; True when its loss is non-finite and the loop should stop. With
        ``on_nan="fail"`` it raises ``NonFiniteLoss`` instead, once the reports are written."""
        if self.recorder is None:
            return False
        try:
            self.recorder.log(self.steps_recorded, batch, loss)
        except GuardStop as stop:
            return self._guard_stopped(stop)
        self.steps_recorded += 1
        if self.recorder.guard is not None:
            return False  # a skipped step's loss is its incident's; the guard watches the state
        value = float(loss.detach().float()) if isinstance(loss, torch.Tensor) else float(loss)
        if math.isfinite(value) or self._diagnosed:
            return False
        step = self.steps_recorded - 1
        log.warning("nanforensics: the loss is %s at step %d", value, step)
        if self.postmortem_on_nan:
            self.run_postmortem()
        loss_only = self.report is not None and self.report.verdict == "loss_only"
        action = self.on_loss_only if loss_only else self.on_nan
        if loss_only and action == "continue":  # the model never saw it: a later NaN loss is examined afresh
            log.warning("nanforensics: the loss of step %d is %s, but no gradient, parameter, optimizer-state or "
                        "buffer value is: training goes on (on_loss_only=%r)", step, value, action)
            return False
        self._diagnosed = True
        if action == "fail":
            self.close_recording()
            found = visible(f"{self.report.headline} (reports in {self.report_dir})") if self.report else \
                "no post-mortem run"
            raise NonFiniteLoss(f"the loss is {value} at step {step}: {found}", self.report, self.report_dir)
        return action == "stop"

    def _guard_stopped(self, stop: GuardStop) -> bool:
        """The guard stopped the run (its policy, or a state the update made non-finite): the post-mortem of its
        incident, then ``on_nan``."""
        self._diagnosed = True
        log.warning("%s", stop)
        if self.postmortem_on_nan and stop.incident is not None:
            self.run_postmortem(stop.incident)
        if self.on_nan == "fail":
            found = f"{self.report.headline} (reports in {self.report_dir})" if self.report else "no post-mortem run"
            raise NonFiniteLoss(f"{stop}: {found}", self.report, self.report_dir) from stop
        return True

    def close_recording(self) -> None:
        if self.recorder is not None:
            self.recorder.close()

    def run_postmortem(self, directory: Path | None = None) -> PostmortemReport:
        """Examine the recording so far (it goes on), or a guard's incident; the reports land in ``report_dir``."""
        from ..views.html import render_html
        from ..views.markdown import render_postmortem

        if self.recorder is not None:
            self.recorder.flush()
        self.report = postmortem(directory or self.run_dir)
        for name, text in (("postmortem.json", to_json(self.report)), ("postmortem.md", render_postmortem(self.report)),
                           ("postmortem.html", render_html(self.report))):
            write_output(self.report_dir / name, text, "report_dir", create_dirs=True)  # its own folder, made here
        log.warning("nanforensics post-mortem: %s", visible(f"{self.report.headline} (reports in {self.report_dir})"))
        return self.report
