"""Param-group hyperparameters of a type the readers do not take (issue 32's fuzzer, seed 5207: a complex tensor as
Adam's ``amsgrad`` in a ``torch.save`` checkpoint reached ``bool(tensor)`` in the soundness check, and replay and
bisect ended in the CLI's catch-all). The class: a hyperparameter whose type no reader checked (a flag held as a
tensor, a rate as a string, betas that are not a pair of reals). One allow-list, ``inputs.HYPERPARAMETERS``, is
checked at the gate after unpickling and on meta.json's groups; here every key of it and a custom key meet values
of every kind, at the library level (microseconds each), and a handful of whole commands show both sides."""

from __future__ import annotations

import importlib.util
import inspect
import json
import math
import shutil
from pathlib import Path

import pytest
import torch
from nanforensics.errors import BadInput
from nanforensics.inputs import HYPERPARAMETERS, check_tensors, hyperparameter_problem, optimizer_problem
from nanforensics.integrations._watch import lrs as lrs_of
from nanforensics.rootcause.precursors import PrecursorProbe

from conftest import ROOT, assert_one_line_error, run_cli, tree_digest

WHERE = Path("ckpts/step_000010.pt")

VALUES = {  # every kind of value a pickle or meta.json can hold where a hyperparameter is, by name
    "True": True, "False": False, "0": 0, "0.5": 0.5, "nan": math.nan, "-inf": -math.inf, "10**400": 10**400,
    "None": None, "a string": "x", "a pair": (0.9, 0.999), "a list pair": [0.9, 0.999], "(None, 1e-3)": (None, 1e-3),
    "one real": [0.9], "three reals": (1.0, 2.0, 3.0), "names": ["fc.weight"], "a dict": {"a": 1}, "bytes": b"x",
    "a complex number": 1j, "nested": [[0.5]], "a real tensor": torch.tensor(0.01), "a [1] tensor": torch.tensor([0.01]),
    "an int tensor": torch.tensor(3), "a tensor pair": (torch.tensor(0.9), torch.tensor(0.999)),
    "a bool tensor": torch.tensor(True), "a complex tensor": torch.zeros(2, dtype=torch.complex64),
    "a complex scalar tensor": torch.tensor(1j), "a tensor of 2": torch.zeros(2), "a real matrix": torch.ones(2, 3),
    "a bool mask": torch.ones(4, dtype=torch.bool), "four reals": (0.9, 0.999, 0.9999, 0.5),
}
NUMBERS = {"0", "0.5", "nan", "-inf", "10**400"}  # NaN and infinities too: their values are scan's findings
TENSORS = {"a real tensor", "a [1] tensor", "an int tensor"}
PAIRS = {"a pair", "a list pair"}
# What each family of torch's keys takes, as examples: written apart from inputs.py's predicates
FAMILIES: dict[str, tuple[set[str], set[str]]] = {
    "flag": ({"amsgrad", "capturable", "centered", "decoupled_weight_decay", "differentiable", "maximize", "nesterov"},
             {"True", "False"}),
    "flag or None": ({"foreach", "fused"}, {"True", "False", "None"}),
    "number": ({"alpha", "beta2_decay", "d", "dampening", "initial_accumulator_value", "lambd", "lr_decay", "momentum",
                "momentum_decay", "rho", "t0", "tolerance_change", "tolerance_grad", "base_momentum", "max_momentum"},
               NUMBERS),
    # lr None: transformers' Adafactor with relative_step=True computes its own
    "lr": ({"lr"}, NUMBERS | TENSORS | {"None"}),
    "rate": ({"weight_decay", "initial_lr", "max_lr", "min_lr", "swa_lr"}, NUMBERS | TENSORS),
    "count": ({"max_iter", "max_eval", "history_size", "ns_steps"}, {"0", "10**400"}),
    "betas": ({"betas"}, PAIRS | {"a tensor pair", "three reals"}),  # three: bitsandbytes' AdEMAMix
    "eps": ({"eps"}, NUMBERS | PAIRS | {"(None, 1e-3)"}),
    "pair": ({"etas", "step_sizes"}, PAIRS),
    "triple": ({"ns_coefficients"}, {"three reals"}),
    "name or None": ({"line_search_fn", "adjust_lr_fn"}, {"None", "a string"}),
    "names": ({"param_names"}, {"names"}),
    # a custom optimizer's key reaches only its own step: any scalar, real or bool tensor (DeepSpeed OnebitAdam's
    # exp_avg_mask) or flat list of them
    "custom": ({"correct_bias", "decay_rate", "exp_avg_mask"}, set(VALUES) - {"a dict", "bytes", "a complex number", "nested",
                                                                             "a complex tensor", "a complex scalar tensor"}),
}
KEYS = {key: family for family, (keys, _) in FAMILIES.items() for key in keys}


def _sd(group: dict) -> dict:
    return {"state": {}, "param_groups": [{"params": [0], **group}]}


def test_the_families_name_every_key_of_the_allow_list():
    assert set(HYPERPARAMETERS) == set(KEYS) - set(FAMILIES["custom"][0])


@pytest.mark.parametrize("key", sorted(KEYS))
def test_every_kind_of_value_of_every_key_passes_or_is_one_line_naming_the_field(key):
    """The generator of the class: each key against each kind of value, through the gate every pickle reader
    passes (``check_tensors``, the state dict where the unrecorded sample keeps it) and meta.json's check."""
    accepted = FAMILIES[KEYS[key]][1]
    for name, value in VALUES.items():
        wrapped = {"model": {}, "optimizer": _sd({key: value}), "step": 10}
        if name in accepted:
            assert check_tensors(wrapped, WHERE) is None, (key, name)
            assert hyperparameter_problem([{key: value}], "param_groups") is None, (key, name)
            continue
        with pytest.raises(BadInput) as e:
            check_tensors(wrapped, WHERE)
        said = str(e.value)
        assert said.startswith(f"{WHERE}: optimizer.param_groups[0].{key} is "), (key, name, said)
        assert "\n" not in said and ", not " in said and len(said) < 200, said
        assert hyperparameter_problem([{key: value}], "param_groups") == said.removeprefix(f"{WHERE}: optimizer.")


@pytest.mark.parametrize("obj, path", [
    ({"optimizer_states": [_sd({"amsgrad": torch.zeros(2, dtype=torch.complex64)})]},
     "optimizer_states[0].param_groups[0].amsgrad is a complex tensor of 2 elements, not a bool"),
    (_sd({"amsgrad": torch.tensor(1.0)}), "param_groups[0].amsgrad is a real tensor, not a bool"),
    ({"\x1b[2J": _sd({"lr": "x"})}, "['\\x1b[2J'].param_groups[0].lr is a string, not a real number, a one-element "
                                    "real tensor or None"),
    ({"o": _sd({0: 1.0})}, "o.param_groups[0] holds a key 0, not a name"),
])
def test_the_field_path_names_where_the_state_dict_lies_in_the_file(obj, path):
    with pytest.raises(BadInput) as e:
        check_tensors(obj, WHERE)
    assert str(e.value) == f"{WHERE}: {path}"


def _torch_groups() -> list[dict]:
    """The param groups every optimizer class of torch.optim writes, some with the tensors torch takes (an lr, Adam's
    betas, SGD's weight_decay), and those its LR schedulers add."""
    def params() -> list[torch.nn.Parameter]:
        return [torch.nn.Parameter(torch.zeros(3, 2))]

    made = [cls(params()) for cls in vars(torch.optim).values() if inspect.isclass(cls)
            and issubclass(cls, torch.optim.Optimizer) and cls is not torch.optim.Optimizer and cls is not torch.optim.SGD]
    tensors = torch.optim.Adam(params(), lr=torch.tensor(0.01), betas=(torch.tensor(0.9), torch.tensor(0.999)))
    made += [torch.optim.SGD(params(), lr=torch.tensor(0.1), momentum=0.9, nesterov=True,
                             weight_decay=torch.tensor(0.01)),
             tensors, torch.optim.LBFGS(params(), line_search_fn="strong_wolfe"),
             torch.optim.AdamW(torch.nn.Linear(2, 3).named_parameters())]  # torch's param_names
    one_cycle, cyclic, swa = (torch.optim.SGD(params(), lr=0.1, momentum=0.9), torch.optim.Adam(params()),
                              torch.optim.SGD(params(), lr=0.1))
    torch.optim.lr_scheduler.OneCycleLR(one_cycle, max_lr=0.1, total_steps=10)
    torch.optim.lr_scheduler.CyclicLR(cyclic, base_lr=0.001, max_lr=0.01)
    torch.optim.swa_utils.SWALR(swa, swa_lr=0.05)
    torch.optim.lr_scheduler.StepLR(tensors, step_size=1)  # initial_lr: the tensor lr
    return [g for o in [*made, one_cycle, cyclic, swa] for g in o.state_dict()["param_groups"]]


def test_every_group_torch_writes_passes_and_every_key_allowed_is_torchs():
    """The holds side: what torch 2.13's optimizers and schedulers write passes, and the allow-list holds their keys
    and no other (a key torch adds later fails here until the list says its type)."""
    groups = _torch_groups()
    assert optimizer_problem({"state": {}, "param_groups": groups}, "optimizer") is None
    written = {k for g in groups for k in g} - {"params"}
    assert written == set(HYPERPARAMETERS), (written ^ set(HYPERPARAMETERS))


@pytest.fixture
def unrecorded(tmp_path: Path) -> Path:
    run = tmp_path / "unrecorded"
    shutil.copytree(ROOT / "sample_runs" / "unrecorded", run)
    return run


def _set_group(path: Path, **values) -> None:
    obj = torch.load(path, weights_only=True)
    obj["optimizer"]["param_groups"][0].update(values)
    torch.save(obj, path)


def test_the_fuzzers_mutant_is_one_line_naming_the_file_and_the_field(unrecorded, tmp_path):
    """seed 5207's crash, through the real entry point: replay and bisect (both reached ``bool(tensor)``) and scan."""
    _set_group(unrecorded / "ckpts/step_000010.pt", amsgrad=torch.zeros(2, dtype=torch.complex64))
    before = tree_digest(unrecorded)
    field = "optimizer.param_groups[0].amsgrad is a complex tensor of 2 elements, not a bool"
    for args in (("replay", "--checkpoint", "ckpts/step_000010.pt", "--code", "train.py", "--json", tmp_path / "r.json"),
                 ("bisect", "ckpts", "--code", "train.py", "--json", tmp_path / "b.json"),
                 ("scan", "ckpts/step_000010.pt")):
        assert_one_line_error(run_cli(*args, cwd=unrecorded), f"ckpts/step_000010.pt: {field}")
    assert tree_digest(unrecorded) == before and not list(tmp_path.glob("*.json"))


def test_a_string_rate_in_meta_json_names_that_file_not_the_step_function(tmp_path):
    """A recorded checkpoint's meta.json goes through the same list: its lr a string was blamed on the step function
    (``manifest.json: step function ... raised ValueError``) when the replay stepped with it."""
    ck = tmp_path / "ck"
    shutil.copytree(ROOT / "sample_runs/clean/checkpoints/step_00000010", ck)
    meta = json.loads((ck / "meta.json").read_text())
    meta["param_groups"][0]["lr"] = "0.01"
    (ck / "meta.json").write_text(json.dumps(meta))
    assert_one_line_error(run_cli("scan", ck), f"{ck / 'meta.json'}: param_groups[0].lr is a string, not a real number")


def test_tensor_rates_as_torch_takes_them_replay_to_the_planted_defect(unrecorded, tmp_path):
    """The holds side through the CLI: an lr and betas held as one-element tensors (capturable and fused Adam's)
    replay as the floats do, to the step of the sample's faulty reading."""
    spec = importlib.util.spec_from_file_location("unrecorded_train", unrecorded / "train.py")
    assert spec is not None and spec.loader is not None
    train = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(train)
    faulty_row = int((train.READINGS < 1e-30).nonzero()[0, 0])
    _set_group(unrecorded / "ckpts/step_000010.pt", lr=torch.tensor(0.01), betas=(torch.tensor(0.9), torch.tensor(0.999)))
    result = run_cli("replay", "--checkpoint", "ckpts/step_000010.pt", "--code", "train.py", "--json", tmp_path / "r.json",
                     cwd=unrecorded)
    assert result.code == 1, result.stderr
    report = json.loads((tmp_path / "r.json").read_text())
    assert report["responsible_step"] == faulty_row // train.ROWS_PER_STEP


class _RelativeStep(torch.optim.Optimizer):
    """An optimizer that computes its own step size where a group's lr is None, as transformers' Adafactor does
    with ``relative_step=True``."""

    def __init__(self, groups: list[dict]) -> None:
        super().__init__(groups, {"lr": None})

    @torch.no_grad()
    def step(self, closure=None):  # noqa: ANN001, ANN201 (torch's signature)
        for group in self.param_groups:
            for p in group["params"]:
                p.sub_(p.grad * (1e-3 if group["lr"] is None else group["lr"]))


@pytest.mark.parametrize("lrs, largest", [([None], None), ([None, 0.5], 0.5), ([torch.tensor([0.25]), None], 0.25)])
def test_an_lr_of_none_is_taken_by_every_reader_of_lr(lrs, largest):
    """The readers of a live optimizer's lr, the replay's precursor probe and the integrations' recorded rates, take
    None (they ended in ``float(None)``'s TypeError) and read the others as their numbers."""
    model = torch.nn.Sequential(*(torch.nn.Linear(2, 2) for _ in lrs))
    optimizer = _RelativeStep([{"params": layer.parameters(), "lr": lr} for layer, lr in zip(model, lrs)])
    model(torch.ones(1, 2)).sum().backward()
    with PrecursorProbe(model, optimizer) as probe:
        optimizer.step()
        assert probe.take(0).learning_rate == largest
    assert lrs_of(optimizer) == [None if lr is None else float(lr) for lr in lrs]


def test_real_optimizers_groups_pass_scan_through_both_readers(unrecorded, tmp_path):
    """The holds side through the CLI: AdEMAMix's three betas, Adafactor's lr None and a OnebitAdam-like mask in a
    custom key, in a pickle and in meta.json, scan as sound checkpoints do (exit 0)."""
    _set_group(unrecorded / "ckpts/step_000010.pt", lr=None, betas=(0.9, 0.999, 0.9999), exp_avg_mask=torch.ones(2, 3))
    assert run_cli("scan", "ckpts/step_000010.pt", cwd=unrecorded).code == 0
    ck = tmp_path / "ck"
    shutil.copytree(ROOT / "sample_runs/clean/checkpoints/step_00000010", ck)
    meta = json.loads((ck / "meta.json").read_text())
    meta["param_groups"][0].update(lr=None, betas=[0.9, 0.999, 0.9999], exp_avg_mask=[1.0, 0.0, 1.0])
    (ck / "meta.json").write_text(json.dumps(meta))
    result = run_cli("scan", ck)
    assert result.code == 0, result.stderr
