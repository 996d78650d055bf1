"""Checkpoints of a distributed run, in the run format (docs/run-format.md).

DDP's model and optimizer state are the same on every rank: rank 0 writes them, as a single process would, into a
checkpoint folder built under a hidden name and renamed into place. FSDP2's are sharded: every rank writes its own
shard through ``torch.distributed.checkpoint`` into the same hidden folder, ``{"model": state_dict, "optim":
{"state": {name: {key: tensor}}}, "step": step}``, and rank 0 adds ``meta.json`` (names, hyperparameters, the non-tensor
state) before the rename. Either way ``meta.json`` carries every rank's RNG state (``rank_rng``), gathered to rank 0,
and a job killed mid-write leaves the previous checkpoint as it was.

Reading never goes through ``torch.distributed.checkpoint``'s own loader, which unpickles ``.metadata``: the shards are
assembled whole by ``formats.dcp`` (a restricted unpickler, weights-only chunks), and each rank of a replay at world size
takes its own part of them (``tensors.shard_like``).
"""

from __future__ import annotations

import base64
import warnings
from pathlib import Path
from typing import Any

import torch

from ..errors import BadInput
from ..formats.dcp import Layout, assemble
from ..runs.checkpoint import TensorWriter, optimizer_state, restore_rng, rng_state


def rank_rng_state() -> dict[str, Any]:
    """This rank's RNG states, and which CUDA device is its own (a rank sees every device of its node)."""
    state = rng_state()
    if state["cuda"]:
        state["cuda_device"] = torch.cuda.current_device()
    return state


def restore_rank_rng(state: dict[str, Any], device: torch.device) -> None:
    """A rank's RNG states on this process; its own CUDA generator's state goes to ``device``'s."""
    restore_rng({**state, "cuda": []})
    if state.get("cuda") and device.type == "cuda":
        own = state["cuda"][state.get("cuda_device", 0)]
        torch.cuda.set_rng_state(torch.frombuffer(bytearray(base64.b64decode(own)), dtype=torch.uint8), device)


def _dcp_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer, step: int) -> dict[str, Any]:
    _, tensors, _, _ = optimizer_state(model, optimizer)
    state: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        name, _, skey = key.rpartition("/")
        state.setdefault(name, {})[skey] = tensor
    return {"model": model.state_dict(), "optim": {"state": state}, "step": step}


def save_shards(build: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer, step: int,
                group: Any) -> None:
    """This rank's part of an FSDP2 checkpoint, written into ``build`` by every rank together."""
    import torch.distributed.checkpoint as dcp

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        dcp.save(_dcp_state(model, optimizer, step), checkpoint_id=build, process_group=group)


def shard_writer(optimizer: torch.optim.Optimizer, step: int, group: Any,
                 announce: Any) -> TensorWriter:
    """``save_checkpoint``'s tensor writer on rank 0: tells the other ranks the folder (``announce``), then writes
    the shards with them."""
    def write(build: Path, model: torch.nn.Module, tensors: dict[str, torch.Tensor], file_meta: dict[str, str]) -> None:
        announce(build)
        save_shards(build, model, optimizer, step, group)
    return write


def read_sharded(metadata: Path) -> tuple[dict[str, torch.Tensor], list[tuple[str, torch.Tensor]]]:
    """The model's state dict and the optimizer's state tensors (keyed ``"<name>/<key>"``), each tensor whole."""
    layout = Layout(metadata)
    model: dict[str, torch.Tensor] = {}
    optim: list[tuple[str, torch.Tensor]] = []
    for t in layout.tensors:
        path = tuple(map(str, t.path))
        if len(path) == 2 and path[0] == "model":
            model[path[1]] = assemble(t)
        elif len(path) == 4 and path[:2] == ("optim", "state"):
            optim.append((f"{path[2]}/{path[3]}", assemble(t)))
        else:
            raise BadInput(metadata, f"entry {t.fqn!r} is neither model nor optimizer state of a nanforensics checkpoint")
    return model, optim
