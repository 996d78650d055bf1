"""scan: real checkpoints in every format, poisoned in parameters, in optimizer state only, or not at all."""

from __future__ import annotations

import json
import pickle
from pathlib import Path

import pytest
import torch
from nanforensics.checkpoints.scan import CLEAN, POISONED_PARAMETERS, POISONED_STATE, scan_checkpoint
from nanforensics.errors import BadInput
from nanforensics.formats import open_checkpoint
from safetensors.torch import save_file

from checkpoint_formats import (
    FIRST_POISONED,
    FORMATS,
    LAST_CLEAN,
    Checkpoints,
    checkpoint_path,
    state_of,
    write_checkpoint,
)
from conftest import assert_one_line_error, run_cli, tree_digest

EXPECTED = {"params": POISONED_PARAMETERS, "state": POISONED_STATE, "clean": CLEAN}


@pytest.fixture(scope="session")
def ck(tmp_path_factory: pytest.TempPathFactory) -> Checkpoints:
    return Checkpoints.make(tmp_path_factory)


def checkpoint_of(ck: Checkpoints, kind: str, fmt: str, step: int) -> Path:
    if fmt == "ours":
        return ck.runs[kind] / "checkpoints" / f"step_{step:08d}"
    return checkpoint_path(ck.folders[kind, fmt], fmt, step)


def short(name: str) -> str:
    """Tensor names across formats, reduced to ``fc1.weight`` / ``fc1.weight.exp_avg_sq``."""
    name = name.replace("/", ".")
    for prefix in ("model.", "optimizer.", "state."):
        name = name.removeprefix(prefix)
    return name


def truth(run: Path, step: int) -> dict[str, tuple[int, list[int] | None]]:
    """Non-finite count and first bad coordinate of every tensor, straight from torch."""
    model, optim, _ = state_of(run, step)
    names = optim["param_groups"][0]["param_names"]
    tensors = dict(model)
    for i, state in optim["state"].items():
        tensors.update({f"{names[i]}.{k}": t for k, t in state.items()})
    out = {}
    for name, t in tensors.items():
        bad = ~torch.isfinite(t)
        first = [int(i) for i in bad.nonzero()[0]] if bad.any() else None
        out[name] = (int(bad.sum()), first)
    return out


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("kind", ["params", "state", "clean"])
def test_full_scan_matches_torch_in_every_format(ck, kind, fmt):
    path = checkpoint_of(ck, kind, fmt, FIRST_POISONED)
    report = scan_checkpoint(open_checkpoint(path), full=True)
    assert report.verdict == EXPECTED[kind]
    assert report.complete and report.bytes_read == report.bytes_total
    assert set(report.groups) == {"model", "optimizer"}
    got = {short(t.name): (t.nonfinite, t.first_nonfinite.index if t.first_nonfinite else None) for t in report.tensors}
    assert got == truth(ck.runs[kind], FIRST_POISONED)
    if kind == "state":
        bad = [short(t.name) for t in report.poisoned]
        assert bad and all(n.endswith("exp_avg_sq") for n in bad)
        assert report.groups["model"].nonfinite_tensors == 0


@pytest.mark.parametrize("fmt", FORMATS)
def test_clean_checkpoint_before_the_defect(ck, fmt):
    report = scan_checkpoint(open_checkpoint(checkpoint_of(ck, "params", fmt, LAST_CLEAN)))
    assert report.verdict == CLEAN and report.complete
    assert report.step == LAST_CLEAN and report.step_source == "metadata"
    assert all(t.max_abs is not None and not t.near_limit for t in report.tensors if t.checked)


def test_early_stop_reads_only_up_to_the_first_bad_tensor(ck):
    source = open_checkpoint(ck.runs["params"] / "checkpoints" / f"step_{FIRST_POISONED:08d}")
    quick = scan_checkpoint(source)
    assert quick.verdict == POISONED_PARAMETERS and not quick.complete
    assert len(quick.poisoned) == 1 and quick.tensors[-1].nonfinite and quick.tensors[-1].group == "model"
    assert quick.bytes_read < quick.bytes_total
    resumed = scan_checkpoint(source, full=True, resume=quick)
    assert resumed.complete and resumed.bytes_read == resumed.bytes_total
    assert [t.name for t in resumed.tensors] == [t.name for t in scan_checkpoint(source, full=True).tensors]


def test_state_only_poison_reads_every_parameter_first(ck):
    report = scan_checkpoint(open_checkpoint(ck.runs["state"] / "checkpoints" / f"step_{FIRST_POISONED:08d}"))
    assert report.verdict == POISONED_STATE and not report.complete
    assert report.groups["model"].read == report.groups["model"].tensors
    assert report.tensors[-1].name.endswith("exp_avg_sq")


def test_dtypes_headroom_and_unchecked_tensors(tmp_path):
    f64 = torch.zeros(3, dtype=torch.float64)
    f64[1] = 1e300  # finite, though beyond float32's range
    fp8 = torch.tensor([1.0, float("inf"), 2.0]).to(torch.float8_e5m2)
    c64 = torch.zeros(2, 2, dtype=torch.complex64)
    c64[1, 0] = complex(0, float("nan"))
    tensors = {"half": torch.tensor([1.0, 60000.0], dtype=torch.float16), "bf16": torch.ones(4, dtype=torch.bfloat16),
               "f64": f64, "fp8": fp8, "c64": c64, "ints": torch.arange(5), "mask": torch.ones(2, dtype=torch.bool),
               "scalar": torch.tensor(3.0), "empty": torch.zeros(0, 4)}
    save_file(tensors, tmp_path / "mixed.safetensors")
    source = open_checkpoint(tmp_path / "mixed.safetensors")
    by_name = {t.name: t for t in scan_checkpoint(source, full=True).tensors}
    assert by_name["half"].near_limit and by_name["half"].max_abs == 60000.0 and by_name["half"].dtype_max == 65504.0
    assert not scan_checkpoint(source, full=True, margin=1.0).tensors[0].near_limit
    assert (by_name["f64"].nonfinite, by_name["f64"].max_abs, by_name["f64"].near_limit) == (0, 1e300, False)
    assert (by_name["fp8"].nonfinite, by_name["fp8"].first_nonfinite.index) == (1, [1])
    assert (by_name["c64"].nonfinite, by_name["c64"].first_nonfinite.index) == (1, [1, 0])
    assert not by_name["ints"].checked and not by_name["mask"].checked
    assert by_name["scalar"].max_abs == 3.0 and by_name["empty"].checked is False


@pytest.mark.filterwarnings("ignore:Sparse")  # torch's notes on building sparse tensors
def test_sparse_tensors_are_read_never_passed_over_as_clean(tmp_path):
    """A NaN among a sparse tensor's stored values poisons the checkpoint; its coordinate is the dense one."""
    coo = torch.sparse_coo_tensor(torch.tensor([[0, 1, 1], [2, 0, 2]]), torch.tensor([3.0, float("nan"), 5.0]), (2, 3))
    hybrid = torch.sparse_coo_tensor(torch.tensor([[0, 2]]), torch.tensor([[1.0, 2.0], [3.0, float("-inf")]]), (3, 2))
    torch.save({"coo": coo, "hybrid": hybrid, "csr": coo.to_sparse_csr(), "clean": torch.eye(3).to_sparse()},
               tmp_path / "sparse.pt")
    before = tree_digest(tmp_path)
    report = scan_checkpoint(open_checkpoint(tmp_path / "sparse.pt"), full=True)
    by_name = {t.name: t for t in report.tensors}
    assert report.verdict == POISONED_PARAMETERS and report.complete and all(t.checked for t in report.tensors)
    assert (by_name["coo"].nonfinite, by_name["coo"].first_nonfinite.index) == (1, [1, 0])
    assert (by_name["csr"].nonfinite, by_name["csr"].first_nonfinite.index) == (1, [1, 0])
    assert by_name["hybrid"].first_nonfinite.index == [2, 1] and by_name["hybrid"].first_nonfinite.value == "-inf"
    assert (by_name["clean"].nonfinite, by_name["clean"].max_abs) == (0, 1.0)
    cli = run_cli("scan", tmp_path / "sparse.pt", "--json", "-")
    assert cli.code == 1 and cli.json()["verdict"] == POISONED_PARAMETERS, cli.stderr
    assert tree_digest(tmp_path) == before


def test_legacy_and_bare_pickles(tmp_path, ck):
    model, optim, _ = state_of(ck.runs["params"], FIRST_POISONED)
    torch.save(model, tmp_path / "bare.pt")  # a plain state dict: everything is model
    torch.save({"state_dict": model, "optimizer_states": [optim]}, tmp_path / "legacy.pth",
               _use_new_zipfile_serialization=False)
    bare = scan_checkpoint(open_checkpoint(tmp_path / "bare.pt"), full=True)
    assert bare.verdict == POISONED_PARAMETERS and set(bare.groups) == {"model"}
    legacy = scan_checkpoint(open_checkpoint(tmp_path / "legacy.pth"), full=True)
    assert legacy.verdict == POISONED_PARAMETERS
    assert {t.group for t in legacy.tensors if "exp_avg" in t.name} == {"optimizer"}
    assert any(t.name == "optimizer_states.0.state.fc1.weight.exp_avg_sq" for t in legacy.poisoned)


class Payload:
    """Unpickling this creates ``marker``: what a hostile checkpoint would do."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return Path.touch, (self.marker,)


def test_malicious_pickle_is_refused_and_never_runs(tmp_path, ck):
    model, _, _ = state_of(ck.runs["clean"], LAST_CLEAN)
    live = tmp_path / "control"
    live.mkdir()
    torch.save({"model": model, "extra": Payload(live / "RAN")}, live / "evil.pt")
    torch.load(live / "evil.pt", weights_only=False)  # the payload is live: an unsafe load runs it
    assert (live / "RAN").exists()

    folder, marker = tmp_path / "ckpts", tmp_path / "PWNED"
    folder.mkdir()
    torch.save({"model": model, "extra": Payload(marker)}, folder / "evil.pt")
    (folder / "plain.pth").write_bytes(pickle.dumps({"w": Payload(marker)}))
    before = tree_digest(folder)
    result = run_cli("scan", folder / "evil.pt")
    assert_one_line_error(result, str(folder / "evil.pt"), "refused, not loaded")
    with pytest.raises(BadInput, match="refused"):
        open_checkpoint(folder / "plain.pth")
    assert not marker.exists()
    assert tree_digest(folder) == before


def test_cli_exit_codes_json_markdown_and_untouched_checkpoints(ck, tmp_path):
    clean = checkpoint_of(ck, "params", "ours", LAST_CLEAN)
    state = checkpoint_of(ck, "state", "hf", FIRST_POISONED)
    before = {p: tree_digest(p) for p in (ck.runs["params"], state)}

    ok = run_cli("scan", clean, "--json", "-")
    assert ok.code == 0, ok.stderr
    report = ok.json()
    assert (report["schema"], report["verdict"], report["step"]) == ("nanforensics.scan/1", "clean", LAST_CLEAN)

    out = run_cli("scan", state, "--full", "--json", tmp_path / "r.json", "--markdown", tmp_path / "r.md")
    assert out.code == 1, out.stderr
    assert "POISONED OPTIMIZER STATE" in out.stdout and "exp_avg_sq" in out.stdout
    saved = json.loads((tmp_path / "r.json").read_text())
    assert saved["verdict"] == "poisoned_optimizer_state" and saved["complete"] is True
    assert "nanforensics scan: POISONED OPTIMIZER STATE" in (tmp_path / "r.md").read_text()
    assert {p: tree_digest(p) for p in before} == before


def test_truncated_file_is_a_one_line_error_through_the_cli(ck, tmp_path):
    good = checkpoint_path(ck.folders["params", "safetensors"], "safetensors", FIRST_POISONED)
    cut = tmp_path / "cut.safetensors"
    cut.write_bytes(good.read_bytes()[: good.stat().st_size - 100])
    assert_one_line_error(run_cli("scan", cut), str(cut), "truncated")


def test_a_file_changed_under_a_scan_is_read_as_checked_or_named(tmp_path):
    """The class: the checkpoint's bytes change between its header's check and a tensor's read. A file put in its
    place (here a symlink out of the tree) is never read: the tensors come from the file whose header was checked.
    The same file cut short is a one-line error naming the tensor past its end, not a bus error."""
    path = tmp_path / "ck.safetensors"
    save_file({"a": torch.ones(4096), "b": torch.ones(4096)}, path)
    outside = tmp_path.parent / f"{tmp_path.name}-elsewhere.safetensors"
    save_file({"a": torch.full((4096,), float("nan")), "b": torch.full((4096,), float("nan"))}, outside)
    stream = open_checkpoint(path).open()
    tensors = stream.tensors()
    assert bool(next(tensors)[1].isfinite().all())
    path.unlink()
    path.symlink_to(outside)
    assert bool(next(tensors)[1].isfinite().all())  # the checked file's "b", not the NaNs it was replaced with
    outside.unlink()

    path.unlink()
    save_file({"a": torch.ones(4096), "b": torch.ones(4096)}, path)
    tensors = open_checkpoint(path).open().tensors()
    next(tensors)
    with open(path, "r+b") as f:
        f.truncate(path.stat().st_size - 100)
    with pytest.raises(BadInput, match="truncated while being read: tensor 'b'"):
        next(tensors)


def _damaged(tmp_path: Path, ck: Checkpoints) -> list[tuple[Path, str]]:
    """(path to scan, the file the error must name) for each kind of damage."""
    st = checkpoint_path(ck.folders["params", "safetensors"], "safetensors", LAST_CLEAN)
    pt = checkpoint_path(ck.folders["params", "pt"], "pt", LAST_CLEAN)
    cases = []
    (tmp_path / "cut.pt").write_bytes(pt.read_bytes()[:2000])
    cases.append((tmp_path / "cut.pt", tmp_path / "cut.pt"))
    (tmp_path / "empty.pt").write_bytes(b"")
    cases.append((tmp_path / "empty.pt", tmp_path / "empty.pt"))
    (tmp_path / "text.pt").write_text("not a checkpoint at all")
    cases.append((tmp_path / "text.pt", tmp_path / "text.pt"))
    (tmp_path / "header.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json at all")
    cases.append((tmp_path / "header.safetensors", tmp_path / "header.safetensors"))
    (tmp_path / "tiny.safetensors").write_bytes(st.read_bytes()[:5])
    cases.append((tmp_path / "tiny.safetensors", tmp_path / "tiny.safetensors"))
    hf = write_checkpoint(tmp_path / "hf", "hf", ck.runs["params"], LAST_CLEAN, LAST_CLEAN)
    (hf / "model-00002-of-00002.safetensors").unlink()
    cases.append((hf, hf / "model-00002-of-00002.safetensors"))
    ours = write_checkpoint(tmp_path / "ours", "ours", ck.runs["params"], LAST_CLEAN, LAST_CLEAN)
    (ours / "meta.json").write_text("{")
    cases.append((ours, ours / "meta.json"))
    return cases


def test_damaged_checkpoints_name_the_file(tmp_path, ck):
    for path, named in _damaged(tmp_path, ck):
        with pytest.raises(BadInput) as e:
            scan_checkpoint(open_checkpoint(path))
        assert e.value.where == str(named), (path, str(e.value))
        assert "\n" not in str(e.value)


def test_a_run_directory_is_not_one_checkpoint(ck):
    with pytest.raises(BadInput, match="run directory with 9 checkpoints"):
        open_checkpoint(ck.runs["clean"])
