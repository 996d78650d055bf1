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
MAX_RANKS = 1 << 20  # a world beyond any job's is damage


def pipeline_problem(options: dict[str, Any], world_size: int) -> str | None:
    """What is wrong with a pipeline run's ``wrapping`` (untrusted input), or None (DDP's options under
    ``data_parallel`` are the caller's to check, with a DDP run's)."""
    if set(options) - {DATA_PARALLEL} != set(OPTIONS):
        return f"of a pipeline run needs exactly {', '.join(OPTIONS)} (and {DATA_PARALLEL}), not " \
               f"{shown(sorted(map(str, options)))}"
    dp = options.get(DATA_PARALLEL, {"size": 1})
    if not (isinstance(dp, dict) and type(dp.get("size")) is int and 1 <= dp["size"] <= MAX_RANKS):
        return f"{DATA_PARALLEL} {shown(dp)} is not {{size, DDP's options}} with a size from 1 to {MAX_RANKS}"
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
    stages, size = options["stages"], dp["size"]
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


def stage_of(wrapping: dict[str, Any], rank: int) -> dict[str, Any]:
    """The stage ``rank`` runs (a validated ``wrapping``)."""
    return wrapping["stages"][rank // dp_size(wrapping)]


def dp_rank(wrapping: dict[str, Any], rank: int) -> int:
    """The data-parallel rank of global rank ``rank``: which of the pipelines it is part of."""
    return rank % dp_size(wrapping)


def stage_rank(wrapping: dict[str, Any], stage: int, dp: int = 0) -> int:
    """The global rank that runs stage ``stage`` in pipeline ``dp``."""
    return stage * dp_size(wrapping) + dp


def last_rank(wrapping: dict[str, Any], dp: int = 0) -> int:
    """The rank of the last stage of pipeline ``dp``: the one that computes its losses."""
    return stage_rank(wrapping, len(wrapping["stages"]) - 1, dp)


def coordinate_text(wrapping: dict[str, Any], rank: int) -> str:
    """Global rank ``rank``'s place, "pp=1, dp=0", as torchtitan's mesh names its dimensions."""
    return f"pp={rank // dp_size(wrapping)}, dp={dp_rank(wrapping, rank)}"
