"""The recorder a user adds to their training loop: batches, losses and checkpoints, on disk."""

from __future__ import annotations

import atexit
import dataclasses
import datetime as _dt
import functools
import json
import os
import queue
import shutil
import threading
from pathlib import Path
from typing import Any, Callable

import torch

from ..distributed.pipeline import pipeline_world
from ..distributed.record import recording_world
from .batches import encoded, snapshot
from .checkpoint import CheckpointState, checkpoint_name, checkpoint_state, write_checkpoint
from .compiled import compiled_backend, unwrapped
from .cpu import this_cpu
from .files import refuse_unstorable, write_bytes_atomic, write_json_atomic
from .guard import Guard, GuardPolicy, ring_nbytes
from .imports import import_string_of
from .layout import DISTRIBUTED_FORMAT
from .optimizers import OptimizerSet, matched, optimizer_set, scheduler_set, unsupported
from .run import MANIFEST, RUN_FORMAT, SEVERAL_OPTIMIZERS_FORMAT, STEPS, batch_path
from .steplog import step_line

# A job for the writer thread, the file a failure of it is charged to unless its error names one, and whether it
# writes a checkpoint (the steps logged before it are then made durable first, and the checkpoint slot freed after).
_Job = tuple[Callable[[], None], "Path | None", bool]


class _StepWriter:
    """Writes batches, step lines and checkpoints on a background thread, so the training loop does not wait on the disk.

    The queue is bounded (back-pressure instead of unbounded memory), and so are checkpoints: one at a time is in
    flight, the next waits until it is written (``checkpoint``). A write error is raised in the training loop at the
    next ``put``, ``checkpoint``, ``drain`` or ``close`` rather than anything being dropped silently.
    """

    def __init__(self, run_dir: Path, depth: int = 8) -> None:
        self.run_dir = run_dir
        self._steps = open(run_dir / STEPS, "a", encoding="utf-8")
        self._queue: queue.Queue[_Job | None] = queue.Queue(maxsize=depth)
        self._checkpoint_slot = threading.Semaphore(1)
        self._error: BaseException | None = None
        self._failed: Path | None = None  # the file a write error struck
        self._thread = threading.Thread(target=self._work, name="nanforensics-recorder", daemon=True)
        self._thread.start()
        atexit.register(self.close)  # a loop that forgets close() still gets its last steps written

    def _work(self) -> None:
        while (item := self._queue.get()) is not None:
            job, where, checkpoint = item
            try:
                if self._error is None:
                    if checkpoint:  # a reader never meets a checkpoint the steps before it could outlive
                        self._sync_steps()
                    self._failed = where
                    job()
            except BaseException as e:  # noqa: BLE001 - handed to the training loop
                self._error = e
            finally:
                if checkpoint:
                    self._checkpoint_slot.release()
                self._queue.task_done()
        self._queue.task_done()

    def _write_step(self, step: int, tensors: dict[str, torch.Tensor] | None, tree: dict[str, Any] | None,
                    line: str) -> None:
        # The batch is on disk before the line that announces it: a reader never meets a step without one.
        # (None: a guard keeps the batches in memory, for its incidents.)
        if tensors is not None and tree is not None:
            self._failed = batch_path(self.run_dir, step)
            write_bytes_atomic(self._failed, encoded(step, tensors, tree), durable=False)
        self._failed = self.run_dir / STEPS
        self._steps.write(line)
        self._steps.flush()

    def _sync_steps(self) -> None:
        self._failed = self.run_dir / STEPS
        os.fsync(self._steps.fileno())

    def _usable(self) -> None:
        if self._steps.closed:
            raise RuntimeError("Recorder.log called after close()")
        self._raise()

    def _raise(self) -> None:
        if (e := self._error) is not None:
            raise _write_error(self._failed or self.run_dir, e) from e

    def put(self, step: int, batch: tuple[dict[str, torch.Tensor] | None, dict[str, Any] | None], line: str) -> None:
        self._usable()
        self._queue.put((functools.partial(self._write_step, step, *batch, line), None, False))

    def checkpoint(self, take: Callable[[], Any], write: Callable[[Any], None], where: Path) -> None:
        """``take()`` here, on the training thread, once the checkpoint before is written (its copies are reused),
        then ``write(taken)`` on the writer thread, in order with the steps; a failure is charged to ``where``."""
        self._usable()
        self._checkpoint_slot.acquire()
        try:
            taken = take()
        except BaseException:
            self._checkpoint_slot.release()
            raise
        self._queue.put((functools.partial(write, taken), where, True))

    def drain(self) -> None:
        """Everything queued is written and the step log is on stable storage."""
        self._queue.join()
        self._raise()
        os.fsync(self._steps.fileno())

    def close(self) -> None:
        if self._steps.closed:
            return
        try:
            self.drain()
        finally:
            self._queue.put(None)
            self._thread.join()
            self._steps.close()
            atexit.unregister(self.close)


class _HostCopies:
    """Host buffers a checkpoint's tensors are copied into on the training thread, to be written from on the writer's
    while the next steps change the originals in place. Reused from one checkpoint to the next (one is in flight at a
    time): no allocation and no page faults per checkpoint, for one copy of the state held until ``close``."""

    def __init__(self) -> None:
        self._buffers: dict[tuple[str, str], torch.Tensor] = {}

    def of(self, state: CheckpointState) -> CheckpointState:
        kept, self._buffers = self._buffers, {}
        return dataclasses.replace(state, **{part: {name: self._copy(kept, part, name, t)
                                                    for name, t in getattr(state, part).items()}
                                             for part in ("model", "optimizer", "extras")})

    def _copy(self, kept: dict[tuple[str, str], torch.Tensor], part: str, name: str, t: torch.Tensor) -> torch.Tensor:
        refuse_unstorable(name, t.dtype)  # here, where the loop can be told, not on the writer thread
        buffer = kept.get((part, name))
        if buffer is None or buffer.shape != t.shape or buffer.dtype != t.dtype:
            buffer = torch.empty(t.shape, dtype=t.dtype)
        self._buffers[part, name] = buffer
        return buffer.copy_(t.detach())  # as the file holds it: contiguous, conjugate and negative views resolved

    def clear(self) -> None:
        self._buffers = {}


def _write_error(fallback: Path, error: BaseException) -> OSError:
    """What the training loop is told when a write failed: the file (the one the error names, a checkpoint's own,
    else ``fallback``), and why (a full disk: no space left)."""
    named = Path(error.filename) if isinstance(error, OSError) and error.filename else fallback
    why = error.strerror if isinstance(error, OSError) and error.strerror else str(error)
    return OSError(f"nanforensics recorder could not write {named}: {why}")


def _optimizer_entry(optimizer: torch.optim.Optimizer, factory: Any) -> dict[str, Any]:
    """The manifest's account of one optimizer: its class and the factory that builds it again, if any."""
    return {"class": import_string_of(type(optimizer), "optimizer class"),
            "factory": import_string_of(factory, "optimizer_factory") if factory else None}


def _optimizer_fields(optimizer: torch.optim.Optimizer, factory: Any, schedulers: list[Any]) -> dict[str, Any]:
    """The manifest's ``optimizer`` (one) or ``optimizers`` (a set: how the loop passed them, and each by name, with
    the factory of its LR scheduler under ``scheduler`` where it has one)."""
    if not isinstance(optimizer, OptimizerSet):
        return {"optimizer": _optimizer_entry(optimizer, factory)}
    factories = matched(factory, list(optimizer.members), optimizer.given)
    return {"optimizers": {"given": optimizer.given, "members": [
        {"name": name, **_optimizer_entry(member, f),
         **({"scheduler": {"factory": import_string_of(s, "scheduler_factory")}} if s is not None else {})}
        for (name, member), f, s in zip(optimizer.members.items(), factories, schedulers or [None] * len(factories))]}}


def _created() -> _dt.datetime:
    """Now, or SOURCE_DATE_EPOCH where set, so that regenerated sample runs are byte-identical."""
    epoch = os.environ.get("SOURCE_DATE_EPOCH")
    return _dt.datetime.fromtimestamp(int(epoch) if epoch else _dt.datetime.now().timestamp(), _dt.timezone.utc)


class Recorder:
    """Records what replay needs: the state before step ``start_step`` and every ``checkpoint_every``
    steps after, each step's batch and logged loss.

    ``keep_checkpoints`` bounds disk use: only the newest N checkpoints are kept, with the batches
    needed to replay from the oldest of them.

    A mixed-precision loop passes its ``scaler`` (``torch.amp.GradScaler``), a loop with an LR scheduler its
    ``scheduler`` and an importable ``scheduler_factory(optimizer)`` that builds it again: their state is
    checkpointed, and replay calls the step function with ``scaler=`` and ``scheduler=`` keyword arguments
    (only those recorded), as the loop did.

    Under torchrun, every rank constructs it with the same path and the model as the loop trains it (wrapped by
    ``DistributedDataParallel`` or ``fully_shard``): each rank records its batch shard and loss, rank 0 the manifest and
    the shared state (nanforensics.distributed). A pipeline-parallel loop passes its schedule as ``model``
    (``torch.distributed.pipelining``; nanforensics.distributed.pipeline).

    ``guard=True`` (or a ``GuardPolicy``) skips a step whose gradients are non-finite before the optimizer writes
    anything, and writes an incident directory per skip (nanforensics.runs.guard). ``batches`` says where the batches
    go: ``"disk"`` (every batch, the default without a guard) or ``"memory"`` (the steps since the newest checkpoint,
    the default with one; only the newest checkpoint is kept).

    Several optimizers stepping in turn in one step (a GAN's generator and discriminator) are passed together as
    ``optimizer=[g_opt, d_opt]`` (a list or tuple, named ``"0"``, ``"1"`` by position) or ``optimizer={"generator":
    g_opt, "discriminator": d_opt}``, over the parameters of the one ``model`` that holds both networks;
    ``optimizer_factory`` is then None or shaped alike, and so are ``scheduler`` and ``scheduler_factory`` (each
    optimizer's own LR scheduler, None for one without). Replay calls the step function with them as given
    (docs/recording.md, "Several optimizers").

    Each callable may be given as its import string instead (``"pkg.models:build_model"``,
    ``"train.py:train_step"``), when replay should reach it under another name than this process does.
    """

    def __init__(
        self,
        run_dir: str | os.PathLike[str],
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer | list[torch.optim.Optimizer] | tuple[torch.optim.Optimizer, ...]
        | dict[str, torch.optim.Optimizer],
        *,
        model_factory: Callable[..., torch.nn.Module] | str,
        step_fn: Callable[..., Any] | str,
        model_kwargs: dict[str, Any] | None = None,
        optimizer_factory: Any = None,
        checkpoint_every: int = 50,
        keep_checkpoints: int | None = None,
        start_step: int = 0,
        overwrite: bool = False,
        scaler: torch.amp.GradScaler | None = None,
        scheduler: Any = None,
        scheduler_factory: Callable[[torch.optim.Optimizer], Any] | str | None = None,
        guard: bool | GuardPolicy = False,
        batches: str | None = None,
    ) -> None:
        batches = batches or ("memory" if guard else "disk")
        if batches not in ("disk", "memory"):
            raise ValueError(f"batches must be 'disk' or 'memory', not {batches!r}")
        if batches == "memory":
            if not guard:
                raise ValueError("batches='memory' keeps the recent batches for a guard's incidents; pass guard=True")
            keep_checkpoints = 1  # the newest checkpoint and the steps since it are all an incident needs
        if (scheduler is None) != (scheduler_factory is None):
            raise ValueError("pass scheduler= and scheduler_factory= together: replay rebuilds the scheduler with "
                             "scheduler_factory(optimizer), then loads its recorded state")
        if checkpoint_every < 1:
            raise ValueError("checkpoint_every must be at least 1")
        if keep_checkpoints is not None and keep_checkpoints < 1:
            raise ValueError("keep_checkpoints must be at least 1 (or None to keep all)")
        optimizer = optimizer_set(optimizer)
        member_schedulers: list[Any] = []  # several optimizers: each one's scheduler factory, in the manifest's members
        if isinstance(optimizer, OptimizerSet) and scheduler is not None:
            scheduler, member_schedulers = scheduler_set(optimizer, scheduler, scheduler_factory)
        optimizer_fields = _optimizer_fields(optimizer, optimizer_factory, member_schedulers)
        self.path = Path(run_dir)
        # Under torchrun, every rank records its own batches and losses; rank 0 the rest (docs/run-format.md).
        self.world = pipeline_world(model, guard=guard, scaler=scaler, scheduler=scheduler) or recording_world(model)
        if isinstance(optimizer, OptimizerSet) and (why := unsupported(
                k for k, v in (("scaler", scaler), ("guard", guard), ("distributed", self.world)) if v)):
            raise ValueError(why)
        if self.world is not None:
            self.world.prepare(self.path, overwrite)
        elif self.path.exists() and any(self.path.iterdir()):
            if not overwrite:
                raise FileExistsError(f"{self.path} is not empty; pass overwrite=True to replace it")
            shutil.rmtree(self.path)
        # names are the model's own, unwrapped: torch.compile's names are the compiled module's, no _orig_mod.
        backend = self.world.compiled if self.world is not None else compiled_backend(model)
        model = self.world.module if self.world is not None else unwrapped(model)
        self.model, self.optimizer, self.scaler, self.scheduler = model, optimizer, scaler, scheduler
        self.checkpoint_every, self.keep_checkpoints = checkpoint_every, keep_checkpoints
        self.start_step = start_step
        self._next_step = start_step
        self._checkpoints: list[int] = []
        manifest = {
            "format": RUN_FORMAT,
            "created": _created().isoformat(timespec="seconds"),
            "torch_version": torch.__version__,
            "model_factory": import_string_of(model_factory, "model_factory"),
            "model_kwargs": model_kwargs or {},
            "step_fn": import_string_of(step_fn, "step_fn"),
            **optimizer_fields,
            "checkpoint_every": checkpoint_every,
            "keep_checkpoints": keep_checkpoints,
            "start_step": start_step,
            "num_threads": torch.get_num_threads(),
            "device": str(next(model.parameters()).device),
            "cpu": dataclasses.asdict(this_cpu()),  # a replay on another kind of CPU sums in another order
        }
        if isinstance(optimizer, OptimizerSet):
            manifest["format"] = SEVERAL_OPTIMIZERS_FORMAT
        if backend is not None:
            manifest["compiled"] = {"backend": backend}
        if scaler is not None:
            manifest["scaler"] = {"enabled": scaler.is_enabled()}
        if scheduler_factory is not None and not member_schedulers:
            manifest["scheduler"] = {"factory": import_string_of(scheduler_factory, "scheduler_factory")}
        if self.world is not None:
            manifest["format"] = DISTRIBUTED_FORMAT
            manifest["distributed"] = self.world.world.to_json()
        try:
            json.dumps(manifest, allow_nan=False)
        except (TypeError, ValueError):
            raise TypeError("model_kwargs must be JSON data (numbers, strings, lists, dicts)") from None
        self._data = self.world.data_dir(self.path) if self.world is not None else self.path
        self._data.mkdir(parents=True, exist_ok=True)
        if self.world is None or self.world.leads:
            write_json_atomic(self.path / MANIFEST, manifest)
        self.manifest = manifest
        self.batches = batches
        self._writer = _StepWriter(self._data)
        self._copies = _HostCopies()
        self.guard = Guard(self, guard if isinstance(guard, GuardPolicy) else GuardPolicy()) if guard else None
        if self.guard is not None:
            self.guard.checkpoint(start_step)
        else:
            self._checkpoint(start_step)

    def log(self, step: int, batch: Any, loss: float | torch.Tensor) -> None:
        """Call once per step, after the user's step function, with the batch it was given."""
        if step != self._next_step:
            raise ValueError(f"Recorder.log got step {step}, expected {self._next_step}: log every step, in order")
        snap = snapshot(batch)
        if self.world is not None:
            loss = self.world.step_loss(step, loss)
        if self.guard is not None:  # the loss and the guard's verdicts, read with one host synchronisation
            value, skipped, state_bad = self.guard.read(step, loss, ring_nbytes(snap))
        else:
            value = float(loss.detach().float().item()) if isinstance(loss, torch.Tensor) else float(loss)
        line = step_line(step, value)
        on_disk = self.batches == "disk"
        self._writer.put(step, snap if on_disk else (None, None), line)  # serialised and written in the background
        self._next_step = step + 1
        if self.guard is not None:
            self.guard.settle(step, batch, None if on_disk else snap, line, ring_nbytes(snap), skipped, state_bad)
            return
        if (self._next_step - self.start_step) % self.checkpoint_every == 0:
            self._checkpoint(self._next_step)

    def _checkpoint(self, step: int) -> None:
        """The state before ``step``: copied here, written on the writer thread (a distributed run's ranks write
        theirs together, here)."""
        folder = self.path / "checkpoints"
        if self.world is None:
            self._writer.checkpoint(lambda: (self._copies.of(checkpoint_state(
                step, self.model, self.optimizer, scaler=self.scaler, scheduler=self.scheduler)), self._retained(step)),
                lambda taken: self._write_checkpoint(folder, *taken), folder / checkpoint_name(step))
            return
        self._writer.drain()
        try:
            self.world.checkpoint(folder, step, self.optimizer, scaler=self.scaler, scheduler=self.scheduler)
        except OSError as e:
            raise _write_error(folder, e) from e
        self._drop(*self._retained(step))

    def _retained(self, step: int) -> tuple[list[int], int]:
        """Count ``step``'s checkpoint in; the checkpoints ``keep_checkpoints`` drops with it, and the oldest step
        whose batch is still needed."""
        self._checkpoints.append(step)
        if self.keep_checkpoints is None or len(self._checkpoints) <= self.keep_checkpoints:
            return [], 0
        dropped, self._checkpoints = self._checkpoints[:-self.keep_checkpoints], self._checkpoints[-self.keep_checkpoints:]
        return dropped, self._checkpoints[0]

    def _drop(self, dropped: list[int], keep_from: int) -> None:
        """Delete what ``_retained`` dropped, once the checkpoint that replaces it is written."""
        if not dropped:
            return
        if self.world is None or self.world.leads:
            for old in dropped:
                shutil.rmtree(self.path / "checkpoints" / checkpoint_name(old), ignore_errors=True)
        for old_step in range(dropped[0], keep_from):
            batch_path(self._data, old_step).unlink(missing_ok=True)

    def _write_checkpoint(self, folder: Path, state: CheckpointState, dropped: tuple[list[int], int]) -> None:
        write_checkpoint(folder, state)
        self._drop(*dropped)

    def flush(self) -> None:
        """Wait for every logged step to reach the disk and go on recording: the run so far is complete there,
        for a post-mortem to read while training continues. After ``close`` there is nothing to wait for."""
        if not self._writer._steps.closed:
            self._writer.drain()

    def close(self) -> None:
        """Wait for every logged step to reach the disk; re-raises a write error from the background. A guard says
        what it skipped (a summary line, and in ``incidents/guard.jsonl``)."""
        if self.guard is not None:
            self.guard.close()
        try:
            self._writer.close()
        finally:
            self._copies.clear()  # the copy of the state the checkpoints were written from

    def __enter__(self) -> "Recorder":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
