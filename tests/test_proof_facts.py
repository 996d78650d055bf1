"""The proof's rules and bookkeeping (replay/proof.py), on one-element tensors and the real optimizers, listed rather
than sampled (about a second in all): each bound a rule gives holds after the real step and is reached by one of the
step's sign patterns, so it is neither too small nor looser than the rule says; each condition that leaves a rule
without a proof, alone; each intermediate value the rule bounds, crossing the limit alone; and what ``StepProof``
keeps between steps and forgets, and what ``UpdateCheck`` reads, tries and names. ``test_proof.py`` samples the rules
over gradients and hyperparameters in every dtype and replays the scenarios with and without the proof;
``test_guard_proof.py`` runs the guard's check over every magnitude."""

from __future__ import annotations

import itertools
import math
from typing import Any

import pytest
import torch
from nanforensics.replay import proof
from nanforensics.replay.proof import StepProof, Update

F64 = torch.float64
G, M, V, TOP, P, B = 3.0, 2.0, 5.0, 11.0, 7.0, 2.0  # the gradient's, the old state's and the parameter's magnitudes
TIGHT = 1e-12  # float64's roundings of a few operations, relative


def _real_adam(cls: type, h: dict[str, Any], fresh: bool, g: float, m: float, v: float, count: float, top: float,
               p0: float) -> dict[str | None, float]:
    """One real step of ``cls`` on a one-element float64 parameter ``p0`` with gradient ``g`` and the old state given
    (signed); each new state value's and the parameter's (key None) magnitude."""
    p = torch.tensor([p0], dtype=F64)
    opt = cls([p], lr=1.0, betas=(0.5, 0.5), eps=h["eps"], weight_decay=h["wd"], amsgrad=h["amsgrad"],
              maximize=h["maximize"])
    opt.param_groups[0].update(lr=h["lr"], betas=(h["b1"], h["b2"]))  # a negative lr too, as a scheduler may set
    if not fresh:
        opt.state[p] = {"step": torch.tensor(count), "exp_avg": torch.tensor([m], dtype=F64),
                        "exp_avg_sq": torch.tensor([v], dtype=F64)}
        if h["amsgrad"]:
            opt.state[p]["max_exp_avg_sq"] = torch.tensor([top], dtype=F64)
    p.grad = torch.tensor([-g if h["maximize"] else g], dtype=F64)
    opt.step()
    return {None: abs(float(p)), **{k: abs(float(t)) for k, t in opt.state[p].items()}}


def _real_sgd(h: dict[str, Any], fresh: bool, g: float, buf: float, p0: float) -> dict[str | None, float]:
    p = torch.tensor([p0], dtype=F64)
    opt = torch.optim.SGD([p], lr=1.0, momentum=0.5, dampening=h["dampening"], maximize=h["maximize"])
    opt.param_groups[0].update(lr=h["lr"], momentum=h["momentum"], nesterov=h["nesterov"])  # past the constructor's checks
    if not fresh and h["momentum"]:
        opt.state[p] = {"momentum_buffer": torch.tensor([buf], dtype=F64)}
    p.grad = torch.tensor([-g if h["maximize"] else g], dtype=F64)
    opt.step()
    return {None: abs(float(p)), **{k: abs(float(t)) for k, t in opt.state[p].items()}}


def _bounds(update: Update, p0: float) -> dict[str | None, float]:
    """The rule's bound on each new state value and on the parameter (key None; absent where it is read)."""
    return {**update.state, **({None: abs(p0) * update.scale + update.move} if update.scale is not None else {})}


def _check(cases: list[tuple[dict[str | None, float], dict[str | None, float]]], reached: bool, where: object) -> None:
    """Each bound holds in every case; and, where ``reached``, some case meets it."""
    ratios: dict[str | None, float] = {}
    for bounds, actual in cases:
        for key, bound in bounds.items():
            assert actual[key] <= bound * (1 + TIGHT) + 1e-300, (where, key, actual[key], bound)
            ratios[key] = max(ratios.get(key, 0.0), actual[key] / bound if bound else 1.0)
    if reached:
        assert all(r >= 1 - TIGHT for r in ratios.values()), (where, ratios)
        assert set(ratios) == set(cases[0][1]), (where, ratios)  # a bound on everything the step writes


ADAM = {"lr": [1e-3, -0.5], "b1": [0.0, 0.9], "b2": [0.0, 0.999], "eps": [1e-3], "wd": [0.0, 0.1, 30.0],
        "amsgrad": [False, True], "maximize": [False, True]}


@pytest.mark.parametrize("cls", [torch.optim.Adam, torch.optim.AdamW])
def test_adams_bounds_hold_and_are_reached(cls):
    """Adam's and AdamW's bound on each state value and on the parameter, over every listed setting: never passed by
    the real step, and met by one sign pattern (the state's with the gradient at G, the parameter's with a zero
    gradient and no second moment at step 1, where its denominator is ``eps`` and ``1 - beta1^t = 1 - beta1``)."""
    decoupled = cls is torch.optim.AdamW
    for values in itertools.product(*ADAM.values()):
        h = dict(zip(ADAM, values))
        group = {"lr": h["lr"], "betas": (h["b1"], h["b2"]), "eps": h["eps"], "weight_decay": h["wd"],
                 "amsgrad": h["amsgrad"]}
        for fresh in (True, False):
            cases = []
            # the state's bounds met with the gradient at G, the parameter's with none at step 1 (fresh: from zeros)
            starts = [(G, 0.0, 0.0, 0.0)] if fresh else [(G, V, 4.0, TOP), (0.0, 0.0, 0.0, 0.0)]
            for (g, v, count, top), m, p0 in itertools.product(starts, [M, -M] if not fresh else [0.0], [P, -P]):
                old = {"exp_avg": abs(m), "exp_avg_sq": v, "step": count, "max_exp_avg_sq": top}
                update = proof._adam(group, fresh, g, old.get, decoupled, F64)
                if h["wd"] and not decoupled:
                    assert update is None  # L2 decay: the gradient grows by what nothing read bounds
                    break
                assert update is not None and update.scale is not None
                cases.append((_bounds(update, p0), _real_adam(cls, h, fresh, g, m, v, count, top, p0)))
            if cases:
                _check(cases, not fresh, (cls.__name__, h, fresh))
                if fresh:  # the state from zeros: its bounds are met by the first step
                    _check([({k: b for k, b in bounds.items() if k is not None},
                            {k: a for k, a in actual.items() if k is not None}) for bounds, actual in cases],
                           True, (cls.__name__, h, fresh))


SGD = {"lr": [1e-3, -0.5], "momentum": [0.0, 0.9, -0.5], "dampening": [0.0, 0.5, 1.5], "nesterov": [False, True],
       "maximize": [False, True]}


def test_sgds_bounds_hold_and_are_reached():
    """SGD's bound on the momentum buffer and the parameter, over every listed setting (a negative momentum and
    nesterov with dampening too, which only the constructor refuses): never passed by the real step, and met by one
    sign pattern wherever the buffer and the gradient can point the same way (nesterov's needs ``momentum >= 0``
    and ``dampening <= 1``)."""
    for values in itertools.product(*SGD.values()):
        h = dict(zip(SGD, values))
        group = {"lr": h["lr"], "momentum": h["momentum"], "dampening": h["dampening"], "nesterov": h["nesterov"]}
        for fresh in (True, False):
            cases = []
            for buf, p0 in itertools.product([B, -B], [P, -P]):
                update = proof._sgd(group, fresh, G, {"momentum_buffer": B}.get, False, F64)
                assert update is not None and update.scale == 1.0
                cases.append((_bounds(update, p0), _real_sgd(h, fresh, G, buf, p0)))
            _check(cases, not h["nesterov"] or h["momentum"] >= 0 and (fresh or h["dampening"] <= 1), (h, fresh))


def test_each_condition_that_leaves_a_rule_without_a_proof():
    """No bound at all (None) where the rule does not hold: a fused, capturable or differentiable step, L2 weight
    decay, a setting that is no number or betas outside [0, 1], an old state not known; the state bounded but the
    parameter read (scale None) where the step may divide by zero or the learning rate is not finite."""
    adam = {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0}
    known = {"exp_avg": 1.0, "exp_avg_sq": 1.0, "step": 3.0, "max_exp_avg_sq": 1.0}
    none = [{"fused": True}, {"capturable": True}, {"differentiable": True}, {"lr": None}, {"lr": "0.1"},
            {"eps": None}, {"betas": (0.9,)}, {"betas": None}, {"betas": (-0.1, 0.5)}, {"betas": (0.5, -0.1)},
            {"betas": (1.1, 0.5)}, {"betas": (0.5, 1.1)}, {"weight_decay": "x"}]
    for change in none:
        for decoupled in (False, True):
            assert proof._adam({**adam, **change}, False, 1.0, known.get, decoupled, torch.float32) is None, change
    assert proof._adam({**adam, "weight_decay": 0.1}, False, 1.0, known.get, False, torch.float32) is None
    assert proof._adam({**adam, "weight_decay": 0.1}, False, 1.0, known.get, True, torch.float32) is not None
    for key in known:
        unknown = {**known, key: None}.get
        for fresh, amsgrad in itertools.product((False, True), (False, True)):
            update = proof._adam({**adam, "amsgrad": amsgrad}, fresh, 1.0, unknown, False, torch.float32)
            assert (update is None) == (not fresh and (key != "max_exp_avg_sq" or amsgrad)), (key, fresh, amsgrad)
    read = [({"eps": 0.0}, torch.float32), ({"eps": 1e-8}, torch.float16), ({"betas": (1.0, 0.5)}, torch.float32),
            ({"betas": (0.5, 1.0)}, torch.float32), ({"betas": (0.5, 1 - 1e-9)}, torch.float16),
            ({"lr": math.inf}, torch.float32), ({"lr": 1e300, "weight_decay": 1e300}, torch.float32)]
    for change, dtype in read:
        update = proof._adam({**adam, **change}, False, 1.0, known.get, True, dtype)
        assert update is not None and update.scale is None and set(update.state) == {"exp_avg", "exp_avg_sq", "step"}, \
            change
    for change, dtype in (({"eps": 1e-8}, torch.float32), ({"betas": (0.5, 1 - 1e-9)}, torch.float32),
                          ({"lr": 1e300, "weight_decay": 1e-300}, torch.float32), ({"betas": (0.0, 0.0)}, torch.float32)):
        assert proof._adam({**adam, **change}, False, 1.0, known.get, True, dtype).scale is not None, change  # the edges
    sgd = {"lr": 1e-3, "momentum": 0.9, "dampening": 0.0}
    for change in ({"fused": True}, {"differentiable": True}, {"weight_decay": 0.1}, {"lr": None}, {"momentum": None},
                   {"dampening": "x"}):
        assert proof._sgd({**sgd, **change}, False, 1.0, {"momentum_buffer": 1.0}.get, True, torch.float32) is None
    assert proof._sgd(sgd, False, 1.0, {}.get, False, torch.float32) is None  # its buffer not known
    assert proof._sgd(sgd, True, 1.0, {}.get, False, torch.float32) is not None  # none yet: the gradient is its start
    assert proof._sgd({**sgd, "dampening": None}, False, 1.0, {"momentum_buffer": 1.0}.get, False, torch.float32) \
        is not None  # no dampening given: none


L32 = torch.finfo(torch.float32).max / 8  # the largest bound kept in float32


def _proven_state(cls: type, settings: dict[str, Any], grad: float, state: dict[str, float] | None = None) -> bool:
    """Whether, after one step of ``cls(settings)`` on a float32 parameter with gradient ``grad`` (its state as given,
    each value learnt exactly), every state tensor the step wrote is proven finite."""
    p = torch.nn.Parameter(torch.zeros(1))
    opt = cls([p], **settings)
    if state is not None:
        opt.state[p] = {k: torch.tensor(v) if k == "step" else torch.tensor([v]) for k, v in state.items()}
    check = StepProof(opt)
    for key, t in opt.state.get(p, {}).items():
        check.learn(p, key, t, abs(float(t)))
    p.grad = torch.tensor([grad])
    check.before_step({p: abs(grad)})
    opt.step()
    check.after_step()
    return all(check.proven(p, key, t) for key, t in opt.state[p].items())


def test_each_intermediate_the_rule_bounds_decides_alone():
    """Every intermediate value the update computes stays below an eighth of the dtype's largest value, or nothing of
    the step is proven: each of Adam's (the gradient's square, the old second moment, the gradient plus the old first
    moment, ``m' / eps`` and the parameter's move) and SGD's (nesterov's direction, the parameter's move), on one
    side of the limit and then the other, the rest below it."""
    adam, at = {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8}, {"step": 3.0, "exp_avg": 0.0, "exp_avg_sq": 0.0}
    b1, b2 = {"betas": (0.0, 0.999)}, {"betas": (0.9, 0.0)}
    for settings, grad, state, below, above in (
            ({}, None, None, math.sqrt(L32 / 2), math.sqrt(2 * L32)),  # g^2
            (b2, 1.0, "exp_avg_sq", L32 / 2, 2 * L32),  # v
            (b1, 1.0, "exp_avg", L32 / 2, 2 * L32),  # g + |m|
            (b1, 1.0, "eps", 1e-37, 1e-38),  # m' / eps
            (b1, 1.0, "lr", 1e29, 1e30)):  # the move
        sides = []
        for value in (below, above):
            if grad is None:
                sides.append(_proven_state(torch.optim.Adam, adam | settings, value))
            elif state in at:
                sides.append(_proven_state(torch.optim.Adam, adam | settings, grad, at | {state: value}))
            else:
                sides.append(_proven_state(torch.optim.Adam, adam | settings | {state: value}, grad))
        assert sides == [True, False], (settings, state)
    nesterov = {"lr": 1e-30, "momentum": 4.0, "nesterov": True}  # its direction g + 4 buf' is 4x the buffer
    assert _proven_state(torch.optim.SGD, nesterov, 1.0, {"momentum_buffer": L32 / 32})
    assert not _proven_state(torch.optim.SGD, nesterov, 1.0, {"momentum_buffer": L32 / 8})
    assert _proven_state(torch.optim.SGD, {"lr": 1e37, "momentum": 0.5}, 1.0)
    assert not _proven_state(torch.optim.SGD, {"lr": 1e38, "momentum": 0.5}, 1.0)


def test_a_step_rounds_up_by_four_roundings_and_a_subnormal():
    """``_up``: above the value after four roundings up in the dtype, and above a subnormal result's absolute
    rounding; by no more than that."""
    for dtype in (torch.float32, torch.bfloat16, torch.float16, F64):
        info = torch.finfo(dtype)
        for x in (0.0, info.tiny, 1.0, 3.0, info.max / 16):
            up = torch.tensor(x, dtype=F64)
            for _ in range(4):
                up = up * (1 + info.eps)
            low, high = float(up) + 4 * info.tiny, proof._up(x, dtype)
            assert low * (1 - 1e-15) <= high <= low * (1 + 1e-15), (dtype, x)
