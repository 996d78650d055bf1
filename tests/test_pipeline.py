"""Pipeline-parallel runs: a 2-stage MLP under torch.distributed.pipelining (GPipe and 1F1B, 4 micro-batches), recorded
by the project's recorder on both ranks (tests/pipeline_job.py), replayed at world size through the real command line,
all in ONE gloo torchrun launch (tests/replays_job.py).

Only sample 1 of micro-batch 2 at step 3 carries the defect: in the GPipe run a near-zero reading in stage 0's input
(finite losses, an infinite gradient of stage 0's ``0.gain[3]``), in the 1F1B run a glitch target on the last stage
(that micro-batch's loss overflows, nothing else). The replay must name the step, the stage and its rank, the
micro-batch, the sample and the coordinate, and leave the run untouched.

A third 2-stage run ("gpipe_scheduled") steps an LR scheduler on each stage and leaves stage 0's gain out of its
optimizer: its gradient is never zeroed, and the replay's group testing must start each pass from the gradient
before the step.

Pipeline x data parallelism: "1f1b_dp" and "1f1b_fsdp", 2 stages x 2 data-parallel ranks (4 processes, one launch of
their own for both: the one 4-process job of the suite, about 20-25 s on 2 cores), each stage under DDP or FSDP2 over
its dp group, as torchtitan's (pp, dp) mesh lays them out; the defect in pipeline 1's batch.

FSDP2 x TP x PP at 2x2x2 ("1f1b_3d", 8 processes, torchtitan's (pp, dp_shard, tp) mesh): recorded and replayed in
one launch of its own, the suite's one 8-process job, on the fewest steps that show it (4, the defect at step 2).
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from nanforensics.checkpoints.bisect import bisect
from nanforensics.distributed.world import mismatch
from nanforensics.errors import BadInput
from nanforensics.runs.checkpoint import Checkpoint
from nanforensics.runs.layout import DISTRIBUTED_FORMAT, World
from nanforensics.runs.run import Run
from nanforensics.runs.stages import DATA_PARALLEL, OPTIONS, TENSOR_PARALLEL

import pipeline_job as job
from conftest import assert_one_line_error, run_cli, tree_digest
from test_distributed import Launched, Ranks, record_and_replay

DEFECT_ID = f"sample-{job.DEFECT_STEP * job.BATCH + job.defect_row():05d}"


NAMES = ["gpipe", "1f1b", "gpipe_scheduled"]


@pytest.fixture(scope="module")
def launched(tmp_path_factory: pytest.TempPathFactory) -> Launched:
    """One torchrun launch: the runs recorded (tests/pipeline_job.py), then replayed at world size; the frozen run,
    whose logged losses stay finite, from the checkpoint before the defect."""
    root = tmp_path_factory.mktemp("pipeline")
    return record_and_replay(root, job.arguments(root, NAMES), NAMES, job.WORLD,
                             {"gpipe_scheduled": ["--from-step", str(job.DEFECT_STEP - 1)]})


@pytest.fixture(scope="module")
def runs(launched) -> dict[str, Path]:
    recorded = launched.recorded
    assert recorded.codes == [0] * job.WORLD and "gpipe_scheduled: 6 steps" in recorded.stdout, recorded.stderr[-3000:]
    return launched.runs


@pytest.fixture(scope="module")
def torchrun_replays(runs, launched) -> dict[str, tuple[Ranks, Path, dict[str, str]]]:
    return launched.replays


def test_layout(runs):
    """The manifest names the pipeline; stage 0 keeps the inputs, the last stage the targets and the micro-batch
    losses; every checkpoint holds both stages' tensors under their names in the whole model."""
    manifest = json.loads((runs["gpipe"] / "manifest.json").read_text())
    assert manifest["format"] == DISTRIBUTED_FORMAT
    assert manifest["distributed"]["wrapping"] == {
        "kind": "pipeline", "schedule": "ScheduleGPipe", "microbatches": job.MICROBATCHES, "scale_grads": True,
        "loss_fn": manifest["step_fn"].replace("train_step", "loss_fn"),
        "stages": [{"stage": i, "rank": i, "modules": mods} for i, mods in enumerate(job.STAGES)]}
    losses = (runs["gpipe"] / "ranks" / "rank_00001" / "microbatch_losses.jsonl").read_text().splitlines()
    assert [len(json.loads(line)["losses"]) for line in losses] == [job.MICROBATCHES] * job.STEPS
    assert not (runs["gpipe"] / "ranks" / "rank_00000" / "microbatch_losses.jsonl").exists()
    meta = json.loads((runs["gpipe"] / "checkpoints" / "step_00000002" / "meta.json").read_text())
    assert meta["param_names"] == ["0.gain", "1.weight", "1.bias", "3.weight", "3.bias", "5.weight", "5.bias"]
    assert len(meta["rank_rng"]) == job.WORLD
    # both ranks logged the last stage's loss; before the defects, both schedules computed the same losses (each
    # accumulates the gradients micro-batch by micro-batch, in order)
    logs = [(runs[name] / "ranks" / f"rank_{r:05d}" / "steps.jsonl").read_text().splitlines()[:job.DEFECT_STEP]
            for name in ("gpipe", "1f1b") for r in (0, 1)]
    assert all(log == logs[0] for log in logs) and len(logs[0]) == job.DEFECT_STEP


@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
def test_replay_at_world_size(runs, torchrun_replays, name):
    """torchrun -m nanforensics replay: step, stage (rank), micro-batch, sample and coordinate; the run untouched.
    GPipe: stage 0's input makes stage 0's gradient infinite (non-finite, exit 1). 1F1B, which interleaves one
    micro-batch's backward with the next one's forward: the last stage's target makes that micro-batch's loss
    infinite and nothing else (loss only, exit 4), the samples found from the last stage's targets."""
    run = runs[name]
    result, out, before = torchrun_replays[name]
    report = json.loads(out.read_text())
    if name == "gpipe":
        assert result.codes == [1] * job.WORLD, result.stderr[-3000:]  # non-finite, on both ranks
        check(report, "ScheduleGPipe", stage=0, made="grad 0.gain[3] = inf", data=("batch['x']", job.DEFECT_FEATURE,
                                                                                   "subnormal"))
        origin = report["origin"]
        assert (origin["step"], origin["stage"], origin["tensor"], origin["index"], origin["value"], origin["rank"]) == (
            job.DEFECT_STEP, "grad", "0.gain", [job.DEFECT_FEATURE], "inf", 0)
        assert "grad 0.gain[3] = inf on rank 0 (stage 0, micro-batch 2 of 4)" in result.stdout, result.stdout
        # nothing non-finite before the origin on either stage; the update spreads it to the parameter
        at = [e for e in report["events"] if e["step"] == job.DEFECT_STEP]
        assert [(e["stage"], e["tensor"]) for e in at][:1] == [("grad", "0.gain")] and {e["rank"] for e in at} == {0}
        assert report["checkpoints_compared"][0]["step"] == job.DEFECT_STEP + 1
        # the progress of each phase, the start's checks included: the newest checkpoint holds the NaN, the one before
        # does not
        assert [line.removeprefix("nanforensics: [replay] ") for line in result.stderr.splitlines()
                if line.startswith("nanforensics: [replay] ")][:3] == [
            f"checking that the checkpoint at step {job.DEFECT_STEP + 1} is finite",
            f"checking that the checkpoint at step {job.DEFECT_STEP - 1} is finite",
            f"replaying steps {job.DEFECT_STEP - 1}-{job.STEPS - 1}, one stage per rank "
            f"({job.STEPS - job.DEFECT_STEP + 1} steps)"]
    else:
        assert result.codes == [4] * job.WORLD, result.stderr[-3000:]  # loss only, on both ranks
        check(report, "Schedule1F1B", stage=1, made="loss = inf", data=("batch['y']", 0, "extreme"),
              only="; no gradient, parameter or optimizer state turned non-finite")
        assert (report["origin"], report["events"], report["loss_only_steps"]) == (None, [], [job.DEFECT_STEP])
        assert report["pipeline"]["logged_microbatch_losses"][job.DEFECT_MICROBATCH] == "inf"
    assert tree_digest(run) == before


DATA_PARALLEL_RUNS = ["1f1b_dp", "1f1b_fsdp"]


@pytest.fixture(scope="module")
def data_parallel(tmp_path_factory: pytest.TempPathFactory) -> Launched:
    """2 stages x 2 data-parallel ranks (4 gloo processes, torchtitan's (pp, dp) mesh), each stage under DDP, or
    FSDP2 (torchtitan's dp_shard), over its dp group: both recorded, then replayed at world size, in one launch."""
    root = tmp_path_factory.mktemp("pipeline_dp")
    return record_and_replay(root, job.arguments(root, DATA_PARALLEL_RUNS), DATA_PARALLEL_RUNS, job.WORLD * job.DP)


@pytest.mark.parametrize("name", DATA_PARALLEL_RUNS)
def test_pipeline_by_data_parallel(data_parallel, name):
    """Pipeline x data parallelism at world size: the origin names the step, the stage, the mesh coordinate (pp, dp),
    the micro-batch, the coordinate and the sample of the pipeline whose batch holds the defect, and the replay is
    bit-exact from a checkpoint after the run's first step (under DDP, its buckets laid out as the run's were by
    then). The update is reported by the rank that holds it: DDP's copies alike, once (dp rank 0); FSDP2's shard of
    ``0.gain`` rows 2-3 by dp rank 1, at the whole tensor's coordinate."""
    recorded = data_parallel.recorded
    assert recorded.codes == [0] * 4 and "1f1b_fsdp: 6 steps" in recorded.stdout, recorded.stderr[-3000:]
    run = data_parallel.runs[name]
    wrapping = json.loads((run / "manifest.json").read_text())["distributed"]["wrapping"]
    assert wrapping["data_parallel"] == ({"size": job.DP, "broadcast_buffers": True, "find_unused_parameters": False,
                                          "gradient_as_bucket_view": False} if name == "1f1b_dp" else {
        "size": job.DP, "modules": [{"module": "", "reshard_after_forward": True, "mp_policy": {
            "param_dtype": None, "reduce_dtype": None, "output_dtype": None, "cast_forward_inputs": True}}]})
    assert [(st["stage"], st["rank"]) for st in wrapping["stages"]] == [(0, 0), (1, job.DP)]
    assert sorted(p.parent.name for p in run.glob("ranks/*/microbatch_losses.jsonl")) == ["rank_00002", "rank_00003"]
    meta = json.loads((run / "checkpoints" / "step_00000002" / "meta.json").read_text())
    assert meta["param_names"] == [n for n, _ in job.build_model().named_parameters()]  # each stage's names once
    # the run's loss: the mean over the pipelines of each one's last stage's
    steps = Run(run).steps
    logs = [[json.loads(line)["loss"] for line in (run / "ranks" / f"rank_{r:05d}" / "steps.jsonl").read_text().splitlines()]
            for r in (2, 3)]
    assert [s.loss for s in steps][:job.DEFECT_STEP] == [(a + b) / 2 for a, b in list(zip(*logs))[:job.DEFECT_STEP]]

    result, out, before = data_parallel.replays[name]
    assert result.codes == [1] * 4, result.stderr[-3000:]
    report = json.loads(out.read_text())
    origin = report["origin"]
    bad = job.BAD_DP  # stage 0 of pipeline 1 is rank 1
    check_origin(report, job.DEFECT_STEP, ("0.gain", [job.DEFECT_FEATURE]), bad, {"pp": 0, "dp": bad},
                 job.DEFECT_STEP + 1)
    # the other pipeline's own gradients stay finite; the update is reported by the rank that holds it
    at = [e for e in report["events"] if e["step"] == job.DEFECT_STEP]
    assert {e["rank"] for e in at if e["stage"] == "grad"} == {bad}
    assert [(e["tensor"], e["index"], e["rank"]) for e in at if e["stage"] == "param"] == [
        ("0.gain", [job.DEFECT_FEATURE], 0 if name == "1f1b_dp" else bad)]
    assert report["findings"][0].endswith(f"made grad 0.gain[{job.DEFECT_FEATURE}] = {origin['value']} on stage 0 "
                                          f"(rank {bad}, pp=0, dp={bad}).")
    assert tree_digest(run) == before
    # every reader sees one model and the world it ran on: bisect and the commands it names, another world size
    found = bisect([run / "checkpoints"])
    assert found.first_poisoned is not None and found.first_poisoned.step == job.DEFECT_STEP + 1
    assert found.replay is not None and f"torchrun --nproc-per-node {job.WORLD * job.DP} -m" in found.replay.command
    problem = mismatch(Run(run), job.WORLD)
    assert problem is not None and f"--nproc-per-node {job.WORLD * job.DP} -m nanforensics replay" in problem


def check_origin(report: dict[str, Any], step: int, grad: tuple[str, list[int]], rank: int, mesh: dict[str, int],
                 compared: int) -> None:
    """A pipeline by data parallelism's origin: the gradient ``grad`` (tensor, whole tensor's coordinate) of stage 0
    on ``rank`` (at ``mesh``) in micro-batch ``DEFECT_MICROBATCH`` at ``step``, the sample of data-parallel rank
    ``mesh["dp"]``'s batch, and the replay bit-exact up to the checkpoint at step ``compared``."""
    origin = report["origin"]
    assert (origin["step"], origin["stage"], origin["tensor"], origin["index"], origin["rank"]) == (step, "grad", *grad,
                                                                                                    rank)
    pipe = report["pipeline"]
    assert (pipe["stage"], pipe["rank"], pipe["mesh"], pipe["microbatch"]) == (0, rank, mesh, job.DEFECT_MICROBATCH)
    assert pipe["logged_microbatch_losses"] == pipe["replayed_microbatch_losses"]
    ident = f"sample-{(step * job.DP + mesh['dp']) * job.BATCH + job.defect_row():05d}"
    assert (report["samples"]["status"], report["samples"]["samples"], report["samples"]["sample_leaves"]) == (
        "attributed", [job.DEFECT_SAMPLE], {"batch['id']": [ident]})
    assert report["samples"]["judged"] == "each_alone" and "samples run alone: " in report["samples"]["message"]
    assert report["responsible_batch"]["file"].endswith(f"ranks/rank_{rank:05d}/batches/step_{step:08d}.safetensors")
    assert report["reproduced"] is True and [(c["step"], c["exact"]) for c in report["checkpoints_compared"]] == [
        (compared, True)]


def test_per_stage_scheduler_and_a_gradient_no_optimizer_zeroes(runs, torchrun_replays):
    """Each stage steps its own LR scheduler: every rank's state is recorded and restored, so the replay from step 2
    is bit-exact (a scheduler rebuilt fresh would update at the first step's learning rate). ``0.gain`` requires grad
    but its stage's optimizer does not hold it: its gradient is never zeroed, so after the replayed step it holds the
    infinity, and each pass of group testing must start from the gradient before the step (the snapshot every replay
    takes, ``replay.session.loose_grads``). Carried over, every subset would fail and the micro-batch would read
    "batch_wide"."""
    meta = json.loads((runs["gpipe_scheduled"] / "checkpoints" / "step_00000002" / "meta.json").read_text())
    assert [s["last_epoch"] for s in meta["rank_schedulers"]] == [2] * job.WORLD
    # every checkpoint keeps that gradient (its stage's, gathered to rank 0): the one after the step holds the inf
    after = Checkpoint(runs["gpipe_scheduled"] / "checkpoints" / f"step_{job.DEFECT_STEP + 1:08d}", job.DEFECT_STEP + 1)
    grads = after.loose_grads(after.meta())
    assert list(grads) == [job.FROZEN]
    assert [i for i, ok in enumerate(torch.isfinite(grads[job.FROZEN]).tolist()) if not ok] == [job.DEFECT_FEATURE]
    result, out, before = torchrun_replays["gpipe_scheduled"]
    assert result.codes == [1] * job.WORLD, result.stderr[-3000:]
    report = json.loads(out.read_text())
    origin = report["origin"]
    assert (origin["step"], origin["stage"], origin["tensor"], origin["index"]) == (
        job.DEFECT_STEP, "grad", job.FROZEN, [job.DEFECT_FEATURE])
    assert (report["samples"]["status"], report["samples"]["samples"]) == ("attributed", [job.DEFECT_SAMPLE])
    assert report["samples"]["sample_leaves"] == {"batch['id']": [DEFECT_ID]}
    # the update never reaches the frozen gain: no parameter or state turns non-finite, nor any logged loss
    assert not [e for e in report["events"] if e["stage"] in ("param", "optimizer_state")]
    assert report["reproduced"] is True and [(c["step"], c["exact"]) for c in report["checkpoints_compared"]] == [
        (job.DEFECT_STEP + 1, True)]
    assert tree_digest(runs["gpipe_scheduled"]) == before


def check(report: dict[str, Any], schedule: str, stage: int, made: str, data: tuple[str, int, str],
          only: str = "") -> None:
    """The pipeline's facts and sentences: the stage, the micro-batch, its rows, the sample and its id."""
    assert report["reproduced"] is True and all(c["exact"] for c in report["checkpoints_compared"])
    pipe = report["pipeline"]
    rows = job.BATCH // job.MICROBATCHES
    assert (pipe["stage"], pipe["rank"], pipe["microbatch"], pipe["microbatches"], pipe["schedule"], pipe["rows"]) == (
        stage, stage, job.DEFECT_MICROBATCH, job.MICROBATCHES, schedule, [job.DEFECT_MICROBATCH * rows,
                                                                          (job.DEFECT_MICROBATCH + 1) * rows])
    assert pipe["logged_microbatch_losses"] == pipe["replayed_microbatch_losses"]
    samples = report["samples"]
    assert (samples["status"], samples["samples"], samples["micro_batch_samples"], samples["sample_leaves"]) == (
        "attributed", [job.DEFECT_SAMPLE], [[job.DEFECT_MICROBATCH, job.DEFECT_SAMPLE]], {"batch['id']": [DEFECT_ID]})
    assert report["responsible_batch"]["file"].endswith(f"ranks/rank_00000/batches/step_{job.DEFECT_STEP:08d}.safetensors")
    defects = [(d["step"], d["rank"], d["tensor"], d["index"], d["kind"]) for d in report["data_defects"]]
    tensor, column, kind = data
    assert defects == [(job.DEFECT_STEP, 0 if tensor == "batch['x']" else 1, tensor, [job.defect_row(), column], kind)]
    assert report["findings"][:2] == [
        f"At step {job.DEFECT_STEP}, micro-batch {job.DEFECT_MICROBATCH} of {job.MICROBATCHES} ({schedule}; rows "
        f"{pipe['rows'][0]}-{pipe['rows'][1] - 1} of the step's batch) made {made} on stage {stage} (rank {stage}){only}.",
        f"Sample {job.DEFECT_SAMPLE} of micro-batch {job.DEFECT_MICROBATCH} alone makes it (batch['id'] = ['{DEFECT_ID}'])."]


def test_one_process_refuses(runs):
    """One process cannot run a stage's step on what the other stages send it: one line with the command. Another
    world size names the same command, never the emulation a data-parallel run offers."""
    result = run_cli("replay", runs["1f1b"])
    assert_one_line_error(result, f"torchrun --nproc-per-node 2 -m nanforensics replay {runs['1f1b']}")
    problem = mismatch(Run(runs["1f1b"]), 3)
    assert problem is not None and "--nproc-per-node 2 -m nanforensics replay" in problem and "emulat" not in problem


def test_recorder_refuses_what_replay_cannot_rebuild(tmp_path):
    """A guard, a scaler, a per-stage LR scheduler whose state holds tensors, a custom chunking of the inputs, a
    schedule of several stages per rank (interleaved), a stage under tensor parallelism without fully_shard (TP x
    PP; FSDP2 x TP x PP is recorded, ``test_fsdp2_tp_pp``): refused when recording starts, by name and why (a
    one-rank process group in this process)."""
    import torch
    import torch.distributed as dist
    from nanforensics import Recorder
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.pipelining import PipelineStage, ScheduleGPipe, ScheduleInterleaved1F1B
    from torch.distributed.pipelining.microbatch import TensorChunkSpec
    from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        stage = PipelineStage(job.build_model(), 0, 1, torch.device("cpu"))
        optimizer = torch.optim.AdamW(stage.submod.parameters())
        scheduler = job.decay(optimizer)
        scheduler.warmup = torch.zeros(())  # a tensor in its state: only rank 0's extras file could carry one
        mesh = init_device_mesh("cpu", (1, 1), mesh_dim_names=("dp", "tp"))
        split = PipelineStage(parallelize_module(job.build_model(), mesh["tp"], {"1": ColwiseParallel()}), 0, 1,
                              torch.device("cpu"))
        gpipe = ScheduleGPipe(stage, 2, loss_fn=job.loss_fn)
        cases = [(gpipe, {"guard": True}, "guard= is not supported with a pipeline schedule: a guard's incidents"),
                 (gpipe, {"scaler": torch.amp.GradScaler("cpu")}, "scaler= is not supported .*: a GradScaler's inf "
                                                                  "check sees only its own stage's gradients"),
                 (gpipe, {"scheduler": scheduler, "scheduler_factory": job.decay}, "LR scheduler holds tensors"),
                 (ScheduleGPipe(stage, 2, loss_fn=job.loss_fn, args_chunk_spec=(TensorChunkSpec(1),)), {},
                  "default chunking"),
                 (ScheduleInterleaved1F1B([stage], 2, loss_fn=job.loss_fn), {},
                  "ScheduleInterleaved1F1B.*an interleaved schedule's stages share a rank"),
                 (ScheduleGPipe(split, 2, loss_fn=job.loss_fn), {}, r"stage under tensor parallelism without "
                                                                     "fully_shard")]
        for i, (schedule, extra, needle) in enumerate(cases):
            with pytest.raises(ValueError, match=needle):
                Recorder(tmp_path / str(i), schedule, optimizer, model_factory=job.build_model, step_fn=job.train_step,
                         **extra)
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("module, style, needle", [
    ("0", "colwise", None), ("2", "rowwise", None), ("0.nothing", "colwise", "names '0.nothing', which stage 0"),
    ("1", "colwise", "splits '1' colwise, but it is a LogSoftplus, not a Linear or an Embedding")])
def test_replay_applies_only_a_plan_that_fits_the_stage(module, style, needle):
    """A 3-D manifest's plan applied to a stage on replay: an entry naming no module of the stage (which
    parallelize_module would skip with a warning, replaying another layout) or a layer its style cannot split (a
    traceback from torch) is one line naming the manifest; an entry of another stage is left to it (a one-rank
    process group in this process)."""
    import torch.distributed as dist
    from nanforensics.distributed.pipeline import prune
    from nanforensics.distributed.pipeline_replay import _plan_stage
    from nanforensics.distributed.tensors import is_dtensor
    from torch.distributed.device_mesh import init_device_mesh

    layouts = {"colwise": ("Replicate()", "Shard(dim=-1)"), "rowwise": ("Shard(dim=-1)", "Replicate()")}
    entry = {"module": module, "style": style, "input_layouts": layouts[style][0],
             "output_layouts": layouts[style][1], "use_local_output": True}
    other = {**entry, "module": "3", "style": "colwise", "input_layouts": "Replicate()", "output_layouts": "Shard(dim=-1)"}
    spec = {"stage": 0, "rank": 0, "modules": job.STAGES_3D[0]}
    where = Path("RUN/manifest.json")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,), mesh_dim_names=("tp",))
        model = prune(job.build_model_3d(), job.STAGES_3D[0])
        if needle is None:
            _plan_stage(model, mesh, [entry, other], spec, where)
            assert [n for n, p in model.named_parameters() if is_dtensor(p)] == [f"{module}.weight", f"{module}.bias"]
            return
        with pytest.raises(BadInput, match=re.escape(needle)) as e:
            _plan_stage(model, mesh, [entry, other], spec, where)
        assert e.value.where == str(where) and "\n" not in str(e.value)
    finally:
        dist.destroy_process_group()


def test_replay_refuses_a_schedule_of_several_stages_per_rank(runs, tmp_path):
    """A manifest naming a multi-stage schedule (no recorder of this version writes one): one line saying why, exit
    2, before any checkpoint or step is read; the copy it names is left as it was. (Any other name: the manifest's
    generated values below.)"""
    import shutil

    schedule = "ScheduleInterleaved1F1B"
    run = tmp_path / "run"
    shutil.copytree(runs["gpipe"], run)
    manifest = json.loads((run / "manifest.json").read_text())
    manifest["distributed"]["wrapping"]["schedule"] = schedule
    (run / "manifest.json").write_text(json.dumps(manifest))
    before = tree_digest(run)
    assert_one_line_error(run_cli("replay", run), f"schedule '{schedule}': this nanforensics replays ScheduleGPipe and "
                                                  "Schedule1F1B (one stage per rank; an interleaved or zero-bubble "
                                                  "schedule puts several stages on a rank)")
    assert tree_digest(run) == before


@pytest.mark.parametrize("enabled", [True, False])
def test_replay_refuses_a_gradscaler_per_stage(runs, tmp_path, enabled):
    """A manifest naming a GradScaler beside a pipeline schedule (no recorder writes one): one line naming the manifest
    and why, exit 2, before the one-process refusal's torchrun command (no world size replays it) and before any
    checkpoint is read; the copy is left as it was."""
    import shutil

    run = tmp_path / "run"
    shutil.copytree(runs["gpipe"], run)
    manifest = json.loads((run / "manifest.json").read_text())
    manifest["scaler"] = {"enabled": enabled}
    (run / "manifest.json").write_text(json.dumps(manifest))
    before = tree_digest(run)
    result = run_cli("replay", run)
    assert_one_line_error(result, "names a GradScaler (scaler) with a pipeline schedule, which nanforensics does not "
                                  "replay: a GradScaler's inf check sees only its own stage's gradients")
    assert "torchrun" not in result.stderr and str(run / "manifest.json") in result.stderr
    assert tree_digest(run) == before


def test_bisect_reads_the_stages_checkpoints(runs):
    """Checkpoints 0 and 2 are clean, 4 holds the NaN the update at step 3 wrote into stage 0's gain."""
    result = bisect([runs["gpipe"] / "checkpoints"])
    assert result.first_poisoned is not None and result.first_poisoned.step == job.DEFECT_STEP + 1
    assert result.last_clean is not None and result.last_clean.step == job.DEFECT_STEP - 1
    assert result.replay is not None and result.replay.command == (
        f"torchrun --nproc-per-node 2 -m nanforensics replay {runs['gpipe']} --from-step {job.DEFECT_STEP - 1}")


_GOOD = {"kind": "pipeline", "schedule": "Schedule1F1B", "microbatches": 4, "scale_grads": True, "loss_fn": "m:f",
         "stages": [{"stage": 0, "rank": 0, "modules": ["a"]}, {"stage": 1, "rank": 1, "modules": ["b"]}]}
_JSON = st.recursive(st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=5),
                     lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3),
                     max_leaves=6)


def _bad_stage() -> st.SearchStrategy[Any]:
    spec = st.fixed_dictionaries({"stage": st.integers(-2, 3), "rank": st.integers(-2, 3),
                                  "modules": st.lists(st.sampled_from(["a", "b", ""]), max_size=2)})
    return st.lists(spec | _JSON, max_size=3)


def _tensor_parallel() -> st.SearchStrategy[Any]:
    entry = st.fixed_dictionaries({"module": st.sampled_from(["a", "b.0", 3]), "style": st.sampled_from(
        ["colwise", "rowwise", "sequence", "loss"]), "input_layouts": st.sampled_from(["Replicate()", "Shard(dim=-1)", "x"]),
        "output_layouts": st.sampled_from(["Replicate()", "Shard(dim=1)"]), "use_local_output": st.booleans() | st.none()})
    return st.fixed_dictionaries({"size": st.integers(0, 3)}, optional={"plan": st.lists(entry | _JSON, max_size=2),
                                                                         "extra": _JSON})


def _data_parallel() -> st.SearchStrategy[Any]:
    return st.fixed_dictionaries({"size": st.integers(0, 3)}, optional={
        "broadcast_buffers": st.booleans() | st.none(), "find_unused_parameters": st.booleans(), "bucket": st.booleans()})


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(key=st.sampled_from([*OPTIONS, DATA_PARALLEL, TENSOR_PARALLEL, "extra"]),
       value=_JSON | _bad_stage() | _data_parallel() | _tensor_parallel())
def test_manifest_validation(key, value):
    """Any value in any field of the pipeline section: read as the recorder wrote it, or refused in one line naming
    the manifest; never a traceback."""
    where = Path("RUN/manifest.json")
    wrapping = {**_GOOD, key: value}
    try:
        world = World.read({"world_size": 2, "backend": "gloo", "wrapping": wrapping}, where)
    except BadInput as e:
        assert e.where == str(where) and "\n" not in str(e)
        return
    assert world.kind == "pipeline" and key != "extra"  # what is read back is what a recorder could have written
    assert world.wrapping["stages"][1]["rank"] == 1 and isinstance(world.wrapping["microbatches"], int)


def test_manifest_validation_accepts_the_recorded_section():
    world = World.read({"world_size": 2, "backend": "gloo", "wrapping": _GOOD}, Path("m.json"))
    assert world.to_json()["wrapping"] == _GOOD


_FSDP = {"module": "", "reshard_after_forward": True,
         "mp_policy": {"param_dtype": None, "reduce_dtype": None, "output_dtype": None, "cast_forward_inputs": True}}
_PLAN = {"module": "a", "style": "colwise", "input_layouts": "Replicate()", "output_layouts": "Shard(dim=-1)",
         "use_local_output": True}
_3D = {**_GOOD, "stages": [{"stage": 0, "rank": 0, "modules": ["a"]}, {"stage": 1, "rank": 4, "modules": ["b"]}],
       DATA_PARALLEL: {"size": 2, "modules": [_FSDP]}, TENSOR_PARALLEL: {"size": 2, "plan": [_PLAN]}}


@pytest.mark.parametrize("change, needle", [
    ({}, None),
    ({DATA_PARALLEL: {"size": 2, "broadcast_buffers": True}}, "needs each stage under fully_shard"),
    ({TENSOR_PARALLEL: {"size": 2, "plan": []}}, "is not {size, plan}"),
    ({TENSOR_PARALLEL: {"size": 4, "plan": [_PLAN]}}, "not a list of one stage per 8 ranks of 8"),
    ({TENSOR_PARALLEL: {"size": 2, "plan": [{**_PLAN, "style": "loss"}]}}, "plan entry"),
])
def test_manifest_of_the_3d_layout(change, needle):
    """FSDP2 x TP x PP: the section the recorder writes reads back; tensor parallelism without fully_shard, an empty
    plan, a size that does not divide the stages' ranks, a style replay cannot rebuild: one line naming the manifest."""
    raw = {"world_size": 8, "backend": "gloo", "wrapping": {**_3D, **change}}
    if needle is None:
        assert World.read(raw, Path("m.json")).to_json()["wrapping"] == {**_3D, "kind": "pipeline"}
        return
    with pytest.raises(BadInput, match=re.escape(needle)):
        World.read(raw, Path("m.json"))


THREE_D = "1f1b_3d"


@pytest.fixture(scope="module")
def three_d(tmp_path_factory: pytest.TempPathFactory) -> Launched:
    """FSDP2 x TP x PP at 2x2x2 (8 gloo processes): recorded, then replayed at world size, in one launch."""
    root = tmp_path_factory.mktemp("pipeline_3d")
    return record_and_replay(root, job.arguments(root, [THREE_D]), [THREE_D], job.WORLD * job.DP * job.TP)


def test_fsdp2_tp_pp(three_d):
    """torchtitan's 3-D layout at world size. Data-parallel rank 1's sample overflows the gradient of hidden unit 13 of
    layer 0, which tensor-parallel rank 1 computes (units 8-15): the origin names the step, stage 0, the mesh
    coordinate (pp=0, dp=1, tp=1) of rank 3, the micro-batch, the sample, and the whole tensor's coordinate [13] of
    the gradient (rank 3's own block holds it at 5). The update's NaN lies in the shard FSDP2 gives data-parallel rank
    1 of that block (units 12-15, 12 + 1 on rank 3): reported there at [13], the coordinate the placements over both
    dimensions (dp_shard, tp) give. The replay is bit-exact to the next checkpoint, the run untouched, bisect names
    the first poisoned checkpoint and the 8-process command, and one process refuses with it."""
    recorded = three_d.recorded
    world = job.WORLD * job.DP * job.TP
    assert recorded.codes == [0] * world and f"{THREE_D}: {job.STEPS_3D} steps" in recorded.stdout, \
        recorded.stderr[-3000:]
    # every element of every rank's shard of every parameter lies where the replay's mapping puts it
    assert f"{THREE_D}: 0 shards misplaced" in recorded.stdout
    run = three_d.runs[THREE_D]
    wrapping = json.loads((run / "manifest.json").read_text())["distributed"]["wrapping"]
    layouts = {"colwise": ("Replicate()", "Shard(dim=-1)"), "rowwise": ("Shard(dim=-1)", "Replicate()")}
    assert wrapping["tensor_parallel"] == {"size": job.TP, "plan": [
        {"module": m, "style": style, "input_layouts": layouts[style][0], "output_layouts": layouts[style][1],
         "use_local_output": True} for m, style in (("0", "colwise"), ("2", "rowwise"), ("3", "colwise"),
                                                    ("4", "rowwise"))]}
    assert [(st["stage"], st["rank"], st["modules"]) for st in wrapping["stages"]] == [
        (i, i * job.DP * job.TP, mods) for i, mods in enumerate(job.STAGES_3D)]
    assert wrapping["data_parallel"]["size"] == job.DP

    result, out, before = three_d.replays[THREE_D]
    assert result.codes == [1] * world, result.stderr[-3000:]
    report = json.loads(out.read_text())
    origin = report["origin"]
    bad = job.BAD_DP * job.TP + job.UNIT // 8  # stage 0, dp=1, tp=1
    check_origin(report, job.DEFECT_STEP_3D, ("0.bias", [job.UNIT]), bad, {"pp": 0, "dp": job.BAD_DP, "tp": 1},
                 job.DEFECT_STEP_3D + 2)
    at = [e for e in report["events"] if e["step"] == job.DEFECT_STEP_3D]
    assert {e["rank"] for e in at} == {bad}  # nothing on tensor-parallel rank 0 of the same batch, nor elsewhere
    assert [(e["stage"], e["tensor"], e["index"]) for e in at if e["stage"] in ("grad", "param")] == [
        ("grad", "0.bias", [job.UNIT]), ("grad", "0.weight", [job.UNIT, 0]),
        ("param", "0.bias", [job.UNIT]), ("param", "0.weight", [job.UNIT, 0])]
    assert report["setup"]["world_size"] == world
    # a step later every value is NaN: rowwise layer 2's bias, replicated over tp, is reported by tp rank 0's copy of
    # each dp shard alone; the whole model's values counted once (a shard per rank, a stage once)
    later = [e for e in report["events"] if e["step"] == job.DEFECT_STEP_3D + 1]
    assert [e["rank"] for e in later if (e["stage"], e["tensor"]) == ("param", "2.bias")] == [0, job.TP]
    assert [e["rank"] for e in later if (e["stage"], e["tensor"]) == ("param", "0.bias")] == [0, 1, 2, 3]
    total = sum(p.numel() for p in job.build_model_3d().parameters())
    assert {(r["params_total"], r["state_total"]) for r in report["spread"]} == {(total, 2 * total)}
    logs = [[json.loads(line)["loss"] for line in (run / "ranks" / f"rank_{r:05d}" / "steps.jsonl").read_text().splitlines()]
            for r in (4, 4 + job.TP)]  # the last stage of each batch's pipeline (tp rank 0)
    finite = job.DEFECT_STEP_3D + 1  # the steps before the NaN
    assert [s.loss for s in Run(run).steps][:finite] == [(a + b) / 2 for a, b in list(zip(*logs))[:finite]]
    assert report["findings"][0].endswith(f"made grad 0.bias[{job.UNIT}] = {origin['value']} on stage 0 "
                                          f"(rank {bad}, pp=0, dp={job.BAD_DP}, tp=1).")
    assert tree_digest(run) == before
    found = bisect([run / "checkpoints"])
    assert found.first_poisoned is not None and found.first_poisoned.step == job.DEFECT_STEP_3D + 2
    assert found.last_clean is not None and found.last_clean.step == job.DEFECT_STEP_3D
    assert found.replay is not None and f"torchrun --nproc-per-node {world} -m" in found.replay.command
    assert_one_line_error(run_cli("replay", run), f"torchrun --nproc-per-node {world} -m nanforensics replay {run}")
    assert tree_digest(run) == before
