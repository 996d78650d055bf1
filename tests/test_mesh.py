"""Runs on a DeviceMesh: real 4-process gloo jobs under torch.distributed.run (tests/mesh_job.py), tensor parallelism
alone, FSDP2 over tensor parallelism and HSDP, replayed at world size through the real CLI under torchrun, emulated on
one process, bisected and scanned.

One launch records every run and replays each at world size (tests/replays_job.py). The defect lies in one data-parallel
group's shard at step 4 (for tensor parallelism alone, in the one batch every rank shares): each replay must name the
step, the mesh coordinate, the global coordinate and the sample, and leave the run untouched.
"""

from __future__ import annotations

import io
import itertools
import json
import pickle
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from nanforensics.checkpoints.bisect import bisect
from nanforensics.checkpoints.scan import scan_checkpoint
from nanforensics.errors import BadInput
from nanforensics.formats.discover import open_checkpoint
from nanforensics.runs.layout import Mesh, World

import mesh_job as job
from conftest import run_cli, tree_digest
from distributed_job import DEFECT_STEP, EVERY
from test_distributed import Launched, Ranks, launch, record_and_replay, replayed, torchrun

LAYOUTS = ["tp", "fsdp2_tp", "hsdp"]
# the mesh, the rank whose local computation first makes the infinity and its coordinate (tensor parallelism alone:
# the rank holding unit UNIT; else the bad group's tensor-parallel rank 0), the origin (stage, tensor, global index)
GAIN = ("grad", "features.gain", [3])
EXPECTED = {"tp": ([4], ["tp"], job.UNIT // 8, f"tp={job.UNIT // 8}", ("forward", "act", [job.DEFECT_SAMPLE, job.UNIT])),
            "fsdp2_tp": ([2, 2], ["dp", "tp"], 2, "dp=1, tp=0", GAIN),
            "hsdp": ([2, 2], ["replicate", "shard"], 1, "replicate=0, shard=1", GAIN)}


@pytest.fixture(scope="module")
def launched(tmp_path_factory: pytest.TempPathFactory) -> Launched:
    """One launch of 4 processes: every run of this module recorded (tests/mesh_job.py), then replayed at world size."""
    root = tmp_path_factory.mktemp("mesh")
    return record_and_replay(root, job.arguments(root, LAYOUTS), LAYOUTS, job.WORLD)


@pytest.fixture(scope="module")
def runs(launched) -> dict[str, Path]:
    recorded = launched.recorded
    assert recorded.codes == [0] * job.WORLD, recorded.stderr[-3000:]
    for name in LAYOUTS:
        assert f"{name}: " in recorded.stdout, recorded.stderr[-3000:]
    return launched.runs


@pytest.fixture(scope="module")
def torchrun_replays(runs, launched) -> dict[str, tuple[Ranks, Path, dict[str, str]]]:
    return launched.replays


def sample_id(name: str) -> str:
    return f"sample-{job.defect_index(name):05d}"


def test_layout(runs):
    """The manifest carries the mesh, the tensor-parallel plan and each parameter's placements; each data-parallel
    group's batches are recorded once (by its tensor-parallel rank 0)."""
    for name in LAYOUTS:
        section = json.loads((runs[name] / "manifest.json").read_text())["distributed"]
        shape, names, *_ = EXPECTED[name]
        assert (section["world_size"], section["mesh"]["shape"], section["mesh"]["dim_names"]) == (4, shape, names)
        assert sorted(p.name for p in (runs[name] / "ranks").iterdir()) == [
            f"rank_{g:05d}" for g in range(job.groups(name))]
    tp = json.loads((runs["tp"] / "manifest.json").read_text())["distributed"]["mesh"]
    assert [(p["module"], p["style"], p["use_local_output"]) for p in tp["plan"]] == [
        ("fc1", "colwise", False), ("fc2", "rowwise", True)]
    assert tp["placements"]["fc2.weight"] == {"tp": "Shard(dim=1)"} and "head.weight" not in tp["placements"]
    fsdp_tp = json.loads((runs["fsdp2_tp"] / "manifest.json").read_text())["distributed"]
    assert fsdp_tp["wrapping"]["kind"] == "fsdp2" and fsdp_tp["mesh"]["tp_dim"] == "tp"
    assert fsdp_tp["mesh"]["placements"]["fc2.weight"] == {"dp": "Shard(dim=0)", "tp": "Shard(dim=1)"}
    hsdp = json.loads((runs["hsdp"] / "manifest.json").read_text())["distributed"]["mesh"]
    assert hsdp["tp_dim"] is None and hsdp["placements"]["fc1.weight"] == {"replicate": "Replicate()",
                                                                         "shard": "Shard(dim=0)"}


@pytest.mark.parametrize("name", LAYOUTS)
def test_replay_at_world_size(runs, torchrun_replays, name):
    """torchrun --nproc-per-node 4 -m nanforensics replay RUN: bit-exact, the step, the rank and its mesh coordinate,
    the global coordinate, the sample; rank 0 alone writes the report; the run untouched."""
    run = runs[name]
    result, out, before = torchrun_replays[name]
    assert result.codes == [1] * job.WORLD, result.stderr[-3000:]
    report = json.loads(out.read_text())
    shape, names, rank, coordinate, (stage, tensor, index) = EXPECTED[name]
    assert (report["verdict"], report["reproduced"], report["setup"]["ranks_replayed"]) == ("nonfinite", True, "torchrun")
    assert (report["setup"]["mesh_shape"], report["setup"]["mesh_dim_names"]) == (shape, names)
    origin = report["origin"]
    assert (origin["step"], origin["stage"], origin["tensor"], origin["index"], origin["rank"]) == (
        DEFECT_STEP, stage, tensor, index, rank)
    assert report["samples"]["samples"] == [job.DEFECT_SAMPLE]
    assert report["samples"]["sample_leaves"] == {"batch['id']": [sample_id(name)]}
    assert report["responsible_batch"]["file"].endswith(
        f"ranks/rank_{job.bad_group(name):05d}/batches/step_{DEFECT_STEP:08d}.safetensors")
    chain = next(f for f in report["findings"] if f"({coordinate})" in f)
    assert f"at step {DEFECT_STEP}" in chain and sample_id(name) in chain, chain
    if name == "tp":  # every rank computed on the one batch: no data-parallel rank is responsible; rank 2 computes the
        # units 16-23, so its local columns 0-7 are the whole activation's 16-23, and it made the -inf before the others
        assert chain.startswith(f"No data-parallel rank is responsible for forward act[5, {job.UNIT}] = -inf at step 4: "
                                "every rank computed on the same batch"), chain
        assert f"tensor-parallel rank 2's local computation (rank 2 ({coordinate}))" in chain, chain
        assert "rank 0 (tp=0), rank 1 (tp=1), rank 3 (tp=3) made non-finite values of their own later in that step" in chain
        rowwise = next(e for e in report["events"] if e["step"] == DEFECT_STEP and e["stage"] == "grad")
        assert (rowwise["tensor"], rowwise["index"], rowwise["rank"]) == ("fc2.weight", [0, job.UNIT], 2)  # Shard(dim=1)
    else:
        assert chain.startswith(f"Data-parallel group {job.bad_group(name)}'s shard (sample {job.DEFECT_SAMPLE}: "), chain
        # the state is sharded: each rank checked its own shard, and the coordinates are the whole tensor's (rows 8-15
        # of features.gain lie in the second data-parallel shard, local rows 0-7 there)
        second = next(e for e in report["events"] if e["step"] == DEFECT_STEP + 1 and e["stage"] == "param"
                      and e["rank"] != 0)
        assert second["tensor"] == "features.gain" and second["index"][0] >= 8, second
    assert result.stdout.count("NON-FINITE") == 1
    # the views name the shard's rank with its mesh coordinate, from the report's words for it
    assert report["responsible_batch"]["owner"] == f"rank {rank} ({coordinate})"
    markdown = run_cli("report", out, "--markdown", "-").stdout
    assert f"step {DEFECT_STEP}, rank {rank} ({coordinate})'s shard" in markdown, markdown
    assert tree_digest(run) == before


@pytest.mark.parametrize("name", LAYOUTS)
def test_one_process_replays_within_a_tolerance(runs, name):
    """On one process the tensor-parallel layers are rebuilt whole (HSDP's two-stage reduction made one average): the
    same origin, group and sample, reproduction judged within a tolerance, and the report says why and names the
    command that replays it exactly."""
    run = runs[name]
    before = tree_digest(run)
    report = replayed(run)
    assert (report["verdict"], report["reproduced"], report["setup"]["ranks_replayed"]) == ("nonfinite", True, "emulated")
    assert report["setup"]["loss_rtol"] == 1e-3
    origin = report["origin"]
    _, _, rank, _, (stage, tensor, index) = EXPECTED[name]
    assert (origin["step"], origin["stage"], origin["tensor"], origin["index"], origin["rank"]) == (
        DEFECT_STEP, stage, tensor, index, 0 if name == "tp" else rank)  # the emulation's rank: the group's lead
    assert report["samples"]["sample_leaves"] == {"batch['id']": [sample_id(name)]}
    why = "HSDP's two-stage gradient reduction" if name == "hsdp" else "its tensor-parallel layers rebuilt whole"
    assert any(f.startswith(f"Replayed on one process, {why}") and
               f"torchrun --nproc-per-node 4 -m nanforensics replay {run}` replays it exactly" in f
               for f in report["findings"]), report["findings"]
    chain = next(f for f in report["findings"] if f.startswith(("Data-parallel group", "No data-parallel rank")))
    assert f" = -inf at step {DEFECT_STEP}" in chain or f" = inf at step {DEFECT_STEP}" in chain, chain
    assert sample_id(name) in chain, chain
    if name == "hsdp":  # a data-parallel group is one rank: its computation is its own here too
        assert chain.startswith(f"Data-parallel group 1's shard (sample {job.DEFECT_SAMPLE}: ") and \
            "in the local computation of rank 1 (replicate=0, shard=1)" in chain, chain
    else:
        assert "in the group's computation, its tensor-parallel layers rebuilt whole" in chain, chain
        assert "tensor-parallel rank" not in chain  # the emulation holds no rank's local computation
    # each entry of the logged losses is a data-parallel group's (on a mesh a group logs one loss), never "every rank"
    losses = [f for f in report["findings"] if "logged loss" in f.lower() and f.startswith(("Every ", "Logged losses first"))]
    assert losses and all("data-parallel group" in f and "rank's logged" not in f for f in losses), report["findings"]
    assert tree_digest(run) == before


@pytest.mark.parametrize("name", LAYOUTS)
def test_bisect_finds_the_first_poisoned_checkpoint(runs, name):
    before = tree_digest(runs[name])
    report = bisect([runs[name]])
    assert (report.last_clean.step, report.first_poisoned.step) == (EVERY, 2 * EVERY)
    assert report.first_poisoned_verdict == "poisoned_parameters"
    assert tree_digest(runs[name]) == before


def test_scan_reports_global_coordinates_of_a_rowwise_shard(runs, tmp_path):
    """fc2 is RowwiseParallel: DCP holds its weight as 4 chunks along dimension 1. A NaN written into the third chunk
    comes out at the whole tensor's coordinate."""
    from torch.distributed.checkpoint.metadata import MetadataIndex

    dest = tmp_path / "ckpt"
    shutil.copytree(runs["tp"] / "checkpoints" / f"step_{EVERY:08d}", dest)
    md = pickle.loads((dest / ".metadata").read_bytes())
    fqn = "model.fc2.weight"
    chunks = md.state_dict_metadata[fqn].chunks
    assert sorted(list(c.offsets) for c in chunks) == [[0, 0], [0, 8], [0, 16], [0, 24]]
    third = next(c for c in chunks if list(c.offsets) == [0, 16])
    poisoned = torch.zeros(tuple(third.sizes))
    poisoned[2, 5] = float("nan")
    info = md.storage_data[MetadataIndex(fqn, third.offsets)]
    buffer = io.BytesIO()
    torch.save(poisoned, buffer)
    (dest / "__9_0.distcp").write_bytes(buffer.getvalue())
    md.storage_data[MetadataIndex(fqn, third.offsets)] = type(info)("__9_0.distcp", 0, len(buffer.getvalue()))
    (dest / ".metadata").write_bytes(pickle.dumps(md))
    scan = scan_checkpoint(open_checkpoint(dest), full=True)
    weight = next(t for t in scan.tensors if t.name == fqn)
    assert (weight.nonfinite, weight.first_nonfinite.index, weight.shape) == (1, [2, 21], [32, 32])


# ---- the manifest's mesh section is untrusted input ---------------------------------------------------------------

GOOD = {"shape": [2, 2], "dim_names": ["dp", "tp"], "tp_dim": "tp",
        "plan": [{"module": "fc1", "style": "colwise", "input_layouts": "Replicate()", "output_layouts": "Shard(dim=-1)",
                  "use_local_output": True}],
        "placements": {"fc1.weight": {"dp": "_StridedShard(dim=0, sf=2)", "tp": "Shard(dim=0)"}}}
SECTION = {"world_size": 4, "backend": "gloo", "wrapping": {"kind": "fsdp2", "modules": [
    {"module": "", "reshard_after_forward": True, "mp_policy": {"param_dtype": None, "reduce_dtype": None,
                                                                 "output_dtype": None, "cast_forward_inputs": True}}]}}
junk = st.recursive(st.none() | st.booleans() | st.integers(-3, 10) | st.text(max_size=12),
                    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3),
                    max_leaves=6)


def test_the_recorded_mesh_reads_back():
    world = World.read({**SECTION, "mesh": GOOD}, Path("manifest.json"))
    assert world.mesh == Mesh((2, 2), ("dp", "tp"), "tp", tuple(GOOD["plan"]), GOOD["placements"])
    assert world.to_json()["mesh"] == GOOD
    assert (world.data_ranks, world.data_rank(3), world.lead(1), world.where(2)) == (2, 1, 2, "rank 2 (dp=1, tp=0)")


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(key=st.sampled_from(sorted(GOOD)), value=junk, nested=st.booleans())
def test_a_damaged_mesh_section_is_one_line_bad_input(key, value, nested):
    """Any field of the mesh section replaced by arbitrary JSON (or a field of its first plan entry): read back as
    the same section, or refused with one line naming the manifest, never another exception."""
    mesh: dict[str, Any] = json.loads(json.dumps(GOOD))
    if nested and key == "plan":
        mesh["plan"][0][str(value)[:8] if not isinstance(value, str) else "style"] = value
    else:
        mesh[key] = value
    try:
        world = World.read({**SECTION, "mesh": mesh}, Path("manifest.json"))
    except BadInput as e:
        assert str(e).startswith("manifest.json: distributed.") and "\n" not in str(e), str(e)
    else:
        assert world.mesh is not None and world.mesh.to_json() == mesh


@pytest.mark.parametrize("name", LAYOUTS)
def test_rebuilt_placements_must_be_the_recorded_ones(runs, name):
    """The placements replay rebuilds are compared with the recorded manifest's before any step: the real recorded
    placements pass; any one parameter's placement on one dimension changed (or the parameter dropped) is one line of
    BadInput naming manifest.json, the parameter, the recorded and the rebuilt placements. Every parameter, dimension
    and other placement of each layout, enumerated (a few dozen dictionary comparisons; it was 20 sampled)."""
    from nanforensics.distributed.wrapping import check_placements
    from nanforensics.runs.run import Run

    run = Run(runs[name])
    assert run.world is not None and run.world.mesh is not None
    recorded = run.world.mesh.placements
    check_placements(json.loads(json.dumps(recorded)), run.world, run.code_file)
    changed = 0
    for param, dim, other in itertools.product(sorted(recorded), sorted({d for p in recorded.values() for d in p}),
                                               ["Replicate()", "Shard(dim=0)", "Shard(dim=1)", None]):
        rebuilt = json.loads(json.dumps(recorded))
        if dim not in rebuilt[param] or other == rebuilt[param][dim]:
            continue
        if other is None:
            del rebuilt[param]
        else:
            rebuilt[param][dim] = other
        changed += 1
        with pytest.raises(BadInput) as e:
            check_placements(rebuilt, run.world, run.code_file)
        line = str(e.value)
        assert line.startswith(f"{run.code_file}: distributed.mesh.placements of {param!r} are ") and "\n" not in line, line
        assert f"{dim}={recorded[param][dim]}" in line and (other is None or f"{dim}={other}" in line), line
    assert changed >= 2 * len(recorded)  # each parameter dropped, and changed on at least one dimension


@pytest.mark.skipif(torch.cuda.device_count() < 4, reason=f"a 2x2 mesh on NCCL needs 4 CUDA devices; this machine "
                                                          f"has {torch.cuda.device_count()}")
def test_nccl_on_gpus(tmp_path):
    """The FSDP2 + TP run on four GPUs with NCCL, replayed at world size on them (whether bit-exact is printed)."""
    recorded = launch([*job.command(tmp_path, ["fsdp2_tp"]), "--cuda"])
    assert recorded.code == 0, recorded.stderr[-3000:]
    out = tmp_path / "report.json"
    torchrun("-m", "nanforensics", "replay", tmp_path / "fsdp2_tp", "--device", "cuda", "--json", out, procs=job.WORLD)
    report = json.loads(out.read_text())
    assert (report["origin"]["step"], report["origin"]["rank"]) == (DEFECT_STEP, 2)
    print(f"fsdp2_tp on NCCL: reproduced {report['reproduced']}")



# ---- the tensor-parallel plan read back off the model and applied again ---------------------------------------------

LAYOUT_TEXTS = ["Replicate()", "Shard(dim=-1)", "Shard(dim=0)"]


@pytest.fixture
def one_rank() -> Any:
    """A process group of one rank in this process (gloo over a file store), left again when the test ends (a replay in
    this process must find none): a DeviceMesh of size 1 carries every plan the recorder reads."""
    import tempfile

    import torch.distributed as dist

    with tempfile.TemporaryDirectory() as folder:
        dist.init_process_group("gloo", store=dist.FileStore(str(Path(folder) / "store"), 1), rank=0, world_size=1)
        try:
            yield
        finally:
            dist.destroy_process_group()


def test_an_optimizer_over_a_dtensor_is_not_proven(one_rank):
    """The proof bounds a parameter's update by its gradient's largest magnitude, which on a DTensor would be one rank's
    shard: an optimizer holding one is not proven (its state is read, as the monitor reads it); the same optimizer over
    plain tensors is."""
    from nanforensics.replay.proof import provable
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (1,))
    plain = torch.nn.Parameter(torch.ones(4))
    sharded = torch.nn.Parameter(distribute_tensor(torch.ones(4), mesh, [Shard(0)]))
    for kind in (torch.optim.Adam, torch.optim.AdamW, torch.optim.SGD):
        assert provable(kind([plain]))
        assert not provable(kind([plain, sharded])) and not provable(kind([{"params": [plain]}, {"params": [sharded]}]))


@pytest.mark.parametrize("style", ["colwise", "rowwise"])
def test_the_plan_is_read_back_and_rebuilt(one_rank, style):
    """Every ColwiseParallel/RowwiseParallel layout pair, local output or not, and SequenceParallel dimension (144 in
    all, listed rather than sampled): the plan the recorder reads off the hooks, applied by replay to a fresh model,
    reads back the same, with the same placements."""
    for given_in, given_out, local, dim, sequence_local in itertools.product(LAYOUT_TEXTS, LAYOUT_TEXTS, (False, True),
                                                                               (0, 1), (False, True)):
        _plan_round_trip(style, given_in, given_out, local, dim, sequence_local)


def _plan_round_trip(style: str, given_in: str, given_out: str, local: bool, dim: int, sequence_local: bool) -> None:
    """One layout of test_the_plan_is_read_back_and_rebuilt."""
    from nanforensics.distributed.wrapping import _placement, describe_mesh, parallelize
    from nanforensics.runs.layout import TP
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel, parallelize_module

    model = torch.nn.Sequential(torch.nn.LayerNorm(8), torch.nn.Linear(8, 8))
    cls = ColwiseParallel if style == "colwise" else RowwiseParallel
    parallelize_module(model, init_device_mesh("cpu", (1,), mesh_dim_names=("tp",)), {
        "0": SequenceParallel(sequence_dim=dim, use_local_output=sequence_local),
        "1": cls(input_layouts=_placement(given_in), output_layouts=_placement(given_out), use_local_output=local)})
    mesh = describe_mesh(model, 1)
    assert mesh is not None and mesh.tp_dim == "tp"
    assert [dict(p) for p in mesh.plan] == [
        {"module": "0", "style": "sequence", "input_layouts": f"Shard(dim={dim})", "output_layouts": f"Shard(dim={dim})",
         "use_local_output": sequence_local},
        {"module": "1", "style": style, "input_layouts": given_in, "output_layouts": given_out, "use_local_output": local}]
    fresh = torch.nn.Sequential(torch.nn.LayerNorm(8), torch.nn.Linear(8, 8))
    parallelize(fresh, World(1, TP, "gloo", {}, mesh), torch.device("cpu"))
    assert describe_mesh(fresh, 1) == mesh
    assert World.read(World(1, TP, "gloo", {}, mesh).to_json(), Path("manifest.json")).mesh == mesh
