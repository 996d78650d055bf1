"""Distributed training runs with a known answer, recorded under torchrun by the project's recorder.

    python -m torch.distributed.run --nproc-per-node 2 tests/distributed_job.py OUT NAME... [--code tests/scenarios.py]
        [--cuda]

Every rank trains the seed model of ``scenarios`` on its own shard of one dataset (a ``DistributedSampler``), wrapped by
DDP or FSDP2's ``fully_shard``, and every rank records with the same path. Only rank ``BAD_RANK``'s shard carries the
data defect: at step ``DEFECT_STEP`` its sample ``DEFECT_SAMPLE`` holds a near-zero reading (3e-45), so that rank's
loss is finite and its local gradient of ``features.gain[3]`` is infinite; the collective spreads it to every rank.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import random
import sys
from pathlib import Path
from typing import Any, Callable, Iterable, NamedTuple

import numpy
import torch
import torch.distributed as dist
import torch.nn.functional as F
from nanforensics import Recorder
from torch import nn
from torch.utils.data import DataLoader, Dataset, DistributedSampler

import scenarios

WORLD, SHARD = 2, 8          # ranks, samples per rank per step
STEPS, EVERY = 8, 3          # steps recorded, checkpoint interval: checkpoints 0, 3, 6
DEFECT_STEP, BAD_RANK, DEFECT_SAMPLE = 4, 1, scenarios.DEFECT_SAMPLE
FLIP_STEP = 5                # the flaky-hardware runs: rank 1's copy (or shard) of a weight turns NaN after this step


def defect_index(step: int = DEFECT_STEP, rank: int = BAD_RANK, position: int = DEFECT_SAMPLE) -> int:
    """The dataset index a DistributedSampler (no shuffling) hands ``rank`` at ``position`` of its shard at ``step``."""
    return (step * SHARD + position) * WORLD + rank


class Readings(Dataset):
    """Positive readings and their targets, as ``scenarios.make_batch`` draws them, one sample at a time with an id."""

    def __init__(self, size: int, defect: int | None, spike: bool = False) -> None:
        g = torch.Generator().manual_seed(0)
        self.x = torch.exp(torch.randn(size, scenarios.N_FEATURES, generator=g) * 0.5)
        self.y = torch.exp(torch.log(self.x).mean(dim=1, keepdim=True) + 0.1 * torch.randn(size, 1, generator=g))
        if defect is not None:  # a reading squashed into fp32's denormal range, or a glitch reading
            self.x[defect, scenarios.DEFECT_FEATURE] = 1e13 if spike else 3e-45

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> dict[str, Any]:
        return {"x": self.x[i], "y": self.y[i], "id": f"sample-{i:05d}"}


class Documents(Dataset):
    """Right-padded token sequences, as ``scenarios.make_token_batch`` draws them, one at a time with an id;
    ``defect`` empties that document: padding throughout, so every row of its attention is masked. The documents
    ``unlabelled`` keep their tokens but have every label ignored (-100), as prompt-only examples do."""

    def __init__(self, size: int, defect: int | None, unlabelled: list[int] | None = None) -> None:
        drawn = scenarios.make_token_batch(0, batch_size=size)
        self.tokens, self.labels = drawn["tokens"], drawn["labels"]
        if defect is not None:
            self.tokens[defect], self.labels[defect] = scenarios.PAD, -100
        for i in unlabelled or []:
            self.labels[i] = -100

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, i: int) -> dict[str, Any]:
        return {"tokens": self.tokens[i], "labels": self.labels[i], "id": f"doc-{i:05d}"}


def train_step_accumulate(model: nn.Module, optimizer: torch.optim.Optimizer, batch: dict[str, Any]) -> torch.Tensor:
    """Gradient accumulation over two micro-batches, all but the last under DDP's ``no_sync()`` (the gradients
    accumulate locally; the last backward all-reduces them), then clipping, which sees the averaged gradients."""
    optimizer.zero_grad(set_to_none=True)
    n = batch["x"].shape[0]
    parts = [p for p in (slice(0, n // 2), slice(n // 2, n)) if p.stop > p.start]
    total = torch.zeros(())
    for i, part in enumerate(parts):
        with model.no_sync() if i < len(parts) - 1 else contextlib.nullcontext():
            loss = F.mse_loss(model(batch["x"][part]), batch["y"][part]) * (part.stop - part.start) / n
            loss.backward()
        total += loss.detach()
    torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=1.0)
    optimizer.step()
    return total


class Job(NamedTuple):
    wrapping: str  # "ddp" or "fsdp2"
    step_fn: Callable[..., Any]
    defect: bool  # rank 1's shard holds the near-zero reading at DEFECT_STEP
    flaky: bool = False  # rank 1's copy (or shard) of a weight turns NaN after FLIP_STEP, outside the step function
    model_kwargs: dict[str, Any] = {}
    decoder: bool = False  # the transformer of scenarios on token documents, instead of the regressor on readings
    spike: bool = False  # the defect is a glitch reading (1e13): a finite gradient whose square overflows
    unlabelled: bool = False  # the decoder, and every label of rank 1's shard at DEFECT_STEP ignored: a NaN loss only
    compiled: str = ""  # "before": torch.compile, then the wrapper; "after": the wrapper, then torch.compile
    matrices: bool = False  # the optimizer holds the 2-d parameters only, as Muon does: the gains and biases
    # require grad, and their gradients, never zeroed, carry over from step to step


RUNS: dict[str, Job] = {
    "ddp": Job("ddp", scenarios.train_step, True),
    "fsdp2": Job("fsdp2", scenarios.train_step, True),
    "ddp_accumulate": Job("ddp", train_step_accumulate, True),
    "ddp_batchnorm": Job("ddp", scenarios.train_step, True, model_kwargs={"batchnorm": True}),  # buffers broadcast
    "ddp_decoder": Job("ddp", scenarios.train_step_lm, True, decoder=True),  # a fully padded document on rank 1
    "ddp_state_overflow": Job("ddp", scenarios.train_step, True, model_kwargs={"log_features": False, "act": "relu"},
                              spike=True),
    "ddp_loss_only": Job("ddp", scenarios.train_step_lm, False, decoder=True, unlabelled=True),
    "ddp_flaky": Job("ddp", scenarios.train_step, False, True),
    "fsdp2_flaky": Job("fsdp2", scenarios.train_step, False, True),
    "ddp_compiled": Job("ddp", scenarios.train_step, True, compiled="before"),
    "ddp_compile_wrapped": Job("ddp", scenarios.train_step, True, compiled="after"),
    "fsdp2_compiled": Job("fsdp2", scenarios.train_step, True, compiled="before"),
    "fsdp2_compile_wrapped": Job("fsdp2", scenarios.train_step, True, compiled="after"),
    "fsdp2_loose": Job("fsdp2", scenarios.train_step, True, matrices=True),  # the gain's inf gradient never stepped
    "fsdp2_killed": Job("fsdp2", scenarios.train_step, False),  # rank 1 dies writing checkpoint KILLED_AT: run it last
}
KILLED_AT = 6


def die_writing(checkpoint: str) -> None:
    """This rank dies once its shard of ``checkpoint`` is on disk, before the checkpoint is complete: torchrun then
    stops the other ranks, as a node lost mid-write would."""
    from torch.distributed.checkpoint import filesystem

    write = filesystem._FileSystemWriter.write_data

    def dying(self: Any, plan: Any, planner: Any) -> Any:
        written = write(self, plan, planner)
        if checkpoint in str(self.path):
            written.wait()
            os._exit(9)
        return written

    filesystem._FileSystemWriter.write_data = dying


COMPILE_BACKEND = "aot_eager"  # aten kernels, as eager mode runs them (inductor takes minutes to compile on 2 cores)


def wrap(model: nn.Module, how: str, compiled: str = "") -> nn.Module:
    """The model as the loop trains it: wrapped by DDP or ``fully_shard``, compiled before or after (the two orders
    users write), or not."""
    if compiled == "before":
        model = torch.compile(model, backend=COMPILE_BACKEND)
    if how == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        wrapped: nn.Module = DistributedDataParallel(model)
    else:
        from torch.distributed.fsdp import fully_shard

        wrapped = fully_shard(model)
    return torch.compile(wrapped, backend=COMPILE_BACKEND) if compiled == "after" else wrapped


def record(out: Path, name: str, code: str | None = None, device: torch.device = torch.device("cpu")) -> list[float]:
    """Train run ``name`` on this rank under the recorder; returns this rank's logged losses."""
    how, step_fn, defect, flaky, kwargs, decoder, spike, unlabelled, compiled, matrices = RUNS[name]
    named = lambda fn: fn if code is None or fn.__module__ != "scenarios" else f"{code}:{fn.__qualname__}"  # noqa: E731
    size, at = STEPS * SHARD * WORLD, defect_index() if defect else None
    ignored = [defect_index(position=i) for i in range(SHARD)] if unlabelled else None  # rank 1's shard at step 4
    data = Documents(size, at, ignored) if decoder else Readings(size, at, spike)
    loader = DataLoader(data, batch_size=SHARD, sampler=DistributedSampler(data, shuffle=False))
    factory = scenarios.build_decoder if decoder else scenarios.build_model
    model = wrap(factory(**kwargs).to(device), how, compiled)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.ndim == 2 or not matrices])
    losses = []
    if name == "fsdp2_killed" and dist.get_rank() == BAD_RANK:
        die_writing(f"step_{KILLED_AT:08d}")
    rec = Recorder(out / name, model, optimizer, model_factory=named(factory), model_kwargs=kwargs,
                   step_fn=named(step_fn), checkpoint_every=EVERY, overwrite=True)
    for step, batch in enumerate(loader):
        batch = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}
        loss = step_fn(model, optimizer, batch)
        if flaky and step == FLIP_STEP and dist.get_rank() == BAD_RANK:
            with torch.no_grad():  # a bit flip in this rank's copy or shard, outside anything the step function does
                weight = model.module.fc2.weight if how == "ddp" else model.fc2.weight.to_local()
                weight[0, 0] = math.nan
        rec.log(step, batch, loss)
        losses.append(float(loss.detach()))
    rec.close()
    return losses


def command(out: Path, names: list[str], *options: str) -> list[str]:
    """The torchrun command line that records ``names`` into ``out`` (run it from the checkout's root: the runs name
    their code ``tests/scenarios.py:...``, as the shipped sample runs do)."""
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(WORLD),
            str(Path(__file__).resolve()), str(out), *names, "--code", "tests/scenarios.py", *options]


def main_for(doc: str, names: Iterable[str], record: Callable[[Path, str, str | None, torch.device], list[float]]
             ) -> None:
    """A job script's command line: on every rank of a torchrun job, record each run named, one after another."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("names", nargs="+", choices=sorted(names))
    parser.add_argument("--code", help="name the scenarios by this path (relative to the checkout's root)")
    parser.add_argument("--cuda", action="store_true", help="train on this rank's GPU, NCCL between ranks")
    args = parser.parse_args()
    os.environ.setdefault("SOURCE_DATE_EPOCH", "1764633600")  # fixed: regenerated runs are byte-identical
    random.seed(0)
    numpy.random.seed(0)  # its RNG state is checkpointed too
    device = torch.device("cpu")
    if args.cuda:
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if args.cuda else "gloo")
    for name in args.names:
        losses = record(args.out, name, args.code, device)
        if dist.get_rank() == 0:
            print(f"{name}: {len(losses)} steps, rank 0's last logged loss {losses[-1]:.4g}", flush=True)
    dist.destroy_process_group()


def main() -> None:
    main_for(__doc__, RUNS, record)


if __name__ == "__main__":
    main()
