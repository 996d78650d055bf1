"""A parameter's optimizer state of a type no step takes (``exp_avg`` a list, None or a float; ``step`` a bool tensor)
ended in the replayed step's AttributeError or RuntimeError, blamed on the user's script (``train.py: step function
... raised``). The class: a state value whose type no reader checked. One allow-list, ``inputs.STATE``, is checked in
``optimizer_problem``, the gate every reader of an optimizer state dict passes; here every key of it meets values of
every kind in memory, torch's own optimizers show the holds side, and the real CLI the refusal."""

from __future__ import annotations

import inspect
import math
import shutil
from pathlib import Path

import pytest
import torch
from nanforensics.inputs import STATE, field_path, optimizer_problem

from conftest import ROOT, assert_one_line_error, run_cli, tree_digest

VALUES = {  # every kind of value a pickle can hold where a parameter's state is, by name
    "True": True, "0": 0, "-5": -5, "0.5": 0.5, "nan": math.nan, "10**400": 10**400, "None": None, "a string": "x",
    "a list of numbers": [0.0, 1.0], "a list of tensors": [torch.zeros(3)], "a list of tensors and None": [None, torch.ones(2)],
    "a real tensor": torch.tensor(0.5), "a [1] tensor": torch.tensor([0.5]), "an int tensor": torch.tensor(3),
    "a real matrix": torch.ones(2, 3), "a bool tensor": torch.tensor(True), "a bool mask": torch.ones(3, dtype=torch.bool),
    "a complex tensor": torch.zeros(2, dtype=torch.complex64),
    "a list of complex tensors": [torch.zeros(2, dtype=torch.complex64)],
}
NUMBERS = {"0", "-5", "0.5", "nan", "10**400"}  # their values are scan's findings (a step of -5 is not a count)
ONE_ELEMENT = {"a real tensor", "a [1] tensor", "an int tensor"}
TENSORS = ONE_ELEMENT | {"a real matrix"}
# What each family of torch's keys takes, as examples: written apart from inputs.py's predicates
FAMILIES: dict[str, tuple[set[str], set[str]]] = {
    "tensor": ({"exp_avg", "exp_avg_sq", "max_exp_avg_sq", "exp_inf", "square_avg", "acc_delta", "grad_avg", "sum",
                "mu_product", "eta", "mu", "ax", "prev", "step_size", "row_var", "col_var", "variance", "d", "H_diag",
                "prev_flat_grad"}, TENSORS),
    "tensor or None": ({"momentum_buffer"}, TENSORS | {"None"}),  # SGD's without momentum
    "count": ({"step", "t", "prev_loss"}, NUMBERS | ONE_ELEMENT),
    "int": ({"func_evals", "n_iter"}, {"0", "-5", "10**400"}),
    "history": ({"old_dirs", "old_stps", "ro"}, {"a list of tensors"}),
    "al": ({"al"}, {"a list of tensors", "a list of tensors and None"}),
}
KEYS = {key: family for family, (keys, _) in FAMILIES.items() for key in keys}


FORTY = "k" * 40
KEY_STEPS = {  # a key from the file -> its step in a field path: a name as itself, anything else as an excerpt
    "lr": ".lr", FORTY: f".{FORTY}", FORTY + "k": "['" + "k" * 36 + "...]", "two words": "['two words']", 3: "[3]",
    True: "[True]", b"\xff": "[b'\\xff']", 10**5000: "[<an integer of 16610 bits>]",
}


@pytest.mark.parametrize("key", list(KEY_STEPS), ids=lambda k: type(k).__name__ + str(len(repr(k)) if isinstance(k, str) else ""))
def test_a_field_path_names_each_key_once_and_shortly(key):
    """Every kind of key a pickle can hold, under a root key that starts with the characters the path's leading dot
    is stripped of: an id of 5,000 digits is described, not written (``str`` refuses it, and the error was lost)."""
    assert field_path((((None, "Xoptimizer"), "state"), key)) == f"Xoptimizer.state{KEY_STEPS[key]}"
    said = optimizer_problem({"state": {key: {"exp_avg": None}}, "param_groups": [{"params": [0]}]}, "optimizer")
    assert said == f"optimizer.state{KEY_STEPS[key]}.exp_avg is None, not a real tensor"


WHAT = [  # a value's kind in the refusal's words, never its content
    (True, "a bool"), (3, "an int"), (0.5, "a float"), ("x", "a string"), (b"x", "a bytes"), ({"a": 1}, "a dict"),
    (None, "None"), ((1.0, 2.0), "a tuple of 2"), ([0.0], "a list of 1"), (torch.tensor(0.5), "a real tensor"),
    (torch.ones(3, dtype=torch.bool), "a bool tensor of 3 elements"),
    (torch.zeros(2, dtype=torch.complex64), "a complex tensor of 2 elements"),
    (torch.empty(2, device="meta"), "a real tensor on meta of 2 elements"),
]


@pytest.mark.parametrize(("value", "words"), WHAT, ids=[w for _, w in WHAT])
def test_the_refusal_says_each_kind_of_value_in_its_own_words(value, words):
    said = optimizer_problem({"state": {0: {"old_dirs": value}}, "param_groups": [{"params": [0]}]}, "")
    assert said is not None and said.startswith(f"state[0].old_dirs is {words}, not "), said  # LBFGS's: a list of tensors


def test_the_families_name_every_key_of_the_allow_list():
    assert set(STATE) == set(KEYS)


@pytest.mark.parametrize("key", sorted(KEYS))
def test_every_kind_of_value_of_every_state_key_passes_or_is_one_line_naming_the_field(key):
    """The generator of the class: each key against each kind of value, at the gate of every optimizer state dict."""
    accepted = FAMILIES[KEYS[key]][1]
    for name, value in VALUES.items():
        said = optimizer_problem({"state": {0: {key: value}}, "param_groups": [{"params": [0]}]}, "optimizer")
        if name in accepted:
            assert said is None, (key, name, said)
        else:
            assert said is not None and said.startswith(f"optimizer.state[0].{key} is ") and ", not " in said, (key, name)
            assert "\n" not in said and len(said) < 120, said


def _stepped() -> list[torch.optim.Optimizer]:
    """Every optimizer class of torch.optim after three steps, in the configurations that keep each kind of state
    (momentum, amsgrad, centered, LBFGS's line search, Adafactor's factored and unfactored moments)."""
    made = []
    options = {torch.optim.SGD: {"momentum": 0.9}, torch.optim.RMSprop: {"momentum": 0.9, "centered": True},
               torch.optim.Adam: {"amsgrad": True}, torch.optim.LBFGS: {"line_search_fn": "strong_wolfe"}}
    for cls in (c for c in vars(torch.optim).values() if inspect.isclass(c) and issubclass(c, torch.optim.Optimizer)
                and c is not torch.optim.Optimizer):
        torch.manual_seed(0)
        model = torch.nn.Linear(3, 3, bias=cls is not torch.optim.Muon)  # Muon: 2-d parameters only
        optimizer = cls(model.parameters(), **options.get(cls, {}))
        for _ in range(3):
            def closure() -> torch.Tensor:
                optimizer.zero_grad()
                loss = model(torch.randn(2, 3)).pow(2).mean()
                loss.backward()
                if cls is torch.optim.SparseAdam:
                    for p in model.parameters():
                        p.grad = p.grad.to_sparse()
                return loss
            optimizer.step(closure)
        made.append(optimizer)
    return made


def test_every_state_torch_keeps_passes_and_every_key_allowed_is_torchs():
    """The holds side: torch 2.13's optimizers' state passes, and the allow-list holds their keys and no other."""
    states = [o.state_dict() for o in _stepped()]
    assert all(optimizer_problem(sd, "optimizer") is None for sd in states)
    kept = {k for sd in states for entry in sd["state"].values() for k in entry}
    assert kept == set(STATE), kept ^ set(STATE)


@pytest.fixture
def unrecorded(tmp_path: Path) -> Path:
    run = tmp_path / "unrecorded"
    shutil.copytree(ROOT / "sample_runs" / "unrecorded", run)
    return run


@pytest.mark.parametrize("key, value, said", [
    ("exp_avg", None, "optimizer.state[0].exp_avg is None, not a real tensor"),
    ("step", torch.tensor(True), "optimizer.state[0].step is a bool tensor, not a real number or a one-element real tensor"),
])
def test_a_state_value_of_the_wrong_type_names_the_checkpoint_not_the_step_function(unrecorded, tmp_path, key, value, said):
    """Through the real entry point: replay named ``train.py: step function ... raised``; now the file and the field."""
    path = unrecorded / "ckpts/step_000010.pt"
    obj = torch.load(path, weights_only=True)
    for entry in obj["optimizer"]["state"].values():
        entry[key] = value
    torch.save(obj, path)
    before = tree_digest(unrecorded)
    for args in (("replay", "--checkpoint", "ckpts/step_000010.pt", "--code", "train.py", "--json", tmp_path / "r.json"),
                 ("scan", "ckpts/step_000010.pt")):
        assert_one_line_error(run_cli(*args, cwd=unrecorded), f"ckpts/step_000010.pt: {said}")
    assert tree_digest(unrecorded) == before and not (tmp_path / "r.json").exists()


@pytest.mark.parametrize("step", [-5, torch.tensor(-5.0)], ids=["int", "tensor"])
def test_a_negative_step_is_scans_finding_and_replays_refusal_naming_the_file(unrecorded, tmp_path, step):
    """Its type passes the gate (a step's value is ``scan``'s: unsound, exit 5); replay would hand Adam a bias
    correction whose square root is complex, which its step raised on (blamed on ``train.py``): refused in one line."""
    path = unrecorded / "ckpts/step_000010.pt"
    obj = torch.load(path, weights_only=True)
    for entry in obj["optimizer"]["state"].values():
        entry["step"] = step
    torch.save(obj, path)
    scan = run_cli("scan", "ckpts/step_000010.pt", "--quiet", cwd=unrecorded)
    assert scan.code == 5 and "error" not in scan.stderr, scan.stderr
    replay = run_cli("replay", "--checkpoint", "ckpts/step_000010.pt", "--code", "train.py", "--json", tmp_path / "r.json",
                     cwd=unrecorded)
    assert_one_line_error(replay, "ckpts/step_000010.pt: optimizer state holds step = -5 for parameter 0, a negative count "
                                  "of updates: torch cannot step with it")
    assert not (tmp_path / "r.json").exists()
