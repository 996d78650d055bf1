"""Pipeline-parallel training runs with a known answer, recorded under torchrun by the project's recorder.

    python -m torch.distributed.run --nproc-per-node 2 tests/pipeline_job.py OUT NAME...

A 6-layer MLP split in two stages (rank 0: ``log(x * gain)`` and the first layers; rank 1: the rest and the loss)
trains under ``ScheduleGPipe`` ("gpipe") or ``Schedule1F1B`` ("1f1b") with ``MICROBATCHES`` micro-batches per step. At
``DEFECT_STEP`` sample ``DEFECT_SAMPLE`` of micro-batch ``DEFECT_MICROBATCH`` is bad. In "gpipe" its input holds a
near-zero reading (3e-45) that stage 0 holds: the loss stays finite, stage 0's gradient of ``0.gain[3]`` is infinite,
and the update turns it NaN. In "1f1b" its target, which the last stage holds, is a glitch (1e20): that micro-batch's
loss overflows to inf on stage 1. "gpipe_scheduled" is "gpipe" with an LR scheduler on each stage and ``0.gain`` out
of the optimizer (it still requires grad). "1f1b_dp" runs 2 pipelines side by side (``--nproc-per-node 4``):
torchtitan's (pp, dp) mesh, each stage under DDP over its dp group, pipeline ``BAD_DP``'s batch holding the near-zero
reading; "1f1b_fsdp" the same with each stage under ``fully_shard`` over its dp group (torchtitan's dp_shard).

"1f1b_3d" is torchtitan's FSDP2 x TP x PP at 2x2x2 (``--nproc-per-node 8``): a (pp, dp_shard, tp) mesh, each stage's
layers split by ``parallelize_module`` on "tp" (Megatron's colwise then rowwise pairs), then ``fully_shard`` on
"dp_shard". Its model (``build_model_3d``) takes ``log(softplus(h))`` of hidden unit ``UNIT``, which only feature
``DEFECT_FEATURE`` drives, negatively; at ``DEFECT_STEP_3D`` pipeline ``BAD_DP``'s sample holds a glitch reading
there (``GLITCH``): softplus underflows to a subnormal, the forward stays finite, and backward's 1/softplus overflows:
``0.bias[UNIT]``'s gradient is infinite, in tensor-parallel rank 1's block of units (8-15), and the update leaves it
NaN in data-parallel rank 1's shard of that block (12-15). Fewest steps: 4, the defect at step 2.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

WORLD, BATCH, MICROBATCHES = 2, 8, 4   # ranks (= stages), samples per step, micro-batches per step
STEPS, EVERY = 6, 2                    # steps recorded, checkpoint interval: checkpoints 0, 2, 4, 6
DEFECT_STEP, DEFECT_MICROBATCH, DEFECT_SAMPLE, DEFECT_FEATURE = 3, 2, 1, 3
FEATURES = 4
STAGES = [["0", "1", "2"], ["3", "4", "5"]]  # the top-level modules each stage holds
SCHEDULES = {"gpipe": "ScheduleGPipe", "1f1b": "Schedule1F1B", "gpipe_scheduled": "ScheduleGPipe",
             "1f1b_dp": "Schedule1F1B", "1f1b_fsdp": "Schedule1F1B", "1f1b_3d": "Schedule1F1B"}
DEFECTS = {"gpipe": "input", "1f1b": "target", "gpipe_scheduled": "input", "1f1b_dp": "input", "1f1b_fsdp": "input",
           "1f1b_3d": "glitch"}
# "1f1b_dp": 2 stages x 2 data-parallel ranks (4 processes), torchtitan's (pp, dp) mesh, each stage under DDP over
# its dp group; only pipeline BAD_DP's batch carries the defect
DP, BAD_DP = 2, 1
# "1f1b_3d": FSDP2 x TP x PP, 2 x 2 x 2
TP, UNIT, GLITCH, STEPS_3D, DEFECT_STEP_3D = 2, 13, 198.0, 4, 2
STAGES_3D = [["0", "1", "2"], ["3", "4"]]
FROZEN = "0.gain"  # "gpipe_scheduled": the optimizer does not hold it; it still requires grad, which nothing zeroes
DECAY = 0.7  # "gpipe_scheduled": each stage's LR scheduler multiplies its learning rate by this every step


def defect_row() -> int:
    """The row of the step's batch the defect sits in (micro-batches split the batch along dimension 0)."""
    return DEFECT_MICROBATCH * (BATCH // MICROBATCHES) + DEFECT_SAMPLE


class LogGain(nn.Module):
    """log(x * gain): a reading near zero makes gain's gradient 1/x, beyond float32's range."""

    def __init__(self, n: int) -> None:
        super().__init__()
        self.gain = nn.Parameter(torch.ones(n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.log(x * self.gain)


def build_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(LogGain(FEATURES), nn.Linear(FEATURES, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(),
                         nn.Linear(16, 1))


class LogSoftplus(nn.Module):
    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return torch.log(F.softplus(h))


def build_model_3d() -> nn.Module:
    """Two colwise/rowwise pairs (stage 0: ``0``, ``1``, ``2``; stage 1: ``3``, ``4``). Unit ``UNIT`` of layer 0 reads
    feature ``DEFECT_FEATURE`` alone, at -0.5; every other unit reads it positively."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(FEATURES, 16), LogSoftplus(), nn.Linear(16, 16), nn.Linear(16, 16), nn.Linear(16, 1))
    with torch.no_grad():
        first = model[0]
        first.weight[:, DEFECT_FEATURE].abs_().add_(0.1)
        first.weight[UNIT].zero_()
        first.weight[UNIT, DEFECT_FEATURE] = -0.5
        first.bias[UNIT] = 0.0
    return model


def loss_fn(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(output, target)


def train_step(schedule: Any, optimizer: torch.optim.Optimizer, batch: dict[str, Any]) -> Any:
    """The same on every rank: stage 0's batch holds the inputs, the last stage's the targets."""
    optimizer.zero_grad(set_to_none=True)
    losses: list[torch.Tensor] = []
    args = (batch["x"],) if "x" in batch else ()
    schedule.step(*args, target=batch.get("y"), losses=losses)
    optimizer.step()
    return losses


def decay(optimizer: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LRScheduler:
    """A stage's LR scheduler ("gpipe_scheduled"): each stage builds and steps its own."""
    return torch.optim.lr_scheduler.LambdaLR(optimizer, _decayed)


def _decayed(step: int) -> float:
    return DECAY ** step


def train_step_scheduled(schedule: Any, optimizer: torch.optim.Optimizer, batch: dict[str, Any], *,
                         scheduler: Any) -> Any:
    losses = train_step(schedule, optimizer, batch)
    scheduler.step()
    return losses


def data_parallel(name: str) -> int:
    """How many pipelines run side by side in run ``name``."""
    return DP if name.endswith(("_dp", "_fsdp", "_3d")) else 1


def tensor_parallel(name: str) -> int:
    return TP if name.endswith("_3d") else 1


def data(step: int, defect: str, dp: int = 0, pipelines: int = 1) -> dict[str, Any]:
    """Pipeline ``dp``'s batch at ``step`` (of ``pipelines``); the defect in the last pipeline's."""
    g = torch.Generator().manual_seed(1000 + step + 97 * dp)
    x = torch.exp(torch.randn(BATCH, FEATURES, generator=g) * 0.5)
    y = torch.log(x).mean(dim=1, keepdim=True)
    bad = step == (DEFECT_STEP_3D if defect == "glitch" else DEFECT_STEP) and dp == min(BAD_DP, pipelines - 1)
    if defect == "glitch" and bad:
        x[defect_row(), DEFECT_FEATURE] = GLITCH
    if defect == "input" and bad:
        x[defect_row(), DEFECT_FEATURE] = 3e-45
    if defect == "target" and bad:
        y[defect_row(), 0] = 1e20
    ids = [f"sample-{(step * pipelines + dp) * BATCH + i:05d}" for i in range(BATCH)]
    return {"x": x, "y": y, "id": ids}


def stage_batch(batch: dict[str, Any], stage: int) -> dict[str, Any]:
    """What each stage's loop holds: the first stage the inputs, the last the targets; both the ids."""
    keep = ("x", "id") if stage == 0 else ("y", "id")
    return {k: batch[k] for k in keep}


def build(schedule_name: str) -> tuple[Any, torch.optim.Optimizer]:
    """This rank's stage and its schedule, as torchtitan builds them: a (pp, dp) DeviceMesh, the stage's module under
    DDP over ``dp`` where there is data parallelism, the stage's communication on ``pp``."""
    from nanforensics.distributed.pipeline import prune
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.pipelining import PipelineStage, schedules
    from torch.nn.parallel import DistributedDataParallel

    dp = data_parallel(schedule_name)
    if schedule_name.endswith("_3d"):  # torchtitan's FSDP2 x TP x PP
        return build_3d(schedule_name)
    mesh = init_device_mesh("cpu", (WORLD, dp), mesh_dim_names=("pp", "dp"))
    index = mesh["pp"].get_local_rank()
    module = prune(build_model(), STAGES[index])
    if schedule_name.endswith("_fsdp"):  # torchtitan's dp_shard: FSDP2 over dp
        from torch.distributed.fsdp import fully_shard

        run = fully_shard(module, mesh=mesh["dp"])
    else:
        run = DistributedDataParallel(module, process_group=mesh["dp"].get_group()) if dp > 1 else module
    stage = PipelineStage(run, index, WORLD, torch.device("cpu"), group=mesh["pp"].get_group())
    schedule = getattr(schedules, SCHEDULES[schedule_name])(stage, MICROBATCHES, loss_fn=loss_fn)
    held = [p for n, p in module.named_parameters() if not (schedule_name == "gpipe_scheduled" and n == FROZEN)]
    return schedule, torch.optim.AdamW(held, lr=1e-2)


def build_3d(schedule_name: str) -> tuple[Any, torch.optim.Optimizer]:
    """As torchtitan lays out 3-D parallelism: a (pp, dp_shard, tp) mesh; each stage's module given its plan on "tp"
    (colwise then rowwise), then ``fully_shard`` on "dp_shard"; the stage's communication on "pp"."""
    from nanforensics.distributed.pipeline import prune
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.pipelining import PipelineStage, schedules
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    mesh = init_device_mesh("cpu", (WORLD, DP, TP), mesh_dim_names=("pp", "dp_shard", "tp"))
    index = mesh["pp"].get_local_rank()
    module = prune(build_model_3d(), STAGES_3D[index])
    pairs = [("0", "2"), ("3", "4")][index]
    parallelize_module(module, mesh["tp"], {pairs[0]: ColwiseParallel(), pairs[1]: RowwiseParallel()})
    fully_shard(module, mesh=mesh["dp_shard"])
    stage = PipelineStage(module, index, WORLD, torch.device("cpu"), group=mesh["pp"].get_group())
    schedule = getattr(schedules, SCHEDULES[schedule_name])(stage, MICROBATCHES, loss_fn=loss_fn)
    return schedule, torch.optim.AdamW(module.parameters(), lr=1e-2)


def misplaced(module: nn.Module) -> list[str]:
    """Every rank's shard of every parameter against the whole tensor at the place ``local_part`` (the replay's one
    mapping from a shard's coordinates to the whole tensor's) gives it: the parameters of any rank whose shard is not
    the whole tensor's block there, gathered to every rank. Under the 3-D layout a parameter is split on both
    ``dp_shard`` and ``tp`` (colwise: ``_StridedShard`` then ``Shard`` on dimension 0; rowwise: dimensions 0 and 1,
    unevenly for a 1-row weight), or on ``dp_shard`` alone and replicated on ``tp`` (rowwise biases)."""
    from nanforensics.distributed.tensors import local_part

    wrong = []
    for name, param in module.named_parameters():  # every rank, in the same order: full_tensor is a collective
        whole = param.full_tensor()
        local, offset = local_part(param.detach())
        assert offset is not None
        if not torch.equal(whole[tuple(slice(o, o + n) for o, n in zip(offset, local.shape))], local):
            wrong.append(name)
    every: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(every, wrong)
    return sorted({name for names in every for name in names})


def record(out: Path, name: str, steps: int = STEPS) -> list[Any]:
    """Train run ``name`` ("gpipe" or "1f1b") on this rank, recorded."""
    from nanforensics import Recorder

    schedule, optimizer = build(name)
    pipelines, tp = data_parallel(name), tensor_parallel(name)
    stage, dp = divmod(dist.get_rank() // tp, pipelines)  # the tensor-parallel ranks of a pipeline share its batch
    scheduled = {"scheduler": decay(optimizer)} if name == "gpipe_scheduled" else {}
    step_fn = train_step_scheduled if scheduled else train_step
    factory = build_model_3d if tp > 1 else build_model
    steps = STEPS_3D if tp > 1 else steps
    if tp > 1:  # before training: every value distinct from its neighbours, none NaN
        wrong = misplaced(schedule._stage.submod)
        if dist.get_rank() == 0:
            print(f"{name}: {len(wrong)} shards misplaced", flush=True)
    rec = Recorder(out / name, schedule, optimizer, model_factory=factory, step_fn=step_fn, checkpoint_every=EVERY,
                   overwrite=True, **scheduled, **({"scheduler_factory": decay} if scheduled else {}))
    logged = []
    for step in range(steps):
        batch = stage_batch(data(step, DEFECTS[name], dp, pipelines), stage)
        losses = step_fn(schedule, optimizer, batch, **scheduled)
        rec.log(step, batch, losses)
        logged.append(losses)
    rec.close()
    return logged


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("names", nargs="+", choices=sorted(SCHEDULES))
    args = parser.parse_args()
    os.environ.setdefault("SOURCE_DATE_EPOCH", "1764633600")
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    for name in args.names:
        logged = record(args.out, name)
        if dist.get_rank() == 0:
            print(f"{name}: {len(logged)} steps", flush=True)
    dist.destroy_process_group()


def arguments(out: Path, names: list[str]) -> list[str]:
    """This script and its arguments, which record ``names`` into ``out`` on every rank."""
    return [str(Path(__file__).resolve()), str(out), *names]


def command(out: Path, names: list[str]) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(WORLD),
            *arguments(out, names)]


if __name__ == "__main__":
    main()
