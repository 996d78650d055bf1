"""Optimizer-state soundness, fact by fact, on tiny checkpoints of a real torch Adam (milliseconds each), so that
each mutant of ``checkpoints/soundness.py`` costs about a second (docs/mutation.md): a step counter against the
checkpoint's own step at both sides of each limit, in the run format (whose step counts the updates before it) and
a plain ``torch.save`` (whose step may be the one being taken); a counter reset beside moments that hold values,
with the bias correction's scale for each kind of betas; counters that differ inside a group; betas that bound
nothing; the layout of every format the reader knows; where a replay's origin lies on each kind of finding, and what
a reset zeroes."""

from __future__ import annotations

import itertools
import math
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from nanforensics.checkpoints import chunks, soundness
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
                                   (1.5, 0.5), (0.9, 0.999, 0.9999)], ids=str)
def test_a_reset_counter_says_the_bias_corrections_scale_where_the_betas_give_one(tmp_path, betas):
    """A counter of 0 beside moments that hold values: the scale the next update's bias correction puts on them,
    where the betas make it a number (b1 < 1, b2 in [0, 1]), and no scale where they do not or are no pair (three:
    AdEMAMix's; one beta is refused before, inputs.HYPERPARAMETERS)."""
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


# ---- naming the state by the model's order (a checkpoint whose optimizer state names no parameters) -----------------

SHAPES = {"A": (2,), "B": (3,), "S": (), "C": (4,)}  # S: a scalar; C: no model tensor's; "-": a parameter without state


def _by_order(model: list[str], state: str, groups: int = 1) -> dict[str, Any]:
    """A plain checkpoint: the model's tensors of these shapes (a nested BatchNorm buffer after the first, skipped by
    its name), the optimizer's state for parameters of these shapes, in one group or two; an unknown key first in
    each state (it fits any parameter), the step an int (older torch) or a 0-d tensor, which fits any."""
    tensors: dict[str, torch.Tensor] = {}
    for i, s in enumerate(model):
        tensors[f"t{i}.weight"] = torch.zeros(SHAPES[s])
        if i == 0:
            tensors["net.norm.running_mean"] = torch.zeros(5)
    states = {i: {"foo": torch.zeros(7), "exp_avg": torch.zeros(SHAPES[s]), "step": torch.tensor(1.0) if i else 1}
              for i, s in enumerate(state) if s != "-"}
    ids = list(range(len(state)))
    param_groups = [{"params": ids, "lr": 0.1}] if groups == 1 else [{"params": ids[:1]}, {"params": ids[1:]}]
    return {"model": tensors, "optimizer": {"state": states, "param_groups": param_groups}}


def _fit(state: str, param: str) -> bool:
    return state == "-" or state == param


def _expected_order(model: list[str], state: str, groups: int) -> tuple[list[str], bool, str, Any]:
    """Labels, named, why not, misfit, by brute force over every way to skip model tensors: named where exactly one
    way fits; where none does, the longest prefix some way fits, against the tensor its leftmost way reaches next."""
    n = len(state)
    ways = [c for c in itertools.combinations(range(len(model)), n) if all(_fit(s, model[j]) for s, j in zip(state, c))]
    if len(ways) == 1:
        return [f"t{j}.weight" for j in ways[0]], True, "", None
    unnamed = [f"#{i}" for i in range(n)]
    if ways:
        return unnamed, False, (f"the model's state dict holds {len(model) - n} tensors beyond the optimizer's "
                                "parameters, and more than one choice of them as buffers fits the state's shapes"), None
    surplus = len(model) - n  # a prefix's way leaves the rest of the state room: at most surplus skipped
    prefixes = [(p, c) for p in range(n, -1, -1) for c in itertools.combinations(range(len(model)), p)
                if all(_fit(s, model[j]) and j - i <= surplus for i, (s, j) in enumerate(zip(state, c)))]
    p = prefixes[0][0]
    skipped = min((c[-1] - (p - 1) for q, c in prefixes if q == p and c), default=0)
    name, shape = f"t{p + skipped}.weight", list(SHAPES[model[p + skipped]])
    misfit = soundness.Misfit(p, "exp_avg", list(SHAPES[state[p]]), name, shape) if groups == 1 else None
    why = (f"matched by order to the model's state dict, position {p}'s exp_avg {list(SHAPES[state[p]])} does not fit "
           f"{name} {shape}" + ("" if groups == 1 else ", and with several groups their order need not be the model's"))
    return unnamed, False, why, misfit


def test_the_state_is_named_by_the_models_order_only_where_one_alignment_fits():
    """Every model of three tensors of three shapes (one a scalar's) against every state of up to three parameters
    of those shapes, a shape the model lacks, or none: named as the one alignment names them, else left #i with why
    (several fit; none does: the misfit, a finding with one group, a note with two)."""
    for model in itertools.product("ABS", repeat=3):
        for n in range(4):
            for state in map("".join, itertools.product("ABSC-", repeat=n)):
                for groups in (1, 2) if n > 1 else (1,):
                    layout = soundness._of_object(_by_order(list(model), state, groups), None)
                    labels, named, why, misfit = _expected_order(list(model), state, groups)
                    got = ([p.label for p in layout.params.values()], layout.named, layout.why_unnamed, layout.misfit)
                    assert got == (labels, named, why, misfit), (model, state, groups)
                    assert layout.by_order == named and [p.group for p in layout.params.values()] == (
                        [0] * n if groups == 1 else [0] + [1] * (n - 1))


@pytest.mark.parametrize("size", [0, soundness.MAX_SKIPPED + 1, soundness.MAX_SKIPPED + 2])
def test_a_model_too_small_or_too_large_to_match_by_order_says_so(size):
    """Up to MAX_SKIPPED tensors beyond the optimizer's parameters are told apart by shape (here the last alone fits);
    more, or fewer tensors than parameters (BatchNorm's buffers not counted), are not matched at all."""
    model = {"norm.running_var": torch.zeros(2)} | {f"t{i}.weight": torch.zeros(2 if i == size - 1 else 3)
                                                     for i in range(size)}
    obj = {"model": model, "optimizer": {"state": {0: {"exp_avg": torch.zeros(2)}}, "param_groups": [{"params": [0]}]}}
    layout = soundness._of_object(obj, None)
    labels = [p.label for p in layout.params.values()]
    if size <= soundness.MAX_SKIPPED + 1 and size:
        assert layout.named and labels == [f"t{size - 1}.weight"] and layout.why_unnamed == ""
        return
    assert not layout.named and labels == ["#0"]
    assert layout.why_unnamed == (f"the optimizer holds 1 parameters, the model's state dict {size} tensors besides "
                                  f"BatchNorm's buffers: too {'many others' if size else 'few'} to match them by order")


def test_without_a_model_beside_it_the_state_keeps_its_positions():
    """No model state dict (none, an empty one, one holding something else than tensors): positions, and why."""
    for model in ({}, {"t.weight": torch.zeros(2), "t.note": "text"}, None):
        obj = {"optimizer": {"state": {0: {"exp_avg": torch.zeros(2)}}, "param_groups": [{"params": [0]}]}}
        layout = soundness._of_object(obj | ({"model": model} if model is not None else {}), None)
        assert not layout.named and [p.label for p in layout.params.values()] == ["#0"]
        assert layout.why_unnamed == "the checkpoint holds no model state dict beside it to match them with"


# ---- the layout of a loaded checkpoint's one optimizer state dict -------------------------------------------------


def _sd(ids: list[Any], names: list[str] | None = None, state: dict[Any, Any] | None = None, **hyper: Any) -> dict:
    group: dict[str, Any] = {"params": ids, **hyper} | ({"param_names": names} if names is not None else {})
    return {"state": {0: {"step": 3, "exp_avg": torch.zeros(2)}} if state is None else state, "param_groups": [group]}


LIGHTNING = {"pytorch-lightning_version": "2.5", "state_dict": {"t.weight": torch.zeros(2), "t.tag": "x"}}
LAYOUTS: dict[str, tuple[Any, list[str] | None, Any]] = {  # object, order names: labels by key, named, scaler
    "named": ({"optimizer": _sd([0, 1], ["a.w", "b.w"], lr=0.5)}, None,
              ({"optimizer.state.a.w": ("a.w", {"step": 3}), "optimizer.state.b.w": ("b.w", {})}, True, None)),
    "names short": ({"optimizer": _sd([0, 1], ["a.w"])}, None,
                    ({"optimizer.state.a.w": ("a.w", {"step": 3}), "optimizer.state.1": ("1", {})}, False, None)),
    "names not a list": ({"optimizer": _sd([0], "a.w")}, None, ({"optimizer.state.0": ("#0", {"step": 3})}, False, None)),
    "by order given": ({"optimizer": _sd([0, 1, 2])}, ["p", "q"],
                       ({"optimizer.state.0": ("p", {"step": 3}), "optimizer.state.1": ("q", {}),
                         "optimizer.state.2": ("#2", {})}, False, None)),
    "ids of every kind": ({"optimizer": _sd([0, "k", 1.5], state={0: "junk", "k": {"step": 1, "lr": "x"},
                                                                 1.5: {"step": 9}})}, None,
                          ({"optimizer.state.0": ("#0", {}), "optimizer.state.k": ("#1", {"step": 1, "lr": "x"}),
                            "optimizer.state.1.5": ("#2", {})}, False, None)),
    "lightning": (LIGHTNING | {"optimizer_states": [_sd([0])]}, None,
                  ({"optimizer_states.0.state.0": ("t.weight", {"step": 3})}, True, None)),
    "nested, with a scaler": ({"scaler": 3.0, "grad_scaler": {"scale": 2.0}, "amp_scaler": {"scale": 1.0},
                               "train": [{"optimizer": _sd([0])}]}, None,
                              ({"train.0.optimizer.state.0": ("#0", {"step": 3})}, False, {"scale": 2.0})),
    "in a list": ([{"model": {"t.weight": torch.zeros(2)}}, _sd([0])], None,
                  ({"1.state.0": ("#0", {"step": 3})}, False, None)),  # no model beside it: one in the list is not
    "a model kept under 'state'": ({"state": {"t.weight": torch.zeros(2)}, "optimizer": _sd([0])}, None,
                                   ({"optimizer.state.0": ("#0", {"step": 3})}, False, None)),  # a dict, no groups
    "two optimizers": ({"a": _sd([0]), "b": _sd([0])}, None, None),
    "lightning, two optimizers": (LIGHTNING | {"optimizer_states": [_sd([0]), _sd([1])]}, None, None),
    "none": ({"model": {"t.weight": torch.zeros(2)}}, None, None),
    "groups not lists of params": ({"optimizer": {"state": {}, "param_groups": [{"params": 0}]}}, None, None),
    "a group not a dict": ({"optimizer": {"state": {}, "param_groups": [[0]]}}, None, None),
}


@pytest.mark.parametrize("case", list(LAYOUTS))
def test_the_layout_of_one_optimizer_state_dict(case):
    """Labels by the group's names where every group names every parameter, else the order names given, else #i
    (each kept where the model cannot name them: no model here but Lightning's, whose one tensor fits); state
    looked up only by an int or str id and only where it is a dict, its non-tensors kept as scalars; the first
    scaler dict; None where there is no one optimizer state dict, or its groups are not lists of parameters."""
    obj, order_names, expected = LAYOUTS[case]
    layout = soundness._of_object(obj, order_names)
    if expected is None:
        assert layout is None
        return
    params, named, scaler = expected
    assert {k: (p.label, p.scalars) for k, p in layout.params.items()} == params
    assert [list(p.scalars) for p in layout.params.values()] == [list(s) for _, s in params.values()]
    assert all(p.group == 0 for p in layout.params.values())
    assert (layout.named, layout.scaler, layout.exact_step) == (named, scaler, False)
    assert layout.groups == [{k: v for k, v in g.items() if k not in ("params", "param_names")}
                             for g in next(soundness._optimizer_dicts(obj))[1]["param_groups"]]


def test_a_group_without_names_leaves_every_group_unnamed():
    """Names in one group and not in the other: the state is matched by order (here: nothing to match with)."""
    sd = {"state": {}, "param_groups": [{"params": [0], "param_names": ["a.w"], "lr": 1.0}, {"params": [1], "lr": 2.0}]}
    layout = soundness._of_object({"optimizer": sd}, None)
    assert not layout.named and layout.groups == [{"lr": 1.0}, {"lr": 2.0}]
    assert [(p.label, p.group) for p in layout.params.values()] == [("a.w", 0), ("#1", 1)]


# ---- the words of an elementwise finding --------------------------------------------------------------------------

BOUND_WORDS = ("these moments did not come from the same gradients (one restored without the other, rescaled or "
               "corrupted), unless the run changed its betas; the next update there is m/(sqrt(v)+eps) = ")
NEGATIVE_WORDS = ("a second moment is an average of squares and cannot be negative; the next update takes its square "
                  "root there: NaN, unless that step's gradient outweighs it")
# check, key, hyperparameters, values at the first coordinate, count: the message, its numbers worked by hand
MESSAGES = [
    # k(0.9, 0.999) = 0.1 / sqrt(0.001 * (1 - 0.81 / 0.999)) = 7.27; the update |m| / max(eps, sqrt v) = 2 / 0.1 = 20
    (soundness.BOUND, "exp_avg", {"betas": (0.9, 0.999), "lr": 0.01, "eps": 1e-8}, {"exp_avg": -2.0, "exp_avg_sq": 0.01},
     3, "exp_avg of w breaks Adam's bound at [1, 2] (3 coordinates in all): |m| = 2 > 7.27 * sqrt(v) = 0.727 (v = 0.01, "
        f"betas 0.9, 0.999): {BOUND_WORDS}20 times lr (about 0.2 from this pair alone; a sound pair moves it at most "
        "about 0.0727)"),
    # no eps, v = 0: divided by the smallest positive float32 (1e-45); no lr: no distance
    (soundness.BOUND, "exp_avg", {"betas": (0.9, 0.999)}, {"exp_avg": 3.0, "exp_avg_sq": 0.0}, 1,
     "exp_avg of w breaks Adam's bound at [1, 2]: |m| = 3 > 7.27 * sqrt(v) = 0 (v = 0, betas 0.9, 0.999): "
     f"{BOUND_WORDS}3e+45 times lr"),
    # k(0.5, 0.5) = 0.5 / sqrt(0.5 * 0.5) = 1; eps 0.5 above sqrt(v) = 0.2 divides; an lr of inf: no distance
    (soundness.BOUND, "exp_avg", {"betas": (0.5, 0.5), "lr": math.inf, "eps": 0.5}, {"exp_avg": 1.0, "exp_avg_sq": 0.04},
     2, "exp_avg of w breaks Adam's bound at [1, 2] (2 coordinates in all): |m| = 1 > 1 * sqrt(v) = 0.2 (v = 0.04, "
        f"betas 0.5, 0.5): {BOUND_WORDS}2 times lr"),
    # k(0, 0.25) = 1 / sqrt(0.75) = 1.15; a negative v counts as 0 (its own finding), eps 0: 1 / 1e-45
    (soundness.BOUND, "exp_avg", {"betas": (0.0, 0.25), "lr": 2.0, "eps": 0.0}, {"exp_avg": 1.0, "exp_avg_sq": -0.25},
     2, "exp_avg of w breaks Adam's bound at [1, 2] (2 coordinates in all): |m| = 1 > 1.15 * sqrt(v) = 0 (v = -0.25, "
        f"betas 0, 0.25): {BOUND_WORDS}1e+45 times lr (about 2e+45 from this pair alone; a sound pair moves it at most "
        "about 2.31)"),
    (soundness.NEGATIVE, "square_avg", {}, {"square_avg": -0.123456}, 1,
     f"square_avg of w is -0.1235 at [1, 2]: {NEGATIVE_WORDS}"),
    (soundness.NEGATIVE, "exp_avg_sq", {}, {"exp_avg_sq": -2.5, "exp_avg": 1.0}, 2,
     f"exp_avg_sq of w is -2.5 at [1, 2] (2 coordinates in all): {NEGATIVE_WORDS}"),
    (soundness.AMSGRAD, "max_exp_avg_sq", {}, {"max_exp_avg_sq": 0.25, "exp_avg_sq": 0.5}, 4,
     "max_exp_avg_sq of w is 0.25 at [1, 2] (4 coordinates in all), below exp_avg_sq 0.5: amsgrad keeps the running "
     "maximum, so these were not saved together; the next update takes the larger and goes on, from a state training "
     "did not produce"),
]


@pytest.mark.parametrize("check, key, hyper, values, n, message", MESSAGES, ids=range(len(MESSAGES)))
def test_each_elementwise_finding_says_its_values_and_what_the_next_update_does(check, key, hyper, values, n, message):
    """The message of each elementwise check: the value(s) at the first flagged coordinate, how many in all (where
    more than one), and for Adam's bound the update those moments make, and how far it moves the parameter."""
    assert soundness._message(check, key, "w", [1, 2], soundness._Tally(n, 5, values), hyper) == message


# ---- a state tensor against its parameter, where the checkpoint names them ----------------------------------------

PARAM = (3, 2)
DTYPE_WORDS = {  # state dtype, parameter dtype: rounding and flushing of the state's dtype, worked by hand
    (torch.bfloat16, torch.float32): "(relative rounding up to 0.004)", (torch.float16, torch.float32):
    "(relative rounding up to 0.0005, values below 6e-05 flushed towards 0)", (torch.bfloat16, torch.float16):
    "(relative rounding up to 0.004)", (torch.float16, torch.bfloat16): "(relative rounding up to 0.0005, values "
    "below 6e-05 flushed towards 0)"}


def _layout_findings(tmp_path: Path, key: str, shape: tuple[int, ...], dtype: torch.dtype, param_dtype: torch.dtype,
                     model_names: tuple[str, ...] = ("weight",)) -> list[Any]:
    """A checkpoint whose parameter ``weight`` (in the model under these names) holds one state tensor."""
    torch.save({"model": {n: torch.zeros(PARAM, dtype=param_dtype) for n in model_names},
                "optimizer": {"state": {0: {"step": torch.tensor(1.0), key: torch.zeros(shape, dtype=dtype)}},
                              "param_groups": [{"params": [0], "param_names": ["weight"], "lr": 0.1}]}, "step": 1},
               tmp_path / "ck.pt")
    return [u for u in soundness.check(open_checkpoint(tmp_path / "ck.pt"))[1] if u.check != soundness.STEP]


def test_each_state_tensor_is_checked_against_its_parameters_shape_and_dtype(tmp_path):
    """Per-element state (exp_avg) has the parameter's shape, a factored moment (row_var) its rank with dims of 1 or
    the parameter's; an unknown key and integer tensors are not judged; a dtype with a larger rounding or a smaller
    range than the parameter's is a finding, with what the conversion lost."""
    fits = {"exp_avg": {PARAM}, "row_var": {PARAM, (1, 2), (3, 1), (1, 1)}}
    for key, shape, dtype, param_dtype in itertools.product(
            ("exp_avg", "row_var", "foo"), (PARAM, (2, 3), (1, 2), (6,)),
            (torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64), (torch.float32, torch.float16)):
        found = _layout_findings(tmp_path, key, shape, dtype, param_dtype)
        judged = key in fits and dtype.is_floating_point
        expected = []
        if judged and shape not in fits[key]:
            expected.append((soundness.SHAPE, {"state_shape": list(shape), "param_shape": list(PARAM)},
                             f"{key} of weight is {list(shape)}, its parameter {list(PARAM)}: it belongs to another "
                             "parameter (or another model); torch's load_state_dict takes it unchecked, and the next "
                             "update fails to broadcast it or broadcasts it into a wrong update"))
        if judged and (dtype, param_dtype) in DTYPE_WORDS:
            dt, pt = str(dtype)[6:], str(param_dtype)[6:]
            expected.append((soundness.DTYPE, {"state_dtype": dt, "param_dtype": pt},
                             f"{key} of weight is {dt}, its parameter {pt}: torch keeps state in the parameter's dtype, "
                             "so this was converted on the way (on saving, or by a tool since) and lost precision "
                             f"{DTYPE_WORDS[dtype, param_dtype]}; load_state_dict casts it back, and the next update "
                             "runs on the rounded moments"))
        assert [(u.check, u.values, u.message) for u in found] == expected, (key, shape, dtype, param_dtype)
        assert all((u.tensor, u.param, u.group, u.index) == (f"optimizer.state.weight.{key}", "weight", 0, None)
                   for u in found)


MISSING = "shapes and dtypes not checked for 1 parameter the model's state dict holds no tensor of: weight"
SEVERAL = "shapes and dtypes not checked for 1 parameter whose name several model tensors end in: weight ({})"


@pytest.mark.parametrize("names, note", [(("weight",), None), (("module.weight",), None),
                                         (("a.weight", "weight", "b.weight"), None),
                                         (("a.weight", "b.weight"), SEVERAL.format("model.a.weight, model.b.weight")),
                                         (("a.weight", "x.a.weight", "b.weight"),
                                          SEVERAL.format("model.a.weight, model.b.weight")),
                                         (("weights",), MISSING), (("module.xweight",), MISSING)], ids=str)
def test_a_parameter_is_found_in_the_model_by_its_name_or_one_suffix_and_the_notes_say_where_not(tmp_path, names, note):
    """The model's tensor of the state's name, or else the one of the fewest parts whose name ends in ``.`` and it (the
    checkpoint's ``model.`` prefix, a wrapper's; the top-level weight, not a's): checked against it. Two such, or none:
    nothing to check against, and a note says which parameter was left out and why (the tensors its name could be)."""
    found = _layout_findings(tmp_path, "exp_avg", (2, 3), torch.float32, torch.float32, names)
    assert [u.check for u in found] == ([soundness.SHAPE] if note is None else [])
    notes = soundness.check(open_checkpoint(tmp_path / "ck.pt"))[0].notes
    assert notes == ([] if note is None else [note])


def test_the_notes_name_three_parameters_left_out_and_count_them_all(tmp_path):
    """Four named parameters the model holds no tensor of, three whose name two of its tensors end in: each note counts
    its parameters and names the first three, '...' for more."""
    names = ["p0", "p1", "q0", "q1", "q2", "p2", "p3"]
    model = {f"{w}.{n}": torch.zeros(2) for n in names if n[0] == "q" for w in ("a", "b")} | {"ok": torch.zeros(2)}
    torch.save({"model": model, "optimizer": {"state": {i: {"exp_avg": torch.zeros(2)} for i in range(len(names))},
                                              "param_groups": [{"params": list(range(len(names))), "param_names": names}]}},
               tmp_path / "ck.pt")
    assert soundness.check(open_checkpoint(tmp_path / "ck.pt"))[0].notes == [
        "shapes and dtypes not checked for 4 parameters the model's state dict holds no tensor of: p0, p1, p2 ...",
        "shapes and dtypes not checked for 3 parameters whose name several model tensors end in: q0 (model.a.q0, "
        "model.b.q0); q1 (model.a.q1, model.b.q1); q2 (model.a.q2, model.b.q2)"]


# ---- what the check says of the whole checkpoint ------------------------------------------------------------------

UNNAMED = ("the optimizer state names no parameters (matched to them by order): shapes and dtypes are not checked "
           "against the parameters, and a parameter is named by its position (#i)")
WHOLE = {  # object saved: optimizers, notes, matched by order
    "named": ({"optimizer": _sd([0], ["t0.weight"], {0: {"exp_avg": torch.zeros(2), "exp_avg_sq": torch.zeros(2)}},
                                         betas=(0.9, 0.999))}, ["Adam-family (Adam, AdamW, NAdam, RAdam)"],
              ["the checkpoint holds no model tensors: shapes and dtypes are not checked against the parameters"], False),
    "by order": (_by_order(["A"], "A"), ["other (checked: non-negative second moments, shapes, dtypes, step, "
                                         "hyperparameters)"],
                 ["the optimizer state names no parameters: their names come from the model's state dict by order (as "
                  "optimizer.load_state_dict matches them), verified by the shapes of every state tensor"], True),
    "no model": ({"optimizer": _sd([0, 1], None, {0: {"momentum_buffer": torch.zeros(2)}}, momentum=0.9)}, ["SGD with momentum"],
                 [UNNAMED + ": the checkpoint holds no model state dict beside it to match them with"], True),
    "kinds by state, else by hyperparameters": ({"optimizer": {"state": {0: {"momentum_buffer": torch.zeros(2)}},
                                                               "param_groups": [{"params": [0], "betas": (0.9, 0.999)},
                                                                                {"params": [1], "momentum": 0.9}]}},
                                                ["SGD with momentum"] * 2, [UNNAMED + ": the checkpoint holds no model "
                                                                             "state dict beside it to match them with"],
                                                True),
    "two optimizers": ({"a": _sd([0]), "b": _sd([0])}, [],
                       ["the checkpoint records no parameter groups: Adam's bound, the step and the hyperparameters are "
                        "not checked, only non-negative second moments and amsgrad's maximum"], False),
}


@pytest.mark.parametrize("case", list(WHOLE))
def test_what_was_checked_and_how_the_state_was_named(tmp_path, case):
    """Each group's kind (by its state, else its hyperparameters), the notes on what was not checked and why, and
    whether the state was matched by order."""
    obj, kinds, notes, by_order = WHOLE[case]
    torch.save(obj | {"step": 3}, tmp_path / "ck.pt")
    summary, _ = soundness.check(open_checkpoint(tmp_path / "ck.pt"))
    assert (summary.optimizers, summary.notes, summary.matched_by_order) == (kinds, notes, by_order)


def test_a_misfit_by_order_is_a_finding_at_its_position(tmp_path):
    """One group, position 1's state fits no model tensor the order leaves it: a shape finding naming both."""
    torch.save(_by_order(["A", "B", "A"], "AC") | {"step": 3}, tmp_path / "ck.pt")
    summary, unsound = soundness.check(open_checkpoint(tmp_path / "ck.pt"))
    assert [(u.check, u.tensor, u.param, u.group, u.index, u.values, u.message) for u in unsound] == [(
        soundness.SHAPE, "optimizer.state.1.exp_avg", "#1", 0, None,
        {"position": 1, "state_shape": [4], "param": "t1.weight", "param_shape": [3]},
        "the optimizer state at position 1 (exp_avg [4]) does not fit the model's parameter at that position, "
        "t1.weight [3]: optimizer.load_state_dict matches state to parameters by order, so a resume hands it a state of "
        "another shape (an error at the next update, or a wrong broadcast); the state belongs to another model, or "
        "parameters were added, removed or reordered since it was saved")]
    assert summary.notes == [UNNAMED + ": matched by order to the model's state dict, position 1's exp_avg [4] does "
                                       "not fit t1.weight [3]"]


def test_a_misfit_names_the_first_state_tensor_that_does_not_fit():
    """exp_avg fits the parameter and exp_avg_sq does not (a factored row_var fits, and comes first): the misfit names
    exp_avg_sq, against the model's tensor at that position."""
    obj = {"model": {"t0.weight": torch.zeros(2)}, "optimizer": {"param_groups": [{"params": [0]}], "state": {0: {
        "row_var": torch.zeros(1), "exp_avg": torch.zeros(2), "exp_avg_sq": torch.zeros(3)}}}}
    layout = soundness._of_object(obj, None)
    assert layout.misfit == soundness.Misfit(0, "exp_avg_sq", [3], "t0.weight", [2])


# ---- the elementwise findings of one parameter: where, how many, the values there ---------------------------------

CELLS = [(i, j) for i in range(3) for j in range(2)]  # a (3, 2) parameter's coordinates, in storage order


def _elementwise(tmp_path: Path, v: torch.Tensor, m: torch.Tensor, eps: float, amsgrad: bool) -> list[Any]:
    state = {"step": torch.tensor(2.0), "exp_avg": m, "exp_avg_sq": v} | ({"max_exp_avg_sq": v.clone()} if amsgrad else {})
    torch.save({"model": {"weight": torch.zeros(PARAM)}, "step": 2, "optimizer": {"state": {0: state}, "param_groups": [
        {"params": [0], "param_names": ["weight"], "betas": (0.9, 0.999), "eps": eps, "amsgrad": amsgrad}]}},
        tmp_path / "ck.pt")
    return soundness.check(open_checkpoint(tmp_path / "ck.pt"))[1]


@pytest.mark.parametrize("chunk", [chunks.CHUNK_BYTES, 8], ids=["one chunk", "two values a chunk"])
def test_each_set_of_flagged_coordinates_is_one_finding_at_the_first(tmp_path, monkeypatch, chunk):
    """Every one or two coordinates of a (3, 2) second moment negative: one finding per tensor, at the first of them
    (row-major), with every moment's value there and the count over every chunk; amsgrad's maximum, a copy, negative
    alike."""
    monkeypatch.setattr(chunks, "CHUNK_BYTES", chunk)
    for cells in itertools.chain(itertools.combinations(CELLS, 1), itertools.combinations(CELLS, 2)):
        v = torch.ones(PARAM)
        for c in cells:
            v[c] = -float(CELLS.index(c) + 1)
        m = torch.full(PARAM, 0.5)
        for amsgrad in (False, True):
            found = _elementwise(tmp_path, v, m, 1e-8, amsgrad)
            first = list(cells[0])
            values = {"exp_avg": 0.5, "exp_avg_sq": v[cells[0]].item()} | (
                {"max_exp_avg_sq": v[cells[0]].item()} if amsgrad else {})
            more = f" ({len(cells)} coordinates in all)" if len(cells) > 1 else ""
            keys = ["exp_avg_sq", "max_exp_avg_sq"] if amsgrad else ["exp_avg_sq"]
            assert [(u.check, u.tensor, u.index, u.values, u.message) for u in found] == [
                (soundness.NEGATIVE, f"optimizer.state.weight.{k}", first, values,
                 f"{k} of weight is {v[cells[0]].item():.4g} at {first}{more}: {NEGATIVE_WORDS}") for k in keys], cells


def test_eps_zero_beside_exact_zeros_is_one_finding_at_the_first(tmp_path):
    """eps = 0 and second moments holding exact zeros (amsgrad: its maximum, the denominator): at the first zero,
    the count, and 0/0 where exp_avg is 0 there too; eps > 0, or no zero, is none."""
    for cells in [(c, CELLS[-1]) for c in CELLS[:-1]]:  # each first zero, the last coordinate a second
        v = torch.ones(PARAM)
        for c in cells:
            v[c] = 0.0
        for m0, amsgrad, eps in itertools.product((0.0, 0.5), (False, True), (0.0, 1e-8)):
            m = torch.zeros(PARAM)
            m[cells[0]] = m0
            found = [u for u in _elementwise(tmp_path, v, m, eps, amsgrad) if u.check == soundness.EPS_ZERO]
            key = "max_exp_avg_sq" if amsgrad else "exp_avg_sq"
            values = {"exp_avg": m0, "exp_avg_sq": 0.0} | ({"max_exp_avg_sq": 0.0} if amsgrad else {})
            effect = "0/0 = NaN" if m0 == 0 else "inf (and 0/0 = NaN where exp_avg is 0)"
            assert [(u.tensor, u.index, u.values, u.message) for u in found] == ([] if eps else [(
                f"optimizer.state.weight.{key}", list(cells[0]), values,
                f"{key} of weight holds 2 exact zeros (first at {list(cells[0])}) and the group's eps is 0: the update "
                f"divides by sqrt(v)+eps = 0 there, so the first zero gradient at such a coordinate makes it {effect}")])


def test_names_given_by_order_say_no_more_than_that(tmp_path):
    """The replay's order names the state (``start_soundness``): no reason to add, the findings under those names."""
    torch.save({"optimizer": _sd([0], None, {0: {"exp_avg_sq": -torch.ones(2)}})}, tmp_path / "ck.pt")
    summary, unsound = soundness.check(open_checkpoint(tmp_path / "ck.pt"), ["net.w"])
    assert summary.notes == [UNNAMED] and summary.matched_by_order
    assert [(u.check, u.param) for u in unsound] == [(soundness.NEGATIVE, "net.w")]


@pytest.mark.parametrize("m, flagged", [(7.5625, False), (7.625, True)])
def test_bfloat16_moments_are_judged_at_bfloat16s_slack(tmp_path, m, flagged):
    """Adam's bound at betas 0.9, 0.999 is 7.27 sqrt(v); bfloat16 moments get its slack for their dtype, 4.13% (five
    units in their last place, and the check's own rounding): beside v = 1, |m| = 7.5625 (4.02% past the bound) is
    rounding, the next bfloat16 above it, 7.625 (4.88%), is not. At float32's slack both would be flagged."""
    state = {"step": torch.tensor(2.0), "exp_avg": torch.full(PARAM, m, dtype=torch.bfloat16),
             "exp_avg_sq": torch.ones(PARAM, dtype=torch.bfloat16)}
    torch.save({"model": {"weight": torch.zeros(PARAM, dtype=torch.bfloat16)}, "step": 2, "optimizer": {
        "state": {0: state}, "param_groups": [{"params": [0], "param_names": ["weight"], "betas": (0.9, 0.999)}]}},
        tmp_path / "ck.pt")
    found = soundness.check(open_checkpoint(tmp_path / "ck.pt"))[1]
    assert [(u.check, u.index) for u in found] == ([(soundness.BOUND, [0, 0])] if flagged else [])


@pytest.mark.parametrize("v, maximum, flagged", [
    ((torch.float32, 1 + 2.0 ** -20), (torch.bfloat16, 1.0), False), ((torch.float32, 1 + 2.0 ** -20),
                                                                      (torch.bfloat16, 0.99), True),
    ((torch.float64, 1 + 2.0 ** -40), (torch.float32, 1.0), False)], ids=["bfloat16, equal", "bfloat16, below",
                                                                          "float32, equal"])
def test_moments_of_different_dtypes_are_compared_at_the_coarsest(tmp_path, v, maximum, flagged):
    """amsgrad's maximum saved in a coarser dtype than exp_avg_sq (a float64 exp_avg beside them): the order is
    judged after rounding both to the coarsest, where 1 is not below 1 + 2^-20 (bfloat16) or 1 + 2^-40 (float32);
    0.99 (0.988 in bfloat16) is."""
    state = {"step": torch.tensor(2.0), "exp_avg": torch.zeros(PARAM, dtype=torch.float64),
             "exp_avg_sq": torch.full(PARAM, v[1], dtype=v[0]),
             "max_exp_avg_sq": torch.full(PARAM, maximum[1], dtype=maximum[0])}
    torch.save({"optimizer": {"state": {0: state}, "param_groups": [{"params": [0], "betas": (0.9, 0.999),
                                                                     "amsgrad": True}]}}, tmp_path / "ck.pt")
    found = soundness.check(open_checkpoint(tmp_path / "ck.pt"))[1]
    assert [(u.check, u.index, u.values) for u in found] == ([(soundness.AMSGRAD, [0, 0], {
        "exp_avg": 0.0, "exp_avg_sq": 1.0, "max_exp_avg_sq": 0.98828125})] if flagged else [])


def test_each_kind_of_state_is_read_in_its_own_pass(tmp_path):
    """An int step (older torch) judged like a tensor's; a factored moment read apart from the larger state beside it;
    a one-element parameter's moments without its 0-d step among their values; a state of a step alone, nothing."""
    state = {0: {"step": 7, "exp_avg": torch.zeros(2), "exp_avg_sq": torch.zeros(2)},
             1: {"step": torch.tensor(1.0), "row_var": torch.tensor([[-1.0], [1.0]]), "col_var": torch.ones(1, 3)},
             2: {"step": torch.tensor(3.0), "exp_avg": torch.tensor([-9.0]), "exp_avg_sq": torch.tensor([-1.0])},
             3: {"step": torch.tensor(1.0)}}
    torch.save({"step": CK_STEP, "optimizer": {"state": state, "param_groups": [
        {"params": [0, 1, 2, 3], "param_names": ["a", "b", "c", "d"], "lr": 0.1}]}}, tmp_path / "ck.pt")
    found = [u for u in soundness.check(open_checkpoint(tmp_path / "ck.pt"))[1] if u.tensor[:12] != "param_groups"]
    assert [(u.check, u.param, u.index, u.values) for u in found] == [
        (soundness.STEP, "a", None, {"step": 7.0, "checkpoint_step": CK_STEP}),
        (soundness.NEGATIVE, "b", [0, 0], {"row_var": -1.0}),
        (soundness.NEGATIVE, "c", [0], {"exp_avg": -9.0, "exp_avg_sq": -1.0})]


def test_without_amsgrad_its_maximum_is_not_the_denominator(tmp_path):
    """A max_exp_avg_sq kept from an amsgrad run by a group that no longer uses it: eps = 0 divides by exp_avg_sq,
    so its zeros are the finding, and the maximum's zeros (where exp_avg_sq holds values) are none."""
    state = {"step": torch.tensor(2.0), "exp_avg": torch.zeros(3), "exp_avg_sq": torch.tensor([1.0, 0.0, 1.0]),
             "max_exp_avg_sq": torch.tensor([0.0, 1.0, 1.0])}
    torch.save({"optimizer": {"state": {0: state}, "param_groups": [{"params": [0], "betas": (0.9, 0.999), "eps": 0.0,
                                                                     "amsgrad": False}]}}, tmp_path / "ck.pt")
    found = [u for u in soundness.check(open_checkpoint(tmp_path / "ck.pt"))[1] if u.check == soundness.EPS_ZERO]
    assert [(u.tensor, u.index) for u in found] == [("optimizer.state.0.exp_avg_sq", [1])]


# ---- a replay from the checkpoint: where the origin lies, what a reset could zero ----------------------------------

Unsound, Event = soundness.Unsound, soundness.Event
TWINS = 5  # group 0: five Linear(2, 2) layers, so each weight has four twins of its shape; group 1: one more


def _live() -> tuple[torch.nn.Module, torch.optim.Adam]:
    """A live model and its Adam: group 0 the first five layers, group 1 the sixth (same shapes, another group)."""
    model = torch.nn.Sequential(*[torch.nn.Linear(2, 2) for _ in range(TWINS + 1)])
    layers = list(model)
    return model, torch.optim.Adam([{"params": [p for m in layers[:TWINS] for p in m.parameters()]},
                                    {"params": list(layers[TWINS].parameters())}])


def _u(check: str, param: str | None, group: int | None, index: list[int] | None = None, tensor: str = "t",
       **values: Any) -> Any:
    return Unsound(check, tensor, param, group, index, values, f"{check} says so")


# a finding: the origins it lies under (each origin: its tensor and index)
ORIGINS = [("0.weight", [0, 1]), ("0.weight", [1, 0]), ("1.weight", [0, 1]), ("5.weight", [0, 1]), ("other", [0, 1])]
ON = [
    (_u(soundness.NEGATIVE, "0.weight", 0, [0, 1]), {0}),  # its coordinate alone
    (_u(soundness.SHAPE, "0.weight", 0), {0, 1}),  # a whole tensor: every coordinate of it
    (_u(soundness.STEP, "1.weight", 0, min_param="0.weight"), {0, 1, 2}),  # a group's counters: either end
    (_u(soundness.STEP, "1.weight", 0, step=0.0), {2}),
    (_u(soundness.HYPERPARAMETER, None, 1, tensor="param_groups[1].lr"), {3}),  # a group: its parameters
    (_u(soundness.HYPERPARAMETER, None, 0, tensor="param_groups[0].lr"), {0, 1, 2}),
    (_u(soundness.LOSS_SCALE, None, None, tensor="scaler.scale"), {0, 1, 2, 3, 4}),  # anywhere
]


@pytest.mark.parametrize("i", range(len(ON)))
def test_the_origin_lies_on_a_finding_at_its_coordinate_tensor_group_or_anywhere(i):
    """Every kind of finding against every kind of origin: on its coordinate (a whole-tensor finding: any of its
    coordinates; a group's step counters: either end), in its group (a hyperparameter), or anywhere (the loss scale)."""
    u, on = ON[i]
    params = soundness._params(*_live())
    assert {j for j, (t, index) in enumerate(ORIGINS) if soundness._on(u, Event(7, "param", t, index, "nan"), params)} == on
    assert (params["0.weight"], params["0.bias"], params["5.weight"]) == ((0, (2, 2)), (0, (2,)), (1, (2, 2)))


LEAD = "The start checkpoint (step 4) is finite but its optimizer state is unsound: "
TAIL = " (each under unsound, with what it does at the next update)."


@pytest.mark.parametrize("n", range(7))
def test_the_first_sentence_counts_the_findings_and_names_four_checks(n):
    """n findings (the sixth alike the fifth: the same check on the same parameter, or tensor where no parameter): their
    number, then up to four distinct checks in order, '...' past four; no origin: nothing more, nothing to reset."""
    found = [_u(soundness.NEGATIVE, f"p{i // 2}", 0, [0]) if i % 3 else _u(soundness.HYPERPARAMETER, None, 0,
                                                                             tensor=f"param_groups[{i}].lr")
             for i in range(n)]
    checks = sorted({f"negative_second_moment (p{i // 2})" if i % 3 else f"hyperparameter (param_groups[{i}].lr)"
                     for i in range(n)})
    words = [] if not n else [f"{LEAD}{n} finding{'s' if n > 1 else ''}, {', '.join(checks[:4])}"
                              f"{' ...' if len(checks) > 4 else ''}{TAIL}"]
    assert len(checks) == {0: 0, 1: 1, 2: 2, 3: 3, 4: 4, 5: 5, 6: 5}[n]  # the sixth is the fifth's twin
    assert soundness.resume_findings(found, None, 4, *_live(), True) == (words, False)


def test_the_origin_names_at_most_three_findings_it_lies_on():
    """Four findings on the origin's coordinate, one elsewhere: a sentence for each of the first three it lies on."""
    here = [_u(c, "0.weight", 0, [0, 1]) for c in (soundness.SHAPE, soundness.DTYPE, soundness.NEGATIVE, soundness.BOUND)]
    found = [_u(soundness.NEGATIVE, "0.bias", 0, [0])] + here
    out, resettable = soundness.resume_findings(found, Event(9, "param", "0.weight", [0, 1], "nan"), 4, *_live(), False)
    assert out[1:] == [f"The origin, 0.weight[0, 1] at step 9, lies on what the start checkpoint's {u.check} check "
                       f"flagged: {u.check} says so." for u in here[:3]]
    assert out[0].startswith(f"{LEAD}5 findings, ") and resettable


# a finding on the origin: whether a reset could zero it
RESETTABLE = [(_u(c, "0.weight", 0, [0, 1]), True) for c in soundness.ELEMENTWISE] + [
    (_u(soundness.STEP, "0.weight", 0, step=0), True), (_u(soundness.STEP, "0.weight", 0, step=3), False),
    (_u(soundness.STEP, "0.weight", 0), False), (_u(soundness.SHAPE, "0.weight", 0), False),
    (_u(soundness.EPS_ZERO, "0.weight", 0, [0, 1]), False), (_u(soundness.NEGATIVE, "0.weight", 0, [1, 1]), False),
    (_u(soundness.LOSS_SCALE, None, None), False), (_u(soundness.HYPERPARAMETER, None, 0), False)]


@pytest.mark.parametrize("i", range(len(RESETTABLE)))
def test_a_reset_could_save_the_run_only_where_the_origin_lies_on_what_it_zeroes(i):
    """An elementwise check's coordinate, or a step of 0 beside moments (the reset zeroes them) under the origin: the
    what-if reset-state is worth running; any other finding, or one elsewhere, is not."""
    u, resettable = RESETTABLE[i]
    assert soundness.resume_findings([u], Event(9, "param", "0.weight", [0, 1], "nan"), 4, *_live(), False)[1] == resettable


TWIN_WORDS = ("The optimizer state was matched to the parameters by order (the checkpoint names none), and {} shares its "
              "shape {} with {}: had training listed them in another order, the moments it was given would be one of "
              "those's, and nothing in the checkpoint tells{}.")
PAIR = ("; here they break Adam's bound against each other, so they may well belong to another parameter of the same "
        "shape")


@pytest.mark.parametrize("origin, by_order, bound, twins", [
    ("0.weight", True, False, "1.weight, 2.weight, 3.weight (+more)"), ("0.weight", True, True,
                                                                        "1.weight, 2.weight, 3.weight (+more)"),
    ("0.weight", False, True, None), ("5.weight", True, False, None), ("other", True, False, None),
    ("0.bias", True, False, "1.bias, 2.bias, 3.bias (+more)")], ids=str)
def test_state_matched_by_order_names_the_origins_shape_twins_in_its_group(origin, by_order, bound, twins):
    """Matched by order: the origin's parameter's twins (its shape, its group; up to three named), and where Adam's bound
    breaks there, that the moments may be another's; a parameter alone of its shape in its group, an origin the model
    does not hold, or state that names its parameters: no sentence."""
    found = [_u(soundness.BOUND if bound else soundness.NEGATIVE, origin, 0, [0])]
    out, _ = soundness.resume_findings(found, Event(9, "param", origin, [0], "nan"), 4, *_live(), by_order)
    shape = [2, 2] if origin.endswith("weight") else [2]
    assert out[2:] == ([] if twins is None else [TWIN_WORDS.format(origin, shape, twins, PAIR if bound else "")])


def test_three_twins_are_named_without_more():
    model = torch.nn.Sequential(*[torch.nn.Linear(2, 2) for _ in range(4)])
    out, _ = soundness.resume_findings([], Event(9, "param", "3.weight", [0], "nan"), 4, model,
                                       torch.optim.Adam(model.parameters()), True)
    assert out == [TWIN_WORDS.format("3.weight", [2, 2], "0.weight, 1.weight, 2.weight", "")]


def test_the_replays_start_names_the_state_by_the_replays_model(tmp_path):
    """A checkpoint whose state names no parameters: the findings name them as the replay's model does, in its
    optimizer's order."""
    model, opt = _live()
    sd = {"state": {3: {"exp_avg_sq": -torch.ones(2)}, 0: {"exp_avg_sq": torch.ones(2, 2)}},
          "param_groups": [{"params": list(range(2 * TWINS))}, {"params": [10, 11]}]}
    torch.save({"optimizer": sd}, tmp_path / "ck.pt")
    found = soundness.start_soundness(open_checkpoint(tmp_path / "ck.pt"), model, opt)
    assert [(u.check, u.param, u.group, u.index) for u in found] == [(soundness.NEGATIVE, "1.bias", 0, [0])]


# ---- the what-if reset: a live optimizer's coordinates that break an elementwise check ------------------------------


def _reset_masks(state: dict[str, Any], group: dict[str, Any] | None = None) -> dict[str, list]:
    """The masks of a live Adam over a (2, 3) weight and a 2-element bias whose weight holds this state."""
    w, b = torch.nn.Parameter(torch.zeros(2, 3)), torch.nn.Parameter(torch.zeros(2))
    opt = torch.optim.Adam([w, b], betas=(0.9, 0.999))
    opt.param_groups[0].update(group or {})
    opt.state[w] = state
    opt.state[b] = {"step": torch.tensor(3.0), "exp_avg": torch.ones(2), "exp_avg_sq": torch.ones(2)}
    masks = soundness.unsound_coordinates(opt)
    assert all(m.dtype == torch.bool for m in masks.values())  # what masked_fill_ takes
    return {("w" if p is w else "b"): m.int().tolist() for p, m in masks.items()}


ONE = [[0, 1, 0], [0, 0, 0]]  # coordinate [0, 1]
ALL = [[1, 1, 1], [1, 1, 1]]


def _at(value: float, dtype: torch.dtype = torch.float32, base: float = 0.0) -> torch.Tensor:
    t = torch.full((2, 3), base, dtype=dtype)
    t[0, 1] = value
    return t


RESETS = {  # the weight's state: its mask
    "healthy": ({"step": torch.tensor(3.0), "exp_avg": _at(0.5), "exp_avg_sq": _at(1.0)}, None),
    "negative v": ({"step": torch.tensor(3.0), "exp_avg": _at(0.0), "exp_avg_sq": _at(-1.0)}, ONE),
    "past the bound": ({"step": torch.tensor(3.0), "exp_avg": _at(8.0), "exp_avg_sq": _at(1.0)}, ONE),
    "amsgrad's maximum below": ({"step": torch.tensor(3.0), "exp_avg": _at(0.0), "exp_avg_sq": _at(1.0),
                                 "max_exp_avg_sq": _at(0.5)}, ONE),
    "step 0 beside values": ({"step": torch.tensor(0.0), "exp_avg": _at(0.5), "exp_avg_sq": _at(1.0)}, ALL),
    "step 0 beside zeros": ({"step": torch.tensor(0.0), "exp_avg": _at(0.0), "exp_avg_sq": _at(0.0)}, None),
    "int step 0": ({"step": 0, "exp_avg": _at(0.5), "exp_avg_sq": _at(1.0)}, ALL),
    "momentum alone, step 0": ({"step": 0, "momentum_buffer": _at(0.5)}, ALL),
    "momentum alone": ({"step": 1, "momentum_buffer": _at(-0.5)}, None),
    # within bfloat16's slack (4.02% past the bound), past float32's
    "bfloat16 at the slack": ({"step": torch.tensor(3.0), "exp_avg": _at(7.5625, torch.bfloat16, 0.0),
                               "exp_avg_sq": _at(1.0, torch.bfloat16, 1.0)}, None),
    "bfloat16 past the slack": ({"step": torch.tensor(3.0), "exp_avg": _at(7.625, torch.bfloat16, 0.0),
                                 "exp_avg_sq": _at(1.0, torch.bfloat16, 1.0)}, ONE),
    "float32 past its slack": ({"step": torch.tensor(3.0), "exp_avg": _at(7.5625), "exp_avg_sq": _at(1.0, base=1.0)}, ONE),
    # not laid out like the parameter, not floating point, or 0-d: not judged
    "factored": ({"step": torch.tensor(0.0), "row_var": -torch.ones(2, 1), "exp_avg": _at(0.0)}, None),
    "integers": ({"step": torch.tensor(0.0), "exp_avg_sq": _at(-1, torch.int64)}, None),
    "0-d": ({"step": torch.tensor(0.0), "exp_avg_sq": torch.tensor(-1.0)}, None),
    "nothing": ({}, None),
}


@pytest.mark.parametrize("case", list(RESETS))
def test_a_reset_zeroes_exactly_the_coordinates_that_break_a_check(case):
    """Each kind of state: the coordinates an elementwise check flags (Adam's bound at the slack of exp_avg_sq's dtype),
    every coordinate where a step of 0 sits beside moments that hold values, nothing for state the checks do not read;
    the healthy bias beside it never."""
    state, mask = RESETS[case]
    assert _reset_masks(state) == ({} if mask is None else {"w": mask})


def test_a_reset_judges_each_group_by_its_betas():
    """|m| = 3 sqrt(v): past the bound of betas (0.5, 0.5) (1), within the defaults' (7.27)."""
    state = {"step": torch.tensor(3.0), "exp_avg": _at(3.0), "exp_avg_sq": _at(1.0, base=1.0)}
    assert _reset_masks(dict(state), {"betas": (0.5, 0.5)}) == {"w": ONE}
    assert _reset_masks(dict(state)) == {}


# ---- what a group's state is checked as --------------------------------------------------------------------------

KINDS = {"adafactor": "Adafactor (factored second moments)", "adamax": "Adamax",
         "adam": "Adam-family (Adam, AdamW, NAdam, RAdam)", "sgd": "SGD with momentum",
         "other": "other (checked: non-negative second moments, shapes, dtypes, step, hyperparameters)"}
KIND_KEYS = ("exp_avg_sq_row", "row_var", "exp_inf", "exp_avg", "exp_avg_sq", "momentum_buffer", "step")
KIND_HYPERS = [{}, {"betas": (0.9, 0.999)}, {"betas": (0.9, 0.999), "amsgrad": True}, {"betas": (0.9, 0.999),
               "amsgrad": False}, {"betas": "x"}, {"beta2_decay": -0.8}, {"decay_rate": -0.8}, {"momentum": 0.9},
               {"momentum": 0.0}, {"momentum": "x"}, {"momentum": 0.9, "betas": (0.9, 0.999)}]


def _kind(hyper: dict[str, Any], keys: set[str]) -> str:
    """The docstring's order: factored moments (by state, or Adafactor's hyperparameters), Adamax's exp_inf, Adam's two
    moments (or no state but a step) with betas, SGD's buffer (or no state and a momentum), else other."""
    if keys & {"exp_avg_sq_row", "row_var"} or {"beta2_decay", "decay_rate"} & set(hyper):
        return KINDS["adafactor"]
    if "exp_inf" in keys:
        return KINDS["adamax"]
    if isinstance(hyper.get("betas"), tuple) and ({"exp_avg", "exp_avg_sq"} <= keys or keys <= {"step"}):
        return KINDS["adam"] + (" with amsgrad" if hyper.get("amsgrad") else "")
    if "momentum_buffer" in keys or (not keys and hyper.get("momentum") == 0.9):
        return KINDS["sgd"]
    return KINDS["other"]


def test_each_groups_kind_comes_from_its_state_keys_else_its_hyperparameters():
    """Every set of the keys that tell the kinds apart, against hyperparameters of each kind (and none, and junk)."""
    for n in range(len(KIND_KEYS) + 1):
        for keys in itertools.combinations(KIND_KEYS, n):
            for hyper in KIND_HYPERS:
                assert soundness.optimizer_kind(hyper, keys) == _kind(hyper, set(keys)), (keys, hyper)


# ---- a hyperparameter out of range: the range, and what the next update does ---------------------------------------

RANGE_WORDS = {"lr": ", outside [0, inf)", "initial_lr": ", outside [0, inf)", "eps": ", outside [0, inf)",
               "weight_decay": ", outside [0, inf)", "momentum": ", outside [0, 1]", "dampening": ", not finite",
               "alpha": ", outside [0, inf)", "rho": ", outside [0, 1]", "beta2_decay": ", outside (-inf, 0]",
               "d": ", outside [0, inf)", "lr_decay": ", outside [0, inf)", "lambd": ", outside [0, inf)",
               "betas": ", outside [0, 1)"}
OTHER_EFFECT = "the optimizer's averages no longer average (torch's constructor refuses it); the next update is not " \
               "the optimizer's"
EFFECTS = {  # (key, infinite): the words; NaN's are every key's, and any other key's are OTHER_EFFECT
    ("lr", True): "the next update moves every parameter of the group by inf times its step direction: inf, and NaN "
                  "(inf * 0) where the direction is 0", ("lr", False): "a negative learning rate climbs the loss",
    ("eps", True): "the update m/(sqrt(v)+eps) is 0: the group stops learning",
    ("eps", False): "a negative eps can make the denominator sqrt(v)+eps 0 or negative: inf or a step uphill",
    ("weight_decay", True): "decoupled decay multiplies the parameters by 1 - lr*wd = -inf: they turn inf or NaN at the "
                            "next step",
    ("weight_decay", False): "negative weight decay grows the weights every step (torch's constructor refuses it)"}
EFFECTS |= {("initial_lr", inf): words for (key, inf), words in EFFECTS.items() if key == "lr"}
NAN_EFFECT = "every update of the group computes with NaN: its parameters turn NaN at the next step"


def test_each_hyperparameter_out_of_range_says_its_range_and_its_effect(tmp_path):
    """Each known key at NaN, +-inf and a finite value past each finite end (one group each, in one checkpoint): the
    range it left and what the next update does with it; the finite ends themselves, where included, are no finding."""
    cases = []
    for key in RANGE_WORDS:
        lo, hi, closed = (0.0, 1.0, False) if key == "betas" else soundness._RANGES[key]
        bad = [math.nan, math.inf, -math.inf] + ([lo - 0.5] if math.isfinite(lo) else []) + (
            [hi + 0.5] if math.isfinite(hi) else [])
        good = ([lo] if math.isfinite(lo) else []) + ([hi] if math.isfinite(hi) and closed else [])
        cases += [(key, x, True) for x in bad] + [(key, x, False) for x in good]
    groups = [{"params": [g], key: (x, 0.5) if key == "betas" else x} for g, (key, x, _) in enumerate(cases)]
    torch.save({"optimizer": {"state": {}, "param_groups": groups}}, tmp_path / "ck.pt")
    found = soundness.check(open_checkpoint(tmp_path / "ck.pt"))[1]
    expected = []
    for g, (key, x, flagged) in enumerate(cases):
        name = "betas[0]" if key == "betas" else key
        effect = NAN_EFFECT if math.isnan(x) else EFFECTS.get((key, math.isinf(x)), OTHER_EFFECT)
        expected += [(f"param_groups[{g}].{name}", f"group {g}'s {name} is {x:g}{RANGE_WORDS[key]}: {effect}")] * flagged
    assert [(u.tensor, u.message) for u in found] == expected


# ---- the layout of every format the reader knows, from checkpoints written as each tool writes them -----------------


def _two_groups() -> tuple[torch.nn.Module, torch.optim.Adam]:
    """Adam after one real step over two groups (lr 0.1, 0.2); 1.weight's exp_avg_sq negative at [0, 2]; 0.bias's
    step an int (older torch: a state scalar)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(2, 3), torch.nn.Linear(3, 1))
    opt = torch.optim.Adam([{"params": list(model[0].parameters()), "lr": 0.1},
                            {"params": list(model[1].parameters()), "lr": 0.2}])
    model(torch.randn(4, 2)).pow(2).mean().backward()
    opt.step()
    opt.state[model[1].weight]["exp_avg_sq"][0, 2] = -1.0
    opt.state[model[0].bias]["step"] = 1
    return model, opt


def _dcp_save(obj: dict[str, Any], folder: Path) -> None:
    import torch.distributed.checkpoint as dcp  # seconds to import: only where a test writes with it
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "torch.distributed is disabled ... assuming a single process"
        dcp.save(obj, checkpoint_id=folder)


def _write(fmt: str, folder: Path) -> Path:
    """The two groups' checkpoint as ``fmt`` writes it (the run format, and its sharded variant, by the recorder)."""
    from nanforensics.distributed.checkpoint import save_shards

    model, opt = _two_groups()
    scaler = torch.amp.GradScaler("cpu", init_scale=0.0)
    sd, osd = model.state_dict(), opt.state_dict()
    folder.mkdir(parents=True)
    if fmt == "run":
        return save_checkpoint(folder, 5, model, opt, scaler=scaler)
    if fmt == "run, sharded":
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "torch.distributed is disabled ... assuming a single process"
            return save_checkpoint(folder, 5, model, opt, scaler=scaler, write_tensors=lambda build, m, t, _: save_shards(
                build, m, t, 5, None))
    if fmt == "torch.save":
        torch.save({"model": sd, "optimizer": osd, "step": 5}, folder / "ck.pt")
        return folder / "ck.pt"
    if fmt == "lightning":
        torch.save({"pytorch-lightning_version": "2.5", "global_step": 5, "state_dict": sd, "optimizer_states": [osd],
                    "native_amp_scaling_state": scaler.state_dict()}, folder / "epoch=0-step=5.ckpt")
        return folder / "epoch=0-step=5.ckpt"
    if fmt == "hf trainer":  # model.safetensors, optimizer.pt, trainer_state.json
        from safetensors.torch import save_file
        save_file(sd, folder / "model.safetensors")
        torch.save(osd, folder / "optimizer.pt")
        (folder / "trainer_state.json").write_text('{"global_step": 5}')
    elif fmt == "accelerate":  # save_state: pytorch_model.bin and optimizer.bin
        torch.save(sd, folder / "pytorch_model.bin")
        torch.save(osd, folder / "optimizer.bin")
    elif fmt == "dcp":  # another tool's torch.distributed.checkpoint folder: no meta.json
        _dcp_save({"model": sd, "optim": osd}, folder)
    elif fmt == "safetensors":  # a bare file
        from safetensors.torch import save_file
        save_file(sd, folder / "model.safetensors")
        return folder / "model.safetensors"
    return folder


SCALER = {"scale": 0.0, "growth_factor": 2.0, "backoff_factor": 0.5, "growth_interval": 2000, "_growth_tracker": 0}
NAMES2 = ["0.weight", "0.bias", "1.weight", "1.bias"]
ID_KEYS = [f"state.{i}" for i in range(4)]
FORMAT_LAYOUTS = {  # format: its param keys (the state tensors' prefix), labels, named, by order, exact step, scaler
    "run": (NAMES2, NAMES2, True, False, True, SCALER),
    "run, sharded": ([f"optim.state.{n}" for n in NAMES2], NAMES2, True, False, True, SCALER),
    "torch.save": ([f"optimizer.{k}" for k in ID_KEYS], NAMES2, True, True, False, None),
    "lightning": ([f"optimizer_states.0.{k}" for k in ID_KEYS], NAMES2, True, True, False, SCALER),
    "hf trainer": (ID_KEYS, ["#0", "#1", "#2", "#3"], False, False, False, None),
    "accelerate": (ID_KEYS, ["#0", "#1", "#2", "#3"], False, False, False, None),
    "dcp": None, "safetensors": None,  # no groups: the signs of second moments alone, named by the state's path
}


@pytest.mark.parametrize("fmt", list(FORMAT_LAYOUTS))
def test_each_format_lays_out_its_groups_names_and_scalars(tmp_path, fmt):
    """The same state in each format: the groups' hyperparameters, each parameter under its state tensors' prefix with
    its name (recorded, matched by the model's order, or #i), its group and its non-tensor state, the loss scaler, and
    whether the checkpoint's step counts the updates; none where the checkpoint records no groups. The planted
    negative second moment is found under that name, and the loss scale of 0 where the scaler was saved."""
    source = open_checkpoint(_write(fmt, tmp_path / "ck"))
    layout = soundness._layout(source, None)
    _, unsound = soundness.check(source)
    expected = FORMAT_LAYOUTS[fmt]
    if expected is None:
        assert layout is None and [(u.check, u.param, u.group, u.index) for u in unsound] == (
            [(soundness.NEGATIVE, "optim.state.2", None, [0, 2])] if fmt == "dcp" else [])
        return
    keys, labels, named, by_order, exact, scaler = expected
    assert list(layout.params) == keys and [p.label for p in layout.params.values()] == labels
    assert [(p.group, p.scalars) for p in layout.params.values()] == [(0, {}), (0, {"step": 1}), (1, {}), (1, {})]
    assert [g["lr"] for g in layout.groups] == [0.1, 0.2] and not {"params", "param_names"} & {*layout.groups[0]}
    assert (layout.named, layout.by_order, layout.exact_step, layout.scaler) == (named, by_order, exact, scaler)
    assert [(u.check, u.param, u.group, u.index) for u in unsound] == [(soundness.NEGATIVE, labels[2], 1, [0, 2])] + (
        [(soundness.LOSS_SCALE, None, None, None)] if scaler else [])


def test_a_zero_checkpoint_names_each_parameter_with_its_partitions_step():
    """DeepSpeed ZeRO (formats.zero's reading of it): the base optimizer's groups, each parameter by its name in
    ``param_shapes``, in its group, with the step of the flat partition its first piece lies in (none where it has no
    piece), and the loss scaler's scale."""
    from nanforensics.formats import zero

    slots = [zero.Slot("fc1.weight", (7, 5), 0, [zero._Piece(0, 1, 0, 35)]), zero.Slot("fc2.bias", (3,), 1, [
        zero._Piece(0, 2, 0, 2), zero._Piece(0, 0, 2, 1)]), zero.Slot("fc2.weight", (3, 7), 1, [])]
    scaler = zero.Record()
    scaler.state = {"cur_scale": 0.0}
    z = zero.Layout(stage=1, files=[], optims=[{"loss_scaler": scaler}], base=[], flats=[], releases=[], model={},
                    slots=slots, hyper=[{"lr": 0.1}, {"lr": 0.2}], steps={0: 3, 1: 4, 2: 5}, frozen={})
    layout = soundness._zero(z)
    assert {k: (p.label, p.group, p.scalars) for k, p in layout.params.items()} == {
        "fc1.weight": ("fc1.weight", 0, {"step": 4}), "fc2.bias": ("fc2.bias", 1, {"step": 5}),
        "fc2.weight": ("fc2.weight", 1, {"step": None})}
    assert (layout.groups, layout.named, layout.scaler, layout.exact_step, layout.by_order) == (
        [{"lr": 0.1}, {"lr": 0.2}], True, {"scale": 0.0}, False, False)


def test_the_shipped_zero_checkpoint_is_laid_out_as_deepspeed_saved_it():
    """sample_runs/zero2's clean global_step2 (DeepSpeed's own engine, two ranks, stage 2), read, never written: its two
    groups (weight decay on the weights alone), each parameter by name with its partition's step, the scaler's scale of
    1; nothing unsound, both groups Adam's."""
    source = open_checkpoint(Path(__file__).parent.parent / "sample_runs" / "zero2" / "global_step2")
    layout = soundness._layout(source, None)
    assert {k: (p.label, p.group, float(p.scalars["step"])) for k, p in layout.params.items()} == {
        n: (n, int(n not in ("fc1.weight", "fc2.weight")), 2.0)
        for n in ("fc1.weight", "fc2.weight", "fc1.bias", "bn.weight", "bn.bias", "fc2.bias")}
    assert [g["weight_decay"] for g in layout.groups] == [0.1, 0.0] and (layout.named, layout.scaler) == (True, {"scale": 1.0})
    summary, unsound = soundness.check(source)
    assert (summary.optimizers, summary.notes, unsound) == (["Adam-family (Adam, AdamW, NAdam, RAdam)"] * 2, [], [])


# ---- one parameter's state: what the scan reads of it, and which checks judge it ------------------------------------


def test_each_state_tensor_is_read_once_for_its_extremes_beside_the_checks(tmp_path):
    """What the scan's finiteness takes from a parameter's state: each tensor's min and max, the per-element moments
    (and a key of another optimizer's, laid out alike) in one pass, a factored moment in its own; none for what the
    checks do not read (the 0-d step, integers)."""
    state = {"step": torch.tensor(2.0), "exp_avg": torch.tensor([0.5, -3.0, 1.0]), "row_var": torch.tensor([2.0]),
             "exp_avg_sq": torch.tensor([4.0, 0.25, 9.0]), "count": torch.tensor([1, 2, 3]),
             "foo": torch.tensor([7.0, -7.0, 0.0])}
    torch.save({"optimizer": {"state": {0: state}, "param_groups": [{"params": [0], "betas": (0.9, 0.999)}]}},
               tmp_path / "ck.pt")
    source = open_checkpoint(tmp_path / "ck.pt")
    stream = source.open()
    checker = soundness.Checker(source, stream.infos)
    read = [(info.name.rpartition(".")[2], extremes) for info, tensor, release in stream.tensors()
            if (param := checker.feed(info, tensor, release)) is not None for info, extremes in param.read()]
    assert sorted(read) == [("count", None), ("exp_avg", (-3.0, 1.0)), ("exp_avg_sq", (0.25, 9.0)),
                            ("foo", (-7.0, 7.0)), ("row_var", (2.0, 2.0)), ("step", None)]


def test_state_the_groups_do_not_list_is_judged_alone_and_names_given_by_order_are_not_judged_against_the_model(
        tmp_path):
    """A state entry no group lists (a named layout): its own elementwise checks, named by its path, in no group.
    Names the replay gave by order: the state is not judged against the model's tensor of that name (a bfloat16 moment
    beside a float32 parameter is then no finding), as the notes say."""
    model = {"weight": torch.zeros(2)}
    state = {0: {"exp_avg": torch.zeros(2, dtype=torch.bfloat16)}, 7: {"exp_avg_sq": torch.tensor([1.0, -2.0])}}
    torch.save({"model": model, "optimizer": {"state": state, "param_groups": [{"params": [0], "param_names": ["w"]}]}},
               tmp_path / "named.pt")
    found = soundness.check(open_checkpoint(tmp_path / "named.pt"))[1]
    assert [(u.check, u.param, u.group, u.index) for u in found] == [
        (soundness.NEGATIVE, "optimizer.state.7", None, [1])]
    torch.save({"model": model, "optimizer": {"state": {0: state[0]}, "param_groups": [{"params": [0]}]}},
               tmp_path / "unnamed.pt")
    assert soundness.check(open_checkpoint(tmp_path / "unnamed.pt"), ["weight"])[1] == []
    torch.save({"model": model, "optimizer": {"state": {0: state[0]}, "param_groups": [{"params": [0], "param_names": [
        "weight"]}]}}, tmp_path / "both.pt")  # the same state, named: judged
    assert [u.check for u in soundness.check(open_checkpoint(tmp_path / "both.pt"))[1]] == [soundness.DTYPE]


# ---- a scalar parameter (CLIP's logit_scale): its moments are 0-d like its step counter -----------------------------

SCALAR_STATES = {  # exp_avg, exp_avg_sq: the finding at the parameter's one coordinate ([]), if any
    "healthy": (0.5, 1.0, None), "negative": (0.0, -1.0, soundness.NEGATIVE), "past the bound": (8.0, 1.0, soundness.BOUND)}


@pytest.mark.parametrize("case", list(SCALAR_STATES))
def test_a_scalar_parameters_moments_are_checked_and_reset_like_any_others(tmp_path, case):
    """A 0-d parameter's exp_avg and exp_avg_sq are judged (its step counter is not among their values), and a reset
    zeroes exactly them where they break a check, leaving the step counter as it was."""
    from nanforensics.replay.whatif import ResetState

    m, v, check = SCALAR_STATES[case]
    state = {"step": torch.tensor(3.0), "exp_avg": torch.tensor(m), "exp_avg_sq": torch.tensor(v)}
    torch.save({"model": {"logit_scale": torch.tensor(1.0)}, "step": 3, "optimizer": {"state": {0: state}, "param_groups": [
        {"params": [0], "param_names": ["logit_scale"], "betas": (0.9, 0.999), "lr": 0.1}]}}, tmp_path / "ck.pt")
    found = soundness.check(open_checkpoint(tmp_path / "ck.pt"))[1]
    assert [(u.check, u.param, u.index, u.values) for u in found] == ([] if check is None else [
        (check, "logit_scale", [], {"exp_avg": m, "exp_avg_sq": v})])
    p = torch.nn.Parameter(torch.tensor(1.0))
    opt = torch.optim.Adam([p])
    opt.state[p] = {k: t.clone() for k, t in state.items()}
    done = ResetState().at_start(opt)
    assert (done, {k: t.item() for k, t in opt.state[p].items()}) == (
        (None, {"step": 3.0, "exp_avg": m, "exp_avg_sq": v}) if check is None else
        ("at the resume, zeroed the unsound optimizer state of 1 coordinate", {"step": 3.0, "exp_avg": 0.0,
                                                                               "exp_avg_sq": 0.0}))


def test_a_reset_passes_over_parameters_without_state_to_the_next():
    """A parameter the optimizer never stepped (no state at all), one whose state holds no tensor the checks read, then
    one whose state breaks a check: its mask alone."""
    params = [torch.nn.Parameter(torch.zeros(2)) for _ in range(3)]
    opt = torch.optim.Adam(params)
    opt.state[params[1]] = {"step": torch.tensor(1.0)}
    opt.state[params[2]] = {"step": torch.tensor(1.0), "exp_avg": torch.zeros(2), "exp_avg_sq": torch.tensor([1.0, -1.0])}
    masks = soundness.unsound_coordinates(opt)
    assert list(masks) == [params[2]] and masks[params[2]].tolist() == [False, True]


def test_the_run_formats_scaler_is_read_with_its_tensors_and_a_bad_tag_names_meta_json(tmp_path):
    """A scaler whose state holds a tensor (the recorder keeps it in extras.safetensors): its scale read from there; a
    tag in meta.json's scaler that does not decode: a one-line error naming meta.json."""
    from nanforensics.errors import BadInput

    class Scaler:
        def state_dict(self) -> dict[str, Any]:
            return {"scale": torch.tensor(0.0), "growth_factor": 2.0}

    model, opt = _two_groups()
    ck = save_checkpoint(tmp_path / "run", 5, model, opt, scaler=Scaler())
    assert soundness._layout(open_checkpoint(ck), None).scaler["scale"].item() == 0.0
    assert [u.check for u in soundness.check(open_checkpoint(ck))[1]][-1] == soundness.LOSS_SCALE
    meta = (ck / "meta.json").read_text().replace('"growth_factor": 2.0', '"growth_factor": {"$float": "x"}')
    (ck / "meta.json").write_text(meta)
    with pytest.raises(BadInput) as e:
        soundness.check(open_checkpoint(ck))
    assert str(e.value).startswith(f"{ck / 'meta.json'}: holds ")


def test_a_module_named_with_a_slash_keeps_it_in_its_parameters_names(tmp_path):
    """``add_module`` takes any name without a dot: the run format's ``<name>/<key>`` is split at its last slash."""
    model = torch.nn.Sequential()
    model.add_module("a/b", torch.nn.Linear(2, 2))
    opt = torch.optim.Adam(model.parameters())
    model(torch.ones(1, 2)).sum().backward()
    opt.step()
    opt.state[model[0].weight]["exp_avg_sq"][0, 1] = -1.0
    found = soundness.check(open_checkpoint(save_checkpoint(tmp_path / "run", 1, model, opt)))[1]
    assert [(u.check, u.tensor, u.param, u.group, u.index) for u in found] == [
        (soundness.NEGATIVE, "a/b.weight/exp_avg_sq", "a/b.weight", 0, [0, 1])]
