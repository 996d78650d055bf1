"""A replay on another kind of CPU than the run's: the manifest names the CPU, the replay compares it with its own,
and where they differ (or the run does not say) the state is judged within a tolerance and the report says why."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from nanforensics.replay.reproduction import STATE_RTOL, _compare
from nanforensics.report import CpuIdentity
from nanforensics.runs.cpu import describe, this_cpu
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from conftest import ROOT, assert_one_line_error, run_cli

HERE = this_cpu()
OTHER = CpuIdentity(model="Imaginary CPU 9000", capability="AVX2" if HERE.capability == "AVX512" else "AVX512",
                    machine=HERE.machine)
BIT_EXACT = "reproduced (parameters, optimizer state and buffers bit-exact at step 20; losses identical)"


def replay(run: Path) -> dict:
    result = run_cli("replay", run, "--json", "-", "--no-explain", "--from-step", "15", "--max-steps", "10",
                     cwd=ROOT)  # steps 10-19, past the checkpoint of step 20
    assert result.code in (0, 1), result.stderr
    return result.json()


def set_cpu(run: Path, cpu: dict | str | None) -> None:
    """The copy's manifest with its cpu field replaced (None: removed, as in a run recorded before it existed)."""
    path = run / "manifest.json"
    manifest = json.loads(path.read_text())
    manifest.pop("cpu", None)
    if cpu is not None:
        manifest["cpu"] = cpu
    path.write_text(json.dumps(manifest))


def nudge(run: Path, step: int, factor_or_ulps: float | int) -> None:
    """fc1.weight[2, 3] of the checkpoint of ``step`` moved by some float32 ulps (int; another CPU's rounding) or
    scaled (float; a real divergence)."""
    path = run / "checkpoints" / f"step_{step:08d}" / "model.safetensors"
    with safe_open(str(path), framework="pt") as f:
        metadata = f.metadata()
    tensors = load_file(path)
    value = np.float32(tensors["fc1.weight"][2, 3].item())
    if isinstance(factor_or_ulps, int):
        for _ in range(factor_or_ulps):
            value = np.nextafter(value, np.float32(np.inf))
    else:
        value = value * np.float32(factor_or_ulps)
    tensors["fc1.weight"][2, 3] = float(value)
    save_file(tensors, path, metadata=metadata)


def cpu_findings(r: dict) -> list[str]:
    return [f for f in r["findings"] if f.startswith("Recorded on ")]


def test_the_recorder_names_the_cpu_and_a_same_cpu_replay_stays_bit_exact(runs):
    assert json.loads((runs["clean"] / "manifest.json").read_text())["cpu"] == {
        "model": HERE.model, "capability": torch.backends.cpu.get_cpu_capability(), "machine": HERE.machine}
    r = replay(runs["clean"])
    assert r["setup"]["recorded_cpu"] == r["setup"]["replay_cpu"] == vars(HERE)
    assert [(c["step"], c["exact"], c["tolerance"], c["rounded"]) for c in r["checkpoints_compared"]] == [
        (20, True, 0.0, 0)]
    assert (r["reproduced"], r["reproduction"], cpu_findings(r)) == (True, BIT_EXACT, [])


def test_another_cpu_is_judged_within_a_tolerance_and_named(copy_run):
    run = copy_run("clean")
    set_cpu(run, vars(OTHER))
    assert "Imaginary CPU 9000" in describe(OTHER) and f"capability {OTHER.capability}" in describe(OTHER)
    nudge(run, 20, 3)  # the last bits another CPU's kernels round differently: within the tolerance
    r = replay(run)
    assert (r["setup"]["recorded_cpu"], r["setup"]["replay_cpu"]) == (vars(OTHER), vars(HERE))
    c = r["checkpoints_compared"][-1]
    assert (r["reproduced"], c["step"], c["exact"], c["first_mismatch"], c["rounded"], c["max_ulps"]) == (
        True, 20, False, None, 1, 3)
    assert r["reproduction"] == (f"reproduced within tolerance (parameters, optimizer state and buffers at step 20 "
                                 f"within rtol {STATE_RTOL:g}: 1 of its {c['values']:,} values differ, by up to 3 "
                                 "ulps, the others bit-exact; losses identical)")
    cause = (f"Recorded on {describe(OTHER)}, replayed on {describe(HERE)}: kernels sum in another order, so the state "
             f"is compared within a tolerance (rtol {STATE_RTOL:g}) rather than bit for bit;")
    assert cpu_findings(r) == [f"{cause} differences up to 3 ulps."]

    nudge(run, 20, 1.5)  # beyond it: a divergence, whatever the CPU
    r = replay(run)
    assert (r["reproduced"], r["diverged_at_step"]) == (False, 20)
    assert r["reproduction"].startswith("not reproduced: the state diverged by step 20: fc1.weight[2, 3]")
    assert len(cpu_findings(r)) == 1


def test_a_run_that_does_not_name_its_cpu_is_compared_within_the_tolerance(copy_run):
    run = copy_run("clean")
    set_cpu(run, None)
    r = replay(run)
    assert (r["setup"]["recorded_cpu"], r["setup"]["replay_cpu"]) == (None, vars(HERE))
    assert [(c["exact"], c["tolerance"]) for c in r["checkpoints_compared"]] == [(True, STATE_RTOL)]
    assert (r["reproduced"], r["reproduction"]) == (True, BIT_EXACT)  # this machine's replay is bit-exact all the same
    assert cpu_findings(r) == [f"Recorded on an unknown CPU (the run's manifest does not name it), replayed on "
                               f"{describe(HERE)}: kernels may sum in another order, so the state is compared within "
                               f"a tolerance (rtol {STATE_RTOL:g}) rather than bit for bit; every value compared is "
                               "bit-exact all the same."]
    set_cpu(run, "x86_64")  # damaged: one line naming the file and the field
    assert_one_line_error(run_cli("replay", run, cwd=ROOT), "manifest.json", "cpu")


@settings(max_examples=60, deadline=None)
@given(st.lists(st.floats(2**-4, 2**4, width=32) | st.floats(-(2**4), -(2**-4), width=32), min_size=1, max_size=16),
       st.integers(1, 200), st.data())
def test_values_some_ulps_apart_are_rounding_across_cpus_and_a_mismatch_on_one(values, ulps, data):
    recorded = torch.tensor(values, dtype=torch.float32)
    at = data.draw(st.integers(0, len(values) - 1))
    replayed = recorded.clone()
    replayed.view(torch.int32)[at] += ulps  # the same value moved ulps away from zero (another CPU's rounding)
    exact = _compare("w", "parameter", recorded, replayed)
    assert exact.mismatch is not None and (exact.mismatch.index, exact.mismatch.ulps, exact.rounded) == ([at], ulps, 0)
    tolerant = _compare("w", "parameter", recorded, replayed, STATE_RTOL)
    assert (tolerant.mismatch, tolerant.rounded, tolerant.max_ulps) == (None, 1, ulps)
    far = replayed.clone()
    far[at] = recorded[at] * 1.01  # a percent apart: beyond the tolerance on any CPU
    assert _compare("w", "parameter", recorded, far, STATE_RTOL).mismatch.index == [at]
