"""The Lightning and Hugging Face callbacks on tiny real models: the run they record replays bit-exactly (through
the loop's LR schedule and clipping), and the post-mortem they run at the NaN loss names the defective batch."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch
from nanforensics.postmortem import DONE, postmortem
from nanforensics.report import to_json

import integration_models as models
from conftest import tree_digest

STEPS = 12


def check(callback, run: Path, step_fn: str) -> None:
    """Stopped at the NaN loss, the post-mortem pinned the defective batch, and its reports lie beside the run."""
    r = callback.report
    assert r is not None and r.verdict == "nonfinite" and r.responsible_step == models.DEFECT_STEP
    assert all(a.status == DONE for a in r.analyses), r.analyses
    assert r.replay.reproduced and r.replay.origin.tensor == "net.features.gain"
    assert r.step_log.last_step == models.DEFECT_STEP + 1  # stopped at the first NaN loss
    assert json.loads((run / "manifest.json").read_text())["step_fn"] == step_fn
    reports = run.with_name(run.name + ".postmortem")
    assert json.loads((reports / "postmortem.json").read_text())["responsible_step"] == models.DEFECT_STEP
    assert (reports / "postmortem.html").is_file() and (reports / "postmortem.md").is_file()
    before = tree_digest(run)  # examined again: the same diagnosis, and nothing written into the run
    again = postmortem(run)
    assert again.headline == r.headline and again.tensor_spread == r.tensor_spread
    assert to_json(again.replay) == to_json(r.replay)
    assert tree_digest(run) == before


def test_lightning_callback(tmp_path, caplog):
    pl = pytest.importorskip("lightning.pytorch", reason="PyTorch Lightning is not installed (nanforensics[lightning])")
    from nanforensics.integrations.lightning import NanForensicsCallback
    from torch.utils.data import DataLoader

    run = tmp_path / "lightning_run"
    callback = NanForensicsCallback(run, checkpoint_every=4)
    trainer = pl.Trainer(max_steps=STEPS, accelerator="cpu", logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, gradient_clip_val=1.0,
                         callbacks=[callback])
    with caplog.at_level(logging.WARNING, logger="nanforensics"):
        trainer.fit(models.RegressorModule(), DataLoader(models.batches(STEPS), batch_size=None))
    assert trainer.global_step == models.DEFECT_STEP + 2 < STEPS
    assert "post-mortem: non-finite values began at step 6" in caplog.text
    batch = callback.report.replay.responsible_batch.leaves
    assert batch["batch['clip_val']"] == 1.0 and batch["batch['lr']"] == [0.01 * 0.5 ** 3]  # StepLR: 3 halvings
    check(callback, run, "nanforensics.integrations.lightning:training_step")


def test_trainer_callback(tmp_path):
    transformers = pytest.importorskip("transformers", reason="transformers is not installed (nanforensics[hf])")
    pytest.importorskip("accelerate", reason="accelerate is not installed (nanforensics[hf])")
    from nanforensics.integrations.hf import NanForensicsTrainerCallback

    class Samples(torch.utils.data.IterableDataset):
        """In order, so that the defective sample lands in step DEFECT_STEP's batch."""

        def __iter__(self):
            for batch in models.batches(STEPS, batch_size=16):
                for x, y in zip(batch["x"], batch["y"]):
                    yield {"x": x, "y": y}

    run = tmp_path / "trainer_run"
    callback = NanForensicsTrainerCallback(run, model_factory=models.build_trainer_regressor, checkpoint_every=4)
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path / "trainer_out"), per_device_train_batch_size=16, max_steps=STEPS, learning_rate=1e-2,
        warmup_steps=2, use_cpu=True, report_to=[], save_strategy="no", logging_strategy="no", disable_tqdm=True,
        optim="adamw_torch", seed=0)
    trainer = transformers.Trainer(model=models.build_trainer_regressor(), args=args, train_dataset=Samples(),
                                   callbacks=[callback])
    trainer.train()
    assert trainer.state.global_step == models.DEFECT_STEP + 2 < STEPS
    batch = callback.report.replay.responsible_batch.leaves
    assert batch["batch['max_grad_norm']"] == 1.0 and len(set(batch["batch['lr']"])) == 1  # the linear schedule's
    check(callback, run, "nanforensics.integrations.hf:training_step")
