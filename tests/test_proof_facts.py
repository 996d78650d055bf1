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
from nanforensics.replay.proof import Hazard, StepProof, Update, UpdateCheck, max_abs

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
            ({"betas": (0.5, 1.0)}, torch.float32), ({"betas": (0.5, 1 - 2**-29), "eps": 1e-3}, torch.float16),
            ({"lr": math.inf}, torch.float32), ({"lr": 1e300, "weight_decay": 1e300}, torch.float32)]
    for change, dtype in read:
        update = proof._adam({**adam, **change}, False, 1.0, known.get, True, dtype)
        assert update is not None and update.scale is None and set(update.state) == {"exp_avg", "exp_avg_sq", "step"}, \
            change
    # sqrt(1 - beta2) at float16's smallest normal, 2^-14, exactly
    for change, dtype in (({"eps": 1e-8}, torch.float32), ({"betas": (0.5, 1 - 2**-28), "eps": 1e-3}, torch.float16),
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
    assert _proven_state(torch.optim.SGD, {"lr": 10.0, "momentum": 0.5}, 0.0)  # a zero gradient moves nothing
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


def _all_proven(check: StepProof, opt: torch.optim.Optimizer, p: torch.Tensor) -> bool:
    return bool(opt.state[p]) and all(check.proven(p, key, t) for key, t in opt.state[p].items())


def test_what_the_proof_keeps_from_step_to_step_and_what_it_forgets():
    """A step proves what it writes where the rule bounds it; the parameter from a bound read before; nothing of a
    parameter while its step runs; a parameter the step skips (no gradient) keeps what was known; a tensor replaced
    or written in place, or a bound past the limit, is not proven; ``forget`` drops everything."""
    p, q = torch.nn.Parameter(torch.ones(2)), torch.nn.Parameter(torch.ones(2))
    opt = torch.optim.Adam([p, q], lr=1e-3)
    check = StepProof(opt)
    assert check.rule is proof._adam and not check.decoupled

    def step(grads: dict[torch.Tensor, float], *, before: Any = None) -> list[torch.Tensor]:
        for t in (p, q):
            t.grad = torch.full((2,), grads[t]) if t in grads else None
        check.before_step({t: abs(g) for t, g in grads.items()})
        if before is not None:
            before()
        opt.step()
        check.after_step()
        return [next(n for n, t in (("p", p), ("q", q)) if t is u) for u in check.unproven]

    check.learn(q, None, q, 1.0)
    assert step({p: 1.0}) == ["p"]  # its state proven from zeros; the parameter never read: not
    assert _all_proven(check, opt, p) and not check.proven(p, None, p)
    assert check.proven(q, None, q) and not opt.state[q]  # skipped: as it was
    check.learn(p, None, p, float(p.detach().abs().max()))
    assert check.proven(p, None, p)
    assert step({p: 1.0}, before=lambda: check.proven(p, None, p) and pytest.fail("proven while its step runs")) == []
    assert _all_proven(check, opt, p) and check.proven(p, None, p)
    with torch.no_grad():
        p.add_(0.0)  # written in place by something else: its version moved
    assert not check.proven(p, None, p) and _all_proven(check, opt, p)
    assert step({p: 1.0}) == ["p"] and _all_proven(check, opt, p) and not check.proven(p, None, p)
    check.learn(p, None, p, float(p.detach().abs().max()))
    opt.state[p]["exp_avg"] = opt.state[p]["exp_avg"].clone()  # replaced
    assert not check.proven(p, "exp_avg", opt.state[p]["exp_avg"]) and check.proven(p, "exp_avg_sq", opt.state[p]["exp_avg_sq"])
    assert step({p: 1.0}) == ["p"] and not _all_proven(check, opt, p)  # its old bound unknown: no proof of the step
    for key, t in opt.state[p].items():
        check.learn(p, key, t, float(t.abs().max()))
    check.learn(p, None, p, float(p.detach().abs().max()))
    opt.state[p]["exp_avg_sq"].add_(0.0)  # written in place
    assert step({p: 1.0}) == ["p"]
    for key, t in opt.state[p].items():
        check.learn(p, key, t, float(t.abs().max()))
    check.learn(p, None, p, float(p.detach().abs().max()))
    assert step({p: 1.0, q: 2.0}) == [] and _all_proven(check, opt, q) and check.proven(q, None, q)  # q's first
    for grads in ({p: math.inf, q: 1.0}, {p: math.nan, q: 1.0}, {p: 1e30, q: 1.0}):  # g^2 past float32's largest
        assert step(grads) == ["p"], grads
    assert not check.proven(p, "exp_avg", opt.state[p]["exp_avg"])
    p.grad, q.grad = torch.ones(2), torch.ones(2)
    check.before_step({q: 1.0})  # no gradient magnitude given for p: nothing proves it
    assert [u is p for u in check.unproven] == [True]
    check.learn(p, None, p, L32 * 2)
    assert not check.proven(p, None, p)  # a bound past the limit proves nothing
    check.learn(p, None, p, L32)
    assert check.proven(p, None, p)
    check.forget()
    assert not check.proven(p, None, p) and not _all_proven(check, opt, q)
    opt.step()
    check.after_step()  # forgotten: the step's expected bounds too
    assert not _all_proven(check, opt, q)


def test_the_parameter_bound_past_the_limit_is_read():
    """A parameter whose known bound, decayed and moved, passes the limit is read (its state still proven)."""
    p = torch.nn.Parameter(torch.ones(1))
    opt = torch.optim.SGD([p], lr=1.0)
    check = StepProof(opt)
    for bound, proven in ((L32 / 2, True), (L32, False)):
        check.learn(p, None, p, bound)
        p.grad = torch.ones(1)
        check.before_step({p: 1.0})
        assert (not check.unproven) == proven, bound


def test_the_groups_each_rule_covers():
    """L2 weight decay, fused and the rest leave a group uncovered; decoupled decay (AdamW's, or Adam's
    ``decoupled_weight_decay``) does not."""
    p = torch.nn.Parameter(torch.ones(1))
    cases = [(torch.optim.Adam, {}, True), (torch.optim.Adam, {"weight_decay": 0.1}, False),
             (torch.optim.Adam, {"weight_decay": 0.1, "decoupled_weight_decay": True}, True),
             (torch.optim.AdamW, {"weight_decay": 0.1}, True), (torch.optim.Adam, {"amsgrad": True}, True),
             (torch.optim.SGD, {"momentum": 0.9}, True), (torch.optim.SGD, {"weight_decay": 0.1}, False)]
    for cls, settings, covered in cases:
        check = StepProof(cls([p], lr=1e-3, **settings))
        assert check.covers(check.optimizer.param_groups[0]) == covered, (cls, settings)
        assert check.decoupled == (cls is torch.optim.AdamW)
        assert check.rule is (proof._sgd if cls is torch.optim.SGD else proof._adam)
    check = StepProof(torch.optim.Adam([p], lr=1e-3))
    assert not check.covers({**check.optimizer.param_groups[0], "fused": True})
    assert check.covers({**check.optimizer.param_groups[0], "weight_decay": 0.1, "decoupled_weight_decay": True})


def test_the_largest_magnitude_of_each_tensor():
    """Exact, NaN and infinities kept, any dtype, a sparse tensor by its stored values; none for none."""
    sparse = torch.sparse_coo_tensor(torch.tensor([[0, 3]]), torch.tensor([-5.0, 2.0]), (6,), check_invariants=True)
    values = max_abs([torch.tensor([1.0, -3.0]), torch.tensor([math.nan, 1.0]), torch.tensor([-math.inf], dtype=torch.float16),
                      torch.tensor([0.5], dtype=torch.bfloat16), sparse, torch.tensor([2.0**-140])])
    assert values[0] == 3.0 and math.isnan(values[1]) and values[2:] == [math.inf, 0.5, 5.0, 2.0**-140]
    assert max_abs([]) == []


def _guarded(*groups: dict[str, Any]) -> tuple[torch.optim.Optimizer, UpdateCheck]:
    opt = torch.optim.Adam(list(groups), lr=1e-3)
    return opt, UpdateCheck(opt)


def test_the_guard_names_the_first_hazard_by_its_position_in_the_optimizers_order():
    """Positions count every parameter of every group (those without a gradient, those of uncovered groups); the
    hazard is the real step's first non-finite value (state before the parameter), tried on a copy that writes
    nothing; what nothing bounds yet is read first and learnt; a group the rule does not cover is not tried."""
    a, b, c, d, e = (torch.nn.Parameter(torch.zeros(3)) for _ in range(5))
    opt, check = _guarded({"params": [a, b]}, {"params": [c], "weight_decay": 0.1}, {"params": [d, e]})
    assert check.uncovered() == [1]
    # d's square passes the proof's limit but not float32's largest (a trial finds it finite), e's passes both
    b.grad, c.grad, d.grad = torch.ones(3), torch.full((3,), 4e37), torch.full((3,), 1e19)
    e.grad = torch.tensor([1.0, -4e37, 4e37])
    found = check.hazard({b: 1.0, c: 4e37, d: 1e19, e: 4e37})
    assert found == Hazard(4, "exp_avg_sq", [1], "inf")
    assert check.trials == 2 and not opt.state and float(e.detach().abs().max()) == 0  # d and e tried, on copies
    assert not check.proof.proven(a, None, a)  # no gradient: not read
    e.grad = torch.ones(3)
    assert check.hazard({b: 1.0, c: 4e37, d: 1e19, e: 1.0}) is None and check.trials == 3  # d's again
    d.grad = torch.ones(3)
    assert check.hazard({b: 1.0, c: 4e37, d: 1.0, e: 1.0}) is None and check.trials == 3
    opt.step()
    check.after_step()
    assert all(check.proof.proven(t, None, t) for t in (b, d, e))


def test_the_guards_trial_reads_the_real_step():
    """The parameter itself, or a state value, by its coordinate and value; a setting the copy's step cannot take is
    the real step's to meet; only floating state is read (an integer step count is not)."""
    p = torch.nn.Parameter(torch.tensor([0.0, 1.0]))
    opt = torch.optim.SGD([p], lr=1e38)
    check = UpdateCheck(opt)
    p.grad = torch.tensor([1.0, -4.0])
    assert check.hazard({p: 4.0}) == Hazard(0, "param", [1], "inf")
    p.grad = torch.tensor([4.0, 1.0])
    assert check.hazard({p: 4.0}) == Hazard(0, "param", [0], "-inf")
    opt.param_groups[0]["lr"] = "1e38"  # no number: the copy's step raises, and the real step meets it itself
    assert check.hazard({p: 4.0}) is None
    nan = torch.nn.Parameter(torch.tensor([1.0, 2.0]))
    opt = torch.optim.Adam([nan], lr=1e-3, eps=0.0, betas=(0.0, 0.0))
    opt.state[nan] = {"step": torch.tensor(1.0), "exp_avg": torch.zeros(2), "exp_avg_sq": torch.zeros(2),
                      "count": torch.tensor([7])}
    check = UpdateCheck(opt)
    assert [key for key, _ in check._tensors(nan)] == [None, "step", "exp_avg", "exp_avg_sq"]
    nan.grad = torch.tensor([1.0, 0.0])
    assert check.hazard({nan: 1.0}) == Hazard(0, "param", [1], "nan")  # 0 / 0 where eps is 0


def test_before_the_first_step_and_after_the_last():
    """Nothing is unproven before a step; a step's bounds are kept once: a second post-hook with no step between (the
    state written in place meanwhile) proves nothing of what was written."""
    p = torch.nn.Parameter(torch.ones(1))
    opt = torch.optim.SGD([p], lr=1e-3, momentum=0.9)
    check = StepProof(opt)
    assert check.unproven == []
    check.after_step()  # a post-hook with no step before it
    assert not opt.state
    p.grad = torch.ones(1)
    check.before_step({p: 1.0})
    opt.step()
    check.after_step()
    buf = opt.state[p]["momentum_buffer"]
    assert check.proven(p, "momentum_buffer", buf)
    buf.fill_(math.inf)
    check.after_step()
    assert not check.proven(p, "momentum_buffer", buf)


def test_adams_decoupled_weight_decay_is_proven_as_adamws_and_a_complex_parameter_is_read():
    for make, proven in ((lambda ps: torch.optim.Adam(ps, weight_decay=0.1, decoupled_weight_decay=True), True),
                         (lambda ps: torch.optim.Adam(ps, weight_decay=0.1), False)):
        p = torch.nn.Parameter(torch.ones(1))
        opt = make([p])
        check = StepProof(opt)
        p.grad = torch.ones(1)
        check.before_step({p: 1.0})
        opt.step()
        check.after_step()
        assert _all_proven(check, opt, p) == proven
    z = torch.nn.Parameter(torch.ones(2, dtype=torch.complex64))
    opt = torch.optim.Adam([z])
    check = StepProof(opt)
    z.grad = torch.ones(2, dtype=torch.complex64)
    check.before_step({z: 1.0})
    assert [u is z for u in check.unproven] == [True]
    opt.step()
    check.after_step()
    assert not _all_proven(check, opt, z)


def test_the_parameter_bound_decays_by_the_learning_rate_times_the_weight_decay():
    """AdamW's ``p (1 - lr wd)``: a parameter at 0.6 of the limit halves, and stays proven."""
    p = torch.nn.Parameter(torch.full((1,), 0.6 * L32))
    opt = torch.optim.AdamW([p], lr=0.5, weight_decay=1.0)
    check = StepProof(opt)
    check.learn(p, None, p, 0.6 * L32)
    p.grad = torch.ones(1)
    check.before_step({p: 1.0})
    assert check.unproven == []
    opt.step()
    check.after_step()
    assert check.proven(p, None, p)


def test_the_guard_reads_only_what_nothing_proves(monkeypatch):
    """The first check reads the parameter and its state; once a step proved them, nothing is read again until
    something writes them."""
    reads: list[int] = []
    real = proof.max_abs
    monkeypatch.setattr(proof, "max_abs", lambda tensors: reads.append(len(tensors)) or real(tensors))
    p = torch.nn.Parameter(torch.ones(3))
    opt = torch.optim.Adam([p], lr=1e-3)
    check = UpdateCheck(opt)
    for _ in range(3):
        p.grad = torch.ones(3)
        assert check.hazard({p: 1.0}) is None
        opt.step()
        check.after_step()
    with torch.no_grad():
        p.add_(0.0)
    p.grad = torch.ones(3)
    check.hazard({p: 1.0})
    assert reads == [1, 0, 0, 1]  # the parameter (its state, from zeros, proven by the step); nothing; it again


def test_the_guards_trial_leaves_the_real_state_as_it_was():
    """The trial steps copies: the real optimizer's state tensors are not written, and a state value that is no
    tensor goes to the copy as it is."""
    p = torch.nn.Parameter(torch.ones(3))
    opt = torch.optim.Adam([p], lr=1e-3)
    p.grad = torch.ones(3)
    opt.step()
    opt.state[p]["note"] = 3  # some optimizers keep a number beside their tensors
    before = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in opt.state[p].items()}
    param = p.detach().clone()
    check = UpdateCheck(opt)
    p.grad = torch.full((3,), 1e19)  # past the proof's limit, not float32's: tried, and finite
    assert check.hazard({p: 1e19}) is None and check.trials == 1
    assert all(torch.equal(v, before[k]) if isinstance(v, torch.Tensor) else v == before[k]
               for k, v in opt.state[p].items())
    assert torch.equal(p.detach(), param)
