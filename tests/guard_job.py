"""The guard under torchrun: the known-answer data of ``distributed_job`` (rank 1's shard holds the near-zero reading at
step DEFECT_STEP: an infinite local gradient on rank 1 only), trained guarded, then again without a recorder and with
``optimizer.step()`` not called at that step; each rank prints whether its parameters (its shards, under FSDP2) are
finite and bit-identical in both (OUT/NAME.rankN.json). ``flaky``: DDP on clean data, rank 1's loss NaN at step LOSS_STEP
(its gradients finite: skipped for rank 1's reason), then rank 1's copy of a weight turned NaN after step FLIP_STEP (a
bit flip on one rank): each rank writes the step its guard stopped at and the incident. Its ranks' disks differ in
speed (``slow_disks``): the incident must be whole and in place on every rank whatever order the ranks write in.

    python -m torch.distributed.run --standalone --nproc-per-node 2 tests/guard_job.py OUT ddp fsdp2 flaky
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from nanforensics import Recorder
from nanforensics.distributed.tensors import is_dtensor
from nanforensics.runs import guard
from nanforensics.runs.guard import GuardPolicy, GuardStop
from torch.utils.data import DataLoader, DistributedSampler

import distributed_job as job
import scenarios


def train(how: str, run: Path | None) -> list[torch.Tensor]:
    data = job.Readings(job.STEPS * job.SHARD * job.WORLD, job.defect_index())
    loader = DataLoader(data, batch_size=job.SHARD, sampler=DistributedSampler(data, shuffle=False))
    model = job.wrap(scenarios.build_model(), how)
    optimizer = torch.optim.AdamW(model.parameters())
    rec = None if run is None else Recorder(run, model, optimizer, model_factory="tests/scenarios.py:build_model",
                                            step_fn="tests/scenarios.py:train_step", checkpoint_every=job.EVERY,
                                            overwrite=True, guard=True)
    real = optimizer.step
    for step, batch in enumerate(loader):
        if rec is None and step == job.DEFECT_STEP:
            optimizer.step = lambda *a, **k: None  # type: ignore[method-assign]
        loss = scenarios.train_step(model, optimizer, batch)
        optimizer.step = real  # type: ignore[method-assign]
        if rec is not None:
            rec.log(step, batch, loss)
    if rec is not None:
        rec.close()
    return [(p.to_local() if is_dtensor(p) else p).detach().clone() for p in model.parameters()]


LOSS_STEP = 2


def nan_loss_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, batch: dict, nan: bool) -> torch.Tensor:
    """The regression step, its loss made NaN where ``nan`` (an auxiliary term gone bad): every gradient stays finite."""
    optimizer.zero_grad(set_to_none=True)
    loss = F.mse_loss(model(batch["x"]), batch["y"])
    (loss * 0 + math.nan if nan else loss).backward()
    optimizer.step()
    return loss


def slow_disks() -> None:
    """Rank 1 writes its part of an incident a second late, rank 0 publishes it half a second late: a rank that did not
    wait for the others (the incident's two barriers) publishes without rank 1's files, or goes on before the incident
    is in place. A delay, not a change: each write still happens, through the guard's own calls."""
    def late(write: Callable[..., Any], when: Callable[..., bool], seconds: float) -> Callable[..., Any]:
        def slowly(*args: Any, **kwargs: Any) -> Any:
            if when(*args):
                time.sleep(seconds)
            return write(*args, **kwargs)
        return slowly
    if dist.get_rank() == 1:
        guard.write_bytes_atomic = late(guard.write_bytes_atomic, lambda path, *_: Path(path).name == guard.STEPS, 1.0)
    else:
        guard.publish_dir_atomic = late(guard.publish_dir_atomic, lambda *_: True, 0.5)


def flaky(run: Path) -> dict:
    """Only rank 1's state goes non-finite (its check is due at FLIP_STEP, a checkpoint's step): every rank must stop
    there together (a rank that went on alone would wait for the others at its next collective)."""
    data = job.Readings(job.STEPS * job.SHARD * job.WORLD, None)
    loader = DataLoader(data, batch_size=job.SHARD, sampler=DistributedSampler(data, shuffle=False))
    model = job.wrap(scenarios.build_model(), "ddp")
    optimizer = torch.optim.AdamW(model.parameters())
    options: dict = {"model_factory": "tests/scenarios.py:build_model", "step_fn": "tests/scenarios.py:train_step",
                     "checkpoint_every": job.EVERY, "overwrite": True}
    try:  # each rank's batches differ: a ring bounded in bytes would checkpoint on one rank and not the other
        Recorder(run.with_name("ring_bytes"), model, optimizer, guard=GuardPolicy(ring_bytes=1), **options)
    except ValueError as e:
        refused = str(e)
    rec = Recorder(run, model, optimizer, guard=True, **options)
    slow_disks()
    try:
        for step, batch in enumerate(loader):
            loss = nan_loss_step(model, optimizer, batch, step == LOSS_STEP and dist.get_rank() == job.BAD_RANK)
            if step == job.FLIP_STEP and dist.get_rank() == job.BAD_RANK:
                with torch.no_grad():
                    model.module.fc2.weight[0, 0] = math.nan
            rec.log(step, batch, loss)
    except GuardStop as stop:
        in_place = sorted(str(p.relative_to(stop.incident)) for p in stop.incident.glob("**/*.json*"))
        return {"rank": dist.get_rank(), "stopped": step, "incident": str(stop.incident.relative_to(run)),
                "refused": refused, "in_place": in_place}
    rec.close()
    return {"rank": dist.get_rank(), "stopped": None, "refused": refused}


def main() -> None:
    out, names = Path(sys.argv[1]), sys.argv[2:]
    os.environ.setdefault("SOURCE_DATE_EPOCH", "1764633600")
    dist.init_process_group("gloo", timeout=timedelta(seconds=120))  # ranks that fell out of step fail, not hang
    for how in names:
        if how == "flaky":
            (out / f"flaky.rank{dist.get_rank()}.json").write_text(json.dumps(flaky(out / how)))
            continue
        guarded = train(how, out / how)
        plain = train(how, None)
        result = {"rank": dist.get_rank(), "finite": all(bool(torch.isfinite(p).all()) for p in guarded),
                  "equal": all(torch.equal(a, b) for a, b in zip(guarded, plain))}
        (out / f"{how}.rank{dist.get_rank()}.json").write_text(json.dumps(result))  # not stdout: ranks' lines interleave
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
