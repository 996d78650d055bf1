"""The cost of recording and of replay at world size on a DeviceMesh, against a plain training step, at 4 ranks.

    python -m torch.distributed.run --standalone --nproc-per-node 4 bench/bench_mesh.py [--layout fsdp2_tp]
        [--hidden 512] [--rounds 20]

Run from the checkout's root. Every rank trains the regressor of ``tests/scenarios.py`` laid out as
``tests/mesh_job.py`` lays it out (``tp``, ``fsdp2_tp`` or ``hsdp``, gloo on CPU), three models side by side: a
plain one; one under the recorder (the step, then ``Recorder.log``: the batch and loss to disk in the background;
checkpoints, a collective ``torch.distributed.checkpoint`` write, are left out: their cost is per checkpoint, not per
step); and the replay of that recording, one rank per process as ``torchrun -m nanforensics replay`` runs it (the
rebuilt mesh and plan, the user's step, every stage checked on the local shards, each step's events and losses
gathered to every rank). Round by round each variant runs one step, timed on rank 0 from a barrier to a barrier; the
ratios are the medians of the per-round ratios, with their interquartile ranges (bench/benchlib.py).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, DistributedSampler

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "tests"), str(ROOT / "bench")]

from benchlib import ms, paired_ratio  # noqa: E402
from nanforensics import Recorder  # noqa: E402
from nanforensics.distributed.sessions import open_session  # noqa: E402
from nanforensics.replay.monitor import StepMonitor  # noqa: E402
from nanforensics.runs.run import Run, UserCode  # noqa: E402

import mesh_job  # noqa: E402
import scenarios  # noqa: E402
from distributed_job import SHARD, Readings  # noqa: E402


def timed(fn) -> float:  # type: ignore[no-untyped-def]
    dist.barrier()
    start = time.perf_counter()
    fn()
    dist.barrier()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layout", choices=sorted(mesh_job.LAYOUTS), default="fsdp2_tp")
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--rounds", type=int, default=20)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    cpu, kwargs = torch.device("cpu"), {"hidden": args.hidden}
    plain, group = mesh_job.lay_out(scenarios.build_model(**kwargs), args.layout, cpu)
    recorded, _ = mesh_job.lay_out(scenarios.build_model(**kwargs), args.layout, cpu)
    plain_opt, recorded_opt = torch.optim.AdamW(plain.parameters()), torch.optim.AdamW(recorded.parameters())
    groups = mesh_job.groups(args.layout)
    data = Readings((args.rounds + 1) * SHARD * groups, None)
    batches = list(DataLoader(data, batch_size=SHARD, sampler=DistributedSampler(data, groups, group, shuffle=False)))
    box = [tempfile.mkdtemp(prefix="bench-mesh-") if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(box)
    out = Path(box[0]) / args.layout
    rec = Recorder(out, recorded, recorded_opt, model_factory="tests/scenarios.py:build_model", model_kwargs=kwargs,
                   step_fn="tests/scenarios.py:train_step", checkpoint_every=10**6, overwrite=True)
    times: dict[str, list[float]] = {"plain": [], "recorded": [], "plain_2": [], "replayed": []}

    def record_step(step: int) -> None:
        rec.log(step, batches[step], scenarios.train_step(recorded, recorded_opt, batches[step]))

    for step in range(args.rounds + 1):  # round 0 warms up
        t = [timed(lambda: scenarios.train_step(plain, plain_opt, batches[step])), timed(lambda: record_step(step))]
        if step:
            times["plain"].append(t[0])
            times["recorded"].append(t[1])
    rec.close()
    run = Run(out)
    session = open_session(run, UserCode.load(run, [ROOT / "tests"]), run.checkpoints()[0], cpu)
    with StepMonitor(session.model, session.optimizer) as monitor:
        for step in range(args.rounds + 1):
            t = [timed(lambda: scenarios.train_step(plain, plain_opt, batches[step])),
                 timed(lambda: session.run_step(monitor))]
            if step:
                times["plain_2"].append(t[0])
                times["replayed"].append(t[1])
    if dist.get_rank() == 0:
        print(f"{args.layout} on {dist.get_world_size()} ranks (gloo, CPU), regressor hidden={args.hidden}, "
              f"{SHARD} samples per data-parallel group, {args.rounds} rounds; plain step "
              f"{ms(statistics.median(times['plain']))}")
        for name, base in (("recorded", "plain"), ("replayed", "plain_2")):
            median, q1, q3 = paired_ratio(times, name, base)
            print(f"  {name:<9} {median:5.2f}x a plain step  (IQR {q1:.2f}-{q3:.2f}; "
                  f"{ms(statistics.median(times[name]))})")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
