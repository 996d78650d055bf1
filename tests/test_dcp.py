"""torch.distributed.checkpoint (FSDP's sharded format): scan and bisect real runs saved by a single process."""

from __future__ import annotations

import io
import pickle
import warnings
from pathlib import Path

import pytest
import torch
from nanforensics.checkpoints.bisect import bisect
from nanforensics.checkpoints.scan import POISONED_PARAMETERS, POISONED_STATE, scan_checkpoint
from nanforensics.errors import BadInput
from nanforensics.formats import open_checkpoint

from checkpoint_formats import ALL_STEPS, FIRST_POISONED, LAST_CLEAN, recorded_runs, state_of
from conftest import assert_one_line_error, run_cli, tree_digest
from test_scan import Payload  # unpickling it creates a marker file


def dcp():
    """torch.distributed.checkpoint, imported where a test saves with it: with DTensor it takes seconds to import,
    which a pytest-xdist worker that only collects this module does not spend."""
    return pytest.importorskip("torch.distributed.checkpoint", reason="this torch has no torch.distributed")


def save_dcp(run: Path, step: int, dest: Path) -> Path:
    """A recorded checkpoint as FSDP's get_state_dict lays it out (state keyed by parameter name), via dcp.save."""
    model, optim, _ = state_of(run, step)
    names = optim["param_groups"][0]["param_names"]
    state = {"model": model, "step": step,
             "optim": {"state": {names[i]: s for i, s in optim["state"].items()},
                       "param_groups": [{"params": names, "lr": 0.01}]}}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "torch.distributed is disabled ... assuming a single process"
        dcp().save(state, checkpoint_id=dest)
    return dest


@pytest.fixture(scope="module")
def dcp_folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    runs = recorded_runs(tmp_path_factory)
    root = tmp_path_factory.mktemp("dcp")
    for kind in ("params", "state"):
        for step in ALL_STEPS:
            save_dcp(runs[kind], step, root / kind / f"ckpt-{step}")
    return {kind: root / kind for kind in ("params", "state")} | {"runs": runs}  # type: ignore[operator]


def truth(run: Path, step: int) -> dict[str, tuple[int, list[int] | None]]:
    model, optim, _ = state_of(run, step)
    names = optim["param_groups"][0]["param_names"]
    tensors = {f"model.{k}": t for k, t in model.items()}
    tensors.update({f"optim.state.{names[i]}.{k}": t for i, s in optim["state"].items() for k, t in s.items()})
    out = {}
    for name, t in tensors.items():
        bad = ~torch.isfinite(t)
        out[name] = (int(bad.sum()), [int(i) for i in bad.nonzero()[0]] if bad.any() else None)
    return out


@pytest.mark.parametrize("kind, verdict", [("params", POISONED_PARAMETERS), ("state", POISONED_STATE)])
def test_bisect_and_scan_find_the_poison(dcp_folders, kind, verdict):
    folder = dcp_folders[kind]
    before = tree_digest(folder)
    report = bisect([folder])
    assert (report.verdict, report.order) == ("poisoned", "metadata")  # the "step" entry saved beside the state
    assert (report.last_clean.step, report.first_poisoned.step) == (LAST_CLEAN, FIRST_POISONED)
    assert report.first_poisoned_verdict == verdict and report.scans <= report.max_scans
    scan = scan_checkpoint(open_checkpoint(folder / f"ckpt-{FIRST_POISONED}"), full=True)
    assert scan.format == "dcp" and scan.verdict == verdict
    found = {t.name: (t.nonfinite, t.first_nonfinite.index if t.first_nonfinite else None) for t in scan.tensors}
    assert found == truth(dcp_folders["runs"][kind], FIRST_POISONED)
    assert {t.group for t in scan.tensors if t.name.startswith("optim.")} == {"optimizer"}
    assert {t.group for t in scan.tensors if t.name.startswith("model.")} == {"model"}
    assert tree_digest(folder) == before


def test_a_tensor_sharded_over_ranks_is_scanned_whole(dcp_folders, tmp_path):
    """Rewrite one checkpoint as two ranks would have saved fc1.weight: two row blocks in another file."""
    src = dcp_folders["params"] / f"ckpt-{FIRST_POISONED}"
    dest = save_dcp(dcp_folders["runs"]["params"], FIRST_POISONED, tmp_path / "sharded")
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex

    md = pickle.loads((dest / ".metadata").read_bytes())
    fqn = "model.fc1.weight"
    whole = md.state_dict_metadata[fqn]
    full = scan_checkpoint(open_checkpoint(src), full=True)
    weight = torch.full(tuple(whole.size), 0.5)
    weight[20, 3] = float("nan")  # in the second block: its coordinate must come out global
    info_type = type(md.storage_data.pop(MetadataIndex(fqn, torch.Size([0, 0]))))
    blobs = bytearray()
    chunks = []
    for offset, rows in ((0, 16), (16, whole.size[0] - 16)):
        start = len(blobs)
        buffer = io.BytesIO()
        torch.save(weight[offset:offset + rows].clone(), buffer)
        blobs += buffer.getvalue()
        chunk = ChunkStorageMetadata(torch.Size([offset, 0]), torch.Size([rows, whole.size[1]]))
        chunks.append(chunk)
        md.storage_data[MetadataIndex(fqn, chunk.offsets)] = info_type("__1_0.distcp", start, len(blobs) - start)
    whole.chunks = chunks
    (dest / "__1_0.distcp").write_bytes(bytes(blobs))
    (dest / ".metadata").write_bytes(pickle.dumps(md))
    scan = scan_checkpoint(open_checkpoint(dest), full=True)
    sharded = next(t for t in scan.tensors if t.name == fqn)
    assert (sharded.nonfinite, sharded.first_nonfinite.index, sharded.shape) == (1, [20, 3], list(whole.size))
    assert {t.name for t in scan.tensors} == {t.name for t in full.tensors}


def test_doctored_or_damaged_checkpoints_are_refused(dcp_folders, tmp_path):
    evil = save_dcp(dcp_folders["runs"]["params"], LAST_CLEAN, tmp_path / "evil")
    marker = tmp_path / "PWNED"
    (evil / ".metadata").write_bytes(pickle.dumps({"state_dict_metadata": Payload(marker)}))
    result = run_cli("scan", evil)
    assert_one_line_error(result, ".metadata", "refused, not loaded", "pathlib.Path.touch")
    assert not marker.exists()

    cut = save_dcp(dcp_folders["runs"]["params"], LAST_CLEAN, tmp_path / "cut")
    [data] = cut.glob("*.distcp")
    data.write_bytes(data.read_bytes()[: data.stat().st_size // 2])
    with pytest.raises(BadInput, match=f"{data.name}.*truncated"):
        scan_checkpoint(open_checkpoint(cut), full=True)
