"""The state-read proof (replay/proof.py): a state tensor it calls proven is finite, for any gradients and any of the
update rules' hyperparameters; the replay names the same origin, coordinate and events with it as without it."""

from __future__ import annotations

import json
import math
from typing import Any, Callable

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st
from nanforensics.replay.engine import ReplayOptions, replay_run
from nanforensics.replay.monitor import StepMonitor
from nanforensics.replay.proof import StepProof, provable

import scenarios
from conftest import run_cli

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
    "beta2": st.sampled_from([0.0, 0.5, 0.999, 0.9999999, 1 - 1e-12]), "eps": st.sampled_from([0.0, 1e-8, 1e-3]),
    "amsgrad": st.booleans(), "maximize": st.booleans(), "weight_decay": st.sampled_from([0.0, 0.1]),
    "momentum": st.sampled_from([0.0, 0.9, 1.0, 2.0]), "dampening": st.sampled_from([0.0, 0.5, -1.0]),
    "nesterov": st.booleans()})
ZERO_BETAS = {"lr": 1e-3, "beta1": 0.0, "beta2": 0.0, "amsgrad": False, "maximize": False, "weight_decay": 0.0,
              "momentum": 0.0, "dampening": 0.0, "nesterov": False}


@settings(max_examples=150, deadline=None)
@given(kind=st.sampled_from(["adam", "adamw", "sgd"]), dtype=st.sampled_from(sorted(DTYPES)), h=HYPER,
       exponents=st.lists(st.floats(-0.2, 1.1), min_size=1, max_size=8), seed=st.integers(0, 2**16),
       zeros=st.lists(st.booleans(), min_size=8, max_size=8))
@example(kind="adam", dtype="float16", h=ZERO_BETAS | {"eps": 1e-8}, exponents=[0.0] * 3, seed=0, zeros=[0, 0, 1] * 3)
@example(kind="adamw", dtype="float32", h=ZERO_BETAS | {"eps": 0.0}, exponents=[0.0] * 3, seed=0, zeros=[0, 0, 1] * 3)
def test_what_is_proven_finite_is_finite(kind, dtype, h, exponents, seed, zeros):
    """Gradients up to and past the square root of the dtype's largest value (exponent 0.5) and past the largest
    value itself, some all zero (with ``beta1 = beta2 = 0``, Adam's ``0 / 0`` where ``eps`` is or rounds to 0):
    every state tensor and parameter the proof calls proven is finite and within its bound; what it does not is
    read, as the monitor reads it, and what a read finds finite is learnt. A parameter found non-finite is reset,
    which moves its version counter."""
    dt = DTYPES[dtype]
    top = math.log2(torch.finfo(dt).max)
    generator = torch.Generator().manual_seed(seed)
    p = torch.nn.Parameter(torch.randn(64, generator=generator).to(dt))
    optimizer = _optimizer(kind, p, h)
    proof = StepProof(optimizer)
    grad_max: dict[torch.Tensor, float] = {}
    optimizer.register_step_pre_hook(lambda *_: proof.before_step(grad_max))
    optimizer.register_step_post_hook(lambda *_: proof.after_step())
    proven = params_proven = 0
    for i, e in enumerate(exponents):
        scale = 0.0 if zeros[i] else 2.0 ** (e * top)
        p.grad = (torch.randn(64, generator=generator, dtype=torch.float64) * scale).to(dt)
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
        if proof.proven(p, None, p):
            params_proven += 1
            assert bool(torch.isfinite(p).all()), p
            assert float(p.detach().abs().max()) <= proof._known[p][None][2], proof._known[p][None]
        elif bool(torch.isfinite(p).all()):
            proof.learn(p, None, p, float(p.detach().float().abs().max()))
        else:
            with torch.no_grad():
                p.copy_(p.nan_to_num(0.0, 0.0, 0.0))  # a parameter gone non-finite would end the story
    if kind == "sgd" and h["weight_decay"] or kind == "adam" and h["weight_decay"]:
        assert proven == params_proven == 0  # L2 weight decay: no proof
    if kind == "sgd" and h["momentum"] == 0:
        assert proven == 0  # no state
    if kind != "sgd" and h["eps"] == 0:
        assert params_proven == 0  # 0 / 0 from finite state


def _monitored(optimizer_factory, steps: int = 4, prove: bool = True,
               after_step: Callable[[int, torch.nn.Module], None] = lambda step, model: None) -> list[tuple[Any, ...]]:
    """Each monitored step of a small model: (state tensors proven, parameters proven, its events as (step, stage,
    tensor)); ``after_step`` runs between ``optimizer.step()`` and the monitor's end of the step."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    optimizer = optimizer_factory(model.parameters())
    out = []
    with StepMonitor(model, optimizer, prove=prove) as monitor:
        for step in range(steps):
            x = torch.randn(16, 8)
            monitor.begin(step, {"x": x}, locate=False)
            optimizer.zero_grad()
            loss = model(x).square().mean()
            loss.backward()
            optimizer.step()
            after_step(step, model)
            events = [(e.step, e.stage, e.tensor) for e in monitor.end(loss)]
            out.append((monitor.proven["optimizer_state"], monitor.proven["param"], events))
    return out


def _monitored_steps(optimizer_factory) -> list[tuple[int, int]]:
    """The state tensors and the parameters proven (not read) at each monitored step; no step flagged."""
    steps = _monitored(optimizer_factory)
    assert not any(events for *_, events in steps)
    return [(state, params) for state, params, _ in steps]


def test_the_monitor_reads_only_what_nothing_proves():
    # exp_avg, exp_avg_sq, step of 4 tensors, fresh state from zeros; the parameters once, to learn their bounds
    assert _monitored_steps(lambda ps: torch.optim.Adam(ps, lr=1e-3)) == [(12, 0)] + [(12, 4)] * 3
    assert _monitored_steps(lambda ps: torch.optim.AdamW(ps, lr=1e-3, weight_decay=0.1)) == [(12, 0)] + [(12, 4)] * 3
    assert _monitored_steps(lambda ps: torch.optim.Adam(ps, lr=1e-3, eps=0.0)) == [(12, 0)] * 4  # 0 / 0: read
    assert _monitored_steps(lambda ps: torch.optim.SGD(ps, lr=1e-3, momentum=0.9)) == [(4, 0)] + [(4, 4)] * 3
    assert _monitored_steps(lambda ps: torch.optim.SGD(ps, lr=1e-3)) == [(0, 0)] + [(0, 4)] * 3
    assert _monitored_steps(lambda ps: torch.optim.Adam(ps, lr=1e-3, weight_decay=0.1)) == [(0, 0)] * 4  # L2 decay
    assert _monitored_steps(lambda ps: torch.optim.RMSprop(ps, lr=1e-3)) == [(0, 0)] * 4  # a rule not known
    assert not provable(torch.optim.RMSprop([torch.nn.Parameter(torch.zeros(1))]))


def _poison(write: str) -> Callable[[int, torch.nn.Module], None]:
    """At step 2, a write into the last layer's bias that makes it non-finite: in place, or through ``.data``."""
    def after_step(step: int, model: torch.nn.Module) -> None:
        if step == 2 and write == "in place":
            with torch.no_grad():
                model[2].bias.clamp_(min=math.inf)  # moves the version counter
        elif step == 2:
            model[2].bias.data.fill_(math.nan)  # a write through .data moves no version counter
    return after_step


def test_a_parameter_written_after_the_step_is_read():
    """A write the optimizer did not make, in place after the step, is read, and the non-finite value it writes is
    the step's param event."""
    *_, (_, params_proven, events) = _monitored(lambda ps: torch.optim.Adam(ps, lr=1e-3), 3, after_step=_poison("in place"))
    assert params_proven == 3  # the other three; the bias was read
    assert events == [(2, "param", "2.bias")]


def test_a_write_through_data_is_seen_only_when_everything_is_read():
    """The proof's stated assumption, held where it fails: ``--read-all`` (``proof=False``) is the way out."""
    for prove, expected in ((False, [(2, "param", "2.bias")]), (True, [])):
        *_, (_, _, events) = _monitored(lambda ps: torch.optim.Adam(ps, lr=1e-3), 3, prove, _poison(".data"))
        assert events == expected


@pytest.mark.parametrize("name", sorted(scenarios.SCENARIOS))
def test_the_proof_changes_no_origin_coordinate_or_event(runs, name):
    with_proof = replay_run(runs[name], ReplayOptions(device="cpu", explain=False))
    without = replay_run(runs[name], ReplayOptions(device="cpu", explain=False, proof=False))
    assert with_proof.origin == without.origin
    assert with_proof.events == without.events
    assert [(s.step, s.params_nonfinite, s.state_nonfinite) for s in with_proof.spread] == \
        [(s.step, s.params_nonfinite, s.state_nonfinite) for s in without.spread]


def test_read_all_on_the_command_line_names_the_same_origin(runs, tmp_path):
    run = runs["adam_near_zero"]
    proven, read = (run_cli("replay", run, "--json", tmp_path / f"{name}.json", "--no-explain", *extra, "--quiet")
                    for name, extra in (("proven", ()), ("read", ("--read-all",))))
    assert proven.code == read.code
    a, b = (json.loads((tmp_path / f"{name}.json").read_text()) for name in ("proven", "read"))
    assert a["origin"] == b["origin"] and a["events"] == b["events"]
