"""Replaying a distributed run: its whole world emulated on one process, or one rank of it under torchrun.

**Emulation.** Data parallelism makes each rank's forward and backward a function of the shared parameters and its
own shard, and then averages the local gradients. So one model can play every rank in turn: each rank's shard runs
through the user's own step function with ``optimizer.step()`` disabled and its own RNG state, the model and
optimizer put back after each pass, and the gradients it leaves at the end of its synchronising backward are that
rank's local gradients: the values a check before the all-reduce sees, and where a non-finite value starts. The last
pass then runs the step for real: at the end of its synchronising backward its gradients are replaced by the mean
over ranks, as DDP's all-reduce (or FSDP2's reduce-scatter) leaves them, so clipping, unscaling and
``optimizer.step()`` see what they saw in the run. At two ranks this is bit-exact; at more, the collective's own
summation order may differ in the last bit (the report says whether replayed losses equal the logged ones).

**Torchrun.** Each process rebuilds the wrapper and replays its own rank; the checks on each rank see its local
gradients as backward accumulates them (before the all-reduce or reduce-scatter reads them), and every step's events
and losses are gathered to every rank, so all ranks take the same decisions. Root cause inside the responsible step
(samples, operations) is then found by rank 0 in the emulation, looking at the responsible rank's shard.
"""

from __future__ import annotations

from contextlib import contextmanager, nullcontext
from typing import Any, Iterator

import torch
import torch.distributed as dist

from ..errors import BadInput
from ..replay.monitor import StepMonitor
from ..replay.session import Session, loss_value, no_optimizer_step
from ..report import Event
from ..runs.batches import map_tensors
from ..runs.checkpoint import Checkpoint, optimizer_params, rng_state
from ..runs.layout import DDP, FSDP2, SHARED_STAGES, World, mean_loss
from ..runs.run import Rebuilt, Run, UserCode
from ..runs.source import StartPoint, StepCode, StepSource
from .checkpoint import restore_rank_rng
from .events import merge, rows, tag
from .world import mismatch, object_group
from .wrapping import check_placements, emulated, mixed_precision, parallelize, placements, shard_fsdp2, wrap_ddp


def open_session(run: StepSource, code: StepCode, checkpoint: StartPoint, device: torch.device) -> Session:
    """A session for the run: a plain one, or for a distributed run its world emulated on this process or one rank of it
    under torchrun. Every replay opens its sessions here, the one place that knows each kind."""
    if run.world is not None:
        return distributed_session(run, code, checkpoint, device)
    return Session(run, code, checkpoint, device)


def regrouped(run: StepSource) -> bool:
    """Whether this replay sums in another order than the run did: a run on a DeviceMesh emulated on one process (its
    tensor-parallel layers rebuilt whole, HSDP's reduction in two stages made one). Its losses and checkpoints are then
    judged within a tolerance, as on another kind of CPU."""
    world = run.world
    return world is not None and world.mesh is not None and not (dist.is_available() and dist.is_initialized())


def distributed_session(run: Run, code: UserCode, checkpoint: Checkpoint, device: torch.device) -> Session:
    """One rank of the run when this process is in a process group of the recorded size, else the emulation."""
    if dist.is_available() and dist.is_initialized():
        problem = mismatch(run, dist.get_world_size())
        if problem is not None:
            raise BadInput(run.path, problem)
        return RankSession(run, code, checkpoint, device)
    return EmulatedSession(run, code, checkpoint, device)


def _rank_rng(session: Session, world: World) -> list[Any]:
    """Every rank's RNG states at the checkpoint, by global rank."""
    states = session.meta.get("rank_rng")
    if not isinstance(states, list) or len(states) != world.world_size:
        raise BadInput(session.checkpoint.path / "meta.json", f"holds no RNG state for each of the {world.world_size} "
                                                              "ranks (rank_rng)")
    return states


def _restore(session: Session, state: Any) -> None:
    restore_rank_rng(state, session.device, session.checkpoint.path / "meta.json")


class EmulatedSession(Session):
    """Every rank of a distributed run on this process, one model playing each in turn."""

    def __init__(self, run: Run, code: UserCode, checkpoint: Checkpoint, device: torch.device) -> None:
        assert run.world is not None
        self.world = run.world
        self.focus = 0  # the data rank (on a mesh, the data-parallel group) whose shard a root-cause pass looks at
        self.rank_losses: dict[int, list[float]] = {}  # step -> each data rank's replayed loss
        if mixed_precision(self.world):
            raise BadInput(run.path / "manifest.json", "the run's FSDP2 MixedPrecisionPolicy computes in other dtypes than "
                                                       "the parameters', which one process cannot emulate: replay it at "
                                                       f"world size, torchrun --nproc-per-node {self.world.world_size} "
                                                       f"-m nanforensics replay {run.path}")
        super().__init__(run, code, checkpoint, device)

    def reset(self) -> None:
        super().reset()
        # one RNG state per data rank: its lead's (the ranks of a tensor-parallel group draw alike)
        states = _rank_rng(self, self.world)
        self.rank_rng = [states[self.world.lead(d)] for d in range(self.world.data_ranks)]
        self.stepped = emulated(self.model, self.world)
        self.lengths = rows(self.model)
        _restore(self, self.rank_rng[self.focus])

    def logged_batch(self, step: int) -> Any:
        return self.run.batch(step, self.focus)

    def shard_of(self, step: int, rank: int) -> Any:
        return map_tensors(self.run.batch(step, rank), lambda t: t.to(self.device))

    @contextmanager
    def focused(self, rank: int | None) -> Iterator[Session | None]:
        before, self.focus = self.focus, self.world.data_rank(rank) if rank is not None else 0
        try:
            yield self
        finally:
            self.focus = before

    def snapshot(self) -> dict[str, Any]:
        return {**super().snapshot(), "rank_rng": list(self.rank_rng)}

    def restore(self, snapshot: dict[str, Any]) -> None:
        super().restore(snapshot)
        self.rank_rng = list(snapshot["rank_rng"])
        _restore(self, self.rank_rng[self.focus])

    def traced_pass(self, origin: Event) -> Any:
        """The rank in focus's pass; every rank's, averaged, for a value that arose after the collective."""
        if origin.stage in SHARED_STAGES:
            return self.run_step()[0]
        return super().traced_pass(origin)

    def run_step(self, monitor: StepMonitor | None = None, locate: bool = False,
                 batch: Any = None) -> tuple[float, list[Event]]:
        """Every rank's pass at this step, the rank in focus first; the last one steps the optimizer on the mean of
        the local gradients. Returns the mean loss over ranks and every rank's events."""
        step, size = self.step, self.world.data_ranks
        order = [self.focus] + [r for r in range(size) if r != self.focus]
        before = self.snapshot() if size > 1 else None
        local: dict[int, dict[torch.Tensor, torch.Tensor]] = {}
        losses: list[float] = [0.0] * size
        events: list[Event] = []
        rank0_buffers = None
        for i, rank in enumerate(order):
            last = i == size - 1
            if i:
                Session.restore(self, before)  # the state before the step; this rank's RNG next
            _restore(self, self.rank_rng[rank])
            shard = batch if batch is not None and rank == self.focus else self.shard_of(step, rank)
            if monitor:
                monitor.begin(step, shard, locate)
            with _Averaging(self, rank, local, last), (nullcontext() if last else no_optimizer_step(self.optimizer)):
                loss = self.call_step(shard)
            losses[rank] = loss_value(loss, self.run.code_file)
            self.rank_rng[rank] = rng_state()
            if monitor:
                events += tag(monitor.end(loss), self.world.lead(rank), self.world, self.lengths, shared=last)
            if rank == 0 and not last:
                rank0_buffers = [b.detach().clone() for b in self.model.buffers()]
        # The next forward starts from rank 0's buffers: DDP broadcasts them. (FSDP2 leaves each rank its own; the
        # emulation keeps rank 0's, which its checkpoints hold.)
        if rank0_buffers is not None:
            with torch.no_grad():
                for b, kept in zip(self.model.buffers(), rank0_buffers):
                    b.copy_(kept)
        self.rank_losses[step] = losses
        self.step += 1
        _restore(self, self.rank_rng[self.focus])  # between steps, this process is the rank in focus
        return mean_loss(losses), merge(events)


class _Averaging:
    """One rank's pass in the emulation: at the end of each backward that synchronises gradients (not under
    ``no_sync()``, or with FSDP2's gradient sync on), the rank's local gradients are kept; in the last pass they are
    then replaced by the mean over every rank's, as the collective leaves them."""

    def __init__(self, session: EmulatedSession, rank: int, local: dict[int, dict[torch.Tensor, torch.Tensor]],
                 last: bool) -> None:
        self.session, self.rank, self.local, self.last = session, rank, local, last
        self.params = [p for p in optimizer_params(session.optimizer) if p.requires_grad]
        self._queued = False
        self._handles: list[Any] = []

    def __enter__(self) -> "_Averaging":
        self._handles = [p.register_post_accumulate_grad_hook(self._accumulated) for p in self.params]
        return self

    def __exit__(self, *exc: object) -> None:
        for h in self._handles:
            h.remove()

    def _accumulated(self, p: torch.Tensor) -> None:
        if not self._queued:  # once per backward: the end of it is when the collective has run
            self._queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._backward_done)

    def _backward_done(self) -> None:
        self._queued = False
        if not self.session.stepped.syncs():  # type: ignore[operator]
            return
        self.local[self.rank] = {p: p.grad.detach().clone() for p in self.params if p.grad is not None}
        if not self.last:
            return
        size = self.session.world.data_ranks
        ddp = self.session.world.kind == DDP
        with torch.no_grad():
            for p in self.params:
                grads = [self.local.get(r, {}).get(p) for r in range(size)]
                if all(g is None for g in grads):
                    continue
                zero = next(g for g in grads if g is not None)
                parts = [torch.zeros_like(zero) if g is None else g for g in grads]
                # DDP scales each local gradient by 1/N as it copies it into the bucket, then sums; FSDP2 reduces
                # with an average (sum, then divide)
                mean = sum(g.mul(1.0 / size) for g in parts) if ddp else sum(parts) / size
                if p.grad is None:
                    p.grad = mean.clone()
                else:
                    p.grad.copy_(mean)


class RankSession(Session):
    """This process's rank of a distributed run, under torchrun: the wrapper rebuilt, its own shard replayed."""

    def __init__(self, run: Run, code: UserCode, checkpoint: Checkpoint, device: torch.device) -> None:
        assert run.world is not None
        self.world = run.world
        self.rank = dist.get_rank()
        self.rank_losses: dict[int, list[float]] = {}
        super().__init__(run, code, checkpoint, device)

    def call_step(self, batch: Any) -> Any:
        """The user's step on this rank's shard; what it raises names the rank, which met it alone."""
        try:
            return super().call_step(batch)
        except BadInput as e:
            e.rank = self.rank
            raise

    def rebuild(self) -> Rebuilt:
        """FSDP2's ``fully_shard`` (on a mesh, after the tensor-parallel plan) or the tensor-parallel plan alone,
        applied before the optimizer is built over the (sharded) parameters."""
        world, device = self.world, self.device
        if world.kind == DDP:
            return self.code.build(self.run, self.checkpoint, self.device, wrap=None)

        def shard(model: torch.nn.Module) -> None:
            if world.kind == FSDP2:
                shard_fsdp2(model, world, device)
            else:
                parallelize(model, world, device)
            check_placements(placements(model), world, self.run.code_file)

        return self.code.build(self.run, self.checkpoint, self.device, wrap=shard)

    def reset(self) -> None:
        super().reset()
        if self.world.kind == DDP:
            self.stepped = wrap_ddp(self.model, self.world.wrapping, self.device)
        self.lengths = rows(self.model)
        _restore(self, _rank_rng(self, self.world)[self.rank])

    def logged_batch(self, step: int) -> Any:
        return self.run.batch(step, self.world.data_rank(self.rank))

    def run_step(self, monitor: StepMonitor | None = None, locate: bool = False,
                 batch: Any = None) -> tuple[float, list[Event]]:
        """This rank's step; returns the mean loss over ranks and every rank's events, the same on every rank."""
        step = self.step
        loss, events = super().run_step(monitor, locate, batch)
        mine = tag(events, self.rank, self.world, self.lengths, shared=self.rank == 0, own=True)
        gathered: list[Any] = [None] * self.world.world_size
        dist.all_gather_object(gathered, (loss, mine), group=object_group())
        self.rank_losses[step] = [gathered[self.world.lead(d)][0] for d in range(self.world.data_ranks)]
        return mean_loss(self.rank_losses[step]), merge(e for _, rank_events in gathered for e in rank_events)

    @contextmanager
    def focused(self, rank: int | None) -> Iterator[Session | None]:
        """Rank 0 explains the step in the emulation (the responsible rank's local gradient depends on nothing but
        the parameters and its shard); the other ranks wait for it. Nobody does where the emulation cannot compute
        what the run computed (an FSDP2 MixedPrecisionPolicy)."""
        try:
            if self.rank == 0 and not mixed_precision(self.world):
                emulation = EmulatedSession(self.run, self.code, self.checkpoint, self.device)
                with emulation.focused(rank) as session:
                    yield session
            else:
                yield None
        finally:
            dist.barrier(group=object_group())
