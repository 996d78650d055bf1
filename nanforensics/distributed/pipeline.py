"""Pipeline-parallel runs (``torch.distributed.pipelining``): the recorder on every stage's rank.

The loop passes its schedule (``ScheduleGPipe`` or ``Schedule1F1B``, one ``PipelineStage`` per rank, stage i on rank
i) to the ``Recorder`` as its model. With data parallelism (``dp`` pipelines side by side, torchtitan's (pp, dp)
mesh), stage i runs on ranks i*dp to i*dp+dp-1 under DistributedDataParallel or FSDP2's ``fully_shard`` over them, and
each pipeline is fed its own batch. Under torchtitan's 3-D layout (a (pp, dp_shard, tp) mesh) each stage's layers are
split first by ``parallelize_module`` on "tp": its plan is read back and recorded beside the stages, a stage runs on
dp*tp ranks, and the tp pipelines of a data-parallel rank share its batch. Each rank logs the batch its step
function gives the schedule (stage 0 the inputs, the last stage the targets); the step function returns the
micro-batch losses on the last stage, whose mean every rank of that pipeline logs, and the last stage keeps each
micro-batch's loss (``microbatch_losses.jsonl``). Checkpoints go through ``torch.distributed.checkpoint``, each rank
writing its stage's parameters and optimizer state under their names in the whole model, rank 0 the names of all
(``meta.json``): so ``scan``, ``bisect`` and every reader see one model. Replay: ``pipeline_replay``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ..finite import encode_float
from ..runs.checkpoint import state_meta, state_to_json
from ..runs.compiled import compiled_backend, own_name, unwrapped
from ..runs.layout import rank_dir
from ..runs.stages import DATA_PARALLEL, PIPELINE, SCHEDULES, TENSOR_PARALLEL, last_rank, pipeline_of, stage_width
from .checkpoint import gathered_loose_grads, rank_rng_state, save_rank_shards, shard_writer
from .record import RankRecorder
from .tensors import is_dtensor
from .world import object_group

MICROBATCH_LOSSES = "microbatch_losses.jsonl"  # the last stage's: {"step": s, "losses": [...]} per line
# why a GradScaler per stage is neither recorded nor replayed: what the recorder and the replay say
SCALER_WHY = ("a GradScaler's inf check sees only its own stage's gradients, so one stage would step where another "
              "skips, and each stage's scale would drift from the one the last stage scaled the loss by")


def schedule_of(obj: Any) -> Any:
    """``obj`` when it is a pipeline schedule of ``torch.distributed.pipelining`` (imported by a loop that uses one),
    else None."""
    module = sys.modules.get("torch.distributed.pipelining.schedules")
    return obj if module is not None and isinstance(obj, module._PipelineSchedule) else None


def step_loss(losses: Any) -> torch.Tensor:
    """The step's loss from its micro-batch losses: their mean, in one order, when recording and replaying."""
    if not isinstance(losses, (list, tuple)) or not losses or not all(isinstance(t, torch.Tensor) for t in losses):
        raise TypeError("on the last stage, a pipeline's step function returns the micro-batch losses (the list "
                        "schedule.step(..., losses=losses) filled)")
    return torch.stack([t.detach().float().reshape(()) for t in losses]).mean()


def prune(model: nn.Module, modules: list[str]) -> nn.Module:
    """The whole model as a stage: every top-level child but ``modules`` removed, so parameters keep their names.
    A container (``nn.Sequential``) drops them; any other module holds None in their place, as a model written for
    pipelining (torchtitan's) expects."""
    for name in [n for n, _ in model.named_children() if n not in modules]:
        if isinstance(model, (nn.Sequential, nn.ModuleList, nn.ModuleDict)):
            del model._modules[name]
        else:
            setattr(model, name, None)
    return model


# ---- recording ----------------------------------------------------------------------------------------------------


class PipelineRankRecorder(RankRecorder):
    """One stage's rank of a pipeline-parallel run (``pipeline_world`` picks it when the model is a schedule)."""

    def __init__(self, schedule: Any) -> None:
        from torch.distributed.pipelining.schedules import PipelineScheduleSingle

        name = type(schedule).__name__
        if name not in SCHEDULES or not isinstance(schedule, PipelineScheduleSingle):
            raise ValueError(f"the schedule is {name}; nanforensics records {' and '.join(SCHEDULES)}, one stage per rank "
                             "(an interleaved schedule's stages share a rank, and replay rebuilds one stage per rank)")
        stage, size, rank = schedule._stage, dist.get_world_size(), dist.get_rank()
        width = size // stage.num_stages if size % stage.num_stages == 0 else 0  # the ranks of each stage
        pipeline = dist.get_process_group_ranks(stage.group) if stage.group is not None else list(range(size))
        if not width or stage.stage_index != rank // width or pipeline != [
                i * width + rank % width for i in range(stage.num_stages)]:
            raise ValueError(f"stage {stage.stage_index} of {stage.num_stages} runs on rank {rank} of {size} in the "
                             f"pipeline of ranks {pipeline}: nanforensics records stage i on ranks i*w to i*w+w-1, "
                             "the same place among them on every stage one pipeline, as init_device_mesh(device, "
                             "(pp, dp) or (pp, dp_shard, tp), mesh_dim_names=...) lays them out")
        if schedule._loss_fn is None or schedule._args_chunk_spec or schedule._kwargs_chunk_spec:
            raise ValueError("the schedule needs a loss_fn and the default chunking (micro-batches along dimension 0)")
        from ..runs.imports import import_string_of

        module, data_parallel, tensor_parallel = _stage_module(stage.submod, stage.stage_index, width)
        mine = {"stage": stage.stage_index, "rank": rank, "modules": [n for n, _ in own_children(module)]}
        every: list[Any] = [None] * size
        dist.all_gather_object(every, (mine, tensor_parallel), group=object_group())
        if any(s["modules"] != every[s["stage"] * width][0]["modules"] or tp != every[s["stage"] * width][1]
               for s, tp in every):
            raise ValueError("the ranks of a stage hold different modules, or split them by different plans")
        firsts = [(s, tp) for s, tp in every if s["rank"] % width == 0]
        options = {"schedule": name, "microbatches": int(schedule._n_microbatches),
                   "scale_grads": bool(schedule.scale_grads),
                   "loss_fn": import_string_of(schedule._loss_fn, "the schedule's loss_fn"),
                   "stages": [s for s, _ in firsts]}
        if data_parallel is not None:
            options[DATA_PARALLEL] = data_parallel
        if any(tp is not None for _, tp in firsts):  # every stage's plan, in stage order: one plan of the whole model
            sizes = {tp["size"] if tp is not None else 1 for _, tp in firsts}
            if len(sizes) != 1:
                raise ValueError(f"the stages are split over different tensor-parallel sizes, {sorted(sizes)}")
            options[TENSOR_PARALLEL] = {"size": sizes.pop(), "plan": [e for _, tp in firsts for e in tp["plan"]]}
        super().__init__(PIPELINE, unwrapped(module), options, compiled_backend(module))
        self.last = last_rank(options, pipeline_of(options, rank))  # the last stage of this rank's pipeline
        self.pipeline = stage.group
        self._losses: Path | None = None

    def data_dir(self, path: Path) -> Path:
        self._losses = rank_dir(path, self.rank) / MICROBATCH_LOSSES
        return super().data_dir(path)

    def step_loss(self, step: int, loss: Any) -> Any:
        """The last stage's mean micro-batch loss, on every rank; the last stage keeps each micro-batch's."""
        value = None
        if self.rank == self.last:
            value = float(step_loss(loss))
            assert self._losses is not None
            line = {"step": step, "losses": [encode_float(float(t.detach().float())) for t in loss]}
            with open(self._losses, "a", encoding="utf-8") as f:
                f.write(json.dumps(line) + "\n")
        box = torch.tensor([0.0 if value is None else value], dtype=torch.float64)  # one broadcast, no pickling
        dist.broadcast(box, src=self.last, group=self.pipeline)
        return float(box.item())

    def checkpoint(self, folder: Path, step: int, optimizer: torch.optim.Optimizer, *, scaler: Any,
                   scheduler: Any) -> None:
        """Every rank writes its stage's tensors through torch.distributed.checkpoint; rank 0 writes meta.json with
        every stage's names (in stage order), every rank's RNG states, and each rank's LR scheduler state where the
        loop gave one (``rank_schedulers``, in rank order: each stage steps its own), and every stage's gradients of
        the parameters its optimizer does not hold."""
        grads = gathered_loose_grads(self.module, optimizer, self.group)
        states: list[Any] | None = [None] * self.size if self.leads else None
        dist.gather_object(rank_rng_state(), states, dst=0, group=self.group)
        names = state_meta(self.module, optimizer)[0], scheduler_state(scheduler)
        if not self.leads:
            dist.gather_object(names, None, dst=0, group=self.group)
            save_rank_shards(self._announce(None), self.module, optimizer, step, self.group)
            return

        def merge(meta: dict[str, Any]) -> None:
            parts: list[Any] = [None] * self.size
            dist.gather_object(names, parts, dst=0, group=self.group)
            if scheduler is not None:
                meta[RANK_SCHEDULERS] = [part[1] for part in parts]
            stages = [part[0] for part in parts[::stage_width(self.world.wrapping)]]  # a stage's other ranks: again
            for key in ("param_names", "param_groups", "buffer_names"):
                meta[key] = [x for part in stages for x in part[key]]
            meta["state_scalars"] = {k: v for part in stages for k, v in part["state_scalars"].items()}

        from ..runs.checkpoint import save_checkpoint

        save_checkpoint(folder, step, self.module, optimizer, scaler=scaler, scheduler=scheduler, rank_rng=states,
                        write_tensors=shard_writer(step, self.group, self._announce), merge_meta=merge, grads=grads)




RANK_SCHEDULERS = "rank_schedulers"  # meta.json: each rank's LR scheduler state, as JSON


def scheduler_state(scheduler: Any) -> Any:
    """A stage's LR scheduler state as JSON (None without one); ValueError for one holding tensors, which only rank
    0's extras file could carry."""
    if scheduler is None:
        return None
    tensors: dict[str, torch.Tensor] = {}
    state = state_to_json(scheduler.state_dict(), tensors, "scheduler")
    if tensors:
        raise ValueError("the stage's LR scheduler holds tensors in its state; nanforensics records a pipeline's "
                         "per-stage schedulers whose state is plain numbers")
    return state


def own_children(module: nn.Module) -> list[tuple[str, nn.Module]]:
    """A stage module's top-level children, under the names the whole model gives them."""
    return list(unwrapped(module).named_children())


def _stage_module(submod: nn.Module, stage: int, width: int) -> tuple[nn.Module, dict[str, Any] | None,
                                                                      dict[str, Any] | None]:
    """The stage's module as the factory builds it, the data-parallel wrapper's options where DDP or FSDP2 averages
    its gradients over the stage's data-parallel ranks, and its tensor-parallel size and plan where
    ``parallelize_module`` split its layers first (torchtitan's FSDP2 x TP x PP). ``width``: the stage's ranks.
    ValueError for another wrapper, another group, or nothing averaging them."""
    from torch.nn.parallel import DistributedDataParallel

    from .wrapping import _fsdp_options, _tp_plan, describe

    plan = _tp_plan(unwrapped(submod))
    if plan and not _sharded(submod):
        raise ValueError("a pipeline stage under tensor parallelism without fully_shard over its data-parallel ranks "
                         "(TP x PP, or TP under DistributedDataParallel) is not supported: nanforensics records "
                         "torchtitan's FSDP2 x TP x PP, parallelize_module on 'tp' then fully_shard on 'dp_shard'")
    if isinstance(unwrapped(submod), DistributedDataParallel):
        _, module, options = describe(submod, width)
        ranks = dist.get_process_group_ranks(unwrapped(submod).process_group)
        if ranks != [stage * width + j for j in range(width)]:
            raise ValueError(f"stage {stage}'s DistributedDataParallel averages over ranks {ranks}, not its "
                             f"data-parallel ranks {stage * width} to {stage * width + width - 1}")
        return module, {"size": width, **options}, None
    tensor_parallel = _stage_plan(plan, stage, width) if plan else None
    tp = tensor_parallel["size"] if tensor_parallel else 1
    dp, at = width // tp, dist.get_rank() % tp
    sharded = _sharded(submod)
    if sharded:  # FSDP2 over the stage's data-parallel ranks, as torchtitan's dp_shard
        wanted = [stage * width + j * tp + at for j in range(dp)]
        modules = [_fsdp_options(name, m, dp, None) for name, m in reversed(sharded)]
        for name, m in sharded:
            ranks = m._get_fsdp_state()._fsdp_param_groups[0].mesh_info.mesh.mesh.flatten().tolist()
            if ranks != wanted:
                raise ValueError(f"stage {stage}'s module {name or '<root>'!r} is sharded over ranks {ranks}, not its "
                                 f"data-parallel ranks {wanted}")
        return submod, {"size": dp, "modules": modules}, tensor_parallel
    if any(is_dtensor(p) for p in submod.parameters()):  # DTensors no plan or wrapper made
        raise ValueError("the stage's parameters are DTensors that neither fully_shard nor a tensor-parallel plan "
                         "made: nanforensics records each stage whole on its rank, or under DistributedDataParallel "
                         "or fully_shard (FSDP2) over its data-parallel ranks, with or without a plan on 'tp' first")
    if width > 1:
        raise ValueError(f"nothing averages the gradients of each stage over its {width} data-parallel ranks: wrap each "
                         "stage's module in DistributedDataParallel or fully_shard over its dp group")
    return submod, None, None


def _sharded(submod: nn.Module) -> list[tuple[str, nn.Module]]:
    """The stage's modules ``fully_shard`` made FSDP2 modules, named as in the model the factory builds."""
    fsdp = sys.modules["torch.distributed.fsdp"].FSDPModule if "torch.distributed.fsdp" in sys.modules else None
    return [(own_name(n), m) for n, m in submod.named_modules() if fsdp is not None and isinstance(m, fsdp)]


def _stage_plan(plan: list[tuple[str, dict[str, Any], Any]], stage: int, width: int) -> dict[str, Any]:
    """The stage's tensor-parallel size and plan (``_tp_plan``'s entries), checked to lie on one dimension of the
    stage's ranks: this rank's data-parallel rank's block of ``tp`` consecutive ranks, as a (pp, dp_shard, tp) mesh
    lays them out."""
    meshes = {tuple(m.mesh.flatten().tolist()) for _, _, m in plan}
    ranks = list(next(iter(meshes)))
    tp = len(ranks)
    first = stage * width + (dist.get_rank() % width) // tp * tp
    if len(meshes) != 1 or width % tp or ranks != list(range(first, first + tp)):
        raise ValueError(f"stage {stage}'s tensor-parallel plan spans ranks {sorted(meshes)}, not one block of "
                         "consecutive ranks of its stage: nanforensics records a (pp, dp_shard, tp) DeviceMesh's 'tp' "
                         "dimension")
    return {"size": tp, "plan": [spec for _, spec, _ in plan]}


def pipeline_world(model: Any, **extras: Any) -> PipelineRankRecorder | None:
    """The recorder's distributed side when the loop passed a pipeline schedule as its model; None otherwise.
    ``extras``: the recorder's ``guard``, ``scaler`` and ``scheduler``: a stage's own LR scheduler is recorded (its
    state plain numbers); a guard and a scaler are refused, each with the reason."""
    if schedule_of(model) is None:
        return None
    given = [name for name, value in extras.items() if value and name != "scheduler"]  # each stage's own: recorded
    if given:
        why = ("a guard's incidents replay on one process, and a pipeline only at world size" if given[0] == "guard"
               else SCALER_WHY)
        raise ValueError(f"{given[0]}= is not supported with a pipeline schedule: {why}")
    scheduler_state(extras.get("scheduler"))
    if not (dist.is_available() and dist.is_initialized()):
        raise ValueError("a pipeline schedule is recorded under torchrun, with its process group initialised")
    return PipelineRankRecorder(model)
