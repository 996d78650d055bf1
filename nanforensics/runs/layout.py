"""A distributed run's directory: the single-process layout, plus one folder per rank for its step log and batches.

```
RUN/
  manifest.json                         format "nanforensics.run/1+distributed", with a "distributed" section
  ranks/rank_00001/steps.jsonl          rank 1's logged (local) losses
  ranks/rank_00001/batches/step_...     rank 1's shard of each step's batch
  checkpoints/step_.../                 DDP: one writer (rank 0); FSDP2: torch.distributed.checkpoint, a shard per rank
```

It is the run format's, so it lives with the other readers of a run (runs/); distributed/ writes and replays it.
The format string differs from a single-process run's, so a reader that knows only ``nanforensics.run/1`` refuses the
run ("newer than this nanforensics reads") instead of replaying one rank's shard as if it were the whole batch.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import BadInput, shown
from .stages import DATA_PARALLEL, MAX_RANKS, PIPELINE, TENSOR_PARALLEL, pipeline_problem
from .steplog import LoggedStep

DISTRIBUTED_FORMAT = "nanforensics.run/1+distributed"
RANKS = "ranks"
DDP, FSDP2, TP = "ddp", "fsdp2", "tp"
WRAPPINGS = (DDP, FSDP2, TP, PIPELINE)
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
    kind: str  # DDP, FSDP2 or TP (tensor parallelism alone)
    backend: str
    wrapping: dict[str, Any]
    mesh: "Mesh | None" = None  # a DeviceMesh layout (tensor parallelism, HSDP); None: one dimension of all ranks

    def to_json(self) -> dict[str, Any]:
        out = {"world_size": self.world_size, "backend": self.backend, "wrapping": {"kind": self.kind, **self.wrapping}}
        return out | ({"mesh": self.mesh.to_json()} if self.mesh is not None else {})

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
        problem = _wrapping_problem(kind, options, size)
        if problem is not None:
            raise BadInput(where, f"distributed.wrapping {problem}")
        mesh = Mesh.read(raw["mesh"], where, size) if "mesh" in raw else None
        if not _mesh_fits(kind, mesh):
            raise BadInput(where, f"distributed.mesh does not fit a {kind} run: DDP and pipelines have none, tensor "
                                  "parallelism alone one tensor-parallel dimension and no other, FSDP2 none or two "
                                  "dimensions or more")
        return cls(size, kind, backend, options, mesh)

    @property
    def data_ranks(self) -> int:
        """How many batches each step has: one per data-parallel group (the ranks of a tensor-parallel group share
        theirs), every rank's own without a mesh."""
        return self.mesh.data_ranks if self.mesh is not None else self.world_size

    def data_rank(self, rank: int) -> int:
        """The data-parallel group of global rank ``rank``: the folder its batches and losses are under."""
        return self.mesh.data_rank(rank) if self.mesh is not None else rank

    def lead(self, data_rank: int) -> int:
        """The global rank that records the batches of data-parallel group ``data_rank``: its tensor-parallel rank 0."""
        return self.mesh.lead(data_rank) if self.mesh is not None else data_rank

    def where(self, rank: int) -> str:
        """Global rank ``rank`` in words: "rank 2 (dp=1, tp=0)" on a mesh."""
        return f"rank {rank}" + (f" ({self.mesh.coordinate_text(rank)})" if self.mesh is not None else "")

    @property
    def collective(self) -> str:
        return "all-reduce" if self.kind == DDP else "reduce-scatter"

    def shard_owner(self, dim0: int, index: list[int]) -> int | None:
        """The rank whose FSDP2 shard holds coordinate ``index`` of a tensor with ``dim0`` rows (``torch.chunk``
        along dimension 0, as ``fully_shard`` lays parameters out); None for DDP, whose state is replicated, and on a
        mesh, where a coordinate lies in several ranks' shards."""
        if self.kind != FSDP2 or self.mesh is not None or not index or dim0 < 1:
            return None
        return index[0] // math.ceil(dim0 / self.world_size)


STYLES = ("colwise", "rowwise", "sequence")  # ColwiseParallel, RowwiseParallel, SequenceParallel
MAX_MESH_DIMS = 3
_LAYOUT = re.compile(r"Replicate\(\)|Shard\(dim=-?\d\)")  # a tensor-parallel style's input or output layout
_PLACEMENT = re.compile(rf"{_LAYOUT.pattern}|_StridedShard\(dim=\d, sf=\d{{1,4}}\)")  # a parameter's, FSDP2's too
_DIM_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,31}")


@dataclass(frozen=True)
class Mesh:
    """The DeviceMesh a run trained on (ranks laid out row-major, as ``init_device_mesh`` lays them), the dimension of
    tensor parallelism (None for HSDP: every dimension is data-parallel), the plan ``parallelize_module`` applied
    there, and each parameter's placement per mesh dimension (a parameter absent from a dimension is replicated on it).

    The ranks of one tensor-parallel group see the same batch: the other dimensions number the data-parallel groups,
    each recording its batches once (its tensor-parallel rank 0 writes them)."""

    shape: tuple[int, ...]
    dim_names: tuple[str, ...]
    tp_dim: str | None
    plan: tuple[dict[str, Any], ...] = ()  # {"module", "style", "input_layouts", "output_layouts", "use_local_output"}
    placements: dict[str, dict[str, str]] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {"shape": list(self.shape), "dim_names": list(self.dim_names), "tp_dim": self.tp_dim,
                "plan": [dict(p) for p in self.plan], "placements": self.placements}

    @classmethod
    def read(cls, raw: Any, where: Path, world_size: int) -> "Mesh":
        """``distributed.mesh``, each field checked (one-line ``BadInput``)."""
        problem = _mesh_problem(raw, world_size)
        if problem is not None:
            raise BadInput(where, f"distributed.mesh {problem}")
        return cls(tuple(raw["shape"]), tuple(raw["dim_names"]), raw["tp_dim"], tuple(raw["plan"]), raw["placements"])

    @property
    def data_dims(self) -> tuple[str, ...]:
        return tuple(n for n in self.dim_names if n != self.tp_dim)

    @property
    def data_ranks(self) -> int:
        return math.prod(n for n, name in zip(self.shape, self.dim_names) if name != self.tp_dim)

    def coordinate(self, rank: int) -> dict[str, int]:
        out, rest = {}, rank
        for name, n in reversed(list(zip(self.dim_names, self.shape))):
            out[name], rest = rest % n, rest // n
        return {name: out[name] for name in self.dim_names}

    def coordinate_text(self, rank: int) -> str:
        return ", ".join(f"{k}={v}" for k, v in self.coordinate(rank).items())

    def tp_rank(self, rank: int) -> int:
        return self.coordinate(rank)[self.tp_dim] if self.tp_dim is not None else 0

    def data_rank(self, rank: int) -> int:
        at = self.coordinate(rank)
        index = 0
        for name, n in zip(self.dim_names, self.shape):
            if name != self.tp_dim:
                index = index * n + at[name]
        return index

    def lead(self, data_rank: int) -> int:
        return next(r for r in range(math.prod(self.shape)) if self.data_rank(r) == data_rank and self.tp_rank(r) == 0)

    def holds(self, rank: int, name: str) -> bool:
        """Whether ``rank`` is the one copy of its shard of parameter ``name`` that speaks for it: coordinate 0 along
        every dimension the parameter is replicated on (every dimension its placements do not name, or name
        ``Replicate()``)."""
        placed = self.placements.get(name, {})
        at = self.coordinate(rank)
        return all(at[d] == 0 for d in self.dim_names if placed.get(d, "Replicate()") == "Replicate()")


def _mesh_problem(raw: Any, world_size: int) -> str | None:
    keys = {"shape", "dim_names", "tp_dim", "plan", "placements"}
    if not isinstance(raw, dict) or set(raw) != keys:
        return f"must be an object with exactly {', '.join(sorted(keys))}"
    shape, names, tp_dim, plan, placements = (raw[k] for k in ("shape", "dim_names", "tp_dim", "plan", "placements"))
    if not (isinstance(shape, list) and 1 <= len(shape) <= MAX_MESH_DIMS
            and all(type(n) is int and 1 <= n <= MAX_RANKS for n in shape) and math.prod(shape) == world_size):
        return f"shape {shown(shape)} is not 1 to {MAX_MESH_DIMS} sizes whose product is the world size, {world_size}"
    if not (isinstance(names, list) and all(isinstance(n, str) and _DIM_NAME.fullmatch(n) for n in names)
            and len(names) == len(shape) and len(set(names)) == len(names)):
        return f"dim_names {shown(names)} is not one distinct identifier per dimension of {shape}"
    if tp_dim is not None and tp_dim not in names:
        return f"tp_dim {shown(tp_dim)} is not null or one of {names}"
    if not isinstance(plan, list) or bool(plan) != (tp_dim is not None):
        return "plan must list the tensor-parallel modules exactly when tp_dim names a dimension"
    problem = _plan_problem(plan)
    if problem is not None:
        return problem
    if not isinstance(placements, dict):
        return f"placements {shown(placements)} is not an object of parameter names"
    for name, placed in placements.items():
        if not (isinstance(placed, dict) and set(placed) <= set(names)
                and all(isinstance(v, str) and _PLACEMENT.fullmatch(v) for v in placed.values())):
            return f"placements of {shown(name)}: {shown(placed)} is not a placement (Replicate(), Shard(dim=d)) " \
                   "per mesh dimension"
    return None


def _plan_problem(plan: list[Any]) -> str | None:
    """What is wrong with a tensor-parallel plan (a mesh's, or a pipeline's stages'), or None."""
    for spec in plan:
        if not (isinstance(spec, dict) and set(spec) == {"module", "style", "input_layouts", "output_layouts",
                                                          "use_local_output"}
                and isinstance(spec["module"], str) and spec["style"] in STYLES
                and isinstance(spec["use_local_output"], bool)
                and all(isinstance(spec[k], str) and _LAYOUT.fullmatch(spec[k])
                        for k in ("input_layouts", "output_layouts"))):
            return f"plan entry {shown(spec)} is not {{module, style ({', '.join(STYLES)}), input_layouts, " \
                   "output_layouts, use_local_output}"
    return None


def _wrapping_problem(kind: str, options: dict[str, Any], world_size: int) -> str | None:
    """What is wrong with a wrapping's options, by its kind; None when nothing is."""
    if kind == DDP:
        return _ddp_problem(options)
    if kind == FSDP2:
        return _fsdp2_problem(options)
    if kind == TP:
        return "of a tensor-parallel run has no options" if options else None
    problem = pipeline_problem(options, world_size)
    if problem is None and TENSOR_PARALLEL in options:  # each stage's plan, on its tensor-parallel ranks
        tp = options[TENSOR_PARALLEL]
        if set(tp) != {"size", "plan"} or not isinstance(tp["plan"], list) or not tp["plan"]:
            return f"{TENSOR_PARALLEL} {shown(tp)} is not {{size, plan}} with the plan's modules"
        problem = _plan_problem(tp["plan"])
    if problem is None and DATA_PARALLEL in options:  # each stage under DDP, or FSDP2, over its data-parallel ranks
        wrapper = {k: v for k, v in options[DATA_PARALLEL].items() if k != "size"}
        return _fsdp2_problem(wrapper) if "modules" in wrapper else _ddp_problem(wrapper)
    return problem


def _mesh_fits(kind: str, mesh: "Mesh | None") -> bool:
    """DDP and pipelines have no mesh; tensor parallelism alone one tensor-parallel dimension and no data-parallel
    one; FSDP2 none (one dimension of all ranks) or two dimensions or more."""
    if kind in (DDP, PIPELINE):
        return mesh is None
    if kind == TP:
        return mesh is not None and mesh.tp_dim is not None and mesh.data_ranks == 1
    return mesh is None or len(mesh.shape) > 1


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
