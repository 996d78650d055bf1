"""Findings say only what is true of the run: each sentence checked, through the CLI's JSON and views, on a
recorded run where it applies and on one where it does not. Batch-wide failures and sample ids at any depth
of the batch belong here too: they decide what the samples sentence and the headline may claim."""

from __future__ import annotations

import itertools
import json
from pathlib import Path
from typing import Any, Callable

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from nanforensics import Recorder
from nanforensics.rootcause.samples import ALONE_UP_TO, PROBES, max_passes, select, split_batch

import scenarios
from conftest import DEFECT_STEP, STEPS, run_cli

S, F = scenarios.DEFECT_SAMPLE, scenarios.DEFECT_FEATURE
HALF = list(range(0, scenarios.BATCH, 2))  # the samples spoiled in the half-bad run


def replay(run: Path, tmp_path: Path, *args: str) -> tuple[dict, str, str]:
    """The CLI's JSON report, its terminal view and its Markdown, from one replay."""
    out, md = tmp_path / "report.json", tmp_path / "report.md"
    result = run_cli("replay", run, "--json", out, "--markdown", md, *args)
    assert result.code in (0, 1, 3), result.stderr
    return json.loads(out.read_text()), result.stdout, md.read_text()


@pytest.fixture(scope="module")
def replayed(runs, tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], tuple[dict, str, str]]:
    """``replay`` of a recorded run with the default options, once per run for the module's tests that read it."""
    done: dict[str, tuple[dict, str, str]] = {}

    def get(name: str) -> tuple[dict, str, str]:
        if name not in done:
            done[name] = replay(runs[name], tmp_path_factory.mktemp(name))
        return done[name]
    return get


def one(findings: list[str], prefix: str) -> str:
    [found] = [f for f in findings if f.startswith(prefix)]
    return found


def record_mlp(path: Path, batch_at: Callable[[int], dict[str, Any]]) -> Path:
    """The seed scenario's model and step function, trained on ``batch_at(step)`` under the recorder."""
    model = scenarios.build_model()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    with Recorder(path, model, optimizer, model_factory=scenarios.build_model, step_fn=scenarios.train_step,
                  checkpoint_every=10) as rec:
        for step in range(DEFECT_STEP + 3):
            batch = batch_at(step)
            rec.log(step, batch, scenarios.train_step(model, optimizer, batch))
    return path


def half_bad(step: int) -> dict[str, Any]:
    """Exactly half the batch holds the near-zero reading at step 17, interleaved so both halves fail."""
    batch = scenarios.make_batch(step)
    if step == DEFECT_STEP:
        batch["x"][HALF, F] = 3e-45
    return batch


def all_bad(step: int) -> dict[str, Any]:
    """Every sample of step 17's batch holds the near-zero reading: a corrupt batch, not a drifting step."""
    batch = scenarios.make_batch(step)
    if step == DEFECT_STEP:
        batch["x"][:, F] = 3e-45
    return batch


def nested_ids(step: int) -> dict[str, Any]:
    """The seed defect, with the ids two levels down and a list of per-sample dicts beside them."""
    batch = scenarios.make_batch(step, defect="near_zero" if step == DEFECT_STEP else None)
    ids = batch.pop("ids")
    batch["meta"] = {"ids": ids, "source": "train.jsonl",
                     "rows": [{"id": i, "line": n} for n, i in enumerate(ids)]}
    return batch


# ---- 3. batch-wide failures ---------------------------------------------------------------------------------


def test_lr_finder_blow_up_is_batch_wide_and_blames_the_step(replayed):
    r, terminal, md = replayed("decoder_lr_finder")
    t = r["responsible_step"]
    assert r["verdict"] == "nonfinite" and r["origin"]["stage"] == "forward" and r["origin"]["tensor"].endswith("ln2")
    s = r["samples"]
    assert (s["status"], s["samples"], s["batch_size"]) == ("batch_wide", [], scenarios.TOKEN_BATCH)
    # the whole batch, single samples (each judged alone: 8 <= ALONE_UP_TO) until more than half fail, the step before's
    # batch from the same state (it fails too); the samples tried alone are fewer than one per sample, and the hint the
    # origin's coordinate gives is not used
    assert s["judged"] == "each_alone" and scenarios.TOKEN_BATCH <= ALONE_UP_TO
    assert r["origin"]["index"][0] == 0 and s["passes"] == 1 + scenarios.TOKEN_BATCH // 2 + 1 + 1
    assert 1 + scenarios.TOKEN_BATCH // 2 < scenarios.TOKEN_BATCH
    assert (s["compared_step"], s["compared_fails"]) == (t - 1, True)
    assert "5 of the 8 samples, more than half, were tried alone and each fails" in s["message"]
    step = one(r["findings"], f"Step {t}, not its data, is responsible")
    assert "its learning rate, its loss scale, or weights grown over many steps" in step
    assert f"Over steps 0-{t - 1} these rose: the learning rate from 0.005 to " in step  # 100-fold every step since
    assert "the gradient norm from" in step and "the largest activation from" in step
    # the JSON keeps the step and its batch; the views do not present the batch as the responsible one
    assert r["responsible_batch"]["step"] == t
    assert f"step {t} failed batch-wide: the step, not its data" in terminal and "responsible batch" not in terminal
    assert "batch (not the cause)" in terminal and "batch-wide: most samples fail alone" in terminal
    assert "failed batch-wide" in md.splitlines()[0] and "Responsible batch" not in md


def test_one_padded_sequence_is_still_attributed(runs, tmp_path):
    r, terminal, _ = replay(runs["decoder_fully_padded"], tmp_path)
    assert (r["samples"]["status"], r["samples"]["samples"]) == ("attributed", [S])
    assert not [f for f in r["findings"] if "not its data" in f]
    assert f"the batch to inspect is step {DEFECT_STEP}'s" in one(r["findings"], "The loss logged")
    assert f"responsible step {DEFECT_STEP}" in terminal and "responsible batch" in terminal


def test_exactly_half_the_batch_bad_is_named_not_batch_wide(tmp_path):
    run = record_mlp(tmp_path / "half", half_bad)
    r, _, _ = replay(run, tmp_path)
    s = r["samples"]
    assert (s["status"], s["samples"]) == ("attributed", HALF)
    assert s["sample_leaves"]["batch['ids']"] == [f"s{DEFECT_STEP:05d}-{i:02d}" for i in HALF]
    assert not [f for f in r["findings"] if "not its data" in f]


def test_a_wholly_corrupt_batch_is_batch_wide_but_blamed_on_its_data(tmp_path):
    run = record_mlp(tmp_path / "corrupt", all_bad)
    r, terminal, _ = replay(run, tmp_path)
    # the whole batch, the sample the origin points at alone and the rest without it, PROBES single samples, and the
    # step before's batch from the same state (it stays finite)
    assert r["samples"]["status"] == "batch_wide" and r["samples"]["passes"] == 1 + 2 + PROBES + 1
    assert (r["samples"]["compared_step"], r["samples"]["compared_fails"]) == (DEFECT_STEP - 1, False)
    [d] = [d for d in r["data_defects"] if d["step"] == DEFECT_STEP]
    assert (d["kind"], d["count"]) == ("subnormal", scenarios.BATCH)
    one(r["findings"], f"Most of step {DEFECT_STEP}'s batch fails sample by sample, and that batch holds data defects")
    assert not [f for f in r["findings"] if "not its data" in f]
    assert f"the batch to inspect is step {DEFECT_STEP}'s" in one(r["findings"], "The loss logged")
    assert f"responsible step {DEFECT_STEP}" in terminal and "responsible batch" in terminal
    assert f"step {DEFECT_STEP}  batch['x'][0, {F}] = " in terminal  # the data row, from the report's defects
    assert f"subnormal ({scenarios.BATCH} such values)" in terminal


@pytest.mark.parametrize("size, alone_up_to", [*((n, limit) for n in range(2, 11) for limit in (ALONE_UP_TO, 0)),
                                                (2 * PROBES - 1, 0)])
def test_batch_wide_exactly_when_more_than_half_fail_alone(size, alone_up_to):
    """Up to 2*PROBES-1 samples the decision is exact: every set of failing samples (around half, for the largest),
    with a real subset test; judging each sample alone (the batches below ALONE_UP_TO) and probing then halving (the
    larger ones, here with the limit at 0: the probes' bound, 2*PROBES-1, is tried there alone)."""
    for k in range(1, size + 1) if size <= 10 else (size // 2, size // 2 + 1, size):
        for bad in itertools.combinations(range(size), k):
            asked: list[list[int]] = []

            def fails(indices: list[int]) -> bool:
                asked.append(indices)
                return any(i in bad for i in indices)

            found = split_batch(size, fails, alone_up_to=alone_up_to)
            if 2 * k > size:
                assert found.status == "batch_wide", (size, bad)
            else:
                assert (found.status, found.samples) == ("attributed", list(bad)), (size, bad)
            assert found.judged == ("each_alone" if alone_up_to else "probes" if not found.named else "group_testing")
            assert len(asked) == len({tuple(a) for a in asked})  # no subset asked twice
            if k == size:
                assert len(asked) == size // 2 + 1  # all fail: decided on one more than half, not every sample


@settings(max_examples=300, deadline=None)
@given(st.integers(2, 2 * ALONE_UP_TO).flatmap(lambda n: st.tuples(
    st.just(n), st.sets(st.integers(0, n - 1), min_size=1), st.integers(0, n - 1), st.booleans())))
def test_a_hint_changes_the_passes_never_the_answer(case):
    """Whatever the hint, right or wrong, the answer stands; above ALONE_UP_TO a right hint for the one failing sample
    costs two passes, below it the hint changes nothing (every sample is run alone, and the batch without the one
    that fails where that is not one of them). ``coupled``: the samples fail only all together (BatchNorm), not each alone."""
    size, bad, hint, coupled = case

    def fails(indices: list[int]) -> bool:
        asked.append(indices)
        return bad <= set(indices) if coupled else any(i in bad for i in indices)

    asked: list[list[int]] = []
    plain = split_batch(size, fails)
    unhinted, asked = asked, []
    hinted = split_batch(size, fails, hint=hint)
    assert (hinted.status, hinted.samples, hinted.coupled) == (plain.status, plain.samples, plain.coupled)
    assert len(asked) == len({tuple(a) for a in asked})  # no subset asked twice
    assert 1 + max(len(asked), len(unhinted)) <= max_passes(size)  # the whole batch, then these: within the bound
    if size <= ALONE_UP_TO:
        assert asked == unhinted and hinted.judged == "each_alone"
    if bad == {hint}:
        assert len(asked) == (size + (size > 2) if size <= ALONE_UP_TO else 2)  # the rest is a sample run already


# ---- 4. sample ids anywhere in the batch -------------------------------------------------------------------


def test_select_indexes_per_sample_lists_at_any_depth():
    batch = {"x": torch.arange(4), "meta": {"ids": ["a", "b", "c", "d"], "pair": ("p", "q", "r", "s"),
                                           "rows": [{"i": 0}, {"i": 1}, {"i": 2}, {"i": 3}], "source": "f"},
             "extra": [torch.zeros(4, 2), ["w", "x", "y", "z"]], "names": ["only", "three", "here"]}
    picked = select(batch, [1, 3], 4)
    assert picked["x"].tolist() == [1, 3]
    assert picked["meta"] == {"ids": ["b", "d"], "pair": ("q", "s"), "rows": [{"i": 1}, {"i": 3}], "source": "f"}
    assert picked["extra"][0].shape == (2, 2) and picked["extra"][1] == ["x", "z"]
    assert picked["names"] == ["only", "three", "here"]  # not per-sample: its length is not the batch's


def test_nested_ids_map_to_samples_through_the_recorder(tmp_path):
    run = record_mlp(tmp_path / "nested", nested_ids)
    r, terminal, _ = replay(run, tmp_path, "--what-if", f"drop-samples={S}")
    s = r["samples"]
    assert (s["status"], s["samples"]) == ("attributed", [S])
    ident = f"s{DEFECT_STEP:05d}-{S:02d}"
    assert s["sample_leaves"] == {"batch['meta']['ids']": [ident],
                                  "batch['meta']['rows']": [{"id": ident, "line": S}]}
    leaves = r["responsible_batch"]["leaves"]
    assert leaves["batch['meta']['source']"] == "train.jsonl" and len(leaves["batch['meta']['ids']"]) == 64
    assert f"batch['meta']['ids']: s{DEFECT_STEP:05d}-00 ... s{DEFECT_STEP:05d}-63 (64)" in terminal
    assert f"(batch['meta']['ids'] = ['{ident}']" in one(r["findings"], "Samples:")
    dropped = r["what_if"][1]
    assert (dropped["intervention"], dropped["finite"]) == (f"drop-samples={S}", True)


# ---- 5. findings say only what is true of this run ---------------------------------------------------------


def test_inf_second_moment_freezes_coordinates_it_does_not_nan_them(runs, tmp_path):
    r, _, _ = replay(runs["adam_state_overflow"], tmp_path, "--no-explain", "--what-if", "clip=1")
    state = one(r["findings"], f"From step {DEFECT_STEP} the optimizer state holds")
    assert "holds infinities in exp_avg_sq (" in state and "while exp_avg stayed finite" in state
    assert f"the parameters stayed finite through step {r['setup']['last_step']}" in state
    assert "frozen" in state and "NaN in the state" not in state
    assert not [f for f in r["findings"] if "beta*NaN" in f or "would not have saved" in f]
    clip = r["what_if"][1]["detail"]
    assert clip.startswith("total gradient norm inf from finite gradients") and "zeroed all" in clip
    assert "NaN" not in clip
    assert r["what_if"][0]["first_nonfinite"] == "optimizer_state exp_avg_sq of fc1.weight"  # its origin


def test_clipping_a_nan_norm_is_said_to_give_nan(runs, tmp_path):
    r, _, _ = replay(runs["clipped_near_zero"], tmp_path, "--no-explain", "--what-if", "clip=1")
    clip = r["what_if"][1]["detail"]
    assert clip.startswith("total gradient norm nan: the clip factor 1/nan is NaN, so clipping made all ")
    assert " is 0" not in clip and "or NaN" not in clip
    inside = one(r["findings"], "The step function turned the inf gradient into NaN before optimizer.step()")
    assert "clip factor max_norm/inf = 0, and 0*inf = NaN" in inside
    assert not [f for f in r["findings"] if f.startswith("Gradient clipping would not have rescued")]
    state = one(r["findings"], f"From step {DEFECT_STEP} the optimizer state holds NaN in exp_avg")
    assert "NaN in the state is absorbing" in state


def test_nan_gradient_norm_makes_the_clip_factor_nan(runs, tmp_path):
    r, _, _ = replay(runs["masked_log_zero"], tmp_path, "--no-explain")
    assert one(r["findings"], "Gradient clipping would not have rescued this").endswith(
        "the total gradient norm is NaN, so the clip factor max_norm/NaN is NaN, and clipping makes every "
        "gradient NaN.")


def test_one_backoff_and_one_caught_overflow_in_the_singular(runs, tmp_path):
    """The plural of both is in tests/test_amp.py, on the same run replayed to its end."""
    r, _, _ = replay(runs["fp16_scaler_catches"], tmp_path, "--no-explain", "--max-steps", "6")
    assert "backed off at step 14, grew at step 13." in one(r["findings"], "Loss scale")
    assert "the step was skipped" in one(r["findings"], "The scaler caught 1 overflow before")


def test_clean_run_says_no_non_finite_value_and_shows_no_data_row(runs, tmp_path):
    """The cases that apply are in tests/test_amp.py (a caught NaN loss, a data defect rendered)."""
    r, terminal, md = replay(runs["clean"], tmp_path, "--no-explain")
    first = r["setup"]["first_step"]
    assert first > 0  # a clean run's replay checks its last window: the finding says which steps it left out
    assert r["data_defects"] == [] and r["findings"] == [
        f"No non-finite value in any batch, activation, loss, gradient, optimizer state, parameter or buffer over "
        f"steps {first}-{r['setup']['last_step']}; steps before {first} were not replayed (`--from-step 0` replays "
        "from the start)."]
    assert "\n│ data " not in terminal and "**Data:**" not in md
    r, _, _ = replay(runs["clean"], tmp_path, "--no-explain", "--from-step", "0")
    assert r["findings"] == [f"No non-finite value in any batch, activation, loss, gradient, optimizer state, "
                             f"parameter or buffer over steps 0-{r['setup']['last_step']}."]


COUPLED_ALONE, COUPLED_PAIR = [2, 3], [4, 5]


def coupled_errors(step: int) -> dict[str, Any]:
    """Step 17's targets put two samples' errors past the batch likelihood's underflow alone (err**2 / 2 ~ 400), two
    more at ~72 each, which underflows only together (72 + 72 > 103); the rest stay near 1 (the model's scale)."""
    batch = scenarios.make_batch(step)
    if step == DEFECT_STEP:
        batch["y"][COUPLED_ALONE] = 30.0
        batch["y"][COUPLED_PAIR] = 12.5
    return batch


def test_a_coupled_failure_after_a_drift_names_the_drift(tmp_path):
    """A loss coupled over the batch (tests/scenarios.py's batch likelihood) under a learning rate doubling every step:
    two samples fail alone, two more only together, and more than half do not. The samples sentence says both; the
    learning rate's rise is said beside them. The margins are orders of magnitude in the likelihoods, so the sets do
    not hang on rounding."""
    run = tmp_path / "likelihood"
    model = scenarios.build_model()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-7)
    scheduler = scenarios.lr_doubling(optimizer)
    step_fn = scenarios.train_step_batch_likelihood
    with Recorder(run, model, optimizer, model_factory=scenarios.build_model, step_fn=step_fn, checkpoint_every=10,
                  scheduler=scheduler, scheduler_factory=scenarios.lr_doubling) as rec:
        for step in range(DEFECT_STEP + 3):
            batch = coupled_errors(step)
            rec.log(step, batch, step_fn(model, optimizer, batch, scheduler=scheduler))
    r, _, _ = replay(run, tmp_path)
    t, s = r["responsible_step"], r["samples"]
    assert (t, r["origin"]["stage"]) == (DEFECT_STEP, "loss")
    assert (s["status"], s["samples"], s["coupled_groups"], r["data_defects"]) == (
        "coupled", COUPLED_ALONE, [COUPLED_PAIR], [])
    samples = one(r["findings"], "Samples: ")
    a, b = COUPLED_PAIR  # judged each alone: its halves are its samples, both tried alone
    assert (f"samples {COUPLED_PAIR} fail together, and neither half of them ([{a}], [{b}]) reproduces the failure: a "
            "failure that needs samples together (") in samples and "smaller subset" not in samples
    ids = [f"s{t:05d}-{i:02d}" for i in COUPLED_ALONE]
    assert samples.endswith(f"; samples 2, 3 of {scenarios.BATCH} produce the non-finite value alone "
                            f"(batch['ids'] = {ids}).")
    drift = one(r["findings"], f"Step {t}'s batch holds no data defect and its failure needs samples together ([4, 5])")
    assert f"; over steps 0-{t - 1} before it these rose: the learning rate from 1e-07 to " in drift
    assert not [f for f in r["findings"] if "not its data" in f]


def test_the_lr_finder_fails_the_same_on_two_threads_and_the_drift_sentence_needs_a_coupled_failure(replayed,
                                                                                                    tmp_path):
    """The LR-finder run recorded on two threads fails as the one-thread run (the session's: tests/conftest.py) does:
    the same step, stage, tensor and batch-wide spread, since its margins are orders of magnitude (tests/scenarios.py's
    ``lr_finder``), not rounding. A batch-wide failure (its learning rate rose) and a coupled one where nothing rose
    before it (BatchNorm's near-zero reading) do not get the coupled-drift sentence."""
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        run = tmp_path / "two_threads"  # to a step past its first NaN loss: a second thread costs its spinning
        scenarios.record(run, "decoder_lr_finder", steps=STEPS, defect_step=DEFECT_STEP, checkpoint_every=10,
                         stop_on_nan=True)
    finally:
        torch.set_num_threads(threads)
    two_threads, _, _ = replay(run, tmp_path)
    one_thread, _, _ = replayed("decoder_lr_finder")
    assert json.loads((run / "manifest.json").read_text())["num_threads"] == 2
    for r in (one_thread, two_threads):
        assert (r["responsible_step"], r["origin"]["stage"], r["samples"]["status"]) == (5, "forward", "batch_wide")
    assert one_thread["origin"]["tensor"] == two_threads["origin"]["tensor"]
    for name, status in (("batchnorm_near_zero", "coupled"), ("decoder_lr_finder", "batch_wide")):
        r, _, _ = replayed(name)
        assert r["samples"]["status"] == status
        assert not [f for f in r["findings"] if "failure needs samples together" in f], r["findings"]
