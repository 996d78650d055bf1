"""Optimizer state that is finite but unsound (checkpoints/soundness.py): Adam's bound checked against the optimizer's
own arithmetic on generated gradients, no false alarm on checkpoints of long healthy runs, and each defect a resume
meets (moments restored apart, a negative second moment, state saved in bf16, a step counter reset, lr = inf in one
group, eps = 0 beside zero second moments, a loss scale of inf) named by ``scan`` (exit 5) and by ``replay`` from
that checkpoint."""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
import random
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from nanforensics.checkpoints import chunks, soundness
from nanforensics.checkpoints.scan import CLEAN, scan_checkpoint
from nanforensics.formats import open_checkpoint
from nanforensics.replay.engine import ReplayOptions, replay_run
from nanforensics.replay.unrecorded import replay_checkpoint
from nanforensics.runs.checkpoint import save_checkpoint
from safetensors.torch import load_file, save_file

import resume_training
import scenarios
from conftest import ROOT, run_cli

RESUME = "tests/resume_training.py"  # as a user names their script, from the checkout's root


# ---- the bound, against torch's own Adam -------------------------------------------------------------------------


def _adam_state(grads: list[torch.Tensor], dtype: torch.dtype, **kwargs: Any) -> tuple[dict[str, torch.Tensor], dict]:
    """Torch's Adam driven by ``grads``: its per-element state, widened to float32 as the scan reads it (float64
    kept)."""
    p = torch.zeros(grads[0].shape, dtype=dtype, requires_grad=True)
    opt = torch.optim.Adam([p], **kwargs)
    for g in grads:
        p.grad = g.to(dtype)
        opt.step()
    state = {k: v.to(torch.promote_types(v.dtype, torch.float32)) for k, v in opt.state[p].items() if v.dim() > 0}
    return state, opt.param_groups[0]


@st.composite
def gradient_runs(draw: Any) -> tuple[list[torch.Tensor], dict[str, Any], torch.dtype]:
    """Gradient sequences of any shape over time: magnitudes from 1e-20 to 1e12, bursts, growth, zeros, sign flips."""
    b2 = draw(st.sampled_from([0.95, 0.99, 0.999, 0.9999]))
    b1 = draw(st.floats(0.0, min(0.99, math.sqrt(b2) - 1e-3)))
    steps = draw(st.integers(1, 120))
    seed = draw(st.integers(0, 2**31 - 1))
    pattern = draw(st.sampled_from(["noise", "growth", "burst", "decay", "sparse"]))
    exponent = draw(st.integers(-20, 12))
    gen = torch.Generator().manual_seed(seed)
    grads = []
    for k in range(steps):
        g = torch.randn(8, generator=gen) * 10.0 ** exponent
        if pattern == "growth":
            g = g.abs() * (b2 / max(b1, 1e-3)) ** min(k, 40)  # the sequence that makes Cauchy-Schwarz tight
        elif pattern == "burst":
            g = g * (1e6 if k == steps - 1 else 1.0)
        elif pattern == "decay":
            g = g * 0.5 ** k
        elif pattern == "sparse":
            g = g * (torch.rand(8, generator=gen) < 0.1)
        grads.append(g)
    kwargs = {"betas": (b1, b2), "amsgrad": draw(st.booleans()), "weight_decay": draw(st.sampled_from([0.0, 0.1])),
              draw(st.sampled_from(["foreach", "fused"])): draw(st.booleans())}
    return grads, kwargs, draw(st.sampled_from([torch.float32, torch.bfloat16]))


@settings(max_examples=150, deadline=None)
@given(gradient_runs())
def test_adam_moments_never_break_the_checks(run):
    grads, kwargs, dtype = run
    state, group = _adam_state(grads, dtype, lr=1e-3, **kwargs)
    if not all(torch.isfinite(v).all() for v in state.values()):
        return  # an overflow is the finiteness scan's to report
    broken = {name: int(mask.sum()) for name, mask in soundness.flags(state, {**group, "_dtype": dtype}).items()
              if mask.any()}
    assert not broken, (broken, kwargs, dtype)


def test_the_bound_is_the_least_one():
    """Gradients growing as (b2/b1)^k reach it (in float64, where they do not overflow): no smaller factor holds."""
    b1, b2 = 0.9, 0.999
    limit = soundness.adam_bound(b1, b2)
    assert limit == pytest.approx(7.27, abs=0.01)
    grads = [torch.full((1,), (b2 / b1) ** k, dtype=torch.float64) for k in range(400)]
    state, group = _adam_state(grads, torch.float64, betas=(b1, b2))
    ratio = float(state["exp_avg"].abs() / state["exp_avg_sq"].sqrt())
    assert 0.999 * limit < ratio <= limit
    assert not any(m.any() for m in soundness.flags(state, group).values())
    assert soundness.adam_bound(0.99, 0.9) is None and soundness.adam_bound(0.9, 1.0) is None  # b1^2 >= b2, b2 = 1
    for b1 in (0.5, 0.75, 0.875):  # b1^2 = b2 exactly (these squares are exact): no bound, not a division by 0
        assert b1 * b1 < 1 and soundness.adam_bound(b1, b1 * b1) is None


_KEYS = ("exp_avg", "exp_avg_sq", "max_exp_avg_sq")


@pytest.mark.parametrize("betas", [None, (0.9, 0.999), (0.99, 0.9)], ids=["no-betas", "bounded", "b1^2>b2"])
@pytest.mark.parametrize("keys", [k for n in range(1, 4) for k in itertools.combinations(_KEYS, n)], ids=str)
def test_each_check_applies_exactly_where_its_tensors_and_betas_are(keys, betas):
    """Every subset of Adam's tensors, with betas that bound them, that do not, or none: a negative second moment
    planted at 0, a maximum below v at 1, an exp_avg 100 times past the bound at 2; each check reports its own
    coordinate where its tensors (and, for the bound, betas) are there, and nothing else is reported."""
    planted = {"exp_avg_sq": [-1.0, 1.0, 1.0, 1.0], "max_exp_avg_sq": [1.0, 0.5, 1.0, 1.0],
               "exp_avg": [0.0, 0.0, 100.0, 0.0]}
    state = {k: torch.tensor(planted[k]) for k in keys}
    hyper = {} if betas is None else {"betas": betas}
    expected = {f"{soundness.NEGATIVE}:{k}": [0] if k == "exp_avg_sq" else [] for k in keys if k in soundness.NONNEGATIVE}
    if {"max_exp_avg_sq", "exp_avg_sq"} <= set(keys):
        expected[f"{soundness.AMSGRAD}:max_exp_avg_sq"] = [1]
    if {"exp_avg", "exp_avg_sq"} <= set(keys) and betas == (0.9, 0.999):
        expected[f"{soundness.BOUND}:exp_avg"] = [2]
    got = {name: mask.nonzero().flatten().tolist() for name, mask in soundness.flags(state, hyper).items()}
    assert got == expected
    suspect = soundness._suspect(state, minima(state), hyper, torch.empty(4))
    assert suspect == any(expected.values())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64], ids=str)
def test_the_absolute_slack_is_the_edge(dtype):
    """Beside a second moment of 0, an exp_avg of exactly the absolute slack is sound and the next float32 up is not."""
    for b1, b2 in ((0.9, 0.999), (0.0, 0.99), (0.95, 0.9999)):
        limit = soundness.adam_bound(b1, b2)
        atol = torch.tensor(soundness._tolerance(dtype, b1, b2, limit)[1], dtype=torch.float32)
        state = {"exp_avg": torch.stack([atol, torch.nextafter(atol, torch.tensor(math.inf))]),
                 "exp_avg_sq": torch.zeros(2)}
        mask = soundness.flags(state, {"betas": (b1, b2), "_dtype": dtype})[f"{soundness.BOUND}:exp_avg"]
        assert mask.tolist() == [False, True], (b1, b2)


# ---- the screen: a chunk it passes has nothing for the masks to flag ------------------------------------------------


_MAGNITUDES = st.sampled_from([0.0, 2.0 ** -149, 1e-42, 1.2e-38, 1e-30, 1e-20, 1e-8, 1e-3, 1.0, 1e10, 1e19, 1e30,
                               3e38])


@st.composite
def state_chunks(draw: Any) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Finite float32 chunks of exp_avg, exp_avg_sq and (sometimes) max_exp_avg_sq, with m placed on, just inside and
    just outside Adam's bound and its slack (ulps and rtol apart), at every scale from denormal to overflow."""
    b2 = draw(st.sampled_from([0.95, 0.99, 0.999, 0.9999]))
    b1 = draw(st.floats(0.0, math.sqrt(b2) - 1e-3))
    dtype = draw(st.sampled_from([torch.float32, torch.bfloat16, torch.float16, torch.float64]))
    limit = soundness.adam_bound(b1, b2)
    rtol, atol = soundness._tolerance(dtype, b1, b2, limit)
    n = draw(st.integers(1, 3))  # few coordinates: any one found suspect makes the whole chunk so
    v = [draw(_MAGNITUDES) * draw(st.sampled_from([1.0, 1.0, -1.0])) for _ in range(n)]
    m = []
    for x in v:
        edge = limit * math.sqrt(max(x, 0.0)) * draw(st.sampled_from([1.0, 1 + rtol / 2, 1 + rtol])) + \
            draw(st.sampled_from([0.0, atol / math.sqrt(2), atol]))
        m.append(draw(st.sampled_from([1.0, -1.0])) * edge * (1 + draw(st.sampled_from([0.0, 1e-7, -1e-7, 1e-4,
                                                                                             -1e-4, -1.0]))))
    state = {"exp_avg": torch.tensor(m, dtype=torch.float64).float(), "exp_avg_sq": torch.tensor(v).float()}
    if draw(st.booleans()):  # amsgrad's maximum: an ulp above v, equal, an ulp below, or of the other sign
        towards = torch.tensor([draw(st.sampled_from([math.inf, -math.inf, math.nan])) for _ in range(n)])
        step = torch.nextafter(state["exp_avg_sq"], towards.nan_to_num(0.0))
        state["max_exp_avg_sq"] = torch.where(towards.isnan(), -state["exp_avg_sq"], step)
    assume(all(bool(t.isfinite().all()) for t in state.values()))
    return state, {"betas": (b1, b2), "_dtype": dtype}


def minima(state: dict[str, torch.Tensor]) -> dict[str, float]:
    """Each chunk's minimum, as the scan's finiteness pass hands it to the screen."""
    return {k: float(t.amin()) for k, t in state.items()}


@settings(max_examples=400, deadline=None)
@given(state_chunks())
def test_the_screen_passes_no_chunk_the_masks_would_flag(chunk):
    """The screen (reductions, no masks) is a sufficient condition for ``flags`` finding nothing: the class is a
    cheap pre-check that must never call clean what the exact check flags."""
    state, hyper = chunk
    flagged = {name: mask.nonzero().flatten().tolist() for name, mask in soundness.flags(state, hyper).items()
               if mask.any()}
    if flagged:
        assert soundness._suspect(state, minima(state), hyper, torch.empty(len(state["exp_avg"]))), (flagged, state)


def test_the_screen_passes_healthy_adam_state():
    """Not vacuous: torch's own Adam state over ordinary gradients is passed without building a mask."""
    grads = [torch.randn(4096, generator=torch.Generator().manual_seed(k)) for k in range(50)]
    state, group = _adam_state(grads, torch.float32, amsgrad=True)
    assert not soundness._suspect(state, minima(state), {**group, "_dtype": torch.float32}, torch.empty(4096))
    state["exp_avg"][7] = 8 * state["exp_avg_sq"][7].sqrt()  # past the bound (7.27 at these betas)
    assert soundness._suspect(state, minima(state), {**group, "_dtype": torch.float32}, torch.empty(4096))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_the_screen_passes_state_at_the_bound_and_where_gradients_were_zero(dtype):
    """Passed, not merely unflagged: coordinates that never had a gradient (m = v = 0, the minimum of v is 0) and
    torch's Adam on gradients growing as (b2/b1)^t, which take |m|/sqrt(v) to the bound itself. A screen that called
    these suspect would build the masks for every chunk of an embedding or of a run at its bound."""
    b1, b2 = 0.9, 0.999
    p = torch.nn.Parameter(torch.zeros(1024, dtype=dtype))
    optimizer = torch.optim.Adam([p], betas=(b1, b2), amsgrad=True)
    base = torch.rand(1024, generator=torch.Generator().manual_seed(0), dtype=torch.float64) + 0.5
    base[:64] = 0  # never a gradient there
    for t in range(60):
        p.grad = (base * (b2 / b1) ** t * 1e-6).to(dtype)
        optimizer.step()
        state = {k: optimizer.state[p][k].float() for k in _KEYS}
        hyper = {"betas": (b1, b2), "_dtype": dtype}
        assert not soundness._suspect(state, minima(state), hyper, torch.empty(1024)), t


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64], ids=str)
def test_the_screen_passes_no_pair_the_masks_would_flag_over_a_grid(dtype):
    """Every pair of a grid of exp_avg and exp_avg_sq, the exp_avg not tied to the bound (the generated chunks above
    place it at the bound's edges): where ``flags`` flags the pair, the screen calls it suspect. Among them: a second
    moment of 0 beside a first moment so small its square underflows float32, in float64 state."""
    magnitudes = [0.0, 2.0 ** -149, 1e-23, 1e-20, 1e-10, 1.0, 1e19]
    for b1, b2 in ((0.9, 0.999), (0.5, 0.99)):
        hyper = {"betas": (b1, b2), "_dtype": dtype}
        for m, v in itertools.product(magnitudes, repeat=2):
            state = {"exp_avg": torch.tensor([m]), "exp_avg_sq": torch.tensor([v])}
            if soundness.flags(state, hyper)[f"{soundness.BOUND}:exp_avg"].any():
                assert soundness._suspect(state, minima(state), hyper, torch.empty(1)), (m, v, b1, b2)


# ---- one pass: the findings do not depend on how the state is cut into chunks ----------------------------------------


def _flawed_adam(rng: random.Random, n: int, edge: int) -> dict[str, Any]:
    """A torch.save checkpoint of two Adam parameters (amsgrad or not, moments of both signs or all >= 0), flaws on
    and beside multiples of ``edge`` (chunk edges) and at the ends: a negative second moment, an exp_avg past the
    bound, a maximum below v; the second parameter's moments in bfloat16 (widened chunk by chunk), with a NaN in its
    last chunk where ``rng`` says."""
    params = [torch.nn.Parameter(torch.zeros(n)), torch.nn.Parameter(torch.zeros(3, n))]
    opt = torch.optim.Adam(params, amsgrad=rng.random() < 0.5)
    g = torch.Generator().manual_seed(rng.randrange(2**31))
    signs = rng.choice([torch.Tensor.abs, torch.Tensor.clone])
    for _ in range(3):
        for p in params:
            p.grad = signs(torch.randn(p.shape, generator=g))
        opt.step()
    state = opt.state_dict()
    for st_ in state["state"].values():
        last = st_["exp_avg"].numel() - 1
        near = [edge * k + d for k in range(1, last // edge, 2) for d in (-1, 0)] + [0, last]
        for key, scale in (("exp_avg_sq", -1.0), ("exp_avg", 20.0), ("max_exp_avg_sq", 0.5)):
            for i in rng.sample(near, rng.randint(1, 3)) if key in st_ else []:
                st_[key].view(-1)[i] *= scale
    second = state["state"][1]
    for key in ("exp_avg", "exp_avg_sq", "max_exp_avg_sq"):
        if key in second:
            second[key] = second[key].to(torch.bfloat16)
    if rng.random() < 0.3:
        second["exp_avg"].view(-1)[-1] = math.nan
    return {"model": {"a": params[0].detach(), "b": params[1].detach()}, "optimizer": state}


@pytest.mark.parametrize("seed", range(10))
def test_findings_do_not_depend_on_the_chunks(tmp_path, monkeypatch, seed):
    """The scan reads a parameter's state once, its tensors in lockstep chunks, the checks fed each chunk and its
    minima (checkpoints/chunks.py): the report (findings, first coordinates, counts, extremes, the verdict) is the same
    with chunks of 4 or 12, 16 or 48 and 8M elements, and each check's first coordinate and count are the ones the
    masks give over the whole tensors; as a torch.save file (Adam's groups: the bound checked) and as safetensors
    (no groups: the second moments' signs screened by the minima alone). A wrong offset, minima given to the wrong
    tensor or a chunk left out each break it."""
    rng = random.Random(seed)
    edge = rng.choice([4, 12])
    obj = _flawed_adam(rng, rng.choice([37, 64, 101]), edge)
    state, group = obj["optimizer"]["state"], obj["optimizer"]["param_groups"][0]
    torch.save(obj, tmp_path / "ck.pt")
    save_file({**obj["model"], **{f"optimizer.{p}.{k}": v for i, p in enumerate("ab") for k, v in state[i].items()}},
              tmp_path / "ck.safetensors")
    for file, hyper in (("ck.pt", group), ("ck.safetensors", {})):
        reports = []
        for size in (edge * 4, 48 if edge == 4 else 16, chunks.CHUNK_BYTES):  # bytes: a float32 chunk's elements x 4
            monkeypatch.setattr(chunks, "CHUNK_BYTES", size)
            report = dataclasses.asdict(scan_checkpoint(open_checkpoint(tmp_path / file), full=True))
            report.pop("seconds")
            reports.append(report)
        assert reports[0] == reports[1] == reports[2]
        masks = soundness.flags({k: v for k, v in state[0].items() if v.dim()}, {**hyper, "_dtype": torch.float32})
        expected = {name: mask.nonzero().flatten().tolist() for name, mask in masks.items() if mask.any()}
        found = {f"{u['check']}:{u['tensor'].rpartition('.')[2]}": u for u in reports[0]["unsound"]
                 if u["param"] in ("a", "optimizer.a") and u["check"] in soundness.ELEMENTWISE}
        assert {name: u["index"] for name, u in found.items()} == {name: i[:1] for name, i in expected.items()}, file
        for name, flagged in expected.items():
            assert (f"({len(flagged)} coordinates in all)" in found[name]["message"]) == (len(flagged) > 1)


# ---- long healthy runs: no false alarm ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Healthy:
    label: str
    steps: int
    optimizer: Callable[[list[torch.nn.Parameter]], torch.optim.Optimizer]
    dtype: torch.dtype = torch.float32
    clip: bool = False


HEALTHY = [
    Healthy("AdamW wd=0.1 amsgrad foreach, clipped", 3000,
            lambda p: torch.optim.AdamW(p, lr=3e-3, weight_decay=0.1, amsgrad=True, foreach=True), clip=True),
    Healthy("Adam L2 wd fused, bf16 parameters", 2000,
            lambda p: torch.optim.Adam(p, lr=1e-2, weight_decay=1e-2, fused=True), dtype=torch.bfloat16),
    Healthy("AdamW single-tensor, betas (0.8, 0.95)", 1500,
            lambda p: torch.optim.AdamW(p, lr=1e-2, betas=(0.8, 0.95), foreach=False)),
    Healthy("NAdam", 500, lambda p: torch.optim.NAdam(p, lr=1e-2)),
    Healthy("SGD momentum 0.9 nesterov wd", 500,
            lambda p: torch.optim.SGD(p, lr=1e-2, momentum=0.9, nesterov=True, weight_decay=1e-4)),
    Healthy("Adafactor", 500, lambda p: torch.optim.Adafactor(p, lr=1e-2)),
]


@pytest.fixture(scope="module")
def healthy(tmp_path_factory: pytest.TempPathFactory) -> list[tuple[str, int, Path]]:
    """Checkpoints of tiny MLPs trained for thousands of steps on noisy, heavy-tailed data, every 500 steps (and the
    last), each in the run format and as a torch.save dict (state matched by order)."""
    root = tmp_path_factory.mktemp("healthy")
    out = []
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a 2-layer MLP of 177 parameters: dispatch, not arithmetic
    try:
        for n, h in enumerate(HEALTHY):
            torch.manual_seed(n)
            model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1)).to(h.dtype)
            opt = h.optimizer(list(model.parameters()))
            x_all = torch.randn(h.steps, 16, 8)
            noise = torch.distributions.StudentT(2.0).sample((h.steps, 16, 1))  # heavy tails: gradient bursts
            for step in range(h.steps + 1):
                if step % 500 == 0 or step == h.steps:
                    label = f"{n}_{step}"
                    out.append((h.label, step, save_checkpoint(root / "ours" / label, step, model, opt)))
                    pt = root / "pt" / f"{label}.pt"
                    pt.parent.mkdir(parents=True, exist_ok=True)
                    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(), "step": step}, pt)
                    out.append((h.label, step, pt))
                if step == h.steps:
                    break
                x = x_all[step].to(h.dtype)
                y = (x.float().sin().sum(1, keepdim=True) + noise[step]).to(h.dtype)
                opt.zero_grad(set_to_none=True)
                torch.nn.functional.mse_loss(model(x), y).backward()
                if h.clip:
                    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                opt.step()
    finally:
        torch.set_num_threads(threads)
    return out


def test_long_healthy_runs_are_clean(healthy):
    alarms = []
    for label, step, path in healthy:
        report = scan_checkpoint(open_checkpoint(path))
        assert report.verdict == CLEAN and report.soundness is not None, (label, step)
        alarms += [(label, step, path.suffix, u.message) for u in report.unsound]
    assert not alarms, alarms[:3]
    steps = sum(h.steps for h in HEALTHY)
    assert len(healthy) == 2 * sum(h.steps // 500 + 1 + (h.steps % 500 > 0) for h in HEALTHY) and steps == 8000


def test_healthy_kinds_and_what_is_not_checked(healthy):
    kinds = {label: scan_checkpoint(open_checkpoint(path)).soundness for label, step, path in healthy
             if step == 500 and path.suffix == ".pt"}
    assert kinds["AdamW wd=0.1 amsgrad foreach, clipped"].optimizers == [
        "Adam-family (Adam, AdamW, NAdam, RAdam) with amsgrad"]
    assert kinds["SGD momentum 0.9 nesterov wd"].optimizers == ["SGD with momentum"]
    assert kinds["Adafactor"].optimizers == ["Adafactor (factored second moments)"]
    assert kinds["NAdam"].matched_by_order and any("by order" in n for n in kinds["NAdam"].notes)


# ---- defects in recorded checkpoints: scan and replay name them ----------------------------------------------------

START = 10  # the checkpoint each defect is put into, replayed from


@pytest.fixture(scope="module")
def recorded(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The clean scenario (Adam) and the mixed-precision one with a GradScaler, recorded with checkpoints at 0, 5, 10."""
    root = tmp_path_factory.mktemp("recorded")
    scenarios.record(root / "adam", "clean", steps=14, checkpoint_every=5)
    scenarios.record(root / "amp", "fp16_scaler_catches", steps=13, checkpoint_every=5)
    return {"adam": root / "adam", "amp": root / "amp"}


def _tensors(ck: Path, edit: Callable[[dict[str, torch.Tensor]], None]) -> None:
    path = ck / "optimizer.safetensors"
    tensors = {k: v.clone() for k, v in load_file(path).items()}
    edit(tensors)
    save_file(tensors, path, metadata={"format": "nanforensics.checkpoint/1", "step": str(START)})


def _meta(ck: Path, edit: Callable[[dict[str, Any]], None]) -> None:
    meta = json.loads((ck / "meta.json").read_text())
    edit(meta)
    (ck / "meta.json").write_text(json.dumps(meta))


def _zero_v(t: dict[str, torch.Tensor]) -> None:
    t["fc1.weight/exp_avg_sq"].zero_()  # a partial restore: the second moments fresh, the first kept


def _negative(t: dict[str, torch.Tensor]) -> None:
    t["fc2.weight/exp_avg_sq"][1, 2] = -1.0


def _bf16(t: dict[str, torch.Tensor]) -> None:
    t["fc1.weight/exp_avg_sq"] = t["fc1.weight/exp_avg_sq"].bfloat16()


def _step_reset(t: dict[str, torch.Tensor]) -> None:
    for key in [k for k in t if k.endswith("/step")]:
        t[key] = torch.zeros_like(t[key])


def _eps_zero(meta: dict[str, Any]) -> None:
    meta["param_groups"][0]["eps"] = 0.0


def _never_updated(t: dict[str, torch.Tensor]) -> None:
    """Coordinates that never got a gradient (an unused embedding row): both moments exactly 0."""
    for key in ("features.gain/exp_avg", "features.gain/exp_avg_sq"):
        t[key][:4] = 0.0


def _scale_inf(meta: dict[str, Any]) -> None:
    meta["scaler"]["scale"] = {"$float": "inf"}


@dataclass(frozen=True)
class Defect:
    run: str
    tensors: Callable[[dict[str, torch.Tensor]], None] | None
    meta: Callable[[dict[str, Any]], None] | None
    check: str
    tensor: str
    index: list[int] | None
    says: str  # in the message: what it does at the next update


DEFECTS = {
    "exp_avg_sq zeroed, exp_avg kept": Defect("adam", _zero_v, None, soundness.BOUND, "fc1.weight/exp_avg", [0, 0],
                                              "the next update there is m/(sqrt(v)+eps)"),
    "one negative exp_avg_sq": Defect("adam", _negative, None, soundness.NEGATIVE, "fc2.weight/exp_avg_sq", [1, 2],
                                      "the next update takes its square root there: NaN"),
    "exp_avg_sq saved in bf16": Defect("adam", _bf16, None, soundness.DTYPE, "fc1.weight/exp_avg_sq", None,
                                       "load_state_dict casts it back"),
    "step reset to 0, moments kept": Defect("adam", _step_reset, None, soundness.STEP, "features.gain/step", None,
                                            "bias correction divides them as if they held one gradient"),
    "eps 0 beside zero second moments": Defect("adam", _never_updated, _eps_zero, soundness.EPS_ZERO,
                                               "features.gain/exp_avg_sq", [0], "0/0 = NaN"),
    "loss scale inf": Defect("amp", None, _scale_inf, soundness.LOSS_SCALE, "scaler.scale", None,
                             "the scaler skips every step"),
}


@pytest.fixture(scope="module")
def damaged(recorded: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A copy of the recorded run per defect, the defect put into its checkpoint of step START."""
    root = tmp_path_factory.mktemp("damaged")
    out = {}
    for n, (name, d) in enumerate(DEFECTS.items()):
        run = root / str(n)
        shutil.copytree(recorded[d.run], run)
        ck = run / "checkpoints" / f"step_{START:08d}"
        if d.tensors:
            _tensors(ck, d.tensors)
        if d.meta:
            _meta(ck, d.meta)
        out[name] = run
    return out


def _named(unsound: list[Any], d: Defect) -> Any:
    hits = [u for u in unsound if u["check"] == d.check and u["tensor"] == d.tensor] if isinstance(unsound[0], dict) \
        else [u for u in unsound if u.check == d.check and u.tensor == d.tensor]
    assert hits, [(u["check"], u["tensor"]) if isinstance(u, dict) else (u.check, u.tensor) for u in unsound]
    return hits[0]


@pytest.mark.parametrize("name", list(DEFECTS))
def test_scan_names_the_defect(damaged, name):
    d = DEFECTS[name]
    report = scan_checkpoint(open_checkpoint(damaged[name] / "checkpoints" / f"step_{START:08d}"))
    assert report.verdict == CLEAN  # finite: the verdict is finiteness's, the findings and exit code say unsound
    hit = _named(report.unsound, d)
    assert hit.index == d.index and d.says in hit.message
    before = scan_checkpoint(open_checkpoint(damaged[name] / "checkpoints" / f"step_{START - 5:08d}"))
    assert before.verdict == CLEAN and before.unsound == []  # the checkpoint before it, untouched


def test_scan_exit_code_5_json_and_terminal(damaged):
    d = DEFECTS["one negative exp_avg_sq"]
    result = run_cli("scan", damaged["one negative exp_avg_sq"] / "checkpoints" / f"step_{START:08d}", "--json", "-")
    assert result.code == 5, (result.code, result.stderr)
    report = result.json()
    assert report["verdict"] == "clean" and report["soundness"]["optimizers"] == [
        "Adam-family (Adam, AdamW, NAdam, RAdam)"]
    hit = _named(report["unsound"], d)
    assert set(hit) == {"check", "tensor", "param", "group", "index", "values", "message"}
    assert (hit["param"], hit["group"], hit["index"]) == ("fc2.weight", 0, [1, 2]) and d.says in hit["message"]
    assert hit["values"]["exp_avg_sq"] == -1.0
    d = DEFECTS["loss scale inf"]
    text = run_cli("scan", damaged["loss scale inf"] / "checkpoints" / f"step_{START:08d}")
    assert text.code == 5 and "UNSOUND OPTIMIZER STATE" in text.stdout and f"Unsound ({d.check})" in text.stdout
    assert "the optimizer state is unsound (1 finding)" in text.stdout


@pytest.mark.parametrize("name", list(DEFECTS))
def test_replay_from_the_checkpoint_names_the_defect(damaged, name):
    d = DEFECTS[name]
    report = replay_run(damaged[name], ReplayOptions(from_step=START, max_steps=3, explain=False))
    assert report.setup.from_checkpoint == START
    hit = _named(report.unsound, d)
    assert d.says in hit.message
    assert any(f.startswith(f"The start checkpoint (step {START}) is finite but its optimizer state is unsound")
               for f in report.findings)


def test_a_negative_second_moment_is_the_origin_and_a_reset_saves_the_run(damaged):
    report = replay_run(damaged["one negative exp_avg_sq"], ReplayOptions(from_step=START, max_steps=4,
                                                                          explain=False))
    assert (report.origin.step, report.origin.tensor, report.origin.index) == (START, "fc2.weight", [1, 2])
    assert any("The origin, fc2.weight[1, 2] at step 10, lies on what the start checkpoint's "
               "negative_second_moment check flagged" in f for f in report.findings)
    reset = next(w for w in report.what_if if w.intervention == "reset-state")  # run without being asked
    assert reset.finite and reset.detail.startswith("at the resume, zeroed the unsound optimizer state of 1 coordinate")
    assert any("the run stays finite with reset-state" in f for f in report.findings)


def test_a_clean_start_says_nothing_of_soundness(recorded):
    report = replay_run(recorded["adam"], ReplayOptions(from_step=START, max_steps=2, explain=False))
    assert report.unsound == [] and not any("unsound" in f for f in report.findings)


# ---- checkpoints a trainer wrote: torch.save dicts, matched by order -----------------------------------------------


@pytest.fixture(scope="module")
def trainer(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """resume_training's state after 10 steps (two AdamW groups), saved by torch.save without parameter names: healthy,
    with lr = inf in the second group, and with one negative exp_avg_sq in fc1.bias (whose shape fc2.bias shares)."""
    root = tmp_path_factory.mktemp("trainer")
    model, opt = resume_training.train(START)
    names = [n for n, _ in model.named_parameters()]
    order = [n for g in opt.param_groups for p in g["params"] for n, q in model.named_parameters() if q is p]
    out = {"healthy": resume_training.save(root / "healthy.pt", model, opt.state_dict(), START)}
    sd = opt.state_dict()
    sd["param_groups"][1]["lr"] = math.inf
    out["lr_inf"] = resume_training.save(root / "lr_inf.pt", model, sd, START)
    sd = opt.state_dict()
    sd["state"][order.index("fc1.bias")]["exp_avg_sq"][3] = -1.0
    out["negative"] = resume_training.save(root / "negative.pt", model, sd, START)
    assert set(names) == set(order)
    return out


def test_lr_inf_in_one_group(trainer):
    result = run_cli("scan", trainer["lr_inf"], "--json", "-")
    assert result.code == 5
    hit = next(u for u in result.json()["unsound"] if u["check"] == soundness.HYPERPARAMETER)
    assert (hit["tensor"], hit["group"], hit["values"]) == ("param_groups[1].lr", 1, {"lr": "inf"})
    assert "by inf times its step direction" in hit["message"]
    report = replay_checkpoint(trainer["lr_inf"], str(ROOT / RESUME), options=ReplayOptions(max_steps=2, explain=False))
    assert report.origin is not None and report.origin.step == START
    assert report.origin.tensor in ("features.gain", "fc1.bias", "fc2.bias", "head.bias")  # group 1: no decay
    assert any("lies on what the start checkpoint's hyperparameter check flagged: group 1's lr is inf" in f
               for f in report.findings)
    assert not any(w.intervention == "reset-state" for w in report.what_if)  # a reset cannot mend a learning rate


def test_matched_by_order_replay_names_the_shape_twins(trainer):
    result = run_cli("replay", "--checkpoint", trainer["negative"], "--code", RESUME, "--max-steps", "3",
                     "--no-explain", "--json", "-", cwd=ROOT)
    assert result.code == 1, result.stderr
    r = result.json()
    assert (r["origin"]["tensor"], r["origin"]["index"]) == ("fc1.bias", [3])
    hit = next(u for u in r["unsound"] if u["check"] == soundness.NEGATIVE)
    # named as the replay matched it: by its position in the optimizer's order (group 1's second, 5th in all)
    assert (hit["param"], hit["tensor"], hit["index"]) == ("fc1.bias", "optimizer.state.4.exp_avg_sq", [3])
    assert any("matched to the parameters by order" in f and "fc1.bias shares its shape [32] with fc2.bias" in f
               for f in r["findings"])
    assert [(w["intervention"], w["finite"]) for w in r["what_if"]] == [("none", False), ("reset-state", True)]
    healthy = replay_checkpoint(trainer["healthy"], str(ROOT / RESUME), options=ReplayOptions(max_steps=2, explain=False))
    assert healthy.verdict == "clean" and healthy.unsound == []
    assert not any("shares its shape" in f for f in healthy.findings)  # said beside an origin only


def test_bisect_reports_an_unsound_checkpoint_with_exit_code_5(trainer, tmp_path):
    folder = tmp_path / "ckpts"
    folder.mkdir()
    shutil.copy(trainer["healthy"], folder / "step_000010.pt")
    later = torch.load(trainer["lr_inf"], weights_only=True)  # the same state, saved as step 20's
    torch.save({**later, "step": 20}, folder / "step_000020.pt")
    result = run_cli("bisect", folder, "--json", "-")
    assert result.code == 5, result.stderr
    report = result.json()
    assert report["verdict"] == "clean" and [h["unsound"] for h in report["history"]] == [1, 0]


def test_factored_and_momentum_state(tmp_path):
    """Adafactor's factored moments must be >= 0; SGD's momentum buffer saved in a narrower dtype is named."""
    model = torch.nn.Linear(4, 3)
    ada = torch.optim.Adafactor(model.parameters(), lr=1e-2)
    sgd = torch.optim.SGD(model.parameters(), lr=1e-2, momentum=0.9)
    for opt in (ada, sgd):
        model(torch.randn(5, 4)).sum().backward()
        opt.step()
    sd = ada.state_dict()
    sd["state"][0]["col_var"][0, 2] = -1e-3
    torch.save({"model": model.state_dict(), "optimizer": sd}, tmp_path / "ada.pt")
    found = scan_checkpoint(open_checkpoint(tmp_path / "ada.pt")).unsound
    assert [(u.check, u.tensor, u.index) for u in found] == [(soundness.NEGATIVE, "optimizer.state.0.col_var", [0, 2])]
    sd = sgd.state_dict()
    sd["state"][0]["momentum_buffer"] = sd["state"][0]["momentum_buffer"].half()
    for group in sd["param_groups"]:
        group["param_names"] = ["weight", "bias"]
    torch.save({"model": model.state_dict(), "optimizer": sd}, tmp_path / "sgd.pt")
    found = scan_checkpoint(open_checkpoint(tmp_path / "sgd.pt")).unsound
    assert [(u.check, u.param) for u in found] == [(soundness.DTYPE, "weight")]
    assert "values below 6e-05 flushed towards 0" in found[0].message


def test_the_other_checks_and_betas_that_give_no_bound(recorded, tmp_path):
    """Shape, a step past the checkpoint's own, differing steps in a group, weight decay inf; and betas with
    b1^2 >= b2, which give no bound: said in the notes, never an alarm."""
    run = tmp_path / "run"
    shutil.copytree(recorded["adam"], run)
    ck = run / "checkpoints" / f"step_{START:08d}"

    def edit(t: dict[str, torch.Tensor]) -> None:
        t["fc1.bias/exp_avg"] = torch.zeros(16)
        t["fc2.bias/step"] = torch.tensor(12.0)
        t["head.bias/step"] = torch.tensor(3.0)

    _tensors(ck, edit)
    _meta(ck, lambda meta: meta["param_groups"][0].update(betas=[0.99, 0.9], weight_decay=math.inf))
    report = scan_checkpoint(open_checkpoint(ck))
    found = {(u.check, u.tensor) for u in report.unsound}
    assert found == {(soundness.SHAPE, "fc1.bias/exp_avg"), (soundness.STEP, "fc2.bias/step"),
                     (soundness.STEP, "param_groups[0].step"), (soundness.HYPERPARAMETER, "param_groups[0].weight_decay")}
    messages = {u.tensor: u.message for u in report.unsound}
    assert "past the checkpoint's own step 10" in messages["fc2.bias/step"]
    assert "head.bias at 3, fc2.bias at 12" in messages["param_groups[0].step"]
    assert any("give no bound on |exp_avg|" in n for n in report.soundness.notes)


@pytest.mark.parametrize("factor", [1.0, 1.05, 1.09])
def test_a_first_moment_past_adams_bound_is_flagged_on_a_real_checkpoint(recorded, tmp_path, factor):
    """One exp_avg coordinate of a recorded Adam checkpoint set to ``factor`` times the bound over its own exp_avg_sq:
    at the bound it is a state Adam can reach (clean); 5% or 9% past it, no gradients could have made it (flagged,
    at that coordinate). The slack is rounding: a tolerance loosened to 0.1% or more lets these through."""
    run = tmp_path / "run"
    shutil.copytree(recorded["adam"], run)
    ck = run / "checkpoints" / f"step_{START:08d}"
    b1, b2 = json.loads((ck / "meta.json").read_text())["param_groups"][0]["betas"]
    v = load_file(ck / "optimizer.safetensors")["fc1.weight/exp_avg_sq"]
    index = divmod(int(v.argmax()), v.shape[1])  # the largest second moment: far from the absolute floor

    def past_the_bound(t: dict[str, torch.Tensor]) -> None:
        t["fc1.weight/exp_avg"][index] = -factor * soundness.adam_bound(b1, b2) * math.sqrt(float(v[index]))

    _tensors(ck, past_the_bound)
    report = scan_checkpoint(open_checkpoint(ck))
    hits = [u for u in report.unsound if u.check == soundness.BOUND and u.tensor == "fc1.weight/exp_avg"]
    assert [h.index for h in hits] == ([list(index)] if factor > 1 else []), [(u.check, u.tensor) for u in report.unsound]
