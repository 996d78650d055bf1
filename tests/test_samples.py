"""The shipped sample runs: what the README and docs/samples.md promise of them, and that they match their generator."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path
from typing import Any, Callable

import pytest
import torch
from nanforensics.finite import decode_float
from nanforensics.replay.reproduction import STATE_ATOL, STATE_RTOL, losses_match
from nanforensics.runs.cpu import this_cpu
from safetensors.torch import load_file

from conftest import ROOT, run_cli, tree_digest

SAMPLES = ROOT / "sample_runs"


@pytest.mark.parametrize("name, code, responsible, logged", [
    ("seed_adam", 1, 27, 28),
    ("sgd_momentum", 1, 27, 29),
    ("clean", 0, None, None),
])
def test_readme_replay_on_sample_runs(name, code, responsible, logged):
    before = tree_digest(SAMPLES)
    result = run_cli("replay", f"sample_runs/{name}", "--json", "-", cwd=ROOT)
    assert result.code == code, result.stderr
    report = result.json()
    assert report["responsible_step"] == responsible
    assert report["logged_first_nonfinite_loss_step"] == logged
    assert report["reproduced"] is True
    if responsible is not None:
        assert (report["origin"]["tensor"], report["origin"]["index"]) == ("features.gain", [3])
    assert tree_digest(SAMPLES) == before


def test_the_zero_sample_bisects_and_scans_without_deepspeed():
    """docs/deepspeed.md's commands on the shipped ZeRO-2 folder (DeepSpeed's pickles, read without DeepSpeed): the
    first poisoned global_step and the planted coordinate, named by parameter."""
    before = tree_digest(SAMPLES)
    bisect = run_cli("bisect", "sample_runs/zero2", "--json", "-", cwd=ROOT)
    scan = run_cli("scan", "sample_runs/zero2/global_step3", "--full", "--json", "-", cwd=ROOT)
    assert tree_digest(SAMPLES) == before
    assert bisect.code == 1 and scan.code == 1, bisect.stderr + scan.stderr
    b = bisect.json()
    assert (b["last_clean"]["step"], b["first_poisoned"]["step"]) == (2, 3), b
    s = scan.json()
    assert s["format"] == "deepspeed-zero" and s["verdict"] == "poisoned_parameters", s
    assert [(t["name"], t["first_nonfinite"]) for t in s["tensors"] if t["nonfinite"]] == [
        ("fc1.weight", {"index": [2, 0], "value": "nan"})], s


def test_readme_replay_of_a_run_nobody_recorded():
    """docs/unrecorded.md's commands on the sample whose script saves plain torch.save checkpoints."""
    before = tree_digest(SAMPLES)
    replay = run_cli("replay", "--checkpoint", "sample_runs/unrecorded/ckpts/step_000010.pt",
                     "--code", "sample_runs/unrecorded/train.py", cwd=ROOT)
    bisect = run_cli("bisect", "sample_runs/unrecorded/ckpts", "--code", "sample_runs/unrecorded/train.py", cwd=ROOT)
    assert tree_digest(SAMPLES) == before
    for result in (replay, bisect):
        assert result.code == 1, result.stderr
        out = " ".join(result.stdout.split())  # the panel wraps lines
        assert "responsible step 17; replayed loss first NaN at step 18" in out
        assert "origin step 17 grad gain[3] = -inf" in out
        assert "samples 5 of 64 (batch['row']: [1093])" in out
        assert "whether the replay reproduces the run cannot be judged" in out
    assert "last clean: step 10" in " ".join(bisect.stdout.split()) and "first poisoned: step 20" in bisect.stdout


def assert_same_run(shipped: Path, made: Path, left_out: Callable[[Path], bool] = lambda rel: False,
                    rtol: float = 0.0) -> None:
    """Every file of a shipped run (or folder of runs) but those ``left_out``, as its generator makes it: tensors
    equal, other files byte for byte; where ``rtol`` is above 0 (made on another kind of CPU: kernels sum in another
    order), tensors and logged losses within it as a replay judges them, and manifests equal but for their cpu."""
    names = sorted(p.relative_to(shipped) for p in shipped.rglob("*") if p.is_file()
                   and not left_out(p.relative_to(shipped)))
    assert names == sorted(p.relative_to(made) for p in made.rglob("*") if p.is_file()
                           and not left_out(p.relative_to(made)))
    for rel in names:
        a, b = shipped / rel, made / rel
        if rel.suffix == ".safetensors":  # metadata key order may differ; tensors must not
            ta, tb = load_file(a), load_file(b)
            assert ta.keys() == tb.keys()
            for k in ta:
                assert_close(ta[k], tb[k], rtol, (rel, k))
        elif rtol and rel.suffix == ".pt":  # torch.save's pickle holds the tensors' bytes
            ta, tb = (torch.load(f, weights_only=True) for f in (a, b))
            assert_close_tree(ta, tb, rtol, rel)
        elif rtol and rel.name == "manifest.json":
            assert {**json.loads(a.read_text()), "cpu": None} == {**json.loads(b.read_text()), "cpu": None}, rel
        elif rtol and rel.name == "steps.jsonl":
            la, lb = ([json.loads(line) for line in f.read_text().splitlines()] for f in (a, b))
            assert [x["step"] for x in la] == [y["step"] for y in lb], rel
            assert all(losses_match(decode_float(x["loss"]), decode_float(y["loss"]), rtol) for x, y in zip(la, lb)), rel
        else:
            assert a.read_bytes() == b.read_bytes(), rel


def assert_close(a: torch.Tensor, b: torch.Tensor, rtol: float, where: object) -> None:
    """Bit for bit (NaN equal to NaN) when ``rtol`` is 0; else within it, as a replay on another CPU is judged."""
    if rtol and a.is_floating_point():
        finite = a[a.isfinite()].abs()
        atol = STATE_ATOL * float(finite.max()) if finite.numel() else 0.0
        assert a.dtype == b.dtype and torch.allclose(a, b, rtol=rtol, atol=atol, equal_nan=True), where
    else:
        assert torch.equal(a.nan_to_num(), b.nan_to_num()), where
        assert torch.equal(a.isnan(), b.isnan()), where


def assert_close_tree(a: Any, b: Any, rtol: float, where: object) -> None:
    assert type(a) is type(b), where
    if isinstance(a, torch.Tensor):
        assert_close(a, b, rtol, where)
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for k in a:
            assert_close_tree(a[k], b[k], rtol, (where, k))
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for x, y in zip(a, b):
            assert_close_tree(x, y, rtol, where)
    else:
        assert a == b, where


def machine_rtol(run: Path) -> float:
    """What a regenerated run may differ by from the shipped one: nothing where the shipped manifest names this
    machine's kind of CPU; else (another CPU, whose kernels sum in another order, or a run recorded before manifests
    named it) the replay's cross-CPU tolerance, STATE_RTOL (1e-3). What the generator controls is compared exactly."""
    recorded = json.loads((run / "manifest.json").read_text()).get("cpu")
    return 0.0 if recorded == dataclasses.asdict(this_cpu()) else STATE_RTOL


def test_generator_reproduces_the_shipped_runs(tmp_path):
    """Bit for bit where the shipped runs name this machine's kind of CPU, else within machine_rtol."""
    subprocess.run([sys.executable, str(SAMPLES / "generate.py"), "--out", str(tmp_path)], check=True,
                   capture_output=True)
    rtol = machine_rtol(SAMPLES / "clean")
    # scripts are not generated; ddp_two_ranks comes from generate_distributed.py, checked in test_distributed.py, and
    # zero2 from generate_zero.py, checked in test_zero.py
    assert_same_run(SAMPLES, tmp_path, lambda rel: rel.suffix == ".py" or rel.parts[0] in ("ddp_two_ranks", "zero2"),
                    rtol)
