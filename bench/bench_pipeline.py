"""Recording and replaying a pipeline-parallel step against a plain one: a 2-stage MLP under ScheduleGPipe on gloo.

    python bench/bench_pipeline.py [--rounds 15] [--steps 10] [--width 512] [--every 50] [--layout pp|pp_dp|3d]
                                   [--replay 40]

Starts itself under torchrun: ``pp`` 2 processes, one stage each; ``pp_dp`` 4, torchtitan's dp_shard x pp at 2x2
(each stage under ``fully_shard`` on "dp_shard"); ``3d`` 8, torchtitan's FSDP2 x TP x PP at 2x2x2 (each stage's
layers colwise then rowwise on "tp", then ``fully_shard`` on "dp_shard"). Then the replay's cost: the recorded run
replayed at world size for 1 step and for ``--replay + 1``, the difference per step against the plain step. Each
rank holds two identical stages, one trained plainly and one under the Recorder (batches to disk, the step's loss
broadcast from the last stage, a checkpoint through torch.distributed.checkpoint every ``--every`` steps); the
variants run in turn each round (``--steps`` steps each), and the ratio is the median over rounds of the recorded
variant's time over the plain one's, with its interquartile range (bench/benchlib.py), on the wall clock and in CPU
time summed over every rank (which a loaded machine does not charge for waiting for a core). Rank 0 prints both.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from benchlib import paired_ratio  # noqa: E402

STAGES, BATCH, MICROBATCHES, FEATURES = 2, 64, 4, 64
RANKS = {"pp": 2, "pp_dp": 4, "3d": 8}  # processes per layout
MESHES = {"pp_dp": ((STAGES, 2), ("pp", "dp_shard")), "3d": ((STAGES, 2, 2), ("pp", "dp_shard", "tp"))}
TARGET = 1.25  # recording costs at most a quarter of a plain step


def build_model(width: int = 512) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(FEATURES, width), nn.Tanh(), nn.Linear(width, width), nn.Tanh(),
                         nn.Linear(width, width), nn.Tanh(), nn.Linear(width, 1))


def loss_fn(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(output, target)


def train_step(schedule: Any, optimizer: torch.optim.Optimizer, batch: dict[str, Any]) -> Any:
    optimizer.zero_grad(set_to_none=True)
    losses: list[torch.Tensor] = []
    schedule.step(*([batch["x"]] if "x" in batch else []), target=batch.get("y"), losses=losses)
    optimizer.step()
    return losses


def stage(width: int, mesh: Any = None) -> tuple[Any, torch.optim.Optimizer]:
    """This rank's stage: one per rank, or on ``mesh`` (pp, dp_shard[, tp]) split by its plan, then sharded."""
    from nanforensics.distributed.pipeline import prune
    from torch.distributed.pipelining import PipelineStage, ScheduleGPipe

    index = dist.get_rank() if mesh is None else mesh["pp"].get_local_rank()
    module = prune(build_model(width), [["0", "1", "2", "3"], ["4", "5", "6"]][index])
    group = None
    if mesh is not None:
        from torch.distributed.fsdp import fully_shard
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

        if "tp" in mesh.mesh_dim_names:
            pair = [("0", "2"), ("4", "6")][index]
            parallelize_module(module, mesh["tp"], {pair[0]: ColwiseParallel(), pair[1]: RowwiseParallel()})
        fully_shard(module, mesh=mesh["dp_shard"])
        group = mesh["pp"].get_group()
    schedule = ScheduleGPipe(PipelineStage(module, index, STAGES, torch.device("cpu"), group=group), MICROBATCHES,
                             loss_fn=loss_fn)
    return schedule, torch.optim.AdamW(module.parameters(), lr=1e-3)


def worker(args: argparse.Namespace) -> None:
    from nanforensics import Recorder

    dist.init_process_group("gloo")
    rank, size = dist.get_rank(), dist.get_world_size()
    mesh = None
    if args.layout in MESHES:
        from torch.distributed.device_mesh import init_device_mesh

        shape, names = MESHES[args.layout]
        mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(BATCH, FEATURES, generator=g), torch.randn(BATCH, 1, generator=g)
    batch = {"x": x, "ids": [f"s{i}" for i in range(BATCH)]} if rank < size // STAGES else {"y": y}
    plain_schedule, plain_opt = stage(args.width, mesh)
    rec_schedule, rec_opt = stage(args.width, mesh)
    out = Path(args.out)
    rec = Recorder(out / "run", rec_schedule, rec_opt, model_factory=build_model, step_fn=train_step,
                   model_kwargs={"width": args.width}, checkpoint_every=args.every, overwrite=True)
    step = [0]

    def plain() -> None:
        for _ in range(args.steps):
            train_step(plain_schedule, plain_opt, batch)

    def recorded() -> None:
        for _ in range(args.steps):
            rec.log(step[0], batch, train_step(rec_schedule, rec_opt, batch))
            step[0] += 1

    for fn in (plain, recorded):  # warm-up: shape inference, the optimizer's state, the first checkpoint
        fn()
    wall: dict[str, list[float]] = {"plain": [], "recorded": []}
    cpu: dict[str, list[float]] = {"plain": [], "recorded": []}  # both ranks' CPU time: waiting for a core is not charged
    for _ in range(args.rounds):
        for name, fn in (("plain", plain), ("recorded", recorded)):
            dist.barrier()
            start, start_cpu = time.perf_counter(), time.process_time()
            fn()
            used = torch.tensor([time.process_time() - start_cpu], dtype=torch.float64)
            dist.all_reduce(used)  # every rank's
            wall[name].append((time.perf_counter() - start) / args.steps)
            cpu[name].append(float(used) / args.steps)
    rec.close()
    if rank == 0:
        layout = {"pp": "one stage per rank", "pp_dp": "FSDP2 x PP (2x2)", "3d": "FSDP2 x TP x PP (2x2x2)"}[args.layout]
        print(f"2-stage MLP (width {args.width}), ScheduleGPipe, {MICROBATCHES} micro-batches of {BATCH // MICROBATCHES}, "
              f"{size} ranks on gloo, {layout}; checkpoint every {args.every} steps; {args.rounds} rounds of "
              f"{args.steps} steps")
        (out / "plain_step_s").write_text(str(sorted(wall["plain"])[len(wall["plain"]) // 2]))
        for clock, times in (("wall clock", wall), ("CPU time, all ranks", cpu)):
            median, q1, q3 = paired_ratio(times, "recorded")
            plain_ms = sorted(times["plain"])[len(times["plain"]) // 2] * 1e3
            print(f"{clock:21}  plain step {plain_ms:7.2f} ms  recorded / plain {median:6.3f}x  (IQR {q1:.3f}-{q3:.3f})"
                  f"  target <= {TARGET}x: {'met' if median <= TARGET else 'NOT met'}", flush=True)
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--every", type=int, default=50)
    parser.add_argument("--layout", choices=sorted(RANKS), default="pp")
    parser.add_argument("--replay", type=int, default=40, help="steps replayed (beyond the first) to time the replay")
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if "RANK" in os.environ:
        worker(args)
        return
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(RANKS[args.layout])]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    with tempfile.TemporaryDirectory() as tmp:
        argv = [*torchrun, __file__, "--rounds", str(args.rounds), "--steps", str(args.steps), "--width",
                str(args.width), "--every", str(args.every), "--layout", args.layout, "--out", tmp]
        code = subprocess.run(argv, env=env).returncode
        if code:
            sys.exit(code)
        replay_cost(torchrun, Path(tmp), min(args.replay, (args.rounds + 1) * args.steps - 1), env)


def replay_cost(torchrun: list[str], out: Path, steps: int, env: dict[str, str]) -> None:
    """The recorded run replayed at world size from its first checkpoint for 1 step and for ``steps + 1``: the
    difference per step (the start, the mesh and the checkpoint's load cancel out) against the plain step."""
    times = []
    for count in (1, steps + 1):
        command = [*torchrun, "-m", "nanforensics", "replay", str(out / "run"), "--from-step", "0", "--max-steps",
                   str(count), "--no-explain", "--json", str(out / f"replay_{count}.json")]
        start = time.perf_counter()
        done = subprocess.run(command, env=env, capture_output=True, text=True)
        times.append(time.perf_counter() - start)
        if done.returncode:
            sys.exit(f"replay exited {done.returncode}: {done.stderr[-2000:]}")
    per_step = (times[1] - times[0]) / steps
    plain = float((out / "plain_step_s").read_text())
    print(f"replay at world size  {times[0]:.1f} s for 1 step, {times[1]:.1f} s for {steps + 1}: {per_step * 1e3:7.2f} ms "
          f"a step, replay / plain {per_step / plain:6.2f}x (watched: every module's output, every local gradient)",
          flush=True)


if __name__ == "__main__":
    main()
