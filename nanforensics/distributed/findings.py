"""A distributed run's replay report: which rank's shard, each rank's losses, and the chain in words."""

from __future__ import annotations

import dataclasses
import math
import shlex
from typing import Callable

from ..finite import worst
from ..replay.reproduction import exact_until
from ..replay.session import Session
from ..report import BatchRef, Event, Precursor, RankCheck, ReplayReport
from ..rootcause.findings import describe
from ..rootcause.samples import batch_size
from ..runs.batches import data_leaves
from ..runs.layout import DDP, FSDP2, SHARED_STAGES, TP, Mesh, World
from ..runs.run import Run
from ..runs.steplog import first_nonfinite
from ..words import every
from .events import rows


def complete(report: ReplayReport, run: Run, session: Session, match: Callable[[float, float], bool]) -> None:
    """Add what a distributed run's report has beyond a single process's: the world, the responsible shard, each
    rank's logged and replayed losses, which rank's logged losses part from the replay first, and which rank's shard
    holds a checkpoint's first value the replay does not compute."""
    from .sessions import RankSession

    world = run.world
    assert world is not None
    report.setup.world_size, report.setup.wrapping = world.world_size, world.kind
    if world.mesh is not None:
        report.setup.mesh_shape, report.setup.mesh_dim_names = list(world.mesh.shape), list(world.mesh.dim_names)
        report.setup.tp_dim = world.mesh.tp_dim
    report.setup.ranks_replayed = "torchrun" if isinstance(session, RankSession) else "emulated"
    if isinstance(session, RankSession):
        report.precursors = _over_ranks(report.precursors)
    if report.origin is not None:
        report.responsible_batch = _responsible(run, report.origin)
    logged = {rank: {s.step: s.loss for s in run.rank_steps(rank)} for rank in range(world.data_ranks)}
    replayed: dict[int, list[float]] = getattr(session, "rank_losses", {})
    for record in report.spread:
        record.rank_logged_losses = [logged[rank].get(record.step) for rank in range(world.data_ranks)]
        record.rank_replayed_losses = replayed.get(record.step)
    report.ranks = [_check(rank, run, report, match) for rank in range(world.data_ranks)]
    lengths = rows(session.model)
    for c in report.checkpoints_compared:
        m = c.first_mismatch
        if m is not None and m.index:  # a parameter or its optimizer state: FSDP2 shards it along dimension 0
            m.rank = world.shard_owner(lengths.get(m.tensor.rpartition(" of ")[2], 0), m.index)


def _over_ranks(precursors: list[Precursor]) -> list[Precursor]:
    """Each step's largest magnitudes over every rank of the job, as the emulation measures them (it runs every rank's
    shard in one process): under torchrun each rank measured its own forward passes only. Every rank calls this."""
    import torch.distributed as dist

    gathered: list[list[Precursor]] = [[] for _ in range(dist.get_world_size())]
    dist.all_gather_object(gathered, precursors)  # between the job's own ranks
    out = []
    for i, p in enumerate(precursors):
        at = [ranks[i] for ranks in gathered]
        act = worst(q.activation_max_abs for q in at)
        out.append(dataclasses.replace(
            p, grad_max_abs=worst(q.grad_max_abs for q in at), update_max_abs=worst(q.update_max_abs for q in at),
            activation_max_abs=act, state_max_abs={k: worst(q.state_max_abs.get(k) for q in at) for k in p.state_max_abs},
            activation_headroom=next((q.activation_headroom for q in at if q.activation_max_abs is act), None)))
    return out


def _responsible(run: Run, origin: Event) -> BatchRef:
    """The shard of the origin's rank; every rank's batch of the step when the origin arose after the collective."""
    if origin.rank is not None and origin.stage not in SHARED_STAGES:
        assert run.world is not None
        group = run.world.data_rank(origin.rank)  # on a mesh, the rank's data-parallel group
        batch = run.batch(origin.step, group)
        return BatchRef(origin.step, str(run.batch_file(origin.step, group)),
                        dict(data_leaves(batch, size=batch_size(batch))), origin.rank,
                        run.world.where(origin.rank))
    leaves = {}
    for rank in run.ranks:
        batch = run.batch(origin.step, rank)
        leaves.update({f"rank {rank}: {path}": value for path, value in data_leaves(batch, size=batch_size(batch))})
    return BatchRef(origin.step, run.batch_origin(origin.step) or "", leaves, None)


def _check(rank: int, run: Run, report: ReplayReport, match: Callable[[float, float], bool]) -> RankCheck:
    """A rank's logged losses against its replayed ones, from the last checkpoint the replay matched bit for bit (a
    loss before it that differs is the reduction's rounding, as for the run's own losses)."""
    until = exact_until(report.checkpoints_compared)
    parted = next((s for s in report.spread if s.rank_replayed_losses is not None and s.rank_logged_losses is not None
                   and s.rank_logged_losses[rank] is not None and (until is None or s.step >= until)
                   and not match(s.rank_logged_losses[rank], s.rank_replayed_losses[rank])), None)
    return RankCheck(rank, first_nonfinite(run.rank_steps(rank)), parted.step if parted else None,
                     parted.rank_logged_losses[rank] if parted and parted.rank_logged_losses else None,
                     parted.rank_replayed_losses[rank] if parted and parted.rank_replayed_losses else None)


def _mesh(r: ReplayReport) -> Mesh | None:
    """The run's DeviceMesh, from the facts the report holds."""
    s = r.setup
    if s.mesh_shape is None or s.mesh_dim_names is None:
        return None
    return Mesh(tuple(s.mesh_shape), tuple(s.mesh_dim_names), s.tp_dim)


def _rank_at(mesh: Mesh, rank: int) -> str:
    return f"rank {rank} ({mesh.coordinate_text(rank)})"


def _mesh_origin(mesh: Mesh, o: Event, named: str, at: list[Event], at_size: bool) -> list[str]:
    """The origin on a DeviceMesh: the data-parallel group whose batch made it, or none when every rank shares one
    batch; at world size (``at_size``), the rank (its mesh coordinate) whose local computation made it and the other
    ranks that made their own; in the emulation, whose tensor-parallel layers are whole, the group's computation."""
    assert o.rank is not None
    group = mesh.data_rank(o.rank)
    here = _rank_at(mesh, o.rank)
    if mesh.tp_dim is None:  # HSDP: a data-parallel group is one rank, its computation its own in both modes
        computation = f"the local computation of {here}"
    elif at_size:
        computation = f"tensor-parallel rank {mesh.tp_rank(o.rank)}'s local computation ({here})"
    else:
        computation = "the group's computation, its tensor-parallel layers rebuilt whole"
    if mesh.data_ranks == 1:
        number, _, ids = named.partition(": ")
        batch = f"its {number}{f' ({ids})' if ids else ''}" if named else "that batch"
        parts = [f"No data-parallel rank is responsible for {_plain(o)} at step {o.step}: every rank computed on the "
                 f"same batch, and {batch} made it in {computation}"]
    else:
        parts = [f"Data-parallel group {group}'s shard{f' ({named})' if named else ''} made {_plain(o)} at step "
                 f"{o.step}, in {computation}"]
    own = [e for e in at if e.stage not in SHARED_STAGES and e.rank is not None and e.rank != o.rank]
    others = sorted({e.rank for e in own if e.rank is not None})
    if others and at_size:
        same = [x for x in others if mesh.data_rank(x) == group]
        later = o.order is not None and all(e.order is not None and e.order > o.order for e in own if e.stage == o.stage)
        text = ", ".join(_rank_at(mesh, x) for x in others)
        parts.append(f"{text} made non-finite values of their own {'later in' if later else 'at'} that step" + (
            ", computing on the same batch" if len(same) == len(others) else ""))
    return parts


def _plain(e: Event) -> str:
    """An event in words without its rank (the sentence names it)."""
    return describe(dataclasses.replace(e, rank=None))


def _ranks(ranks: list[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else "ranks " + ", ".join(map(str, ranks))


def _loss(x: float | None) -> str:
    return "-" if x is None else f"{x:.6g}" if math.isfinite(x) else str(x)


def findings(r: ReplayReport) -> list[str]:
    """The chain across ranks in words, and which rank's logged losses the replay does not reproduce."""
    size, kind = r.setup.world_size, r.setup.wrapping
    if size is None or kind is None:
        return []
    collective = World(size, kind, "", {}).collective
    out = []
    o = r.origin
    if o is not None:
        at = [e for e in r.events if e.step == o.step]
        if o.stage in SHARED_STAGES:
            holder = f"rank {o.rank}'s shard of" if o.rank is not None else "every rank's copy of"
            out.append(f"No rank's own values (batch, activations, loss, local gradients) were non-finite at step "
                       f"{o.step}: the first non-finite value arose after the {collective}, in {holder} "
                       f"{_plain(o)}, from the gradients averaged over {every(size, 'rank')}' shards.")
        else:
            samples = r.samples if r.samples is not None and r.samples.status == "attributed" else None
            named = ""
            if samples is not None:
                ids = "; ".join(f"{k} = {v}" for k, v in samples.sample_leaves.items())
                named = f"sample{'s' * (len(samples.samples) > 1)} {', '.join(map(str, samples.samples))}" + (
                    f": {ids}" if ids else "")
            local = sorted({e.rank for e in at if e.stage not in SHARED_STAGES and e.rank is not None})
            mesh = _mesh(r)
            if mesh is not None and o.rank is not None:
                parts = _mesh_origin(mesh, o, named, at, r.setup.ranks_replayed == "torchrun")
            else:
                parts = [f"Rank {o.rank}'s shard{f' ({named})' if named else ''} made {_plain(o)} at step {o.step}"]
                if len(local) > 1:
                    parts.append(f"{_ranks(local)} each made non-finite values of their own at that step")
            spread = next((e for e in at if e.stage == "optimizer_grad"), None)
            if spread is not None and kind == TP:
                parts.append(f"no collective averages gradients over a data-parallel dimension: optimizer.step() saw "
                             f"{_plain(spread)}" + (f" on {_rank_at(mesh, spread.rank)}" if mesh and spread.rank is not None
                                                    else ""))
            elif spread is not None and kind == DDP:
                parts.append(f"the all-reduce spread it to {every(size, 'rank')} (optimizer.step() saw {_plain(spread)})")
            elif spread is not None:
                into = f"rank {spread.rank}'s gradient shard" if spread.rank is not None else "the gradient shards"
                parts.append(f"the reduce-scatter averaged it into {into} (optimizer.step() saw {_plain(spread)})")
            state = next((e for e in at if e.stage == "optimizer_state"), None)
            if state is not None:
                parts.append(f"the optimizer state took it ({describe(state)})")
            param = next((e for e in at if e.stage == "param"), None)
            if param is not None:
                parts.append(f"the update made {describe(param)}")
            after = {e.rank for e in r.events if e.step == o.step + 1 and e.stage not in SHARED_STAGES}
            if kind == FSDP2 and param is not None and after >= set(range(size)):
                parts.append(f"the next forward's all-gather handed it to {every(size, 'rank')}")
            out.append("; ".join(parts) + ".")
        shown = {c.rank: c.logged_first_nonfinite_loss_step for c in r.ranks}
        entry = "data-parallel group" if _mesh(r) is not None else "rank"  # on a mesh, each group logs one loss
        if shown and len(set(shown.values())) == 1 and None not in shown.values():
            out.append(f"Every {entry}'s logged loss is non-finite from step {next(iter(shown.values()))}.")
        elif any(step is not None for step in shown.values()):
            out.append("Logged losses first non-finite: " + "; ".join(
                f"{entry} {rank} at step {step}" if step is not None else f"{entry} {rank} never"
                for rank, step in shown.items()) + ".")
    out += _regrouped(r) + _checkpoint_shard(r) + _loss_only(r, size)
    parted = sorted((c for c in r.ranks if c.diverged_at_step is not None), key=lambda c: (c.diverged_at_step, c.rank))
    if parted:
        c = parted[0]
        first = [x.rank for x in parted if x.diverged_at_step == c.diverged_at_step]
        if len(first) > 1:
            out.append(f"The logged losses of {_ranks(first)} part from the replay together, at step {c.diverged_at_step}: "
                       "the losses do not single out a rank (a collective carries one rank's fault to the others).")
        else:
            later = "; ".join(f"rank {x.rank}'s from step {x.diverged_at_step}" for x in parted[1:])
            text = (f"Rank {c.rank}'s logged loss differs from the replay first, at step {c.diverged_at_step} (logged "
                    f"{_loss(c.logged_loss)}, replayed {_loss(c.replayed_loss)})" + (f"; {later}" if later else ""))
            if r.verdict == "not_reproduced":
                text += (f". The replay of the same code and shards stays finite there: suspect rank {c.rank}'s hardware "
                         "(its accelerator or memory), or something that rank did outside the step function")
            out.append(text + ".")
    return out


def _regrouped(r: ReplayReport) -> list[str]:
    """Why a run on a DeviceMesh replayed on one process is judged within a tolerance, and the command that is not."""
    mesh = _mesh(r)
    if mesh is None or r.setup.ranks_replayed != "emulated" or not r.setup.loss_rtol:
        return []
    what = "its tensor-parallel layers rebuilt whole" if mesh.tp_dim is not None else \
        "HSDP's two-stage gradient reduction (within each shard group, then across replicas) made one average"
    return [f"Replayed on one process, {what}: the replay sums in another order than the run's {r.setup.world_size} "
            f"ranks, so its losses are judged within rtol {r.setup.loss_rtol:g} and its checkpoints within a tolerance, "
            f"not bit for bit; `torchrun --nproc-per-node {r.setup.world_size} -m nanforensics replay "
            f"{shlex.quote(r.setup.run)}` replays it exactly."]


def _checkpoint_shard(r: ReplayReport) -> list[str]:
    """Whose copy or shard held the first value of a recorded checkpoint that the replay computes finite, where the
    checkpoint holds it non-finite: a value the run's code and data do not compute."""
    c = next((c for c in r.checkpoints_compared if c.first_mismatch is not None and c.step == r.diverged_at_step), None)
    m = c.first_mismatch if c is not None else None
    if m is None or not m.index or _finite_text(m.recorded) or not _finite_text(m.replayed):
        return []
    where = f"{m.tensor}[{', '.join(map(str, m.index))}]"
    if m.rank is not None:
        return [f"The checkpoint of step {c.step} holds {where} = {m.recorded} in rank {m.rank}'s shard (FSDP2 shards "
                f"dimension 0), where the replay of the same code and shards computes {m.replayed}: rank {m.rank} held "
                "a value the replay does not compute; suspect its hardware (its accelerator or memory)."]
    return [f"The checkpoint of step {c.step} holds {where} = {m.recorded} in the state rank 0 wrote for every rank "
            f"(DDP replicates it), where the replay computes {m.replayed}: a rank's non-finite gradients reached it "
            "through the all-reduce, or rank 0's copy was damaged."]


def _finite_text(value: str) -> bool:
    """Whether a value as a comparison writes it ("0.0123", "nan", "float32[4, 8]") is a finite number."""
    try:
        return math.isfinite(float(value))
    except ValueError:
        return False


def _loss_only(r: ReplayReport, size: int) -> list[str]:
    """Which ranks computed the non-finite loss of each loss-only step: the run's loss, their mean, shows any one."""
    out = []
    for s in r.spread:
        if s.step not in r.loss_only_steps or s.rank_replayed_losses is None:
            continue
        bad = [rank for rank, x in enumerate(s.rank_replayed_losses) if not math.isfinite(x)]
        if bad and len(bad) < size:
            own = "its own shard" if len(bad) == 1 else "their own shards"
            out.append(f"Only {_ranks(bad)} computed a non-finite loss at step {s.step}, from {own}; the other ranks' "
                       f"stayed finite, and the run's loss, the mean over {every(size, 'rank')}, is non-finite because of it.")
        elif bad:
            out.append(f"Every rank computed a non-finite loss at step {s.step}, each from its own shard.")
    return out
