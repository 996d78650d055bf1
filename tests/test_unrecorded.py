"""Replays of runs nobody recorded: training scripts written without the recorder, saving checkpoints the way users
do (``torch.save`` dicts every N steps, a Hugging Face Trainer with ``save_steps``), replayed from those checkpoints
with the script's own callables and batch function, and compared with the recorder's replay of the same run."""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from nanforensics.errors import BadInput
from nanforensics.formats.training_state import load_model, load_optimizer
from nanforensics.postmortem import postmortem
from nanforensics.replay.engine import ReplayOptions
from nanforensics.replay.unrecorded import replay_checkpoint
from safetensors.torch import save_file

import plain_training
import scenarios
from conftest import DEFECT_STEP, ROOT, assert_one_line_error, run_cli, tree_digest

PLAIN = "tests/plain_training.py"  # as a user names their script, from the checkout's root
QUICK = ReplayOptions(explain=False, max_steps=3)  # library-level checks of the loading, not of the diagnosis
assert plain_training.DEFECT_STEP == DEFECT_STEP  # the twin of the recorded scenario


@pytest.fixture(scope="module")
def plain(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Checkpoints of steps 0, 10 and 20 of the seed scenario, saved by a plain loop: 20 is poisoned."""
    out = tmp_path_factory.mktemp("plain") / "ckpts"
    plain_training.train(out)
    return out


def cli_json(*args: str | Path) -> tuple[int, dict]:
    result = run_cli(*args, "--json", "-", cwd=ROOT)
    assert result.code in (0, 1, 3, 4), result.stderr
    return result.code, result.json()


def test_replay_from_a_torch_save_checkpoint_names_what_the_recorded_replay_names(plain, runs):
    before = tree_digest(plain)
    what_if = ("--what-if", "skip-after-moments", "--what-if", "drop-samples=5")
    code, r = cli_json("replay", "--checkpoint", plain / "step_000010.pt", "--code", PLAIN, *what_if)
    assert tree_digest(plain) == before, "replay wrote beside the checkpoints"
    assert code == 1 and r["verdict"] == "nonfinite" and r["responsible_step"] == DEFECT_STEP
    _, recorded = cli_json("replay", runs["adam_near_zero"], *what_if)  # the same run, recorded
    for key in ("responsible_step", "origin", "events", "first_nonfinite_loss_step", "fully_nonfinite_step",
                "state_poisoned", "what_if"):
        assert r[key] == recorded[key], key
    # the recorded replay's rewind reaches back to its older checkpoint (step 0) for PRECURSOR_STEPS of precursors;
    # a single --checkpoint has none older, so its precursors start there, and equal the recorded ones from there
    assert r["precursors"][0]["step"] == 10
    assert r["precursors"] == [p for p in recorded["precursors"] if p["step"] >= 10]
    assert (r["samples"]["samples"], r["samples"]["sample_leaves"]) == ([scenarios.DEFECT_SAMPLE],
                                                                        {"batch['ids']": ["s00017-05"]})
    assert r["samples"] == recorded["samples"]
    assert [(w["intervention"], w["finite"]) for w in r["what_if"]] == [
        ("none", False), ("skip-after-moments", False), ("drop-samples=5", True)]
    assert r["operation"] == recorded["operation"]
    assert r["responsible_batch"]["file"] == f"{PLAIN}:batch_at({DEFECT_STEP})"
    assert r["responsible_batch"]["leaves"] == recorded["responsible_batch"]["leaves"]
    # bit-exact: the replayed losses are the losses the recorder logged for the same steps
    logged = {s["step"]: s["logged_loss"] for s in recorded["spread"]}
    assert [s["replayed_loss"] for s in r["spread"]] == [logged[s["step"]] for s in r["spread"]]
    assert all(s["logged_loss"] is None for s in r["spread"])
    # nothing logged: no claim about reproduction, and the loss the training log showed NaN is named
    assert r["reproduced"] is None and r["logged_first_nonfinite_loss_step"] is None
    assert any("cannot be judged" in f for f in r["findings"])
    assert not any("not reproduced from the supplied batches" in f for f in r["findings"])
    assert any("first shows NaN at step 18" in f and "not step 18's" in f for f in r["findings"])
    loaded = r["loaded"]
    assert (loaded["layout"], loaded["step"], loaded["step_from"]) == ("torch.save dict", 10, "metadata")
    assert (loaded["optimizer_matched"], loaded["optimizer_params"], loaded["same_shape_params"]) == ("order", 7, 2)
    assert (loaded["scheduler"], loaded["rng_restored"], loaded["random_modules"]) == ("none", [], [])
    assert any("matched to the parameters by order" in f and "2 of 7 parameters share" in f for f in r["findings"])
    assert any("RNG state was not restored (the checkpoint holds no RNG state)" in f and "no dropout" in f
               for f in r["findings"])
    assert any("needs --from-step 11" in f for f in r["findings"])


def test_bisect_with_code_replays_from_the_last_clean_checkpoint(plain):
    code, r = cli_json("bisect", plain, "--code", PLAIN)
    assert code == 1
    assert (r["last_clean"]["step"], r["first_poisoned"]["step"]) == (10, 20)
    replayed = r["replayed"]
    assert replayed["responsible_step"] == DEFECT_STEP and replayed["loaded"]["step"] == 10
    assert (replayed["origin"]["tensor"], replayed["origin"]["index"]) == ("features.gain", [scenarios.DEFECT_FEATURE])
    assert replayed["samples"]["samples"] == [scenarios.DEFECT_SAMPLE]
    assert replayed["setup"]["last_step"] <= 21  # the window to the poisoned checkpoint, and a step past it


def test_postmortem_of_the_folder_points_to_bisect_with_code(plain):
    r = postmortem(plain)
    assert (r.kind, r.verdict, r.window.first, r.window.last) == ("checkpoints", "nonfinite", 10, 19)
    assert any(f"nanforensics bisect {plain} --code train.py" in f for f in r.findings)


def test_batches_without_the_defect_do_not_reproduce_it(plain):
    code, r = cli_json("bisect", plain, "--code", PLAIN, "--batches", "batch_without_defect")
    replayed = r["replayed"]
    assert code == 3 and replayed["verdict"] == "not_reproduced" and replayed["origin"] is None
    assert replayed["setup"]["last_step"] == 21
    assert "The checkpoint at step 20 holds non-finite values" in replayed["findings"][0]
    assert "not reproduced from the supplied batches" in replayed["findings"][0]
    # with no poisoned checkpoint to contradict it, a clean replay is clean, and says what it cannot judge
    report = replay_checkpoint(plain / "step_000010.pt", PLAIN, {"batches": "batch_without_defect"}, QUICK)
    assert (report.verdict, report.reproduced, report.setup.last_step) == ("clean", None, 12)
    assert any("cannot be judged" in f and "not reproduced from the supplied batches" in f for f in report.findings)


def test_optimizer_state_saved_with_names_is_matched_by_name(tmp_path, plain):
    plain_training.train(tmp_path, steps=11, named=True)
    by_name = replay_checkpoint(tmp_path / "step_000010.pt", PLAIN, {"optimizer": "make_named_optimizer"}, QUICK)
    by_order = replay_checkpoint(plain / "step_000010.pt", PLAIN, None, QUICK)
    assert (by_name.loaded.optimizer_matched, by_order.loaded.optimizer_matched) == ("name", "order")
    # the same state in the same places, whichever way it was matched: equal losses, bit for bit
    assert [s.replayed_loss for s in by_name.spread] == [s.replayed_loss for s in by_order.spread]
    assert not any("by order" in f for f in by_name.findings)


def test_rng_state_in_the_checkpoint_replays_dropout_exactly(tmp_path):
    with_rng, without = tmp_path / "rng", tmp_path / "none"
    losses = plain_training.train(with_rng, steps=14, rng=True, dropout=True)
    plain_training.train(without, steps=11, dropout=True)
    names = {"model": "build_model_with_dropout"}
    restored = replay_checkpoint(with_rng / "step_000010.pt", PLAIN, names, QUICK)
    assert restored.loaded.rng_restored == ["torch"] and restored.loaded.random_modules == ["act.1"]
    assert [s.replayed_loss for s in restored.spread] == losses[10:13]  # the training's dropout masks
    assert not any("RNG state was not restored" in f for f in restored.findings)
    seeded = replay_checkpoint(without / "step_000010.pt", PLAIN, names, QUICK)
    assert seeded.loaded.rng_restored == []
    assert [s.replayed_loss for s in seeded.spread] != losses[10:13]
    assert any("RNG state was not restored" in f and "dropout (act.1)" in f and "not the run's" in f
               for f in seeded.findings)


def test_loading_by_name_through_a_wrapper_prefix_tied_weights_and_fqn_keyed_state():
    """The decoder ties its head to its embedding; saved from torch.compile's wrapper with the tie saved once, and
    its AdamW state keyed by names, it loads into a fresh model whose optimizer lists the parameters reversed."""
    trained = scenarios.build_decoder()
    optimizer = torch.optim.AdamW(trained.parameters(), lr=1e-3)
    scenarios.train_step_lm(trained, optimizer, scenarios.make_token_batch(0))
    names = {id(p): n for n, p in trained.named_parameters()}
    saved = optimizer.state_dict()
    order = [names[id(p)] for p in optimizer.param_groups[0]["params"]]
    by_fqn = {"state": {order[i]: st for i, st in saved["state"].items()},
              "param_groups": [{**saved["param_groups"][0], "params": order}]}
    model_sd = {f"_orig_mod.{k}": v for k, v in trained.state_dict().items() if k != "head.weight"}

    model = scenarios.build_decoder()
    assert load_model(model, model_sd, Path("ckpt"), "build_decoder") == "_orig_mod."
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), trained.state_dict().values()))
    fresh = torch.optim.AdamW(list(reversed(list(model.parameters()))), lr=1e-3)
    assert load_optimizer(model, fresh, by_fqn, Path("ckpt"), "make_optimizer") == ("name", 0)
    for n, p in model.named_parameters():
        original = optimizer.state[dict(trained.named_parameters())[n]]
        assert torch.equal(fresh.state[p]["exp_avg_sq"], original["exp_avg_sq"]), n
    with pytest.raises(BadInput, match="'tok.weight' is torch.float16, the model build_decoder builds holds "
                                       "torch.float32"):
        load_model(scenarios.build_decoder(), {k: v.half() for k, v in trained.state_dict().items()}, Path("ckpt"),
                   "build_decoder")


def test_code_inside_the_checkpoint_folder_is_refused_unless_trusted(plain, tmp_path):
    """A Trainer-style folder (weights, optimizer.pt, trainer_state.json) that ships a script of its own."""
    state = torch.load(plain / "step_000010.pt", weights_only=True)
    folder = tmp_path / "checkpoint-10"
    folder.mkdir()
    save_file(state["model"], folder / "model.safetensors")
    torch.save(state["optimizer"], folder / "optimizer.pt")
    (folder / "trainer_state.json").write_text(json.dumps({"global_step": 10}))
    shutil.copy(ROOT / PLAIN, folder / "train.py")
    with pytest.raises(BadInput, match="train.py.* lies inside the run directory.*--trust-run-dir"):
        replay_checkpoint(folder, str(folder / "train.py"), None, QUICK)
    trusted = replay_checkpoint(folder, str(folder / "train.py"), None, replace(QUICK, trust_run_dir=True))
    assert (trusted.loaded.step, trusted.loaded.step_from) == (10, "trainer_state.json")
    assert trusted.loaded.layout == "folder of model.safetensors, optimizer.pt, trainer_state.json"
    by_file = replay_checkpoint(plain / "step_000010.pt", PLAIN, None, QUICK)
    assert [s.replayed_loss for s in trusted.spread] == [s.replayed_loss for s in by_file.spread]


def test_a_batch_function_must_give_the_same_batch_every_time_and_not_an_empty_one(plain):
    with pytest.raises(BadInput, match="returned another batch for step 10 when asked again"):
        replay_checkpoint(plain / "step_000010.pt", PLAIN, {"batches": "batch_unseeded"}, QUICK)
    with pytest.raises(BadInput, match="returned an empty batch for step 12 .past the end of the data"):
        replay_checkpoint(plain / "step_000010.pt", PLAIN, {"batches": "batch_from_a_short_file"}, QUICK)


@pytest.mark.parametrize("args, needles", [
    (["--code", "tests/scenarios.py"], ["tests/scenarios.py: defines no batch_at, make_optimizer",
                                        "--batches NAME, --optimizer NAME"]),
    (["--code", PLAIN, "--model", "build_other_model"], ["defines no build_other_model"]),
    (["--code", PLAIN, "--optimizer", "make_sgd"], ["optimizer state holds hyperparameters amsgrad, betas",
                                                    "another optimizer class saved it"]),
    (["--code", PLAIN, "--from-step", "-1"], ["step -1 is negative"]),
    (["--model", "build_model"], ["--model", "give the script with --code"]),
])
def test_wrong_code_is_a_one_line_error(plain, args, needles):
    assert_one_line_error(run_cli("replay", "--checkpoint", plain / "step_000010.pt", *args, cwd=ROOT), *needles)


def test_checkpoints_that_cannot_be_loaded_say_why(plain, tmp_path, runs):
    """A poisoned checkpoint, a model that does not fit by name, a file with no optimizer state, a recorded run:
    one line each."""
    poisoned = run_cli("replay", "--checkpoint", plain / "step_000020.pt", "--code", PLAIN, cwd=ROOT)
    assert_one_line_error(poisoned, "already holds non-finite values", "nanforensics bisect")
    state = torch.load(plain / "step_000010.pt", weights_only=True)
    torch.save({**state, "model": {**state["model"], "extra.weight": torch.zeros(2)}}, tmp_path / "extra_10.pt")
    torch.save({"model": state["model"], "step": 10}, tmp_path / "weights_10.pt")
    for path, names, needle in [
        (tmp_path / "extra_10.pt", None, "model state does not match the model tests/plain_training.py:build_model "
                                         "builds, by name: unexpected extra.weight"),
        (plain / "step_000010.pt", {"model": "build_batchnorm_model"}, "missing norm.weight, norm.bias"),
        (tmp_path / "weights_10.pt", None, "holds no optimizer state dict"),
        (runs["clean"], None, "is a run recorded by nanforensics: replay it with `nanforensics replay"),
    ]:
        with pytest.raises(BadInput, match=needle):
            replay_checkpoint(path, PLAIN, names, QUICK)


def test_hugging_face_trainer_checkpoints(tmp_path):
    pytest.importorskip("transformers", reason="transformers is not installed (nanforensics[hf])")
    pytest.importorskip("accelerate", reason="accelerate is not installed (nanforensics[hf])")
    import hf_training
    import integration_models as models

    out = tmp_path / "trainer_out"
    hf_training.main(out)
    assert sorted(p.name for p in out.iterdir()) == ["checkpoint-12", "checkpoint-4", "checkpoint-8"]
    code, r = cli_json("replay", "--checkpoint", out / "checkpoint-4", "--code", "tests/hf_training.py",
                       "--scheduler", "make_scheduler")
    assert code == 1 and r["responsible_step"] == models.DEFECT_STEP
    assert (r["origin"]["tensor"], r["origin"]["index"]) == ("net.features.gain", [scenarios.DEFECT_FEATURE])
    assert r["samples"]["samples"] == [scenarios.DEFECT_SAMPLE]
    loaded = r["loaded"]
    assert "optimizer.pt" in loaded["layout"] and loaded["step_from"] == "trainer_state.json"
    assert (loaded["optimizer_matched"], loaded["same_shape_params"], loaded["scheduler"]) == ("order", 2, "restored")
    assert loaded["rng_restored"] == [] and "rng_state.pth was not loaded" in loaded["rng_missing"]
    assert "numpy" in loaded["rng_missing"]
    assert not any("--from-step" in f for f in r["findings"])  # the Trainer's global_step counts steps taken
    # the Trainer's own log of the window up to the responsible step: the replay is the run, bit for bit (where
    # transformers logs the loss unrounded; versions before 5 round it to 4 digits)
    history = json.loads((out / "checkpoint-12" / "trainer_state.json").read_text())["log_history"]
    trainer = {h["step"] - 1: h["loss"] for h in history if "loss" in h}
    replayed = {s["step"]: s["replayed_loss"] for s in r["spread"]}
    assert all(trainer[s] in (replayed[s], round(replayed[s], 4)) for s in range(4, models.DEFECT_STEP + 1))

    code, b = cli_json("bisect", out, "--code", "tests/hf_training.py")  # without the scheduler factory
    assert code == 1 and (b["last_clean"]["step"], b["first_poisoned"]["step"]) == (4, 8)
    assert b["replayed"]["responsible_step"] == models.DEFECT_STEP
    assert b["replayed"]["loaded"]["scheduler"] == "unused"
    assert any("no scheduler factory was named" in f for f in b["replayed"]["findings"])


def test_an_accelerate_save_state_folder_loads_as_the_torch_save_file_does(plain, tmp_path):
    pytest.importorskip("accelerate", reason="accelerate is not installed (nanforensics[hf])")
    plain_training.train_accelerate(tmp_path)
    folder = tmp_path / "step_000010"
    report = replay_checkpoint(folder, PLAIN, None, QUICK)
    loaded = report.loaded
    assert loaded.layout == "folder of model.safetensors, optimizer.bin, random_states_0.pkl"
    assert (loaded.step, loaded.step_from, loaded.optimizer_matched) == (10, "name", "order")
    assert loaded.rng_restored == [] and "random_states_0.pkl was not loaded" in loaded.rng_missing
    by_file = replay_checkpoint(plain / "step_000010.pt", PLAIN, None, QUICK)  # the same state, saved by torch.save
    assert [s.replayed_loss for s in report.spread] == [s.replayed_loss for s in by_file.spread]


# ---- the stages and verdicts of a recorded replay, from a checkpoint ----------------------------------------------

LOSS_ONLY = "but no gradient, parameter, optimizer-state or buffer value was: the non-finite loss never reached the model"


def _start(tmp_path: Path, build: str) -> Path:
    """The state before step 0 of a loop that trains ``build``'s model with AdamW, saved as users save it."""
    model = getattr(plain_training, build)()
    optimizer = plain_training.make_adamw(model)
    path = tmp_path / "step_000000.pt"
    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "step": 0}, path)
    return path


def test_a_loss_that_never_reaches_the_model_is_loss_only(tmp_path):
    """Every label -100 at step 2: a NaN loss, zero gradients, exit 4, as on a recorded run."""
    start, saved = _start(tmp_path, "build_decoder"), tmp_path / "report.json"
    result = run_cli("replay", "--checkpoint", start, "--code", PLAIN, "--model", "build_decoder", "--step",
                     "train_step_lm", "--batches", "tokens_at", "--optimizer", "make_adamw", "--max-steps", "4",
                     "--json", saved, cwd=ROOT)
    assert result.code == 4, result.stderr
    r = json.loads(saved.read_text())
    short = plain_training.SHORT_DEFECT
    assert (r["verdict"], r["loss_only_steps"], r["origin"], r["reproduced"]) == ("loss_only", [short], None, None)
    assert r["setup"]["last_step"] == 3  # on past the NaN loss, to --max-steps
    assert any(f.startswith(f"The loss was NaN at step {short}, {LOSS_ONLY}") for f in r["findings"]), r["findings"]
    judged = [f for f in r["findings"] if "cannot be judged" in f]
    assert len(judged) == 1 and "not reproduced from the supplied batches" not in judged[0]  # the loss did not stay finite
    assert f"non-finite loss at step {short} only" in result.stdout and "LOSS ONLY" in result.stdout


def test_a_buffer_that_goes_non_finite_is_the_origin(tmp_path):
    """One 1e30 pixel at step 2: BatchNorm's running_var turns inf, everything else finite."""
    names = {"model": "build_cnn", "step": "train_step_classify", "batches": "images_at", "optimizer": "make_adamw"}
    r = replay_checkpoint(_start(tmp_path, "build_cnn"), PLAIN, names, replace(QUICK, max_steps=4))
    short = plain_training.SHORT_DEFECT
    assert (r.verdict, r.responsible_step, r.reproduced) == ("nonfinite", short, None)
    assert (r.origin.stage, r.origin.tensor, r.origin.value) == ("buffer", "norm.running_var", "inf")
    assert {e.stage for e in r.events} == {"buffer"}
    assert r.responsible_batch.file == f"{PLAIN}:images_at({short})"
    assert any(f.startswith("Buffer norm.running_var holds non-finite values from step 2") for f in r.findings)


# ---- the trust policy, outputs and inputs ---------------------------------------------------------------------

HOSTILE = '''
import functools
from torch import load
from hostile import Touch, run, system
from plain_training import batch_at, build_model, make_optimizer, train_step
build_partial = functools.partial(build_model)
'''


@pytest.fixture
def hostile_script(tmp_path, monkeypatch) -> tuple[Path, Path]:
    """A training script whose names include payloads, and the marker file a payload leaves if it ever runs."""
    import hostile

    marker = tmp_path / "payload-ran"
    monkeypatch.setenv(hostile.MARKER, str(marker))
    script = tmp_path / "code" / "train.py"
    script.parent.mkdir()
    script.write_text(HOSTILE)
    return script, marker


@pytest.mark.parametrize("role, name, why", [
    ("model", "Touch", "it is the class hostile.Touch, and an nn.Module subclass or a function is wanted"),
    ("model", "load", "it is torch.serialization.load, whose file"),  # torch's, which the user did not name
    ("model", "build_partial", "a partial object of Python's standard library (functools)"),
    ("step", "Touch", "it is the class hostile.Touch, and a function is wanted"),
    ("batches", "system", "of Python's standard library"),
    ("optimizer", "run", "it is subprocess.run, whose file"),
    ("scheduler", "Touch", "a scheduler class of torch.optim.lr_scheduler or a function is wanted"),
])
def test_a_refused_callable_never_runs(plain, hostile_script, role, name, why):
    script, marker = hostile_script
    with pytest.raises(BadInput) as refused:
        replay_checkpoint(plain / "step_000010.pt", str(script), {role: name}, QUICK)
    message = str(refused.value)
    assert message.startswith(f"{script}: --{role} '{script}:{name}' is refused: ") and why in message, message
    assert "--trust-code" in message and "\n" not in message
    assert not marker.exists(), "the payload ran"


def test_the_code_is_shown_first_and_trust_code_opts_in(plain, hostile_script):
    script, _ = hostile_script
    args = ("replay", "--checkpoint", plain / "step_000010.pt", "--code", script, "--model", "build_partial",
            "--max-steps", "2", "--no-explain")
    refused = run_cli(*args)
    assert refused.stderr.startswith(f"nanforensics: run code: --model={script}:build_partial, "
                                     f"--step={script}:train_step, --batches={script}:batch_at, "
                                     f"--optimizer={script}:make_optimizer\n"), refused.stderr
    assert_one_line_error(refused, f"--model '{script}:build_partial' is refused", "--trust-code")
    trusted = run_cli(*args, "--trust-code", "--json", "-")
    assert trusted.code == 0, trusted.stderr
    assert f"{script}:build_partial" in trusted.json()["setup"]["imported"]


def test_no_output_over_the_checkpoint_the_script_or_into_a_checkpoint_folder(plain, tmp_path):
    checkpoint = plain / "step_000010.pt"
    folder = tmp_path / "checkpoint-10"
    folder.mkdir()
    before = checkpoint.read_bytes(), (ROOT / PLAIN).read_bytes()
    calls = [
        (["replay", "--checkpoint", checkpoint, "--code", PLAIN, "--json", checkpoint], ["--json", "an input"]),
        (["replay", "--checkpoint", checkpoint, "--code", PLAIN, "--markdown", PLAIN], ["--markdown", "an input"]),
        (["replay", "--checkpoint", folder, "--code", PLAIN, "--json", folder / "r.json"], ["lies inside"]),
        (["bisect", plain, "--code", PLAIN, "--markdown", PLAIN], ["--markdown", "an input"]),
    ]
    results = [run_cli(*call[0], cwd=ROOT) for call in calls]
    for result, (_, needles) in zip(results, calls):
        assert_one_line_error(result, *needles)
    assert (checkpoint.read_bytes(), (ROOT / PLAIN).read_bytes()) == before


def test_a_script_that_is_not_a_regular_file_is_refused_unread(plain, tmp_path):
    fifo = tmp_path / "train.py"
    os.mkfifo(fifo)  # a read would wait for a writer that never comes
    with pytest.raises(BadInput, match=r"train\.py: not a regular file \(a FIFO\)"):
        replay_checkpoint(plain / "step_000010.pt", str(fifo), None, QUICK)


@pytest.mark.parametrize("value", [False, True])
def test_hyperparameters_a_newer_torch_added(tmp_path, value):
    """A checkpoint a newer torch saved holds keys this torch's class lacks: left out where they keep the older
    behaviour, named (with the torch version) where they ask for more; SGD has no decoupled_weight_decay in any torch."""
    model = torch.nn.Linear(2, 1)
    saved = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9).state_dict()
    saved["param_groups"] = [{**g, "decoupled_weight_decay": value} for g in saved["param_groups"]]
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    if value:
        with pytest.raises(BadInput, match=r"holds decoupled_weight_decay=True, which SGD of torch \S+ cannot do: a "
                                           "newer torch saved it"):
            load_optimizer(model, optimizer, saved, tmp_path / "ckpt.pt", "make_sgd")
    else:
        load_optimizer(model, optimizer, saved, tmp_path / "ckpt.pt", "make_sgd")
        assert "decoupled_weight_decay" not in optimizer.param_groups[0]
