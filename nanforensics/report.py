"""Reports are plain dataclasses; this turns them into JSON (the one machine-readable view)."""

from __future__ import annotations

import dataclasses
import json
import math
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .runs.files import write_bytes_atomic


REPLAY_SCHEMA = "nanforensics.replay/1"

# The order in which a step touches its tensors; within a step, an earlier stage is the cause.
STAGES = ("batch", "forward", "loss", "grad", "optimizer_grad", "optimizer_state", "param")


@dataclass
class Event:
    """The first non-finite value met at one stage of one step (per state key for optimizer state)."""

    step: int
    stage: str
    tensor: str
    index: list[int]
    value: str  # "nan" | "inf" | "-inf"
    state_key: str | None = None
    elements_nonfinite: int = 0  # over every tensor of this stage (and state key) at this step
    tensors_nonfinite: int = 0
    dtype: str | None = None


@dataclass
class BatchRef:
    step: int
    file: str
    leaves: dict[str, Any]  # the batch's non-tensor leaves, such as sample ids


@dataclass
class StepRecord:
    """One replayed step: losses side by side, and how far the non-finite values have spread."""

    step: int
    logged_loss: float | None
    replayed_loss: float
    params_nonfinite: int
    params_total: int
    state_nonfinite: int
    state_total: int


@dataclass
class DataDefect:
    """A value in a logged batch that is non-finite, beyond the magnitude limit, or subnormal."""

    step: int
    file: str
    tensor: str          # batch leaf path, e.g. batch['x']
    kind: str            # "nonfinite" | "extreme" | "subnormal"
    count: int
    index: list[int]     # first such coordinate: [sample, feature, ...]
    value: str


@dataclass
class OpSite:
    """Where an aten operation ran: phase, module path, the user's source line."""

    op: str                       # e.g. "aten::div.Tensor"
    phase: str                    # "forward" | "backward" | "optimizer"
    module: str | None            # module path the op ran under ("<root>" for the model, None outside it)
    source: str | None            # "file.py:line in function" of the user's code
    input_dtypes: list[str]
    input_ranges: list[list[str]]  # [min, max] of each floating input, as strings ("inf", "2.8e-45", ...)
    output_dtypes: list[str]


@dataclass
class OperationCulprit:
    """The first operation of the responsible step whose output is non-finite while its inputs were finite."""

    site: OpSite
    output_value: str             # "nan" | "inf" | "-inf"
    output_index: list[int]
    autograd_node: str | None = None   # for a backward op, e.g. "LogBackward0"
    forward: OpSite | None = None      # for a backward op, the forward operation it differentiates
    note: str | None = None


@dataclass
class SampleAttribution:
    """Which samples of the responsible batch reproduce the non-finite gradient on their own."""

    status: str                   # "attributed" | "coupled" | "batch_wide" | "not_reproduced" | "opted_out" | "unsplittable"
    batch_size: int | None
    samples: list[int]            # positions in the batch
    sample_leaves: dict[str, list[Any]]  # logged non-tensor leaves (ids) of those samples
    passes: int                   # forward/backward passes spent
    coupled_groups: list[list[int]]
    message: str


@dataclass
class Precursor:
    """Per-step magnitudes that show a drift towards overflow before the event."""

    step: int
    grad_norm: float | None
    grad_max_abs: float | None
    update_max_abs: float | None
    state_max_abs: dict[str, float]   # per optimizer-state key (exp_avg_sq: Adam's v), over all parameters
    activation_max_abs: float | None
    activation_dtype: str | None
    activation_headroom: float | None  # max |activation| / the dtype's largest finite value


@dataclass
class ReplaySetup:
    run: str
    from_checkpoint: int
    first_step: int
    last_step: int
    device: str
    num_threads: int
    imported: list[str]


@dataclass
class ReplayReport:
    verdict: str  # "nonfinite" | "clean" | "not_reproduced"
    responsible_step: int | None
    responsible_batch: BatchRef | None
    first_nonfinite_loss_step: int | None
    logged_first_nonfinite_loss_step: int | None
    origin: Event | None
    events: list[Event]
    spread: list[StepRecord]
    state_poisoned: bool
    reproduced: bool
    diverged_at_step: int | None
    fully_nonfinite_step: int | None
    findings: list[str]
    setup: ReplaySetup
    data_defects: list[DataDefect] = field(default_factory=list)
    operation: OperationCulprit | None = None
    samples: SampleAttribution | None = None
    precursors: list[Precursor] = field(default_factory=list)
    schema: str = field(default=REPLAY_SCHEMA)


def to_jsonable(obj: Any) -> Any:
    """Dataclasses become dicts; non-finite floats become "nan"/"inf"/"-inf" (JSON has no such numbers)."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        fields = sorted(dataclasses.fields(obj), key=lambda f: f.name != "schema")  # schema first, for readers
        return {f.name: to_jsonable(getattr(obj, f.name)) for f in fields}
    if isinstance(obj, dict):
        return {str(k): to_jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [to_jsonable(v) for v in obj]
    if isinstance(obj, Path):
        return str(obj)
    if isinstance(obj, float) and not math.isfinite(obj):
        return "nan" if math.isnan(obj) else ("inf" if obj > 0 else "-inf")
    return obj


def to_json(report: Any) -> str:
    return json.dumps(to_jsonable(report), indent=2, allow_nan=False) + "\n"


def write_json(report: Any, destination: str) -> None:
    """``-`` is stdout; a path is written atomically, so a failed run leaves an earlier report as it was."""
    text = to_json(report)
    if destination == "-":
        sys.stdout.write(text)
        sys.stdout.flush()
    else:
        write_bytes_atomic(Path(destination), text.encode(), durable=False)
