"""User code is reached only through the manifest's import strings, and never from inside the run directory
unless the user says so."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import shutil
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from nanforensics.errors import BadInput
from nanforensics.replay.engine import ReplayOptions, replay_run
from nanforensics.runs.imports import load_callable, platform, top_levels
from packaging.requirements import Requirement

import hostile
from conftest import ANNOUNCEMENT, TESTS, assert_one_line_error, run_cli, tree_digest

PAYLOAD = '''
from pathlib import Path
Path({marker!r}).write_text("ran")
from scenarios import train_step
'''


def _plant(run: Path, marker: Path, as_package: bool) -> str:
    """Code inside the run directory that leaves a marker file when it runs; returns its import string."""
    if as_package:
        (run / "shipped").mkdir()
        (run / "shipped" / "__init__.py").write_text(PAYLOAD.format(marker=str(marker)))
        (run / "shipped" / "steps.py").write_text("from scenarios import train_step\n")
        return "shipped.steps:train_step"
    (run / "shipped_steps.py").write_text(PAYLOAD.format(marker=str(marker)))
    return "shipped_steps:train_step"


@pytest.mark.parametrize("as_package", [False, True])
def test_code_inside_the_run_dir_is_refused_unless_trusted(copy_run, tmp_path, as_package):
    run = copy_run("adam_near_zero")
    marker = tmp_path / "payload-ran"
    manifest = json.loads((run / "manifest.json").read_text())
    manifest["step_fn"] = _plant(run, marker, as_package)
    (run / "manifest.json").write_text(json.dumps(manifest))
    before = tree_digest(run)
    # run from inside the run directory, where a plain import would find the shipped module first; the user's code is
    # then not in the working directory: --code-path names it
    result = run_cli("replay", ".", "--no-explain", "--code-path", TESTS, cwd=run)
    assert_one_line_error(result, "manifest.json", "inside the run directory", "--trust-run-dir")
    assert not marker.exists(), "the shipped code ran"
    trusted = run_cli("replay", ".", "--no-explain", "--trust-run-dir", "--code-path", TESTS, "--json", "-", cwd=run)
    assert trusted.code == 1, trusted.stderr
    assert marker.exists()
    assert manifest["step_fn"] in trusted.json()["setup"]["imported"]
    assert tree_digest(run) == before  # not even a __pycache__ beside the trusted code


def test_script_path_inside_the_run_dir_is_refused(copy_run, tmp_path):
    run = copy_run("adam_near_zero")
    marker = tmp_path / "payload-ran"
    (run / "train.py").write_text(PAYLOAD.format(marker=str(marker)))
    manifest = json.loads((run / "manifest.json").read_text())
    manifest["step_fn"] = f"{run / 'train.py'}:train_step"
    (run / "manifest.json").write_text(json.dumps(manifest))
    assert_one_line_error(run_cli("replay", run, "--no-explain"), "inside the run directory")
    assert not marker.exists()


# ---- the trust policy: what a manifest may call --------------------------------------------------------------

FIELDS = {"model_factory": ("model_factory",), "step_fn": ("step_fn",), "optimizer.class": ("optimizer", "class"),
          "optimizer.factory": ("optimizer", "factory"), "scheduler.factory": ("scheduler", "factory")}
TOUCH = "touch {marker}"
WRITE = "__import__('pathlib').Path({marker!r}).write_text('ran')"
# (field, import string, model_kwargs): each would leave the marker if the policy let it be called
PAYLOADS = [
    ("model_factory", "os:system", {"command": TOUCH}),
    ("model_factory", "subprocess:run", {"args": TOUCH, "shell": True}),
    ("model_factory", "builtins:exec", {}),
    ("model_factory", "hostile:system", {"command": TOUCH}),  # os.system re-exported by a user module
    ("model_factory", "torch.serialization:os.system", {"command": TOUCH}),  # and by torch
    ("model_factory", "sympy:sympify", {"a": WRITE}),  # a function of the platform that evaluates its argument
    ("model_factory", "hostile:Touch", {}),  # a class that is no nn.Module
    ("model_factory", "hostile:Builder.build", {"marker": "{marker}"}),  # a bound method, not a function
    ("step_fn", "hostile:Touch", {}),
    ("step_fn", "os:system", {}),
    ("optimizer.class", "hostile:Touch", {}),
    ("optimizer.class", "torch.optim.lr_scheduler:StepLR", {}),
    ("optimizer.factory", "hostile:Touch", {}),
    ("optimizer.factory", "hostile:run", {}),  # subprocess.run re-exported
    ("scheduler.factory", "hostile:Touch", {}),
    ("scheduler.factory", "torch.optim:Adam", {}),  # a torch.optim class, but not a scheduler
]


def _name(run: Path, field: str, spec: str, model_kwargs: dict[str, Any] | None = None) -> None:
    """Put ``spec`` in the manifest's ``field`` (and ``model_kwargs``), as a hostile run directory would."""
    manifest = json.loads((run / "manifest.json").read_text())
    *parents, last = FIELDS[field]
    node = manifest
    for key in parents:
        if not isinstance(node.get(key), dict):
            node[key] = {}
        node = node[key]
    node[last] = spec
    if model_kwargs is not None:
        manifest["model_kwargs"] = model_kwargs
    (run / "manifest.json").write_text(json.dumps(manifest))


@pytest.fixture
def marker(tmp_path, monkeypatch) -> Path:
    path = tmp_path / "payload-ran"
    monkeypatch.setenv(hostile.MARKER, str(path))
    return path


@pytest.mark.parametrize("field, spec, kwargs", PAYLOADS, ids=[f"{f}={s}" for f, s, _ in PAYLOADS])
def test_a_payload_in_any_field_is_refused_before_it_is_called(copy_run, marker, field, spec, kwargs):
    run = copy_run("adam_near_zero")
    _name(run, field, spec, {k: v.format(marker=str(marker)) if isinstance(v, str) else v for k, v in kwargs.items()})
    before = tree_digest(run)
    with pytest.raises(BadInput) as refused:
        replay_run(run, ReplayOptions(device="cpu", explain=False))
    message = str(refused.value)
    assert "manifest.json" in message and f"{field} {spec!r} is refused" in message and "--trust-code" in message
    assert "\n" not in message
    assert not marker.exists(), "the payload ran"
    assert tree_digest(run) == before


def test_every_command_refuses_and_shows_the_code_first_and_trust_code_opts_in(copy_run, tmp_path, marker):
    run = copy_run("adam_near_zero")
    _name(run, "model_factory", "os:system", {"command": f"touch {marker}"})
    beyond = tmp_path / "beyond"  # a factory that works but lies beyond the policy: a bound classmethod
    shutil.copytree(run, beyond)
    built = tmp_path / "built"
    _name(beyond, "model_factory", "hostile:Builder.build", {"marker": str(built)})
    before = tree_digest(run)
    out = tmp_path / "out"
    out.mkdir()
    calls = {
        "replay": ("replay", run, "--json", out / "replay.json"),
        "repair": ("repair", run, "--out", out / "repaired", "--json", out / "repair.json"),
        "postmortem": ("postmortem", run, "--json", out / "postmortem.json", "--markdown", out / "pm.md"),
        "refused": ("replay", beyond, "--no-explain"),
        "trusted": ("replay", beyond, "--no-explain", "--trust-code", "--json", "-"),
    }
    results = {name: run_cli(*args) for name, args in calls.items()}
    for command in ("replay", "repair"):
        r = results[command]
        assert r.stderr.startswith(ANNOUNCEMENT + "model_factory=os:system, step_fn=scenarios:train_step"), r.stderr
        assert_one_line_error(r, "manifest.json", "model_factory 'os:system' is refused", "standard library")
    pm = results["postmortem"]  # what the directory allows without the code: checkpoint-only, saying why
    assert pm.code == 1, pm.stderr
    replay = next(a for a in json.loads((out / "postmortem.json").read_text())["analyses"] if a["name"] == "replay")
    assert replay["status"] == "skipped" and "model_factory `os:system` is refused" in replay["detail"]
    assert not marker.exists(), "the payload ran"
    assert tree_digest(run) == before
    assert not (out / "replay.json").exists() and not (out / "repaired").exists() and not (out / "repair.json").exists()
    assert_one_line_error(results["refused"], "model_factory 'hostile:Builder.build' is refused", "bound method")
    trusted = results["trusted"]  # the same run, with --trust-code
    assert trusted.code == 1 and built.exists(), trusted.stderr
    assert "hostile:Builder.build" in trusted.json()["setup"]["imported"]


@pytest.mark.parametrize("role, spec, allowed", [
    ("model_factory", "scenarios:build_model", True),
    ("model_factory", "torch.nn:Linear", True),  # a Module class of torch
    ("model_factory", "torch.optim:Adam", False),
    ("model_factory", "torch:load", False),  # unpickles whatever model_kwargs names
    ("model_factory", "torch.hub:load", False),  # imports a repository's hubconf.py
    ("model_factory", "nanforensics.runs.files:write_json_atomic", False),  # the tool's own functions
    ("model_factory", "scenarios:torch.load", False),  # reached through the user's module
    ("model_factory", "__main__:main", False),
    ("step_fn", "scenarios:train_step", True),
    pytest.param("step_fn", "nanforensics.integrations.lightning:training_step", True,  # the integrations' defaults
                 marks=pytest.mark.skipif(importlib.util.find_spec("lightning") is None,
                                          reason="PyTorch Lightning is not installed (nanforensics[lightning])")),
    ("step_fn", "nanforensics.integrations._watch:clip", False),
    ("optimizer.class", "torch.optim.adam:Adam", True),
    ("optimizer.factory", "torch.optim:SGD", True),
    ("optimizer.factory", "scenarios:_adamw", True),
    ("scheduler.factory", "torch.optim.lr_scheduler:StepLR", True),
    ("scheduler.factory", "scenarios:cosine_lr", True),
])
def test_the_policy_by_role(role, spec, allowed, tmp_path):
    where = tmp_path / "manifest.json"
    if allowed:
        assert callable(load_callable(role, spec, where=where))
    else:
        with pytest.raises(BadInput, match=f"{role} .* is refused"):
            load_callable(role, spec, where=where)
        if not spec.startswith("__main__"):  # (pytest's __main__ has no main)
            assert load_callable(role, spec, where=where, trust_code=True) is not None  # the opt-in


def test_the_standard_library_is_not_even_imported(tmp_path):
    assert "this" not in sys.modules
    with pytest.raises(BadInput, match="standard library"):
        load_callable("model_factory", "this:s", where=tmp_path / "manifest.json")
    assert "this" not in sys.modules  # importing it would print; nothing ran


def test_a_script_among_the_installed_packages_is_refused(tmp_path):
    """Loaded under a name of its own, torch/serialization.py's load would pass for the user's function."""
    script = Path(torch.serialization.__file__)
    with pytest.raises(BadInput, match="part of the installed packages"):
        load_callable("model_factory", f"{script}:load", where=tmp_path / "manifest.json")


def test_the_platform_covers_what_nanforensics_runs_on():
    """The platform holds every package nanforensics and its extras pull in here, as their requirements' markers
    select them: their functions are no user's code. A newer release's new dependency is in it without a change
    to the list (transformers 5.25 brought ``kernels`` and ``tomlkit`` after the list was written)."""
    seen: set[str] = set()
    todo = [(Requirement(r), {"test", "lightning", "hf"}) for r in importlib.metadata.requires("nanforensics") or []]
    tops: set[str] = set()
    while todo:
        req, extras = todo.pop()
        if req.marker is not None and not any(req.marker.evaluate({"extra": e}) for e in extras or {""}):
            continue
        name = req.name.lower().replace("_", "-")
        if name in seen:
            continue
        seen.add(name)
        try:
            dist = importlib.metadata.distribution(req.name)
        except importlib.metadata.PackageNotFoundError:
            continue
        tops |= top_levels(dist)
        todo += [(Requirement(r), set(req.extras)) for r in dist.requires or []]
    missing = {t for t in tops if t.isidentifier() and not t.startswith("__")} - platform() - sys.stdlib_module_names
    assert not missing, sorted(missing)
