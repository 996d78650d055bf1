"""Distributed runs: real 2-process gloo jobs under torch.distributed.run, recorded by the project's recorder on every
rank (tests/distributed_job.py), replayed with every rank emulated on one process and at world size under torchrun.

Only rank 1's shard carries the defect (a near-zero reading: a finite loss, an infinite local gradient at step 4); the
collective spreads it to rank 0. Both replays must name rank 1, step 4 and the sample, and leave the run untouched.
One launch records every run of this module; the last run's rank 1 dies while writing a checkpoint.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from nanforensics.checkpoints.bisect import bisect
from nanforensics.distributed.wrapping import describe
from nanforensics.formats.discover import discover
from nanforensics.replay.engine import ReplayOptions, replay_run
from nanforensics.report import to_jsonable
from nanforensics.runs.layout import DISTRIBUTED_FORMAT
from nanforensics.runs.run import RUN_FORMAT

import distributed_job as job
import scenarios
from conftest import ANNOUNCEMENT, ROOT, TESTS, Result, assert_one_line_error, run_cli, tree_digest
from test_samples import SAMPLES, assert_same_run, machine_rtol

COMPILED = ["ddp_compiled", "ddp_compile_wrapped", "fsdp2_compiled", "fsdp2_compile_wrapped"]
RECORDED = ["ddp", "fsdp2", "ddp_accumulate", "ddp_batchnorm", "ddp_decoder", "ddp_state_overflow", "ddp_loss_only",
            "ddp_flaky", "fsdp2_flaky", *COMPILED, "fsdp2_loose", "fsdp2_killed"]  # killed last: it ends the job
DEFECT_ID = f"sample-{job.defect_index():05d}"
SAMPLE = SAMPLES / "ddp_two_ranks"


def launch(argv: list[str]) -> Result:
    """A command from the checkout's root (the runs name their code tests/scenarios.py, as the shipped samples do),
    outside any torchrun job of its own."""
    env = {**os.environ, "COLUMNS": "160", "NO_COLOR": "1"}
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "NANFORENSICS_DEBUG"):
        env.pop(key, None)
    p = subprocess.run(argv, capture_output=True, text=True, env=env, cwd=ROOT, timeout=600)
    return Result(p.returncode, p.stdout, p.stderr)


def torchrun(*args: str | Path, procs: int = job.WORLD) -> Result:
    """``python -m torch.distributed.run`` with ``procs`` processes (2 unless told) on a free port."""
    return launch([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(procs),
                   *map(str, args)])


def exit_codes(result: Result) -> dict[str, str]:
    """Each rank's exit code, as torchrun reports a job with a failed rank."""
    return dict(re.findall(r"rank\s+: (\d+) \(local_rank: \d+\)\s+exitcode\s+: (-?\d+)", result.stderr))


@dataclass
class Ranks:
    """One command of a launch of tests/replays_job.py: its ranks' stdout and stderr (in rank order), exit codes."""
    stdout: str
    stderr: str
    codes: list[int]


def at_world_size(root: Path, commands: list[list[str | Path]], procs: int = job.WORLD) -> list[Ranks]:
    """The CLI's ``commands``, each at world size ``procs``, in one torchrun launch (tests/replays_job.py): the
    launch's start and torch import paid once, not once per command."""
    result = torchrun(TESTS / "replays_job.py", root, json.dumps([list(map(str, c)) for c in commands]), procs=procs)
    assert result.code == 0, result.stderr[-3000:]
    read = lambda n, kind: [(root / str(n) / f"rank_{r}.{kind}").read_text() for r in range(procs)]  # noqa: E731
    return [Ranks("".join(read(n, "out")), "".join(read(n, "err")), [int(c) for c in read(n, "code")])
            for n in range(len(commands))]


@dataclass
class Launched:
    """What ``record_and_replay``'s launch did: the recording's ranks, the runs, and each run's replay at world size
    (its ranks, its report's path, the run's digest from before the replays)."""
    recorded: Ranks
    runs: dict[str, Path]
    replays: dict[str, tuple[Ranks, Path, dict[str, str]]]


def record_and_replay(root: Path, recording: list[str], names: list[str], procs: int,
                      options: dict[str, list[str]] | None = None) -> Launched:
    """One torchrun launch (tests/replays_job.py): the job script and arguments ``recording`` record ``names`` into
    ``root``, their digests are taken, then each is replayed: ``torchrun --nproc-per-node PROCS -m nanforensics
    replay RUN --json OUT`` (and the replay's ``options`` of the run, where given)."""
    runs = {name: root / name for name in names}
    commands = [recording, ["digest", *runs.values()],
                *(["replay", run, *(options or {}).get(name, []), "--json", root / f"{name}.json"]
                  for name, run in runs.items())]
    recorded, _, *replays = at_world_size(root / "ranks", commands, procs)
    before = json.loads((root / "ranks" / "1" / "digest.json").read_text())
    return Launched(recorded, runs, {name: (ranks, root / f"{name}.json", before[str(run)])
                                     for (name, run), ranks in zip(runs.items(), replays)})


def replayed(run: Path) -> dict[str, Any]:
    """The emulated replay, in this process, as JSON."""
    return to_jsonable(replay_run(run, ReplayOptions(code_paths=[TESTS])))


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Every run of this module, recorded by one launch of the sample generator's command."""
    root = tmp_path_factory.mktemp("distributed")
    result = launch(job.command(root, RECORDED))
    for name in RECORDED[:-1]:
        assert f"{name}: {job.STEPS} steps" in result.stdout, result.stderr[-3000:]
    assert "exitcode  : 9" in result.stderr, result.stderr[-3000:]  # rank 1 of the last run, killed mid-write
    return {name: root / name for name in RECORDED}


# replayed under torchrun by one launch (the sample: the shipped one; one compiled run of each order, of each wrapper)
AT_WORLD_SIZE = ["ddp", "fsdp2", "sample", "ddp_compile_wrapped", "fsdp2_compiled", "fsdp2_loose"]


@pytest.fixture(scope="module")
def torchrun_replays(runs, tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Ranks, Path, dict[str, str]]]:
    """``torchrun -m nanforensics replay RUN --json OUT`` of each of AT_WORLD_SIZE (tests/replays_job.py): its ranks,
    its report's path, and the run's digest from before the launch."""
    root = tmp_path_factory.mktemp("at_world_size")
    dirs = {name: SAMPLE.relative_to(ROOT) if name == "sample" else runs[name] for name in AT_WORLD_SIZE}
    before = {name: tree_digest(ROOT / run) for name, run in dirs.items()}
    done = at_world_size(root / "ranks", [["replay", run, "--json", root / f"{name}.json"] for name, run in dirs.items()])
    return {name: (ranks, root / f"{name}.json", before[name]) for name, ranks in zip(AT_WORLD_SIZE, done)}


def check_attribution(report: dict[str, Any], wrapping: str, ranks_replayed: str, exact: bool = True) -> None:
    """Rank 1, step 4, grad features.gain[3], sample 5 of its shard: the answer the job planted."""
    assert report["verdict"] == "nonfinite"
    assert report["reproduced"] is True or not exact
    origin = report["origin"]
    assert (origin["step"], origin["stage"], origin["tensor"], origin["index"], origin["value"], origin["rank"]) == (
        job.DEFECT_STEP, "grad", "features.gain", [scenarios.DEFECT_FEATURE], "inf", job.BAD_RANK)
    batch = report["responsible_batch"]
    assert batch["rank"] == job.BAD_RANK and batch["step"] == job.DEFECT_STEP
    assert batch["file"].endswith(f"ranks/rank_{job.BAD_RANK:05d}/batches/step_{job.DEFECT_STEP:08d}.safetensors")
    samples = report["samples"]
    assert samples["status"] == "attributed" and samples["samples"] == [job.DEFECT_SAMPLE]
    assert samples["sample_leaves"] == {"batch['id']": [DEFECT_ID]}
    setup = report["setup"]
    assert (setup["world_size"], setup["wrapping"], setup["ranks_replayed"]) == (job.WORLD, wrapping, ranks_replayed)
    # rank 0's own values stay finite at step 4; after the collective every rank holds the infinity
    at = [e for e in report["events"] if e["step"] == job.DEFECT_STEP]
    assert {e["rank"] for e in at if e["stage"] == "grad"} == {job.BAD_RANK}
    spread = next(e for e in at if e["stage"] == "optimizer_grad")
    assert spread["rank"] == (None if wrapping == "ddp" else 0)  # FSDP2: row 3 of 16 lies in rank 0's shard
    record = next(s for s in report["spread"] if s["step"] == job.DEFECT_STEP)
    assert record["rank_logged_losses"] == record["rank_replayed_losses"] or not exact
    assert all(isinstance(x, float) for x in record["rank_logged_losses"])  # rank 1's loss is finite at the origin
    collective = "all-reduce spread it to both ranks" if wrapping == "ddp" else "reduce-scatter averaged it into rank 0's"
    chain = next(f for f in report["findings"] if f.startswith("Rank 1's shard"))
    assert chain.startswith(f"Rank 1's shard (sample {job.DEFECT_SAMPLE}: batch['id'] = ['{DEFECT_ID}']) made grad "
                            f"features.gain[3] = inf at step {job.DEFECT_STEP}; the {collective}"), chain
    assert [c["logged_first_nonfinite_loss_step"] for c in report["ranks"]] == [job.DEFECT_STEP + 1] * job.WORLD
    assert f"Every rank's logged loss is non-finite from step {job.DEFECT_STEP + 1}." in report["findings"]  # no mesh


def test_layout(runs):
    manifest = json.loads((runs["ddp"] / "manifest.json").read_text())
    assert manifest["format"] == DISTRIBUTED_FORMAT != RUN_FORMAT  # a run/1 reader refuses it: "newer", not misread
    assert manifest["distributed"] == {"world_size": 2, "backend": "gloo", "wrapping": {
        "kind": "ddp", "broadcast_buffers": True, "find_unused_parameters": False, "gradient_as_bucket_view": False}}
    fsdp = json.loads((runs["fsdp2"] / "manifest.json").read_text())["distributed"]["wrapping"]
    assert fsdp["kind"] == "fsdp2" and [m["module"] for m in fsdp["modules"]] == [""]
    assert not (runs["ddp"] / "steps.jsonl").exists() and not (runs["ddp"] / "batches").exists()
    for rank in range(job.WORLD):
        folder = runs["ddp"] / "ranks" / f"rank_{rank:05d}"
        assert len((folder / "steps.jsonl").read_text().splitlines()) == job.STEPS
        assert len(list((folder / "batches").iterdir())) == job.STEPS
    ddp_ckpt, fsdp_ckpt = runs["ddp"] / "checkpoints" / "step_00000003", runs["fsdp2"] / "checkpoints" / "step_00000003"
    assert {p.name for p in ddp_ckpt.iterdir()} == {"model.safetensors", "optimizer.safetensors", "meta.json"}
    assert {p.name for p in fsdp_ckpt.iterdir()} == {".metadata", "__0_0.distcp", "__1_0.distcp", "meta.json"}
    for ckpt in (ddp_ckpt, fsdp_ckpt):
        meta = json.loads((ckpt / "meta.json").read_text())
        assert len(meta["rank_rng"]) == job.WORLD and all("torch" in state for state in meta["rank_rng"])


def test_emulated_batchnorm_buffers(runs):
    """BatchNorm's running statistics: every rank's forward starts from rank 0's (DDP broadcasts them), and rank 0's
    are kept after the step. The emulation reproduces every logged loss of both ranks bit for bit."""
    report = replayed(runs["ddp_batchnorm"])
    assert report["reproduced"] is True and all(c["diverged_at_step"] is None for c in report["ranks"])
    origin = report["origin"]
    assert (origin["step"], origin["stage"], origin["rank"]) == (job.DEFECT_STEP, "grad", job.BAD_RANK)
    assert report["responsible_batch"]["rank"] == job.BAD_RANK
    assert report["samples"]["status"] in ("attributed", "coupled")  # BatchNorm couples the samples of a shard
    # the buffer stage, per rank: each rank's running statistics turn NaN in its own forward of step 5, counted once
    buffers = [e for e in report["events"] if e["stage"] == "buffer"]
    assert min(e["step"] for e in buffers) == job.DEFECT_STEP + 1
    assert {e["rank"] for e in buffers if e["step"] == job.DEFECT_STEP + 1} == {0, 1}
    after = next(s for s in report["spread"] if s["step"] == job.DEFECT_STEP + 1)
    assert after["buffers_nonfinite"] == after["buffers_total"] > 0  # one copy's worth, not each rank's added up


def test_emulated_transformer(runs):
    """The decoder of scenarios (causal -inf mask, padding, LayerNorm, tied head) with an empty document in rank 1's
    shard: its attention rows are all masked, softmax gives NaN in the forward pass of that rank alone."""
    report = replayed(runs["ddp_decoder"])
    assert report["reproduced"] is True
    origin = report["origin"]
    assert (origin["step"], origin["stage"], origin["rank"]) == (job.DEFECT_STEP, "forward", job.BAD_RANK)
    assert not [e for e in report["events"] if e["step"] == job.DEFECT_STEP and e["rank"] == 0]
    assert report["samples"]["samples"] == [job.DEFECT_SAMPLE]
    assert report["samples"]["sample_leaves"] == {"batch['id']": [f"doc-{job.defect_index():05d}"]}


def test_emulated_overflow_after_the_collective(runs):
    """A glitch reading (1e13) in rank 1's shard: every local gradient stays finite, the averaged one too, but its
    square overflows Adam's exp_avg_sq, which every rank holds alike. No rank's shard is named; all are the batch."""
    report = replayed(runs["ddp_state_overflow"])
    assert report["verdict"] == "nonfinite" and report["reproduced"] is True
    origin = report["origin"]
    assert (origin["step"], origin["stage"], origin["state_key"], origin["rank"]) == (
        job.DEFECT_STEP, "optimizer_state", "exp_avg_sq", None)
    batch = report["responsible_batch"]
    assert batch["rank"] is None and "ranks/rank_*/batches/" in batch["file"]
    assert set(batch["leaves"]) == {"rank 0: batch['id']", "rank 1: batch['id']"}
    assert [d["rank"] for d in report["data_defects"] if d["kind"] == "extreme"] == [job.BAD_RANK]
    assert any(f.startswith("No rank's own values") and "after the all-reduce, in every rank's copy of" in f
               for f in report["findings"])
    assert not any(f.startswith("Rank 1's shard") or "logged loss is non-finite" in f or
                   f.startswith("Logged losses first non-finite") for f in report["findings"])  # AdamW kept it finite


def test_loss_only_on_one_rank(runs, tmp_path):
    """Every label of rank 1's shard at step 4 is ignored (-100): that rank's mean loss is 0/0 = NaN and its gradients
    zero, which the all-reduce averages with rank 0's finite ones. The run's loss (the ranks' mean) is NaN at step 4
    and nothing else is: loss_only (exit code 4 on every rank at world size), the loss rank 1's alone, explained in
    rank 1's shard."""
    report = replayed(runs["ddp_loss_only"])
    assert (report["verdict"], report["loss_only_steps"], report["origin"], report["events"]) == (
        "loss_only", [job.DEFECT_STEP], None, [])
    assert report["reproduced"] is True
    record = next(s for s in report["spread"] if s["step"] == job.DEFECT_STEP)
    assert record["replayed_loss"] == "nan" and record["params_nonfinite"] == record["state_nonfinite"] == 0
    for losses in (record["rank_logged_losses"], record["rank_replayed_losses"]):
        assert isinstance(losses[0], float) and losses[1] == "nan"
    assert any(f.startswith(f"Only rank 1 computed a non-finite loss at step {job.DEFECT_STEP}, from its own shard")
               for f in report["findings"]), report["findings"]
    assert report["samples"]["status"] == "batch_wide" and report["samples"]["batch_size"] == job.SHARD  # rank 1's
    assert report["operation"] is not None and report["operation"]["traced_from"] == "loss = nan on rank 1"
    out = tmp_path / "report.json"
    result = torchrun("-m", "nanforensics", "replay", runs["ddp_loss_only"], "--json", out)
    codes = exit_codes(result)
    assert codes == {"0": "4", "1": "4"}, result.stderr[-3000:]
    at_size = json.loads(out.read_text())
    assert (at_size["verdict"], at_size["loss_only_steps"], at_size["setup"]["ranks_replayed"]) == (
        "loss_only", [job.DEFECT_STEP], "torchrun")
    assert at_size["findings"] == report["findings"]  # rank 0 explains the step in the emulation


def test_a_refused_callable_never_runs_on_any_rank(runs, tmp_path):
    """The trust policy admits a distributed run's callables as it does a single process's (the manifest's fields,
    README's Security): os:system as the model factory is refused, emulated or on every rank at world size, before
    anything calls it; rank 0 alone announces the code and speaks the error."""
    run, marker = tmp_path / "hostile", tmp_path / "payload-ran"
    shutil.copytree(runs["ddp"], run)
    manifest = json.loads((run / "manifest.json").read_text())
    manifest["model_factory"], manifest["model_kwargs"] = "os:system", {"command": f"touch {marker}"}
    (run / "manifest.json").write_text(json.dumps(manifest))
    before = tree_digest(run)
    assert_one_line_error(run_cli("replay", run), "model_factory 'os:system' is refused", "standard library")
    result = torchrun("-m", "nanforensics", "replay", run)
    codes = exit_codes(result)
    assert codes == {"0": "2", "1": "2"}, result.stderr[-3000:]
    assert result.stderr.count("model_factory 'os:system' is refused") == 1
    assert result.stderr.count(ANNOUNCEMENT) == 1
    assert not marker.exists(), "the payload ran"
    assert tree_digest(run) == before


def test_outputs_at_world_size_are_checked_first(runs):
    """A report into the run directory is refused on every rank before any replays; nothing is written."""
    run = runs["ddp"]
    before = tree_digest(run)
    result = torchrun("-m", "nanforensics", "replay", run, "--json", run / "report.json")
    codes = exit_codes(result)
    assert codes == {"0": "2", "1": "2"}, result.stderr[-3000:]
    assert result.stderr.count("lies inside") == 1 and "which this command examines" in result.stderr
    assert tree_digest(run) == before


def test_shipped_sample_matches_its_generator(runs):
    """sample_runs/generate_distributed.py: the same command, renamed, its code named as shipped beside the samples.
    On another kind of CPU than the one that made the sample, the machine's own facts (its cpu, the low bits of its
    sums) are judged as a replay judges them: named, and within the replay's tolerance."""
    manifest = Path("manifest.json")
    rtol = machine_rtol(SAMPLE)
    assert_same_run(SAMPLE, runs["ddp"], lambda rel: rel == manifest, rtol)
    shipped, made = (json.loads((run / manifest).read_text()) for run in (SAMPLE, runs["ddp"]))
    renamed = {k: made[k].replace("tests/scenarios.py", "sample_runs/code/regressor.py") for k in ("model_factory", "step_fn")}
    machine = {"cpu": None} if rtol else {}
    assert {**shipped, **machine} == {**made, **renamed, **machine}


def test_readme_emulated_replay_of_the_sample():
    """docs/distributed.md's command on the shipped sample: rank 1, step 4, sample-00075, from one process."""
    before = tree_digest(SAMPLE)
    result = run_cli("replay", "sample_runs/ddp_two_ranks", "--json", "-", cwd=ROOT)
    assert result.code == 1, result.stderr
    check_attribution(result.json(), "ddp", "emulated", exact=machine_rtol(SAMPLE) == 0)  # bit-exact on its own CPU
    assert tree_digest(SAMPLE) == before


@pytest.mark.parametrize("name", ["fsdp2", "ddp_accumulate"])
def test_emulated_fsdp2_and_gradient_accumulation(runs, name):
    """FSDP2's shards assembled whole from torch.distributed.checkpoint; micro-batches under DDP's no_sync(), then
    clipping on the averaged gradients. The emulation stays bit-exact."""
    before = tree_digest(runs[name])
    check_attribution(replayed(runs[name]), "fsdp2" if name == "fsdp2" else "ddp", "emulated")
    assert tree_digest(runs[name]) == before


@pytest.mark.parametrize("name", ["ddp", "fsdp2"])
def test_torchrun_replay_at_world_size(runs, torchrun_replays, name):
    ranks, out, before = torchrun_replays[name]
    assert ranks.codes == [1] * job.WORLD, ranks.stderr[-3000:]  # every rank exits with the replay's code, 1: found
    assert ranks.stdout.count("NON-FINITE") == 1  # rank 0 alone renders the report
    check_attribution(json.loads(out.read_text()), name, "torchrun")
    assert tree_digest(runs[name]) == before


def test_a_gradient_no_optimizer_holds_is_kept_whole_and_put_back_on_every_rank(runs, torchrun_replays):
    """FSDP2 with an optimizer over the 2-d parameters only, as Muon's: the gains and biases require grad, their
    gradients are never zeroed, and at step 4 rank 1's shard makes ``features.gain``'s inf for good while every
    logged loss stays finite. Each checkpoint keeps those gradients whole, gathered from the ranks' shards, so
    checkpoint 6 is no clean start: the replay, emulated and at world size (each rank given its shard of them), starts
    at checkpoint 3 and names step 4. A checkpoint without them (before) started the replay at 6, and it was clean."""
    from nanforensics.runs.checkpoint import Checkpoint

    folder = runs["fsdp2_loose"] / "checkpoints"
    for step in (3, 6):
        checkpoint = Checkpoint(folder / f"step_{step:08d}", step)
        grads = checkpoint.loose_grads(checkpoint.meta())
        assert sorted(grads) == ["fc1.bias", "fc2.bias", "features.gain", "head.bias"]
        assert tuple(grads["features.gain"].shape) == (scenarios.N_FEATURES,)  # whole, not rank 0's shard
        bad = [i for i, ok in enumerate(torch.isfinite(grads["features.gain"]).tolist()) if not ok]
        assert bad == ([scenarios.DEFECT_FEATURE] if step > job.DEFECT_STEP else [])
    _, out, before = torchrun_replays["fsdp2_loose"]
    for how, report in (("emulated", replayed(runs["fsdp2_loose"])), ("torchrun", json.loads(out.read_text()))):
        origin = report["origin"]
        assert (report["setup"]["first_step"], report["setup"]["ranks_replayed"]) == (job.EVERY, how)
        assert (origin["step"], origin["stage"], origin["tensor"], origin["index"], origin["value"], origin["rank"]) == (
            job.DEFECT_STEP, "grad", "features.gain", [scenarios.DEFECT_FEATURE], "inf", job.BAD_RANK), how
        assert report["reproduced"] is True and [(c["step"], c["exact"]) for c in report["checkpoints_compared"]] == [
            (2 * job.EVERY, True)], how
    assert tree_digest(runs["fsdp2_loose"]) == before


@pytest.mark.parametrize("name", COMPILED)
def test_compiled_inside_and_around_the_wrapper(runs, torchrun_replays, name):
    """torch.compile inside DDP or FSDP2 (compile, then wrap) and around it (wrap, then compile), the two orders loops
    are written in: recorded under the names of the module the factory builds (no ``_orig_mod.``, in the manifest's
    FSDP2 modules, the checkpoints and the optimizer state), the backend in the manifest, and replayed eagerly, bit for
    bit (aot_eager runs eager mode's kernels): emulated on one process, or at world size (one run of each order and
    each wrapper each way)."""
    run = runs[name]
    manifest = json.loads((run / "manifest.json").read_text())
    assert manifest["compiled"] == {"backend": job.COMPILE_BACKEND}
    wrapping = manifest["distributed"]["wrapping"]
    assert [m["module"] for m in wrapping.get("modules", [{"module": ""}])] == [""]
    meta = json.loads((run / "checkpoints" / "step_00000003" / "meta.json").read_text())
    assert meta["param_names"] == [n for n, _ in scenarios.build_model().named_parameters()]
    assert [n for g in meta["param_groups"] for n in g["params"]] == meta["param_names"]
    before = tree_digest(run)
    if name in AT_WORLD_SIZE:
        ranks, out, before = torchrun_replays[name]
        assert ranks.codes == [1] * job.WORLD, ranks.stderr[-3000:]
        report, how = json.loads(out.read_text()), "torchrun"
    else:
        report, how = replayed(run), "emulated"
    check_attribution(report, wrapping["kind"], how)
    assert report["setup"]["compiled"] == job.COMPILE_BACKEND and all(c["exact"] for c in report["checkpoints_compared"])
    assert any(f.startswith(f"The run trained under torch.compile (backend {job.COMPILE_BACKEND})")
               for f in report["findings"])
    assert tree_digest(run) == before


@settings(max_examples=80, deadline=None)
@given(parts=st.lists(st.text(alphabet="abc_0", min_size=1, max_size=4).filter(lambda p: p != "_orig_mod"),
                      min_size=1, max_size=4),
       compiled=st.lists(st.integers(0, 4), max_size=3))
def test_own_name_drops_every_compiled_wrapper(parts, compiled):
    """A module's or tensor's name with ``_orig_mod`` wherever a compiled wrapper sat along its path (around the
    whole model, inside a data-parallel wrapper, around one block) is the name the factory's model gives it."""
    from nanforensics.runs.compiled import own_name

    wrapped = list(parts)
    for at in sorted(compiled, reverse=True):
        wrapped.insert(min(at, len(wrapped) - 1), "_orig_mod")
    assert own_name(".".join(wrapped)) == ".".join(parts)


def test_world_size_mismatch_is_one_line(runs, monkeypatch):
    """What torchrun tells each process, for a job of 3 ranks (and one of 2 for a single-process run)."""
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "3")
    result = run_cli("replay", runs["ddp"], cwd=ROOT)
    assert_one_line_error(result, "recorded by 2 ranks, replayed by 3",
                          f"torchrun --nproc-per-node 2 -m nanforensics replay {runs['ddp']}",
                          f"or `nanforensics replay {runs['ddp']}` to emulate the 2 ranks")
    single = runs["ddp"].parent / "single"
    scenarios.record(single, "clean", steps=2, checkpoint_every=1)
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert_one_line_error(run_cli("replay", single), "recorded by one process, replayed by 2",
                          f"nanforensics replay {single}` without torchrun")
    assert json.loads((single / "manifest.json").read_text())["format"] == RUN_FORMAT  # the single-process layout
    assert (single / "steps.jsonl").exists() and not (single / "ranks").exists()


def test_flaky_rank_named_by_its_losses(runs):
    """No data defect: rank 1's copy of a weight turns NaN outside the step function. The replay stays finite, and
    rank 1's logged loss is the first to part from it."""
    report = replayed(runs["ddp_flaky"])
    assert report["verdict"] == "not_reproduced"
    flip = job.FLIP_STEP + 1
    assert [(c["rank"], c["diverged_at_step"], c["logged_loss"]) for c in report["ranks"]] == [
        (0, flip + 1, "nan"), (1, flip, "nan")]
    # rank 0 wrote checkpoint 6's replicated state before the NaN reached it: it is clean, and the replay starts there
    assert report["setup"]["from_checkpoint"] == 6 and all(c["exact"] for c in report["checkpoints_compared"])
    assert not any(f.startswith("The checkpoint of step") for f in report["findings"])
    assert any(f.startswith(f"Rank 1's logged loss differs from the replay first, at step {flip}") and
               "suspect rank 1's hardware" in f for f in report["findings"])


def test_flaky_shard_named_by_the_checkpoint(runs):
    """Rank 1's shard of a weight turns NaN before checkpoint 6 is written: the all-gather hands it to both ranks, so
    the losses part together, but the checkpoint names the shard that held it."""
    report = replayed(runs["fsdp2_flaky"])
    assert report["verdict"] == "not_reproduced"
    assert [c["diverged_at_step"] for c in report["ranks"]] == [job.FLIP_STEP + 1] * 2
    # from checkpoint 3, the replay's state differs from checkpoint 6 (torch.distributed.checkpoint's shards) in one value
    [compared] = report["checkpoints_compared"]
    diff = compared["first_mismatch"]
    assert (compared["step"], compared["exact"], compared["mismatched_tensors"], diff["elements"]) == (6, False, 1, 1)
    assert (diff["tensor"], diff["index"], diff["recorded"], diff["rank"]) == (
        "fc2.weight", [16, 0], "nan", 1)  # row 16 of 32: rank 1's half
    assert report["diverged_at_step"] == 6
    assert any("do not single out a rank" in f for f in report["findings"])
    assert any("in rank 1's shard" in f and "suspect its hardware" in f for f in report["findings"])


def test_bisect_finds_the_first_poisoned_dcp_checkpoint(runs):
    report = bisect([runs["fsdp2"]])
    assert report.order == "metadata" and [r.step for r in report.history] == [6, 0, 3]
    assert [c.format for c in discover([runs["fsdp2"]]).checkpoints] == ["dcp"] * 3
    assert (report.last_clean.step, report.first_poisoned.step) == (3, 6)
    assert report.first_poisoned_verdict == "poisoned_parameters"
    assert report.replay is not None and report.replay.from_step == 3  # every rank kept its batches


def test_killed_mid_checkpoint_leaves_the_previous_one(runs):
    """Rank 1 died with its shard of checkpoint 6 written and the checkpoint incomplete: at most a hidden folder holds
    it (rank 0 removes its build folder when the collective write fails, unless torchrun's stop comes first), and every
    reader carries on from checkpoint 3."""
    run = runs["fsdp2_killed"]
    before = tree_digest(run)
    assert sorted(p.name for p in (run / "checkpoints").iterdir() if not p.name.startswith(".")) == [
        "step_00000000", "step_00000003"]
    assert {p.name.split(".")[1] for p in (run / "checkpoints").iterdir() if p.name.startswith(".")} <= {"step_00000006"}
    bisected = bisect([run])
    assert bisected.verdict == "clean" and [r.step for r in bisected.history] == [3, 0]
    result = run_cli("replay", run, "--json", "-", cwd=ROOT)
    assert result.code == 0, result.stderr
    assert result.json()["verdict"] == "clean" and result.json()["setup"]["from_checkpoint"] == 3
    assert tree_digest(run) == before


def test_unsupported_parallelism_is_refused():
    """A plain model in a world of several ranks: tensor or pipeline parallel, or a loop that all-reduces by hand."""
    with pytest.raises(ValueError, match="DistributedDataParallel or fully_shard"):
        describe(scenarios.build_model(), 2)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason=f"NCCL needs 2 CUDA devices; this machine has "
                                                          f"{torch.cuda.device_count()}")
def test_nccl_on_gpus(tmp_path):
    """The same job on two GPUs with NCCL, replayed at world size on them and emulated on one GPU. Whether the
    replayed losses equal the logged ones bit for bit (GPU kernels need not be deterministic) is printed, not
    asserted."""
    recorded = launch(job.command(tmp_path, ["ddp", "fsdp2"], "--cuda"))
    assert recorded.code == 0, recorded.stderr[-3000:]
    for name in ("ddp", "fsdp2"):
        out = tmp_path / f"{name}.json"
        torchrun("-m", "nanforensics", "replay", tmp_path / name, "--device", "cuda", "--json", out)
        emulated = run_cli("replay", tmp_path / name, "--device", "cuda", "--json", "-", cwd=ROOT).json()
        for how, report in (("torchrun", json.loads(out.read_text())), ("emulated", emulated)):
            check_attribution(report, name, how, exact=False)
            print(f"{name} {how}: reproduced {report['reproduced']}, diverged at {report['diverged_at_step']}")


def test_torchrun_and_emulated_replays_of_the_sample_agree(torchrun_replays):
    """Precursors are over every rank in both modes (rank 1's outlier activation too): the two JSON reports of the
    shipped sample are one but for the field that names the mode."""
    ranks, out, before = torchrun_replays["sample"]
    assert ranks.codes == [1] * job.WORLD, ranks.stderr[-3000:]
    at_size = json.loads(out.read_text())
    assert tree_digest(SAMPLE) == before
    emulated = run_cli("replay", "sample_runs/ddp_two_ranks", "--json", "-", cwd=ROOT).json()
    assert (at_size["setup"].pop("ranks_replayed"), emulated["setup"].pop("ranks_replayed")) == ("torchrun", "emulated")
    largest = max(v for p in at_size["precursors"] if isinstance(v := p["activation_max_abs"], float))
    assert largest > 100  # rank 1's near-zero reading's log, which rank 0 never sees
    for key in sorted(set(at_size) | set(emulated)):
        assert at_size.get(key) == emulated.get(key), key
