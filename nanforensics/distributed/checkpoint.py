"""Checkpoints of a distributed run, in the run format (docs/run-format.md).

DDP's model and optimizer state are the same on every rank: rank 0 writes them, as a single process would, into a
checkpoint folder built under a hidden name and renamed into place. FSDP2's are sharded: every rank writes its own
shard through ``torch.distributed.checkpoint`` into the same hidden folder, ``{"model": state_dict, "optim":
{"state": {name: {key: tensor}}}, "step": step}``, and rank 0 adds ``meta.json`` (names, hyperparameters, the non-tensor
state) before the rename. Either way ``meta.json`` carries every rank's RNG state (``rank_rng``), gathered to rank 0,
and a job killed mid-write leaves the previous checkpoint as it was.

Reading never goes through ``torch.distributed.checkpoint``'s own loader, which unpickles ``.metadata``: the shards are
assembled whole by ``formats.dcp`` (a restricted unpickler, weights-only chunks) where ``runs.checkpoint`` reads a
checkpoint, and each rank of a replay at world size takes its own part of them (``tensors.shard_like``).
"""

from __future__ import annotations

import base64
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from ..errors import BadInput
from ..runs.checkpoint import TensorWriter, loose_grads, optimizer_state, restore_rng, rng_state


def rank_rng_state() -> dict[str, Any]:
    """This rank's RNG states, and which CUDA device is its own (a rank sees every device of its node)."""
    state = rng_state()
    if state["cuda"]:
        state["cuda_device"] = torch.cuda.current_device()
    return state


def restore_rank_rng(state: Any, device: torch.device, where: Path) -> None:
    """A rank's RNG states (from ``meta.json``'s ``rank_rng``, named ``where`` in errors) on this process; its own
    CUDA generator's state goes to ``device``'s."""
    if not isinstance(state, dict):
        raise BadInput(where, f"rank_rng holds {type(state).__name__}, not a rank's RNG states")
    restore_rng({**state, "cuda": []}, where)
    if state.get("cuda") and device.type == "cuda":
        try:
            own = state["cuda"][state.get("cuda_device", 0)]
            torch.cuda.set_rng_state(torch.frombuffer(bytearray(base64.b64decode(own, validate=True)),
                                                      dtype=torch.uint8), device)
        except (IndexError, KeyError, TypeError, ValueError, RuntimeError) as e:
            raise BadInput(where, f"rank_rng's CUDA state is not one recorded by nanforensics ({e})") from None


def save_shards(build: Path, model_sd: dict[str, torch.Tensor], tensors: dict[str, torch.Tensor], step: int,
                group: Any) -> None:
    """This rank's part of an FSDP2 checkpoint (its model state dict, its optimizer state tensors keyed
    ``"<name>/<key>"``), written into ``build`` by every rank together."""
    import torch.distributed.checkpoint as dcp

    state: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        name, _, skey = key.rpartition("/")
        state.setdefault(name, {})[skey] = tensor
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        dcp.save({"model": model_sd, "optim": {"state": state}, "step": step}, checkpoint_id=build,
                 process_group=group)


def gathered_loose_grads(module: torch.nn.Module, optimizer: torch.optim.Optimizer,
                         group: Any) -> dict[str, torch.Tensor] | None:
    """Every rank's gradients of the parameters no optimizer holds (``runs.checkpoint.loose_grads``, each whole),
    gathered to rank 0 for its checkpoint; None on the other ranks. Every rank calls it, before any other collective of
    the checkpoint: a sharded gradient is gathered by all its ranks. The ranks of DDP or FSDP2 hold the same ones (the
    first rank's are kept), a pipeline's stages each their own."""
    mine = {name: grad.cpu() for name, grad in loose_grads(module, optimizer).items()}
    leads = dist.get_rank() == 0
    held: list[Any] | None = [None] * dist.get_world_size() if leads else None
    dist.gather_object(mine, held, dst=0, group=group)
    if held is None:
        return None
    merged: dict[str, torch.Tensor] = {}
    for part in held:
        for name, grad in part.items():
            merged.setdefault(name, grad)
    return merged


def save_rank_shards(build: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer, step: int,
                     group: Any) -> None:
    """A rank other than 0's part of an FSDP2 checkpoint, into the folder rank 0 builds."""
    _, tensors, _, _ = optimizer_state(model, optimizer)
    save_shards(build, model.state_dict(), tensors, step, group)


def shard_writer(step: int, group: Any, announce: Any) -> TensorWriter:
    """``save_checkpoint``'s tensor writer on rank 0: tells the other ranks the folder (``announce``), then writes
    the shards with them."""
    def write(build: Path, model_sd: dict[str, torch.Tensor], tensors: dict[str, torch.Tensor],
              file_meta: dict[str, str]) -> None:
        announce(build)
        save_shards(build, model_sd, tensors, step, group)
    return write
