"""Several optimizers in one step (issue 31): a GAN recorded and replayed, and a run of one optimizer unchanged."""

from __future__ import annotations

import json
import math
import random
import runpy
import shutil
from pathlib import Path
from typing import Any, Mapping

import pytest
import torch
from nanforensics import Recorder
from nanforensics.runs.checkpoint import Checkpoint, save_checkpoint
from nanforensics.runs.optimizers import OptimizerSet, optimizer_set
from nanforensics.runs.run import RUN_FORMAT, Manifest, Run
from torch import nn

import gan
from conftest import ROOT, assert_one_line_error, run_cli


@pytest.fixture(scope="module")
def gan_runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The GAN recorded six ways (tests/gan.py): the huge reading with a dict of optimizers and with a list that
    puts the discriminator's first, and the near-zero reading; each reading again with an LR scheduler per optimizer
    and one GradScaler for both; and the list with the generator's scheduler alone."""
    root = tmp_path_factory.mktemp("gan")
    return {"dict": gan.record_gan(root / "dict"), "list": gan.record_gan(root / "list", as_list=True),
            "near_zero": gan.record_gan(root / "near_zero", fault="near_zero"),
            "scheduled": gan.record_gan(root / "scheduled", scheduled=True, scaler=True),
            "near_zero_amp": gan.record_gan(root / "near_zero_amp", fault="near_zero", scheduled=True, scaler=True),
            "list_scheduled": gan.record_gan(root / "list_scheduled", as_list=True, scheduled=True)}


def _replay(run: Path, *args: str, code: int = 1) -> dict[str, Any]:
    """The JSON report of the CLI's replay; exit code 1 where it found a non-finite value, 0 where clean."""
    result = run_cli("replay", run, "--json", "-", *args)
    assert result.code == code, result.stderr
    return result.json()


@pytest.mark.parametrize("kind, optimizer", [("dict", "discriminator"), ("list", "0")])
def test_replay_names_step_optimizer_tensor_and_coordinate(gan_runs: Mapping[str, Path], kind: str,
                                                           optimizer: str) -> None:
    """The fault makes the discriminator's exp_avg_sq overflow in the faulty feature's column and nothing else
    (tests/gan.py): the report names that step, that optimizer (by name, or by position in a list), tensor, key and
    column, though the logged loss never went NaN."""
    report = _replay(gan_runs[kind])
    origin = report["origin"]
    assert report["verdict"] == "nonfinite" and report["responsible_step"] == gan.FAULT_STEP
    assert (origin["stage"], origin["tensor"], origin["state_key"]) == ("optimizer_state", "discriminator.0.weight",
                                                                        "exp_avg_sq")
    assert origin["index"][1] == gan.FAULT_FEATURE and origin["value"] == "inf"
    assert origin["optimizer"] == optimizer and f"(optimizer {optimizer})" in origin["text"]
    # every event naming a parameter names the optimizer that steps it, and only those
    for e in report["events"]:
        assert e["optimizer"] == ((optimizer if e["tensor"].startswith("discriminator.") else
                                   {"dict": "generator", "list": "1"}[kind])
                                  if e["stage"] in ("grad", "optimizer_grad", "optimizer_state", "param") else None)
    assert report["samples"] is not None and report["operation"]["site"]["phase"] == "optimizer"


def test_the_origin_is_the_first_pass_not_the_first_stage(gan_runs: Mapping[str, Path]) -> None:
    """The near-zero reading: the discriminator's gradient is inf in its own pass, its step makes its gain NaN, and the
    generator's pass in the same step runs forward through it. The origin is that gradient, not the later forward
    (which comes first by stage), and the events follow the passes: the discriminator's update before the forward.
    A what-if acts at each optimizer's step() and says what it did at each: resetting the discriminator's one
    non-finite coordinate (the gain's update NaN-ed it) saves the run; the generator's state had nothing to reset."""
    report = _replay(gan_runs["near_zero"], "--what-if", "reset-state")
    origin = report["origin"]
    assert report["responsible_step"] == gan.FAULT_STEP == report["logged_first_nonfinite_loss_step"]
    assert (origin["stage"], origin["tensor"], origin["index"], origin["optimizer"]) == (
        "grad", "discriminator.0.gain", [gan.FAULT_FEATURE], "discriminator")
    at_fault = [(e["stage"], e["tensor"]) for e in report["events"] if e["step"] == gan.FAULT_STEP]
    assert at_fault.index(("param", "discriminator.0.gain")) < at_fault.index(("forward", "discriminator.0"))
    assert report["operation"]["site"]["phase"] == "backward"
    reset = next(w for w in report["what_if"] if w["intervention"] == "reset-state")
    assert reset["finite"] is True and reset["detail"] == (
        "optimizer discriminator: zeroed the optimizer state of 1 coordinate, put back 1 parameter value; "
        "optimizer generator: zeroed the optimizer state of 0 coordinates, put back 0 parameter values")


def test_the_manual_gan_script_records_and_replays_clean(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The manual's GAN script (docs/recording.md), saved and run as ``python train_gan.py`` runs it (as ``__main__``,
    here in this process: a new one would spend seconds importing torch): a healthy run of two optimizers replays clean from its
    first step, every checkpoint it passes matching the recorded one."""
    block = (ROOT / "docs" / "recording.md").read_text().split("```python\n# train_gan.py")[1].split("```")[0]
    (tmp_path / "train_gan.py").write_text("# train_gan.py" + block)
    monkeypatch.chdir(tmp_path)
    runpy.run_path(str(tmp_path / "train_gan.py"), run_name="__main__")
    run = tmp_path / "runs" / "gan"
    assert json.loads((run / "manifest.json").read_text())["optimizers"]["given"] == "dict"
    result = run_cli("replay", run, "--from-step", "0", "--json", "-", cwd=tmp_path)
    assert result.code == 0, result.stderr
    report = result.json()
    assert report["verdict"] == "clean" and report["origin"] is None and report["reproduced"] is True
    assert (report["setup"]["first_step"], report["setup"]["last_step"]) == (0, 19)
    assert [c["step"] for c in report["checkpoints_compared"]] == [10, 20]
    assert all(c["exact"] for c in report["checkpoints_compared"])


def test_gan_manifest_and_checkpoints_name_every_optimizer(gan_runs: Mapping[str, Path]) -> None:
    manifest = json.loads((gan_runs["dict"] / "manifest.json").read_text())
    assert manifest["format"] == "nanforensics.run/1+optimizers" and "optimizer" not in manifest
    assert manifest["optimizers"] == {"given": "dict", "members": [
        {"name": "generator", "class": "torch.optim.adam:Adam", "factory": "gan:generator_adam"},
        {"name": "discriminator", "class": "torch.optim.adam:Adam", "factory": None}]}
    meta = json.loads((gan_runs["dict"] / "checkpoints" / "step_00000004" / "meta.json").read_text())
    assert meta["group_optimizers"] == ["generator", "discriminator"]
    assert [n.split(".")[0] for n in meta["param_names"]] == ["generator"] * 4 + ["discriminator"] * 4


def test_a_run_of_one_optimizer_reads_as_before(tmp_path: Path, runs: Mapping[str, Path]) -> None:
    """Every shipped sample and a freshly recorded run of one optimizer: the format, manifest keys and checkpoint
    meta of before; replay names no optimizer."""
    for manifest in sorted(ROOT.glob("sample_runs/*/manifest.json")):
        if json.loads(manifest.read_text())["format"] == RUN_FORMAT:
            read = Manifest.read(manifest)
            assert read.optimizers is None and read.optimizer_class is not None, manifest
    run = runs["adam_state_overflow"]
    manifest = json.loads((run / "manifest.json").read_text())
    assert manifest["format"] == RUN_FORMAT and "optimizers" not in manifest and set(manifest["optimizer"]) == {
        "class", "factory"}
    assert all("group_optimizers" not in json.loads((c.path / "meta.json").read_text()) for c in Run(run).checkpoints())
    report = _replay(run)
    assert report["origin"]["stage"] == "optimizer_state" and report["origin"]["optimizer"] is None
    assert "(optimizer" not in report["origin"]["text"]


def test_scan_bisect_repair_and_postmortem_of_a_run_of_several_optimizers(gan_runs: Mapping[str, Path],
                                                                         tmp_path: Path) -> None:
    """The checkpoints of several optimizers read as any: scan and bisect find the discriminator's exp_avg_sq at the
    first checkpoint after the fault; the post-mortem's headline names the step and the optimizer; repair leaves the
    batch out and writes a checkpoint that resumes into the loop's own dict of optimizers, each with its own state,
    finite."""
    run = gan_runs["dict"]
    postmortem = run_cli("postmortem", run, "--json", "-")
    # every unit reads the huge feature: the whole column overflows, and row 0 is its first coordinate
    assert postmortem.code == 1 and postmortem.json()["headline"] == (
        f"non-finite values began at step {gan.FAULT_STEP}: optimizer_state exp_avg_sq of "
        f"discriminator.0.weight[0, {gan.FAULT_FEATURE}] = inf (optimizer discriminator)")
    scan = run_cli("scan", run / "checkpoints" / "step_00000008", "--json", "-").json()
    bad = [t for t in scan["tensors"] if t["nonfinite"]]
    assert scan["verdict"] == "poisoned_optimizer_state"
    assert bad[0]["name"] == "discriminator.0.weight/exp_avg_sq" and bad[0]["first_nonfinite"]["index"][1] == 2
    bisect = run_cli("bisect", run, "--json", "-").json()
    assert (bisect["last_clean"]["step"], bisect["first_poisoned"]["step"]) == (4, 8)
    repaired = run_cli("repair", run, "--out", tmp_path / "repaired", "--json", "-")
    assert repaired.code == 0, repaired.stderr
    report = repaired.json()
    assert report["responsible_step"] == gan.FAULT_STEP and report["verification"]["finite"] is True
    model = gan.build_gan()
    optimizers = {"generator": gan.generator_adam(model), "discriminator": torch.optim.Adam(
        model["discriminator"].parameters())}
    Checkpoint(Path(report["checkpoint"]), report["resume_step"]).load_into(model, optimizers)
    for name, opt in optimizers.items():
        held = [t for s in opt.state.values() for t in s.values()]
        assert held and all(torch.isfinite(t).all() for t in held), name
        assert {n for n, p in model.named_parameters() if p in opt.state} == {
            n for n, _ in model.named_parameters() if n.startswith(name)}


# ---- the state of several optimizers through a checkpoint, on generated sets ----------------------------------------

_KINDS = [lambda ps: torch.optim.Adam(ps, lr=1e-2), lambda ps: torch.optim.AdamW(ps, lr=1e-2),
          lambda ps: torch.optim.SGD(ps, lr=1e-2, momentum=0.9), lambda ps: torch.optim.RMSprop(ps, lr=1e-2),
          lambda ps: torch.optim.Adagrad(ps, lr=1e-2), lambda ps: torch.optim.Adamax(ps, lr=1e-2)]


def _generated(seed: int) -> tuple[nn.Module, Any]:
    """A model of several layers and optimizers over a random split of its parameters (each optimizer one or two
    groups, a random class), as a list or a dict: the same seed builds the same again."""
    rng = random.Random(seed)
    torch.manual_seed(seed)
    model = nn.Sequential(*[nn.Linear(3, 3) for _ in range(rng.randint(2, 4))])
    params = list(model.parameters())
    cuts = sorted(rng.sample(range(1, len(params)), rng.randint(1, min(3, len(params) - 1))))
    shares = [params[a:b] for a, b in zip([0, *cuts], [*cuts, len(params)])]
    opts = []
    for share in shares:
        groups = [{"params": share[:1]}, {"params": share[1:], "lr": 3e-3}] if len(share) > 1 and rng.random() < 0.5 \
            else share
        opts.append(rng.choice(_KINDS)(groups))
    return model, ({f"opt{i}": o for i, o in enumerate(opts)} if rng.random() < 0.5 else opts)


@pytest.mark.parametrize("seed", range(12))
def test_every_optimizers_state_survives_a_checkpoint(tmp_path: Path, seed: int) -> None:
    """Written as one state dict of every member's parameters in turn, read back into freshly built optimizers of
    the same shape: each member's state and groups are its own again, none shifted onto another's parameters."""
    model, given = _generated(seed)
    opts = optimizer_set(given)
    assert isinstance(opts, OptimizerSet)
    for _ in range(2):
        opts.zero_grad()
        model(torch.randn(4, 3)).square().sum().backward()
        for member in opts.members.values():  # as a step function steps them, in turn
            member.step()
    folder = save_checkpoint(tmp_path, 2, model, opts)
    fresh_model, fresh = _generated(seed)
    Checkpoint(folder, 2).load_into(fresh_model, fresh)
    for (name, before), after in zip(opts.members.items(), optimizer_set(fresh).members.values()):
        a, b = before.state_dict(), after.state_dict()
        as_json = json.loads(json.dumps(a["param_groups"]))  # JSON keeps a tuple (Adam's betas) as a list, as for one
        assert as_json == b["param_groups"], name
        assert a["state"].keys() == b["state"].keys(), name
        for i in a["state"]:
            for key, value in a["state"][i].items():
                assert torch.equal(torch.as_tensor(value), torch.as_tensor(b["state"][i][key])), (name, i, key)


# ---- what a run of several optimizers cannot be, refused up front ----------------------------------------------------

def _gan_parts() -> tuple[nn.Module, dict[str, torch.optim.Optimizer]]:
    model = gan.build_gan()
    return model, {"generator": gan.generator_adam(model), "discriminator": torch.optim.Adam(
        model["discriminator"].parameters())}


def test_recorder_refuses_what_several_optimizers_do_not_support(tmp_path: Path) -> None:
    model, opts = _gan_parts()
    with pytest.raises(ValueError, match="guard is not supported with several optimizers"):
        Recorder(tmp_path / "run", model, opts, model_factory=gan.build_gan, step_fn=gan.train_step_gan, guard=True)
    assert not (tmp_path / "run").exists()


def test_recorder_refuses_schedulers_not_one_per_optimizer(tmp_path: Path) -> None:
    """The schedulers of several optimizers come shaped like them, each with its factory, each over its own
    optimizer: else replay would build another schedule than the loop's."""
    model, opts = _gan_parts()
    own = {"generator": gan.generator_steps(opts["generator"]), "discriminator": gan.discriminator_cosine(
        opts["discriminator"])}
    factories = {"generator": gan.generator_steps, "discriminator": gan.discriminator_cosine}
    for schedulers, made, error, needle in (
            (own["generator"], gan.generator_steps, TypeError, "scheduler for several optimizers must be None or shaped"),
            (own, [gan.generator_steps, gan.discriminator_cosine], TypeError, "scheduler_factory for several"),
            ({**own, "discriminator": None}, factories, ValueError, "optimizer discriminator: pass its scheduler and"),
            ({"generator": own["discriminator"], "discriminator": own["generator"]}, factories, ValueError,
             "the scheduler given for optimizer generator schedules another optimizer")):
        with pytest.raises(error, match=needle):
            Recorder(tmp_path / "run", model, opts, model_factory=gan.build_gan, step_fn=gan.train_step_gan_scheduled,
                     scheduler=schedulers, scheduler_factory=made)
    assert not (tmp_path / "run").exists()


def test_each_optimizers_scheduler_and_a_shared_scaler_replay_bit_exact(gan_runs: Mapping[str, Path]) -> None:
    """The GAN with a StepLR on the generator, a cosine on the discriminator and one GradScaler for both (torch's
    pattern: ``scaler.step`` each, one ``update``): the manifest names each scheduler's factory in its optimizer's
    entry, each checkpoint holds both schedules by optimizer; replayed from the first step, every checkpoint matches
    bit for bit (a schedule not restored, or restored onto the other optimizer, changes the Adam updates) and the
    huge reading is found where it was, under the scaler too."""
    run = gan_runs["scheduled"]
    manifest = json.loads((run / "manifest.json").read_text())
    assert "scheduler" not in manifest and manifest["scaler"] == {"enabled": True}
    assert [m.get("scheduler") for m in manifest["optimizers"]["members"]] == [
        {"factory": "gan:generator_steps"}, {"factory": "gan:discriminator_cosine"}]
    meta = json.loads((run / "checkpoints" / "step_00000004" / "meta.json").read_text())
    assert meta["scheduler"]["generator"]["step_size"] == 3 and meta["scheduler"]["discriminator"]["T_max"] == gan.STEPS
    report = _replay(run, "--from-step", "0")
    assert report["reproduced"] is True and report["responsible_step"] == gan.FAULT_STEP
    assert [(c["step"], c["exact"]) for c in report["checkpoints_compared"]] == [(4, True), (8, True)]
    origin = report["origin"]
    assert (origin["stage"], origin["tensor"], origin["state_key"], origin["optimizer"]) == (
        "optimizer_state", "discriminator.0.weight", "exp_avg_sq", "discriminator")


def test_a_scheduler_for_one_optimizer_of_a_list(gan_runs: Mapping[str, Path]) -> None:
    """``scheduler=[None, StepLR(g_opt)]`` beside ``optimizer=[d_opt, g_opt]``: the manifest names a scheduler for
    optimizer 1 alone, the checkpoints hold its schedule alone, and replay gives the step function the list as the
    loop did (None first): bit-exact from the first step, the generator's rate halved every three steps."""
    run = gan_runs["list_scheduled"]
    members = json.loads((run / "manifest.json").read_text())["optimizers"]["members"]
    assert [m.get("scheduler") for m in members] == [None, {"factory": "gan:generator_steps"}]
    meta = json.loads((run / "checkpoints" / "step_00000008" / "meta.json").read_text())
    assert list(meta["scheduler"]) == ["1"] and meta["scheduler"]["1"]["_last_lr"] == [1e-3 * 0.5 ** 2]
    report = _replay(run, "--from-step", "0")
    assert report["reproduced"] is True and report["responsible_step"] == gan.FAULT_STEP
    assert [(c["step"], c["exact"]) for c in report["checkpoints_compared"]] == [(4, True), (8, True)]


def test_a_shared_scaler_catches_the_overflow_of_one_optimizer_while_the_other_steps(gan_runs: Mapping[str, Path]) -> None:
    """The near-zero reading under the shared scaler: the discriminator's gradient is inf, so ``scaler.step`` skips
    the discriminator's update while the generator's, finite, steps, and ``update`` backs off. Nothing non-finite
    outlives the step: the scaler caught it (a skip of one optimizer of several is a skip), and the run is clean."""
    report = _replay(gan_runs["near_zero_amp"], "--from-step", "0", code=0)
    assert report["verdict"] == "clean" and report["origin"] is None and report["reproduced"] is True
    assert all(c["exact"] for c in report["checkpoints_compared"])
    steps = {s["step"]: s for s in report["amp"]["steps"]}
    assert [s for s, v in steps.items() if v["skipped"]] == [gan.FAULT_STEP] and steps[gan.FAULT_STEP]["caught"]
    assert steps[gan.FAULT_STEP]["next_scale"] == steps[gan.FAULT_STEP]["scale"] / 2
    assert [e["step"] for e in report["amp"]["caught"]] == [gan.FAULT_STEP]


def test_recorder_refuses_a_parameter_in_two_optimizers_and_misshaped_factories(tmp_path: Path) -> None:
    model, opts = _gan_parts()
    with pytest.raises(ValueError, match="stepped by optimizers generator and everything"):
        Recorder(tmp_path / "a", model, {**opts, "everything": torch.optim.SGD(model.parameters(), lr=0.1)},
                 model_factory=gan.build_gan, step_fn=gan.train_step_gan)
    with pytest.raises(TypeError, match="shaped like optimizer="):
        Recorder(tmp_path / "b", model, opts, model_factory=gan.build_gan, step_fn=gan.train_step_gan,
                 optimizer_factory=[gan.generator_adam, None])
    for given, needle in (([], "not an empty list"), ({}, "needs at least one"), ((opts["generator"], "adam"),
                                                                                  "optimizer 1 is a str")):
        with pytest.raises(TypeError, match=needle):
            Recorder(tmp_path / "c", model, given, model_factory=gan.build_gan, step_fn=gan.train_step_gan)
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists() and not (tmp_path / "c").exists()


@pytest.mark.parametrize("damage, needle", [
    (lambda m: m.update(scheduler={"factory": "gan:generator_steps"}), "scheduler beside optimizers"),
    (lambda m: m["optimizers"]["members"][0].update(scheduler={"factory": 3}),
     "optimizers.members.0.scheduler.factory 3 is not an import string"),
    (lambda m: m.update(distributed={"world_size": 2}), "distributed is not supported with several"),
    (lambda m: m["optimizers"]["members"][1].update(name="generator"), "are not distinct non-empty names"),
    (lambda m: m["optimizers"].update(given="set"), "optimizers.given 'set' is not one of"),
    (lambda m: m["optimizers"]["members"][0].pop("class"), "field optimizers.members.0.class is missing")])
def test_a_damaged_manifest_of_several_optimizers_is_one_line(gan_runs: Mapping[str, Path], tmp_path: Path,
                                                              damage: Any, needle: str) -> None:
    run = tmp_path / "run"
    shutil.copytree(gan_runs["dict"], run)
    manifest = json.loads((run / "manifest.json").read_text())
    damage(manifest)
    (run / "manifest.json").write_text(json.dumps(manifest))
    assert_one_line_error(run_cli("replay", run), "manifest.json", needle)


def test_a_checkpoint_without_each_optimizers_schedule_is_one_line(gan_runs: Mapping[str, Path], tmp_path: Path) -> None:
    """A checkpoint whose ``scheduler`` lacks one optimizer's schedule cannot restore the run's schedulers: refused in
    one line naming meta.json and the optimizers each side holds, before any step."""
    run = tmp_path / "run"
    shutil.copytree(gan_runs["scheduled"], run)
    for meta_file in (run / "checkpoints").glob("*/meta.json"):
        meta = json.loads(meta_file.read_text())
        del meta["scheduler"]["discriminator"]
        meta_file.write_text(json.dumps(meta))
    assert_one_line_error(run_cli("replay", run, "--from-step", "0"), "meta.json", "scheduler state does not fit",
                          "schedulers of optimizers ['generator'], the run's are ['discriminator', 'generator']")


def test_a_checkpoint_of_other_optimizers_is_one_line(gan_runs: Mapping[str, Path], tmp_path: Path) -> None:
    run = tmp_path / "run"
    shutil.copytree(gan_runs["dict"], run)
    for meta_file in (run / "checkpoints").glob("*/meta.json"):
        meta = json.loads(meta_file.read_text())
        meta["group_optimizers"] = ["discriminator", "generator"]
        meta_file.write_text(json.dumps(meta))
    assert_one_line_error(run_cli("replay", run, "--from-step", "0"), "meta.json", "belong to optimizers")


# ---- the monitor over passes: what a pass checked is read again only when written since ----------------------------

@pytest.mark.parametrize("locate", [False, True])
@pytest.mark.parametrize("fault", [None, "after_step", "lr"])
def test_each_update_is_checked_once(locate: bool, fault: str | None) -> None:
    """Two optimizers step in turn. ``after_step``: both update finite values, then the step function rescales the
    first network's weight by a norm that is 0 (weight normalisation of an all-zero row): its 4 entries turn
    non-finite after the pass that checked them, and the step's end reads the weight again since it was written.
    ``lr``: the first optimizer's learning rate is inf, its own update makes the weight non-finite, found right
    after that pass and not counted again at the end, which finds it unchanged."""
    from nanforensics.replay.monitor import StepMonitor

    torch.manual_seed(0)
    model = nn.ModuleDict({"a": nn.Linear(4, 1, bias=False), "b": nn.Linear(1, 1)})
    opts = optimizer_set([torch.optim.SGD(model["a"].parameters(), lr=math.inf if fault == "lr" else 0.1),
                          torch.optim.SGD(model["b"].parameters(), lr=0.1)])
    x = torch.ones(2, 4)
    with StepMonitor(model, opts) as monitor:
        monitor.begin(0, x, locate)
        member = opts.members["0"]
        member.zero_grad()
        model["b"](model["a"](x)).square().mean().backward()
        member.step()
        member = opts.members["1"]
        member.zero_grad()
        loss = model["b"](torch.ones(2, 1)).square().mean()  # the second network on its own input: it stays finite
        loss.backward()
        member.step()
        if fault == "after_step":
            with torch.no_grad():
                w = model["a"].weight
                w.div_(w.mul(0).norm())  # the row's norm, 0: every entry 0/0 or x/0
        events = monitor.end(loss)
    params = [e for e in events if e.stage == "param"]
    assert [(e.tensor, e.optimizer) for e in params] == ([("a.weight", "0")] if fault else [])
    if locate and fault:
        assert params[0].elements_nonfinite == 4 and params[0].tensors_nonfinite == 1


# (locate, defer): locate mode; detect mode reading each verdict at once (the CPU's); detect mode deferring them to the
# step's end (a GPU's, exercised on the CPU)
_MODES = [(True, None), (False, None), (False, True)]
_RATES = [lambda ps, lr: torch.optim.SGD(ps, lr=lr), lambda ps, lr: torch.optim.SGD(ps, lr=lr, momentum=0.9),
          lambda ps, lr: torch.optim.Adam(ps, lr=lr), lambda ps, lr: torch.optim.RMSprop(ps, lr=lr)]


@pytest.mark.parametrize("seed", range(16))
def test_the_origin_is_the_pass_that_made_it_on_generated_steps(seed: int) -> None:
    """Generated steps of 2-4 optimizers, each owning one layer of a chain; every pass runs the whole chain forward
    and backward and steps one optimizer. Optimizer ``k``'s learning rate is inf: its own update makes its layer
    non-finite, and every later pass runs forward through it. The origin, in locate and in detect mode (its verdicts
    read at once, or deferred to the step's end as on a GPU), is that layer's update (stage ``param``, optimizer
    ``k``), never a later pass's forward, which ranks first by stage."""
    from nanforensics.replay.monitor import StepMonitor

    for locate, defer in _MODES:
        rng = random.Random(seed)  # the same step for each mode, from scratch
        torch.manual_seed(seed)
        n = rng.randint(2, 4)
        k = rng.randrange(n - 1)  # a later pass runs through the broken layer
        model = nn.ModuleDict({f"l{i}": nn.Linear(3, 3) for i in range(n)})
        members = [rng.choice(_RATES)(model[f"l{i}"].parameters(), math.inf if i == k else 1e-2) for i in range(n)]
        names = [f"net{i}" for i in range(n)] if rng.random() < 0.5 else [str(i) for i in range(n)]
        opts = optimizer_set(dict(zip(names, members)) if names[0] == "net0" else members)
        x = torch.randn(5, 3)
        with StepMonitor(model, opts, defer=defer) as monitor:
            monitor.begin(0, x, locate)
            for member in members:
                member.zero_grad()
                h = x
                for i in range(n):
                    h = model[f"l{i}"](h)
                loss = h.square().mean()
                loss.backward()
                member.step()
            events = monitor.end(loss)
        origin = events[0]
        assert (origin.stage, origin.tensor.split(".")[0], origin.optimizer) == ("param", f"l{k}", names[k]), (
            locate, [(e.stage, e.tensor) for e in events])
        assert any(e.stage == "forward" for e in events)  # the later passes did run through it


@pytest.mark.parametrize("seed", range(8))
def test_a_loss_made_before_the_first_update_is_the_origin_on_generated_steps(seed: int) -> None:
    """Generated steps of 2-4 optimizers, each owning one layer of a chain, stepping in turn after one backward (the
    oracle's programs of two). The loss overflows outside any module (``exp`` of a finite output): it is inf, and
    every gradient and update after it non-finite. The loss was computed in the first pass, before any gradient,
    and is the origin in locate and detect mode (each way), though the monitor reads it at the step's end, after every
    optimizer stepped: it ranks in the pass the model last ran forward in (oracle seed 60099)."""
    from nanforensics.replay.monitor import StepMonitor

    for locate, defer in _MODES:
        rng = random.Random(seed)
        torch.manual_seed(seed)
        n = rng.randint(2, 4)
        model = nn.Sequential(*[nn.Linear(3, 3) for _ in range(n)])
        members = [rng.choice(_RATES)(model[i].parameters(), 1e-2) for i in range(n)]
        opts = optimizer_set(members)
        x = torch.randn(5, 3)
        with StepMonitor(model, opts, defer=defer) as monitor:
            monitor.begin(0, x, locate)
            opts.zero_grad()
            loss = torch.exp(model(x).abs() + 100).mean()  # exp(100) and more: past float32's largest
            loss.backward()
            for member in members:
                member.step()
            events = monitor.end(loss)
        assert not [e for e in events if e.stage == "forward"]
        assert (events[0].stage, events[0].value if locate else "inf") == ("loss", "inf"), (
            locate, [(e.stage, e.tensor) for e in events])
        assert [e.stage for e in events][1] == "grad"
