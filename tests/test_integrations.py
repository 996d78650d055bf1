"""The Lightning and Hugging Face callbacks on tiny real models: the run they record replays bit-exactly (through
the loop's LR schedule, clipping and gradient accumulation), the post-mortem they run at the NaN loss names the
defective batch (the micro-batch, under accumulation), and the job then fails unless told otherwise. The
checkpoints these libraries write (Lightning's ModelCheckpoint, accelerate's save_state) are read by scan and
bisect."""

from __future__ import annotations

import json
import logging
import re
import warnings
from pathlib import Path

import pytest
import torch
from nanforensics.checkpoints.bisect import bisect
from nanforensics.checkpoints.scan import scan_checkpoint
from nanforensics.errors import BadInput
from nanforensics.formats import open_checkpoint
from nanforensics.postmortem import DONE, postmortem
from nanforensics.replay.engine import replay_run
from nanforensics.report import to_json, to_jsonable
from nanforensics.runs.run import Run
from nanforensics.views.checkpoints import render_bisect_terminal
from rich.console import Console

import integration_models as models
import scenarios
from conftest import ROOT, run_cli, tree_digest

STEPS = 12
UNATTACHED = "`self.trainer` reference is not registered"


def check(callback, run: Path, step_fn: str, again: bool = True) -> None:
    """Stopped at the NaN loss, the post-mortem pinned the defective batch, and its reports lie beside the run;
    ``again``: a second post-mortem of the run finds the same, and writes nothing into it."""
    r = callback.report
    assert r is not None and r.verdict == "nonfinite" and r.responsible_step == models.DEFECT_STEP
    assert all(a.status == DONE for a in r.analyses), r.analyses
    assert r.replay.reproduced and r.replay.origin.tensor == "net.features.gain"
    assert r.step_log.last_step == models.DEFECT_STEP + 1  # stopped at the first NaN loss
    assert json.loads((run / "manifest.json").read_text())["step_fn"] == step_fn
    reports = run.with_name(run.name + ".postmortem")
    assert json.loads((reports / "postmortem.json").read_text())["responsible_step"] == models.DEFECT_STEP
    assert (reports / "postmortem.html").is_file() and (reports / "postmortem.md").is_file()
    if not again:
        return
    before = tree_digest(run)  # examined again: the same diagnosis, and nothing written into the run
    again = postmortem(run)
    assert again.headline == r.headline and again.tensor_spread == r.tensor_spread
    assert to_json(again.replay) == to_json(r.replay)
    assert tree_digest(run) == before


def terminal(render, report) -> str:
    console = Console(record=True, width=100, color_system=None)
    render(report, console)
    return console.export_text()


def lightning_trainer(callbacks: list, steps: int = STEPS, **options):
    pl = pytest.importorskip("lightning.pytorch", reason="PyTorch Lightning is not installed (nanforensics[lightning])")
    return pl.Trainer(max_steps=steps, accelerator="cpu", logger=False, enable_checkpointing=False,
                      enable_progress_bar=False, enable_model_summary=False, callbacks=callbacks, **options)


def regressor_module():
    """lightning_training's LightningModule, imported where a test fits one: Lightning takes seconds to import,
    which a pytest-xdist worker that only collects this module does not spend."""
    pytest.importorskip("lightning.pytorch", reason="PyTorch Lightning is not installed (nanforensics[lightning])")
    from lightning_training import RegressorModule

    return RegressorModule()


def loader(batches: list):
    return torch.utils.data.DataLoader(batches, batch_size=None)


def test_lightning_callback_fails_the_job_after_the_post_mortem(tmp_path, caplog):
    trainer = lightning_trainer([], gradient_clip_val=1.0)
    from nanforensics.integrations import NonFiniteLoss
    from nanforensics.integrations.lightning import NanForensicsCallback

    run = tmp_path / "lightning_run"
    callback = NanForensicsCallback(run, checkpoint_every=4)
    trainer.callbacks.append(callback)
    with caplog.at_level(logging.WARNING, logger="nanforensics"), warnings.catch_warnings(record=True) as seen, \
            pytest.raises(NonFiniteLoss, match="non-finite values began at step 6") as failed:
        warnings.simplefilter("always")
        trainer.fit(regressor_module(), loader(models.batches(STEPS)))
    assert failed.value.report is callback.report and failed.value.report_dir == tmp_path / "lightning_run.postmortem"
    assert trainer.global_step == models.DEFECT_STEP + 2 < STEPS
    assert "post-mortem: non-finite values began at step 6" in caplog.text
    assert not [w for w in seen if UNATTACHED in str(w.message)]  # replay ran the module's self.log() quietly
    batch = callback.report.replay.responsible_batch.leaves
    assert batch["batch['clip_val']"] == 1.0 and batch["batch['lr']"] == [0.01 * 0.5 ** 3]  # StepLR: 3 halvings
    assert batch["batch['micro_batches'][0]['batch']['ids']"][0] == f"s{models.DEFECT_STEP:05d}-00"
    check(callback, run, "nanforensics.integrations.lightning:training_step")


def test_lightning_gradient_accumulation_names_the_micro_batch_and_sample(tmp_path):
    """Two micro-batches per optimizer step, the defect in the second one of step 6: the step replays bit-exactly
    (losses divided by accumulate_grad_batches, clipped once) and the samples point into that micro-batch."""
    trainer = lightning_trainer([], accumulate_grad_batches=2, gradient_clip_val=1.0)
    from nanforensics.integrations.lightning import NanForensicsCallback

    run = tmp_path / "accumulated"
    callback = NanForensicsCallback(run, checkpoint_every=4, on_nan="stop")
    trainer.callbacks.append(callback)
    trainer.fit(regressor_module(), loader(models.batches(STEPS, batch_size=16, accumulate=2)))
    assert trainer.global_step == models.DEFECT_STEP + 2  # stopped, without an exception
    check(callback, run, "nanforensics.integrations.lightning:training_step", again=False)
    samples = callback.report.replay.samples
    assert samples.status == "attributed" and samples.batch_size == 32
    assert samples.samples == [16 + scenarios.DEFECT_SAMPLE]
    assert samples.micro_batch_samples == [[1, scenarios.DEFECT_SAMPLE]]
    defective = 2 * models.DEFECT_STEP + 1  # the micro-batch's index in the data
    assert samples.sample_leaves == {"batch['micro_batches'][1]['batch']['ids']":
                                     [f"s{defective:05d}-{scenarios.DEFECT_SAMPLE:02d}"]}
    assert f"(micro-batch 1, sample {scenarios.DEFECT_SAMPLE}) of 32" in samples.message


def test_lightning_accumulation_with_the_users_step_fn(tmp_path):
    trainer = lightning_trainer([], steps=4, accumulate_grad_batches=2)
    from nanforensics.integrations.lightning import NanForensicsCallback

    run = tmp_path / "own_step"
    trainer.callbacks.append(NanForensicsCallback(run, checkpoint_every=2, step_fn=models.accumulating_step))
    trainer.fit(regressor_module(), loader(models.batches(4, batch_size=16, accumulate=2, defect=False)))
    assert json.loads((run / "manifest.json").read_text())["step_fn"] == "integration_models:accumulating_step"
    report = replay_run(run)
    assert (report.verdict, report.reproduced, report.setup.last_step) == ("clean", True, 3)


class Samples(torch.utils.data.IterableDataset):
    """In order, so that the defective sample lands in the defective micro-batch; ``target`` names the label."""

    def __init__(self, accumulate: int = 1, target: str = "y") -> None:
        self.accumulate, self.target = accumulate, target

    def __iter__(self):
        for batch in models.batches(STEPS, batch_size=16, accumulate=self.accumulate):
            for x, y in zip(batch["x"], batch["y"]):
                yield {"x": x, self.target: y}


def hf_trainer(tmp_path: Path, callback, model, data, **options):
    transformers = pytest.importorskip("transformers", reason="transformers is not installed (nanforensics[hf])")
    pytest.importorskip("accelerate", reason="accelerate is not installed (nanforensics[hf])")
    options = {"learning_rate": 1e-2, **options}
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path / "trainer_out"), per_device_train_batch_size=16, max_steps=STEPS, warmup_steps=2,
        use_cpu=True, report_to=[], save_strategy="no", logging_strategy="no", disable_tqdm=True, optim="adamw_torch",
        seed=0, **options)
    return transformers.Trainer(model=model, args=args, train_dataset=data, callbacks=[callback])


def test_trainer_callback_fails_the_job(tmp_path):
    pytest.importorskip("transformers", reason="transformers is not installed (nanforensics[hf])")
    from nanforensics.integrations import NonFiniteLoss
    from nanforensics.integrations.hf import NanForensicsTrainerCallback

    run = tmp_path / "trainer_run"
    callback = NanForensicsTrainerCallback(run, model_factory=models.build_trainer_regressor, checkpoint_every=4)
    trainer = hf_trainer(tmp_path, callback, models.build_trainer_regressor(), Samples())
    with pytest.raises(NonFiniteLoss, match="non-finite values began at step 6"):
        trainer.train()
    assert trainer.state.global_step == models.DEFECT_STEP + 2 < STEPS
    assert not callback._hooks  # removed before the exception left the Trainer
    batch = callback.report.replay.responsible_batch.leaves
    assert batch["batch['max_grad_norm']"] == 1.0 and len(set(batch["batch['lr']"])) == 1  # the linear schedule's
    assert batch["batch['loss_divisor']"] == 1
    check(callback, run, "nanforensics.integrations.hf:training_step")


class Documents(torch.utils.data.IterableDataset):
    """GPT-2 samples, 16 a step; ``empty`` is the step whose samples have no label left (prompts only: all -100)."""

    def __init__(self, empty: int) -> None:
        self.empty = empty

    def __iter__(self):
        for step in range(STEPS):
            for j in range(16 // scenarios.GPT2_BATCH):
                batch = scenarios.make_gpt2_batch(step * 4 + j, defect="all_ignored" if step == self.empty else None)
                for i in range(scenarios.GPT2_BATCH):
                    yield {k: batch[k][i] for k in ("input_ids", "attention_mask", "labels")}


def test_trainer_goes_on_through_a_batch_whose_loss_alone_is_nan(tmp_path, caplog):
    """HF's batch whose labels are all -100: a NaN loss, zero gradients, the model intact. The post-mortem says
    loss_only, and the run trains on to the end (no NonFiniteLoss) unless on_loss_only says otherwise."""
    pytest.importorskip("transformers", reason="transformers is not installed (nanforensics[hf])")
    from nanforensics.integrations.hf import NanForensicsTrainerCallback

    run, empty = tmp_path / "gpt2_run", 5
    callback = NanForensicsTrainerCallback(run, model_factory=scenarios.build_gpt2, checkpoint_every=4)
    trainer = hf_trainer(tmp_path, callback, scenarios.build_gpt2(), Documents(empty), learning_rate=1e-3)
    with caplog.at_level(logging.WARNING, logger="nanforensics"):
        trainer.train()
    assert trainer.state.global_step == STEPS
    assert (callback.report.verdict, callback.report.replay.loss_only_steps) == ("loss_only", [empty])
    assert json.loads((tmp_path / "gpt2_run.postmortem" / "postmortem.json").read_text())["verdict"] == "loss_only"
    assert f"the loss of step {empty} is nan, but no gradient" in caplog.text and "training goes on" in caplog.text
    assert [s.step for s in Run(run).steps] == list(range(STEPS))  # every step recorded, through the NaN loss

    stopping = NanForensicsTrainerCallback(tmp_path / "stops", model_factory=scenarios.build_gpt2,
                                           checkpoint_every=4, on_loss_only="stop")
    trainer = hf_trainer(tmp_path, stopping, scenarios.build_gpt2(), Documents(empty), learning_rate=1e-3)
    trainer.train()
    assert trainer.state.global_step == empty + 1 and stopping.report.verdict == "loss_only"


@pytest.mark.parametrize("factory, target, divisor", [
    (models.build_trainer_regressor, "y", 2),  # a mean loss: the Trainer divides it by the micro-batches
    (models.build_labels_regressor, "labels", None),  # normalised by num_items_in_batch: left alone
])
def test_trainer_gradient_accumulation(tmp_path, factory, target, divisor):
    pytest.importorskip("transformers", reason="transformers is not installed (nanforensics[hf])")
    from nanforensics.integrations.hf import NanForensicsTrainerCallback

    run = tmp_path / "accumulated"
    callback = NanForensicsTrainerCallback(run, model_factory=factory, checkpoint_every=4, on_nan="stop")
    trainer = hf_trainer(tmp_path, callback, factory(), Samples(accumulate=2, target=target),
                         gradient_accumulation_steps=2, learning_rate=1e-3)  # slower: the tanh units stay
    # unsaturated, so the near-zero reading's gradient still overflows at step 6
    trainer.train()
    check(callback, run, "nanforensics.integrations.hf:training_step", again=False)
    leaves = callback.report.replay.responsible_batch.leaves
    assert leaves["batch['loss_divisor']"] == divisor
    recorded = Run(run).batch(models.DEFECT_STEP)["micro_batches"]
    assert len(recorded) == 2 and all(("num_items_in_batch" in m) is (divisor is None) for m in recorded)
    samples = callback.report.replay.samples
    assert samples.micro_batch_samples == [[1, scenarios.DEFECT_SAMPLE]] and samples.batch_size == 32


def test_the_workflow_uploads_the_callbacks_reports():
    """The training job's run directory is runs/ci: the callback writes its reports to runs/ci.postmortem."""
    from nanforensics.integrations._watch import Watcher

    class Callback(Watcher):
        default_step_fn = staticmethod(scenarios.train_step)

    workflow = (ROOT / "docs" / "github-actions-postmortem.yml").read_text()
    assert re.search(r"--run-dir (\S+)", workflow).group(1) == "runs/ci"
    assert Callback("runs/ci").report_dir == Path("runs/ci.postmortem")
    assert re.search(r"^\s+path: runs/ci\.postmortem$", workflow, re.MULTILINE)


def test_on_nan_is_checked():
    from nanforensics.integrations._watch import Watcher

    with pytest.raises(ValueError, match="on_nan must be one of 'fail', 'stop', 'continue'"):
        Watcher("runs/x", on_nan="raise")


# ---- the checkpoints these libraries write --------------------------------------------------------


@pytest.fixture(scope="module")
def lightning_checkpoints(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A real fit with ModelCheckpoint every 2 steps (and save_last), the defect at step 6."""
    pl = pytest.importorskip("lightning.pytorch", reason="PyTorch Lightning is not installed (nanforensics[lightning])")
    folder = tmp_path_factory.mktemp("lightning") / "ckpts"
    saving = pl.callbacks.ModelCheckpoint(dirpath=folder, every_n_train_steps=2, save_top_k=-1, save_last=True)
    trainer = pl.Trainer(max_steps=10, accelerator="cpu", logger=False, enable_progress_bar=False,
                         enable_model_summary=False, callbacks=[saving])
    trainer.fit(regressor_module(), loader(models.batches(10)))
    return folder


def test_lightning_model_checkpoints_are_bisected(lightning_checkpoints):
    """Its bookkeeping (kth_value = inf) is no parameter, its files are found in the folder and by a glob, ordered
    by global_step, last.ckpt set aside as the copy it is."""
    folder = lightning_checkpoints
    first = folder / "epoch=0-step=2.ckpt"
    raw = torch.load(first, weights_only=True)
    assert any(torch.equal(v.get("kth_value", torch.tensor(0.0)), torch.tensor(float("inf")))
               for v in raw["callbacks"].values())

    scanned = scan_checkpoint(open_checkpoint(first))
    assert (scanned.verdict, scanned.format, scanned.step) == ("clean", "lightning", 2)
    assert scanned.groups["model"].tensors == 7 and scanned.groups["optimizer"].tensors > 0

    by_glob = to_jsonable(bisect([str(folder / "*.ckpt")]))
    result = run_cli("bisect", folder, "--json", "-")
    assert result.code == 1, result.stderr
    for b in (result.json(), by_glob):
        assert (b["order"], b["checkpoints"]) == ("metadata", 5)  # steps 2, 4, 6, 8, 10
        # The defect at step 6 poisons the parameters in that step's update: the checkpoint at step 6 is the
        # state before it (global_step 6), the one at step 8 the first poisoned.
        assert (b["last_clean"]["step"], b["first_poisoned"]["step"]) == (6, 8)
        assert {h["format"] for h in b["history"]} == {"lightning"}
        assert b["skipped"] == [f"{folder / 'last.ckpt'}: Lightning's copy of the checkpoint of step 10 (save_last)"]
    shown = terminal(render_bisect_terminal, bisect([folder]))
    assert "lightning" in shown and f"Not read: {folder / 'last.ckpt'}" in shown


def test_lightning_checkpoints_replay_with_the_training_script(lightning_checkpoints):
    """bisect --code on the fit's .ckpt files: the last clean one loads into the module, its Adam and its StepLR
    (Lightning's state_dict, optimizer_states and lr_schedulers), and the replay names the step and coordinate."""
    result = run_cli("bisect", lightning_checkpoints, "--code", "tests/lightning_training.py", "--scheduler",
                     "make_scheduler", "--json", "-", cwd=ROOT)
    assert result.code == 1, result.stderr
    b = result.json()
    assert (b["last_clean"]["step"], b["first_poisoned"]["step"]) == (6, 8)
    r = b["replayed"]
    assert (r["verdict"], r["responsible_step"]) == ("nonfinite", models.DEFECT_STEP)
    assert (r["origin"]["tensor"], r["origin"]["index"]) == ("net.features.gain", [scenarios.DEFECT_FEATURE])
    assert r["samples"]["samples"] == [scenarios.DEFECT_SAMPLE]
    loaded = r["loaded"]
    assert (loaded["layout"], loaded["step"], loaded["step_from"]) == ("Lightning checkpoint", 6, "metadata")
    assert (loaded["optimizer_matched"], loaded["scheduler"]) == ("order", "restored")
    assert r["reproduced"] is None


def test_accelerate_save_state_is_read_with_its_optimizer_state(tmp_path):
    """A real accelerate save_state after an Adam step whose gradient squared overflows float32: the parameters
    are finite, optimizer.bin is not, and the RNG pickle is named, not loaded."""
    accelerate = pytest.importorskip("accelerate", reason="accelerate is not installed (nanforensics[hf])")
    acc = accelerate.Accelerator(cpu=True)
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    schedule = torch.optim.lr_scheduler.StepLR(optimizer, 2)
    model, optimizer, schedule = acc.prepare(model, optimizer, schedule)
    acc.backward(model(torch.full((3, 4), 1e22)).sum())  # gradient 3e22: (1 - beta2) * its square overflows float32
    optimizer.step()
    schedule.step()
    folder = tmp_path / "checkpoint_0"
    acc.save_state(folder)
    assert torch.isfinite(model.weight).all() and sorted(p.name for p in folder.iterdir()) == [
        "model.safetensors", "optimizer.bin", "random_states_0.pkl", "scheduler.bin"]

    result = run_cli("scan", folder)
    assert result.code == 1, result.stderr
    assert "layout accelerate" in result.stdout and "Not read: random_states_0.pkl" in result.stdout
    r = scan_checkpoint(open_checkpoint(folder), full=True)
    assert (r.verdict, r.format) == ("poisoned_optimizer_state", "accelerate")
    assert [t.name for t in r.poisoned] == ["state.0.exp_avg_sq"] and r.poisoned[0].group == "optimizer"
    assert [s.split(":")[0] for s in r.skipped] == ["random_states_0.pkl", "scheduler.bin"]
    assert "never unpickles" in r.skipped[0]


def test_a_file_that_is_no_checkpoint_says_so(tmp_path):
    report = tmp_path / "report.json"
    report.write_text('{"schema": "nanforensics.scan/1"}\n')
    with pytest.raises(BadInput, match=r"report\.json: is not a checkpoint \(a JSON document\)"):
        open_checkpoint(report)


def guard_events(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "incidents" / "guard.jsonl").read_text().splitlines()]


def guarded_batches(bad: tuple[int, ...], batch_size: int = scenarios.BATCH) -> list[dict]:
    """The near-zero reading (an infinite gradient, a finite loss) at each step of ``bad``."""
    return [scenarios.make_batch(s, defect="near_zero" if s in bad else None, batch_size=batch_size)
            for s in range(STEPS)]


def test_lightning_guard_trains_through_a_bad_batch_and_fails_at_k_in_a_row(tmp_path):
    trainer = lightning_trainer([], gradient_clip_val=1.0)
    from nanforensics.integrations import NonFiniteLoss
    from nanforensics.integrations.lightning import NanForensicsCallback
    from nanforensics.runs.guard import GuardPolicy

    callback = NanForensicsCallback(tmp_path / "one", checkpoint_every=4, guard=GuardPolicy(max_consecutive=3))
    trainer.callbacks.append(callback)
    module = regressor_module()
    trainer.fit(module, loader(guarded_batches((models.DEFECT_STEP,))))
    assert trainer.global_step == STEPS and all(torch.isfinite(p).all() for p in module.parameters())
    assert [e["step"] for e in guard_events(tmp_path / "one") if e["event"] == "skip"] == [models.DEFECT_STEP]
    assert (tmp_path / "one" / "incidents" / f"step_{models.DEFECT_STEP:08d}" / "manifest.json").is_file()
    assert callback.report is None  # nothing stopped: no post-mortem

    callback = NanForensicsCallback(tmp_path / "three", checkpoint_every=4, guard=GuardPolicy(max_consecutive=3))
    with pytest.raises(NonFiniteLoss, match="3 consecutive steps skipped.*non-finite values began at step 6"):
        lightning_trainer([callback], gradient_clip_val=1.0).fit(regressor_module(),
                                                                 loader(guarded_batches((4, 5, 6))))
    assert callback.report is not None and callback.report.replay.responsible_step == 6
    assert (tmp_path / "three.postmortem" / "postmortem.json").is_file()


class GuardedSamples(torch.utils.data.IterableDataset):
    def __init__(self, bad: tuple[int, ...]) -> None:
        self.bad = bad

    def __iter__(self):
        for batch in guarded_batches(self.bad, batch_size=16):
            for x, y in zip(batch["x"], batch["y"]):
                yield {"x": x, "y": y}


def test_trainer_guard_trains_through_a_bad_batch_and_fails_at_k_in_a_row(tmp_path):
    pytest.importorskip("transformers", reason="transformers is not installed (nanforensics[hf])")
    from nanforensics.integrations import NonFiniteLoss
    from nanforensics.integrations.hf import NanForensicsTrainerCallback
    from nanforensics.runs.guard import GuardPolicy

    callback = NanForensicsTrainerCallback(tmp_path / "one", model_factory=models.build_trainer_regressor,
                                           checkpoint_every=4, guard=GuardPolicy(max_consecutive=3))
    model = models.build_trainer_regressor()
    trainer = hf_trainer(tmp_path, callback, model, GuardedSamples((models.DEFECT_STEP,)))
    trainer.train()
    assert trainer.state.global_step == STEPS and all(torch.isfinite(p).all() for p in model.parameters())
    assert [e["step"] for e in guard_events(tmp_path / "one") if e["event"] == "skip"] == [models.DEFECT_STEP]
    assert not callback._hooks

    callback = NanForensicsTrainerCallback(tmp_path / "three", model_factory=models.build_trainer_regressor,
                                           checkpoint_every=4, guard=GuardPolicy(max_consecutive=3))
    trainer = hf_trainer(tmp_path, callback, models.build_trainer_regressor(), GuardedSamples((4, 5, 6)))
    with pytest.raises(NonFiniteLoss, match="3 consecutive steps skipped.*non-finite values began at step 6"):
        trainer.train()
    assert callback.report is not None and (tmp_path / "three.postmortem" / "postmortem.json").is_file()
