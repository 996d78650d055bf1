"""The shipped sample runs: what the README promises of them, and that they match their generator."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from conftest import run_cli, tree_digest

ROOT = Path(__file__).resolve().parent.parent
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


def assert_same_run(shipped: Path, made: Path) -> None:
    """Every file of a shipped run, as its generator makes it: tensors equal, other files byte for byte."""
    names = sorted(p.relative_to(shipped) for p in shipped.rglob("*") if p.is_file())
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
    made = sorted(p.name for p in tmp_path.iterdir())
    # the rest comes from generate_distributed.py, checked in test_distributed.py
    assert sorted(p.name for p in SAMPLES.iterdir() if p.is_dir()) == sorted(made + ["ddp_two_ranks"])
    for name in made:
        assert_same_run(SAMPLES / name, tmp_path / name)
