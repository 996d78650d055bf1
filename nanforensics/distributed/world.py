"""The process group a replay at world size runs in: torchrun's environment, the world-size check, the exit code.

``torchrun --nproc-per-node N -m nanforensics replay RUN`` starts N copies of the command line, each told its rank
through the environment (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``). Each joins the process group (gloo on CPU,
NCCL on GPU), replays its own rank, and leaves it; rank 0 writes the report, and every rank exits with its code.
"""

from __future__ import annotations

import shlex
import sys
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import torch
import torch.distributed as dist

from ..errors import BadInput
from ..runs.run import Run
from ..runs.stages import PIPELINE
from .env import exit_now, exit_on_stop, torchrun_env

_GLOO: dict[Any, Any] = {}


def object_group() -> Any:
    """The group Python objects (events, losses, RNG states, exit codes) travel on: the default group when it is gloo,
    else a gloo group made once over the same ranks, so NCCL is asked only to move tensors."""
    if str(dist.get_backend()) == "gloo":
        return None
    world = dist.group.WORLD
    if world not in _GLOO:
        _GLOO[world] = dist.new_group(backend="gloo")
    return _GLOO[world]


def mismatch(run: Run, ranks: int) -> str | None:
    """Why ``ranks`` processes cannot replay the run together, with the command that can; None when they can."""
    path = shlex.quote(str(run.path))
    if run.world is None:
        return None if ranks == 1 else (f"recorded by one process, replayed by {ranks}: run "
                                        f"`nanforensics replay {path}` without torchrun")
    recorded = run.world.world_size
    if ranks == recorded:
        return None
    if run.world.kind == PIPELINE:  # each rank its place in a stage: never emulated
        return (f"recorded by {recorded} ranks of a pipeline, replayed by {ranks} processes: run `torchrun "
                f"--nproc-per-node {recorded} -m nanforensics replay {path}`")
    return (f"recorded by {recorded} ranks, replayed by {ranks}: run `torchrun --nproc-per-node {recorded} -m "
            f"nanforensics replay {path}`, or `nanforensics replay {path}` to emulate the {recorded} ranks on one process")


@dataclass
class Joined:
    """This process's place in the replay: rank 0 of 1 outside torchrun."""

    rank: int = 0
    world_size: int = 1
    grouped: bool = False  # joined a process group

    @property
    def writes(self) -> bool:
        return self.rank == 0

    def agree(self, code: int) -> int:
        """Rank 0's exit code, on every rank, once rank 0 has written the report.

        torchrun stops the other workers (SIGTERM) as soon as one exits with a non-zero code; from here on such a
        stop ends this process with the agreed code, so every rank exits with the same one."""
        if not self.grouped:
            return code
        # rank 0's report is written only once it has left the buffers: the other ranks exit as soon as this returns,
        # and the stop torchrun then sends would otherwise land while rank 0 flushes it (a report cut mid-line)
        sys.stdout.flush()
        sys.stderr.flush()
        box = [code]
        dist.broadcast_object_list(box, src=0, group=object_group())
        agreed = int(box[0])
        exit_on_stop(agreed)
        return agreed

    def exit(self, code: int) -> None:
        """Under torchrun, end the process now with ``code`` (``exit_now``)."""
        if self.grouped:
            exit_now(code)


@contextmanager
def joined(run_dir: Path | None, device: torch.device) -> Iterator[Joined]:
    """Under torchrun, join the process group for the replay of ``run_dir`` (after checking the world size: a
    mismatch is bad input, raised before any rank waits on another), and leave it afterwards. ``run_dir`` None: a
    checkpoint replayed with the user's code (--checkpoint), which one process replays."""
    env = torchrun_env()
    if env is None:
        yield Joined()
        return
    rank, size, local_rank = env
    if run_dir is None:
        if size != 1:
            raise BadInput("--checkpoint", f"a run nobody recorded is replayed by one process, not {size}: run the "
                                           "same command without torchrun")
        yield Joined()
        return
    run = Run(run_dir)
    problem = mismatch(run, size)
    if problem is not None:
        raise BadInput(run.path, problem)
    if run.world is None:
        yield Joined()
        return
    if device.type == "cuda":
        torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    try:
        yield Joined(rank, size, True)
    finally:
        dist.destroy_process_group()
        _GLOO.clear()
