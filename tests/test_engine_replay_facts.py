"""The replay loop's facts, each read exactly: where it starts, the window it replays, where it stops and why, the
step it rewinds to for the precursors, the records of each step, the checkpoints it compares, the tolerance it judges
by, the progress it reports, and what it refuses. On tiny runs the project's recorder makes here (a defect at a
chosen step; a replay of one is a tenth of a second), on copies of them changed where a case needs it, and on the
committed sample of a run nobody recorded, read and never written."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from nanforensics.distributed.sessions import open_session
from nanforensics.errors import BadInput
from nanforensics.replay import whatif
from nanforensics.replay.engine import ReplayOptions, _explain, _start_checkpoint, replay, replay_run
from nanforensics.replay.reproduction import STATE_RTOL
from nanforensics.replay.unrecorded import replay_checkpoint
from nanforensics.runs.cpu import this_cpu
from nanforensics.runs.run import Run, UserCode
from nanforensics.runs.unrecorded import open_unrecorded, user_checkpoint
from safetensors.torch import load_file, save_file

import scenarios
from conftest import ROOT, tree_digest

UNRECORDED = ROOT / "sample_runs" / "unrecorded"
DDP = ROOT / "sample_runs" / "ddp_two_ranks"  # the shipped two-rank sample: rank 1, step 4, sample-00075
DEFECT = 26  # the long run's defect: an infinite gradient in features.gain[3], sample 5 of the batch
STEPS, EVERY = 32, 2  # the long run: steps 0-31, checkpoints before steps 0, 2, ... 30 and after the last
NO_LABELS = 3  # the loss-only run's defect: a batch without a label, a NaN loss and nothing else


class Log:
    """Progress as the replay reports it, every phase and update in order."""

    def __init__(self) -> None:
        self.events: list[tuple] = []

    def phase(self, what: str, total: int | None = None, unit: str = "step", at_most: bool = False) -> None:
        self.events.append(("phase", what, total, unit, at_most))

    def update(self, done: int, total: int | None = None) -> None:
        self.events.append(("update", done, total))


def phase(what: str, total: int | None = None, unit: str = "step", at_most: bool = False) -> tuple:
    return ("phase", what, total, unit, at_most)


def updates(first: int, last: int, total: int | None = None) -> list[tuple]:
    return [("update", n, total) for n in range(first, last + 1)]


@pytest.fixture(scope="module")
def recorded(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The long run (an origin at step 26, NaN logged from 27); steps 0-5 with a defect at step 3 of: the loss-only
    run and a mixed-precision run whose scaler catches each overflow (checkpoints every 2 steps), a run whose batch
    norm's running variance overflows (checkpoints every step); and the mixed run: a batch without a label at step 1,
    a fully padded one at step 4 (NaN in the forward pass from there)."""
    root = tmp_path_factory.mktemp("engine-facts")
    scenarios.record(root / "long", "adam_near_zero", steps=STEPS, defect_step=DEFECT, checkpoint_every=EVERY)
    for name, every in (("decoder_no_labels", 2), ("fp16_scaler_catches", 2), ("batchnorm_huge_pixel", 1)):
        scenarios.record(root / name, name, steps=6, defect_step=NO_LABELS, checkpoint_every=every)
    scenarios.record(root / "mixed", "decoder_no_labels", steps=6, checkpoint_every=2,
                     defects={1: "no_labels", 4: "fully_padded"})
    return {"long": root / "long", "no_labels": root / "decoder_no_labels", "amp": root / "fp16_scaler_catches",
            "buffer": root / "batchnorm_huge_pixel", "mixed": root / "mixed"}


def changed(recorded: dict[str, Path], tmp_path: Path, name: str, *, manifest: dict | None = None,
            losses: dict[int, float | str] | None = None, drop: tuple[str, ...] = ()) -> Path:
    """A copy of a recorded run with manifest fields replaced (None: removed), logged losses replaced, files dropped."""
    run = tmp_path / name
    shutil.copytree(recorded[name], run)
    if manifest:
        raw = json.loads((run / "manifest.json").read_text())
        raw.update(manifest)
        raw = {k: v for k, v in raw.items() if v is not None}
        (run / "manifest.json").write_text(json.dumps(raw))
    if losses:
        lines = [json.loads(line) for line in (run / "steps.jsonl").read_text().splitlines()]
        lines = [{**line, "loss": losses.get(line["step"], line["loss"])} for line in lines]
        (run / "steps.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    for path in drop:
        target = run / path
        shutil.rmtree(target) if target.is_dir() else target.unlink()
    return run


def refusal(call, *args) -> tuple[str | Path, str]:
    """Where and what the one-line refusal of ``call(*args)`` says (a path where it names a file)."""
    with pytest.raises(BadInput) as refused:
        call(*args)
    where = refused.value.where
    return (Path(where) if where and where.startswith("/") else where), refused.value.problem


def logged_losses(run: Path) -> dict[int, float]:
    return {line["step"]: float(line["loss"]) for line in map(json.loads, (run / "steps.jsonl").read_text().splitlines())}


def test_the_long_run_rewinds_to_the_newest_old_enough_checkpoint_and_stops_a_step_past_the_nan_loss(recorded):
    """Start: the newest finite checkpoint before the first NaN logged (27): step 26. The origin at step 26 leaves it
    no room for precursors (16 steps), so the rewind goes to the newest checkpoint at or before step 10 (not the oldest,
    nor the one after it); the chain is complete at step 27 (every parameter NaN, the first NaN loss), the replay ends
    a step after."""
    log, before = Log(), tree_digest(recorded["long"])
    r = replay_run(recorded["long"], ReplayOptions(explain=False), log)
    assert tree_digest(recorded["long"]) == before
    assert (r.verdict, r.responsible_step, r.first_nonfinite_loss_step, r.logged_first_nonfinite_loss_step,
            r.fully_nonfinite_step, r.diverged_at_step, r.reproduced, r.state_poisoned) == (
        "nonfinite", DEFECT, DEFECT + 1, DEFECT + 1, DEFECT + 1, None, True, True)
    assert (r.origin.step, r.origin.stage, r.origin.tensor, r.origin.index, r.origin.value) == (
        DEFECT, "grad", "features.gain", [3], "inf")
    assert r.responsible_batch.step == DEFECT and r.responsible_batch.file.endswith("step_00000026.safetensors")
    assert (r.setup.from_checkpoint, r.setup.first_step, r.setup.last_step, r.setup.num_threads) == (26, 26, 28, 1)
    assert r.setup.loss_rtol is None and r.setup.recorded_cpu == r.setup.replay_cpu == this_cpu()
    assert [p.step for p in r.precursors] == list(range(10, DEFECT + 3))
    assert [(c.step, c.exact) for c in r.checkpoints_compared] == [(28, True)]  # NaN where the run's was
    logged = logged_losses(recorded["long"])
    rows = [(s.step, s.params_nonfinite, s.params_total, s.state_nonfinite, s.state_total, s.buffers_nonfinite,
             s.buffers_total, s.loss_ulps) for s in r.spread]
    assert rows == [(26, 1, 1649, 2, 3305, 0, 0, 0), (27, 1649, 1649, 3298, 3305, 0, 0, None),
                    (28, 1649, 1649, 3298, 3305, 0, 0, None)]
    for s in r.spread:
        assert s.logged_loss == logged[s.step] or math.isnan(s.logged_loss) and math.isnan(logged[s.step])
        assert s.replayed_loss == s.logged_loss or math.isnan(s.replayed_loss) and math.isnan(s.logged_loss)
    assert {e.step for e in r.events} == {26, 27, 28} and r.events[0] is r.origin
    assert r.operation is None and r.samples is None and r.what_if == []
    assert [(d.step, d.tensor, d.kind, d.index) for d in r.data_defects] == [(DEFECT, "batch['x']", "subnormal", [5, 3])]
    assert r.loaded is None and r.unsound == [] and r.findings
    assert log.events == [
        phase("checking that the checkpoint at step 26 is finite"), phase("checking the batches of steps 26-31"),
        phase("replaying steps 26-29", 4), phase("locating: re-running steps 10-25 with precursor probes", 16),
        *updates(1, 16), phase("locating: steps 26-29, reading each first non-finite value", 4, at_most=True),
        ("update", 1, 4), ("update", 2, 4), ("update", 3, 3)]


def test_a_start_sixteen_steps_before_the_origin_needs_no_rewind_and_passes_each_later_checkpoint(recorded):
    """From step 10, the origin 16 steps later: the precursors start at the start (restored from memory); every
    recorded checkpoint passed is compared, bit for bit on the CPU the run was recorded on."""
    log = Log()
    r = replay_run(recorded["long"], ReplayOptions(explain=False, from_step=10), log)
    assert (r.setup.from_checkpoint, r.setup.first_step, r.setup.last_step, r.responsible_step) == (10, 10, 28, DEFECT)
    assert [p.step for p in r.precursors] == list(range(10, DEFECT + 3))
    assert [(c.step, c.exact, c.tolerance) for c in r.checkpoints_compared] == [(s, True, 0.0) for s in range(12, 30, 2)]
    assert [s.step for s in r.spread] == list(range(10, DEFECT + 3)) and r.reproduced
    healthy = [(s.params_nonfinite, s.state_nonfinite, s.buffers_nonfinite) for s in r.spread if s.step < DEFECT]
    assert healthy == [(0, 0, 0)] * (DEFECT - 10)  # a step nothing turned non-finite counts none, in every column
    assert log.events == [
        phase("checking that the checkpoint at step 10 is finite"), phase("checking the batches of steps 10-31"),
        phase("replaying steps 10-29", 20), *updates(1, 16, 20),
        phase("locating: steps 26-29, reading each first non-finite value", 4, at_most=True),
        ("update", 1, 4), ("update", 2, 4), ("update", 3, 3)]


def test_the_chain_waits_after_steps_past_the_nan_loss_from_a_start_that_rewinds(recorded):
    """after=2 from step 20: detect mode to the origin, the rewind to step 10 re-run with the probes, then the chain
    complete at step 27 + 2, inside the log's guess (27 + 1 + 2)."""
    log = Log()
    r = replay_run(recorded["long"], ReplayOptions(explain=False, from_step=20, after=2), log)
    assert (r.setup.from_checkpoint, r.setup.first_step, r.setup.last_step) == (20, 20, 29)
    assert [p.step for p in r.precursors] == list(range(10, 30))
    assert [(c.step, c.exact) for c in r.checkpoints_compared] == [(s, True) for s in range(22, 32, 2)]
    assert log.events == [
        phase("checking that the checkpoint at step 20 is finite"), phase("checking the batches of steps 20-31"),
        phase("replaying steps 20-30", 11), *updates(1, 6, 11),
        phase("locating: re-running steps 10-25 with precursor probes", 16), *updates(1, 16),
        phase("locating: steps 26-30, reading each first non-finite value", 5, at_most=True), *updates(1, 3, 5),
        ("update", 4, 4)]


def test_a_logged_nan_that_does_not_reproduce_stops_the_replay_after_steps_past_it(recorded, tmp_path):
    """NaN logged at step 10 of a copy, the replay finite there: it starts at step 10 and stops at 10 + after, not
    reproduced; with no origin, no precursors and nothing explained."""
    run = changed(recorded, tmp_path, "long", losses={10: "nan"})
    for after in (1, 2):
        log = Log()
        r = replay_run(run, ReplayOptions(after=after), log)
        assert (r.verdict, r.responsible_step, r.logged_first_nonfinite_loss_step, r.diverged_at_step) == (
            "not_reproduced", None, 10, None)
        assert [s.step for s in r.spread] == list(range(10, 11 + after)) and r.precursors == []
        assert r.operation is None and r.samples is None
        assert log.events == [phase("checking that the checkpoint at step 10 is finite"),
                              phase(f"checking the batches of steps 10-{STEPS - 1}"),
                              phase(f"replaying steps 10-{10 + 1 + after}", 2 + after),
                              *updates(1, after, 2 + after), ("update", 1 + after, 1 + after)]


def test_a_loss_only_step_is_explained_from_the_state_kept_before_it(recorded):
    """The loss-only run: its NaN loss (step 3) reaches nothing, so the replay runs on to the log's end; the loss is
    explained (the operation, the samples) from the state kept before step 3, with no step re-run for it."""
    log = Log()
    r = replay_run(recorded["no_labels"], ReplayOptions(), log)
    assert (r.verdict, r.loss_only_steps, r.origin, r.events, r.precursors) == ("loss_only", [NO_LABELS], None, [], [])
    assert [s.step for s in r.spread] == [2, 3, 4, 5] and r.first_nonfinite_loss_step == NO_LABELS
    assert [(c.step, c.exact) for c in r.checkpoints_compared] == [(4, True), (6, True)] and r.reproduced
    assert r.operation.traced_from == "loss = nan" and r.operation.site.op == "aten::nll_loss_forward.default"
    assert (r.samples.status, r.samples.compared_step, r.samples.compared_fails) == ("batch_wide", 2, False)
    assert log.events[:6] == [phase("checking that the checkpoint at step 2 is finite"),
                              phase("checking the batches of steps 2-5"), phase("replaying steps 2-5", 4),
                              *updates(1, 3, 4)]
    assert log.events[6:8] == [("update", 4, 4), phase("tracing the operation behind loss at step 3")]


def test_the_tolerances_follow_the_cpu_the_compiler_and_the_option(recorded, tmp_path):
    """Bit for bit on the CPU the run names (a run naming no device ran on the CPU, "cpu:0" is the CPU); within
    STATE_RTOL and 1e-3 where it names another CPU or none, or was compiled with kernels of its own; --loss-rtol
    overrides the losses' tolerance. The run's thread count is pinned (sums round by it)."""
    other = {"model": "another", "capability": "DEFAULT", "machine": "x86_64"}
    cases = [({}, None, None, 0.0), ({"cpu": other}, None, 1e-3, STATE_RTOL),
             ({"cpu": None}, None, 1e-3, STATE_RTOL), ({"compiled": {"backend": "inductor"}}, None, 1e-3, STATE_RTOL),
             ({"compiled": {"backend": "eager"}}, None, None, 0.0), ({}, 0.25, 0.25, 0.0),
             ({"cpu": other}, 0.0, None, STATE_RTOL), ({"device": None}, None, None, 0.0),
             ({"device": None, "cpu": other}, None, 1e-3, STATE_RTOL), ({"device": "cpu:0"}, None, None, 0.0),
             ({"device": "cpu:0", "cpu": other}, None, 1e-3, STATE_RTOL)]
    for n, (manifest, option, loss_rtol, state_rtol) in enumerate(cases):
        run = changed(recorded, tmp_path / str(n), "no_labels", manifest=manifest)
        r = replay_run(run, ReplayOptions(explain=False, loss_rtol=option))
        assert (r.setup.loss_rtol, [c.tolerance for c in r.checkpoints_compared], r.reproduced) == (
            loss_rtol, [state_rtol] * 2, True), manifest
    threads = changed(recorded, tmp_path / "threads", "no_labels", manifest={"num_threads": 2})
    r = replay_run(threads, ReplayOptions(explain=False))
    assert r.setup.num_threads == 2 and torch.get_num_threads() == 1  # pinned for the replay, then restored


def test_a_logged_loss_some_ulps_off_is_judged_by_the_ulps_allowed(recorded, tmp_path):
    """Step 4's logged loss 3 float32 ulps off the replayed one (judged: past the last checkpoint compared, step 4's)."""
    logged = logged_losses(recorded["no_labels"])[4]
    off = float(torch.tensor(logged).view(torch.int32).add(3).view(torch.float32))
    run = changed(recorded, tmp_path, "no_labels", losses={4: off}, drop=("checkpoints/step_00000006",))
    for ulps, reproduced in ((2, False), (3, True)):
        r = replay_run(run, ReplayOptions(explain=False, loss_ulps=ulps))
        assert (r.reproduced, r.diverged_at_step if not reproduced else None, r.loss_max_ulps) == (
            reproduced, 4 if not reproduced else None, 3)


def test_the_batches_of_the_whole_window_are_checked_against_the_magnitude_given(recorded):
    """The readings are exp(N(0, 0.5)): a bound of 1 flags each step's batch, over the window from the start to the
    log's end (step 31), though the replay stops at step 28."""
    r = replay_run(recorded["long"], ReplayOptions(explain=False, data_max_abs=1.0))
    assert sorted({d.step for d in r.data_defects}) == list(range(26, STEPS))


@pytest.mark.parametrize("max_steps", [6, 7])
def test_a_window_bounded_by_max_steps_has_its_batches_checked_to_its_last_step_not_past(recorded, max_steps):
    """From step 20, --max-steps 6 ends the window at step 25, a step before the defect's subnormal reading: no batch
    past the window is checked (the defect's step is not named); --max-steps 7 takes step 26 in, and names it."""
    r = replay_run(recorded["long"], ReplayOptions(explain=False, from_step=20, max_steps=max_steps))
    assert (r.setup.from_checkpoint, r.setup.last_step) == (20, 19 + max_steps)
    assert [(d.step, d.kind) for d in r.data_defects] == ([] if max_steps == 6 else [(DEFECT, "subnormal")])


def test_a_what_if_is_replayed_from_the_start_at_the_origin(recorded):
    """The run as recorded, then with the origin's step skipped, each from the start checkpoint through the what-if
    steps after the origin: each its own phase, and the finding says which stayed finite."""
    log = Log()
    r = replay_run(recorded["long"], ReplayOptions(explain=False, what_if=[whatif.parse("skip")], what_if_steps=2), log)
    assert [(w.intervention, w.step, w.last_step) for w in r.what_if] == [
        ("none", DEFECT, DEFECT + 2), ("skip", DEFECT, DEFECT + 2)]
    assert [f for f in r.findings if f.startswith("What-if")] == [
        f"What-if at step {DEFECT}, checked through step {DEFECT + 2}: the run stays finite with skip."]
    assert [e[1] for e in log.events if e[0] == "phase"][-2:] == [
        f"what-if 1 of 2: as recorded, steps {DEFECT}-{DEFECT + 2}", f"what-if 2 of 2: skip, steps {DEFECT}-{DEFECT + 2}"]


def test_a_distributed_run_names_its_ranks_and_its_what_if_changes_the_responsible_ranks_shard():
    """The shipped two-rank DDP sample, emulated on this process (read, never written): the report names the world,
    the responsible rank's batch file and each rank's losses, logged and replayed (within the tolerance of this
    machine, whatever CPU it is); a what-if dropping sample 5 changes the shard of the origin's rank (1), where
    sample-00075 is, and saves the run (rank 0's sample 5 is healthy: dropping it would not)."""
    before = tree_digest(DDP)
    r = replay_run(DDP, ReplayOptions(explain=False, what_if=[whatif.parse("drop-samples=5")], what_if_steps=2))
    assert (r.setup.world_size, r.setup.wrapping, r.setup.ranks_replayed, r.origin.rank) == (2, "ddp", "emulated", 1)
    batch = r.responsible_batch
    assert (batch.step, batch.rank, batch.owner, batch.leaves["batch['id']"][5]) == (4, 1, "rank 1", "sample-00075")
    assert batch.file.endswith("ranks/rank_00001/batches/step_00000004.safetensors")
    assert [(c.rank, c.logged_first_nonfinite_loss_step, c.diverged_at_step) for c in r.ranks] == [(0, 5, None), (1, 5, None)]
    assert [(s.step, len(s.rank_logged_losses), len(s.rank_replayed_losses)) for s in r.spread] == [
        (step, 2, 2) for step in range(3, 7)]
    assert [(w.intervention, w.step, w.finite) for w in r.what_if] == [("none", 4, False), ("drop-samples=5", 4, True)]
    assert tree_digest(DDP) == before


@pytest.mark.parametrize("off, loss_rtol, loss_ulps, parted", [
    (5e-4, 1e-3, 8, None),  # thousands of ulps off, within the relative tolerance: the same loss
    (2e-3, 1e-3, 8, 4),     # past it: rank 1's loss parts from the replay at step 4
    (4, 0.0, 2, 4),         # 4 float32 ulps off (an int: ulps), 2 allowed and no relative tolerance: parted
])
def test_each_ranks_losses_are_judged_by_the_tolerances_the_replay_was_given(tmp_path, off, loss_rtol, loss_ulps, parted):
    """Rank 1's logged loss at step 4 of a copy of the DDP sample moved ``off``; the window ends at step 4, before any
    checkpoint is compared, so every rank's every loss is judged, by --loss-rtol and --loss-ulps as the run's own are
    (the replay here computes step 4's rank 1 loss bit for bit; the other losses within 2 ulps on any CPU)."""
    run = tmp_path / "ddp"
    shutil.copytree(DDP, run)
    log = run / "ranks" / "rank_00001" / "steps.jsonl"
    lines = [json.loads(line) for line in log.read_text().splitlines()]
    assert lines[4]["step"] == 4
    loss = lines[4]["loss"]
    if isinstance(off, int):
        moved = np.float32(loss)
        for _ in range(off):
            moved = np.nextafter(moved, np.float32(math.inf))
        lines[4]["loss"] = float(moved)
    else:
        lines[4]["loss"] = loss * (1 + off)
    log.write_text("".join(json.dumps(line) + "\n" for line in lines))
    r = replay_run(run, ReplayOptions(explain=False, from_step=3, max_steps=2, loss_rtol=loss_rtol, loss_ulps=loss_ulps))
    assert (r.setup.last_step, r.checkpoints_compared) == (4, [])
    assert [c.diverged_at_step for c in r.ranks] == [None, parted]


def test_the_explanation_without_the_state_kept_re_runs_from_the_session_start(recorded):
    """_explain with nothing kept: the session restarts at its checkpoint and re-runs to the origin's step (none to
    re-run from the origin's own checkpoint), and finds what the replay finds from the state it kept: the backward of
    log at sample 5's reading, the sample found in 3 passes by starting from the one the operation's output points at."""
    r = replay_run(recorded["long"], ReplayOptions(from_step=20))
    assert (r.operation.site.op, r.operation.output_index, r.samples.samples, r.samples.passes) == (
        "aten::div.Tensor", [scenarios.DEFECT_SAMPLE, 3], [scenarios.DEFECT_SAMPLE], 3)
    run = Run(recorded["long"])
    code = UserCode.load(run, (), False, False, ())
    for start, rerun in ((20, [phase("re-running steps 20-25 to the responsible one")]), (26, [])):
        session = open_session(run, code, next(c for c in run.checkpoints() if c.step == start), torch.device("cpu"))
        log = Log()
        assert _explain(session, r.origin, None, log) == (r.operation, r.samples)
        assert log.events[:len(rerun) + 1] == [*rerun, phase("tracing the operation behind grad at step 26")]


def test_the_start_checkpoint_is_the_newest_finite_one_at_or_before_the_target(recorded, tmp_path):
    """Those after the origin (28, 30 and the last, 32) hold NaN: each is tried, newest first, and passed over."""
    run = Run(recorded["long"])
    for target, start, tried in ((None, 26, [32, 30, 28]), (32, 26, [32, 30, 28]), (31, 26, [30, 28]), (28, 26, [28]),
                                 (27, 26, []), (26, 26, []), (25, 24, []), (0, 0, [])):
        log = Log()
        assert _start_checkpoint(run, target, log).step == start
        assert log.events == [phase(f"checking that the checkpoint at step {s} is finite") for s in (*tried, start)]
    gone = Run(changed(recorded, tmp_path / "a", "long", drop=("checkpoints/step_00000000",)))
    assert refusal(_start_checkpoint, gone, 1) == (gone.checkpoint_folder, "no checkpoint at or before step 1 (oldest is step 2)")
    late = Run(changed(recorded, tmp_path / "b", "long", drop=tuple(f"checkpoints/step_{s:08d}" for s in range(0, 28, 2))))
    assert refusal(_start_checkpoint, late, 31) == (late.checkpoint_folder, (
        "every checkpoint up to step 30 already holds non-finite values: the origin lies before the oldest one kept "
        "(run `nanforensics bisect` on the folder)"))
    none = Run(changed(recorded, tmp_path / "c", "long", drop=("checkpoints",)))
    assert refusal(_start_checkpoint, none, 31) == (none.checkpoint_folder, "the run has no checkpoints")


def test_the_rewind_needs_every_batch_from_the_older_checkpoint_to_the_start(recorded, tmp_path):
    """Step 10's batch or step 25's missing, the precursors start at the start checkpoint (step 26) instead of step 10;
    step 2's, before step 10, does not matter. With no checkpoint old enough, the oldest is tried, and only it: the
    buffer run, checkpoints every step, rewinds from 3 to 0, and stays at 3 without step 0's batch."""
    for missing, start in ((2, 10), (10, 26), (25, 26)):
        run = changed(recorded, tmp_path / str(missing), "long", drop=(f"batches/step_{missing:08d}.safetensors",))
        r = replay_run(run, ReplayOptions(explain=False))
        assert r.responsible_step == DEFECT and [p.step for p in r.precursors] == list(range(start, DEFECT + 3)), missing
    run = changed(recorded, tmp_path, "buffer", drop=("batches/step_00000000.safetensors",))
    assert [p.step for p in replay_run(run, ReplayOptions(explain=False)).precursors] == [3, 4, 5]


def test_refusals_before_any_step(recorded, tmp_path):
    assert refusal(replay_run, recorded["long"], ReplayOptions(from_step=STEPS)) == (
        "--from-step", "step 32 lies past the run's last logged step, 31")
    assert refusal(replay_run, recorded["long"], ReplayOptions(device="tpu"))[0] == "--device"
    assert replay_run(recorded["no_labels"], ReplayOptions(from_step=5, explain=False)).setup.from_checkpoint == 4
    late = changed(recorded, tmp_path / "late", "long")
    (late / "steps.jsonl").write_text("".join(line + "\n" for line in (late / "steps.jsonl").read_text().splitlines()[18:]))
    assert refusal(replay_run, late, ReplayOptions(from_step=17)) == (
        late, "its step log starts at step 18, after the start checkpoint (step 16): the steps between were never logged")
    empty = changed(recorded, tmp_path / "empty", "long")
    (empty / "steps.jsonl").write_text("")
    assert refusal(replay_run, empty) == (empty / "steps.jsonl", "no steps were logged")


def test_a_run_nobody_recorded_has_its_batches_checked_where_the_replay_ran_them():
    """No log says where it ends: --max-steps bounds the window, and the batches checked are those replayed."""
    log = Log()
    r = replay_checkpoint(UNRECORDED / "ckpts" / "step_000010.pt", str(UNRECORDED / "train.py"),
                          options=ReplayOptions(explain=False, max_steps=9, data_max_abs=0.5), progress=log)
    assert (r.verdict, r.responsible_step, r.setup.first_step, r.setup.last_step) == ("nonfinite", 17, 10, 18)
    assert sorted({d.step for d in r.data_defects}) == list(range(10, 19))
    assert not any(e[0] == "phase" and e[1].startswith("checking the batches") for e in log.events)
    start = user_checkpoint(UNRECORDED / "ckpts" / "step_000010.pt")
    run, code = open_unrecorded(start, str(UNRECORDED / "train.py"))
    assert refusal(replay, run, code, ReplayOptions(explain=False)) == (
        "--max-steps", "the run logged no steps, so nothing says where it ends: give --max-steps")


def test_a_run_nobody_recorded_never_asks_for_a_batch_past_the_steps_replayed(tmp_path):
    """Its data holds 30 steps (a batch past them raises, as a loader run dry does), and --max-steps 1000 bounds the
    window far past them: the replay stops at step 19 (the chain complete), having asked for no batch past it, so
    the bound's batches (never replayed) are neither computed nor checked."""
    code = tmp_path / "train.py"
    code.write_text((UNRECORDED / "train.py").read_text() + '''

_rows = batch_at


def batch_at(step: int) -> dict[str, Any]:
    if step >= STEPS:
        raise IndexError(f"the data holds {STEPS} steps, not {step + 1}")
    return _rows(step)
''')
    r = replay_checkpoint(UNRECORDED / "ckpts" / "step_000010.pt", str(code),
                          options=ReplayOptions(explain=False, max_steps=1000, data_max_abs=0.5))
    assert (r.verdict, r.responsible_step, r.setup.first_step, r.setup.last_step) == ("nonfinite", 17, 10, 19)
    assert sorted({d.step for d in r.data_defects}) == list(range(10, 20))


def test_an_optimizer_replay_does_not_support_is_refused_naming_the_run(tmp_path):
    """LBFGS (a program of the generator, recorded): refused once its session is open, before any step, naming the run
    directory, the optimizer and why."""
    from tests.oracle import programs

    code, run = tmp_path / "code", tmp_path / "run"
    programs.record(programs.materialise(programs.draw(701), code), run, "every_2")
    assert refusal(replay_run, run, ReplayOptions(code_paths=[code])) == (
        run, "replay does not support the optimizer LBFGS: it calls the step function's closure inside "
             "optimizer.step(), so the forward and backward run inside the update")


def test_read_all_sees_a_write_through_data_that_the_proof_assumes_never_happens(tmp_path):
    """The step function writes NaN into the head's bias through ``.data`` after the update of step 3. The update's
    proof (on by default) assumes only optimizer.step() writes parameters, so detect mode does not read the bias and
    the NaN is first seen in step 4's forward; ``proof=False`` (``--read-all``) reads it at step 3, where it was
    written. Both sides: the proof is on unless turned off, and off when it is."""
    run = tmp_path / "run"
    scenarios.record(run, "clean", steps=6, checkpoint_every=2, step_fn=scenarios.train_step_nan_through_data)
    write = scenarios.DATA_WRITE_STEP
    for proof, origin in ((True, (write + 1, "forward", "head")), (False, (write, "param", "head.bias"))):
        r = replay_run(run, ReplayOptions(explain=False, proof=proof))
        assert (r.setup.from_checkpoint, r.first_nonfinite_loss_step) == (2, write + 1)
        assert (r.origin.step, r.origin.stage, r.origin.tensor, r.origin.value) == (*origin, "nan"), proof


def test_an_unsound_start_is_replayed_from_itself_and_its_reset_is_tried(recorded, tmp_path):
    """A negative second moment put into the checkpoint of step 16: the origin lies on it at step 16, the precursors
    start there (an older checkpoint does not lead to the state the steps did not make), and resetting it is replayed
    without being asked."""
    run = changed(recorded, tmp_path, "long")
    path = run / "checkpoints" / "step_00000016" / "optimizer.safetensors"
    tensors = {k: v.clone() for k, v in load_file(path).items()}
    tensors["fc2.weight/exp_avg_sq"][1, 2] = -1.0
    save_file(tensors, path, metadata={"format": "nanforensics.checkpoint/1", "step": "16"})
    r = replay_run(run, ReplayOptions(explain=False, from_step=16, what_if_steps=2))
    assert (r.responsible_step, r.origin.tensor, r.origin.index) == (16, "fc2.weight", [1, 2])
    assert [(u.tensor, u.index) for u in r.unsound] == [("fc2.weight/exp_avg_sq", [1, 2])]
    assert [p.step for p in r.precursors] == [s.step for s in r.spread] and r.spread[0].step == 16
    assert [(w.intervention, w.step, w.finite) for w in r.what_if] == [("none", 16, False), ("reset-state", 16, True)]
    assert [f for f in r.findings if f.startswith("The start checkpoint")] == [
        "The start checkpoint (step 16) is finite but its optimizer state is unsound: 1 finding, "
        "negative_second_moment (fc2.weight) (each under unsound, with what it does at the next update)."]


def test_a_caught_overflow_leaves_no_nan_pending_and_a_buffer_counts_in_the_records(recorded):
    """The NaN logged at step 3 of the mixed-precision run was an overflow its scaler caught: nothing is pending, the
    replay runs to the log's end, and a what-if asked for has no step to change. The batch norm's running variance:
    the buffer is the origin, counted each step."""
    r = replay_run(recorded["amp"], ReplayOptions(explain=False, what_if=[whatif.parse("skip")]))
    assert (r.verdict, r.logged_first_nonfinite_loss_step, [s.step for s in r.spread]) == ("clean", NO_LABELS, [2, 3, 4, 5])
    assert r.what_if == [] and r.findings[-1] == "What-if replays not run: the replay found no responsible step to change."
    assert r.amp.scaler and NO_LABELS in [s.step for s in r.amp.steps if s.caught]
    assert [f.split(":")[0] for f in r.findings if "scale" in f] == [  # the scaler's own findings, beside the verdict's
        "No non-finite value reached the optimizer state or the parameters over steps 2-5",
        "Loss scale 4.1943e+06 before step 2, 262144 after step 5",
        "The scaler caught 4 overflows before optimizer.step() wrote the moments"]
    r = replay_run(recorded["buffer"], ReplayOptions(explain=False))
    assert (r.responsible_step, r.origin.stage, r.origin.tensor) == (NO_LABELS, "buffer", "norm.running_var")
    assert [(s.step, s.buffers_nonfinite, s.buffers_total) for s in r.spread] == [(3, 4, 8), (4, 4, 8), (5, 4, 8)]
    assert [p.step for p in r.precursors] == [0, 1, 2, 3, 4, 5]


def test_the_trust_options_reach_the_policy(recorded, tmp_path):
    """Code inside the run directory, a function of the standard library, one of an installed distribution: each
    refused until its own option admits it (then called: the factory's result is no model)."""
    inside = tmp_path / "inside"
    changed(recorded, tmp_path, "no_labels").rename(inside)
    shutil.copy(Path(scenarios.__file__), inside / "shipped.py")
    manifest = json.loads((inside / "manifest.json").read_text())
    (inside / "manifest.json").write_text(json.dumps({**manifest, "step_fn": f"{inside}/shipped.py:train_step_lm"}))
    assert "lies inside the run directory" in refusal(replay_run, inside, ReplayOptions(code_paths=[inside]))[1]
    assert replay_run(inside, ReplayOptions(explain=False, code_paths=[inside], trust_run_dir=True)).verdict == "loss_only"
    for factory, options, says in (
            ("os:getcwd", {}, "model_factory 'os:getcwd' is refused"),
            ("os:getcwd", {"trust_packages": ["sympy"]}, "model_factory 'os:getcwd' is refused"),
            ("os:getcwd", {"trust_code": True}, "model factory os:getcwd returned str, not a Module"),
            ("sympy:symbols", {}, "model_factory 'sympy:symbols' is refused"),
            ("sympy:symbols", {"trust_packages": ["sympy"]}, "model factory sympy:symbols raised TypeError")):
        (inside / "manifest.json").write_text(json.dumps({**manifest, "model_factory": factory}))
        assert refusal(replay_run, inside, ReplayOptions(**options))[1].startswith(says), (factory, options)


def test_where_the_log_guesses_too_early_the_end_moves_to_the_windows(recorded):
    """The log's guess is a step past its first NaN + after. after=0 on the loss-only run: nothing stops the replay at
    step 4, so the total grows to the window's end. The mixed run: its first NaN (step 1) is loss-only, and the origin
    (step 4) lies past the guess (step 3): located to the window's end; with after=2 the guess is the origin's own
    step, and the total grows only as the replay passes it."""
    log = Log()
    r = replay_run(recorded["no_labels"], ReplayOptions(explain=False, after=0), log)
    assert [s.step for s in r.spread] == [2, 3, 4, 5] and r.verdict == "loss_only"
    assert log.events[2:] == [phase("replaying steps 2-4", 3), *updates(1, 3, 3), ("update", 4, 4)]
    log = Log()
    r = replay_run(recorded["mixed"], ReplayOptions(explain=False), log)
    assert (r.verdict, r.loss_only_steps, r.responsible_step, r.origin.stage) == ("nonfinite", [1], 4, "forward")
    assert [s.step for s in r.spread] == [0, 1, 2, 3, 4, 5] and [p.step for p in r.precursors] == [0, 1, 2, 3, 4, 5]
    assert log.events[2:] == [phase("replaying steps 0-3", 4), *updates(1, 4, 4),
                              phase("locating: steps 4-5, reading each first non-finite value", 2, at_most=True),
                              *updates(1, 2, 2)]
    log = Log()  # after=2: the guess is the origin's step itself (1 + 1 + 2), kept until the replay passes it
    replay_run(recorded["mixed"], ReplayOptions(explain=False, after=2), log)
    assert log.events[2:] == [phase("replaying steps 0-4", 5), *updates(1, 4, 5),
                              phase("locating: step 4, reading each first non-finite value", 1, at_most=True),
                              ("update", 1, 1), ("update", 2, 2)]


def test_a_checkpoint_keeping_a_nonfinite_gradient_of_a_parameter_no_optimizer_holds_is_no_clean_start(recorded, tmp_path):
    """The scan reads the state, not the gradients save_checkpoint keeps beside it (the next step starts from them):
    the start checks them too. An infinite one in step 26's checkpoint moves the start to step 24; a finite one not."""
    for value, start in ((math.inf, 24), (1.0, DEFECT)):
        run = changed(recorded, tmp_path / str(value), "long")
        folder = run / "checkpoints" / f"step_{DEFECT:08d}"
        meta = json.loads((folder / "meta.json").read_text())
        (folder / "meta.json").write_text(json.dumps({**meta, "loose_grads": ["features.gain"]}))
        save_file({"loose_grads/features.gain": torch.full((16,), value)}, folder / "extras.safetensors")
        assert _start_checkpoint(Run(run), DEFECT + 1).step == start


def test_a_run_whose_log_holds_no_nan_is_replayed_from_the_newest_finite_checkpoint_before_its_last_step(recorded, tmp_path):
    """The loss-only run with its NaN loss logged as a number: the target is the last logged step (5), not whatever
    checkpoint is newest (the one after the last step, 6)."""
    run = changed(recorded, tmp_path, "no_labels", losses={NO_LABELS: 1.0})
    r = replay_run(run, ReplayOptions(explain=False))
    assert (r.verdict, r.setup.from_checkpoint, [s.step for s in r.spread]) == ("clean", 4, [4, 5])
