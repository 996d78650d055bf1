"""Recorder(guard=True): a step with a non-finite gradient is skipped before the optimizer writes anything, the run goes
on, and each skip or stop leaves an incident that replays like a fully recorded run."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from nanforensics import Recorder
from nanforensics.runs.batches import snapshot
from nanforensics.runs.guard import GUARD_LOG, INCIDENTS, GuardPolicy, GuardStop, ring_nbytes

import guard_training as gt
from conftest import ROOT, TESTS, run_cli

STEPS = 500


def events(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / INCIDENTS / GUARD_LOG).read_text().splitlines()]


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """These models are tiny: a second thread only adds contention on a shared machine (replay pins what was used)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def guarded(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, torch.nn.Module]:
    run = tmp_path_factory.mktemp("guard") / "run"
    return run, gt.train(run, STEPS, checkpoint_every=50)


def test_guarded_run_equals_the_loop_that_did_not_step_at_the_bad_batches(guarded):
    _, model = guarded
    reference = gt.train(None, STEPS, skip=tuple(gt.DEFECTS))
    for (name, got), want in zip(model.state_dict().items(), reference.state_dict().values()):
        assert torch.isfinite(got).all(), name
        assert torch.equal(got, want), name


def test_the_log_lists_exactly_the_skipped_steps_with_their_samples(guarded):
    run, _ = guarded
    log = events(run)
    skips = [e for e in log if e["event"] == "skip"]
    assert [e["step"] for e in skips] == sorted(gt.DEFECTS)
    for e in skips:
        assert e["samples"]["batch['ids']"] == [f"s{e['step']:04d}-{i}" for i in range(gt.BATCH)]
        assert e["grad"]["value"] in ("nan", "inf", "-inf") and e["grad"]["tensor"]
        assert e["incident"] == f"incidents/step_{e['step']:08d}"
    inf_step = next(s for s, d in gt.DEFECTS.items() if d == "inf_input")
    assert next(e for e in skips if e["step"] == inf_step)["nonfinite_inputs"] == {"batch['x']": [gt.BAD_SAMPLE]}
    summary = log[-1]
    assert summary["event"] == "summary" and summary["steps"] == STEPS
    assert summary["skipped_steps"] == sorted(gt.DEFECTS)
    # memory mode: no batch on disk, only the newest checkpoint
    assert not (run / "batches").exists()
    assert [p.name for p in (run / "checkpoints").iterdir()] == [f"step_{STEPS:08d}"]


@pytest.mark.parametrize("step", sorted(gt.DEFECTS))
def test_each_incident_replays_to_its_step_tensor_and_sample(guarded, tmp_path, step):
    run, _ = guarded
    incident = run / INCIDENTS / f"step_{step:08d}"
    meta = json.loads((incident / "incident.json").read_text())
    assert meta["kind"] == "skip" and meta["step"] == step and meta["from_checkpoint"] < step  # the ring held the rest
    out = tmp_path / "report.json"
    result = run_cli("replay", incident, "--json", out)
    assert result.code == 1, result.stderr
    report = json.loads(out.read_text())
    assert report["responsible_step"] == step
    origin = {"inf_input": ("batch", "batch['x']", [gt.BAD_SAMPLE, 2, 1]), "overflowing_label": ("loss", "loss", []),
              "huge_value": ("forward", "block.self_attn", [gt.BAD_SAMPLE, 3, 0])}[gt.DEFECTS[step]]
    assert (report["origin"]["stage"], report["origin"]["tensor"], report["origin"]["index"]) == origin
    assert report["samples"]["sample_leaves"] == {"batch['ids']": [f"s{step:04d}-{gt.BAD_SAMPLE}"]}


def test_the_update_that_would_make_the_nan_from_finite_gradients_is_skipped(tmp_path):
    """Adam with eps=0 meets an exactly zero gradient: every gradient finite, the update 0/0. The proof cannot bound it
    (eps is 0), the real step on a copy makes the NaN: skipped, bit for bit as the loop that did not step there."""
    model = gt.train_update_nan(tmp_path / "run", 40, checkpoint_every=10)
    reference = gt.train_update_nan(None, 40, skip=(gt.THAW,))
    for got, want in zip(model.state_dict().values(), reference.state_dict().values()):
        assert torch.equal(got, want)
    skip = next(e for e in events(tmp_path / "run") if e["event"] == "skip")
    assert (skip["step"], skip["reason"], skip["grad"]) == (gt.THAW, "update", None)
    assert skip["update"] == {"tensor": "head.bias", "state": "param", "index": [0], "value": "nan"}


def test_a_nan_written_after_the_step_stops_the_run_with_an_incident(tmp_path):
    with pytest.raises(GuardStop) as stop:
        gt.train_flip(tmp_path / "run", 40, checkpoint_every=10, guard=GuardPolicy(state_check_every=5))
    incident = stop.value.incident
    assert incident == tmp_path / "run" / INCIDENTS / "step_00000024"  # found at the first check after THAW
    found = events(tmp_path / "run")[0]
    assert found["event"] == "state_nonfinite" and found["found"][0]["tensor"] == "head.bias"
    out = tmp_path / "report.json"
    assert run_cli("replay", incident, "--json", out).code == 1
    report = json.loads(out.read_text())
    assert report["responsible_step"] == gt.THAW
    assert (report["origin"]["stage"], report["origin"]["tensor"]) == ("param", "head.bias")


def test_a_nan_written_after_the_step_before_a_checkpoint_is_never_checkpointed(tmp_path):
    """Where no step follows the NaN written after the step (the last one, here also the one before a checkpoint),
    no skip shows it: the state check, made whenever a checkpoint is due, is the one detector, and the run stops
    before a checkpoint holding it is written. (The check never flagging passed every other test: there the next
    step's NaN gradients stopped the run.)"""
    with pytest.raises(GuardStop) as stop:
        gt.train_flip(tmp_path / "run", 3, at=2, checkpoint_every=3)
    assert stop.value.incident == tmp_path / "run" / INCIDENTS / "step_00000002"
    assert [e["event"] for e in events(tmp_path / "run")] == ["state_nonfinite", "summary"]
    assert not (tmp_path / "run" / "checkpoints" / "step_00000003").exists()


def _flip_from(run: Path, start: int, steps: int, at: int, **options: Any) -> None:
    """``gt.train_flip``'s loop from step ``start`` (a resumed run's numbering): a NaN written after step ``at``."""
    model = gt.build_model()
    optimizer = gt.make_optimizer(model)
    with Recorder(run, model, optimizer, model_factory=gt.build_model, step_fn=gt.flip_step, start_step=start,
                  **options) as rec:
        for step in range(start, start + steps):
            batch = {**gt.make_batch(step, {}), "flip": step == at}
            rec.log(step, batch, gt.flip_step(model, optimizer, batch))


ONE_BATCH = ring_nbytes(snapshot(gt.make_batch(0, {})))


@pytest.mark.parametrize("start, at, options", [
    (0, 2, {"checkpoint_every": 100, "guard": GuardPolicy(ring_bytes=3 * ONE_BATCH)}),
    (7, 9, {"checkpoint_every": 3, "guard": True}),
    (7, 11, {"checkpoint_every": 100, "guard": GuardPolicy(state_check_every=5)})],
    ids=["ring-bytes", "resumed-checkpoint", "resumed-check-every"])
def test_the_state_check_is_due_where_its_policy_says(tmp_path, start, at, options):
    """The state check runs at the step that fills the ring to ``ring_bytes`` (three batches: the checkpoint comes
    early there), and counts ``checkpoint_every`` and ``state_check_every`` from a resumed run's first step: a NaN
    written after that step is found there, the run stopped before any later checkpoint."""
    with pytest.raises(GuardStop) as stop:
        _flip_from(tmp_path / "run", start, 12, at, **options)
    assert stop.value.incident == tmp_path / "run" / INCIDENTS / f"step_{at:08d}"
    assert [e["event"] for e in events(tmp_path / "run")] == ["state_nonfinite", "summary"]
    assert sorted(p.name for p in (tmp_path / "run" / "checkpoints").iterdir()) == [f"step_{start:08d}"]


def test_rollback_restores_the_newest_checkpoint_and_training_goes_on(tmp_path):
    model = gt.train_flip(tmp_path / "run", 40, checkpoint_every=10, guard=GuardPolicy(state_check_every=5, rollback=True))
    assert all(torch.isfinite(p).all() for p in model.parameters())
    log = events(tmp_path / "run")
    assert [(e["event"], e.get("rolled_back_to")) for e in log] == [("rollback", 20), ("summary", None)]
    assert log[-1]["rollbacks"] == [24]


def test_k_bad_batches_in_a_row_stop_and_a_repeated_sample_is_named(tmp_path):
    defects = {5: "inf_input", 9: "inf_input", 10: "inf_input", 11: "inf_input"}
    repeated = gt.make_batch(5, defects)

    def batch(step: int) -> dict:
        return repeated if step == 9 else gt.make_batch(step, defects)  # step 9 feeds step 5's samples again

    model = gt.build_model()
    optimizer = gt.make_optimizer(model)
    rec = Recorder(tmp_path / "run", model, optimizer, model_factory=gt.build_model, step_fn=gt.train_step,
                   checkpoint_every=4, guard=GuardPolicy(max_consecutive=3))
    with pytest.raises(GuardStop, match="3 consecutive steps skipped") as stop:
        for step in range(20):
            rec.log(step, batch(step), gt.train_step(model, optimizer, batch(step)))
    assert step == 11
    assert stop.value.incident == tmp_path / "run" / INCIDENTS / "step_00000011"  # the newest incident, the stop's own
    log = events(tmp_path / "run")
    assert [e["step"] for e in log if e["event"] == "skip"] == [5, 9, 10, 11]
    assert next(e for e in log if e["step"] == 9)["repeats"][0]["step"] == 5
    assert log[-2] == {"event": "stop", "step": 11, "why": "3 consecutive steps skipped (max_consecutive=3)",
                       "incident": f"{INCIDENTS}/step_00000011"}
    assert log[-1]["event"] == "summary"
    assert sorted(p.name for p in (tmp_path / "run" / INCIDENTS).iterdir() if p.is_dir()) == \
        [f"step_{s:08d}" for s in (5, 9, 10, 11)]


def _skipping(run: Path, skips: tuple[int, ...], steps: int, policy: GuardPolicy) -> int:
    """A guarded run of ``steps`` steps whose batches at ``skips`` hold an inf: the step it stopped at (GuardStop), or
    ``steps`` where it ran to the end."""
    defects = {s: "inf_input" for s in skips}
    model = gt.build_model()
    optimizer = gt.make_optimizer(model)
    rec = Recorder(run, model, optimizer, model_factory=gt.build_model, step_fn=gt.train_step, guard=policy)
    try:
        for step in range(steps):
            b = gt.make_batch(step, defects)
            rec.log(step, b, gt.train_step(model, optimizer, b))
    except GuardStop as stop:
        assert f"{len([s for s in skips if s <= step])} of {step + 1} steps skipped, more than max_skip_fraction=" \
            f"{policy.max_skip_fraction}" in str(stop)
        return step
    rec.close()
    return steps


def test_fraction_of_skipped_steps_stops(tmp_path):
    """Judged at each skip from the fraction_after-th step on (2 of 7 at step 6 is not judged yet; 3 of 10 at step 9,
    the tenth, is), and only a fraction above the limit stops: exactly a quarter of the steps skipped at 0.25 goes on."""
    assert _skipping(tmp_path / "a", (2, 6, 9), 12, GuardPolicy(max_skip_fraction=0.2, fraction_after=10)) == 9
    assert _skipping(tmp_path / "b", (3, 7, 11), 12, GuardPolicy(max_skip_fraction=0.25, fraction_after=4)) == 12


def test_fused_adam_skips_on_the_device_and_keeps_its_step_count(tmp_path):
    defects = {7: "inf_input", 12: "overflowing_label"}
    model = gt.train(tmp_path / "run", 20, fused=True, defects=defects, checkpoint_every=5)
    reference = gt.train(None, 20, fused=True, defects=defects, skip=(7, 12))
    for got, want in zip(model.state_dict().values(), reference.state_dict().values()):
        assert torch.equal(got, want)
    assert [e["step"] for e in events(tmp_path / "run") if e["event"] == "skip"] == [7, 12]


def _scaled(tmp: Path, steps: int, bad: dict[int, str], init_scale: float, unscaled: tuple[int, ...] = ()) -> dict:
    """A guarded run under a GradScaler, its step taken plainly at the steps ``unscaled``; the guard's summary."""
    model = gt.build_model()
    optimizer = gt.make_optimizer(model)
    scaler = torch.amp.GradScaler("cpu", init_scale=init_scale)
    rec = Recorder(tmp / "run", model, optimizer, model_factory=gt.build_model, step_fn=gt.train_step,
                   scaler=scaler, guard=True)
    for step in range(steps):
        b = gt.make_batch(step, bad)
        optimizer.zero_grad(set_to_none=True)
        loss = (model(b["x"]) - b["y"]).pow(2).mean()
        if step in unscaled:
            loss.backward()
            optimizer.step()
        else:
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
        rec.log(step, b, loss)
    rec.close()
    assert all(torch.isfinite(p).all() for p in model.parameters())
    return events(tmp / "run")[-1]


def test_grad_scaler_skips_stay_the_scalers(tmp_path):
    summary = _scaled(tmp_path, 8, {3: "inf_input", 6: "inf_input"}, 2.0**16)  # the scaler finds each, skips, backs off
    assert summary["skipped"] == 0 and summary["scaler_skips"] == 2  # each back-off counted


def test_a_step_logged_before_the_scaler_scaled_anything_is_no_scaler_skip(tmp_path):
    """A GradScaler has no scale until it first scales a loss: a step logged before that reads the scale as 1, so
    a scaler that starts at 1 has not backed off."""
    summary = _scaled(tmp_path, 3, {}, 1.0, unscaled=(0,))
    assert summary["skipped"] == 0 and summary["scaler_skips"] == 0


KINDS = ["adamw", "adamw_fused", "sgd", "sgd_fused"]
# every case of the class, listed (72: a huge gradient only for SGD, Adam's square of one overflows its state), the
# poisoned coordinate walking over the parameters from case to case
SKIP_CASES = [(kind, poison, huge, steps_before) for kind in KINDS for poison in (None, math.nan, math.inf, -math.inf)
              for huge in ((False, True) if kind.startswith("sgd") else (False,)) for steps_before in (0, 1, 2)]


@pytest.mark.parametrize("case", range(len(SKIP_CASES)), ids=[f"{k}-{p}-{'huge' if h else 'unit'}-after{s}"
                                                           for k, p, h, s in SKIP_CASES])
def test_any_nonfinite_gradient_skips_bit_for_bit_and_only_then(tmp_path, case):
    """The class: a NaN or an infinity anywhere in any gradient leaves every parameter and optimizer-state tensor (the
    step count included) bit-identical; finite gradients, even ones whose sums overflow (SGD's momentum near float32's
    largest value: the state check's screen, settled exactly), step as without the guard."""
    kind, poison, huge, steps_before = SKIP_CASES[case]
    _skip_case(tmp_path, 7 * case, poison, huge, kind, steps_before, (torch.float32, torch.float32))


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtypes", [(torch.float32, torch.bfloat16), (torch.bfloat16, torch.float32)], ids=str)
def test_a_nan_in_any_dtype_group_skips(tmp_path, kind, dtypes):
    """A model whose layers differ in dtype: the non-finite check runs per (device, dtype) group, and a NaN in the
    first layer's gradient (the first group, not the last) skips the step like one in a model of one dtype."""
    _skip_case(tmp_path, 0, math.nan, False, kind, 1, dtypes)


def _skip_case(tmp: Path, which: int, poison: float | None, huge: bool, kind: str, steps_before: int,
               dtypes: tuple[torch.dtype, torch.dtype]) -> None:
    """Train a guarded model (its two layers in ``dtypes``) and an unguarded twin ``steps_before`` steps, then one
    more with ``poison`` at the gradient coordinate ``which`` (mod their number): the guarded step leaves everything
    as it was and the log names it; without poison both stay equal."""
    torch.manual_seed(0)
    model, twin = (torch.nn.Sequential(torch.nn.Linear(4, 5).to(dtypes[0]), torch.nn.Linear(5, 3).to(dtypes[1]))
                   for _ in range(2))
    twin.load_state_dict(model.state_dict())
    fused = kind.endswith("fused") or None
    opt, twin_opt = ((torch.optim.AdamW(m.parameters(), fused=fused) if kind.startswith("adamw") else
                      torch.optim.SGD(m.parameters(), lr=1e-3, momentum=0.9, fused=fused)) for m in (model, twin))
    scale = 1e38 if huge else 1.0
    rec = Recorder(tmp / "run", model, opt, model_factory=gt.build_model,
                   step_fn=gt.train_step, guard=GuardPolicy(max_consecutive=10, state_check_every=1))

    def grads(m: torch.nn.Module, step: int, last: bool) -> None:
        g = torch.Generator().manual_seed(step)
        for p in m.parameters():
            p.grad = ((torch.rand(p.shape, generator=g) * 2 - 1) * scale).to(p.dtype)
        if last and poison is not None:
            flat = [p.grad.view(-1) for p in m.parameters()]
            sizes = [f.numel() for f in flat]
            i = which % sum(sizes)
            k = next(j for j in range(len(sizes)) if i < sum(sizes[:j + 1]))
            flat[k][i - sum(sizes[:k])] = poison

    for step in range(steps_before + 1):
        last = step == steps_before
        grads(model, step, last)
        grads(twin, step, last)
        before = {k: v.clone() for k, v in model.state_dict().items()}
        state_before = {(id(p), k): v.clone() for p, s in opt.state.items() for k, v in s.items()}
        opt.step()
        if not (last and poison is not None):
            twin_opt.step()
        rec.log(step, {"x": torch.zeros(1)}, 0.0)
        if last and poison is not None:
            assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
            after = {(id(p), k): v for p, s in opt.state.items() for k, v in s.items()}
            assert after.keys() >= state_before.keys()
            assert all(torch.equal(v, state_before[key]) if key in state_before else not v.any()
                       for key, v in after.items())  # a fused step's first call creates zero state, as under a scaler
    rec.close()
    for a, b in zip(model.parameters(), twin.parameters()):
        assert torch.equal(a, b)
    assert events(rec.path)[-1]["skipped_steps"] == ([steps_before] if poison is not None else [])


def test_ddp_and_fsdp2_skip_together_and_the_incident_names_the_rank(tmp_path):
    """torchrun, 2 gloo ranks, the bad batch on rank 1 only: both ranks skip the step (one collective on a flag),
    finish with weights bit-identical to the loop that did not step there, and the incident replays to rank 1. In
    ``flaky``, rank 1's loss alone is NaN at one step: both skip it, the record giving rank 1's reason (rank 0 has
    none); then a NaN written into rank 1's copy of a weight alone stops both ranks at the state check of that step,
    the stop's log naming rank 1's tensor (the screen's flag is all-reduced: without it rank 0 would go on alone).
    Rank 1's disk is slow there, then rank 0's: each rank stops with the incident whole and in place."""
    import distributed_job as job
    import guard_job

    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    p = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                        str(TESTS / "guard_job.py"), str(tmp_path), "ddp", "fsdp2", "flaky"],
                       capture_output=True, text=True, cwd=ROOT, env=env, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    incident = f"{INCIDENTS}/step_{job.FLIP_STEP:08d}"
    assert [json.loads((tmp_path / f"flaky.rank{r}.json").read_text()) for r in range(2)] == [
        {"rank": r, "stopped": job.FLIP_STEP, "incident": incident,
         "refused": "ring_bytes bounds one process's ring; under torchrun bound it in steps (checkpoint_every)",
         # whole and in place as each rank's guard stops, though rank 1 wrote its part late and rank 0 published late
         "in_place": [f"checkpoints/step_{job.FLIP_STEP // job.EVERY * job.EVERY:08d}/meta.json", "incident.json",
                      "manifest.json", "ranks/rank_00000/steps.jsonl", "ranks/rank_00001/steps.jsonl"]}
        for r in range(2)]
    assert sorted(os.listdir(tmp_path / "flaky" / INCIDENTS)) == [
        GUARD_LOG, f"step_{guard_job.LOSS_STEP:08d}", f"step_{job.FLIP_STEP:08d}"]
    skip, stop = events(tmp_path / "flaky")[:2]  # rank 1's NaN loss (its gradients finite): its reason is the record's
    ids = [[f"sample-{job.defect_index(step=guard_job.LOSS_STEP, rank=r, position=i):05d}" for i in range(job.SHARD)]
           for r in range(2)]
    assert skip == {"event": "skip", "step": guard_job.LOSS_STEP, "reason": "loss", "ranks_nonfinite_grad": [1],
                    "grad": None, "loss": "nan", "per_rank": [
                        {"rank": 0, "grad": None, "samples": {"batch['id']": ids[0]}, "nonfinite_inputs": {}},
                        {"rank": 1, "grad": None, "samples": {"batch['id']": ids[1]}, "nonfinite_inputs": {},
                         "reason": "loss", "loss": "nan"}],
                    "incident": f"{INCIDENTS}/step_{guard_job.LOSS_STEP:08d}"}
    assert (stop["event"], stop["step"], stop["incident"]) == ("state_nonfinite", job.FLIP_STEP, incident)
    assert stop["found"] == [None, {"tensor": "fc2.weight", "state": "param", "rank": 1, "index": [0, 0],
                                    "value": "nan"}]
    for how in ("ddp", "fsdp2"):
        results = [json.loads((tmp_path / f"{how}.rank{r}.json").read_text()) for r in range(2)]
        assert sorted(r["rank"] for r in results) == [0, 1] and all(r["finite"] and r["equal"] for r in results), how
        log = events(tmp_path / how)
        skip = next(e for e in log if e["event"] == "skip")
        assert sorted(os.listdir(tmp_path / how / INCIDENTS)) == [GUARD_LOG, f"step_{job.DEFECT_STEP:08d}"]  # no leftovers
        assert (skip["step"], skip["reason"]) == (job.DEFECT_STEP, "gradient")
        # FSDP2's shards are DTensors: the update's proof does not go there, and the log says so
        assert [e["event"] for e in log if e["event"] == "gradient_check_only"] == (["gradient_check_only"] if how ==
                                                                                   "fsdp2" else [])
        # DDP averages the gradients: every rank's is infinite; FSDP2's: rank 0's shard holds row 3, rank 1's is finite
        ranks = [0, 1] if how == "ddp" else [0]
        grad = {"tensor": "features.gain", "index": [3], "value": "inf"}
        assert skip["ranks_nonfinite_grad"] == ranks and skip["grad"] == {**grad, "rank": 0}
        assert skip["per_rank"] == [
            {"rank": r, "grad": {**grad, "rank": r} if r in ranks else None,
             "samples": {"batch['id']": [f"sample-{job.defect_index(rank=r, position=i):05d}" for i in range(job.SHARD)]},
             "nonfinite_inputs": {}, **({"reason": "gradient"} if r in ranks else {})} for r in range(2)]
        out = tmp_path / f"{how}.json"
        result = run_cli("replay", tmp_path / how / INCIDENTS / f"step_{job.DEFECT_STEP:08d}", "--json", out, cwd=ROOT)
        assert result.code == 1, result.stderr
        report = json.loads(out.read_text())
        origin = report["origin"]
        assert (origin["step"], origin["stage"], origin["tensor"], origin["rank"]) == (
            job.DEFECT_STEP, "grad", "features.gain", job.BAD_RANK)
        assert report["samples"]["sample_leaves"] == {"batch['id']": [f"sample-{job.defect_index():05d}"]}


def test_disk_mode_keeps_every_batch_and_still_writes_the_incident(tmp_path):
    defects = {6: "inf_input"}
    gt.train(tmp_path / "run", 10, defects=defects, checkpoint_every=4, batches="disk")
    run = tmp_path / "run"
    assert sorted(p.name for p in (run / "batches").iterdir()) == [f"step_{s:08d}.safetensors" for s in range(10)]
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step_00000000", "step_00000004",
                                                                       "step_00000007", "step_00000008"]
    incident = run / INCIDENTS / "step_00000006"
    assert sorted(p.name for p in (incident / "batches").iterdir()) == ["step_00000004.safetensors",
                                                                        "step_00000005.safetensors",
                                                                        "step_00000006.safetensors"]
    assert (incident / "batches" / "step_00000005.safetensors").read_bytes() == \
        (run / "batches" / "step_00000005.safetensors").read_bytes()


@pytest.mark.parametrize("options, message", [({"batches": "memory"}, "pass guard=True"),
                                              ({"guard": True, "batches": "tape"}, "'disk' or 'memory'"),
                                              ({"guard": GuardPolicy(), "batches": None, "checkpoint_every": 0},
                                               "checkpoint_every")])
def test_settings_are_checked(tmp_path, options, message):
    model = gt.build_model()
    with pytest.raises(ValueError, match=message):
        Recorder(tmp_path / "run", model, gt.make_optimizer(model), model_factory=gt.build_model,
                 step_fn=gt.train_step, **options)
    with pytest.raises(ValueError, match="at least 1"):
        GuardPolicy(max_consecutive=0)


@pytest.mark.parametrize("field, bad, good, message", [
    ("max_consecutive", 0, 1, "max_consecutive, state_check_every and fraction_after must be at least 1"),
    ("state_check_every", 0, 1, "max_consecutive, state_check_every and fraction_after must be at least 1"),
    ("fraction_after", 0, 1, "max_consecutive, state_check_every and fraction_after must be at least 1"),
    ("max_skip_fraction", -0.01, 0.0, "max_skip_fraction must be between 0 and 1"),
    ("max_skip_fraction", 1.01, 1.0, "max_skip_fraction must be between 0 and 1"),
    ("ring_bytes", 0, 1, "ring_bytes must be positive (or None for no byte limit)")])
def test_each_policy_limit_is_refused_past_its_edge_and_taken_at_it(field, bad, good, message):
    """Each setting alone, one past its edge (refused with its own sentence) and at it (taken)."""
    with pytest.raises(ValueError) as refused:
        GuardPolicy(**{field: bad})
    assert str(refused.value) == message
    assert getattr(GuardPolicy(**{field: good}), field) == good
