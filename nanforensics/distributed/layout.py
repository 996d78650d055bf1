"""A distributed run's directory: the single-process layout, plus one folder per rank for its step log and batches.

```
RUN/
  manifest.json                         format "nanforensics.run/1+distributed", with a "distributed" section
  ranks/rank_00001/steps.jsonl          rank 1's logged (local) losses
  ranks/rank_00001/batches/step_...     rank 1's shard of each step's batch
  checkpoints/step_.../                 DDP: one writer (rank 0); FSDP2: torch.distributed.checkpoint, a shard per rank
```

The format string differs from a single-process run's, so a reader that knows only ``nanforensics.run/1`` refuses the
run ("newer than this nanforensics reads") instead of replaying one rank's shard as if it were the whole batch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import BadInput, shown
from ..runs.steplog import LoggedStep
from .stages import PIPELINE, pipeline_problem

DISTRIBUTED_FORMAT = "nanforensics.run/1+distributed"
RANKS = "ranks"
DDP, FSDP2 = "ddp", "fsdp2"
WRAPPINGS = (DDP, FSDP2, PIPELINE)
MAX_RANKS = 1 << 20  # a world beyond any job's is damage
DDP_OPTIONS = ("broadcast_buffers", "find_unused_parameters", "gradient_as_bucket_view")
MP_POLICY = ("param_dtype", "reduce_dtype", "output_dtype", "cast_forward_inputs")  # FSDP2's MixedPrecisionPolicy
# the floating dtypes a MixedPrecisionPolicy may name; replay looks each up on torch by this name, and nothing else
DTYPES = ("float16", "bfloat16", "float32", "float64")
# Stages whose values every rank shares after the gradient collective (replicated under DDP, sharded under FSDP2);
# the others (batch, forward, loss, grad, ...) are each rank's own.
SHARED_STAGES = ("optimizer_grad", "optimizer_state", "param")


def rank_dir(run_dir: Path, rank: int) -> Path:
    """Where rank ``rank`` writes its step log and batches: a folder laid out like a single-process run's."""
    return run_dir / RANKS / f"rank_{rank:05d}"


@dataclass(frozen=True)
class World:
    """The ``distributed`` section of a manifest: how many ranks ran, and the wrapping replay rebuilds.

    ``wrapping`` is the recorded wrapper's options: for DDP ``broadcast_buffers``, ``find_unused_parameters``,
    ``gradient_as_bucket_view``; for FSDP2 ``modules``, each ``{"module": fqn, "reshard_after_forward", "mp_policy"}``
    in the order ``fully_shard`` was applied (children before their parents).
    """

    world_size: int
    kind: str  # DDP or FSDP2
    backend: str
    wrapping: dict[str, Any]

    def to_json(self) -> dict[str, Any]:
        return {"world_size": self.world_size, "backend": self.backend, "wrapping": {"kind": self.kind, **self.wrapping}}

    @classmethod
    def read(cls, raw: Any, where: Path) -> "World":
        """The manifest's ``distributed`` section, each field checked: a run directory is untrusted input."""
        wrapping = raw.get("wrapping") if isinstance(raw, dict) else None
        if not isinstance(wrapping, dict):
            raise BadInput(where, "distributed section missing or malformed: it needs world_size, backend and wrapping")
        size, backend, kind = raw.get("world_size"), raw.get("backend", ""), wrapping.get("kind")
        if type(size) is not int or not 1 <= size <= MAX_RANKS:
            raise BadInput(where, f"distributed.world_size {shown(size)} is not a rank count from 1 to {MAX_RANKS}")
        if kind not in WRAPPINGS:
            raise BadInput(where, f"distributed.wrapping.kind {shown(kind)}: this nanforensics replays "
                                  f"{' and '.join(WRAPPINGS)} runs")
        if not isinstance(backend, str):
            raise BadInput(where, f"distributed.backend {shown(backend)} is not a string")
        options = {k: v for k, v in wrapping.items() if k != "kind"}
        problem = _ddp_problem(options) if kind == DDP else _fsdp2_problem(options) if kind == FSDP2 \
            else pipeline_problem(options, size)
        if problem is not None:
            raise BadInput(where, f"distributed.wrapping {problem}")
        return cls(size, kind, backend, options)

    @property
    def collective(self) -> str:
        return "all-reduce" if self.kind == DDP else "reduce-scatter"

    def shard_owner(self, dim0: int, index: list[int]) -> int | None:
        """The rank whose FSDP2 shard holds coordinate ``index`` of a tensor with ``dim0`` rows (``torch.chunk``
        along dimension 0, as ``fully_shard`` lays parameters out); None for DDP, whose state is replicated."""
        if self.kind != FSDP2 or not index or dim0 < 1:
            return None
        return index[0] // math.ceil(dim0 / self.world_size)


def _ddp_problem(options: dict[str, Any]) -> str | None:
    for key, value in options.items():
        if key not in DDP_OPTIONS or not isinstance(value, bool):
            return f"{shown(key)}: {shown(value)} is not one of DDP's options {', '.join(DDP_OPTIONS)} (true or false)"
    return None


def _fsdp2_problem(options: dict[str, Any]) -> str | None:
    modules = options.get("modules")
    if set(options) != {"modules"} or not isinstance(modules, list) or not modules:
        return "of an FSDP2 run needs modules, the list of fully_shard-ed modules, and nothing else"
    for spec in modules:
        if not (isinstance(spec, dict) and set(spec) == {"module", "reshard_after_forward", "mp_policy"}
                and isinstance(spec["module"], str) and isinstance(spec["reshard_after_forward"], bool)
                and isinstance(spec["mp_policy"], dict) and set(spec["mp_policy"]) == set(MP_POLICY)):
            return f"module {shown(spec)} is not {{module, reshard_after_forward, mp_policy}} as the recorder writes it"
        for key, value in spec["mp_policy"].items():
            wanted = (bool,) if key == "cast_forward_inputs" else (str, type(None))
            if not isinstance(value, wanted) or (isinstance(value, str) and value not in DTYPES):
                return f"mp_policy {key} {shown(value)} is not {' or '.join(DTYPES) if str in wanted else 'true or false'}"
    return None


def merged_steps(per_rank: list[list[LoggedStep]]) -> list[LoggedStep]:
    """The run's loss per step, as a loop that averages its ranks' losses would log it: the mean over ranks (non-finite
    where any rank's is), over the steps every rank logged (a rank killed first logged fewer)."""
    count = min(len(steps) for steps in per_rank) if per_rank else 0
    out = []
    for i in range(count):
        rows = [steps[i] for steps in per_rank]
        if len({s.step for s in rows}) != 1:
            raise ValueError(f"ranks logged different steps at line {i + 1}: {sorted({s.step for s in rows})}")
        out.append(LoggedStep(rows[0].step, mean_loss([s.loss for s in rows])))
    return out


def mean_loss(losses: list[float]) -> float:
    """One summation order (rank order) for logged and replayed losses alike, so equal losses give equal means."""
    return sum(losses) / len(losses)
