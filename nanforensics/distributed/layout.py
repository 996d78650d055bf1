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

from ..errors import BadInput
from ..runs.steplog import LoggedStep

DISTRIBUTED_FORMAT = "nanforensics.run/1+distributed"
RANKS = "ranks"
DDP, FSDP2 = "ddp", "fsdp2"
WRAPPINGS = (DDP, FSDP2)
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
        try:
            wrapping = dict(raw["wrapping"])
            kind = wrapping.pop("kind")
            world = cls(int(raw["world_size"]), str(kind), str(raw.get("backend", "")), wrapping)
        except (KeyError, TypeError, ValueError) as e:
            raise BadInput(where, f"distributed section missing or malformed: {e}") from None
        if world.world_size < 1 or world.kind not in WRAPPINGS:
            raise BadInput(where, f"distributed section names {world.world_size} ranks wrapped by {world.kind!r}; "
                                  f"this nanforensics replays {' and '.join(WRAPPINGS)} runs")
        return world

    @property
    def collective(self) -> str:
        return "all-reduce" if self.kind == DDP else "reduce-scatter"

    def shard_owner(self, dim0: int, index: list[int]) -> int | None:
        """The rank whose FSDP2 shard holds coordinate ``index`` of a tensor with ``dim0`` rows (``torch.chunk``
        along dimension 0, as ``fully_shard`` lays parameters out); None for DDP, whose state is replicated."""
        if self.kind != FSDP2 or not index or dim0 < 1:
            return None
        return index[0] // math.ceil(dim0 / self.world_size)


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
