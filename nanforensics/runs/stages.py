"""The ``distributed`` section of a pipeline-parallel run's manifest: its schedule and which modules each stage holds.

A run trained with ``torch.distributed.pipelining`` (one ``PipelineStage`` per rank, a single-stage schedule such as
``ScheduleGPipe`` or ``Schedule1F1B``) is recorded with ``wrapping.kind`` "pipeline" and::

    {"kind": "pipeline", "schedule": "ScheduleGPipe", "microbatches": 4, "scale_grads": true,
     "loss_fn": "train.py:loss_fn", "stages": [{"stage": 0, "rank": 0, "modules": ["0", "1"]}, ...]}

Each stage's module is the model its ``model_factory`` builds with every top-level child but ``modules`` removed, so a
parameter keeps the name it has in the whole model, on every stage and in every checkpoint. Torch-free: the manifest
is read before anything imports torch.
"""

from __future__ import annotations

from typing import Any

from ..errors import shown

PIPELINE = "pipeline"
# the single-stage schedules replay rebuilds: each runs every micro-batch's forward and backward once, in order
SCHEDULES = ("ScheduleGPipe", "Schedule1F1B")
MAX_MICROBATCHES = 1 << 16
OPTIONS = ("schedule", "microbatches", "scale_grads", "loss_fn", "stages")


def pipeline_problem(options: dict[str, Any], world_size: int) -> str | None:
    """What is wrong with a pipeline run's ``wrapping`` (untrusted input), or None."""
    if set(options) != set(OPTIONS):
        return f"of a pipeline run needs exactly {', '.join(OPTIONS)}, not {shown(sorted(map(str, options)))}"
    schedule, count, scale = options["schedule"], options["microbatches"], options["scale_grads"]
    if schedule not in SCHEDULES:
        return f"schedule {shown(schedule)}: this nanforensics replays {' and '.join(SCHEDULES)}"
    if type(count) is not int or not 1 <= count <= MAX_MICROBATCHES:
        return f"microbatches {shown(count)} is not a count from 1 to {MAX_MICROBATCHES}"
    if not isinstance(scale, bool):
        return f"scale_grads {shown(scale)} is not true or false"
    if not isinstance(options["loss_fn"], str) or not options["loss_fn"]:
        return f"loss_fn {shown(options['loss_fn'])} is not an import string"
    stages = options["stages"]
    if not isinstance(stages, list) or len(stages) != world_size:
        return f"stages {shown(stages)} is not a list of one stage per rank ({world_size})"
    seen: set[str] = set()
    for i, spec in enumerate(stages):
        if not (isinstance(spec, dict) and set(spec) == {"stage", "rank", "modules"} and type(spec["stage"]) is int
                and type(spec["rank"]) is int and isinstance(spec["modules"], list) and spec["modules"]
                and all(isinstance(m, str) and m for m in spec["modules"])):
            return f"stage {shown(spec)} is not {{stage, rank, modules}} as the recorder writes it"
        if spec["stage"] != i or spec["rank"] != i:
            return f"stage {shown(spec['stage'])} on rank {shown(spec['rank'])} is not stage {i} on rank {i}"
        if seen & set(spec["modules"]):
            return f"module {shown(sorted(seen & set(spec['modules']))[0])} is held by two stages"
        seen |= set(spec["modules"])
    return None


def stage_of(wrapping: dict[str, Any], rank: int) -> dict[str, Any]:
    """The stage ``rank`` runs (a validated ``wrapping``)."""
    return next(s for s in wrapping["stages"] if s["rank"] == rank)


def last_rank(wrapping: dict[str, Any]) -> int:
    """The rank of the last stage: the one that computes the losses."""
    return int(wrapping["stages"][-1]["rank"])
