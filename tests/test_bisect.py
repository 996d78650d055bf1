"""bisect: the first poisoned checkpoint of real runs in every format, within ceil(log2 n) + 2 reads."""

from __future__ import annotations

import math
import shutil
from pathlib import Path

import pytest
import torch
from nanforensics.checkpoints.bisect import bisect, scan_bound
from nanforensics.checkpoints.scan import POISONED_PARAMETERS, POISONED_STATE
from nanforensics.errors import BadInput
from safetensors.torch import save_file

from checkpoint_formats import ALL_STEPS, FIRST_POISONED, FORMATS, LAST_CLEAN, Checkpoints, build
from conftest import ROOT, assert_one_line_error, run_cli, tree_digest

N = len(ALL_STEPS)


@pytest.fixture(scope="session")
def ck(tmp_path_factory: pytest.TempPathFactory) -> Checkpoints:
    return Checkpoints.make(tmp_path_factory)


def target(ck: Checkpoints, kind: str, fmt: str) -> Path:
    return ck.runs[kind] if fmt == "ours" else ck.folders[kind, fmt]


def assert_found(report, first: int | None, last_clean: int | None) -> None:
    assert (report.first_poisoned.step if report.first_poisoned else None) == first
    assert (report.last_clean.step if report.last_clean else None) == last_clean
    assert report.scans == len(report.history) <= report.max_scans == scan_bound(report.checkpoints)
    assert len({r.index for r in report.history}) == report.scans  # no checkpoint read twice


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("kind, verdict", [("params", POISONED_PARAMETERS), ("state", POISONED_STATE)])
def test_every_format_finds_the_boundary(ck, fmt, kind, verdict):
    before = tree_digest(target(ck, kind, fmt))
    report = bisect([target(ck, kind, fmt)])
    assert report.verdict == "poisoned" and report.order == "metadata" and report.checkpoints == N
    assert_found(report, FIRST_POISONED, LAST_CLEAN)
    assert report.first_poisoned_verdict == verdict
    assert report.first_poisoned_scan.complete and report.poisoned_tensors
    if kind == "state":
        assert all(t.group == "optimizer" and t.name.endswith("exp_avg_sq") for t in report.poisoned_tensors)
    assert tree_digest(target(ck, kind, fmt)) == before


def test_linear_reads_every_checkpoint_and_agrees(ck):
    report = bisect([ck.runs["params"]], linear=True)
    assert report.scans == report.max_scans == N and report.mode == "linear"
    assert (report.first_poisoned.step, report.last_clean.step) == (FIRST_POISONED, LAST_CLEAN)


def test_globs_and_checkpoint_folders_of_a_run(ck):
    pt = ck.folders["params", "pt"]
    assert_found(bisect([f"{pt}/ckpt_*.pt"]), FIRST_POISONED, LAST_CLEAN)
    assert_found(bisect([f"{ck.folders['params', 'hf']}/checkpoint-*"]), FIRST_POISONED, LAST_CLEAN)
    from_folder = bisect([ck.runs["params"] / "checkpoints"])
    assert_found(from_folder, FIRST_POISONED, LAST_CLEAN)
    assert from_folder.replay is not None  # the folder lies in a run: it is still that run's replay


@pytest.mark.parametrize("fmt", ["pt", "safetensors", "hf"])
def test_order_by_name_without_metadata(ck, tmp_path, fmt):
    build(tmp_path, fmt, [(ck.runs["params"], s) for s in ALL_STEPS], metadata=False)
    report = bisect([tmp_path])
    assert report.order == "name"
    assert_found(report, FIRST_POISONED, LAST_CLEAN)


def test_metadata_step_wins_over_the_name(ck, tmp_path):
    build(tmp_path, "safetensors", [(ck.runs["params"], s) for s in ALL_STEPS])
    for p in list(tmp_path.iterdir()):  # names now count down while the steps inside count up
        p.rename(p.with_name(f"renamed-{1000 - int(p.stem.split('-')[1])}.safetensors"))
    report = bisect([tmp_path])
    assert report.order == "metadata"
    assert_found(report, FIRST_POISONED, LAST_CLEAN)


@pytest.mark.parametrize("fmt", ["ours", "pt", "hf"])
def test_poison_at_the_first_and_at_the_last_checkpoint(ck, tmp_path, fmt):
    run = ck.runs["params"]
    late = build(tmp_path / "late", fmt, [(run, s) for s in ALL_STEPS if s >= FIRST_POISONED])
    assert_found(bisect([late]), FIRST_POISONED, None)
    early = build(tmp_path / "early", fmt, [(run, s) for s in ALL_STEPS if s <= FIRST_POISONED])
    assert_found(bisect([early]), FIRST_POISONED, LAST_CLEAN)


def test_clean_run(ck):
    report = bisect([ck.folders["clean", "hf"]])
    assert report.verdict == "clean" and report.first_poisoned is None and report.poisoned_tensors == []
    assert report.scans == 2 and report.last_clean.step == ALL_STEPS[-1]


def test_non_monotonic_history_is_reported_not_bisected_through(ck, tmp_path):
    bad, good = ck.runs["params"], ck.runs["clean"]
    # A repaired run: poisoned at 20 and 25, clean again from 30 on.
    repaired = build(tmp_path / "repaired", "pt", [(bad, s) for s in ALL_STEPS if s <= 25] +
                     [(good, s) for s in ALL_STEPS if s >= 30])
    linear = bisect([repaired], linear=True)
    assert linear.verdict == "non_monotonic"
    assert [(b.poisoned.step, b.clean_after.step) for b in linear.non_monotonic] == [(25, 30)]
    assert (linear.first_poisoned.step, linear.last_clean.step) == (FIRST_POISONED, LAST_CLEAN)
    # Poisoned first, clean last: bisection sees the contradiction in its first two reads.
    flipped = build(tmp_path / "flipped", "safetensors", [(bad, s) for s in (20, 25)] + [(good, s) for s in (30, 35)])
    report = bisect([flipped])
    assert report.verdict == "non_monotonic" and report.scans == 2
    assert report.last_clean is None and report.first_poisoned.step == 20


def test_scan_count_stays_within_the_bound_wherever_the_poison_starts(tmp_path):
    n = 33
    for start in range(n + 1):  # start == n: nothing poisoned
        for i in range(n):
            value = float("nan") if i >= start else 1.0
            save_file({"w": torch.full((4,), value)}, tmp_path / f"c{i:03d}.safetensors", metadata={"step": str(i)})
        report = bisect([tmp_path])
        assert report.scans <= math.ceil(math.log2(n)) + 2
        expected_first = start if start < n else None
        assert_found(report, expected_first, (start - 1 if start < n else n - 1) if start > 0 else None)


def test_replay_hint_needs_the_batches_of_the_window(ck, tmp_path):
    run = ck.runs["params"]
    report = bisect([run])
    assert report.replay.command == f"nanforensics replay {run} --from-step {LAST_CLEAN}"
    copy = tmp_path / "run"
    shutil.copytree(run, copy)
    (copy / "batches" / "step_00000017.safetensors").unlink()
    (copy / "batches" / "step_00000018.safetensors").unlink()
    pruned = bisect([copy])
    assert pruned.replay is None and "steps 17-18" in pruned.replay_unavailable
    assert bisect([ck.runs["params"] / "checkpoints" / "step_00000020"]).replay_unavailable.startswith("no clean")


def test_ordering_problems_are_bad_input(ck, tmp_path):
    build(tmp_path / "dup", "pt", [(ck.runs["params"], 0)])
    build(tmp_path / "dup2", "pt", [(ck.runs["params"], 0)])
    with pytest.raises(BadInput, match="both are step 0"):
        bisect([tmp_path / "dup", tmp_path / "dup2" / "ckpt_0.pt"])
    nameless = tmp_path / "nameless"
    nameless.mkdir()
    for name in ("first", "second"):
        save_file({"w": torch.ones(2)}, nameless / f"{name}.safetensors")
    with pytest.raises(BadInput, match="no number in its name"):
        bisect([nameless])
    with pytest.raises(BadInput, match="matches no checkpoint"):
        bisect([f"{tmp_path}/nothing-*.pt"])


def test_cli(ck, tmp_path):
    run, pt = ck.runs["params"], ck.folders["params", "pt"]
    before = {p: tree_digest(p) for p in (run, pt, ck.runs["clean"])}

    found, glob, clean, replayed = (run_cli(*args) for args in [
        ("bisect", run, "--json", "-"),
        ("bisect", f"{pt}/ckpt_*.pt", "--markdown", tmp_path / "b.md"),
        ("bisect", ck.runs["clean"]),
        ("bisect", run, "--replay"),
    ])
    assert found.code == 1, found.stderr
    r = found.json()
    assert r["schema"] == "nanforensics.bisect/1"
    assert r["first_poisoned"] == {"path": str(run / "checkpoints" / "step_00000020"), "step": FIRST_POISONED}
    assert r["last_clean"]["step"] == LAST_CLEAN and r["scans"] <= scan_bound(N)
    assert {t["name"] for t in r["poisoned_tensors"]} >= {"features.gain", "features.gain/exp_avg_sq"}
    assert r["replay"]["command"] == f"nanforensics replay {run} --from-step {LAST_CLEAN}"

    assert glob.code == 1 and "first poisoned: step 20" in glob.stdout
    assert "nanforensics bisect: POISONED" in (tmp_path / "b.md").read_text()

    assert clean.code == 0 and "CLEAN" in clean.stdout

    assert replayed.code == 1, replayed.stderr
    assert "step 17" in replayed.stdout  # the replay names the step that made the NaN
    assert {p: tree_digest(p) for p in before} == before


def test_cli_damaged_checkpoint_in_a_folder(ck, tmp_path):
    folder = tmp_path / "ckpts"
    shutil.copytree(ck.folders["params", "safetensors"], folder)
    victim = folder / "weights-25.safetensors"
    victim.write_bytes(victim.read_bytes()[:-64])
    before = tree_digest(folder)
    assert_one_line_error(run_cli("bisect", folder), str(victim), "truncated")
    assert tree_digest(folder) == before


def test_a_checkpoint_read_again_to_complete_it_is_said_to_be_its_rest(tmp_path):
    """bisect completes the first poisoned checkpoint's early-stopped read: its progress says it reads the rest, not
    the same checkpoint twice; every other checkpoint is read once."""
    shown = run_cli("bisect", ROOT / "sample_runs" / "seed_adam" / "checkpoints", "--json", tmp_path / "b.json")
    assert shown.code == 1, shown.stderr
    reads = [line.split("] ", 1)[1].rsplit(" (", 1)[0] for line in shown.stderr.splitlines() if "[bisect] reading" in line]
    assert reads == ["reading step_00000030", "reading step_00000000", "reading step_00000010", "reading step_00000020",
                     "reading the rest of step_00000030"]
