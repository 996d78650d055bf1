"""Replaying a pipeline-parallel run at world size (``torchrun --nproc-per-node N -m nanforensics replay RUN``).

Each rank rebuilds its stage (the model its factory builds, pruned to the stage's modules), its optimizer and
schedule, and runs the user's step function on its own batch, watching its stage: each module's output per
micro-batch, each parameter's gradient after each micro-batch's backward (the accumulated sum turns non-finite in the
micro-batch that made it so), each micro-batch's loss on the last stage, and the parameters and optimizer state after
the step. The events of every rank are gathered and ordered as the pipeline computes them (a micro-batch's forward
stage by stage, its loss, its backward from the last stage back; micro-batch by micro-batch, as both schedules
accumulate the gradients); the first names the step, the stage, the micro-batch and the coordinate. Sample attribution
then runs that micro-batch's subsets through the stages again (each sample alone, up to ``ALONE_UP_TO``; above, group
testing), from the state before the step, handing activations and gradients from rank to rank, and names the sample
within the micro-batch.

With data parallelism the (pp, dp) mesh is made again and each stage wrapped as recorded (DDP or FSDP2 over its dp
ranks): every pipeline replays its own batch side by side, the gradients are watched before they are averaged (under
FSDP2 on the unsharded parameters), each FSDP2 shard at the whole tensor's coordinate, and the origin's rank names its
mesh coordinate. Each stage's own LR scheduler is rebuilt and its recorded state loaded. Under FSDP2 x TP x PP the
(pp, dp_shard, tp) mesh is made again and each stage's part of the recorded plan applied before ``fully_shard``; a
value the placements replicate over tensor-parallel ranks is reported by the copy that speaks for it.

**On one process** the run is refused, with the command that replays it: a stage's module alone cannot compute what
the others fed it, and the user's step function gives the schedule its own rank's batch, so running the stages one
after the other would call it in another way than the run did.
"""

from __future__ import annotations

import copy
import json
import math
import shlex
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import nn

from ..errors import BadInput, shown
from ..finite import decode_float, locate, value_name
from ..progress import SILENT, Progress
from ..replay.reproduction import LOSS_ULPS, compare_checkpoint, float32_ulps, judge
from ..replay.session import loose_grads, put_back
from ..report import (
    LOSS_ONLY_STAGES,
    BatchRef,
    CheckpointComparison,
    Event,
    PipelineOrigin,
    ReplayReport,
    ReplaySetup,
    SampleAttribution,
    StepRecord,
)
from ..rootcause.data import check_batches
from ..rootcause.samples import judged_text, select, split_batch
from ..runs.batches import data_leaves, map_tensors, per_sample
from ..runs.checkpoint import Checkpoint, optimizer_params, restore_rng, rng_state, state_from_json
from ..runs.layout import mean_loss, rank_dir
from ..runs.run import Run, UserCode
from ..runs.stages import (
    DATA_PARALLEL,
    PIPELINE,
    TENSOR_PARALLEL,
    batch_pipelines,
    coordinate,
    coordinate_text,
    dp_rank,
    dp_size,
    last_rank,
    pipeline_of,
    stage_of,
    stage_rank,
    stage_width,
    tp_size,
)
from ..words import count, span
from .checkpoint import restore_rank_rng
from .pipeline import MICROBATCH_LOSSES, RANK_SCHEDULERS, SCALER_WHY, prune, step_loss
from .tensors import local_part, shard_like, speaks_for
from .world import object_group
from .wrapping import apply_plan, shard_modules, unsharded_params, wrap_ddp


def logged_microbatch_losses(run: Run, pipeline: int = 0) -> dict[int, list[float]]:
    """The last stage's micro-batch losses per step in pipeline ``pipeline``, as recorded: a torn last line (a job killed
    mid-write) is dropped, any other line that is not a step's losses is bad input; no file, none (an older
    recording)."""
    from ..inputs import excerpt, read_input
    from ..runs.steplog import is_step

    path = rank_dir(run.path, last_rank(run.world.wrapping, pipeline)) / MICROBATCH_LOSSES  # type: ignore[union-attr]
    out: dict[int, list[float]] = {}
    if not path.is_file():
        return out
    for number, text in enumerate(read_input(path).split(b"\n")[:-1], 1):
        try:
            line = json.loads(text)
            step, losses = line["step"], [decode_float(x) for x in line["losses"]]
        except (ValueError, KeyError, TypeError, RecursionError):
            raise BadInput(path, f"line {number} is not a step's micro-batch losses: {excerpt(text)}") from None
        if not is_step(step):
            raise BadInput(path, f"line {number}: step {shown(step)} is not a step number")
        out[step] = losses
    return out


# ---- replay at world size -----------------------------------------------------------------------------------------


def one_process_refusal(run: Run) -> str:
    size = run.world.world_size if run.world else 1
    return (f"a pipeline-parallel run is replayed by one process per rank it ran on: run `torchrun --nproc-per-node {size} -m "
            f"nanforensics replay {shlex.quote(str(run.path))}` (one process cannot run a stage's step function on "
            "what the other stages send it)")


class _Stage:
    """This rank's stage rebuilt at a checkpoint: module, optimizer, schedule, RNG."""

    def __init__(self, run: Run, code: UserCode, checkpoint: Checkpoint, device: torch.device, loss_fn: Callable) -> None:
        from torch.distributed.pipelining import PipelineStage, schedules

        wrapping = run.world.wrapping  # type: ignore[union-attr]
        self.rank, self.size = dist.get_rank(), dist.get_world_size()
        self.spec, self.wrapping = stage_of(wrapping, self.rank), wrapping
        self.stages, self.line = len(wrapping["stages"]), pipeline_of(wrapping, self.rank)
        self.last = self.rank == last_rank(wrapping, self.line)
        self.pipeline, data_group, tp_group = _groups(wrapping, device)
        self.sharded = data_group is not None and "modules" in wrapping[DATA_PARALLEL]  # FSDP2 over the dp ranks
        where = run.path / "manifest.json"
        try:
            model = code.model_factory(**run.manifest.model_kwargs)
        except Exception as e:
            raise BadInput(where, f"model factory {run.manifest.model_factory} raised {e.__class__.__name__}: {e}") from None
        missing = sorted(set(self.spec["modules"]) - {n for n, _ in model.named_children()})
        if missing:
            raise BadInput(where, f"stage {self.spec['stage']}'s module {missing[0]!r} is not a child of the model the "
                                  "factory builds")
        self.model = prune(model, self.spec["modules"]).to(device)
        if tp_group is not None:  # the stage's part of the plan, then fully_shard: torchtitan's order
            _plan_stage(self.model, tp_group, wrapping[TENSOR_PARALLEL]["plan"], self.spec, where)
        if self.sharded:  # before the optimizer is built over the (sharded) parameters
            shard_modules(self.model, wrapping[DATA_PARALLEL]["modules"], data_group)
        self.meta = checkpoint.meta()
        self.optimizer = _stage_optimizer(code, self.model, self.meta, checkpoint, run)
        self.scheduler = code.scheduler(run, self.optimizer)  # this stage's own, built before any state is loaded
        _load_stage(checkpoint, self.model, self.optimizer, self.meta)
        if self.scheduler is not None:
            self.scheduler.load_state_dict(_scheduler_state(checkpoint, self.meta, self.rank, self.size))
        states = self.meta.get("rank_rng")
        if not isinstance(states, list) or len(states) != self.size:
            raise BadInput(checkpoint.path / "meta.json", f"holds no RNG state for each of the {self.size} ranks (rank_rng)")
        restore_rank_rng(states[self.rank], device, checkpoint.path / "meta.json")
        # the stage's module under DDP over its data-parallel ranks, as recorded; the checks watch the module itself
        run_as = self.model if data_group is None or self.sharded else \
            wrap_ddp(self.model, wrapping[DATA_PARALLEL], device, data_group.get_group())
        stage = PipelineStage(run_as, self.spec["stage"], self.stages, device, group=self.pipeline)
        self.schedule = getattr(schedules, wrapping["schedule"])(
            stage, wrapping["microbatches"], loss_fn=loss_fn, scale_grads=wrapping["scale_grads"])
        self.stage, self.loss_fn = stage, loss_fn
        self.step = checkpoint.step

    def totals(self) -> tuple[int, int]:
        """The stage's parameter and optimizer-state values, whole (a sharded tensor's numel is the whole one's)."""
        state = sum(v.numel() for st in self.optimizer.state.values() for v in st.values()
                    if isinstance(v, torch.Tensor) and v.is_floating_point() and v.ndim)
        return sum(p.numel() for p in self.model.parameters()), state

    def twins(self) -> dict[torch.Tensor, str]:
        """Each parameter's tensor its local gradient accumulates into, by name: under FSDP2 the unsharded one."""
        return unsharded_params(self.model, {p: n for n, p in self.model.named_parameters()})

    def snapshot(self) -> dict[str, Any]:
        return {"model": {k: v.detach().clone() for k, v in self.model.state_dict().items()},
                "grads": loose_grads(self.model, self.optimizer),
                "optimizer": copy.deepcopy(self.optimizer.state_dict()), "rng": rng_state(), "step": self.step,
                "scheduler": copy.deepcopy(self.scheduler.state_dict()) if self.scheduler is not None else None}

    def restore(self, snap: dict[str, Any]) -> None:
        self.model.load_state_dict(snap["model"])
        self.optimizer.load_state_dict(copy.deepcopy(snap["optimizer"]))
        self.optimizer.zero_grad(set_to_none=True)
        put_back(snap["grads"])
        if self.scheduler is not None:
            self.scheduler.load_state_dict(copy.deepcopy(snap["scheduler"]))
        restore_rng(snap["rng"])
        self.step = snap["step"]


def _plan_stage(model: nn.Module, mesh: Any, plan: list[dict[str, Any]], spec: dict[str, Any], where: Any) -> None:
    """The recorded plan's entries of this stage's modules applied on its tensor-parallel ranks; BadInput for an
    entry naming no module of the stage, or a style its module does not take (``parallelize_module`` would skip the
    one with a warning and refuse the other with a traceback)."""
    mine = [e for e in plan if e["module"].partition(".")[0] in spec["modules"]]
    for entry in mine:
        try:
            module = model.get_submodule(entry["module"])
        except AttributeError:
            raise BadInput(where, f"the tensor-parallel plan names {entry['module']!r}, which stage {spec['stage']}'s "
                                  "module does not hold") from None
        if entry["style"] != "sequence" and not isinstance(module, (nn.Linear, nn.Embedding)):
            raise BadInput(where, f"the tensor-parallel plan splits {entry['module']!r} {entry['style']}, but it is a "
                                  f"{type(module).__name__}, not a Linear or an Embedding")
    apply_plan(model, mesh, mine)


def _scheduler_state(checkpoint: Checkpoint, meta: dict[str, Any], rank: int, size: int) -> Any:
    """Rank ``rank``'s LR scheduler state, as the recorder wrote each rank's into meta.json (plain JSON)."""
    states = meta.get(RANK_SCHEDULERS)
    if not isinstance(states, list) or len(states) != size or not isinstance(states[rank], dict):
        raise BadInput(checkpoint.path / "meta.json", f"holds no LR scheduler state for each of the {size} ranks "
                                                      f"({RANK_SCHEDULERS}), which the manifest's scheduler needs")
    return state_from_json(states[rank], None, checkpoint.path / "meta.json")


def _groups(wrapping: dict[str, Any], device: torch.device) -> tuple[Any, Any, Any]:
    """This rank's pipeline (the ranks of every stage at its place in the stage) as a process group, its stage's
    data-parallel ranks as a mesh, and its tensor-parallel ranks as one (None without): torchtitan's (pp, dp) or
    (pp, dp_shard, tp) DeviceMesh made again; (None, None, None) on one rank per stage: the pipeline is every rank."""
    from torch.distributed.device_mesh import init_device_mesh

    if stage_width(wrapping) == 1:
        return None, None, None
    stages, dp = len(wrapping["stages"]), dp_size(wrapping)
    if TENSOR_PARALLEL not in wrapping:
        mesh = init_device_mesh(device.type, (stages, dp), mesh_dim_names=("pp", "dp"))
        return mesh["pp"].get_group(), mesh["dp"], None
    mesh = init_device_mesh(device.type, (stages, dp, tp_size(wrapping)), mesh_dim_names=("pp", "dp_shard", "tp"))
    return mesh["pp"].get_group(), mesh["dp_shard"], mesh["tp"]


def _stage_optimizer(code: UserCode, model: nn.Module, meta: dict[str, Any], checkpoint: Checkpoint,
                     run: Run) -> torch.optim.Optimizer:
    """The stage's optimizer: its factory's, or the recorded class over the param groups of this stage's parameters."""
    where = run.path / "manifest.json"
    if code.optimizer_factory is not None:
        try:
            return code.optimizer_factory(model)
        except Exception as e:
            raise BadInput(where, f"optimizer.factory raised {e.__class__.__name__}: {e}") from None
    named = dict(model.named_parameters(remove_duplicate=False))
    mine = _stage_groups(meta, model)
    held = [n for g in mine for n in g["params"]]
    # a parameter of the stage in no group is one its optimizer does not hold (its gradient carries over), as on one
    # process; a group of two stages' parameters, or a parameter in two groups, no recorder wrote
    if not set(held) <= set(named) or len(set(held)) != len(held):
        raise BadInput(checkpoint.path / "meta.json", "its param groups mix this stage's parameters with another "
                                                      "stage's, or hold one twice")
    groups = [{**g, "params": [named[n] for n in g["params"]]} for g in mine]
    try:
        return code.optimizer_class(groups)
    except Exception as e:
        raise BadInput(where, f"cannot rebuild optimizer {run.manifest.optimizer_class}: {e}") from None


def _stage_groups(meta: dict[str, Any], model: nn.Module) -> list[dict[str, Any]]:
    """The recorded param groups of this stage's parameters (by name), in the recorded order."""
    named = dict(model.named_parameters(remove_duplicate=False))
    return [g for g in meta["param_groups"] if any(n in named for n in g["params"])]


def _load_stage(checkpoint: Checkpoint, model: nn.Module, optimizer: torch.optim.Optimizer,
                meta: dict[str, Any]) -> None:
    """This stage's part of the checkpoint: its parameters and buffers, its optimizer state, the gradients of its
    parameters the optimizer does not hold."""
    expected = model.state_dict()
    tensors = {k: v for k, v in checkpoint.model_tensors().items() if k in expected}
    for name, tensor in tensors.items():
        if tensor.dtype != expected[name].dtype:
            raise BadInput(checkpoint.model_file, f"tensor {name!r} is {tensor.dtype}, the stage holds {expected[name].dtype}")
        tensors[name] = shard_like(tensor, expected[name])  # FSDP2: this rank's shard of the whole tensor
    try:
        model.load_state_dict(tensors)
    except RuntimeError as e:
        raise BadInput(checkpoint.model_file, f"does not fit the stage: {' '.join(str(e).split())[:300]}") from None
    params = optimizer_params(optimizer)
    names = [n for n in meta["param_names"] if n in expected]
    by_name = dict(model.named_parameters(remove_duplicate=False))
    order = {id(p): i for i, p in enumerate(params)}
    index = {n: order[id(by_name[n])] for n in names if id(by_name[n]) in order}
    state: dict[int, dict[str, Any]] = {}
    for key, tensor in checkpoint.optimizer_tensors():
        name, _, skey = key.rpartition("/")
        if name in index:
            tensor = shard_like(tensor, by_name[name])
            state.setdefault(index[name], {})[skey] = tensor
    for name, values in meta["state_scalars"].items():
        if name in index:
            state.setdefault(index[name], {}).update(values)
    # the recorded hyperparameters (an LR scheduler's lr at the checkpoint: building one reset it), this optimizer's
    # parameters
    groups = optimizer.state_dict()["param_groups"]
    recorded = _stage_groups(meta, model)
    if len(recorded) == len(groups):
        groups = [{**{k: v for k, v in r.items() if k != "params"}, "params": g["params"]} for r, g in zip(recorded, groups)]
    try:
        optimizer.load_state_dict({"state": state, "param_groups": groups})
    except (ValueError, KeyError, RuntimeError) as e:
        raise BadInput(checkpoint.optimizer_file, f"does not fit the stage's optimizer: {e}") from None
    checkpoint.put_back_loose_grads(meta, model, optimizer, stage=True)


# The order the pipeline computes a micro-batch's values in: forward stage by stage, the loss, backward from the
# last stage back; the update after every micro-batch.
_PHASES = {"forward": 0, "loss": 1, "grad": 2, "optimizer_state": 3, "param": 4, "buffer": 5}


class _Watch:
    """The checks on one stage during one step: which micro-batch is under way, and the first non-finite value of
    each module output, gradient and loss, with the micro-batch it arose in."""

    def __init__(self, s: _Stage) -> None:
        self.s = s
        self.mb: int | None = None  # the micro-batch whose forward or backward is under way
        self.forwarded = 0  # the micro-batch forwarded last: the loss that follows is its
        self.one_tensor = True  # the stage's forward returned one tensor each time (what group testing hands on)
        self.events: list[tuple[tuple, Event]] = []
        self.seen: set[tuple[str, str]] = set()
        self.inputs: dict[int, Any] = {}   # stage 0: each micro-batch's args
        self.targets: dict[int, Any] = {}  # last stage: each micro-batch's target
        self.losses: list[float] = []
        self.step = s.step
        self.handles: list[Any] = []

    def __enter__(self) -> "_Watch":
        s = self.s
        fwd, bwd, loss = s.stage.forward_one_chunk, s.stage.backward_one_chunk, s.schedule._compute_loss

        def forward(i: int, args: Any, *a: Any, **k: Any) -> Any:
            self.mb = self.forwarded = i
            self.inputs[i] = args
            try:
                out = fwd(i, args, *a, **k)
                self.one_tensor = self.one_tensor and isinstance(out, torch.Tensor)
                return out
            finally:
                self.mb = None

        def backward(i: int, *a: Any, **k: Any) -> Any:
            self.mb = i
            try:
                return bwd(i, *a, **k)
            finally:
                self.mb = None

        def compute_loss(output: Any, target: Any, *a: Any) -> Any:
            """Right after the forward pass of the micro-batch it scores."""
            value = loss(output, target, *a)
            self.targets[self.forwarded] = target
            self.losses.append(float(value.detach().float()))
            self._check("loss", "loss", value, self.forwarded)
            return value

        s.stage.forward_one_chunk, s.stage.backward_one_chunk = forward, backward
        s.schedule._compute_loss = compute_loss
        for name, m in s.model.named_modules():
            if name:
                self.handles.append(m.register_forward_hook(lambda mod, args, out, name=name: self._outputs(name, out)))
        for p, name in s.twins().items():  # the local gradients, before DDP or FSDP2 averages them
            if p.requires_grad:
                self.handles.append(p.register_post_accumulate_grad_hook(
                    lambda p, name=name: self._check("grad", name, p.grad)))
        return self

    def __exit__(self, *exc: object) -> None:
        s = self.s
        for attr in ("forward_one_chunk", "backward_one_chunk"):
            del s.stage.__dict__[attr]
        del s.schedule.__dict__["_compute_loss"]
        for h in self.handles:
            h.remove()

    def _outputs(self, name: str, out: Any) -> None:
        tensors = [out] if isinstance(out, torch.Tensor) else [t for t in (out if isinstance(out, (list, tuple)) else [])
                                                               if isinstance(t, torch.Tensor)]
        for t in tensors:
            if t.is_floating_point():
                self._check("forward", name, t)

    def _check(self, stage: str, name: str, t: torch.Tensor | None, mb: int | None = -1, key: str | None = None) -> None:
        mb = self.mb if mb == -1 else mb
        # outside a micro-batch, the stage's shape inference runs its forward on uninitialised tensors: not the run's;
        # a DTensor the placements replicate over tensor-parallel ranks is reported by the copy that speaks for it
        if t is None or (stage, f"{name}/{key}") in self.seen or (mb is None and stage in ("forward", "grad")) \
                or not speaks_for(t):
            return
        held, offset = local_part(t.detach())  # an FSDP2 shard is checked where it lies in the whole tensor
        where = locate(held)
        if where is None:
            return
        self.seen.add((stage, f"{name}/{key}"))
        index = [i + o for i, o in zip(where.index, offset)] if offset else where.index
        e = Event(self.step, stage, name, index, where.value, state_key=key, dtype=str(t.dtype).removeprefix("torch."),
                  rank=self.s.rank, elements_nonfinite=int((~torch.isfinite(held)).sum()), tensors_nonfinite=1)
        self.events.append(((mb, stage), e))

    def after_step(self) -> None:
        """The update: parameters, optimizer state and buffers after ``optimizer.step()``."""
        s = self.s
        names = {id(p): n for n, p in s.model.named_parameters()}
        for p, st in s.optimizer.state.items():
            for key, value in st.items():
                if isinstance(value, torch.Tensor) and value.is_floating_point() and value.ndim:
                    self._check("optimizer_state", names.get(id(p), "?"), value, None, key)
        for name, p in s.model.named_parameters():
            self._check("param", name, p, None)
        for name, b in s.model.named_buffers():
            if b.is_floating_point():
                self._check("buffer", name, b, None)


def _order(item: tuple[tuple, Event], stages: int, n: int, width: int) -> tuple:
    """An event's place in the step's computation (see ``_PHASES``); the pipelines side by side, in the order of
    their places in a stage (data-parallel rank, then tensor-parallel rank)."""
    (mb, phase), e = item
    stage, pipeline = divmod(e.rank if e.rank is not None else 0, width)
    return (n if mb is None else mb, _PHASES[phase], stage if phase == "forward" else stages - stage, pipeline, e.tensor)


# what the update writes: the same in every DDP copy of a stage, reported by data-parallel rank 0's alone (FSDP2's
# shards are each rank's own)
_REPLICATED = ("optimizer_state", "param", "buffer")



def replay_pipeline(run: Any, code: Any, start: Callable[[], Any], device: torch.device, opts: Any,
                    progress: Progress = SILENT) -> ReplayReport:
    """Replay a pipeline-parallel run from the checkpoint ``start`` finds, one stage on each rank of this torchrun
    job; refused on one process, before any checkpoint is read."""
    from ..rootcause.findings import narrate
    from ..runs import imports

    if run.manifest.scaler_enabled is not None:  # no recorder writes one: refused at any world size
        raise BadInput(run.path / "manifest.json", f"names a GradScaler (scaler) with a pipeline schedule, which "
                                                   f"nanforensics does not replay: {SCALER_WHY}")
    if not (dist.is_available() and dist.is_initialized()):
        raise BadInput(run.path, one_process_refusal(run))
    if not isinstance(run, Run) or not isinstance(code, UserCode):
        raise BadInput(run.path, "a pipeline-parallel run is replayed from its own recording")
    checkpoint = start()
    world = run.world
    assert world is not None
    wrapping = world.wrapping
    loss_fn = imports.load_callable("distributed.wrapping.loss_fn", wrapping["loss_fn"], where=run.path / "manifest.json",
                                    search_paths=opts.code_paths, forbidden=None if opts.trust_run_dir else run.path,
                                    trust_code=opts.trust_code, trust_packages=opts.trust_packages)
    s = _Stage(run, code, checkpoint, device, loss_fn)
    n, stages, dp, size = wrapping["microbatches"], s.stages, dp_size(wrapping), world.world_size
    width = stage_width(wrapping)
    if dp > 1 and not s.sharded and checkpoint.step > run.manifest.start_step:
        _warm_up(run, code, s, device)
    logged = {st.step: st.loss for st in run.steps}
    logged_mb = [logged_microbatch_losses(run, j) for j in batch_pipelines(wrapping)]  # by data-parallel rank
    last = run.last_step if opts.max_steps is None else min(run.last_step or 0, checkpoint.step + opts.max_steps - 1)
    assert last is not None
    progress.phase(f"replaying {span(checkpoint.step, last)}, one stage per rank", last - checkpoint.step + 1)
    spread: list[StepRecord] = []
    events: list[Event] = []
    origin_item: tuple[tuple, Event] | None = None
    # (the event to explain, the state before its step, that step's micro-batches): the origin's, or else the first
    # loss-only step's
    explained: tuple[tuple[tuple, Event], dict[str, Any], tuple[Any, Any, bool]] | None = None
    loss_explained: tuple[tuple[tuple, Event], dict[str, Any], tuple[Any, Any, bool]] | None = None
    loss_only: list[int] = []
    replayed_mb: dict[int, list[list[float]]] = {}
    later = {c.step: c for c in run.checkpoints() if c.step > checkpoint.step}
    compared: list[CheckpointComparison] = []
    while s.step <= last:
        step = s.step
        snap = s.snapshot() if origin_item is None else None
        with _Watch(s) as watch:
            value = _step(run, code, s, device)
            watch.after_step()
        gathered: list[Any] = [None] * size
        dist.all_gather_object(gathered, (watch.events, value, watch.losses, s.totals()), group=object_group())
        lasts = [gathered[last_rank(wrapping, j)] for j in batch_pipelines(wrapping)]
        loss = mean_loss([g[1] for g in lasts])  # as the run's loss is read: the mean over the batches' pipelines
        replayed_mb[step] = [g[2] for g in lasts]
        found = sorted((item for r, g in enumerate(gathered) for item in g[0]
                        if pipeline_of(wrapping, r) == 0 or s.sharded or item[0][1] not in _REPLICATED),
                       key=lambda item: _order(item, stages, n, width))
        events += [e for _, e in found]
        params_total, state_total = (sum(g[3][i] for g in gathered[::width]) for i in (0, 1))  # each stage's, whole
        logged_loss = logged.get(step)
        spread.append(StepRecord(step, logged_loss, loss, _bad(found, "param"), params_total,
                                 _bad(found, "optimizer_state"), state_total,
                                 loss_ulps=float32_ulps(logged_loss, loss) if logged_loss is not None else None))
        if found and origin_item is None:
            captured = (found[0], snap, (watch.inputs, watch.targets, watch.one_tensor))
            if {e.stage for _, e in found} <= LOSS_ONLY_STAGES:  # nothing reached a gradient or the state: no origin
                loss_only.append(step)
                events = events[:-len(found)]
                loss_explained = loss_explained or captured
            else:
                origin_item = found[0]
                explained = captured
        s.step += 1
        if s.step in later and all(c.matched for c in compared):  # the recorded state after this step
            compared.append(_compare(s, later[s.step]))
        progress.update(step - checkpoint.step + 1)
        if origin_item is not None and step >= origin_item[1].step + opts.after:
            break
    origin = origin_item[1] if origin_item else None
    report = _report(run, checkpoint, device, code, spread, events, origin, compared, loss_only)
    explained = explained or loss_explained
    if explained is not None:
        ((mb, _), event), before, captured = explained
        rank = event.rank or 0
        stage_index, pipeline = divmod(rank, width)
        batch = dp_rank(wrapping, rank)  # whose batch the pipeline ran
        first = stage_rank(wrapping, 0, pipeline)  # the rank that holds this pipeline's inputs
        rows = _rows(_batch_rows(run, event.step, first), n, mb) if mb is not None else []
        rows_text = f" (rows {rows[0]}-{rows[-1]})" if rows else ""
        at = f" ({coordinate_text(wrapping, rank)})" if width > 1 else ""
        report.pipeline = PipelineOrigin(
            stage_index, rank, mb, n, wrapping["schedule"], [rows[0], rows[-1] + 1] if rows else [],
            logged_mb[batch].get(event.step, []), replayed_mb.get(event.step, [[]] * dp)[batch],
            text=f"stage {stage_index}{at}, " + (f"micro-batch {mb} of {n}" if mb is not None else "the update"),
            batch_text=f", micro-batch {mb} of {n}{rows_text}, stage 0's inputs{at}" if mb is not None else "",
            mesh=coordinate(wrapping, rank) if width > 1 else {})
        if mb is not None and opts.explain and event.stage != "param":
            s.restore(before)
            report.samples = _attribute(run, s, event, mb, rows, captured, first, progress)
            report.responsible_batch = _responsible(run, event.step, rows, first)
        report.findings = pipeline_findings(report, event)
    report.data_defects = check_batches(run, [r.step for r in spread], opts.data_max_abs)  # each rank's batches
    return narrate(report)


def _warm_up(run: Run, code: UserCode, s: _Stage, device: torch.device) -> None:
    """The stage's DDP as the run's was past its first step. DDP lays its buckets out again after its first
    iteration (in the order gradients became ready), and a pipeline schedule, whose every micro-batch's forward
    prepares DDP's reducer, averages a bucket's gradients after the micro-batch that completes it: so the layout
    decides the sums, and a fresh DDP at a later checkpoint would not sum as the run did (measured: 2 ulps at the
    next checkpoint). The first replayed step runs once, unwatched, and the stage's state is put back."""
    snap = s.snapshot()
    _step(run, code, s, device)
    s.restore(snap)


def _step(run: Run, code: UserCode, s: _Stage, device: torch.device) -> float | None:
    """The user's step function on this rank's batch of the stage's next step; the step's loss on a last stage."""
    batch = map_tensors(run.batch(s.step, s.rank), lambda t: t.to(device))
    extras = {"scheduler": s.scheduler} if s.scheduler is not None else {}  # as one process passes it
    try:
        returned = code.step_fn(s.schedule, s.optimizer, batch, **extras)
        return float(step_loss(returned)) if s.last else None
    except BadInput:
        raise
    except Exception as e:
        raise BadInput(run.code_file, f"step function {code.step_name} raised {e.__class__.__name__} at step "
                                      f"{s.step} on stage {s.spec['stage']}: {e}") from None


def _bad(found: list[tuple[tuple, Event]], stage: str) -> int:
    return sum(e.elements_nonfinite for _, e in found if e.stage == stage)


def _batch_rows(run: Run, step: int, first: int) -> int:
    """The step's batch size, as the first stage's batch holds it (on rank ``first``)."""
    from ..rootcause.samples import batch_size

    return batch_size(run.batch(step, first)) or 0


def _rows(size: int, n: int, mb: int) -> list[int]:
    """The rows of a batch of ``size`` that micro-batch ``mb`` of ``n`` holds: the schedule splits along dimension 0
    with ``torch.tensor_split``."""
    return torch.tensor_split(torch.arange(size), n)[mb].tolist()


def _responsible(run: Run, step: int, rows: list[int], first: int) -> BatchRef:
    """The micro-batch's rows of the first stage's batch (on rank ``first``): its non-tensor leaves (sample ids)."""
    batch = run.batch(step, first)
    size = _batch_rows(run, step, first)
    leaves = {p: [v[i] for i in rows] if per_sample(v, size) else v for p, v in data_leaves(batch, size=size)}
    return BatchRef(step, str(run.batch_file(step, first)), leaves, first)


def _attribute(run: Run, s: _Stage, origin: Event, mb: int, rows: list[int], captured: tuple[Any, Any, bool],
               first: int, progress: Progress) -> SampleAttribution:
    """Group testing within micro-batch ``mb``, every rank together: each subset runs through the stages from the
    state before the step (every pipeline on the same rows of its own micro-batch); the origin's rank says whether
    the origin's tensor turned non-finite."""
    inputs, targets, one_tensor = captured
    size = len(rows)
    each: list[Any] = [None] * s.size
    dist.all_gather_object(each, one_tensor, group=object_group())
    if not all(each):
        return SampleAttribution("unsplittable", size, [], {}, 0, [], "a stage's forward returned more than one "
                                 "tensor: group testing hands one tensor from stage to stage")
    snap = s.snapshot()
    passes = [0]

    def fails(indices: list[int]) -> bool:
        passes[0] += 1
        s.restore(snap)
        args = select(inputs.get(mb), indices, size) if s.spec["stage"] == 0 else None
        target = select(targets.get(mb), indices, size) if s.last else None
        bad = _subset_pass(s, origin, args, target)
        verdict = [bad]
        dist.broadcast_object_list(verdict, src=origin.rank or 0, group=object_group())
        return bool(verdict[0])

    progress.phase(f"attributing samples of micro-batch {mb} at step {origin.step}, one stage per rank", None)
    try:
        if not fails(list(range(size))):
            return SampleAttribution("not_reproduced", size, [], {}, passes[0], [],
                                     f"micro-batch {mb} alone, forward and backward through every stage, stays finite")
        found = split_batch(size, fails)
    finally:
        s.restore(snap)
    batch = run.batch(origin.step, first)
    whole = _batch_rows(run, origin.step, first)
    leaves = {p: [v[rows[i]] for i in found.samples] for p, v in data_leaves(batch, size=whole) if per_sample(v, whole)}
    located = [[mb, i] for i in found.samples]
    listed = ", ".join(map(str, found.samples))
    if found.status == "attributed":
        message = (f"{'samples' if len(found.samples) > 1 else 'sample'} {listed} of micro-batch {mb} ({size} samples) "
                   f"{'produce' if len(found.samples) > 1 else 'produces'} the non-finite value alone "
                   f"({judged_text(found, size, count(passes[0], 'pass', 'passes') + ' through the stages')})")
    else:
        message = f"{found.status}: samples {listed} of micro-batch {mb} ({passes[0]} passes through the stages)"
    return SampleAttribution(found.status, size, found.samples, leaves, passes[0], found.coupled, message, located,
                             judged=found.judged)


def _subset_pass(s: _Stage, origin: Event, args: Any, target: Any) -> bool:
    """One micro-batch's forward and backward through the stages, activations and gradients handed from rank to rank
    (every rank takes part in each hand-over); on the origin's rank, whether the origin's tensor turned non-finite."""
    group = s.pipeline or object_group()  # each pipeline hands over within itself
    stage, stages = s.spec["stage"], s.stages
    ranks = [stage_rank(s.wrapping, hop, s.line) for hop in range(stages)]  # the global rank of each stage
    seen: list[bool] = [False]

    def watch(t: Any) -> None:
        # this rank's shard alone: a DTensor's own reductions are collectives, and only the origin's rank watches
        if isinstance(t, torch.Tensor) and locate(local_part(t.detach())[0]) is not None:
            seen[0] = True

    handles = []
    mine = s.rank == origin.rank
    if mine and origin.stage == "forward":
        handles.append(s.model.get_submodule(origin.tensor).register_forward_hook(lambda m, a, out: watch(out)))
    elif mine and origin.stage == "grad":
        twin = next(p for p, name in s.twins().items() if name == origin.tensor)
        handles.append(twin.register_post_accumulate_grad_hook(lambda p: watch(p.grad)))
    try:
        out = None
        received = None
        for hop in range(stages):
            if hop == stage:
                x = args if stage == 0 else received
                x = x if isinstance(x, tuple) else (x,)
                if stage:
                    x = tuple(t.detach().requires_grad_(t.is_floating_point()) for t in x)
                inputs = x
                out = s.model(*x)
            box = [out.detach() if hop == stage and isinstance(out, torch.Tensor) else None]
            if hop < stages - 1:
                dist.broadcast_object_list(box, src=ranks[hop], group=group)
                if hop + 1 == stage:
                    received = box[0]
        grads: Any = None
        for hop in reversed(range(stages)):
            if hop == stage:
                if s.last:
                    value = s.loss_fn(out, target)
                    if mine and origin.stage == "loss":
                        watch(value)
                    torch.autograd.backward(value)
                else:
                    torch.autograd.backward(out, grad_tensors=grads)
                sent = inputs[0].grad if stage and inputs and isinstance(inputs[0], torch.Tensor) else None
            else:
                sent = None
            box = [sent]
            if hop > 0:
                dist.broadcast_object_list(box, src=ranks[hop], group=group)
                if hop - 1 == stage:
                    grads = box[0]
    finally:
        for h in handles:
            h.remove()
        s.optimizer.zero_grad(set_to_none=True)
    return seen[0]


def _compare(s: _Stage, checkpoint: Checkpoint) -> CheckpointComparison:
    """Every stage's state against the recorded checkpoint, each rank its own tensors; the first mismatch is the
    earliest stage's, with its rank."""
    mine = compare_checkpoint(s.model, s.optimizer, checkpoint, held_only=True)
    if mine.first_mismatch is not None:
        mine.first_mismatch.rank = s.rank
    parts: list[Any] = [None] * s.size
    dist.all_gather_object(parts, mine, group=object_group())
    parts = parts[::stage_width(s.wrapping)]  # a stage's other ranks compare the same (whole) tensors again
    first = next((p.first_mismatch for p in parts if p.first_mismatch is not None), None)
    return CheckpointComparison(
        checkpoint.step, str(checkpoint.path), sum(p.tensors for p in parts), all(p.exact for p in parts),
        sum(p.mismatched_tensors for p in parts), first, sum(p.values for p in parts), sum(p.nan_matched for p in parts),
        error=next((p.error for p in parts if p.error), None), rounded=sum(p.rounded for p in parts),
        max_ulps=max((p.max_ulps for p in parts if p.max_ulps is not None), default=None))


def _report(run: Run, checkpoint: Checkpoint, device: torch.device, code: UserCode, spread: list[StepRecord],
            events: list[Event], origin: Event | None, compared: list[CheckpointComparison],
            loss_only: list[int]) -> ReplayReport:
    from ..runs.cpu import this_cpu
    from ..runs.steplog import first_nonfinite

    world = run.world
    assert world is not None
    diverged = judge(spread, compared, 0.0, LOSS_ULPS)
    setup = ReplaySetup(str(run.path), checkpoint.step, spread[0].step if spread else checkpoint.step,
                        spread[-1].step if spread else checkpoint.step, str(device), torch.get_num_threads(),
                        code.imported, world_size=world.world_size, wrapping=PIPELINE, ranks_replayed="torchrun",
                        **({"recorded_cpu": run.cpu, "replay_cpu": this_cpu()} if device.type == "cpu" else {}))
    logged_nan = {r.step for r in spread if r.logged_loss is not None and not math.isfinite(r.logged_loss)}
    verdict = "nonfinite" if origin is not None else "not_reproduced" if logged_nan and (
        diverged is not None or not set(loss_only) >= logged_nan) else "loss_only" if loss_only else "clean"
    return ReplayReport(
        verdict=verdict, responsible_step=origin.step if origin else None, responsible_batch=None,
        first_nonfinite_loss_step=next((r.step for r in spread if not math.isfinite(r.replayed_loss)), None),
        logged_first_nonfinite_loss_step=first_nonfinite(run.steps), origin=origin, events=events, spread=spread,
        state_poisoned=any(e.stage == "optimizer_state" for e in events), reproduced=diverged is None,
        diverged_at_step=diverged, fully_nonfinite_step=next(
            (r.step for r in spread if r.params_total and r.params_nonfinite == r.params_total), None),
        findings=[], setup=setup, checkpoints_compared=compared, loss_only_steps=loss_only,
        loss_max_ulps=max((r.loss_ulps for r in spread if r.loss_ulps is not None), default=None))


def pipeline_findings(r: ReplayReport, e: Event) -> list[str]:
    """Where ``e`` (the origin, or the first loss-only step's loss) arose in words: step, stage and rank, micro-batch
    and sample, tensor and coordinate."""
    from ..rootcause.findings import describe

    p = r.pipeline
    assert p is not None
    what = describe(Event(e.step, e.stage, e.tensor, e.index, e.value, state_key=e.state_key))
    where = f"stage {p.stage} (rank {p.rank}" + "".join(f", {k}={v}" for k, v in p.mesh.items()) + ")"
    if p.microbatch is None:
        return [f"At step {e.step}, {where}'s update made {what} after all {p.microbatches} micro-batches "
                f"({p.schedule})."]
    only = "; no gradient, parameter or optimizer state turned non-finite" if r.origin is None else ""
    out = [f"At step {e.step}, micro-batch {p.microbatch} of {p.microbatches} ({p.schedule}; rows {p.rows[0]}-"
           f"{p.rows[1] - 1} of the step's batch) made {what} on {where}{only}."]
    sa = r.samples
    if sa is not None and sa.status == "attributed":
        ids = "; ".join(f"{k} = {v!r}" for k, v in sa.sample_leaves.items())
        out.append(f"Sample {', '.join(map(str, sa.samples))} of micro-batch {p.microbatch} alone makes it"
                   + (f" ({ids})." if ids else "."))
    elif sa is not None:
        out.append(sa.message)
    if p.logged_microbatch_losses:
        listed = ", ".join(f"{x:.6g}" if math.isfinite(x) else value_name(x) for x in p.logged_microbatch_losses)
        out.append(f"The last stage logged micro-batch losses [{listed}] at step {e.step}.")
    return out
