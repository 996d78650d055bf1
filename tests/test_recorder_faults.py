"""The recorder and the readers under faults: killed jobs, a full disk, corrupt step logs, random batches."""

from __future__ import annotations

import json
import math
import os
import random
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from nanforensics import Recorder
from nanforensics.errors import BadInput
from nanforensics.runs.batches import encoded, read_batch, snapshot
from nanforensics.runs.steplog import read_steps

import scenarios
from conftest import run_cli, tree_digest

JOB = Path(__file__).with_name("recording_job.py")


def _job(run_dir: Path, steps: int, *limit: int) -> subprocess.Popen[str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(JOB.parent.parent), os.environ.get("PYTHONPATH", "")])}
    return subprocess.Popen([sys.executable, str(JOB), str(run_dir), str(steps), *map(str, limit)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)


@pytest.mark.parametrize("kill_after", [0.5, 1.2, 2.0, 2.8])
def test_killed_recording_leaves_a_readable_run(tmp_path, kill_after):
    run = tmp_path / "run"
    job = _job(run, 100_000)
    deadline = time.monotonic() + 60
    while not (run / "steps.jsonl").exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(kill_after * random.Random(kill_after).uniform(0.5, 1.0))
    job.send_signal(signal.SIGKILL)
    job.wait()
    before = tree_digest(run)
    checkpoints = sorted((run / "checkpoints").glob("step_*"))
    assert checkpoints, "the initial checkpoint is written before the first step"
    for c in checkpoints:  # every checkpoint that has its final name is complete
        assert {p.name for p in c.iterdir()} >= {"model.safetensors", "optimizer.safetensors", "meta.json"}
        json.loads((c / "meta.json").read_text())
    scan = run_cli("scan", checkpoints[-1])
    assert scan.code == 0, scan.stderr
    replay = run_cli("replay", run, "--json", "-")
    assert replay.code == 0, replay.stderr
    assert replay.json()["verdict"] == "clean" and replay.json()["reproduced"] is True
    assert tree_digest(run) == before


def test_full_disk_raises_in_the_training_loop(tmp_path):
    # checkpoints (largest file 22 kB) fit; the step log outgrows the limit after some 700 steps. A checkpoint every
    # 500 steps: the steps, not some 230 checkpoints, are what fills the disk here
    job = _job(tmp_path / "run", 2000, 30_000, 500)
    out, err = job.communicate(timeout=120)
    assert job.returncode != 0 and "finished" not in out
    assert f"nanforensics recorder could not write {tmp_path / 'run' / 'steps.jsonl'}: File too large" in err, \
        err[-2000:]
    logged = read_steps(tmp_path / "run" / "steps.jsonl")
    assert 100 < len(logged) < 2000


def test_a_failed_checkpoint_write_names_the_file_and_leaves_no_hidden_folder(tmp_path):
    # the model file (7 kB) fits, a later file of the very first checkpoint does not
    job = _job(tmp_path / "run", 10, 10_000)
    out, err = job.communicate(timeout=120)
    assert job.returncode != 0 and "finished" not in out
    named = re.search(r"nanforensics recorder could not write (\S+): File too large", err)
    assert named, err[-2000:]
    assert Path(named[1]).parent == tmp_path / "run" / "checkpoints" / "step_00000000"  # as it would have been
    assert list((tmp_path / "run" / "checkpoints").iterdir()) == []  # neither the checkpoint nor its build folder


@pytest.mark.parametrize("leaf, problem", [
    (lambda: torch.eye(3).to_sparse(), "a sparse_coo tensor cannot be recorded"),
    (lambda: torch.eye(3).to_sparse_csr(), "a sparse_csr tensor cannot be recorded"),
    (lambda: torch.empty(3, device="meta"), "a tensor on the meta device holds no values"),
], ids=["coo", "csr", "meta"])
@pytest.mark.filterwarnings("ignore:Sparse")
def test_a_batch_leaf_that_cannot_be_recorded_is_named(tmp_path, leaf, problem):
    model = scenarios.build_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with Recorder(tmp_path / "r", model, optimizer, model_factory=scenarios.build_model,
                  step_fn=scenarios.train_step) as rec:
        with pytest.raises(TypeError, match=rf"batch\['x'\]\[1\]: {problem}"):
            rec.log(0, {"x": [torch.ones(2), leaf()]}, 1.0)
        rec.log(0, {"x": [torch.ones(2)]}, 1.0)  # the refused step was not counted
    assert [s.step for s in read_steps(tmp_path / "r" / "steps.jsonl")] == [0]


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=400))
def test_step_log_reader_never_crashes_on_garbage(tmp_path_factory, data):
    path = tmp_path_factory.mktemp("log") / "steps.jsonl"
    path.write_bytes(data)
    try:
        steps = read_steps(path)
    except BadInput as e:
        assert "steps.jsonl" in str(e) and "\n" not in str(e)
    else:
        assert all(isinstance(s.step, int) and isinstance(s.loss, float) for s in steps)


@settings(max_examples=100, deadline=None)
@given(st.integers(min_value=0, max_value=10_000), st.binary(min_size=1, max_size=8))
def test_corrupting_a_valid_step_log_never_crashes(tmp_path_factory, position, junk):
    good = b"".join(json.dumps({"step": i, "loss": 0.5 / (i + 1)}).encode() + b"\n" for i in range(30))
    position %= len(good)
    path = tmp_path_factory.mktemp("log") / "steps.jsonl"
    path.write_bytes(good[:position] + junk + good[position + len(junk):])
    try:
        read_steps(path)
    except BadInput as e:
        assert "steps.jsonl" in str(e)


_leaf = st.one_of(
    st.integers(-10**6, 10**6), st.text(max_size=8), st.none(), st.booleans(),
    st.floats(allow_nan=False, allow_infinity=False, width=32),
    st.builds(lambda shape, dtype: torch.randn(shape).to(dtype),
              st.lists(st.integers(0, 3), max_size=3).map(tuple),
              st.sampled_from([torch.float32, torch.float16, torch.bfloat16, torch.int64])),
)
_batches = st.recursive(_leaf, lambda inner: st.one_of(
    st.lists(inner, max_size=3), st.lists(inner, max_size=3).map(tuple),
    st.dictionaries(st.text(min_size=1, max_size=5), inner, max_size=3)), max_leaves=10)


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, dict):
        return isinstance(b, dict) and list(a) == list(b) and all(_same(a[k], b[k]) for k in a)
    return a == b and type(a) is type(b) or (isinstance(a, float) and math.isclose(a, b))


@settings(max_examples=150, deadline=None)
@given(_batches)
def test_batch_round_trip_is_exact(tmp_path_factory, batch):
    path = tmp_path_factory.mktemp("batch") / "b.safetensors"
    path.write_bytes(b"".join(encoded(3, *snapshot(batch))))  # what the recorder writes: a snapshot, encoded
    assert _same(batch, read_batch(path))
