"""The recorder: what it writes, what it refuses, and that replay can use what it kept."""

from __future__ import annotations

import json
import os

import pytest
import torch
from nanforensics import Recorder
from nanforensics.errors import BadInput
from nanforensics.runs.batches import read_batch
from nanforensics.runs.run import Run

import scenarios
from conftest import run_cli


def _model_and_optimizer():
    model = scenarios.build_model()
    return model, torch.optim.Adam(model.parameters(), lr=1e-2)


def test_layout_of_a_recorded_run(runs):
    run = Run(runs["adam_near_zero"])
    m = run.manifest.raw
    assert m["format"] == "nanforensics.run/1"
    assert m["model_factory"] == "scenarios:build_model"
    assert m["step_fn"] == "scenarios:train_step"
    assert m["optimizer"]["class"] == "torch.optim.adam:Adam"
    assert [c.step for c in run.checkpoints()] == [0, 10, 20]
    assert [s.step for s in run.steps] == list(range(24))
    assert all(run.batch_file(s).exists() for s in range(24))
    old = os.umask(0o022)
    os.umask(old)
    if old == 0o022:  # files are created like any other, readable by the CI job that collects them
        assert all(p.stat().st_mode & 0o044 == 0o044 for p in run.path.rglob("*"))
    meta = run.checkpoints()[1].meta()
    assert meta["param_names"][0] == "features.gain"
    assert meta["param_groups"][0]["lr"] == 0.01


def test_batch_round_trip_of_nested_structures(tmp_path):
    model, opt = _model_and_optimizer()
    batch = {"x": torch.randn(4, 16), "parts": (torch.arange(4), [torch.ones(2, dtype=torch.float16), "a.png"]),
             "ids": [7, 8, 9, 10], "meta": {"source": "shard-3", "weights": None}}
    with Recorder(tmp_path / "r", model, opt, model_factory=scenarios.build_model,
                  step_fn=scenarios.train_step) as rec:
        rec.log(0, batch, torch.tensor(0.5))
    back = read_batch(tmp_path / "r" / "batches" / "step_00000000.safetensors")
    assert back.keys() == batch.keys()
    assert torch.equal(back["x"], batch["x"])
    assert isinstance(back["parts"], tuple) and isinstance(back["parts"][1], list)
    assert torch.equal(back["parts"][0], batch["parts"][0]) and back["parts"][1][0].dtype == torch.float16
    assert back["parts"][1][1] == "a.png" and back["ids"] == [7, 8, 9, 10] and back["meta"] == batch["meta"]
    assert Run(tmp_path / "r").steps[0].loss == 0.5


def test_non_finite_losses_are_logged_as_strings(tmp_path):
    model, opt = _model_and_optimizer()
    with Recorder(tmp_path / "r", model, opt, model_factory=scenarios.build_model,
                  step_fn=scenarios.train_step) as rec:
        for step, loss in enumerate([1.0, float("nan"), float("-inf")]):
            rec.log(step, torch.zeros(1), loss)
    lines = [json.loads(x) for x in (tmp_path / "r" / "steps.jsonl").read_text().splitlines()]
    assert [x["loss"] for x in lines] == [1.0, "nan", "-inf"]


def _local_step(model, optimizer, batch):  # module level: fine
    return torch.zeros(())


@pytest.mark.parametrize("step_fn, message", [
    (lambda m, o, b: 0, "lambda"),
    (None, "defined inside a function"),
])
def test_callables_that_cannot_be_imported_again_are_refused(tmp_path, step_fn, message):
    def local(model, optimizer, batch):
        return 0
    model, opt = _model_and_optimizer()
    with pytest.raises(ValueError, match=message):
        Recorder(tmp_path / "r", model, opt, model_factory=scenarios.build_model, step_fn=step_fn or local)


def test_steps_must_be_logged_in_order_and_kwargs_must_be_json(tmp_path):
    model, opt = _model_and_optimizer()
    rec = Recorder(tmp_path / "r", model, opt, model_factory=scenarios.build_model, step_fn=_local_step)
    with pytest.raises(ValueError, match="expected 0"):
        rec.log(3, torch.zeros(1), 0.0)
    rec.close()
    with pytest.raises(FileExistsError):
        Recorder(tmp_path / "r", model, opt, model_factory=scenarios.build_model, step_fn=_local_step)
    with pytest.raises(TypeError, match="JSON"):
        Recorder(tmp_path / "q", model, opt, model_factory=scenarios.build_model, step_fn=_local_step,
                 model_kwargs={"dtype": torch.float32})


def test_retention_keeps_what_replay_needs(tmp_path):
    run = tmp_path / "kept"
    scenarios.record(run, "adam_near_zero", steps=24, defect_step=17, checkpoint_every=5, keep_checkpoints=2)
    r = Run(run)
    assert [c.step for c in r.checkpoints()] == [15, 20]
    batches = sorted(int(p.stem.split("_")[1]) for p in (run / "batches").iterdir())
    assert batches == list(range(15, 24))
    result = run_cli("replay", run, "--json", "-")
    assert result.code == 1, result.stderr
    assert result.json()["responsible_step"] == 17



def _without_gain(model: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD([p for n, p in model.named_parameters() if n != "features.gain"], lr=1e-3)


def test_the_gradients_no_optimizer_steps_are_kept_and_put_back(tmp_path):
    """A parameter that requires grad but no optimizer holds accumulates its gradient from step to step (nothing zeroes
    it): each checkpoint keeps it as the next step starts from it (``loose_grads``), ``load_into`` puts it back bit for
    bit, and a kept gradient naming a parameter an optimizer holds is refused, naming it (untrusted input)."""
    from nanforensics.runs.checkpoint import LOOSE_GRADS

    model = scenarios.build_model()
    optimizer = _without_gain(model)
    after: dict[int, torch.Tensor] = {}
    with Recorder(tmp_path / "run", model, optimizer, model_factory=scenarios.build_model,
                  step_fn=scenarios.train_step, checkpoint_every=2) as rec:
        for step in range(4):
            batch = scenarios.make_batch(step)
            rec.log(step, batch, scenarios.train_step(model, optimizer, batch))
            after[step] = model.features.gain.grad.clone()
    assert not torch.equal(after[1], after[0])  # it accumulates: the kept one must be the right step's
    checkpoints = {c.step: c for c in Run(tmp_path / "run").checkpoints()}
    assert LOOSE_GRADS not in checkpoints[0].meta()  # before the first step it has none
    two = checkpoints[2]
    assert two.meta()[LOOSE_GRADS] == ["features.gain"]
    fresh = scenarios.build_model()
    two.load_into(fresh, _without_gain(fresh))
    assert torch.equal(fresh.features.gain.grad, after[1])
    raw = json.loads((two.path / "meta.json").read_text())
    raw[LOOSE_GRADS] = ["head.weight"]
    (two.path / "meta.json").write_text(json.dumps(raw))
    with pytest.raises(BadInput, match="head.weight"):
        two.load_into(fresh, _without_gain(fresh))
