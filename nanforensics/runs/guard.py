"""The guard of ``Recorder(guard=True)``: a step is skipped before the optimizer writes anything when its gradients are
non-finite, when its loss is (``skip_nonfinite_loss``), or when the update would make a non-finite state or parameter
value from finite ones (the replay's proof, ``replay.proof.UpdateCheck``: one proof, two users); each skip (or stop)
leaves an incident directory that replays like a fully recorded run, naming which of the three fired.

Why before the step: once Adam's moments hold a non-finite value the state is absorbing (README), so a skip helps
only before ``optimizer.step()`` writes them. The user's step function calls ``optimizer.step()`` itself, so the guard
wraps that method on the optimizer instance (a step pre-hook cannot cancel a step): the gradients are checked as the
step would see them, after the user's clipping or unscaling, and the original step runs only when all are finite.
An optimizer that takes a ``found_inf`` tensor (fused Adam and AdamW, GradScaler's contract) is handed the verdict
on the device and skips there, bit for bit as under a GradScaler, with no host synchronisation; any other is called
or not on the host's reading of it, the step's one synchronisation.

What a skip cannot undo: a non-finite value written after the step (code after it, a bit flip), or by an update the
proof does not cover (another optimizer: the gradients and the loss alone decide, said once in the log). Parameters
and optimizer state are checked every ``state_check_every`` steps and before every checkpoint; a non-finite one stops
the run (``GuardStop``) with an incident, or, with ``rollback=True``, restores an in-memory copy of the state at the
newest checkpoint.
"""

from __future__ import annotations

import json
import logging
import math
import os
import shutil
import types
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from ..distributed.tensors import is_dtensor
from ..distributed.world import object_group
from ..finite import is_finite, locate, stored, value_name
from ..replay.proof import Hazard, UpdateCheck, max_abs, provable
from .batches import data_leaves, encoded, leaves
from .checkpoint import checkpoint_name, optimizer_params, param_names
from .files import json_bytes, make_build_dir, publish_dir_atomic, write_bytes_atomic, write_json_atomic
from .layout import rank_dir
from .run import MANIFEST, STEPS, batch_path

if TYPE_CHECKING:
    from .recorder import Recorder

log = logging.getLogger("nanforensics")

INCIDENTS = "incidents"        # run_dir/incidents/step_%08d/: one replayable run directory per skip or stop
GUARD_LOG = "guard.jsonl"      # run_dir/incidents/guard.jsonl: every skip, stop and rollback, and the summary
INCIDENT_FILE = "incident.json"
INCIDENT_FORMAT = "nanforensics.incident/1"


class GuardStop(RuntimeError):
    """Raised by ``Recorder.log`` when the guard stops the run: the policy's limit on skips was reached, or the update
    made a parameter or optimizer-state value non-finite. ``incident`` is the directory to replay."""

    def __init__(self, message: str, incident: Path | None) -> None:
        super().__init__(message)
        self.incident = incident


@dataclass(frozen=True)
class GuardPolicy:
    """When the guard stops a run, and how closely it watches the state.

    ``max_consecutive``: stop after this many skipped steps in a row. ``max_skip_fraction``: stop when more than this
    fraction of the steps so far were skipped, judged from step ``fraction_after`` on (a single early skip is not a
    trend). ``state_check_every``: check every parameter and optimizer-state tensor after every N-th step (and always
    before a checkpoint is written). ``ring_bytes``: the most batch bytes kept in memory; a checkpoint comes early
    when the ring would hold more (its size in steps is ``checkpoint_every``). ``rollback``: keep a copy of the
    parameters, buffers and optimizer state of the newest checkpoint on their device (their size again in memory),
    restored when the update made a value non-finite, instead of stopping. ``skip_nonfinite_loss``: skip a step whose
    loss (each scalar ``backward()`` was called on since the last step) is non-finite, its gradients finite or not.
    """

    max_consecutive: int = 5
    max_skip_fraction: float = 0.01
    fraction_after: int = 100
    state_check_every: int = 10
    ring_bytes: int | None = None
    rollback: bool = False
    skip_nonfinite_loss: bool = True

    def __post_init__(self) -> None:
        if self.max_consecutive < 1 or self.state_check_every < 1 or self.fraction_after < 1:
            raise ValueError("max_consecutive, state_check_every and fraction_after must be at least 1")
        if not 0.0 <= self.max_skip_fraction <= 1.0:
            raise ValueError("max_skip_fraction must be between 0 and 1")
        if self.ring_bytes is not None and self.ring_bytes < 1:
            raise ValueError("ring_bytes must be positive (or None for no byte limit)")


@dataclass
class _Entry:
    """A step kept for an incident: its batch (None when on disk) and its line of steps.jsonl."""

    step: int
    batch: tuple[dict[str, torch.Tensor], dict[str, Any]] | None
    line: str
    nbytes: int


@dataclass
class _Pending:
    """What the guarded ``optimizer.step`` saw in the step being logged."""

    flags: torch.Tensor                 # per rank: 1 where that rank's step would have been skipped
    grads: list[tuple[int, torch.Tensor]] = field(default_factory=list)  # (optimizer index, local gradient)
    skipped: bool | None = None         # read on the host already (None: decided on the device)
    losses: list[torch.Tensor] = field(default_factory=list)  # the scalars backward() ran from, for the loss check
    hazard: Hazard | None = None        # what the update would have made non-finite from finite values


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if is_dtensor(t) else t


def nonfinite_flag(tensors: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    """1.0 on ``device`` when any tensor holds a NaN or an infinity, else 0.0, without a host synchronisation: the
    check GradScaler makes (exact, and x*1 leaves every value as it was), per device and dtype."""
    found = torch.zeros((), dtype=torch.float32, device=device)
    groups: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
    for t in tensors:
        if t.is_floating_point() and t.numel():
            held = t if t.layout == torch.strided else stored(t).values  # a sparse gradient: its coalesced values
            groups.setdefault((held.device, held.dtype), []).append(held)
    for (dev, _), ts in groups.items():
        here = torch.zeros((), dtype=torch.float32, device=dev)
        torch._amp_foreach_non_finite_check_and_unscale_(ts, here, torch.ones((), dtype=torch.float32, device=dev))
        found = found + here.to(device, non_blocking=True)
    return found.clamp(max=1.0)


_watching: list["Guard"] = []  # the guards that want the losses backward() runs from
_unwatched: Any = None  # torch.Tensor.backward as it was before the first of them


def _backward(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
    """``Tensor.backward`` while a guard watches: the root (a scalar loss) is kept, detached, for the step's loss
    check; nothing is read here (the check joins the gradient check's one read)."""
    if self.numel() == 1:
        for guard in _watching:
            guard.losses.append(self.detach())
    return _unwatched(self, *args, **kwargs)


def _watch(guard: "Guard") -> None:
    global _unwatched
    if not _watching:
        _unwatched = torch.Tensor.backward
        torch.Tensor.backward = _backward  # type: ignore[method-assign]
    _watching.append(guard)


def _unwatch(guard: "Guard") -> None:
    if guard in _watching:
        _watching.remove(guard)
        if not _watching:
            torch.Tensor.backward = _unwatched  # type: ignore[method-assign]


def _sum_flag(tensors: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    """Read-only screen of the state after a step: non-finite where any sum is (NaN and infinities propagate); a sum
    that overflowed finite values is settled exactly on the host, only then."""
    sums = [t.detach().sum(dtype=torch.float32).to(device, non_blocking=True) for t in tensors
            if t.is_floating_point() and t.numel()]
    if not sums:
        return torch.zeros((), device=device)
    return (~torch.isfinite(torch.stack(sums))).any().float()


class Guard:
    """The guard of one recorder: the wrapped ``optimizer.step``, the ring of recent batches, the policy and the
    incidents. Every rank of a distributed run holds one and takes the same decisions."""

    def __init__(self, rec: "Recorder", policy: GuardPolicy) -> None:
        self.rec, self.policy = rec, policy
        self.optimizer = rec.optimizer
        self.params = optimizer_params(self.optimizer)
        self.names = param_names(rec.model, self.optimizer)
        self.device = self.params[0].device if self.params else torch.device("cpu")
        world = rec.world
        self.rank, self.size = (world.rank, world.size) if world is not None else (0, 1)
        if self.size > 1 and policy.ring_bytes is not None:  # each rank's batches differ: their rings would disagree
            raise ValueError("ring_bytes bounds one process's ring; under torchrun bound it in steps (checkpoint_every)")
        self.writes = world is None or world.leads
        self.folder = rec.path / INCIDENTS
        self.ring: list[_Entry] = []
        self.pending: _Pending | None = None
        self.steps = 0
        self.skipped: list[int] = []
        self.scaler_skips = 0
        self.rollbacks: list[int] = []
        self.incidents: list[Path] = []
        self.consecutive = 0
        self._seen_samples: dict[str, int] = {}  # a sample id -> the first skipped step that held it
        self._scale: float | None = None
        self._copy: dict[str, Any] | None = None
        self._last: _Pending | None = None
        self._closed = False
        # Fused Adam and AdamW take the verdict on the device. Not fused SGD: on its first step it fills the momentum
        # buffers with torch.empty_like and a found_inf skip leaves them so, uninitialised, for the next step.
        self._takes_found_inf = isinstance(self.optimizer, torch.optim.Adam) and bool(
            getattr(self.optimizer, "_step_supports_amp_scaling", False))
        # The update's proof (replay/proof.py), where the optimizer's rule is known: a step that would make a
        # non-finite value from finite gradients is skipped too. Elsewhere the gradients (and the loss) alone decide.
        self.update_check = UpdateCheck(self.optimizer) if provable(self.optimizer) and not self._takes_found_inf \
            else None
        self.losses: list[torch.Tensor] = []
        if policy.skip_nonfinite_loss:
            _watch(self)
        # Installed as a method of the optimizer, so that wrappers which rebind ``step.__func__`` to the optimizer (an
        # LR scheduler made after the recorder) still call the guard.
        self._had_own_step = "step" in vars(self.optimizer)
        self._original = self.optimizer.step
        guard = self

        def step(optimizer: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> Any:
            return guard._guarded_step(*args, **kwargs)

        if hasattr(self._original, "_wrapped_by_lr_sched"):  # a scheduler's counting wrapper is still called under it
            step._wrapped_by_lr_sched = True  # type: ignore[attr-defined]
        self._installed = types.MethodType(step, self.optimizer)
        self.optimizer.step = self._installed  # type: ignore[method-assign]
        if self.writes:
            self.folder.mkdir(parents=True, exist_ok=True)
        self._note_coverage()

    def _note_coverage(self) -> None:
        """Said once, in the log and ``guard.jsonl``: what the guard can prove of this optimizer's updates."""
        cls = type(self.optimizer).__name__
        uncovered = self.update_check.uncovered() if self.update_check is not None else \
            list(range(len(self.optimizer.param_groups)))
        if not uncovered:
            return
        why = ("its verdict is handed to the fused step on the device" if self._takes_found_inf else
               "the update's proof knows Adam, AdamW and SGD (not a subclass, not sharded) without L2 weight decay, "
               "fused, capturable or differentiable steps")
        self._note({"event": "gradient_check_only", "optimizer": cls, "groups": uncovered, "why": why})
        log.info("nanforensics guard: %s, groups %s: gradients (and the loss) checked alone, not the update: %s", cls,
                 uncovered, why)

    # ---- the step ------------------------------------------------------------------------------------------------

    def _guarded_step(self, *args: Any, **kwargs: Any) -> Any:
        closure = kwargs.pop("closure", None) if "closure" in kwargs else (args[0] if args else None)
        args = (None, *args[1:]) if args and closure is args[0] else args  # it ran here: None in its place, the rest kept
        loss = None
        if closure is not None:  # Lightning's closure runs forward, backward and clipping: the gradients come after it
            with torch.enable_grad():
                loss = closure()
        losses, self.losses = self.losses, []  # the step's own: a GradScaler's step below takes them along
        if getattr(self.optimizer, "found_inf", None) is not None:  # a GradScaler decides this step: its skip is its own
            out = self._original(*args, **kwargs)
            return loss if closure is not None else out
        grads = [(i, _local(p.grad)) for i, p in enumerate(self.params) if p.grad is not None]
        hazard = None
        if self.update_check is None:
            mine = nonfinite_flag([g for _, g in grads] + losses, self.device)
        else:  # one read: each gradient's largest magnitude (non-finite where it holds one) and the losses
            maxima = max_abs([g for _, g in grads] + losses)
            bad = not all(math.isfinite(m) for m in maxima)
            if not bad:
                hazard = self.update_check.hazard({self.params[i]: m for (i, _), m in zip(grads, maxima)})
            mine = torch.tensor(float(bad or hazard is not None), device=self.device)
        flags = torch.zeros(self.size, dtype=torch.float32, device=self.device)
        flags[self.rank] = mine
        if self.size > 1:
            dist.all_reduce(flags)  # the one collective: every rank learns which ranks would skip
        pending = _Pending(flags, grads, losses=losses, hazard=hazard)
        earlier, self.pending = self.pending, pending
        if earlier is not None:  # a second optimizer.step() in one logged step: either skip counts, with what it saw
            pending.flags = torch.maximum(flags, earlier.flags)
            pending.grads, pending.losses = earlier.grads + grads, earlier.losses + losses
            pending.hazard = earlier.hazard or hazard
        if self._takes_found_inf:
            self.optimizer.found_inf = (flags.sum() > 0).float()  # type: ignore[attr-defined]
            try:
                out = self._original(*args, **kwargs)
            finally:
                del self.optimizer.found_inf  # type: ignore[attr-defined]
            return loss if closure is not None else out
        skip = bool(flags.sum().item() > 0)  # the step's one host synchronisation
        pending.skipped = skip or bool(earlier is not None and earlier.skipped)
        if skip:
            return loss
        out = self._original(*args, **kwargs)
        if self.update_check is not None:
            self.update_check.after_step()
        return loss if closure is not None else out

    def uninstall(self) -> None:
        _unwatch(self)
        if vars(self.optimizer).get("step") is self._installed:
            if self._had_own_step:
                self.optimizer.step = self._original  # type: ignore[method-assign]
            else:
                del self.optimizer.step

    # ---- at log --------------------------------------------------------------------------------------------------

    def read(self, step: int, loss: float | torch.Tensor, nbytes: int) -> tuple[float, bool, bool]:
        """The logged loss, whether the step was skipped and whether the state check (when due) found a non-finite
        value, read with one host synchronisation."""
        pending, self.pending = self.pending, None
        self.losses.clear()  # a backward() with no step after it (an evaluation) is no step's loss
        check = self._check_due(step, nbytes)
        parts: list[torch.Tensor] = []
        device = loss.device if isinstance(loss, torch.Tensor) else torch.device("cpu")
        parts.append(loss.detach().float().reshape(()) if isinstance(loss, torch.Tensor) else torch.tensor(float(loss)))
        if pending is not None and pending.skipped is None:
            parts.append(pending.flags.sum())
        if check:
            flag = _sum_flag(self._state_tensors(), self.device)
            if self.size > 1:
                dist.all_reduce(flag, op=dist.ReduceOp.MAX)
            parts.append(flag)
        scaler = self.rec.scaler
        if scaler is not None and scaler.is_enabled():
            parts.append(scaler._scale.reshape(()).float() if scaler._scale is not None else torch.tensor(1.0))
        values = torch.stack([p.to(device).float() for p in parts]).tolist()
        value = values.pop(0)
        skipped = False
        if pending is not None:
            skipped = pending.skipped if pending.skipped is not None else values.pop(0) > 0
        state_bad = bool(check and values.pop(0) > 0) and self._agree(not self._state_finite())
        if scaler is not None and scaler.is_enabled():
            scale = values.pop(0)
            if self._scale is not None and scale < self._scale:
                self.scaler_skips += 1  # the scaler backed off: its own skip, benign
            self._scale = scale
        self._last = pending
        return value, skipped, state_bad

    def _check_due(self, step: int, nbytes: int) -> bool:
        return (step + 1 - self.rec.start_step) % self.policy.state_check_every == 0 or self._checkpoint_due(step, nbytes)

    def _checkpoint_due(self, step: int, nbytes: int) -> bool:
        if (step + 1 - self.rec.start_step) % self.rec.checkpoint_every == 0:
            return True
        limit = self.policy.ring_bytes
        return limit is not None and sum(e.nbytes for e in self.ring) + nbytes >= limit

    def _state_tensors(self) -> list[torch.Tensor]:
        tensors = [_local(p.detach()) for p in self.params]
        for p in self.params:
            tensors += [_local(v) for v in self.optimizer.state.get(p, {}).values() if isinstance(v, torch.Tensor)]
        return tensors

    def _state_finite(self) -> bool:
        """Exact: a sum that overflowed finite values is not a defect."""
        return all(is_finite(t) for t in self._state_tensors() if t.is_floating_point() and t.numel())

    def settle(self, step: int, batch: Any, snap: tuple[dict[str, torch.Tensor], dict[str, Any]] | None, line: str,
               nbytes: int, skipped: bool, state_bad: bool) -> None:
        """After the step's line went to the writer: keep its batch, act on the verdicts, checkpoint when due."""
        self.ring.append(_Entry(step, snap, line, nbytes))
        self.steps += 1
        due = self._checkpoint_due(step, 0)
        if skipped and self._agree(not self._state_finite()):
            self._state_went_bad(step)  # the gradients are non-finite because the state already is: no skip helps
        elif skipped:
            self._skip(step, batch)
        elif state_bad:
            self._state_went_bad(step)
        else:
            self.consecutive = 0
            if due:
                self.checkpoint(step + 1)

    def checkpoint(self, step: int) -> None:
        """The recorder's checkpoint, the ring emptied (it holds the steps since the newest checkpoint), and the
        rollback copy taken."""
        self.rec._checkpoint(step)
        self.ring.clear()
        if self.policy.rollback:
            self._copy = {"params": [p.detach().clone() for p in self.params],
                          "buffers": [b.detach().clone() for b in self.rec.model.buffers()],
                          "state": [{k: v.clone() if isinstance(v, torch.Tensor) else v
                                     for k, v in self.optimizer.state.get(p, {}).items()} for p in self.params]}

    def _skip(self, step: int, batch: Any) -> None:
        pending = self._last
        assert pending is not None
        self.skipped.append(step)
        self.consecutive += 1
        ranks = [r for r, f in enumerate(pending.flags.tolist()) if f > 0]
        found = self._first_bad_grad(pending)
        why = self._why(pending, found)
        samples = {path: value for path, value in data_leaves(batch)}
        bad_inputs = _nonfinite_samples(batch)
        per_rank = self._gather({"rank": self.rank, "grad": found, "samples": samples, "nonfinite_inputs": bad_inputs,
                                 **why})
        first = next((r for r in per_rank if r.get("reason")), why)
        entry: dict[str, Any] = {"event": "skip", "step": step, "reason": first.get("reason"),
                                 "ranks_nonfinite_grad": ranks,
                                 "grad": next((r["grad"] for r in per_rank if r["grad"]), None),
                                 **{k: first[k] for k in ("update", "loss") if k in first}}
        if self.size > 1:
            entry["per_rank"] = per_rank
        else:
            entry.update(samples=samples, nonfinite_inputs=bad_inputs)
        repeats = self._repeats(step, [r["samples"] for r in per_rank])
        if repeats:
            entry["repeats"] = repeats
        entry["incident"] = str(self._incident("skip", step, entry).relative_to(self.rec.path))
        self._note(entry)
        log.warning("nanforensics guard: skipped step %d (%s%s); incident %s", step, _said(entry),
                    f"; the same samples as step {repeats[0]['step']}" if repeats else "", entry["incident"])
        self.checkpoint(step + 1)  # the state after the skip: a later incident replays from it, past this step
        self._police(step)

    def _why(self, pending: _Pending, grad: dict[str, Any] | None) -> dict[str, Any]:
        """Which of the three fired on this rank: a non-finite gradient, a non-finite loss, or an update that would
        make a non-finite value from finite ones (with its tensor, state key and coordinate)."""
        if grad is not None:
            return {"reason": "gradient"}
        loss = next((t for t in pending.losses if not is_finite(t)), None)
        if loss is not None:
            return {"reason": "loss", "loss": value_name(float(loss))}
        h = pending.hazard
        if h is not None:
            return {"reason": "update", "update": {"tensor": self.names[h.param], "state": h.state, "index": h.index,
                                                   "value": h.value}}
        return {}

    def _first_bad_grad(self, pending: _Pending) -> dict[str, Any] | None:
        for index, grad in pending.grads:
            if not is_finite(grad):  # every gradient the check read: a complex one too
                where = locate(grad)
                if where is not None:
                    return {"tensor": self.names[index], "index": where.index, "value": where.value, "rank": self.rank}
        return None

    def _repeats(self, step: int, sample_sets: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """Earlier skips that held any of this batch's sample ids (the tensor-free per-sample lists)."""
        ids = {json.dumps(v, sort_keys=True) for samples in sample_sets for value in samples.values()
               if isinstance(value, list) for v in value}
        earlier: dict[int, list[Any]] = {}
        for key in ids:
            if key in self._seen_samples:
                earlier.setdefault(self._seen_samples[key], []).append(json.loads(key))
            else:
                self._seen_samples[key] = step
        return [{"step": s, "samples": v} for s, v in sorted(earlier.items())]

    def _state_went_bad(self, step: int) -> None:
        entry: dict[str, Any] = {"event": "state_nonfinite", "step": step, "found": self._gather(self._first_bad_state()),
                                 "checked_every": self.policy.state_check_every}
        incident = self._incident("stop", step, entry)
        entry["incident"] = str(incident.relative_to(self.rec.path))
        if self._copy is None:
            self._note(entry)
            raise self._stop(f"step {step} left a non-finite parameter or optimizer-state value that no skip could "
                             "prevent (written after the step, or by an update the guard's proof does not cover)",
                             incident)
        self._restore()
        entry["event"], entry["rolled_back_to"] = "rollback", self.rec._checkpoints[-1]
        self.rollbacks.append(step)
        self._note(entry)
        log.warning("nanforensics guard: step %d left a non-finite state value; rolled back to the state before step %d "
                    "(incident %s)", step, entry["rolled_back_to"], entry["incident"])
        self.consecutive += 1
        self.checkpoint(step + 1)
        self._police(step)

    def _first_bad_state(self) -> dict[str, Any] | None:
        for index, p in enumerate(self.params):
            named = [("param", _local(p.detach()))] + [
                (k, _local(v)) for k, v in self.optimizer.state.get(p, {}).items() if isinstance(v, torch.Tensor)]
            for key, t in named:
                if t.is_floating_point() and not is_finite(t):
                    where = locate(t)
                    assert where is not None  # t is not finite: locate finds its first coordinate that is not
                    return {"tensor": self.names[index], "state": key, "rank": self.rank, "index": where.index,
                            "value": where.value}
        return None

    def _restore(self) -> None:
        assert self._copy is not None
        with torch.no_grad():
            for p, saved in zip(self.params, self._copy["params"]):
                p.copy_(saved)
            for b, saved in zip(self.rec.model.buffers(), self._copy["buffers"]):
                b.copy_(saved)
            for p, saved in zip(self.params, self._copy["state"]):
                self.optimizer.state[p] = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in saved.items()}

    def _police(self, step: int) -> None:
        p = self.policy
        why = None
        if self.consecutive >= p.max_consecutive:
            why = f"{self.consecutive} consecutive steps skipped (max_consecutive={p.max_consecutive})"
        elif self.steps >= p.fraction_after and len(self.skipped) > p.max_skip_fraction * self.steps:
            why = (f"{len(self.skipped)} of {self.steps} steps skipped, more than max_skip_fraction="
                   f"{p.max_skip_fraction}")
        if why is not None:  # called after a skip's or a rollback's incident: the newest is this step's
            self._note({"event": "stop", "step": step, "why": why,
                        "incident": str(self.incidents[-1].relative_to(self.rec.path))})
            raise self._stop(why, self.incidents[-1])

    def _stop(self, why: str, incident: Path | None) -> GuardStop:
        self.rec.close()
        return GuardStop(f"nanforensics guard stopped the run: {why}; replay {incident}", incident)

    # ---- the record ----------------------------------------------------------------------------------------------

    def _gather(self, item: Any) -> list[Any]:
        if self.size == 1:
            return [item]
        out: list[Any] = [None] * self.size
        dist.all_gather_object(out, item, group=object_group())
        return out

    def _agree(self, local: bool) -> bool:
        """True on every rank when it is on any (a rare path: after a screen flagged something)."""
        if self.size == 1:
            return local
        flag = torch.tensor([float(local)])
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=object_group())
        return bool(flag.item() > 0)

    def _note(self, entry: dict[str, Any]) -> None:
        if self.writes:
            with open(self.folder / GUARD_LOG, "ab") as f:
                f.write(json_bytes(entry, indent=None))

    def _incident(self, kind: str, step: int, entry: dict[str, Any]) -> Path:
        """``incidents/step_N/``: the run's manifest, its newest checkpoint (hard links where the file system allows),
        and every step since it, batches and losses, as the recorder writes them: a run directory of its own. Built
        under a hidden name and renamed into place; a name taken is never written over (``step_N.2``)."""
        self.rec._writer.drain()
        start = self.rec._checkpoints[-1]
        final = self.folder / checkpoint_name(step)
        n = 1
        while final.exists() or final in self.incidents:
            n += 1
            final = self.folder / f"{checkpoint_name(step)}.{n}"
        build = make_build_dir(final) if self.writes else None
        if self.size > 1:
            box = [build]
            dist.broadcast_object_list(box, src=0, group=object_group())
            build = box[0]
        assert build is not None
        data = rank_dir(build, self.rank) if self.rec.world is not None else build
        data.mkdir(parents=True, exist_ok=True)
        lines = []
        for e in self.ring:
            body = encoded(e.step, *e.batch) if e.batch is not None else \
                batch_path(self.rec._data, e.step).read_bytes()
            write_bytes_atomic(batch_path(data, e.step), body, durable=False)
            lines.append(e.line)
        write_bytes_atomic(data / STEPS, "".join(lines).encode())
        if self.size > 1:
            dist.barrier(group=object_group())
        if self.writes:
            manifest = {**self.rec.manifest, "start_step": start, "keep_checkpoints": None}
            write_json_atomic(build / MANIFEST, manifest)
            shutil.copytree(self.rec.path / "checkpoints" / checkpoint_name(start),
                            build / "checkpoints" / checkpoint_name(start), copy_function=_link_or_copy)
            write_json_atomic(build / INCIDENT_FILE, {"format": INCIDENT_FORMAT, "kind": kind, "step": step,
                                                      "from_checkpoint": start, **entry})
            publish_dir_atomic(build, final)
        if self.size > 1:
            dist.barrier(group=object_group())
        self.incidents.append(final)
        return final

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self.uninstall()
        summary = {"event": "summary", "steps": self.steps, "skipped": len(self.skipped), "skipped_steps": self.skipped,
                   "scaler_skips": self.scaler_skips, "rollbacks": self.rollbacks,
                   "incidents": [str(p.relative_to(self.rec.path)) for p in self.incidents]}
        self._note(summary)
        text = (f"nanforensics guard: {self.steps} steps, {len(self.skipped)} skipped"
                f"{' (steps ' + ', '.join(map(str, self.skipped)) + ')' if self.skipped else ''}, "
                f"{self.scaler_skips} skipped by the GradScaler (benign), {len(self.rollbacks)} rolled back; "
                f"incidents in {self.folder}")
        (log.warning if self.skipped or self.rollbacks else log.info)(text)


def _said(entry: dict[str, Any]) -> str:
    """The skip's reason in words, for the log line."""
    if entry.get("reason") == "update":
        u = entry["update"]
        what = "the parameter" if u["state"] == "param" else u["state"]
        return f"finite gradients, but the update would make {what} of {u['tensor']}{u['index']} {u['value']}"
    if entry.get("reason") == "loss":
        return f"non-finite loss {entry['loss']}"
    g = entry.get("grad")
    return f"non-finite gradient {g['tensor']}{g['index']} = {g['value']}" if g else "a non-finite gradient"


def _link_or_copy(src: str, dst: str) -> None:
    """A checkpoint file is never changed in place (written whole and renamed), so a hard link is a safe copy."""
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)


def _nonfinite_samples(batch: Any) -> dict[str, list[int]]:
    """Per tensor of the batch that holds a non-finite value: the samples (first-dimension rows) that do."""
    out: dict[str, list[int]] = {}
    for path, t in leaves(batch):
        if isinstance(t, torch.Tensor) and t.is_floating_point() and t.numel() and not is_finite(t):
            rows = (~torch.isfinite(t.detach().reshape(t.shape[0], -1) if t.dim() else t.reshape(1, 1))).any(dim=1)
            out[path] = rows.nonzero().flatten().tolist()
    return out


def ring_nbytes(snap: tuple[dict[str, torch.Tensor], dict[str, Any]]) -> int:
    return sum(t.numel() * t.element_size() for t in snap[0].values())

