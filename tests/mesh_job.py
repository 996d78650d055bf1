"""Runs on a 2-D (or tensor-parallel) DeviceMesh with a known answer, recorded under torchrun by the project's recorder.

    python -m torch.distributed.run --standalone --nproc-per-node 4 tests/mesh_job.py OUT NAME... [--code tests/scenarios.py]
        [--cuda]

The regressor of ``scenarios`` on ``distributed_job``'s readings, laid out three ways over 4 ranks:

- ``tp``: tensor parallelism alone on a 1-D ``tp`` mesh, ``scenarios.Units`` (fc1 ColwiseParallel keeping its output a
  DTensor, fc2 RowwiseParallel): every rank sees the same batch, which holds a glitch reading (1e13) at step
  ``DEFECT_STEP``, sample ``DEFECT_SAMPLE``; it drives hidden unit ``UNIT`` alone to -inf, in rank ``UNIT // 8``'s block of
  units: no data-parallel rank is responsible, one tensor-parallel rank's local computation is;
- ``fsdp2_tp``: the same plan on the ``tp`` dimension of a 2x2 ``(dp, tp)`` mesh, then ``fully_shard`` on ``dp``;
- ``hsdp``: ``fully_shard`` on a 2x2 ``(replicate, shard)`` mesh.

In the others only data-parallel group 1's batch carries the defect: at step ``DEFECT_STEP`` its sample
``DEFECT_SAMPLE`` holds a near-zero reading (3e-45), a finite loss and an infinite gradient of ``features.gain[3]``.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from nanforensics import Recorder
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler

import distributed_job as job
import scenarios
from distributed_job import DEFECT_STEP, EVERY, SHARD, STEPS, Readings

WORLD = 4
DEFECT_SAMPLE = scenarios.DEFECT_SAMPLE
LAYOUTS = {"tp": ((WORLD,), ("tp",)), "fsdp2_tp": ((2, 2), ("dp", "tp")), "hsdp": ((2, 2), ("replicate", "shard"))}
UNIT = 21  # the hidden unit of scenarios.Units the glitch reading drives to -inf: rank 2 of 4 holds units 16-23


def groups(name: str) -> int:
    """How many data-parallel groups (batches per step) layout ``name`` has."""
    shape, dims = LAYOUTS[name]
    return WORLD // dict(zip(dims, shape)).get("tp", 1)


def bad_group(name: str) -> int:
    return 0 if groups(name) == 1 else 1


def defect_index(name: str, step: int = DEFECT_STEP, position: int = DEFECT_SAMPLE) -> int:
    """The dataset index a DistributedSampler (no shuffling) over the data-parallel groups hands the bad group."""
    return (step * SHARD + position) * groups(name) + bad_group(name)


def lay_out(model: nn.Module, name: str, device: torch.device) -> tuple[nn.Module, int]:
    """The model parallelised as layout ``name``; returns it and this rank's data-parallel group."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    shape, dims = LAYOUTS[name]
    mesh = init_device_mesh(device.type, shape, mesh_dim_names=dims)
    if "tp" in dims:  # tensor parallelism alone keeps fc1's output a DTensor: its checks see global coordinates
        parallelize_module(model, mesh["tp"], {"fc1": ColwiseParallel(use_local_output=name != "tp"),
                                               "fc2": RowwiseParallel()})
    if name == "fsdp2_tp":
        fully_shard(model, mesh=mesh["dp"])
    elif name == "hsdp":
        fully_shard(model, mesh=mesh)
    at = dict(zip(dims, mesh.get_coordinate() or ()))
    group = 0 if name == "tp" else at["dp"] if name == "fsdp2_tp" else at["replicate"] * 2 + at["shard"]
    return model, group


def record(out: Path, name: str, code: str | None = None, device: torch.device = torch.device("cpu")) -> list[float]:
    """Train run ``name`` on this rank under the recorder; returns this rank's logged losses."""
    named = lambda fn: fn if code is None else f"{code}:{fn.__qualname__}"  # noqa: E731
    factory = scenarios.build_units if name == "tp" else scenarios.build_model
    model, group = lay_out(factory().to(device), name, device)
    data = Readings(STEPS * SHARD * groups(name), defect_index(name), spike=name == "tp")
    loader = DataLoader(data, batch_size=SHARD, sampler=DistributedSampler(data, groups(name), group, shuffle=False))
    optimizer = torch.optim.AdamW(model.parameters())
    rec = Recorder(out / name, model, optimizer, model_factory=named(factory),
                   step_fn=named(scenarios.train_step), checkpoint_every=EVERY, overwrite=True)
    losses = []
    for step, batch in enumerate(loader):
        batch = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}
        loss = scenarios.train_step(model, optimizer, batch)
        rec.log(step, batch, loss)
        losses.append(float(loss.detach()))
    rec.close()
    return losses


def arguments(out: Path, names: list[str]) -> list[str]:
    """This script and its arguments, which record ``names`` into ``out`` on every rank (from the checkout's root)."""
    return [str(Path(__file__).resolve()), str(out), *names, "--code", "tests/scenarios.py"]


def command(out: Path, names: list[str]) -> list[str]:
    """The torchrun command line that records ``names`` into ``out`` (from the checkout's root)."""
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(WORLD),
            *arguments(out, names)]


def main() -> None:
    job.main_for(__doc__, LAYOUTS, record)


if __name__ == "__main__":
    main()
