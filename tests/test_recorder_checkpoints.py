"""Checkpoints off the training thread: copied when ``log`` takes them, written by the recorder's writer thread.

What is on disk must be what the synchronous ``save_checkpoint`` writes at that moment, byte for byte, whatever the
loop does to its model and optimizer after ``log`` returns; a write that fails there is one line naming the file, at the
loop's next call; a replay from such a checkpoint is bit-exact."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest
import torch
from nanforensics import Recorder
from nanforensics.runs.checkpoint import checkpoint_name, save_checkpoint

import scenarios
from conftest import run_cli, tree_digest

# what a checkpoint holds, one scenario each: Adam's state, SGD's momentum, a GradScaler's and an LR scheduler's
# state, BatchNorm's buffers, a float16 model and its state
HOLDS = ["clean", "sgd_near_zero", "fp16_scaler_catches", "batchnorm_near_zero", "fp16_adam_state_overflow"]
EVERY = 3


class _Loop:
    """A scenario's training loop under the recorder; ``sync`` keeps what ``save_checkpoint`` writes at each
    checkpoint, taken right after the ``log`` call that took the recorder's."""

    def __init__(self, run: Path, name: str, sync: Path) -> None:
        self.sc = scenarios.SCENARIOS[name]
        torch.manual_seed(0)
        self.model = self.sc.factory(**self.sc.model_kwargs)
        self.optimizer = self.sc.optimizer(self.model)
        self.extras: dict[str, Any] = {}
        if self.sc.scaler:
            self.extras["scaler"] = self.sc.scaler()
        if self.sc.scheduler:
            self.extras["scheduler"] = self.sc.scheduler(self.optimizer)
        self.sync = sync
        self.rec = Recorder(run, self.model, self.optimizer, model_factory=self.sc.factory,
                            model_kwargs=self.sc.model_kwargs, step_fn=self.sc.step_fn, checkpoint_every=EVERY,
                            scheduler_factory=self.sc.scheduler if self.sc.scheduler else None, **self.extras)
        self.save(0)
        self.next = 0

    def save(self, step: int) -> None:
        save_checkpoint(self.sync, step, self.model, self.optimizer, **self.extras)

    def step(self) -> None:
        step, self.next = self.next, self.next + 1
        batch = self.sc.batches(step, 0, None)
        self.rec.log(step, batch, self.sc.step_fn(self.model, self.optimizer, batch, **self.extras))
        if (step + 1) % EVERY == 0:
            self.save(step + 1)


def _checkpoints(run: Path) -> dict[str, str]:
    return tree_digest(run / "checkpoints")


@pytest.mark.parametrize("name", HOLDS)
def test_a_checkpoint_written_off_the_thread_is_the_synchronous_one(tmp_path, name):
    loop = _Loop(tmp_path / "run", name, tmp_path / "sync")
    for _ in range(2 * EVERY + 1):
        loop.step()
    loop.rec.close()
    written = _checkpoints(tmp_path / "run")
    assert written == tree_digest(tmp_path / "sync")
    assert sorted({Path(k).parts[0] for k in written}) == [checkpoint_name(s) for s in (0, EVERY, 2 * EVERY)]


def test_the_state_is_copied_when_log_takes_it_and_replays_bit_exactly(tmp_path):
    """The writer thread is held while the loop trains on, changing every parameter and optimizer state in place: the
    checkpoint it then writes is the state at ``log``, and a replay from it reproduces every logged loss."""
    run = tmp_path / "run"
    loop = _Loop(run, "adam_near_zero", tmp_path / "sync")
    for _ in range(EVERY - 1):
        loop.step()
    loop.rec.flush()
    held = threading.Event()
    loop.rec._writer._queue.put((lambda: held.wait(60), None, False))  # the writer waits here until released
    loop.step()  # takes the checkpoint before step EVERY
    assert not (run / "checkpoints" / checkpoint_name(EVERY)).exists()  # log did not wait for the write
    before = {n: p.detach().clone() for n, p in loop.model.named_parameters()}
    for _ in range(EVERY - 1):
        loop.step()
    with torch.no_grad():
        for p in loop.model.parameters():
            p.add_(1.0)  # and in place by hand, the optimizer's state too
        for state in loop.optimizer.state.values():
            for v in state.values():
                v.add_(1.0)
    assert all(not torch.equal(p, before[n]) for n, p in loop.model.named_parameters())
    held.set()
    loop.rec.close()
    assert _checkpoints(run) == tree_digest(tmp_path / "sync")
    result = run_cli("replay", run, "--from-step", EVERY, "--no-explain", "--json", "-")
    assert result.code == 0, result.stderr
    report = result.json()
    assert report["setup"]["from_checkpoint"] == EVERY
    assert report["reproduced"] is True and report["diverged_at_step"] is None


@pytest.mark.parametrize("surfaces_at", ["log", "flush", "close"])
def test_a_checkpoint_write_that_fails_on_the_writer_thread_is_one_line_naming_the_file(tmp_path, surfaces_at):
    run = tmp_path / "run"
    loop = _Loop(run, "clean", tmp_path / "sync")
    loop.rec.flush()
    blocker = run / "checkpoints"
    for old in blocker.iterdir():  # the folder the next checkpoint goes into is now a file
        for f in old.iterdir():
            f.unlink()
        old.rmdir()
    blocker.rmdir()
    blocker.write_bytes(b"")
    for _ in range(EVERY):
        loop.rec.log(loop.next, scenarios.make_batch(loop.next), 1.0)
        loop.next += 1
    with pytest.raises(OSError) as raised:
        if surfaces_at == "log":
            loop.rec._writer._queue.join()  # the failure has happened; the loop learns of it at its next call
            loop.rec.log(loop.next, scenarios.make_batch(loop.next), 1.0)
        else:
            getattr(loop.rec, surfaces_at)()
    assert str(raised.value) == f"nanforensics recorder could not write {blocker}: File exists"
    if surfaces_at != "close":
        with pytest.raises(OSError, match=f"could not write {blocker}"):  # and at the calls after, until closed
            loop.rec.close()
    assert [p.name for p in run.iterdir() if p.name.startswith(".")] == []
