"""A run's model and optimizer rebuilt at a checkpoint, stepping through its batches with the user's own step
function. Replay, what-if replays and root-cause passes all drive one of these, for a recorded run or not."""

from __future__ import annotations

import copy
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator

import torch

from ..errors import BadInput
from ..report import Event
from ..runs.batches import map_tensors
from ..runs.checkpoint import restore_rng, rng_state
from ..runs.optimizers import as_given, loose_params, members_of
from ..runs.source import StartPoint, StepCode, StepSource
from .monitor import StepMonitor

if TYPE_CHECKING:
    from ..runs.run import Rebuilt


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name not in ("cpu", "cuda") and not name.startswith("cuda:"):
        raise BadInput("--device", f"unknown device {name!r}; use auto, cpu or cuda")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise BadInput("--device", "cuda was asked for but this torch sees no CUDA device")
    return torch.device(name)


@contextmanager
def pinned_threads(n: int | None) -> Iterator[int]:
    """Pin the recording's thread count: CPU reductions split work by thread count, and so round by it."""
    before = torch.get_num_threads()
    if n:
        torch.set_num_threads(int(n))
    try:
        yield torch.get_num_threads()
    finally:
        torch.set_num_threads(before)


def loss_value(loss: Any, where: Path) -> float:
    if isinstance(loss, torch.Tensor) and loss.numel() == 1:
        return float(loss.detach().float().item())
    if isinstance(loss, (int, float)):
        return float(loss)
    raise BadInput(where, f"the step function returned {type(loss).__name__}, not a scalar loss")


@contextmanager
def no_optimizer_step(optimizer: torch.optim.Optimizer) -> Iterator[None]:
    """An instance attribute shadows the method: the user's step runs, the optimizer does nothing (each of several,
    whose own ``step()`` the step function calls).

    An LR scheduler may already have put its own wrapper there; it is put back as it was.
    """
    members = members_of(optimizer)
    own = [vars(o).get("step") for o in members]
    for o in members:
        o.step = lambda *args, **kwargs: None  # type: ignore[method-assign]
    try:
        yield
    finally:
        for o, step in zip(members, own):
            if step is None:
                del o.step
            else:
                o.step = step  # type: ignore[method-assign]


class Session:
    """Rebuilds the model at a checkpoint and runs the user's steps from there, monitored or plain.

    ``model`` is the model as the run defined it (the hooks' target); ``stepped`` is what the step function is given,
    the same model here, a data-parallel wrapper in a distributed session.
    """

    def __init__(self, run: StepSource, code: StepCode, checkpoint: StartPoint, device: torch.device) -> None:
        self.run, self.code, self.checkpoint, self.device = run, code, checkpoint, device
        self.reset()

    def reset(self) -> None:
        """Back to the checkpoint: fresh model, optimizer, scaler and scheduler, its RNG states restored."""
        self.model, self.optimizer, self.scaler, self.scheduler, self.meta = self.rebuild()
        self.stepped: torch.nn.Module = self.model
        restore_rng(self.meta["rng"], self.checkpoint.path / "meta.json")
        self.step = self.checkpoint.step

    def rebuild(self) -> Rebuilt:
        """The run's objects at the checkpoint (a rank of a replay at world size shards the model on the way)."""
        return self.code.build(self.run, self.checkpoint, self.device)

    def logged_batch(self, step: int) -> Any:
        """The batch as logged (for a distributed run, the shard of the rank in focus)."""
        return self.run.batch(step)

    def batch(self, step: int) -> Any:
        return map_tensors(self.logged_batch(step), lambda t: t.to(self.device))

    @contextmanager
    def focused(self, rank: int | None) -> Iterator["Session | None"]:
        """The session to explain a step in, looking at ``rank``'s shard (distributed runs); None on a rank that
        leaves the explaining to another."""
        yield self

    def traced_pass(self, origin: Event) -> Any:
        """The pass the operation trace follows ``origin`` through: the user's step on this step's batch (in a
        distributed run, the shard of the rank in focus, or every rank's when the origin arose after the collective).
        Returns the loss."""
        return self.call_step(self.batch(self.step))

    def call_step(self, batch: Any) -> Any:
        """The user's step function on one batch, given the scaler and scheduler as keyword arguments where the
        run recorded them; what it raises becomes a one-line error."""
        extras = {k: as_given(v) for k, v in (("scaler", self.scaler), ("scheduler", self.scheduler)) if v is not None}
        try:
            return self.code.step_fn(self.stepped, as_given(self.optimizer), batch, **extras)
        except BadInput:
            raise
        except Exception as e:
            raise BadInput(self.run.code_file, f"step function {self.code.step_name} raised "
                                               f"{e.__class__.__name__} at step {self.step}: {e}") from None

    def run_step(self, monitor: StepMonitor | None = None, locate: bool = False,
                 batch: Any = None) -> tuple[float, list[Event]]:
        """Run the next step (on ``batch`` instead of the run's own where given: a what-if drops samples);
        returns its loss and, with a monitor, its events."""
        batch = self.batch(self.step) if batch is None else batch
        if monitor:
            monitor.begin(self.step, batch, locate)
        loss = self.call_step(batch)
        value = loss_value(loss, self.run.code_file)
        events = monitor.end(loss) if monitor else []
        self.step += 1
        return value, events

    def snapshot(self) -> dict[str, Any]:
        """The state before the next step, in memory: restoring it is cheaper than replaying from the checkpoint."""
        return {"model": {k: v.detach().clone() for k, v in self.model.state_dict().items()},
                "grads": loose_grads(self.model, self.optimizer),
                "optimizer": _copied(self.optimizer.state_dict()),
                "rng": rng_state(), "step": self.step, "scaler": self.scaler.state_dict() if self.scaler is not None else None,
                "scheduler": copy.deepcopy(self.scheduler.state_dict()) if self.scheduler is not None else None}

    def restore(self, snapshot: dict[str, Any]) -> None:
        self.model.load_state_dict(snapshot["model"])
        # load_state_dict keeps the tensors it is given: a copy, as the snapshot may be restored again
        self.optimizer.load_state_dict(_copied(snapshot["optimizer"]))
        self.optimizer.zero_grad(set_to_none=True)
        put_back(snapshot["grads"])
        restore_rng(snapshot["rng"])
        self.step = snapshot["step"]
        if self.scaler is not None:
            self.scaler.load_state_dict(snapshot["scaler"])
        if self.scheduler is not None:
            self.scheduler.load_state_dict(copy.deepcopy(snapshot["scheduler"]))

    def advance_to(self, step: int) -> None:
        """Plain steps up to (not including) ``step``."""
        while self.step < step:
            self.run_step()


def loose_grads(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[torch.Tensor, torch.Tensor | None]:
    """The gradients of the parameters the optimizer does not hold (Muon's biases, a frozen layer's that still
    requires grad), copied: nothing zeroes them, so they carry over between steps, and a re-run of a step must start
    from them as they were, not from what the pass before left (a NaN it made would fail every later pass). Every
    snapshot of a replay's state takes them (this session's, a pipeline stage's), and ``put_back`` restores them."""
    return {p: None if p.grad is None else p.grad.detach().clone() for _, p in loose_params(model, optimizer)}


def put_back(grads: dict[torch.Tensor, torch.Tensor | None]) -> None:
    """The gradients ``loose_grads`` took, each as it was (a copy: the snapshot may be restored again)."""
    for p, grad in grads.items():
        p.grad = None if grad is None else grad.clone()


def _copied(state_dict: dict[str, Any]) -> dict[str, Any]:
    """A deep copy of an optimizer state dict whose state tensors are cloned rather than deep-copied: sample
    attribution restores it before every pass, and ``Tensor.__deepcopy__`` costs many times a clone per tensor."""
    clones = {id(t): t.clone() for s in state_dict["state"].values() for t in s.values() if isinstance(t, torch.Tensor)}
    return copy.deepcopy(state_dict, clones)
