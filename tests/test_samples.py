"""The shipped sample runs: what the README promises of them, and that they match their generator."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Callable

import pytest
import torch
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


def test_readme_replay_of_a_run_nobody_recorded():
    """The README's commands on the sample whose script saves plain torch.save checkpoints."""
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


def assert_same_run(shipped: Path, made: Path, left_out: Callable[[Path], bool] = lambda rel: False) -> None:
    """Every file of a shipped run (or folder of runs) but those ``left_out``, as its generator makes it: tensors
    equal, other files byte for byte."""
    names = sorted(p.relative_to(shipped) for p in shipped.rglob("*") if p.is_file()
                   and not left_out(p.relative_to(shipped)))
    assert names == sorted(p.relative_to(made) for p in made.rglob("*") if p.is_file())
    for rel in names:
        a, b = shipped / rel, made / rel
        if rel.suffix == ".safetensors":  # metadata key order may differ; tensors must not
            ta, tb = load_file(a), load_file(b)
            assert ta.keys() == tb.keys()
            for k in ta:
                assert torch.equal(ta[k].nan_to_num(), tb[k].nan_to_num()), (rel, k)
                assert torch.equal(ta[k].isnan(), tb[k].isnan()), (rel, k)
        else:
            assert a.read_bytes() == b.read_bytes(), rel


def test_generator_reproduces_the_shipped_runs(tmp_path):
    subprocess.run([sys.executable, str(SAMPLES / "generate.py"), "--out", str(tmp_path)], check=True,
                   capture_output=True)
    # scripts are not generated; ddp_two_ranks comes from generate_distributed.py, checked in test_distributed.py
    assert_same_run(SAMPLES, tmp_path, lambda rel: rel.suffix == ".py" or rel.parts[0] == "ddp_two_ranks")
