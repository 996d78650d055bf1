"""DeepSpeed ZeRO checkpoints (stages 1, 2, 3; world 1 and 2), written by DeepSpeed's own engine on the CPU
(tests/zero_checkpoints.py, once per session): every flat coordinate maps back to the parameter and coordinate DeepSpeed's
``zero_to_fp32`` puts it at, a NaN planted anywhere is named there, bisect finds the first poisoned global_step, the
soundness screen sees Adam's bound, and damaged folders give one error line."""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from nanforensics.checkpoints.scan import CLEAN, POISONED_PARAMETERS, POISONED_STATE, scan_checkpoint
from nanforensics.formats import MODEL, OPTIMIZER, open_checkpoint

import zero_checkpoints as gen
from conftest import ROOT, TESTS, assert_one_line_error, error_lines, run_cli, tree_digest

CASES = [(w, s) for w in gen.WORLDS for s in gen.STAGES]


@pytest.fixture(scope="session")
def zero_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Every checkpoint of both world sizes (DeepSpeed's engine, on the CPU)."""
    if importlib.util.find_spec("deepspeed") is None:
        if os.environ.get("CI"):
            pytest.fail("deepspeed is not installed: CI installs the deepspeed extra (pyproject.toml)")
        pytest.skip("deepspeed is not installed (pip install -e '.[deepspeed]')")
    root = tmp_path_factory.mktemp("zero")
    job = subprocess.run([sys.executable, str(TESTS / "zero_checkpoints.py"), str(root)], capture_output=True, text=True,
                         timeout=600)
    assert job.returncode == 0, (job.stdout + job.stderr)[-4000:]
    return root


def expected(root: Path, world: int, stage: int) -> dict[str, Any]:
    return torch.load(root / f"w{world}" / f"s{stage}" / "plants" / "zero_to_fp32.pt", weights_only=True)


def tensors(folder: Path) -> Iterator[tuple[str, str, torch.Tensor]]:
    for info, t, _ in open_checkpoint(folder).open().tensors():
        yield info.name, info.group, t


@pytest.mark.parametrize("world, stage", CASES)
def test_every_coordinate_maps_where_zero_to_fp32_puts_it(zero_root, world, stage):
    """In the numbered checkpoint every fp32 coordinate holds its own rank, group and position: the parameters read
    equal DeepSpeed's reconstruction coordinate for coordinate, and each exp_avg (numbered + 0.5) lies where its
    weight does."""
    theirs = expected(zero_root, world, stage)["numbered"]
    ours = {(name, group): t.clone() for name, group, t in tensors(zero_root / f"w{world}" / f"s{stage}" / "plants" /
                                                                   "numbered")}
    for name, t in theirs.items():
        assert torch.equal(ours[(name, MODEL)], t), name
    trained = [n for n in theirs if (f"{n}/exp_avg", OPTIMIZER) in ours]
    assert len(trained) == 6  # fc1, bn and fc2's weights and biases; the buffers and the frozen one have no state
    for name in trained:
        assert torch.equal(ours[(f"{name}/exp_avg", OPTIMIZER)], theirs[name] + 0.5), name
    # distinct numbers: the mapping is one-to-one, no coordinate read twice
    values = torch.cat([ours[(n, MODEL)].reshape(-1) for n in trained])
    assert values.unique().numel() == values.numel()


def plants(root: Path) -> list[tuple[int, int, str, str]]:
    return [(w, s, kind, p.name) for w, s in CASES for kind in gen.KINDS
            for p in sorted((root / f"w{w}" / f"s{s}" / "plants").glob(f"{kind}-*"))]


def test_a_planted_nan_is_named_at_its_parameter_and_coordinate(zero_root):
    """A NaN at every planted position (both ends of each rank's partition and between) of the fp32 master weights,
    exp_avg and exp_avg_sq: the scan names the parameter and coordinate zero_to_fp32 puts the fp32 plant at (the state
    shares its layout), and a plant in padding, which zero_to_fp32 leaves out, is no parameter's."""
    cases = plants(zero_root)
    assert len(cases) == 3 * 3 * 5 * (1 + 2)
    padding = set()
    for world, stage, kind, tag in cases:
        where = expected(zero_root, world, stage)["nan"][tag.replace(kind, "fp32", 1)]
        report = scan_checkpoint(open_checkpoint(zero_root / f"w{world}" / f"s{stage}" / "plants" / tag), full=True,
                                 soundness=False)
        found = [[t.name, t.first_nonfinite.index] for t in report.poisoned]
        suffix = "" if kind == "fp32" else f"/{kind}"
        assert found == [[name + suffix, index] for name, index in where], (world, stage, tag)
        assert report.verdict == (CLEAN if not where else POISONED_PARAMETERS if kind == "fp32" else POISONED_STATE)
        if not where:
            padding.add((world, stage))
    # plants in padding: world 2's stage 2 pads each parameter to 4 elements, stage 3 each parameter to 2 pieces
    assert padding == {(2, 2), (2, 3)}


def test_the_cli_scans_a_zero_folder_and_leaves_it_untouched(zero_root):
    folder = zero_root / "w2" / "s3" / "plants" / "exp_avg_sq-r1-i1"
    before = tree_digest(folder)
    result = run_cli("scan", folder, "--json", "-")
    assert result.code == 1, result.stderr
    report = result.json()
    where = expected(zero_root, 2, 3)["nan"]["fp32-r1-i1"]
    assert report["format"] == "deepspeed-zero" and report["verdict"] == POISONED_STATE
    assert [[t["name"], t["first_nonfinite"]["index"]] for t in report["tensors"] if t["nonfinite"]] == \
        [[f"{where[0][0]}/exp_avg_sq", where[0][1]]]
    assert tree_digest(folder) == before


@pytest.mark.parametrize("world, stage", CASES)
def test_bisect_names_the_first_poisoned_global_step(zero_root, world, stage):
    result = run_cli("bisect", zero_root / f"w{world}" / f"s{stage}" / "run", "--json", "-")
    assert result.code == 1, result.stderr
    report = result.json()
    assert report["first_poisoned"]["step"] == gen.BAD_STEP and report["last_clean"]["step"] == gen.BAD_STEP - 1
    assert report["first_poisoned_verdict"] == POISONED_PARAMETERS


def test_the_shipped_sample_is_what_its_generator_writes(zero_root):
    """sample_runs/zero2 is the generator's w2/s2/run (sample_runs/generate_zero.py, DeepSpeed's own scripts left out):
    byte for byte where DeepSpeed, torch and the CPU are the ones it was made with; elsewhere what the generator
    controls: the same tensors (name, group, dtype, shape) with NaN and inf at the same coordinates. Not their values:
    fc1.bias feeds a BatchNorm, so its gradient is rounding noise whose sign Adam's first steps turn into +-lr."""
    shipped, made = ROOT / "sample_runs" / "zero2", zero_root / "w2" / "s2" / "run"
    files = sorted(p.relative_to(shipped) for p in shipped.rglob("*") if p.is_file())
    assert files == sorted(p.relative_to(made) for p in made.rglob("*") if p.is_file() and p.suffix != ".py")
    if all((shipped / f).read_bytes() == (made / f).read_bytes() for f in files):
        return
    for folder in sorted(shipped.glob("global_step*")):
        ours = {(name, group): (t.dtype, t.shape, t.isnan(), t.isinf()) for name, group, t in tensors(made / folder.name)}
        theirs = {(name, group): (t.dtype, t.shape, t.isnan(), t.isinf()) for name, group, t in tensors(folder)}
        assert ours.keys() == theirs.keys(), folder
        for key, (dtype, shape, nan, inf) in theirs.items():
            assert (dtype, shape) == ours[key][:2] and torch.equal(nan, ours[key][2]) and torch.equal(inf, ours[key][3]), \
                (folder.name, key)


def test_hf_trainer_checkpoint_folders_are_read_through_latest(zero_root, tmp_path):
    """The HF Trainer's ``checkpoint-N`` (``global_stepN`` named by ``latest``, beside a 16-bit ``model.safetensors``
    and ``rng_state.pth``): the ZeRO checkpoint is read, the files beside it named as not read; bisect over the output
    folder orders by ``global_steps`` and names checkpoint-3."""
    from safetensors.torch import save_file

    run = zero_root / "w2" / "s2" / "run"
    for step in (1, 2, 3, 4):
        folder = tmp_path / f"checkpoint-{step}"
        shutil.copytree(run / f"global_step{step}", folder / f"global_step{step}")
        (folder / "latest").write_text(f"global_step{step}")
        save_file({"fc1.weight": torch.zeros(7, 5, dtype=torch.bfloat16)}, folder / "model.safetensors")
        torch.save({"python": 1}, folder / "rng_state.pth")
    scan = run_cli("scan", tmp_path / "checkpoint-2", "--json", "-")
    assert scan.code == 0, scan.stderr
    report = scan.json()
    assert report["format"] == "deepspeed-zero" and report["step"] == 2
    assert [line.split(":")[0] for line in report["skipped"]] == ["model.safetensors", "rng_state.pth"]
    assert "beside the DeepSpeed ZeRO checkpoint global_step2" in report["skipped"][0]
    bisect = run_cli("bisect", tmp_path, "--json", "-")
    assert bisect.code == 1, bisect.stderr
    assert bisect.json()["first_poisoned"]["path"] == str(tmp_path / "checkpoint-3")


@pytest.mark.parametrize("world, stage", CASES)
def test_the_soundness_screen_flags_exp_avg_beyond_adams_bound(zero_root, world, stage):
    """Rank 0's group-0 position ``UNSOUND_INDEX`` holds |m| = 100 sqrt(v) + 1: flagged at the parameter and coordinate
    the numbered checkpoint shows that position at (number = position, rank 0, group 0), and nowhere else."""
    numbered = expected(zero_root, world, stage)["numbered"]
    [(name, index)] = [(n, (t == gen.UNSOUND_INDEX).nonzero()[0].tolist()) for n, t in numbered.items()
                       if t.is_floating_point() and bool((t == gen.UNSOUND_INDEX).any())]
    result = run_cli("scan", zero_root / f"w{world}" / f"s{stage}" / "plants" / "unsound", "--json", "-")
    assert result.code == 5, result.stderr
    report = result.json()
    assert [(u["check"], u["param"], u["index"]) for u in report["unsound"]] == [("adam_bound", name, index)]
    assert report["soundness"]["optimizers"] == ["Adam-family (Adam, AdamW, NAdam, RAdam)"] * 2


def test_the_clean_checkpoints_are_sound(zero_root):
    for world, stage in CASES:
        report = scan_checkpoint(open_checkpoint(zero_root / f"w{world}" / f"s{stage}" / "run" / "global_step2"))
        assert (report.verdict, report.unsound, report.soundness.notes) == (CLEAN, [], []), (world, stage)


@pytest.mark.parametrize("precision, stage", gen.MIXED)
def test_a_16_bit_working_copy_is_scanned_beside_the_fp32_master(zero_root, precision, stage):
    """bf16 (its ``bf16_zero_pp_rank_*`` files) and fp16: the working copy the forward pass computes with is read as
    ``module.<name>``; inf there is a poisoned parameter though the fp32 master is finite; an inf loss scale is unsound."""
    base = zero_root / precision / f"s{stage}"
    clean = run_cli("scan", base / "clean", "--json", "-")
    assert clean.code == 0, clean.stderr
    names = {t["name"]: t["dtype"] for t in clean.json()["tensors"]}
    assert names["0.weight"] == "float32" and names["module.0.weight"] == ("bfloat16" if precision == "bf16" else "float16")
    planted = run_cli("scan", base / "module-inf", "--json", "-", "--full")
    assert planted.code == 1, planted.stderr
    assert [(t["name"], t["first_nonfinite"]) for t in planted.json()["tensors"] if t["nonfinite"]] == \
        [("module.0.weight", {"index": list(gen.MODULE_INF), "value": "inf"})]
    scale = run_cli("scan", base / "scale-inf", "--json", "-")
    assert scale.code == 5, scale.stderr
    assert [(u["check"], u["values"]) for u in scale.json()["unsound"]] == [("loss_scale", {"scale": "inf"})]


# ---- damaged folders: one line, exit 2, naming the file -------------------------------------------------------


def copy(zero_root: Path, tmp_path: Path, world: int, stage: int) -> Path:
    dest = tmp_path / f"global_step2-w{world}-s{stage}"
    shutil.copytree(zero_root / f"w{world}" / f"s{stage}" / "run" / "global_step2", dest)
    return dest


def optim(folder: Path, rank: int) -> Path:
    return folder / f"zero_pp_rank_{rank}_mp_rank_00_optim_states.pt"


def model_states(folder: Path) -> Path:
    own = folder / "mp_rank_00_model_states.pt"
    return own if own.exists() else folder / "zero_pp_rank_0_mp_rank_00_model_states.pt"


@pytest.mark.parametrize("stage", gen.STAGES)
@pytest.mark.parametrize("what", sorted(gen.DAMAGE))
def test_optimizer_states_that_disagree_with_the_rest_are_one_error_line(zero_root, stage, what):
    """Rewritten by DeepSpeed's own pickling (the generator): each disagreement named, with the file, in one line."""
    folder = zero_root / "w2" / f"s{stage}" / "damaged" / what
    result = run_cli("scan", folder)
    assert_one_line_error(result, gen.DAMAGE[what])
    assert "zero_pp_rank_" in error_lines(result.stderr)[0]


@pytest.mark.parametrize("stage", gen.STAGES)
def test_a_truncated_rank_file_is_one_error_line(zero_root, tmp_path, stage):
    folder = copy(zero_root, tmp_path, 2, stage)
    data = optim(folder, 1).read_bytes()
    optim(folder, 1).write_bytes(data[:len(data) // 2])
    assert_one_line_error(run_cli("scan", folder), str(optim(folder, 1)))


@pytest.mark.parametrize("stage", gen.STAGES)
def test_a_missing_or_extra_rank_file_is_one_error_line(zero_root, tmp_path, stage):
    folder = copy(zero_root, tmp_path, 2, stage)
    optim(folder, 0).unlink()
    assert_one_line_error(run_cli("scan", folder), str(optim(folder, 0)), "is missing")
    folder = copy(zero_root, tmp_path / "extra", 1, stage)
    shutil.copy(optim(folder, 0), optim(folder, 1))
    assert_one_line_error(run_cli("scan", folder), "partition_count", "2 optimizer states files")


@pytest.mark.parametrize("name", ["mp_rank_01_model_states.pt", "zero_pp_rank_0_mp_rank_01_optim_states.pt",
                                  "layer_01-model_00-model_states.pt"])
def test_a_tensor_or_pipeline_parallel_part_is_refused_not_read_in_part(zero_root, tmp_path, name):
    folder = copy(zero_root, tmp_path, 1, 2)
    shutil.copy(model_states(folder), folder / name)
    assert_one_line_error(run_cli("scan", folder), str(folder / name), "tensor- or pipeline-parallel")


@pytest.mark.parametrize("stage", gen.STAGES)
@pytest.mark.parametrize("shape", [(7, 6), (7, 4), (1 << 40, 1 << 21), (7, -5), (7.0, 5)])
def test_shapes_that_do_not_fill_the_partitions_are_refused_before_allocating(zero_root, tmp_path, stage, shape):
    """fc1.weight's recorded shape changed (one element more or less, 2^61 elements, a negative or float dimension):
    refused from the sizes alone, naming the model states file, never a 2^63-byte allocation."""
    folder = copy(zero_root, tmp_path, 2, stage)
    states = torch.load(model_states(folder), weights_only=True)
    states["param_shapes"][0]["fc1.weight"] = torch.Size(shape) if all(isinstance(d, int) for d in shape) else shape
    torch.save(states, model_states(folder))
    for command in ("scan", "bisect"):
        assert_one_line_error(run_cli(command, folder), "param_shapes")


def test_a_global_beyond_the_allow_list_is_refused_by_name(zero_root, tmp_path):
    """A pickled object of any class but DeepSpeed's allow-listed ones (here a Fraction): refused, never built."""
    from fractions import Fraction

    folder = copy(zero_root, tmp_path, 1, 2)
    states = torch.load(model_states(folder), weights_only=True)
    states["lr_scheduler"] = Fraction(1, 3)
    torch.save(states, model_states(folder))
    assert_one_line_error(run_cli("scan", folder), str(model_states(folder)), "fractions.Fraction")


def test_replay_from_a_zero_checkpoint_is_refused_saying_why(zero_root):
    folder = zero_root / "w1" / "s2" / "run" / "global_step2"
    result = run_cli("replay", "--checkpoint", folder, "--code", "tests/plain_training.py", cwd=ROOT)
    assert_one_line_error(result, str(folder), "DeepSpeed ZeRO", "zero_to_fp32.py")


def test_a_save_folder_of_several_points_to_them(zero_root):
    run = zero_root / "w1" / "s1" / "run"
    assert_one_line_error(run_cli("scan", run), "DeepSpeed save folder holding 4 ZeRO checkpoints",
                          "global_step1 ... global_step4")


def test_a_torch_without_named_stand_ins_says_so_in_one_line(zero_root, monkeypatch):
    """torch before 2.6 takes no (stand-in, name) pairs in safe_globals: the version named, never an AttributeError."""
    from nanforensics.formats import torch_file

    monkeypatch.setattr(torch_file, "_NAMED_STAND_INS", False)
    assert_one_line_error(run_cli("scan", zero_root / "w1" / "s1" / "run" / "global_step2"), "needs torch >= 2.6")


def test_one_rank_file_alone_points_to_its_folder(zero_root):
    folder = zero_root / "w1" / "s1" / "run" / "global_step2"
    assert_one_line_error(run_cli("scan", optim(folder, 0)), "DeepSpeed ZeRO", f"scan its folder {folder}")
