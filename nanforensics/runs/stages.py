"""The ``distributed`` section of a pipeline-parallel run's manifest: its schedule and which modules each stage holds.

A run trained with ``torch.distributed.pipelining`` (one ``PipelineStage`` per rank, a single-stage schedule such as
``ScheduleGPipe`` or ``Schedule1F1B``) is recorded with ``wrapping.kind`` "pipeline" and::

    {"kind": "pipeline", "schedule": "ScheduleGPipe", "microbatches": 4, "scale_grads": true,
     "loss_fn": "train.py:loss_fn", "stages": [{"stage": 0, "rank": 0, "modules": ["0", "1"]}, ...]}

Each stage's module is the model its ``model_factory`` builds with every top-level child but ``modules`` removed, so a
parameter keeps the name it has in the whole model, on every stage and in every checkpoint. Torch-free: the manifest
is read before anything imports torch.

Pipeline x data parallelism (torchtitan's layout: ``init_device_mesh(device, (pp, dp), mesh_dim_names=("pp", "dp"))``,
each stage's module under DistributedDataParallel or ``fully_shard`` over its ``dp`` group) adds ``"data_parallel":
{"size": dp, ...DDP's options}`` or ``{"size": dp, "modules": [...FSDP2's, as an FSDP2 run's wrapping lists them]}``:
stage i runs on ranks ``i * dp`` to ``i * dp + dp - 1`` (its ``rank`` is the first of them), and data-parallel rank j
of every stage is one pipeline, fed its own batch. Without the key, ``dp`` is 1.

FSDP2 x TP x PP (torchtitan's 3-D layout: a ``(pp, dp_shard, tp)`` mesh, each stage's module given its
tensor-parallel plan by ``parallelize_module`` on ``tp``, then ``fully_shard`` on ``dp_shard``) adds
``"tensor_parallel": {"size": tp, "plan": [...the plan's entries, as a mesh run's]}``: each stage runs on ``dp * tp``
ranks, stage i's first at ``i * dp * tp``, rank ``i * dp * tp + j * tp + t`` its data-parallel rank j and
tensor-parallel rank t, and each ``(j, t)`` one pipeline; the ``tp`` pipelines of data-parallel rank j share a batch.
Without the key, ``tp`` is 1.
"""

from __future__ import annotations

from typing import Any

from ..errors import shown

PIPELINE = "pipeline"
# the single-stage schedules replay rebuilds: each runs every micro-batch's forward and backward once, in order
SCHEDULES = ("ScheduleGPipe", "Schedule1F1B")
MAX_MICROBATCHES = 1 << 16
OPTIONS = ("schedule", "microbatches", "scale_grads", "loss_fn", "stages")
DATA_PARALLEL = "data_parallel"  # optional: the data-parallel size and DDP's options on every stage
TENSOR_PARALLEL = "tensor_parallel"  # optional: the tensor-parallel size and the plan inside every stage
MAX_RANKS = 1 << 20  # a world beyond any job's is damage


def pipeline_problem(options: dict[str, Any], world_size: int) -> str | None:
    """What is wrong with a pipeline run's ``wrapping`` (untrusted input), or None (DDP's options under
    ``data_parallel`` are the caller's to check, with a DDP run's)."""
    if set(options) - {DATA_PARALLEL, TENSOR_PARALLEL} != set(OPTIONS):
        return f"of a pipeline run needs exactly {', '.join(OPTIONS)} (and {DATA_PARALLEL}, {TENSOR_PARALLEL}), not " \
               f"{shown(sorted(map(str, options)))}"
    for key, what in ((DATA_PARALLEL, "DDP's options"), (TENSOR_PARALLEL, "plan")):
        part = options.get(key, {"size": 1})
        if not (isinstance(part, dict) and type(part.get("size")) is int and 1 <= part["size"] <= MAX_RANKS):
            return f"{key} {shown(part)} is not {{size, {what}}} with a size from 1 to {MAX_RANKS}"
    if TENSOR_PARALLEL in options and "modules" not in options.get(DATA_PARALLEL, {}):
        return f"{TENSOR_PARALLEL} needs each stage under fully_shard over its data-parallel ranks ({DATA_PARALLEL} " \
               "with modules): the one layout with tensor parallelism inside a stage this nanforensics replays"
    schedule, count, scale = options["schedule"], options["microbatches"], options["scale_grads"]
    if schedule not in SCHEDULES:
        return f"schedule {shown(schedule)}: this nanforensics replays {' and '.join(SCHEDULES)} (one stage per " \
               "rank; an interleaved or zero-bubble schedule puts several stages on a rank)"
    if type(count) is not int or not 1 <= count <= MAX_MICROBATCHES:
        return f"microbatches {shown(count)} is not a count from 1 to {MAX_MICROBATCHES}"
    if not isinstance(scale, bool):
        return f"scale_grads {shown(scale)} is not true or false"
    if not isinstance(options["loss_fn"], str) or not options["loss_fn"]:
        return f"loss_fn {shown(options['loss_fn'])} is not an import string"
    stages, size = options["stages"], stage_width(options)
    if not isinstance(stages, list) or len(stages) * size != world_size:
        return f"stages {shown(stages)} is not a list of one stage per {size} ranks of {world_size}"
    seen: set[str] = set()
    for i, spec in enumerate(stages):
        if not (isinstance(spec, dict) and set(spec) == {"stage", "rank", "modules"} and type(spec["stage"]) is int
                and type(spec["rank"]) is int and isinstance(spec["modules"], list) and spec["modules"]
                and all(isinstance(m, str) and m for m in spec["modules"])):
            return f"stage {shown(spec)} is not {{stage, rank, modules}} as the recorder writes it"
        if spec["stage"] != i or spec["rank"] != i * size:
            return f"stage {shown(spec['stage'])} on rank {shown(spec['rank'])} is not stage {i} on rank {i * size}"
        if seen & set(spec["modules"]):
            return f"module {shown(sorted(seen & set(spec['modules']))[0])} is held by two stages"
        seen |= set(spec["modules"])
    return None


def dp_size(wrapping: dict[str, Any]) -> int:
    """How many data-parallel ranks run each stage (a validated ``wrapping``): 1 without data parallelism."""
    return int(wrapping.get(DATA_PARALLEL, {"size": 1})["size"])


def tp_size(wrapping: dict[str, Any]) -> int:
    """How many tensor-parallel ranks split each stage's layers: 1 without tensor parallelism."""
    return int(wrapping.get(TENSOR_PARALLEL, {"size": 1})["size"])


def stage_width(wrapping: dict[str, Any]) -> int:
    """How many ranks run each stage: its data-parallel times its tensor-parallel ranks."""
    return dp_size(wrapping) * tp_size(wrapping)


def stage_of(wrapping: dict[str, Any], rank: int) -> dict[str, Any]:
    """The stage ``rank`` runs (a validated ``wrapping``)."""
    return wrapping["stages"][rank // stage_width(wrapping)]


def pipeline_of(wrapping: dict[str, Any], rank: int) -> int:
    """Which pipeline global rank ``rank`` is part of (its ranks, one per stage, hand activations to each other):
    ``dp_rank * tp + tp_rank``."""
    return rank % stage_width(wrapping)


def dp_rank(wrapping: dict[str, Any], rank: int) -> int:
    """The data-parallel rank of global rank ``rank``: whose batch its pipeline runs."""
    return pipeline_of(wrapping, rank) // tp_size(wrapping)


def batch_pipelines(wrapping: dict[str, Any]) -> list[int]:
    """One pipeline per batch (data-parallel rank j's tensor-parallel rank 0), in data-parallel rank order: the run's
    loss is the mean of their last stages'."""
    return [j * tp_size(wrapping) for j in range(dp_size(wrapping))]


def stage_rank(wrapping: dict[str, Any], stage: int, pipeline: int = 0) -> int:
    """The global rank that runs stage ``stage`` in pipeline ``pipeline``."""
    return stage * stage_width(wrapping) + pipeline


def last_rank(wrapping: dict[str, Any], pipeline: int = 0) -> int:
    """The rank of the last stage of pipeline ``pipeline``: the one that computes its losses."""
    return stage_rank(wrapping, len(wrapping["stages"]) - 1, pipeline)


def coordinate(wrapping: dict[str, Any], rank: int) -> dict[str, int]:
    """Global rank ``rank``'s place on the mesh, as torchtitan names its dimensions: {"pp", "dp"} and, with tensor
    parallelism, "tp"."""
    at = {"pp": rank // stage_width(wrapping), "dp": dp_rank(wrapping, rank)}
    return at | ({"tp": rank % tp_size(wrapping)} if TENSOR_PARALLEL in wrapping else {})


def coordinate_text(wrapping: dict[str, Any], rank: int) -> str:
    """Global rank ``rank``'s place, "pp=1, dp=0" (", tp=1" with tensor parallelism)."""
    return ", ".join(f"{k}={v}" for k, v in coordinate(wrapping, rank).items())
