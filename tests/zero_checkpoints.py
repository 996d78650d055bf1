"""Real DeepSpeed ZeRO checkpoints for tests/test_zero.py, written by DeepSpeed's own engine on the CPU.

``python tests/zero_checkpoints.py OUT`` trains a tiny model (two param groups, a BatchNorm's buffers, a frozen
parameter, sizes that leave padding at world 2) with ``deepspeed.initialize`` over a gloo process group of one process
and, beside it, of two, for ZeRO stages 1, 2 and 3 (torch's AdamW as the client optimizer: no DeepSpeed op is built),
and saves with ``engine.save_checkpoint``:

- ``OUT/w{WORLD}/s{STAGE}/run/global_step{1..4}``: steps 1 and 2 clean; before step 3's save one coordinate of the fp32
  master partition is set to NaN in memory, and training goes on from it, so steps 3 and 4 are poisoned;
- ``OUT/w{WORLD}/s{STAGE}/plants/{kind}-r{rank}-i{index}``: the state after step 2, with NaN at flat position ``index``
  of rank ``rank``'s partition of group 0 in ``kind`` (``fp32``: the master weights, ``exp_avg``, ``exp_avg_sq``);
- ``OUT/w{WORLD}/s{STAGE}/plants/numbered``: every fp32 partition coordinate holds its own number (rank * 10^6 +
  group * 10^4 + position), and exp_avg the same plus 0.5: the mapping back to parameters, laid bare;
- ``OUT/w{WORLD}/s{STAGE}/plants/unsound``: exp_avg at group 0's ``UNSOUND_INDEX`` (rank 0) 100 times Adam's bound;
- ``OUT/bf16/s1`` and ``OUT/fp16/s2`` (world 1): a 16-bit run's ``clean`` checkpoint, ``module-inf`` (inf in the
  16-bit working copy of one weight, the fp32 master finite) and ``scale-inf`` (the loss scaler's scale inf);
- ``OUT/w2/s{STAGE}/damaged/{what}``: ``run/global_step2`` with one optimizer states file made to disagree with the
  rest (``DAMAGE``: a partition count, a partition or an exp_avg one element short, a group missing, a stage 7);
- ``OUT/w{WORLD}/s{STAGE}/plants/zero_to_fp32.pt``: what DeepSpeed's ``get_fp32_state_dict_from_zero_checkpoint``
  makes of ``numbered``, and where the NaN of each fp32 plant lands in its reconstruction (the tests' expectations,
  computed here so that the test process never imports DeepSpeed).

DeepSpeed's shared-memory all-reduce op is left out (``__compatible_ops__``, DeepSpeed's own gate for ops a machine
cannot build): it is a speed-up that would be compiled (a minute and a half) on first use.
"""

from __future__ import annotations

import math
import os
import sys
import types
from pathlib import Path

import torch

STAGES = (1, 2, 3)
# world 2's layouts beside the defaults: stage 2 pads each parameter to 4 elements (param_alignment_paddings: 35 -> 36),
# stage 3 puts fc1.weight's and fc2.weight's pieces in flat sub-groups of their own within one param group
VARIANTS = {(2, 2): {"parameter_alignment": True}, (3, 2): {"sub_group_size": 16}}
WORLDS = (1, 2)
KINDS = ("fp32", "exp_avg", "exp_avg_sq")
UNSOUND_INDEX = 3
MIXED = (("bf16", 1), ("fp16", 2))  # world 1: 16-bit working copies beside the fp32 master weights
MODULE_INF = (1, 2)
# damaged/{what} (world 2): how the optimizer states disagree with the rest, and the words the error names it by
DAMAGE = {"partition_count": "partition_count", "short_partition": "hold", "short_state": "exp_avg of flat group 0",
          "groups": "rank 0", "stage": "zero_stage"}
BAD_STEP = 3  # the first poisoned global_step folder of run/
_MUON = "deepspeed.runtime.zero.muon.muon_optimizer"  # compiles its kernels on import: seconds a run here never uses


class Tiny(torch.nn.Module):
    """Sizes 35, 7, 7, 7, 21, 3 (odd: padding at world 2), a BatchNorm's buffers, one frozen parameter."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = torch.nn.Linear(5, 7)
        self.bn = torch.nn.BatchNorm1d(7)
        self.fc2 = torch.nn.Linear(7, 3)
        self.frozen = torch.nn.Parameter(torch.linspace(-1, 1, 5), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.bn(self.fc1(x + self.frozen))))


def plants(partition: int) -> list[int]:
    """Positions of a rank's group-0 partition to plant at: both ends, and some between."""
    return sorted({0, 1, partition // 3, partition // 2 + 1, partition - 1})


def _fp32(opt: object, stage: int) -> list[torch.Tensor]:
    return opt.fp32_partitioned_groups_flat if stage == 3 else opt.single_partition_of_fp32_groups  # type: ignore


def _state(opt: object, stage: int, g: int) -> dict[str, torch.Tensor]:
    return opt.optimizer.state[_fp32(opt, stage)[g]]  # type: ignore


def _tensor(opt: object, stage: int, kind: str) -> torch.Tensor:
    return _fp32(opt, stage)[0] if kind == "fp32" else _state(opt, stage, 0)[kind]


def _worker(rank: int, world: int, out: Path, store: str) -> None:
    import deepspeed
    import deepspeed.ops
    import torch.distributed as dist

    torch.set_num_threads(1)  # every worker, spawned ones too: the same bytes whatever OMP_NUM_THREADS says
    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    sys.modules[_MUON] = types.ModuleType(_MUON)  # its optimizer class, which ZeRO checks for, stands for none here
    sys.modules[_MUON].MuonWithAuxAdam = type("MuonWithAuxAdam", (), {})  # type: ignore[attr-defined]
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    for stage in STAGES:
        _stage(stage, rank, world, out)
    if world == 1:
        for precision, stage in MIXED:
            _mixed(precision, stage, out)
    dist.barrier()
    dist.destroy_process_group()
    if world > 1:  # a spawned rank: its files are closed; the interpreter's teardown once aborted it ("terminate called
        os._exit(0)  # without an active exception", a native thread destroyed still joinable), failing the whole job


def _stage(stage: int, rank: int, world: int, out: Path) -> None:
    import deepspeed

    torch.manual_seed(0)
    model = Tiny()
    decay = [p for n, p in model.named_parameters() if p.requires_grad and n.endswith("weight") and "bn" not in n]
    rest = [p for p in model.parameters() if p.requires_grad and all(p is not d for d in decay)]
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}],
                                  lr=0.01)
    config = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1,
              "zero_optimization": {"stage": stage, **VARIANTS.get((stage, world), {})},
              "zero_allow_untested_optimizer": True,
              "steps_per_print": 10 ** 9}
    engine, opt, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=config,
                                             dist_init_required=False)
    base = out / f"w{world}" / f"s{stage}"
    data = torch.Generator().manual_seed(1 + rank)

    def step() -> None:
        loss = engine(torch.randn(4, 5, generator=data)).pow(2).mean()
        engine.backward(loss)
        engine.step()

    for _ in range(2):
        step()
        engine.save_checkpoint(base / "run")
    with torch.no_grad():  # the master weights are leaves that require grad
        for kind in KINDS:
            t = _tensor(opt, stage, kind)
            for index in plants(t.numel()):
                for target in range(world):
                    keep = float(t[index])
                    if rank == target:
                        t[index] = math.nan
                    engine.save_checkpoint(base / "plants", tag=f"{kind}-r{target}-i{index}", save_latest=False)
                    t[index] = keep
        kept = [(f.clone(), _state(opt, stage, g)["exp_avg"].clone()) for g, f in enumerate(_fp32(opt, stage))]
        for g, f in enumerate(_fp32(opt, stage)):
            numbers = rank * 10 ** 6 + g * 10 ** 4 + torch.arange(f.numel(), dtype=torch.float32)
            f.copy_(numbers)
            _state(opt, stage, g)["exp_avg"].copy_(numbers + 0.5)
        engine.save_checkpoint(base / "plants", tag="numbered", save_latest=False)
        for g, (f, m) in enumerate(kept):
            _fp32(opt, stage)[g].copy_(f)
            _state(opt, stage, g)["exp_avg"].copy_(m)
        m, v = _state(opt, stage, 0)["exp_avg"], _state(opt, stage, 0)["exp_avg_sq"]
        keep_m = float(m[UNSOUND_INDEX])
        if rank == 0:
            m[UNSOUND_INDEX] = 100 * math.sqrt(float(v[UNSOUND_INDEX])) + 1.0
        engine.save_checkpoint(base / "plants", tag="unsound", save_latest=False)
        m[UNSOUND_INDEX] = keep_m
        if rank == 0:
            _fp32(opt, stage)[0][plants(_fp32(opt, stage)[0].numel())[2]] = math.nan
    step()  # the NaN weight poisons the forward pass
    engine.save_checkpoint(base / "run")
    step()
    engine.save_checkpoint(base / "run")
    engine.destroy()
    if rank == 0:
        _expect(base / "plants")
        if world == 2:
            _damage(base)


def _mixed(precision: str, stage: int, out: Path) -> None:
    """A 16-bit run (a Linear pair: BatchNorm does not run in 16 bits on the CPU): its ``bf16_``-named optimizer
    states or fp16 loss scaler; ``module-inf`` with inf at ``MODULE_INF`` of the working copy of ``0.weight``,
    ``scale-inf`` with the loss scaler's scale inf."""
    import deepspeed

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.ReLU(), torch.nn.Linear(7, 3))
    config = {"train_micro_batch_size_per_gpu": 4, "zero_optimization": {"stage": stage},
              "zero_allow_untested_optimizer": True, precision: {"enabled": True}, "steps_per_print": 10 ** 9}
    engine, opt, _, _ = deepspeed.initialize(model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=0.01),
                                             config=config, dist_init_required=False)
    dtype = torch.bfloat16 if precision == "bf16" else torch.float16
    base = out / precision / f"s{stage}"
    for _ in range(2):
        engine.backward(engine(torch.randn(4, 5, dtype=dtype)).float().pow(2).mean())
        engine.step()
    engine.save_checkpoint(base, tag="clean", save_latest=False)
    weight = engine.module[0].weight
    with torch.no_grad():
        keep = weight[MODULE_INF].item()
        weight[MODULE_INF] = math.inf
        engine.save_checkpoint(base, tag="module-inf", save_latest=False)
        weight[MODULE_INF] = keep
    opt.loss_scaler.cur_scale = math.inf
    engine.save_checkpoint(base, tag="scale-inf", save_latest=False)
    engine.destroy()


def _damage(base: Path) -> None:
    """Copies of ``run/global_step2`` whose optimizer states disagree with the rest (``DAMAGE``), rewritten here where
    DeepSpeed's classes can be unpickled and pickled again as they were."""
    import shutil

    for what in DAMAGE:
        folder = base / "damaged" / what
        shutil.copytree(base / "run" / "global_step2", folder)
        rank = 1 if what in ("short_partition", "groups") else 0
        file = next(folder.glob(f"zero_pp_rank_{rank}_*optim_states.pt"))
        obj = torch.load(file, weights_only=False)
        sd = obj["optimizer_state_dict"]
        flats = sd["fp32_flat_groups" if "fp32_flat_groups" in sd else "single_partition_of_fp32_groups"]
        base_state = sd.get("optimizer_state_dict", sd.get("base_optimizer_state"))
        if what == "partition_count":
            sd["partition_count"] = [3] * len(flats) if isinstance(sd["partition_count"], list) else 3
        elif what == "short_partition":
            flats[0] = flats[0][:-1].clone()
        elif what == "short_state":
            base_state["state"][0]["exp_avg"] = base_state["state"][0]["exp_avg"][:-1].clone()
        elif what == "groups":
            flats.pop()
        elif what == "stage":
            sd["zero_stage"] = 7
        torch.save(obj, file)


def _expect(plants: Path) -> None:
    """DeepSpeed's own reconstruction (``zero_to_fp32``) of the numbered checkpoint, and where each fp32 plant's NaN
    lands in it (none: the position is padding), saved beside them as ``zero_to_fp32.pt``."""
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint as to_fp32

    out: dict[str, object] = {"numbered": {n: t.clone() for n, t in to_fp32(plants, tag="numbered").items()}}
    nan = {}
    for folder in sorted(plants.glob("fp32-*")):
        sd = to_fp32(plants, tag=folder.name)
        nan[folder.name] = [[n, t.isnan().nonzero()[0].tolist()] for n, t in sd.items()
                            if t.is_floating_point() and bool(t.isnan().any())]
    out["nan"] = nan
    torch.save(out, plants / "zero_to_fp32.pt")


def generate(out: Path) -> None:
    """Every checkpoint: world 2 in two worker processes of torch.multiprocessing while this one writes world 1."""
    import torch.multiprocessing as mp

    out.mkdir(parents=True, exist_ok=True)
    store = str(out.resolve() / ".store")
    pair = mp.start_processes(_worker, args=(WORLDS[1], out, store + "-2"), nprocs=WORLDS[1], join=False,
                              start_method="spawn")
    _worker(0, 1, out, store + "-1")
    while not pair.join():
        pass


if __name__ == "__main__":
    generate(Path(sys.argv[1]))
