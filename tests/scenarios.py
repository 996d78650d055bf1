"""Known ways a run dies with NaN, as small real training runs: shipped samples, tests and benchmarks use them.

Every defect comes from the data through the real forward and backward, never from a hook
that writes inf. The model log-transforms positive features with a learnable per-feature gain,
``log(softplus(gain) * x)``: autograd's log backward divides by its input, so a near-zero
reading such as 3e-45 gives a finite loss (log(3e-45) = -103) and an infinite gradient in
exactly one coordinate of ``features.gain``.
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn.functional as F
from nanforensics import Recorder
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "sample_runs" / "code"))
_writes, sys.dont_write_bytecode = sys.dont_write_bytecode, True  # no __pycache__ written into sample_runs/
from regressor import N_FEATURES, Regressor  # noqa: E402, F401 - the shipped samples' model, one definition
from regressor import build_model as _build_model  # noqa: E402
from regressor import train_step as _train_step  # noqa: E402

sys.dont_write_bytecode = _writes

BATCH = 64
DEFECT_SAMPLE, DEFECT_FEATURE = 5, 3


def build_model(**kwargs: Any) -> nn.Module:
    """The shipped samples' ``build_model``, named ``scenarios:build_model`` in the runs the tests record."""
    return _build_model(**kwargs)


def train_step(model: nn.Module, optimizer: torch.optim.Optimizer, batch: dict[str, Any]) -> torch.Tensor:
    """The shipped samples' ``train_step``, named ``scenarios:train_step`` in the runs the tests record."""
    return _train_step(model, optimizer, batch)


DATA_WRITE_STEP = 3  # train_step_nan_through_data's step


def train_step_nan_through_data(model: nn.Module, optimizer: torch.optim.Optimizer, batch: dict[str, Any]) -> torch.Tensor:
    """The plain step, then at step DATA_WRITE_STEP (its batch's first id says which) NaN written into the last
    parameter through ``.data``: a write no version counter sees, which the update's proof assumes never happens."""
    loss = train_step(model, optimizer, batch)
    if batch["ids"][0] == f"s{DATA_WRITE_STEP:05d}-00":
        list(model.parameters())[-1].data.fill_(math.nan)
    return loss


def train_step_clipped(model: nn.Module, optimizer: torch.optim.Optimizer, batch: dict[str, Any]) -> torch.Tensor:
    optimizer.zero_grad(set_to_none=True)
    loss = F.mse_loss(model(batch["x"]), batch["y"])
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=1.0)
    optimizer.step()
    return loss


def train_step_poisson(model: nn.Module, optimizer: torch.optim.Optimizer, batch: dict[str, Any]) -> torch.Tensor:
    optimizer.zero_grad(set_to_none=True)
    rate = model(batch["x"])
    loss = (rate - batch["y"] * torch.log(rate)).mean()
    loss.backward()
    optimizer.step()
    return loss


def train_step_logcosh(model: nn.Module, optimizer: torch.optim.Optimizer, batch: dict[str, Any]) -> torch.Tensor:
    """The log-cosh loss written naively: cosh overflows past |error| = 89, in the loss, outside any module."""
    optimizer.zero_grad(set_to_none=True)
    loss = torch.log(torch.cosh(model(batch["x"]) - batch["y"])).mean()
    loss.backward()
    optimizer.step()
    return loss


def train_step_fp16(model: nn.Module, optimizer: torch.optim.Optimizer, batch: dict[str, Any]) -> torch.Tensor:
    """Forward under fp16 autocast without a GradScaler: activations past 65504 are inf."""
    optimizer.zero_grad(set_to_none=True)
    with torch.autocast(batch["x"].device.type, dtype=torch.float16):
        pred = model(batch["x"])
    loss = F.mse_loss(pred.float(), batch["y"])
    loss.backward()
    optimizer.step()
    return loss


def train_step_amp(model: nn.Module, optimizer: torch.optim.Optimizer, batch: dict[str, Any], *,
                   scaler: torch.amp.GradScaler, scheduler: Any) -> torch.Tensor:
    """The textbook mixed-precision step: fp16 autocast, scaled backward, scaler.step skips a step that overflowed."""
    optimizer.zero_grad(set_to_none=True)
    with torch.autocast(batch["x"].device.type, dtype=torch.float16):
        pred = model(batch["x"])
    loss = F.mse_loss(pred.float(), batch["y"])
    scaler.scale(loss).backward()
    scale = scaler.get_scale()
    scaler.step(optimizer)
    scaler.update()
    if scaler.get_scale() >= scale:  # a back-off means the scaler skipped the step: the schedule waits too
        scheduler.step()
    return loss


def train_step_bf16(model: nn.Module, optimizer: torch.optim.Optimizer, batch: dict[str, Any]) -> torch.Tensor:
    """``train_step`` under bf16 autocast: fp32's range, so no scaler; the near-zero reading still breaks log's
    backward."""
    with torch.autocast(batch["x"].device.type, dtype=torch.bfloat16):
        return train_step(model, optimizer, batch)


def train_step_half(model: nn.Module, optimizer: torch.optim.Optimizer, batch: dict[str, Any]) -> torch.Tensor:
    """A model held in float16 throughout (no fp32 master weights): Adam's moments live in float16 too."""
    optimizer.zero_grad(set_to_none=True)
    pred = model(batch["x"].to(next(model.parameters()).dtype))
    loss = F.mse_loss(pred.float(), batch["y"])
    loss.backward()
    optimizer.step()
    return loss


def make_batch(step: int, seed: int = 0, defect: str | None = None, batch_size: int = BATCH,
               n_features: int = N_FEATURES) -> dict[str, Any]:
    """A deterministic batch of positive readings; ``defect`` spoils one sample the way real data does."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + step)
    x = torch.exp(torch.randn(batch_size, n_features, generator=g) * 0.5)
    y = torch.exp(torch.log(x).mean(dim=1, keepdim=True) + 0.1 * torch.randn(batch_size, 1, generator=g))
    s, f = DEFECT_SAMPLE, DEFECT_FEATURE
    if defect == "near_zero":      # a reading squashed into fp32's denormal range
        x[s, f] = 3e-45
    elif defect == "spike":        # a glitch reading: the gradient is large and finite, its square is not
        x[s, f] = 1e13
    elif defect == "nan":          # a missing value stored as NaN
        x[s, f] = math.nan
    elif defect == "huge":         # one sample left in raw units, 10^4 times the others
        x[s] *= 1e4
    elif defect == "nano":         # one sample never converted from nano-units
        x[s] *= 1e10
    elif defect == "zero":         # an absent reading stored as 0
        x[s, f] = 0.0
    elif defect == "raw":          # one sample left in raw units, 10^5 times the others
        x[s] *= 1e5
    elif defect == "gain500":      # one sample read with the amplifier gain 500 times too high
        x[s] *= 500
    elif defect == "hundred":      # one sample in centi-units, 100 times the others
        x[s] *= 100
    elif defect is not None:
        raise ValueError(f"unknown defect {defect!r}")
    ids = [f"s{step:05d}-{i:02d}" for i in range(batch_size)]
    return {"x": x, "y": y, "ids": ids}


# ---- a decoder-only transformer, the model users train ------------------------------------------------------
#
# nanoGPT-shaped: token and position embeddings, pre-LayerNorm blocks of causal self-attention and an MLP, a tied
# head. The causal mask is written as users write it, ``masked_fill(mask, float("-inf"))``: it puts -inf into every
# step's attention scores, and softmax turns each into a 0 weight. Sequences are right-padded (PAD, with labels
# -100), and padded keys are masked the same way; a padded query still sees the real tokens before it. A sequence
# that is padding throughout leaves every row of its attention fully masked: softmax of a row of -inf is 0/0 =
# NaN, in the forward activations of that sample. Its loss terms are all ignored, so the loss stays finite, but the
# NaN reaches the gradients through softmax's backward, and AdamW writes it into every moment.

VOCAB, SEQ_LEN, TOKEN_BATCH, PAD = 64, 16, 8, 0


class CausalSelfAttention(nn.Module):
    """``bias_buffer``: the causal mask kept as an additive buffer of 0 and -inf (as older GPT code does), the padding
    still masked with masked_fill."""

    def __init__(self, d_model: int, n_head: int, seq_len: int = SEQ_LEN, bias_buffer: bool = False) -> None:
        super().__init__()
        self.n_head = n_head
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)
        if bias_buffer:
            causal = torch.ones(seq_len, seq_len, dtype=torch.bool).triu(1)
            self.register_buffer("causal_bias", torch.zeros(seq_len, seq_len).masked_fill(causal, float("-inf")))
        self.bias_buffer = bias_buffer

    def forward(self, x: torch.Tensor, pad: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = (z.view(b, t, self.n_head, c // self.n_head).transpose(1, 2) for z in self.qkv(x).split(c, dim=2))
        scores = (q @ k.transpose(-2, -1)) / math.sqrt(c // self.n_head)
        if self.bias_buffer:
            scores = (scores + self.causal_bias[:t, :t]).masked_fill(pad[:, None, None, :], float("-inf"))
        else:
            causal = torch.ones(t, t, dtype=torch.bool, device=x.device).triu(1)
            scores = scores.masked_fill(causal | pad[:, None, None, :], float("-inf"))
        y = F.softmax(scores, dim=-1) @ v
        return self.proj(y.transpose(1, 2).reshape(b, t, c))


class Block(nn.Module):
    def __init__(self, d_model: int, n_head: int, seq_len: int = SEQ_LEN, bias_buffer: bool = False) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(d_model), nn.LayerNorm(d_model)
        self.attn = CausalSelfAttention(d_model, n_head, seq_len, bias_buffer)
        self.mlp = nn.Sequential(nn.Linear(d_model, 4 * d_model), nn.GELU(), nn.Linear(4 * d_model, d_model))

    def forward(self, x: torch.Tensor, pad: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x), pad)
        return x + self.mlp(self.ln2(x))


class Decoder(nn.Module):
    def __init__(self, vocab: int = VOCAB, seq_len: int = SEQ_LEN, d_model: int = 32, n_head: int = 2,
                 n_layer: int = 2, bias_buffer: bool = False) -> None:
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, d_model), nn.Embedding(seq_len, d_model)
        self.blocks = nn.ModuleList(Block(d_model, n_head, seq_len, bias_buffer) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab, bias=False)
        self.head.weight = self.tok.weight
        for module in self.modules():  # GPT-2's initialisation: the default N(0, 1) embedding gives logits of ~20
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, std=0.02)
            if isinstance(module, nn.Linear) and module.bias is not None:
                nn.init.zeros_(module.bias)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        pad = tokens == PAD
        x = self.tok(tokens) + self.pos(torch.arange(tokens.shape[1], device=tokens.device))
        for block in self.blocks:
            x = block(x, pad)
        return self.head(self.ln_f(x))


def build_decoder(**kwargs: Any) -> nn.Module:
    torch.manual_seed(0)
    return Decoder(**kwargs)


def train_step_lm(model: nn.Module, optimizer: torch.optim.Optimizer, batch: dict[str, Any]) -> torch.Tensor:
    """Next-token cross-entropy; padded positions are labelled -100 and ignored."""
    optimizer.zero_grad(set_to_none=True)
    logits = model(batch["tokens"])
    loss = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), batch["labels"][:, 1:].reshape(-1),
                           ignore_index=-100)
    loss.backward()
    optimizer.step()
    return loss


def make_token_batch(step: int, seed: int = 0, defect: str | None = None, batch_size: int = TOKEN_BATCH,
                     seq_len: int = SEQ_LEN, vocab: int = VOCAB) -> dict[str, Any]:
    """Right-padded token sequences of random lengths; ``fully_padded`` empties sample DEFECT_SAMPLE."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + step)
    tokens = torch.randint(1, vocab, (batch_size, seq_len), generator=g)
    lengths = torch.randint(seq_len // 2, seq_len + 1, (batch_size,), generator=g)
    if defect == "fully_padded":   # an empty document that survived the tokenizer: padding throughout
        lengths[DEFECT_SAMPLE] = 0
    elif defect not in (None, "no_labels"):
        raise ValueError(f"unknown defect {defect!r}")
    tokens[torch.arange(seq_len)[None, :] >= lengths[:, None]] = PAD
    labels = tokens.masked_fill(tokens == PAD, -100)
    if defect == "no_labels":      # every target masked (prompt-only examples): the mean loss is 0/0 = NaN
        labels.fill_(-100)
    return {"tokens": tokens, "labels": labels, "ids": [f"doc{step:05d}-{i:02d}" for i in range(batch_size)]}


# ---- a CNN with BatchNorm ------------------------------------------------------------------------------------------
#
# BatchNorm's running statistics are registered buffers, updated in the training forward from each batch's own
# statistics. One pixel of 1e30 (a saturated sensor value stored raw) makes every channel's batch variance overflow
# float32: running_var becomes inf, while the normalised outputs (x/sqrt(inf) = 0), the loss, the gradients, the
# parameters and Adam's moments all stay finite. Training-mode losses never show it; eval mode would.

IMAGE, CLASSES, IMAGE_BATCH = 8, 3, 8


class SmallCNN(nn.Module):
    def __init__(self, channels: int = 4, classes: int = CLASSES) -> None:
        super().__init__()
        self.conv = nn.Conv2d(1, channels, 3, padding=1)
        self.norm = nn.BatchNorm2d(channels)
        self.head = nn.Linear(channels, classes)

    def forward(self, image: torch.Tensor) -> torch.Tensor:
        return self.head(F.relu(self.norm(self.conv(image))).mean(dim=(2, 3)))


def build_cnn(**kwargs: Any) -> nn.Module:
    torch.manual_seed(0)
    return SmallCNN(**kwargs)


def train_step_classify(model: nn.Module, optimizer: torch.optim.Optimizer, batch: dict[str, Any]) -> torch.Tensor:
    optimizer.zero_grad(set_to_none=True)
    loss = F.cross_entropy(model(batch["image"]), batch["label"])
    loss.backward()
    optimizer.step()
    return loss


def make_image_batch(step: int, seed: int = 0, defect: str | None = None,
                     batch_size: int = IMAGE_BATCH) -> dict[str, Any]:
    """Noise images and labels; ``huge_pixel`` sets one pixel of sample DEFECT_SAMPLE to 1e30."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + step)
    image = torch.randn(batch_size, 1, IMAGE, IMAGE, generator=g)
    label = torch.randint(0, CLASSES, (batch_size,), generator=g)
    if defect == "huge_pixel":
        image[DEFECT_SAMPLE, 0, IMAGE // 2, IMAGE // 2] = 1e30
    elif defect is not None:
        raise ValueError(f"unknown defect {defect!r}")
    return {"image": image, "label": label, "ids": [f"img{step:05d}-{i:02d}" for i in range(batch_size)]}


# ---- a Hugging Face GPT-2 (the ``hf`` extra), built from its config ---------------------------------------------
#
# Two ways a GPT-2 fine-tune meets NaN. A batch whose labels are all -100 (prompts only: every response truncated
# away) has no token to average over: the mean cross-entropy is 0/0 = NaN, made in the loss's reduction, while the
# gradients stay 0. And a distillation loss written by hand, softmax as exp/sum on logits divided by a temperature:
# a temperature annealed too far makes exp overflow to inf, and inf/inf = NaN downstream.

GPT2_VOCAB, GPT2_LEN, GPT2_BATCH = 64, 16, 4


def build_gpt2(**kwargs: Any) -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(vocab_size=GPT2_VOCAB, n_positions=GPT2_LEN, n_embd=32, n_layer=2, n_head=2, resid_pdrop=0.0,
                        embd_pdrop=0.0, attn_pdrop=0.0, **kwargs)
    return GPT2LMHeadModel(config)


def train_step_gpt2(model: nn.Module, optimizer: torch.optim.Optimizer, batch: dict[str, Any]) -> torch.Tensor:
    """The model computes its own loss from ``labels`` (-100: ignored), as a Trainer would have it."""
    optimizer.zero_grad(set_to_none=True)
    loss = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], labels=batch["labels"],
                 use_cache=False).loss
    loss.backward()
    optimizer.step()
    return loss


def train_step_gpt2_summed(model: nn.Module, optimizer: torch.optim.Optimizer, batch: dict[str, Any]) -> torch.Tensor:
    """As the Trainer calls it: the loss summed over tokens, divided by the number of labelled tokens it counted."""
    optimizer.zero_grad(set_to_none=True)
    loss = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], labels=batch["labels"],
                 use_cache=False, num_items_in_batch=(batch["labels"] != -100).sum()).loss
    loss.backward()
    optimizer.step()
    return loss


def train_step_gpt2_distill(model: nn.Module, optimizer: torch.optim.Optimizer, batch: dict[str, Any]) -> torch.Tensor:
    """Cross-entropy against the next token under a temperature, its softmax written by hand as exp/sum."""
    optimizer.zero_grad(set_to_none=True)
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], use_cache=False).logits
    e = torch.exp(logits[:, :-1] / batch["temperature"])
    p = e / e.sum(dim=-1, keepdim=True)
    target = batch["input_ids"][:, 1:]
    loss = -torch.log(p.gather(-1, target[..., None])).mean()
    loss.backward()
    optimizer.step()
    return loss


def make_gpt2_batch(step: int, seed: int = 0, defect: str | None = None) -> dict[str, Any]:
    """Right-padded sequences (attention mask 0, labels -100 on the padding). ``all_ignored``: every label -100;
    ``cold``: a temperature of 1e-3, where exp(logits / T) overflows."""
    if defect not in (None, "all_ignored", "cold"):
        raise ValueError(f"unknown defect {defect!r}")
    g = torch.Generator().manual_seed(seed * 1_000_003 + step)
    ids = torch.randint(1, GPT2_VOCAB, (GPT2_BATCH, GPT2_LEN), generator=g)
    lengths = torch.randint(GPT2_LEN // 2, GPT2_LEN + 1, (GPT2_BATCH,), generator=g)
    mask = (torch.arange(GPT2_LEN)[None, :] < lengths[:, None]).long()
    ids = ids * mask
    labels = ids.masked_fill(mask == 0, -100)
    if defect == "all_ignored":
        labels = torch.full_like(ids, -100)
    return {"input_ids": ids, "attention_mask": mask, "labels": labels,
            "temperature": torch.tensor(1e-3 if defect == "cold" else 1.0)}


def train_step_lm_scheduled(model: nn.Module, optimizer: torch.optim.Optimizer, batch: dict[str, Any], *,
                            scheduler: Any) -> torch.Tensor:
    """``train_step_lm``, then the LR scheduler's step, as a loop with a scheduler does."""
    loss = train_step_lm(model, optimizer, batch)
    scheduler.step()
    return loss


def train_step_batch_likelihood(model: nn.Module, optimizer: torch.optim.Optimizer, batch: dict[str, Any], *,
                                scheduler: Any) -> torch.Tensor:
    """A Gaussian regression whose loss is the batch's negative log-likelihood written naively, as -log of the batch's
    likelihood exp(-sum(err**2) / 2) (the product of the samples'), then the LR scheduler's step. The likelihood
    underflows to 0 once the squared errors of the samples together pass ~2*103: -log(0) = inf, and exp's backward
    gives inf*0 = NaN gradients. A loss coupled over the batch, where two samples of moderate error (err**2 / 2 = 75
    each: exp(-75) = 3e-33 alone, exp(-150) = 0 together) fail only together."""
    optimizer.zero_grad(set_to_none=True)
    err = model(batch["x"]) - batch["y"]
    loss = -torch.log(torch.exp(-0.5 * (err ** 2).sum()))
    loss.backward()
    optimizer.step()
    scheduler.step()
    return loss


def lr_doubling(optimizer: torch.optim.Optimizer) -> Any:
    """A learning rate that doubles every step (from 1e-7 it stays too small to move the model far in 20 steps)."""
    return torch.optim.lr_scheduler.ExponentialLR(optimizer, gamma=2.0)


def _adamw(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=1e-3)


def _adamw_lr_range(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=5e-3)


def lr_finder(optimizer: torch.optim.Optimizer) -> Any:
    """An LR range test sweeping two decades a step from 5e-3, up to 5e9 (past that a float32 Adam step overflows).

    AdamW moves every weight by about the learning rate, so the residual stream grows about 10^6-fold a step: its
    largest value is ~3e13 at step 4 (forward and backward finite: the backward first overflows near 1e18) and ~3e24
    at step 5, where each sample alone makes LayerNorm's variance overflow (from 1e20 on). Both margins are orders of
    magnitude, so the failing step, its stage and its batch-wide spread do not hang on the CPU's summation order or
    thread count, as a doubling learning rate's slow approach to the boundary did (3x lower or higher learning
    rates fail at the same step and stage)."""
    return torch.optim.lr_scheduler.LambdaLR(optimizer, _lr_range)


def _lr_range(step: int) -> float:
    return 100.0 ** min(step, 6)


@dataclass(frozen=True)
class Scenario:
    """A recorded run with a known answer."""

    model_kwargs: dict[str, Any]
    optimizer: Callable[[nn.Module], torch.optim.Optimizer]
    step_fn: Callable[..., Any]
    defect: str | None
    expected_stage: str | None  # stage of the origin replay must name; None for a clean run
    poisson: bool = False
    scaler: Callable[[], torch.amp.GradScaler] | None = None  # a mixed-precision loop's GradScaler
    scheduler: Callable[[torch.optim.Optimizer], Any] | None = None  # an LR scheduler's factory
    factory: Callable[..., nn.Module] = build_model  # model_factory(**model_kwargs)
    batches: Callable[..., dict[str, Any]] = make_batch  # batches(step, seed, defect or None)


def _adam(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.Adam(model.parameters(), lr=1e-2)


def _sgd(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=1e-2, momentum=0.9)


def _adam_fp16(model: nn.Module) -> torch.optim.Optimizer:
    """eps=1e-4: the default 1e-8 is 0 in float16."""
    return torch.optim.Adam(model.parameters(), lr=1e-2, eps=1e-4)


def scaler_2_24() -> torch.amp.GradScaler:
    """Starts high and grows every 5 clean steps, so a short run shows the control loop: back-off and growth."""
    return torch.amp.GradScaler("cpu", init_scale=2.0 ** 24, growth_interval=5)


def cosine_lr(optimizer: torch.optim.Optimizer) -> Any:
    return torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=60)


SCENARIOS: dict[str, Scenario] = {
    "adam_near_zero": Scenario({}, _adam, train_step, "near_zero", "grad"),
    "clean": Scenario({}, _adam, train_step, None, None),
    "sgd_near_zero": Scenario({}, _sgd, train_step, "near_zero", "grad"),
    "clipped_near_zero": Scenario({}, _adam, train_step_clipped, "near_zero", "grad"),
    "adam_state_overflow": Scenario({"log_features": False, "act": "relu"}, _adam, train_step, "spike",
                                    "optimizer_state"),
    "nan_in_data": Scenario({}, _adam, train_step, "nan", "batch"),
    "squared_relu_overflow": Scenario({"log_features": False, "act": "relu2"}, _adam, train_step, "nano", "forward"),
    "masked_log_zero": Scenario({"masked_log": True}, _adam, train_step, "zero", "grad"),
    "logcosh_overflow": Scenario({"log_features": False, "act": "relu"}, _adam, train_step_logcosh, "raw", "loss"),
    "fp16_activation_overflow": Scenario({"log_features": False, "act": "relu2"}, _adam, train_step_fp16, "hundred",
                                         "forward"),
    "batchnorm_near_zero": Scenario({"batchnorm": True}, _adam, train_step, "near_zero", "grad"),
    "poisson_log_zero": Scenario({"log_features": False, "poisson": True, "act": "relu"}, _adam, train_step_poisson,
                                 "huge", "loss"),
    # a GradScaler catches every overflow: the scale too high early on (backward), a nano-unit sample (forward)
    "fp16_scaler_catches": Scenario({"log_features": False, "act": "relu"}, _adam, train_step_amp, "nano", None,
                                    scaler=scaler_2_24, scheduler=cosine_lr),
    # fp16 without a scaler: the forward stays below 65504, the backward does not, and Adam takes the inf
    "fp16_backward_overflow": Scenario({"log_features": False, "act": "relu"}, _adam, train_step_fp16, "huge", "grad"),
    "bf16_near_zero": Scenario({}, _adam, train_step_bf16, "near_zero", "grad"),
    # a float16 model: a large but finite gradient (total norm ~2e4) whose square overflows Adam's exp_avg_sq
    "fp16_adam_state_overflow": Scenario({"log_features": False, "act": "relu", "dtype": "float16"}, _adam_fp16,
                                         train_step_half, "gain500", "optimizer_state"),
    # a transformer: the causal -inf mask fires every step; a fully padded sequence makes softmax's rows NaN
    "decoder_fully_padded": Scenario({}, _adamw, train_step_lm, "fully_padded", "forward", factory=build_decoder,
                                     batches=make_token_batch),
    # every label -100: a NaN loss, zero gradients, the model's state intact (no origin: verdict loss_only)
    "decoder_no_labels": Scenario({}, _adamw, train_step_lm, "no_labels", None, factory=build_decoder,
                                  batches=make_token_batch),
    # one 1e30 pixel: BatchNorm's running_var turns inf, everything else stays finite
    "batchnorm_huge_pixel": Scenario({}, _adam, train_step_classify, "huge_pixel", "buffer", factory=build_cnn,
                                     batches=make_image_batch),
    # the same decoder under an LR finder: no defect, the step (its learning rate) is what overflows
    "decoder_lr_finder": Scenario({}, _adamw_lr_range, train_step_lm_scheduled, None, "forward", scheduler=lr_finder,
                                  factory=build_decoder, batches=make_token_batch),
}


def record(run_dir: str | Path, name: str, *, steps: int = 30, defect_step: int = 17, checkpoint_every: int = 10,
           seed: int = 0, keep_checkpoints: int | None = None, stop_on_nan: bool = False,
           overwrite: bool = False, code: str | None = None, defects: dict[int, str] | None = None,
           step_fn: Callable[..., Any] | None = None) -> list[float]:
    """Train scenario ``name`` for ``steps`` steps under the recorder; returns the logged losses.

    ``defects`` maps steps to the defects their batches get, in place of the scenario's one at ``defect_step``;
    ``step_fn`` takes the place of the scenario's step function.

    ``stop_on_nan`` ends the loop a step after the first non-finite loss, as a job that
    aborts on NaN would. ``code`` names this file for replay (``tests/scenarios.py``, relative to the
    checkout's root) instead of its module name ``scenarios``.
    """
    sc = SCENARIOS[name]
    step_fn = step_fn or sc.step_fn
    named = (lambda fn: fn) if code is None else (lambda fn: f"{code}:{fn.__qualname__}")
    model = sc.factory(**sc.model_kwargs)
    optimizer = sc.optimizer(model)
    scaler = sc.scaler() if sc.scaler else None
    scheduler = sc.scheduler(optimizer) if sc.scheduler else None
    extras = {k: v for k, v in (("scaler", scaler), ("scheduler", scheduler)) if v is not None}
    losses: list[float] = []
    with Recorder(run_dir, model, optimizer, model_factory=named(sc.factory), model_kwargs=sc.model_kwargs,
                  step_fn=named(step_fn), checkpoint_every=checkpoint_every, keep_checkpoints=keep_checkpoints,
                  overwrite=overwrite, scaler=scaler, scheduler=scheduler,
                  scheduler_factory=named(sc.scheduler) if sc.scheduler else None) as rec:
        for step in range(steps):
            defect = defects.get(step) if defects is not None else sc.defect if step == defect_step else None
            batch = sc.batches(step, seed, defect)
            loss = step_fn(model, optimizer, batch, **extras)
            rec.log(step, batch, loss)
            losses.append(float(loss.detach()))
            if stop_on_nan and not all(math.isfinite(v) for v in losses[:-1]):
                break
    return losses


class LogSoftplus(nn.Module):
    """log(softplus(h)), unit by unit: a unit driven far below 0 underflows softplus to 0, and log(0) = -inf."""

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return torch.log(F.softplus(h))


class Units(nn.Module):
    """Readings through hidden units that each take ``LogSoftplus``. Every unit but ``unit`` weighs feature
    ``DEFECT_FEATURE`` positively: a glitch reading there (1e13) drives ``unit`` alone to -inf, in the forward pass.
    Under ColwiseParallel each rank of a tensor-parallel group computes its own block of units, so one rank makes it."""

    def __init__(self, n_features: int = N_FEATURES, hidden: int = 32, unit: int = 21) -> None:
        super().__init__()
        self.fc1, self.act = nn.Linear(n_features, hidden), LogSoftplus()
        self.fc2, self.head = nn.Linear(hidden, hidden), nn.Linear(hidden, 1)
        with torch.no_grad():
            self.fc1.weight[:, DEFECT_FEATURE].abs_().add_(0.1)  # steps of training leave them positive
            self.fc1.weight[unit, DEFECT_FEATURE] = -0.5

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.fc2(self.act(self.fc1(x)))))


def build_units(**kwargs: Any) -> nn.Module:
    torch.manual_seed(0)
    return Units(**kwargs)
