"""Every value torch and users put in a param group, recorded and read back as it was (the class: a param-group value
the recorder writes that its reader does not give back as it was: refused, as a ``[1]`` lr written ``[0.01]`` and a
user's mask written as a nested list were, or changed, as a float32 tensor lr read back as the float it holds was, and
Adam, AdamW, Adamax, NAdam, Adafactor and ASGD then replayed off by the last bits). meta.json writes a tensor inline
as its bytes, dtype and shape (``checkpoint.state_to_json``), and the recorder passes its groups through the reader's
gate (``inputs.hyperparameter_problem``) before writing: a value either comes back equal in type, dtype, shape and
bits, or the training loop is told in one line. Here each optimizer class of torch.optim trains under the real
Recorder with every form of tensor lr and replays from its checkpoint bit for bit, and every kind of value meets
every family of key."""

from __future__ import annotations

import base64
import inspect
import math
import struct
import warnings
from pathlib import Path
from typing import Any

import numpy
import pytest
import torch
from nanforensics import Recorder
from nanforensics.errors import BadInput
from nanforensics.inputs import HYPERPARAMETERS, hyperparameter_problem
from nanforensics.runs.checkpoint import (
    Checkpoint,
    checkpoint_name,
    checkpoint_state,
    save_checkpoint,
    state_from_json,
    state_to_json,
)

# every form torch takes for an lr: the reader must give back that very value
LR_FORMS: dict[str, Any] = {"float": 0.01, "0-d tensor": torch.tensor(0.01), "[1] tensor": torch.tensor([0.003])}
OPTIMIZERS = sorted((c for c in vars(torch.optim).values() if inspect.isclass(c) and issubclass(c, torch.optim.Optimizer)
                     and c not in (torch.optim.Optimizer, torch.optim.SparseAdam)),  # SparseAdam: sparse grads only
                    key=lambda c: c.__name__)
STEPS, EVERY = 4, 2  # a checkpoint before step 2: steps 2 and 3 are replayed from it


def build(groups: int = 1) -> torch.nn.Module:
    """One bias-free layer per param group (Muon takes 2-d parameters only), wide enough that a float32 lr and the
    float it holds step Adam's parameters apart within two steps."""
    torch.manual_seed(0)
    return torch.nn.Sequential(*(torch.nn.Linear(16, 16, bias=False) for _ in range(groups)))


def step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, batch: dict[str, Any]) -> torch.Tensor:
    """Through a closure: LBFGS needs one, the others take it."""
    def closure() -> torch.Tensor:
        optimizer.zero_grad()
        loss = model(batch["x"]).pow(2).mean()
        loss.backward()
        return loss
    return optimizer.step(closure)


def _batch(s: int) -> dict[str, torch.Tensor]:
    return {"x": torch.randn(8, 16, generator=torch.Generator().manual_seed(s))}


def _weights(model: torch.nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def _bits(value: Any) -> Any:
    """What must survive the round trip: a value's type, a tensor's dtype, shape and bytes (NaN's sign too), a float's
    bits (-0.0). Two things JSON's tags do not keep: a tuple (betas come back a list of the same items, which every
    optimizer indexes alike) and a float NaN's sign (``{"$float": "nan"}``, as the step log writes a NaN loss)."""
    if isinstance(value, torch.Tensor):
        raw = value.detach().contiguous().reshape(-1).view(torch.uint8)
        return "tensor", value.dtype, tuple(value.shape), bytes(raw.tolist())
    if isinstance(value, float):
        return "float", b"nan" if math.isnan(value) else struct.pack("<d", value)
    if isinstance(value, (list, tuple)):
        return "list", [_bits(v) for v in value]
    return type(value), value


def _record_and_replay(run: Path, cls: type[torch.optim.Optimizer], lrs: list[Any], steps: int = STEPS,
                       every: int = EVERY) -> tuple[dict[str, Any], list[str]]:
    """meta.json of the checkpoint before step ``every`` of a run of ``steps`` steps of ``cls`` with a param group per
    lr in ``lrs``, as the reader gives it, and what differs when the steps after it are replayed from it as replay
    rebuilds the optimizer (its class over the checkpoint's groups, ``runs.run._optimizer``, then ``load_into``)."""
    model = build(len(lrs))
    optimizer = cls([{"params": layer.parameters(), "lr": lr} for layer, lr in zip(model, lrs)])
    losses, weights = [], []
    with Recorder(run, model, optimizer, model_factory=build, model_kwargs={"groups": len(lrs)}, step_fn=step,
                  checkpoint_every=every) as rec:
        for s in range(steps):
            loss = step(model, optimizer, _batch(s))
            rec.log(s, _batch(s), loss)
            losses.append(loss.detach().clone())
            weights.append(_weights(model))
    checkpoint = Checkpoint(run / "checkpoints" / checkpoint_name(every), every)
    meta = checkpoint.meta()
    again = build(len(lrs))
    named = dict(again.named_parameters())
    replayed = cls([{**g, "params": [named[n] for n in g["params"]]} for g in meta["param_groups"]])
    checkpoint.load_into(again, replayed)
    differs = []
    for s in range(every, steps):
        loss = step(again, replayed, _batch(s))
        differs += [f"loss {s}"] * (_bits(loss) != _bits(losses[s]))
        differs += [f"weights {s}"] * (_bits(_weights(again)) != _bits(weights[s]))
    return meta, differs


@pytest.mark.parametrize("cls", OPTIMIZERS, ids=lambda c: c.__name__)
def test_every_lr_form_torch_takes_is_read_back_as_it_was_and_replays_bit_for_bit(tmp_path, cls):
    forms = list(LR_FORMS.values())
    runs = [forms] if cls is not torch.optim.LBFGS else [forms[2:]]  # LBFGS: one param group
    for i, lrs in enumerate(runs):
        meta, differs = _record_and_replay(tmp_path / str(i), cls, lrs)
        assert [_bits(g["lr"]) for g in meta["param_groups"]] == [_bits(lr) for lr in lrs]
        assert differs == [], (lrs, differs)


# ---- the generator: every kind of value in every family of key -------------------------------------------------------

CUSTOM = "mask"  # a key no torch optimizer has: a user's own, passed on to their optimizer's step
FAMILY_KEYS = sorted({id(kind): key for key, kind in sorted(HYPERPARAMETERS.items())}.values()) + [CUSTOM]
NAN = -torch.tensor(math.nan)  # NaN with its sign bit set, as 0/0 gives on x86: its bits must survive too
# the dtypes a user or an optimizer computes with: a tensor of one of them the gate takes is written and read back; the
# others (sub-byte, float8 variants) may be refused by the writer instead, in one line
COMMON_DTYPES = (torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.int16,
                 torch.int8, torch.uint8, torch.bool)
ALL_DTYPES = sorted({d for d in vars(torch).values() if isinstance(d, torch.dtype) and not str(d).startswith("torch.q")},
                    key=str)  # quantized ones: no tensor of them is made this way


def _of(dtype: torch.dtype, shape: list[int]) -> torch.Tensor:
    """A tensor of ``dtype`` and ``shape`` with bits worth keeping (-0.0, NaN's sign, a fraction) where it has them."""
    values = torch.tensor([0.01, -0.0, 3.0, math.inf])
    if dtype.is_floating_point or dtype.is_complex:
        values[3] = NAN
    flat = values.repeat(2)[: math.prod(shape)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # complex32's: "experimental"
        try:
            return flat.to(dtype).reshape(shape)
        except RuntimeError:  # a sub-byte dtype torch makes but does not convert to
            return torch.zeros(shape, dtype=dtype)


VALUES: dict[str, Any] = {
    "int": 3, "big int": 10**400, "float": 0.5, "-0.0": -0.0, "nan": -math.nan, "-inf": -math.inf, "True": True,
    "False": False, "None": None, "a name": "strong_wolfe", "a pair": (0.9, 0.999), "a list pair": [0.9, 0.999],
    "three reals": (0.9, 0.999, 0.9999), "a tensor pair": (torch.tensor([0.9]), torch.tensor(0.999)),
    "a list of tensors": [torch.ones(3), torch.zeros(2, dtype=torch.bool)], "names": ["fc.weight"], "nested": [[0.5]],
    "a dict": {"a": 1}, "bytes": b"x", "complex": 1j, "a transposed matrix": torch.arange(6.0).reshape(2, 3).t(),
    "an empty tensor": torch.zeros(0, 3), "a tensor that requires grad": torch.tensor(0.01, requires_grad=True),
    "a sparse tensor": torch.eye(3).to_sparse(), "a conjugate view": torch.tensor([1 + 2j]).conj(),
    "numpy float64": numpy.float64(0.01), "numpy float32": numpy.float32(0.01), "numpy int64": numpy.int64(3),
    **{f"{str(d).removeprefix('torch.')} {shape}": _of(d, shape) for d in ALL_DTYPES for shape in ([], [1], [3], [2, 2])},
}

HOLDS = {  # the holds side, as examples: values torch and users put there that must come back
    "lr": {"float", "float32 []", "float32 [1]", "float64 []", "None"}, "betas": {"a pair", "a tensor pair", "three reals"},
    CUSTOM: {"float32 [3]", "bool [2, 2]", "int64 [1]", "a list of tensors", "a transposed matrix", "an empty tensor"},
}


def _optimizer(values: list[Any], key: str) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """SGD (it reads none of these keys) with a param group per value, its ``key`` set to it as a user or a
    scheduler sets one after the optimizer is built."""
    model = torch.nn.ParameterList([torch.nn.Parameter(torch.ones(2)) for _ in values])
    optimizer = torch.optim.SGD([{"params": [p]} for p in model], lr=0.1)
    for group, value in zip(optimizer.param_groups, values):
        group[key] = value
    return model, optimizer


@pytest.mark.parametrize("key", FAMILY_KEYS)
def test_every_value_is_read_back_as_it_was_or_refused_in_one_line_before_writing(tmp_path, key):
    """Each kind of value under a key of each family of the allow-list and under a user's own key: the recorder's
    state (``checkpoint_state``, which the Recorder takes in the training loop) refuses it in one line naming the
    field, or the checkpoint written gives it back through ``Checkpoint.meta`` (the reader and its gate) equal in
    type, dtype, shape and bits. Refused only what the gate refuses, or a tensor of a dtype no one trains with."""
    kept = {}
    for name, value in VALUES.items():
        model, optimizer = _optimizer([value], key)
        try:
            checkpoint_state(0, model, optimizer)
        except ValueError as e:
            said = str(e)
            assert "\n" not in said and len(said) < 300 and key in said, (name, said)
            live = hyperparameter_problem([{key: value}], "param_groups")
            assert live is not None or value.dtype not in COMMON_DTYPES, (name, said)
            continue
        kept[name] = value
    model, optimizer = _optimizer(list(kept.values()), key)
    meta = Checkpoint(save_checkpoint(tmp_path, 0, model, optimizer), 0).meta()
    for (name, value), group in zip(kept.items(), meta["param_groups"], strict=True):
        assert _bits(group[key]) == _bits(value), name
    assert HOLDS.get(key, set()) <= set(kept), HOLDS[key] - set(kept)
    assert {"nested", "a dict", "bytes", "complex", "a sparse tensor", "a conjugate view", "numpy float32"}.isdisjoint(kept)


def test_a_value_replay_would_refuse_is_refused_in_the_training_loop_before_its_checkpoint(tmp_path):
    """Through the Recorder: a user's key holding a nested list stops the loop at the checkpoint that would hold it,
    in one line naming the field; the checkpoints before it stay as they were, and a user's mask of several elements
    is recorded and read back as it was."""
    model = build()
    optimizer = torch.optim.Adam(model.parameters(), lr=torch.tensor(0.01))
    mask = torch.tensor([1.0, 0.0, 1.0])
    optimizer.param_groups[0]["mask"] = mask
    with pytest.raises(ValueError) as e:
        with Recorder(tmp_path / "run", model, optimizer, model_factory=build, step_fn=step, checkpoint_every=1) as rec:
            for s in range(2):
                rec.log(s, _batch(s), step(model, optimizer, _batch(s)))
                optimizer.param_groups[0]["mask"] = [[1.0, 0.0]]
    assert str(e.value).startswith("optimizer param_groups[0].mask is a list of 1, not ") and "\n" not in str(e.value)
    assert sorted(p.name for p in (tmp_path / "run/checkpoints").iterdir()) == [checkpoint_name(0), checkpoint_name(1)]
    first = Checkpoint(tmp_path / "run/checkpoints" / checkpoint_name(0), 0).meta()
    assert _bits(first["param_groups"][0]["mask"]) == _bits(mask)


def test_a_tensor_the_groups_share_is_read_back_shared_and_replays_bit_for_bit(tmp_path):
    """An lr tensor given as the optimizer's default is one object every group holds; a scheduler with a lambda per
    group ``fill_``s it group by group, so in the run every group steps with the last group's rate. Read back as a
    tensor per group, the replay stepped each group with its own rate and its weights went apart from the run's."""
    def built() -> tuple[torch.nn.Module, torch.optim.Optimizer, Any]:
        model = build(2)
        optimizer = torch.optim.Adam([{"params": layer.parameters()} for layer in model], lr=torch.tensor(0.01))
        return model, optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, [lambda e: 1.0, lambda e: 0.5 ** e])

    def steps(model: torch.nn.Module, optimizer: torch.optim.Optimizer, scheduler: Any, few: range) -> None:
        for s in few:
            step(model, optimizer, _batch(s))
            scheduler.step()

    model, optimizer, scheduler = built()
    steps(model, optimizer, scheduler, range(2))
    checkpoint = Checkpoint(save_checkpoint(tmp_path, 2, model, optimizer, scheduler=scheduler), 2)
    written = _bits(optimizer.param_groups[0]["lr"])
    steps(model, optimizer, scheduler, range(2, 5))
    lrs = [g["lr"] for g in checkpoint.meta()["param_groups"]]
    assert lrs[0] is lrs[1] and _bits(lrs[0]) == written and '{"$same": ' in (checkpoint.path / "meta.json").read_text()
    again, replayed, rescheduled = built()
    checkpoint.load_into(again, replayed, scheduler=rescheduled)
    assert replayed.param_groups[0]["lr"] is replayed.param_groups[1]["lr"]
    steps(again, replayed, rescheduled, range(2, 5))
    assert _bits(_weights(again)) == _bits(_weights(model))


def test_a_shared_tensor_is_still_shared_where_another_stages_groups_come_before():
    """A pipeline's rank 0 writes every stage's groups one after another, each stage's as that stage wrote them
    (``distributed.pipeline``): a reference back counts inline tensors before it, so it holds in the joined list."""
    stages = [torch.tensor(0.1), torch.tensor(0.2)]
    written = [state_to_json([{"lr": lr}, {"lr": lr}], None, "param_groups") for lr in stages]
    read = state_from_json(written[0] + written[1], None, Path("meta.json"))
    assert [g["lr"].item() for g in read] == [lr.item() for lr in stages for _ in range(2)]
    assert read[0]["lr"] is read[1]["lr"] and read[2]["lr"] is read[3]["lr"] and read[1]["lr"] is not read[2]["lr"]


FLOAT32_ONE = base64.b64encode(struct.pack("<f", 1.0)).decode()
DAMAGED = {  # an inline tensor as no writer writes it, each way its three fields can disagree, and a reference to none
    "a dtype no tensor is written in": {"$bytes": "AA==", "dtype": "uint4", "shape": []},
    "a dtype that is no name": {"$bytes": "AA==", "dtype": 5, "shape": []},
    "a shape that is no list": {"$bytes": FLOAT32_ONE, "dtype": "float32", "shape": 1},
    "a negative size": {"$bytes": FLOAT32_ONE, "dtype": "float32", "shape": [-1]},
    "a bool size": {"$bytes": FLOAT32_ONE, "dtype": "float32", "shape": [True]},
    "a size beyond int64": {"$bytes": "", "dtype": "float32", "shape": [2**64, 0]},
    "bytes that are not base64": {"$bytes": "@@@@", "dtype": "uint8", "shape": [3]},
    "bytes that are a number": {"$bytes": 5, "dtype": "uint8", "shape": []},
    "too few bytes": {"$bytes": FLOAT32_ONE, "dtype": "float32", "shape": [2]},
    "too many bytes": {"$bytes": FLOAT32_ONE, "dtype": "float16", "shape": []},
    "a bool that is 2": {"$bytes": "Ag==", "dtype": "bool", "shape": []},
    "the same as no tensor before": {"$same": 1}, "the same as itself": {"$same": 0},
    "the same as a bool": {"$same": True},
}


@pytest.mark.parametrize("name", DAMAGED)
def test_an_inline_tensor_whose_fields_disagree_is_a_one_line_error_naming_the_file(tmp_path, name):
    """The reader's side of the inline tag (a run directory is untrusted): ``state_from_json``, which every reader of
    meta.json's groups and state scalars calls, names the file; the CLI prints that line and exits 2."""
    where = tmp_path / "meta.json"
    with pytest.raises(BadInput) as e:
        state_from_json({"lr": DAMAGED[name]}, None, where)
    assert str(e.value).startswith(f"{where}: holds ") and "\n" not in str(e.value) and len(str(e.value)) < 300
    assert _bits(state_from_json({"lr": {**DAMAGED["too few bytes"], "shape": [1]}}, None, where)["lr"]) == \
        _bits(torch.tensor([1.0]))  # the holds side: the same bytes as a shape they fill
