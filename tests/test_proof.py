"""The state-read proof (replay/proof.py): a state tensor it calls proven is finite, for any gradients and any of the
update rules' hyperparameters; the replay names the same origin, coordinate and events with it as without it."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from nanforensics.replay.engine import ReplayOptions, replay_run
from nanforensics.replay.monitor import StepMonitor
from nanforensics.replay.proof import StateProof, provable

import scenarios

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _optimizer(kind: str, p: torch.Tensor, h: dict) -> torch.optim.Optimizer:
    if kind == "sgd":
        return torch.optim.SGD([p], lr=h["lr"], momentum=h["momentum"], dampening=h["dampening"],
                               nesterov=h["nesterov"] and h["dampening"] == 0 and h["momentum"] > 0, maximize=h["maximize"],
                               weight_decay=h["weight_decay"])
    cls = torch.optim.Adam if kind == "adam" else torch.optim.AdamW
    return cls([p], lr=h["lr"], betas=(h["beta1"], h["beta2"]), eps=h["eps"], amsgrad=h["amsgrad"],
               maximize=h["maximize"], weight_decay=h["weight_decay"])


HYPER = st.fixed_dictionaries({
    "lr": st.sampled_from([1e-3, 1.0]), "beta1": st.sampled_from([0.0, 0.5, 0.9, 0.999999]),
    "beta2": st.sampled_from([0.0, 0.5, 0.999, 0.9999999]), "eps": st.sampled_from([0.0, 1e-8]),
    "amsgrad": st.booleans(), "maximize": st.booleans(), "weight_decay": st.sampled_from([0.0, 0.1]),
    "momentum": st.sampled_from([0.0, 0.9, 1.0, 2.0]), "dampening": st.sampled_from([0.0, 0.5, -1.0]),
    "nesterov": st.booleans()})


@settings(max_examples=120, deadline=None)
@given(kind=st.sampled_from(["adam", "adamw", "sgd"]), dtype=st.sampled_from(sorted(DTYPES)), h=HYPER,
       exponents=st.lists(st.floats(-0.2, 1.1), min_size=1, max_size=8), seed=st.integers(0, 2**16))
def test_a_state_tensor_proven_finite_is_finite(kind, dtype, h, exponents, seed):
    """Gradients up to and past the square root of the dtype's largest value (exponent 0.5) and past the largest
    value itself: whatever the proof calls proven is finite and within its bound; what it does not is read, as the
    monitor reads it, and what a read finds finite is learnt."""
    dt = DTYPES[dtype]
    top = math.log2(torch.finfo(dt).max)
    generator = torch.Generator().manual_seed(seed)
    p = torch.nn.Parameter(torch.randn(64, generator=generator).to(dt))
    optimizer = _optimizer(kind, p, h)
    proof = StateProof(optimizer)
    grad_max: dict[torch.Tensor, float] = {}
    optimizer.register_step_pre_hook(lambda *_: proof.before_step(grad_max))
    optimizer.register_step_post_hook(lambda *_: proof.after_step())
    proven = 0
    for e in exponents:
        with torch.no_grad():
            p.copy_(p.nan_to_num(0.0, 0.0, 0.0))  # a parameter gone non-finite would end the story
        p.grad = (torch.randn(64, generator=generator, dtype=torch.float64) * 2.0 ** (e * top)).to(dt)
        lo, hi = (float(x) for x in torch.aminmax(p.grad))
        grad_max[p] = max(-lo, hi) if math.isfinite(lo) and math.isfinite(hi) else math.inf
        optimizer.step()
        for key, t in optimizer.state[p].items():
            if not t.is_floating_point():
                continue
            held = proof._known.get(p, {}).get(key)
            if proof.proven(p, key, t):
                proven += 1
                assert bool(torch.isfinite(t).all()), (key, t)
                assert float(t.abs().max()) <= held[2], (key, held)
            elif bool(torch.isfinite(t).all()):
                proof.learn(p, key, t, float(t.float().abs().max()))
    if kind == "sgd" and (h["momentum"] == 0 or h["weight_decay"]) or kind == "adam" and h["weight_decay"]:
        assert proven == 0  # nothing to prove, or L2 weight decay: no proof


def _monitored_steps(optimizer_factory, steps: int = 4) -> list[int]:
    """The state tensors proven (not read) at each monitored step of a small model."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    optimizer = optimizer_factory(model.parameters())
    proven = []
    with StepMonitor(model, optimizer) as monitor:
        for step in range(steps):
            x = torch.randn(16, 8)
            monitor.begin(step, {"x": x}, locate=False)
            optimizer.zero_grad()
            loss = model(x).square().mean()
            loss.backward()
            optimizer.step()
            assert monitor.end(loss) == []
            proven.append(monitor.state_proven)
    return proven


def test_the_monitor_reads_the_state_only_where_nothing_proves_it():
    adam = _monitored_steps(lambda ps: torch.optim.Adam(ps, lr=1e-3))
    assert adam[0] == 8 and adam[1:] == [8] * 3  # exp_avg, exp_avg_sq of 4 tensors; fresh state from zeros
    assert _monitored_steps(lambda ps: torch.optim.SGD(ps, lr=1e-3, momentum=0.9)) == [4] * 4
    assert _monitored_steps(lambda ps: torch.optim.Adam(ps, lr=1e-3, weight_decay=0.1)) == [0] * 4  # L2 decay
    assert _monitored_steps(lambda ps: torch.optim.RMSprop(ps, lr=1e-3)) == [0] * 4  # a rule not known
    assert not provable(torch.optim.RMSprop([torch.nn.Parameter(torch.zeros(1))]))


@pytest.mark.parametrize("name", sorted(scenarios.SCENARIOS))
def test_the_proof_changes_no_origin_coordinate_or_event(runs, name):
    with_proof = replay_run(runs[name], ReplayOptions(device="cpu", explain=False))
    without = replay_run(runs[name], ReplayOptions(device="cpu", explain=False, state_proof=False))
    assert with_proof.origin == without.origin
    assert with_proof.events == without.events
    assert [(s.step, s.params_nonfinite, s.state_nonfinite) for s in with_proof.spread] == \
        [(s.step, s.params_nonfinite, s.state_nonfinite) for s in without.spread]
