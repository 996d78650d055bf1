"""The recorder on one rank of a torchrun job: every rank records its own shard; rank 0 writes what ranks share.

Every rank constructs the ``Recorder`` with the same path and calls ``log`` at the same steps (the loop is the same
program on every rank), so checkpoints can be collective: the RNG states are gathered to rank 0, and FSDP2's shards
are written by every rank at once. The recorder's own messages travel on a gloo group, whatever backend trains.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from ..runs.checkpoint import save_checkpoint
from ..runs.compiled import compiled_backend, unwrapped
from ..runs.layout import DDP, World, rank_dir
from ..runs.stages import PIPELINE
from .checkpoint import gathered_loose_grads, rank_rng_state, save_rank_shards, shard_writer
from .world import object_group
from .wrapping import describe, describe_mesh


def recording_world(model: torch.nn.Module) -> "RankRecorder | None":
    """The distributed side of a recording, or None for a single process (no process group, or one rank and no
    data-parallel wrapper)."""
    if not (dist.is_available() and dist.is_initialized()):
        return None
    size = dist.get_world_size()
    try:  # torch.compile around the wrapper (wrap, then compile) is looked through: the wrapper says the layout
        kind, module, options = describe(model, size)
    except ValueError:
        if size == 1:
            return None
        raise
    # and torch.compile inside it (compile, then wrap): the names are the compiled module's, as on one process
    return RankRecorder(kind, unwrapped(module), options, compiled_backend(model) or compiled_backend(module))


class RankRecorder:
    def __init__(self, kind: str, module: torch.nn.Module, options: dict[str, Any], compiled: str | None = None) -> None:
        self.rank, self.size = dist.get_rank(), dist.get_world_size()
        self.module = module
        self.compiled = compiled  # the torch.compile backend, inside the wrapper or around it; None: not compiled
        self.group = object_group()
        # a pipeline's stages say their layout themselves (its data-parallel mesh is part of the (pp, dp) one)
        mesh = describe_mesh(module, self.size) if kind != PIPELINE else None
        self.world = World(self.size, kind, str(dist.get_backend()), options, mesh)
        self._scratch: tempfile.TemporaryDirectory[str] | None = None

    @property
    def leads(self) -> bool:
        """Rank 0 writes the manifest and the state every rank shares."""
        return self.rank == 0

    def prepare(self, path: Path, overwrite: bool) -> None:
        """Rank 0 checks and clears the run directory before any rank writes into it; all ranks raise alike."""
        problem = None
        if self.leads and path.exists() and any(path.iterdir()):
            if overwrite:
                shutil.rmtree(path)
            else:
                problem = f"{path} is not empty; pass overwrite=True to replace it"
        verdict = [problem]
        dist.broadcast_object_list(verdict, src=0, group=self.group)
        if verdict[0] is not None:
            raise FileExistsError(verdict[0])

    def data_dir(self, path: Path) -> Path:
        """Where this rank's batches and losses go: its data-parallel group's folder, written by the group's
        tensor-parallel rank 0 alone; the other ranks of the group, which saw the same batch, write into a scratch
        folder that goes with the recorder."""
        group = self.world.data_rank(self.rank)
        if self.world.lead(group) == self.rank:
            return rank_dir(path, group)
        self._scratch = tempfile.TemporaryDirectory(prefix="nanforensics-tp-rank-")
        return Path(self._scratch.name)

    def step_loss(self, step: int, loss: Any) -> Any:
        """The loss this rank logs for ``step``: its own (a pipeline's ranks log the last stage's)."""
        return loss

    def checkpoint(self, folder: Path, step: int, optimizer: torch.optim.Optimizer, *, scaler: Any,
                   scheduler: Any) -> None:
        grads = gathered_loose_grads(self.module, optimizer, self.group)
        states: list[Any] | None = [None] * self.size if self.leads else None
        dist.gather_object(rank_rng_state(), states, dst=0, group=self.group)
        sharded = self.world.kind != DDP  # DTensor parameters: every rank writes its shard
        if self.leads:
            writer = shard_writer(step, self.group, self._announce) if sharded else None
            save_checkpoint(folder, step, self.module, optimizer, scaler=scaler, scheduler=scheduler, rank_rng=states,
                            write_tensors=writer, grads=grads)
        elif sharded:
            save_rank_shards(self._announce(None), self.module, optimizer, step, self.group)

    def _announce(self, build: Path | None) -> Path:
        """The hidden folder rank 0 builds a checkpoint in, made known to every rank."""
        box = [build]
        dist.broadcast_object_list(box, src=0, group=self.group)
        assert box[0] is not None
        return Path(box[0])
