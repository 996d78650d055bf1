"""A seeded generator of small training programs, each a real module with ``build_model``, ``make_optimizer``,
``make_batch`` and ``train_step`` at module level (what the project's Recorder records and replay imports).

A program is drawn axis by axis (``AXES``) from ``random.Random(seed)``, only among values that fit together (a sparse
embedding trains with an optimizer that takes sparse gradients; a fault on float inputs needs float inputs), and
written out as source: the same seed gives the same file, so a seed is a regression case.

Large batches are opt-in (``draw(seed, large=True)``, ``python -m tests.oracle --large-batches``): the seed's program
(every axis, its data seed) with a batch drawn from ``LARGE_SIZES``, all above ``ALONE_UP_TO``, so sample attribution
probes and halves instead of running each sample alone. The plain draw never reaches them, and drawing them consumes
nothing of the seed's own stream: every existing seed draws the same program as before. A large program is named by
its seed and size (``prog_SEED_bSIZE``, the axis ``size``); ``(seed, large)`` is its regression case.
"""

from __future__ import annotations

import importlib
import random
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import torch
from nanforensics.runs.optimizers import UNSUPPORTED as UNSUPPORTED_WITH_SEVERAL

STEPS = 6  # steps a program trains for; the fault lands at FAULT_STEP
FAULT_STEP = 3
CLASSES = 3  # classes of the classification losses: never a batch size, so a per-batch (3,) tensor is never a row

ARCHS = ("mlp", "conv_bn", "conv_gn", "attention", "lstm", "gru", "embedding", "embedding_sparse", "weight_norm",
         "spectral_norm", "checkpoint", "custom_function", "func_per_sample", "compiled")
LOSSES = ("mse", "cross_entropy", "poisson", "kl", "contrastive")
OPTIMIZERS = tuple(sorted(n for n in dir(torch.optim) if n != "Optimizer" and isinstance(getattr(torch.optim, n), type)
                          and issubclass(getattr(torch.optim, n), torch.optim.Optimizer)))
OPTIMIZER_COUNTS = ("one", "two")
STEP_SHAPES = ("plain", "clip", "accumulation", "bf16_autocast", "fp16_scaler", "scheduler", "after_update")
BATCH_SHAPES = ("rows", "ids", "per_batch_tensor")
CHECKPOINTS = {"start": 100, "every_2": 2}  # checkpoint_every: one before step 0, or one every two steps (state in it)
FAULTS = ("none", "inf_input", "nan_input", "huge_input", "constant_row", "log_zero", "masked_inf_zero", "eps_zero",
          "lr_spike", "slow_overflow", "no_target")
AXES: dict[str, tuple[str, ...]] = {"arch": ARCHS, "loss": LOSSES, "optimizer": OPTIMIZERS,
                                    "optimizers": OPTIMIZER_COUNTS, "step": STEP_SHAPES, "batch": BATCH_SHAPES,
                                    "fault": FAULTS, "checkpoints": tuple(CHECKPOINTS)}
# the opt-in large batches: above rootcause/samples.py's ALONE_UP_TO (32), even (two micro-batches of accumulation keep
# every row); 34 just above the limit; small models, so a pass stays cheap at 64 rows
LARGE_SIZES = (34, 48, 64)
LARGE_AXES: dict[str, tuple[str, ...]] = {**AXES, "size": tuple(map(str, LARGE_SIZES))}

TOKENS = ("attention", "embedding", "embedding_sparse")  # archs fed token ids, not floats
SPARSE_OK = ("SparseAdam", "SGD", "Adagrad")  # the optimizers that take a sparse gradient
EPS = ("Adam", "AdamW", "Adamax", "NAdam", "RAdam", "RMSprop", "Adagrad", "Adadelta")  # those with an eps to set to 0
CLOSURE = ("LBFGS",)  # step(closure) only
SCHEDULED = ("lr_spike", "slow_overflow")  # faults an LR scheduler makes


def features(step: str, fault: str) -> tuple[str, ...]:
    """What a program of this step shape and fault gives the Recorder besides model and optimizer."""
    scheduled = step == "scheduler" or fault in SCHEDULED
    return (("scaler",) if step == "fp16_scaler" else ()) + (("scheduler",) if scheduled else ())


@dataclass(frozen=True)
class Program:
    seed: int
    axes: dict[str, str]
    batch_size: int
    source: str

    @property
    def name(self) -> str:
        return f"prog_{self.seed}" + (f"_b{self.axes['size']}" if "size" in self.axes else "")


def draw(seed: int, large: bool = False) -> Program:
    """The program of ``seed``: each axis drawn uniformly among the values that fit the ones drawn before it;
    ``large``: the same program with a batch from ``LARGE_SIZES`` (the module's docstring), axis ``size``."""
    rng = random.Random(seed)
    arch = rng.choice(ARCHS)
    losses = ("mse", "cross_entropy", "poisson", "kl") if arch == "func_per_sample" else LOSSES
    loss = rng.choice(losses)
    optimizer = rng.choice(SPARSE_OK if arch == "embedding_sparse" else [o for o in OPTIMIZERS if o != "SparseAdam"])
    count = rng.choice(OPTIMIZER_COUNTS) if arch in ("mlp", "conv_bn", "lstm") and optimizer != "Muon" else "one"
    shapes = ["plain", "clip", "scheduler", "after_update"] if arch in ("func_per_sample", "embedding_sparse") \
        or optimizer in CLOSURE or count == "two" else list(STEP_SHAPES)
    if arch == "compiled" or loss == "contrastive":
        shapes = [s for s in shapes if s != "accumulation"]
    if arch == "embedding_sparse":  # clip_grad_norm_ takes no sparse gradient
        shapes = [s for s in shapes if s != "clip"]
    step = rng.choice(shapes)
    batch = rng.choice(BATCH_SHAPES)
    faults = ["none", "lr_spike", "slow_overflow"]
    if arch not in TOKENS:
        faults += ["inf_input", "nan_input", "huge_input", "constant_row", "log_zero"]
    if arch in ("attention", "mlp"):
        faults.append("masked_inf_zero")
    if optimizer in EPS:
        faults.append("eps_zero")
    fault = rng.choice(faults)
    if loss == "cross_entropy" and fault == "none" and random.Random(-seed - 1).random() < 0.8:
        fault = "no_target"  # drawn apart, so the draws above stay those of the seeds kept as regression cases
    if arch == "conv_bn" and fault == "none" and random.Random(-seed - 6).random() < 0.75:
        # BatchNorm under an overflow the schedule makes: a sample fails alone and passes among others, in a half that
        # passes (120400, 200032); drawn apart as well
        fault = random.Random(-seed - 7).choice(SCHEDULED)
    if arch == "lstm" and step == "fp16_scaler":  # torch's CPU LSTM has no float16 kernel (oneDNN: no primitive)
        step = random.Random(-seed - 4).choice([s for s in shapes if s != "fp16_scaler"])
    if optimizer in CLOSURE:
        count = "one"  # a step(closure) optimizer trains alone: the two-optimizer loop steps each without a closure
    if count == "two" and set(features(step, fault)) & set(UNSUPPORTED_WITH_SEVERAL):
        # what the Recorder refuses for several optimizers is not drawn for them (drawn apart, as above)
        again = random.Random(-seed - 2)
        step = again.choice([s for s in shapes if not set(features(s, "none")) & set(UNSUPPORTED_WITH_SEVERAL)])
        fault = again.choice([f for f in faults if not set(features("plain", f)) & set(UNSUPPORTED_WITH_SEVERAL)])
    if count == "two" and arch != "lstm" and random.Random(-seed - 5).random() < 0.25:
        step = "fp16_scaler"  # one GradScaler for both optimizers (drawn apart as well)
    # drawn apart as well; a sparse SGD's momentum is a sparse state no checkpoint holds (the Recorder refuses it)
    checkpoints = random.Random(-seed - 3).choice(["start"] if arch == "embedding_sparse" and optimizer == "SGD"
                                                  else list(CHECKPOINTS))
    axes = {"arch": arch, "loss": loss, "optimizer": optimizer, "optimizers": count, "step": step, "batch": batch,
            "fault": fault, "checkpoints": checkpoints}
    size = rng.choice((4, 8, 10))  # never 3 nor 6: a micro-batch of 3 rows would look like the (3,) tensor
    if large:  # drawn apart, after the seed's own size, so the data seed below stays the seed's
        size = random.Random(-seed - 8).choice(LARGE_SIZES)
        axes["size"] = str(size)
    return Program(seed, axes, size, render(axes, size, rng.randrange(2 ** 31)))


# ---- source ---------------------------------------------------------------------------------------------------

HEADER = '''"""Generated by tests/oracle/programs.py: {axes}."""
import math

import torch
import torch.nn.functional as F
from torch import nn

B, STEPS, FAULT_STEP, CLASSES, DATA_SEED = {size}, {steps}, {fault_step}, {classes}, {data_seed}
VOCAB, SEQ = 11, 5
'''

# the input each arch takes, as the body of make_batch: ``x`` built from generator ``g``
INPUTS = {
    "float": "x = torch.exp(torch.randn(B, 8, generator=g) * 0.5)",
    "image": "x = torch.exp(torch.randn(B, 1, 4, 4, generator=g) * 0.5)",
    "sequence": "x = torch.exp(torch.randn(B, SEQ, 4, generator=g) * 0.5)",
    "tokens": "x = torch.randint(1, VOCAB, (B, SEQ), generator=g)",
}
ARCH_INPUT = {"conv_bn": "image", "conv_gn": "image", "lstm": "sequence", "gru": "sequence", "attention": "tokens",
              "embedding": "tokens", "embedding_sparse": "tokens"}

MODULES = '''
class LogFeatures(nn.Module):
    """log(softplus(gain) * x) of positive readings; ``masked``: zero readings mean absent, the masked branch."""

    def __init__(self, n, masked=False):
        super().__init__()
        self.gain = nn.Parameter(torch.zeros(n))
        self.masked = masked

    def forward(self, x):
        u = F.softplus(self.gain) * x
        return torch.where(u > 0, torch.log(u), torch.zeros_like(u)) if self.masked else torch.log(u)


class RowStandardise(nn.Module):
    """Each row to mean 0 and std 1, written without an eps: a constant row is 0/0."""

    def forward(self, x):
        flat = x.flatten(1)
        return ((flat - flat.mean(1, keepdim=True)) / flat.std(1, keepdim=True)).view_as(x)


class Square(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x * x

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        return 2 * x * g


class Attention(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)

    def forward(self, h, pad):
        q, k, v = self.qkv(h).chunk(3, dim=-1)
        scores = q @ k.transpose(-2, -1) / math.sqrt(h.shape[-1])
        causal = torch.ones(h.shape[1], h.shape[1], dtype=torch.bool).triu(1)
        scores = scores.masked_fill(causal | pad[:, None, :], float("-inf"))
        return self.proj(F.softmax(scores, dim=-1) @ v)
'''

# each arch: (constructor lines, forward lines) of class Net; ``self.pre`` is the fault's input transform
ARCH_BODY = {
    "mlp": ("self.body = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, OUT))",
            "return self.body(self.pre(x))"),
    "weight_norm": ("self.body = nn.Sequential(nn.utils.parametrizations.weight_norm(nn.Linear(8, 16)), nn.Tanh(), "
                    "nn.Linear(16, OUT))", "return self.body(self.pre(x))"),
    "spectral_norm": ("self.body = nn.Sequential(nn.utils.parametrizations.spectral_norm(nn.Linear(8, 16)), nn.Tanh(), "
                      "nn.Linear(16, OUT))", "return self.body(self.pre(x))"),
    "checkpoint": ("self.body = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, OUT))",
                   "return torch.utils.checkpoint.checkpoint(self.body, self.pre(x), use_reentrant=False)"),
    "custom_function": ("self.fc1, self.fc2 = nn.Linear(8, 16), nn.Linear(16, OUT)",
                        "return self.fc2(Square.apply(self.fc1(self.pre(x))))"),
    "func_per_sample": ("self.body = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, OUT))",
                        "return self.body(self.pre(x))"),
    "compiled": ("self.body = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, OUT))",
                 "return self.body(self.pre(x))"),
    "conv_bn": ("self.body = nn.Sequential(nn.Conv2d(1, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(), nn.Flatten(), "
                "nn.Linear(64, OUT))", "return self.body(self.pre(x))"),
    "conv_gn": ("self.body = nn.Sequential(nn.Conv2d(1, 4, 3, padding=1), nn.GroupNorm(2, 4), nn.ReLU(), nn.Flatten(), "
                "nn.Linear(64, OUT))", "return self.body(self.pre(x))"),
    "lstm": ("self.rnn, self.head = nn.LSTM(4, 8, batch_first=True), nn.Linear(8, OUT)",
             "return self.head(self.rnn(self.pre(x))[0][:, -1])"),
    "gru": ("self.rnn, self.head = nn.GRU(4, 8, batch_first=True), nn.Linear(8, OUT)",
            "return self.head(self.rnn(self.pre(x))[0][:, -1])"),
    "attention": ("self.emb, self.attn, self.head = nn.Embedding(VOCAB, 8), Attention(8), nn.Linear(8, OUT)",
                  "pad = x == 0\n        return self.head(self.attn(self.emb(x), pad)[:, -1])"),
    "embedding": ("self.emb, self.head = nn.Embedding(VOCAB, 8), nn.Linear(8, OUT)",
                  "return self.head(self.emb(x).mean(1))"),
    "embedding_sparse": ("self.emb = nn.Embedding(VOCAB, 8, sparse=True)\n"
                         "        self.register_buffer('head', torch.randn(8, OUT))",
                         "return self.emb(x).mean(1) @ self.head"),
}
N_IN = {"float": 8, "image": 16, "sequence": 4, "tokens": 0}


def render(axes: dict[str, str], size: int, data_seed: int) -> str:
    """The program's source text."""
    arch, loss, fault, step = axes["arch"], axes["loss"], axes["fault"], axes["step"]
    kind = ARCH_INPUT.get(arch, "float")
    out = {"mse": 1, "poisson": 1, "cross_entropy": CLASSES, "kl": CLASSES, "contrastive": 8}[loss]
    init, forward = ARCH_BODY[arch]
    pre = {"constant_row": "RowStandardise()", "log_zero": f"LogFeatures({N_IN[kind]})",
           "masked_inf_zero": f"LogFeatures({N_IN[kind]}, masked=True)"}.get(fault, "nn.Identity()")
    if kind in ("image", "sequence") and fault in ("log_zero", "masked_inf_zero"):
        pre = "nn.Identity()" if fault == "masked_inf_zero" else "nn.Sequential(nn.Flatten(1), LogFeatures(%d), " \
            "nn.Unflatten(1, %s))" % (N_IN[kind], "(1, 4, 4)" if kind == "image" else "(SEQ, 4)")
        if kind == "sequence" and fault == "log_zero":
            pre = "nn.Sequential(nn.Flatten(1), LogFeatures(SEQ * 4), nn.Unflatten(1, (SEQ, 4)))"
    ema = step == "after_update"
    src = [HEADER.format(axes=", ".join(f"{k}={v}" for k, v in axes.items()), size=size, steps=STEPS,
                         fault_step=FAULT_STEP, classes=CLASSES, data_seed=data_seed), f"OUT = {out}", MODULES]
    src.append(f"""
class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.pre = {pre}
        {init}

    def forward(self, x):
        {forward}


def build_model():
    torch.manual_seed(0)
    model = Net()
""")
    if arch == "compiled":
        src.append("    return torch.compile(model, backend='aot_eager')\n")
    else:
        src.append("    return model\n")
    src.append(_optimizer(axes))
    src.append(_scheduler(axes))
    src.append(_batch(axes, kind))
    src.append(_loss(axes))
    src.append(_step(axes, ema))
    return "\n".join(src)


def _optimizer(axes: dict[str, str]) -> str:
    name = axes["optimizer"]
    kwargs = {"SGD": "lr=0.05, momentum=0.9", "LBFGS": "lr=0.5, max_iter=2", "Rprop": "lr=0.01",
              "Adadelta": "lr=1.0", "Muon": "lr=0.02"}.get(name, "lr=0.01")
    if axes["fault"] == "eps_zero":
        kwargs += ", eps=0.0"
    if name == "Muon":  # Muon takes 2-d parameters only: the rest train with AdamW, the way its docs pair them
        return textwrap.dedent(f'''
            def make_optimizer(model):
                return torch.optim.Muon([p for p in model.parameters() if p.ndim == 2], {kwargs})
            ''')
    if axes["optimizers"] == "two":
        return textwrap.dedent(f'''
            def make_optimizer(model):
                params = list(model.parameters())
                half = len(params) // 2
                return (torch.optim.{name}(params[:half], {kwargs}), torch.optim.Adam(params[half:], lr=0.01))
            ''')
    return textwrap.dedent(f'''
        def make_optimizer(model):
            return torch.optim.{name}(model.parameters(), {kwargs})
        ''')


def _scheduler(axes: dict[str, str]) -> str:
    fault = axes["fault"]
    if fault == "lr_spike":
        rule = "lambda step: 1e12 if step == FAULT_STEP else 1.0"
    elif fault == "slow_overflow":
        rule = "lambda step: 100.0 ** step"
    elif axes["step"] == "scheduler":
        rule = "lambda step: 0.9 ** step"
    else:
        return "\nmake_scheduler = None\n"
    return textwrap.dedent(f'''
        def make_scheduler(optimizer):
            return torch.optim.lr_scheduler.LambdaLR(optimizer, _rule)


        def _rule(step):
            return ({rule})(step)
        ''')


def _batch(axes: dict[str, str], kind: str) -> str:
    fault, loss = axes["fault"], axes["loss"]
    spoil = {"inf_input": "x.view(B, -1)[1, 2] = math.inf", "nan_input": "x.view(B, -1)[1, 2] = math.nan",
             "huge_input": "x.view(B, -1)[1] *= 1e30", "constant_row": "x.view(B, -1)[1] = 2.0",
             "log_zero": "x.view(B, -1)[1, 2] = 0.0", "masked_inf_zero": "x.view(B, -1)[1, 2] = 0.0"}.get(fault)
    if fault == "masked_inf_zero" and kind == "tokens":
        spoil = "x[1] = 0"  # a sequence that is padding throughout: every row of its attention masked
    elif fault == "no_target":
        spoil = "y[:] = -100"  # every label ignored: a mean over no target, a NaN loss with zero gradients
    elif fault == "eps_zero":
        spoil = "x.view(B, -1)[:, 0] = 0.0" if kind != "tokens" else None  # a feature absent from every batch
    target = {"mse": "y = torch.randn(B, 1, generator=g)",
              "poisson": "y = torch.poisson(torch.full((B, 1), 2.0), generator=g)",
              "cross_entropy": "y = torch.randint(0, CLASSES, (B,), generator=g)\n    y[0] = -100",
              "kl": "y = torch.softmax(torch.randn(B, CLASSES, generator=g), dim=1)",
              "contrastive": "y = torch.randn(B, 8, generator=g) * 0.01"}[loss]
    lines = ["g = torch.Generator().manual_seed(DATA_SEED + step)", INPUTS[kind], *target.split("\n    ")]
    if spoil is not None:
        always = fault == "eps_zero"
        lines.append(spoil if always else f"if step == FAULT_STEP:\n        {spoil}")
    fields = {"x": "x", "y": "y"}
    if axes["batch"] == "ids":
        fields["ids"] = "[f's{step}-{i}' for i in range(B)]"
    elif axes["batch"] == "per_batch_tensor":
        fields["w"] = "torch.tensor([1.0, 2.0, 0.5])"  # class weights, one per batch
    body = "\n    ".join("\n    ".join(part.split("\n")) for part in lines)
    batch = "{" + ", ".join(f"{k!r}: {v}" for k, v in fields.items()) + "}"
    if axes["step"] == "accumulation":  # two micro-batches of the rows; a per-batch tensor goes whole into each
        batch = "{'micro_batches': [{k: v[m * B // 2:(m + 1) * B // 2] if len(v) == B else v for k, v in %s.items()} " \
                "for m in range(2)]}" % batch
    return f"\ndef make_batch(step):\n    {body}\n    return {batch}\n"


def _loss(axes: dict[str, str]) -> str:
    loss, weighted = axes["loss"], axes["batch"] == "per_batch_tensor"
    expr = {"mse": "F.mse_loss(out, batch['y'])",
            "poisson": "F.poisson_nll_loss(out, batch['y'], log_input=True)",
            "cross_entropy": "F.cross_entropy(out, batch['y'], ignore_index=-100, label_smoothing=0.1%s)"
                             % (", weight=batch['w']" if weighted else ""),
            "kl": "F.kl_div(F.log_softmax(out, dim=1), batch['y'], reduction='batchmean')",
            "contrastive": "_info_nce(model, out, batch)"}[loss]
    if weighted and loss != "cross_entropy":
        expr += " * batch['w'].mean()"
    extra = ""
    if loss == "contrastive":
        extra = textwrap.dedent('''
            def _info_nce(model, out, batch):
                """Two views of each sample, matched against every other sample of the batch."""
                z1 = F.normalize(out, dim=1)
                z2 = F.normalize(out + batch['y'], dim=1)
                return F.cross_entropy(z1 @ z2.T / 0.1, torch.arange(out.shape[0]))
            ''')
    return extra + f"\n\ndef loss_fn(model, out, batch):\n    return {expr}\n"


def _step(axes: dict[str, str], ema: bool) -> str:
    shape, arch, count = axes["step"], axes["arch"], axes["optimizers"]
    scheduled = "scheduler" in features(shape, axes["fault"])
    kw = []
    if shape == "fp16_scaler":
        kw.append("scaler")
    if scheduled:
        kw.append("scheduler")
    sig = "def train_step(model, optimizer, batch" + (", *, " + ", ".join(kw) if kw else "") + "):"
    tail = (["for s in scheduler:\n        s.step()"] if count == "two" else ["scheduler.step()"]) if scheduled else []
    if ema:
        tail.append("with torch.no_grad():\n        for p in model.parameters():\n            p.mul_(0.999)")
    if count == "two" and shape == "fp16_scaler":  # torch's pattern for several optimizers: one update after
        body = ["for opt in optimizer:\n        opt.zero_grad(set_to_none=True)",
                "with torch.autocast('cpu', dtype=torch.float16):\n        out = model(batch['x'])",
                "loss = loss_fn(model, out.float(), batch)", "scaler.scale(loss).backward()",
                "for opt in optimizer:\n        scaler.step(opt)", "scaler.update()"]
    elif count == "two":
        body = ["for opt in optimizer:\n        opt.zero_grad(set_to_none=True)",
                "loss = loss_fn(model, model(batch['x']), batch)", "loss.backward()",
                "for opt in optimizer:\n        opt.step()"]
    elif axes["optimizer"] in CLOSURE:
        body = ["def closure():\n        optimizer.zero_grad(set_to_none=True)\n"
                "        loss = loss_fn(model, model(batch['x']), batch)\n        loss.backward()\n        return loss",
                "loss = optimizer.step(closure)"]
        if shape == "clip":
            body = body[:1] + ["loss = closure()", "torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)",
                               "optimizer.step(lambda: loss)"]
    elif arch == "func_per_sample":
        body = ["optimizer.zero_grad(set_to_none=True)",
                "params = {k: v.detach() for k, v in model.named_parameters()}",
                "def one(p, x, y):\n        sample = {'x': x[None], 'y': y[None], **{k: v for k, v in batch.items() "
                "if k not in ('x', 'y')}}\n"
                "        return loss_fn(model, torch.func.functional_call(model, p, (x[None],)), sample)",
                "grads = torch.func.vmap(torch.func.grad(one), in_dims=(None, 0, 0))(params, batch['x'], batch['y'])",
                "for k, p in model.named_parameters():\n        p.grad = grads[k].mean(0)",
                "loss = loss_fn(model, model(batch['x']), batch).detach()"]
        body += _clip(shape) + ["optimizer.step()"]
    elif shape == "accumulation":
        body = ["optimizer.zero_grad(set_to_none=True)", "loss = 0.0",
                "for micro in batch['micro_batches']:\n"
                "        part = loss_fn(model, model(micro['x']), micro) / len(batch['micro_batches'])\n"
                "        part.backward()\n        loss = loss + part.detach()", "optimizer.step()"]
    elif shape == "bf16_autocast":
        body = ["optimizer.zero_grad(set_to_none=True)",
                "with torch.autocast('cpu', dtype=torch.bfloat16):\n        out = model(batch['x'])",
                "loss = loss_fn(model, out.float(), batch)", "loss.backward()", "optimizer.step()"]
    elif shape == "fp16_scaler":
        body = ["optimizer.zero_grad(set_to_none=True)",
                "with torch.autocast('cpu', dtype=torch.float16):\n        out = model(batch['x'])",
                "loss = loss_fn(model, out.float(), batch)", "scaler.scale(loss).backward()", "scaler.step(optimizer)",
                "scaler.update()"]
    else:
        body = ["optimizer.zero_grad(set_to_none=True)", "loss = loss_fn(model, model(batch['x']), batch)",
                "loss.backward()", *_clip(shape), "optimizer.step()"]
    lines = "\n    ".join([*body, *tail, "return loss"])
    return f"\n\n{sig}\n    {lines}\n"


def _clip(shape: str) -> list[str]:
    return ["torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)"] if shape == "clip" else []


# ---- on disk, and recorded ------------------------------------------------------------------------------------

def materialise(program: Program, folder: Path) -> ModuleType:
    """Write the program as ``folder/prog_SEED.py`` and import it from there (``folder`` put on sys.path)."""
    return load(program.name, program.source, folder)


def load(name: str, source: str, folder: Path) -> ModuleType:
    """Write ``source`` as ``folder/NAME.py`` and import it afresh from there (``folder`` put on sys.path): a module
    the Recorder names its step function and factories by, and replay imports again."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"{name}.py").write_text(source)
    if str(folder) not in sys.path:
        sys.path.insert(0, str(folder))
    sys.modules.pop(name, None)
    importlib.invalidate_caches()
    return importlib.import_module(name)


def extras(module: ModuleType, optimizer: Any) -> dict[str, Any]:
    """The keyword arguments the program's step takes: its GradScaler (one, for two optimizers too) and its scheduler
    (for two optimizers, a tuple of one over each), freshly built."""
    out: dict[str, Any] = {}
    if "scaler" in module.train_step.__code__.co_varnames[:module.train_step.__code__.co_argcount
                                                            + module.train_step.__code__.co_kwonlyargcount]:
        out["scaler"] = torch.amp.GradScaler("cpu", init_scale=2.0 ** 16)
    if module.make_scheduler is not None:
        out["scheduler"] = tuple(map(module.make_scheduler, optimizer)) if isinstance(optimizer, tuple) \
            else module.make_scheduler(optimizer)
    return out


def record(module: ModuleType, run_dir: Path, checkpoints: str = "start") -> list[float]:
    """Train the program (its module) for STEPS steps under the Recorder, checkpointed as ``CHECKPOINTS`` says; the
    losses it logged."""
    from nanforensics import Recorder

    model = module.build_model()
    optimizer = module.make_optimizer(model)
    kw = extras(module, optimizer)
    losses = []
    factory = module.make_scheduler
    with Recorder(run_dir, model, optimizer, model_factory=module.build_model, step_fn=module.train_step,
                  checkpoint_every=CHECKPOINTS[checkpoints], scaler=kw.get("scaler"), scheduler=kw.get("scheduler"),
                  scheduler_factory=(factory,) * len(optimizer) if factory and isinstance(optimizer, tuple)
                  else factory) as rec:
        for step in range(STEPS):
            batch = module.make_batch(step)
            loss = module.train_step(model, optimizer, batch, **kw)
            rec.log(step, batch, loss)
            losses.append(float(loss))
    return losses
