"""Optimizer-state soundness, fact by fact, on tiny checkpoints of a real torch Adam (milliseconds each), so that
each mutant of ``checkpoints/soundness.py`` costs about a second (docs/mutation.md): a step counter against the
checkpoint's own step at both sides of each limit, in the run format (whose step counts the updates before it) and
a plain ``torch.save`` (whose step may be the one being taken); a counter reset beside moments that hold values,
with the bias correction's scale for each kind of betas; counters that differ inside a group; betas that bound
nothing."""

from __future__ import annotations

import itertools
import math
from pathlib import Path
from typing import Any

import pytest
import torch
from nanforensics.checkpoints import soundness
from nanforensics.formats import open_checkpoint
from nanforensics.numbers import root
from nanforensics.runs.checkpoint import save_checkpoint

from test_guard import one_thread  # noqa: F401 - its autouse fixture: these models are tiny

CK_STEP = 5
NAMES = ["0.weight", "0.bias", "1.weight", "1.bias"]  # two groups of two, as the model's state dict orders them
GROUP = {"0.weight": 0, "0.bias": 0, "1.weight": 1, "1.bias": 1, "2.weight": 2, "2.bias": 2}
FORMATS = ["run", "torch", "torch-without-step"]  # the run's own format: its step counts the updates before it


def _optimizer(betas: tuple[float, ...] = (0.9, 0.999)) -> tuple[torch.nn.Module, torch.optim.Adam]:
    """Adam after one real step, in three groups: the third's layer has no gradient, so it holds no state."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(2, 3), torch.nn.Linear(3, 1), torch.nn.Linear(1, 1))
    opt = torch.optim.Adam([{"params": list(layer.parameters())} for layer in model], lr=1e-2)
    model[1](model[0](torch.randn(4, 2))).pow(2).mean().backward()
    opt.step()
    for group in opt.param_groups:
        group["betas"] = betas  # after the step: torch's constructor would refuse some
    return model, opt


def _findings(tmp_path: Path, fmt: str, steps: dict[str, Any], *, zero_moments: bool = False,
              betas: tuple[float, ...] = (0.9, 0.999)) -> tuple[soundness.Soundness, list[Any]]:
    """The soundness of a checkpoint whose parameters hold these step counters (a tensor, as torch keeps it)."""
    model, opt = _optimizer(betas)
    for name, p in zip(NAMES, model.parameters()):
        opt.state[p]["step"] = torch.tensor(float(steps[name]))
        if zero_moments:
            for key in ("exp_avg", "exp_avg_sq"):
                opt.state[p][key].zero_()
    tmp_path.mkdir(parents=True, exist_ok=True)
    if fmt == "run":
        ck = save_checkpoint(tmp_path / "run", CK_STEP, model, opt)
    else:
        ck = tmp_path / "ck.pt"
        torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(),
                    **({"step": CK_STEP} if fmt == "torch" else {})}, ck)
    return soundness.check(open_checkpoint(ck))


def _same(a: Any, b: Any) -> bool:
    return repr(a) == repr(b)  # nan == nan, and 7 != 7.0 is not asked


def _expected_step(step: float, fmt: str, nonzero: bool, betas: tuple[float, ...]) -> tuple[dict, str] | None:
    """What the step check says of one parameter's counter, from the docstring's rules."""
    ck = None if fmt == "torch-without-step" else CK_STEP
    if not math.isfinite(step) or step < 0 or step != int(step):
        return {"step": step}, (f"is {step}: not a count of updates; the next update's bias correction 1 - beta^step "
                                "is then meaningless (NaN or a negative divisor)")
    if step == 0 and nonzero:
        scale = f" (the update scaled by sqrt(1-b2)/(1-b1) = {root(1 - betas[1]) / (1 - betas[0]):.2g} of what the " \
                "moments' age gives)" if len(betas) == 2 and betas[0] < 1 and 0 <= betas[1] <= 1 else ""
        return {"step": step, "checkpoint_step": ck}, (
            "is 0 while its moments hold values: the counter was reset with the moments kept; the next update's bias "
            f"correction divides them as if they held one gradient{scale}")
    if ck is not None and step > ck + (0 if fmt == "run" else 1):
        return {"step": step, "checkpoint_step": ck}, (
            f"is {step:g}, past the checkpoint's own step {ck}: the optimizer state comes from a later point of "
            "training (or another run) than the weights beside it")
    return None


STEPS = [0, 1, CK_STEP - 1, CK_STEP, CK_STEP + 1, CK_STEP + 2, 2.5, -1, -0.5, math.inf, -math.inf, math.nan]


@pytest.mark.parametrize("fmt", FORMATS)
def test_each_step_counter_is_judged_against_the_checkpoints_step(tmp_path, fmt):
    """Every parameter holds the same counter (so the group's counters agree): each value is a finding exactly where
    the rules say, with its values and words, for the parameter it belongs to."""
    for step, zero in itertools.product(STEPS, (False, True)):
        _, unsound = _findings(tmp_path / f"{step}-{zero}", fmt, dict.fromkeys(NAMES, step), zero_moments=zero)
        found = [u for u in unsound if u.check == soundness.STEP]
        expected = _expected_step(float(step), fmt, not zero, (0.9, 0.999))
        assert [u.param for u in found] == ((sorted(NAMES) if fmt == "run" else NAMES) if expected else []), \
            (step, zero, found)
        for u in found:
            values, words = expected
            assert u.group == GROUP[u.param] and u.index is None and _same(u.values, values), (step, zero, u)
            assert u.tensor == (f"{u.param}/step" if fmt == "run" else f"optimizer.state.{NAMES.index(u.param)}.step")
            assert u.message == f"step of {u.param} {words}", (step, zero, u.message)


@pytest.mark.parametrize("betas", [(0.9, 0.999), (0.0, 0.0), (0.5, 1.0), (1.0, 0.999), (0.9, 1.5), (0.9, -0.5),
                                   (1.5, 0.5), (0.9,)], ids=str)
def test_a_reset_counter_says_the_bias_corrections_scale_where_the_betas_give_one(tmp_path, betas):
    """A counter of 0 beside moments that hold values: the scale the next update's bias correction puts on them,
    where the betas make it a number (b1 < 1, b2 in [0, 1]), and no scale where they do not or are no pair."""
    _, unsound = _findings(tmp_path, "torch", dict.fromkeys(NAMES, 0), betas=betas)
    found = [u for u in unsound if u.check == soundness.STEP]
    _, words = _expected_step(0.0, "torch", True, betas)
    assert [u.message for u in found] == [f"step of {n} {words}" for n in NAMES]
    assert ("scaled by" in words) == (betas in [(0.9, 0.999), (0.0, 0.0), (0.5, 1.0)])


@pytest.mark.parametrize("fmt, values", [("run", (3, 4)), ("torch", (3, 4, math.nan))])
def test_counters_that_differ_in_a_group_are_one_finding_naming_both_ends(tmp_path, fmt, values):
    """Every assignment of two counts (and NaN, no count) to the four parameters: a group whose counts differ is one
    finding, at the parameter with the highest count (ties: the last name), naming the lowest (ties: the first name);
    a group whose counts agree is none, and a counter that is no count (its own finding) is compared with none."""
    for counts in itertools.product(values, repeat=len(NAMES)):
        steps = dict(zip(NAMES, counts))
        _, unsound = _findings(tmp_path / "".join(map(str, counts)), fmt, steps)
        found = [u for u in unsound if u.check == soundness.STEP and u.tensor.startswith("param_groups")]
        expected = []
        for g in (0, 1):
            members = sorted((float(s), n) for n, s in steps.items() if GROUP[n] == g and not math.isnan(s))
            lo, hi = (members[0], members[-1]) if members else ((0, ""), (0, ""))
            if lo[0] != hi[0]:
                expected.append((f"param_groups[{g}].step", hi[1], g, {"min": lo[0], "max": hi[0], "min_param": lo[1]},
                                 f"group {g}'s step counters differ: {lo[1]} at {lo[0]:g}, {hi[1]} at {hi[0]:g}: "
                                 "unless some parameters had no gradient at some steps (torch skips them), the state "
                                 "was put together from different points of training, and the next update corrects "
                                 "each bias by its own count"))
        assert [(u.tensor, u.param, u.group, u.values, u.message) for u in found] == expected, counts
        assert all(u.index is None for u in found)


@pytest.mark.parametrize("fmt", FORMATS[:2])
@pytest.mark.parametrize("betas", [(0.9, 0.999), (0.99, 0.9), (0.9, 0.81), (1.0, 0.5)], ids=str)
def test_betas_that_bound_nothing_are_a_note_for_each_adam_group_with_state(tmp_path, fmt, betas):
    """b1^2 >= b2 (or b1 out of range): Adam's bound is not checked, and the notes say so for each group recognised as
    Adam's; the third group holds no state (its layer had no gradient), so nothing recognised it."""
    summary, _ = _findings(tmp_path, fmt, dict.fromkeys(NAMES, 1), betas=betas)
    bounded = soundness.adam_bound(*betas) is not None
    notes = [n for n in summary.notes if "Adam's bound not checked" in n]
    assert notes == ([] if bounded else [
        f"group {g}: betas {betas[0]:g}, {betas[1]:g} give no bound on |exp_avg| (it needs 0 <= b1 < 1, 0 < b2 < 1 "
        "and b1^2 < b2): Adam's bound not checked" for g in (0, 1)])


@pytest.mark.parametrize("fmt", FORMATS[:2])
def test_each_groups_hyperparameters_are_judged_as_that_group(tmp_path, fmt):
    """An lr out of range in one group at a time is a finding of that group alone."""
    for g in range(3):
        model, opt = _optimizer()
        opt.param_groups[g]["lr"] = -1.0
        if fmt == "run":
            ck = save_checkpoint(tmp_path / f"run{g}", CK_STEP, model, opt)
        else:
            ck = tmp_path / f"ck{g}.pt"
            torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(), "step": CK_STEP}, ck)
        _, unsound = soundness.check(open_checkpoint(ck))
        assert [(u.check, u.tensor, u.group) for u in unsound] == [
            (soundness.HYPERPARAMETER, f"param_groups[{g}].lr", g)], g
