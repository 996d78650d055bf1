"""The fuzzer of real artifacts (tests/fuzz, issue 32) in the suite: a fixed budget of mutants over every layout and
command, each call in a forked child under time and address-space limits, and every kept regression case.

A broken invariant fails the test with its class and the mutation that made it, except the classes another change
closes (``KNOWN_PENDING``), expected to fail until that change is merged."""

from __future__ import annotations

import copy
from collections.abc import Hashable
from pathlib import Path
from typing import Any

import pytest

from fuzz import campaign, oracle, seeds
from fuzz.campaign import KNOWN_PENDING, Crash
from fuzz.mutate import Mutation

BUDGET = 28  # mutants: every layout twice, every command of it on each; see README, Security
SEED = 20261204


@pytest.fixture(scope="module")
def seed_trees(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return seeds.build(tmp_path_factory.getbasetemp() / "fuzz-seeds")


def test_the_invariants_hold_on_a_fixed_budget_of_mutants(seed_trees, tmp_path):
    figures = campaign.fuzz(seed_trees, tmp_path, mutants=BUDGET, seed=SEED)
    assert set(figures.mutants) == {(lay.name, c) for lay in seeds.LAYOUTS for c in lay.commands}, figures.lines()
    unexpected = [c for c in figures.crashes if c.pending is None]
    assert not unexpected, "\n".join([f"{c.layout} {c.command}: {c.violation} <- {c.mutation.describe()}"
                                      for c in unexpected] + figures.lines())


def _case_id(case: Crash) -> str:
    return f"{case.layout}-{case.command}-{case.mutation.mutator}-{case.violation[:40]}"


CASES = campaign.load_corpus()


@pytest.mark.parametrize("case", [
    pytest.param(c, id=_case_id(c), marks=[pytest.mark.xfail(
        strict=True, reason=f"KNOWN_PENDING: {c.pending}, closed by helper {KNOWN_PENDING[c.pending][0]}")]
        if c.pending else []) for c in CASES])
def test_kept_regression_case(case, seed_trees, tmp_path):
    """A crash the fuzzer found, minimised: every invariant holds on it now."""
    assert campaign.reproduce(case, seed_trees, tmp_path) == []


def test_the_oracle_sees_each_broken_invariant(seed_trees, tmp_path):
    """The oracle is not blind: a payload imported by a mutant, a changed input, a stray file, an exit by a signal
    and a hang are each reported (checked on the harness' own doings, not the tool's)."""
    ws = oracle.Workspace(tmp_path / "w")
    ws.make(seed_trees["report"])
    before = oracle.digest(ws.tree)
    args = ["report", str(ws.tree / "r.json")]
    clean = oracle.run_fork(args, ws, time_limit=60)
    assert oracle.violations("report", clean, ws, before, [], "r.json") == [], clean.stderr
    ws.sentinel.write_text("ran")
    (ws.tree / "r.json").write_text("{}")
    (ws.cwd / "stray").touch()
    found = oracle.violations("report", clean, ws, before, [], "r.json")
    assert found == ["payload ran", "input changed", "created outside the named outputs: cwd/stray"], found
    ws.sentinel.unlink()
    (ws.cwd / "stray").unlink()
    before = oracle.digest(ws.tree)
    killed = oracle.Outcome(None, "", "", signal=11)
    assert oracle.violations("scan", killed, ws, before, [], "r.json")[0] == "signal: SIGSEGV"
    assert oracle.violations("scan", oracle.Outcome(None, "", "", timed_out=True), ws, before, [],
                             "r.json")[0].startswith("hang")
    two_lines = oracle.Outcome(2, "", "nanforensics: error: r.json: bad\nmore\n")
    assert "error in 2 lines" in oracle.violations("report", two_lines, ws, before, [], "r.json")


def test_a_mutation_is_reproduced_from_its_record(seed_trees, tmp_path):
    """The same record gives the same bytes: a kept case is the crash it was."""
    trees = []
    for name in ("a", "b"):
        ws = oracle.Workspace(tmp_path / name)
        ws.make(seed_trees["run"])
        Mutation("json", "manifest.json", {"op": "value", "path": ["checkpoint_every"], "value": 8}).apply(ws.tree)
        trees.append({k: v for k, v in oracle.digest(ws.tree).items() if not k.endswith(".py")})  # but the payload
    assert trees[0] == trees[1] and '"checkpoint_every":1' + "0" * 400 in (tmp_path / "a/in/manifest.json").read_text()


@pytest.mark.parametrize("references", [1000, 40_000])
def test_a_container_shared_by_many_references_counts_once_per_reference(references, tmp_path):
    """The class of the fuzzer's first find: a pickle's memo makes one param group referenced n times in 2n bytes, and
    every reader walks it n times (10^6 references: minutes). The one gate after unpickling counts each reference:
    a few thousand pass, past MAX_JSON_OBJECTS walked objects it is one line naming the file."""
    from nanforensics.errors import BadInput
    from nanforensics.inputs import MAX_JSON_OBJECTS, check_tensors

    group = {"params": list(range(7)), "param_names": [f"p{i}" for i in range(7)], "lr": 0.01, "betas": (0.9, 0.999)}
    obj = {"optimizer": {"state": {}, "param_groups": [group] * references}}
    expanded = 3 + references * (1 + len(group) + 7 + 7 + 2)
    if expanded <= MAX_JSON_OBJECTS:
        check_tensors(obj, tmp_path / "ok.pt")
    else:
        with pytest.raises(BadInput, match=r"ckpt\.pt: holds more than 1,000,000 objects"):
            check_tensors(obj, tmp_path / "ckpt.pt")


def _optimizer_state() -> tuple[Any, Any, dict]:
    """The scenarios' model and Adam after one step: its state dict as torch writes it (tensors per parameter)."""
    import torch

    import scenarios

    model = scenarios.build_model()
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    scenarios.train_step(model, optimizer, scenarios.make_batch(0))
    return model, optimizer, copy.deepcopy(optimizer.state_dict())


PLACES = {  # where in an optimizer state dict a value is put, as the fuzzer's object mutator puts it
    "a parameter's state": lambda sd, v: sd["state"].__setitem__(0, v),
    "a state value": lambda sd, v: sd["state"][0].__setitem__("exp_avg", v),
    "a state key": lambda sd, v: sd["state"][0].__setitem__(v if isinstance(v, Hashable) else str(v), 0.0),
    "a group's params item": lambda sd, v: sd["param_groups"][0]["params"].__setitem__(0, v),
    "a group": lambda sd, v: sd["param_groups"].__setitem__(0, v),
}


@pytest.mark.parametrize("place", sorted(PLACES))
@pytest.mark.parametrize("value", [float("nan"), 10**400, "x", None, b"\xff", [1.0], {"a": 1}, (0.5, 2.0), True])
def test_an_optimizer_state_of_any_shape_loads_or_is_one_line(place, value, tmp_path):
    """The class of the fuzzer's second and third finds (a parameter's state a float in replay --checkpoint:
    AttributeError; a params item a list in bisect: TypeError, unhashable): whatever a pickled optimizer state dict
    holds where, the gate after unpickling (``check_tensors``, every reader's) and loading it into an optimizer each
    work or are BadInput naming the file."""
    from nanforensics.errors import BadInput
    from nanforensics.formats.training_state import load_optimizer
    from nanforensics.inputs import check_tensors

    model, optimizer, sd = _optimizer_state()
    PLACES[place](sd, value)
    path = tmp_path / "ckpt.pt"
    for step in (lambda: check_tensors({"model": {}, "optimizer": sd}, path),
                 lambda: load_optimizer(model, optimizer, sd, path, "make_optimizer")):
        try:
            step()
        except BadInput as e:
            assert str(e).startswith(str(path)), e
