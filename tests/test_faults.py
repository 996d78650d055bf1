"""Every command over damaged copies of a recorded run: one table, one CLI call per (damage, command).

Each case must end in a one-line error naming the file and the problem with exit code 2 (never the
catch-all line for unforeseen exceptions), or, where the damage leaves enough, work (exit 0/1) or give a
post-mortem marked partial (an analysis failed, naming the file; no step pinned). Either way the input
directory is byte-identical afterwards and, on an error, the earlier report at the --json path is left
as it was and no Markdown report is written. The calls run concurrently (a pool as wide as the CPUs),
since most of each is the import of torch; conftest's summary of them by command and class ends the
session.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import signal
import stat
import struct
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator, Mapping

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from nanforensics.checkpoints.scan import scan_checkpoint
from nanforensics.errors import BadInput
from nanforensics.formats import open_checkpoint
from nanforensics.inputs import SafetensorsFile, TensorFile
from safetensors.torch import load_file, save_file

from conftest import DEFECT_STEP, FAULT_CASE, Result, error_lines, run_cli, tree_digest

SCENARIO = "adam_near_zero"
CK = Path("checkpoints") / "step_00000010"  # the last clean checkpoint before the defect: replay starts here
MODEL = CK / "model.safetensors"
EARLIER = "an earlier report\n"
# root reads through any permission bits; without these two capabilities it is held to them like any user
NO_OVERRIDE = ("setpriv", "--bounding-set=-dac_override,-dac_read_search", "--")
ERROR, WORKS, PARTIAL = "error", "works", "partial"


# ---- damage: each changes a copy of the run (and may prepare the output folder) -------------------------


def _cut(path: Path, size: int) -> None:
    path.write_bytes(path.read_bytes()[:size])


def truncated_header(run: Path, out: Path) -> None:
    _cut(run / MODEL, 40)


def truncated_body(run: Path, out: Path) -> None:
    _cut(run / MODEL, (run / MODEL).stat().st_size - 100)


def sizes_beyond_file(run: Path, out: Path) -> None:
    """A self-consistent header whose largest tensor claims ten times the rows it has bytes for."""
    data = (run / MODEL).read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + n])
    spec = header["fc2.weight"]
    spec["shape"][0] *= 10
    spec["data_offsets"][1] = spec["data_offsets"][0] + math.prod(spec["shape"]) * 4
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    (run / MODEL).write_bytes(struct.pack("<Q", len(raw)) + raw + data[8 + n:])


def huge_header_length(run: Path, out: Path) -> None:
    data = (run / MODEL).read_bytes()
    (run / MODEL).write_bytes(struct.pack("<Q", 1 << 62) + data[8:])


def _retensor(run: Path, name: str, change: Callable[[torch.Tensor], torch.Tensor]) -> None:
    """Rewrite one model tensor as a valid safetensors file, keeping the file's metadata."""
    tensors = load_file(run / MODEL)
    tensors[name] = change(tensors[name])
    save_file(tensors, run / MODEL, metadata=SafetensorsFile(run / MODEL).metadata)


def wrong_dtype(run: Path, out: Path) -> None:
    _retensor(run, "fc2.weight", lambda t: t.half())


def wrong_shape(run: Path, out: Path) -> None:
    _retensor(run, "fc2.weight", lambda t: t[:16].clone())


def missing_optimizer_state(run: Path, out: Path) -> None:
    (run / CK / "optimizer.safetensors").unlink()


def _edit_manifest(run: Path, **changes: str) -> None:
    manifest = json.loads((run / "manifest.json").read_text())
    (run / "manifest.json").write_text(json.dumps({**manifest, **changes}, indent=2))


def malformed_manifest(run: Path, out: Path) -> None:
    _cut(run / "manifest.json", 60)


def future_manifest(run: Path, out: Path) -> None:
    _edit_manifest(run, format="nanforensics.run/9")


def manifest_missing_module(run: Path, out: Path) -> None:
    _edit_manifest(run, model_factory="no_such_faults_module:build_model")


def batches_missing_mid_window(run: Path, out: Path) -> None:
    for step in (13, 14):
        (run / "batches" / f"step_{step:08d}.safetensors").unlink()


def garbage_log_lines(run: Path, out: Path) -> None:
    lines = (run / "steps.jsonl").read_bytes().splitlines(keepends=True)
    (run / "steps.jsonl").write_bytes(b"".join(lines[:5] + [b"\x00\xffgarbage{\n"] + lines[5:]))


def torn_last_line(run: Path, out: Path) -> None:
    """A job killed in the middle of writing its last step record."""
    _cut(run / "steps.jsonl", (run / "steps.jsonl").stat().st_size - 9)


def empty_directory(run: Path, out: Path) -> None:
    shutil.rmtree(run)
    run.mkdir()


def unreadable_directory(run: Path, out: Path) -> None:
    """The run folder, and the checkpoint folder scan is given, without read or search permission."""
    (run / CK).chmod(0)
    run.chmod(0)


def unwritable_output(run: Path, out: Path) -> None:
    """A folder where the Markdown report goes; a file where repair's --out folder goes."""
    (out / "report.md").mkdir()
    (out / "repaired").write_text("a file, not a folder")


# ---- hostile inputs (issue 13): outputs aimed at the input, special files, absurd numbers, deep nesting ----------

DEEP = "[" * 100_000 + "]" * 100_000
SAVED = "saved.json"  # a report inside the run, re-rendered by ``report``


def _header(path: Path, change: Callable[[dict], bytes]) -> None:
    """Rewrite a safetensors file's JSON header (``change`` returns the new header bytes), keeping its data."""
    data = path.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    raw = change(json.loads(data[8:8 + n]))
    raw += b" " * (-len(raw) % 8)
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + data[8 + n:])


def _fifo(path: Path) -> None:
    path.unlink()
    os.mkfifo(path)


def _log_line(run: Path, line: str) -> None:
    (run / "steps.jsonl").write_text(line + "\n" + (run / "steps.jsonl").read_text())


def report_path_is_the_step_log(run: Path, out: Path) -> None:
    """Nothing to damage: the command line aims the report at an input (see ARGV)."""


def report_path_is_a_symlink_into_the_run(run: Path, out: Path) -> None:
    (out / "link.json").symlink_to(run / "manifest.json")


def report_path_climbs_back_into_the_checkpoint(run: Path, out: Path) -> None:
    """Nothing to damage: ``CK/../step_00000010/x.json`` is inside the scanned folder."""


def markdown_over_the_saved_report(run: Path, out: Path) -> None:
    (run / SAVED).write_text("{}\n")


def html_inside_the_run(run: Path, out: Path) -> None:
    """Nothing to damage: the post-mortem's --html names a file in the run."""


def repair_out_inside_the_run(run: Path, out: Path) -> None:
    """Nothing to damage: repair's --out names a folder in the run."""


def bisect_report_inside_a_globbed_checkpoint(run: Path, out: Path) -> None:
    """Nothing to damage: bisect's targets are a glob, the report lands in one of the folders it matches."""


def fifo_step_log(run: Path, out: Path) -> None:
    _fifo(run / "steps.jsonl")


def fifo_manifest(run: Path, out: Path) -> None:
    _fifo(run / "manifest.json")


def fifo_batch(run: Path, out: Path) -> None:
    _fifo(run / "batches" / "step_00000012.safetensors")


def fifo_checkpoint_file(run: Path, out: Path) -> None:
    _fifo(run / MODEL)


def device_as_optimizer_state(run: Path, out: Path) -> None:
    """/dev/zero's twin in the run, made there as root; else a symlink to /dev/zero, which leaves the run."""
    (run / CK / "optimizer.safetensors").unlink()
    if os.geteuid() == 0:
        os.mknod(run / CK / "optimizer.safetensors", 0o666 | stat.S_IFCHR, os.makedev(1, 5))
    else:
        (run / CK / "optimizer.safetensors").symlink_to("/dev/zero")


def fifo_saved_report(run: Path, out: Path) -> None:
    os.mkfifo(run / SAVED)


def step_1e300(run: Path, out: Path) -> None:
    _log_line(run, '{"step": 1e300, "loss": 1.0}')


def step_infinity(run: Path, out: Path) -> None:
    _log_line(run, '{"step": Infinity, "loss": 1.0}')


def num_threads_two(run: Path, out: Path) -> None:
    _edit_manifest(run, num_threads="two")


def num_threads_negative(run: Path, out: Path) -> None:
    _edit_manifest(run, num_threads=-3)


def rng_not_base64(run: Path, out: Path) -> None:
    meta = json.loads((run / CK / "meta.json").read_text())
    meta["rng"]["torch"] = "not base64!"
    (run / CK / "meta.json").write_text(json.dumps(meta))


def deep_manifest(run: Path, out: Path) -> None:
    (run / "manifest.json").write_text(DEEP)


def deep_step_log(run: Path, out: Path) -> None:
    _log_line(run, DEEP)


def deep_batch_tree(run: Path, out: Path) -> None:
    path = run / "batches" / "step_00000012.safetensors"
    _header(path, lambda h: json.dumps({**h, "__metadata__": {**h["__metadata__"], "tree": DEEP}}).encode())


def shape_1e400(run: Path, out: Path) -> None:
    _header(run / MODEL, lambda h: json.dumps(h).replace('"shape": [', '"shape": [1e400, ', 1).encode())


def deep_safetensors_header(run: Path, out: Path) -> None:
    _header(run / MODEL, lambda h: json.dumps(h)[:-1].encode() + b', "deep": ' + DEEP.encode() + b"}")


def superscript_step_in_metadata(run: Path, out: Path) -> None:
    save_file({"w": torch.ones(2)}, run / "extra.safetensors", metadata={"step": "\u00b2"})


def step_of_5000_digits_in_a_pt_file(run: Path, out: Path) -> None:
    torch.save({"step": "9" * 5000, "w": torch.ones(2)}, run / "extra.pt")


def optimizer_factory_returns_no_optimizer(run: Path, out: Path) -> None:
    manifest = json.loads((run / "manifest.json").read_text())
    manifest["optimizer"]["factory"] = "hostile:not_an_optimizer"
    (run / "manifest.json").write_text(json.dumps(manifest))


def deep_saved_report(run: Path, out: Path) -> None:
    (run / SAVED).write_text(DEEP)


# The command line of the cases that name their own paths (the rest are command_line's), by damage.
ARGV: dict[Callable[[Path, Path], None], Callable[[Path, Path], list[str | Path]]] = {
    report_path_is_the_step_log: lambda run, out: ["replay", run, "--json", run / "steps.jsonl"],
    report_path_is_a_symlink_into_the_run: lambda run, out: ["replay", run, "--json", out / "link.json"],
    report_path_climbs_back_into_the_checkpoint:
        lambda run, out: ["scan", run / CK, "--json", run / CK / ".." / CK.name / "x.json"],
    markdown_over_the_saved_report: lambda run, out: ["report", run / SAVED, "--markdown", run / SAVED],
    html_inside_the_run: lambda run, out: ["postmortem", run, "--html", run / "report.html"],
    repair_out_inside_the_run: lambda run, out: ["repair", run, "--out", run / "repaired"],
    bisect_report_inside_a_globbed_checkpoint:
        lambda run, out: ["bisect", str(run / "checkpoints" / "step_*"), "--json", run / CK / "r.json"],
    fifo_saved_report: lambda run, out: ["report", run / SAVED, "--markdown", out / "report.md"],
    deep_saved_report: lambda run, out: ["report", run / SAVED, "--markdown", out / "report.md"],
    superscript_step_in_metadata: lambda run, out: ["scan", run / "extra.safetensors", "--json", out / "report.json"],
    step_of_5000_digits_in_a_pt_file: lambda run, out: ["scan", run / "extra.pt", "--json", out / "report.json"],
}


# ---- the table ------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Expect:
    outcome: str  # ERROR, WORKS or PARTIAL
    needles: tuple[str, ...] = ()  # in the error line (ERROR), in a failed analysis' detail (PARTIAL)


def error(*needles: str) -> Expect:
    return Expect(ERROR, needles)


def partial(*needles: str) -> Expect:
    return Expect(PARTIAL, needles)


@dataclass(frozen=True)
class Damage:
    apply: Callable[[Path, Path], None]
    expect: dict[str, Expect]  # by command: only the commands the damage means something to
    wrapper: tuple[str, ...] = ()
    kind: str = "damaged file"  # the class of fault, for the summary

    @property
    def name(self) -> str:
        return self.apply.__name__

    @property
    def process(self) -> bool:
        """Run as a process: the command under another user (``wrapper``), or given a special file, which a process
        that hung on it would show within run_cli's timeout."""
        return bool(self.wrapper) or self.kind == SPECIAL


_BAD_MODEL = ("model.safetensors",)
_FIFO = "not a regular file (a FIFO)"
OVER_INPUT, SPECIAL, ABSURD = "output over an input", "special file", "absurd number or deep nesting"
DAMAGES = [
    Damage(truncated_header, {c: error(*_BAD_MODEL, "truncated") for c in ("scan", "bisect", "replay")}
           | {"postmortem": partial(*_BAD_MODEL, "truncated")}),
    Damage(truncated_body, {c: error(*_BAD_MODEL, "truncated") for c in ("scan", "bisect", "replay", "repair")}
           | {"postmortem": partial(*_BAD_MODEL, "truncated")}),
    Damage(sizes_beyond_file, {c: error(*_BAD_MODEL, "fc2.weight") for c in ("scan", "bisect", "replay")}),
    Damage(huge_header_length, {c: error(*_BAD_MODEL, "header") for c in ("scan", "replay")}),
    Damage(wrong_dtype, {"replay": error(*_BAD_MODEL, "fc2.weight", "float16"),
                         "repair": error(*_BAD_MODEL, "fc2.weight", "float16")}),
    Damage(wrong_shape, {"replay": error(*_BAD_MODEL, "fc2.weight", "does not fit"),
                         "postmortem": partial(*_BAD_MODEL, "fc2.weight")}),
    Damage(missing_optimizer_state, {c: error("optimizer.safetensors", "missing")
                                     for c in ("scan", "bisect", "replay")}),
    Damage(malformed_manifest, {c: error("manifest.json", "not valid JSON") for c in ("bisect", "replay", "repair")}
           | {"postmortem": partial("manifest.json", "not valid JSON")}),
    Damage(future_manifest, {"replay": error("manifest.json", "newer"),
                             "postmortem": partial("manifest.json", "newer")}),
    Damage(manifest_missing_module, {c: error("manifest.json", "no_such_faults_module") for c in ("replay", "repair")}
           | {"postmortem": Expect(WORKS)}),  # checkpoint-only: test_postmortem checks how it is marked
    Damage(batches_missing_mid_window, {c: error("step_00000013.safetensors", "missing") for c in ("replay", "repair")}
           | {"postmortem": partial("step_00000013.safetensors", "missing")}),
    Damage(garbage_log_lines, {c: error("steps.jsonl", "line 6") for c in ("replay", "repair")}
           | {"postmortem": partial("steps.jsonl", "line 6")}),
    Damage(torn_last_line, {"replay": Expect(WORKS), "postmortem": Expect(WORKS)}),
    Damage(empty_directory, {"scan": error("run", "not a checkpoint folder"),
                             "bisect": error("run", "holds no checkpoints"),
                             "replay": error("manifest.json", "missing"), "repair": error("manifest.json", "missing"),
                             "postmortem": error("run", "nothing could be analysed")}),
    Damage(unreadable_directory, {c: error("run", "ermission denied") for c in ("scan", "bisect", "replay",
                                                                               "postmortem")},
           wrapper=NO_OVERRIDE),
    Damage(unwritable_output, {c: error("report.md") for c in ("scan", "bisect", "replay", "postmortem")}
           | {"repair": error("repaired", "not a directory")}),
    *(Damage(apply, {command: error(*needles)}, kind=OVER_INPUT) for apply, command, needles in [
        (report_path_is_the_step_log, "replay", ("--json", "steps.jsonl", "never writes into")),
        (report_path_is_a_symlink_into_the_run, "replay", ("--json", "link.json", "never writes into")),
        (report_path_climbs_back_into_the_checkpoint, "scan", ("--json", "x.json", "never writes into")),
        (markdown_over_the_saved_report, "report", ("--markdown", SAVED, "never writes over")),
        (html_inside_the_run, "postmortem", ("--html", "report.html", "never writes into")),
        (repair_out_inside_the_run, "repair", ("--out", "repaired", "never writes into")),
        (bisect_report_inside_a_globbed_checkpoint, "bisect", ("--json", "r.json", "never writes into")),
    ]),
    Damage(fifo_step_log, {"replay": error("steps.jsonl", _FIFO), "postmortem": partial("steps.jsonl", _FIFO)},
           kind=SPECIAL),
    Damage(fifo_manifest, {"replay": error("manifest.json", _FIFO)}, kind=SPECIAL),
    Damage(fifo_batch, {"replay": error("step_00000012.safetensors", _FIFO)}, kind=SPECIAL),
    Damage(fifo_checkpoint_file, {c: error(*_BAD_MODEL, _FIFO) for c in ("scan", "bisect")}, kind=SPECIAL),
    Damage(device_as_optimizer_state, {"scan": error("optimizer.safetensors", "not a regular file (a character device)"
                                                     if os.geteuid() == 0 else "leads outside")}, kind=SPECIAL),
    Damage(fifo_saved_report, {"report": error(SAVED, _FIFO)}, kind=SPECIAL),
    Damage(step_1e300, {"replay": error("steps.jsonl", "line 1: step 1e+300"),
                        "postmortem": partial("steps.jsonl", "line 1: step 1e+300")}, kind=ABSURD),
    Damage(step_infinity, {"replay": error("steps.jsonl", "line 1: step inf")}, kind=ABSURD),
    Damage(num_threads_two, {"replay": error("manifest.json", "num_threads 'two'")}, kind=ABSURD),
    Damage(num_threads_negative, {"replay": error("manifest.json", "num_threads -3")}, kind=ABSURD),
    Damage(rng_not_base64, {"replay": error("meta.json", "rng.torch")}, kind=ABSURD),
    Damage(deep_manifest, {"replay": error("manifest.json", "nested too deeply")}, kind=ABSURD),
    Damage(deep_step_log, {"replay": error("steps.jsonl", "line 1")}, kind=ABSURD),
    Damage(deep_batch_tree, {"replay": error("step_00000012.safetensors", "tree", "nested too deeply")}, kind=ABSURD),
    Damage(shape_1e400, {"scan": error(*_BAD_MODEL, "shape [inf")}, kind=ABSURD),
    Damage(deep_safetensors_header, {"scan": error(*_BAD_MODEL, "nested too deeply")}, kind=ABSURD),
    Damage(superscript_step_in_metadata, {"scan": error("extra.safetensors", "step '²'")}, kind=ABSURD),
    Damage(step_of_5000_digits_in_a_pt_file, {"scan": error("extra.pt", "step '9999")}, kind=ABSURD),
    Damage(optimizer_factory_returns_no_optimizer, {"replay": error("manifest.json", "optimizer.factory",
                                                                    "not a torch.optim.Optimizer")}, kind=ABSURD),
    Damage(deep_saved_report, {"report": error(SAVED, "nested too deeply")}, kind=ABSURD),
]
CASES = [pytest.param(d, command, id=f"{d.name}-{command}") for d in DAMAGES for command in d.expect]


def command_line(damage: Damage, command: str, run: Path, out: Path) -> list[str | Path]:
    """The command over the damaged run (scan: its start checkpoint, or the run folder when none is left)."""
    if damage.apply in ARGV:
        return ARGV[damage.apply](run, out)
    reports: list[str | Path] = ["--json", out / "report.json"]
    if command == "repair":
        return ["repair", run, "--out", out / "repaired", *reports]
    target = run / CK if command == "scan" and (run / CK).is_dir() else run
    return [command, target, *reports, "--markdown", out / "report.md"]


@dataclass
class Outcome:
    result: Result
    untouched: bool  # the input directory byte-identical afterwards
    json_report: str  # the --json path's content afterwards
    markdown_written: bool


def _attempt(recorded: Path, root: Path, damage: Damage, command: str) -> Outcome:
    run, out = root / "run", root / "out"
    shutil.copytree(recorded, run)
    out.mkdir()
    (out / "report.json").write_text(EARLIER)
    damage.apply(run, out)
    before = tree_digest(run)
    result = run_cli(*command_line(damage, command, run, out), wrapper=damage.wrapper, process=damage.process)
    for folder in (run, run / CK):  # the digest reads as root; the checks need the folders back to their modes
        if folder.exists():
            folder.chmod(0o755)
    return Outcome(result, tree_digest(run) == before, (out / "report.json").read_text(),
                   (out / "report.md").is_file())


@pytest.fixture(scope="module")
def recorded(runs: Mapping[str, Path]) -> Path:
    """The session's recorded run of the scenario (recorded once, when a module first asks): each case damages a copy."""
    return runs[SCENARIO]


@pytest.fixture(scope="module")
def outcomes(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory,
             recorded: Path) -> dict[str, Outcome]:
    """Every case collected in this session: the processes concurrently (most of each is importing torch), the
    in-process calls meanwhile on this thread."""
    wanted = [item.callspec.params for item in request.session.items
              if item.module is request.module and hasattr(item, "callspec") and "damage" in item.callspec.params]
    with ThreadPoolExecutor(max_workers=os.cpu_count() or 2) as pool:
        futures = {f"{p['damage'].name}-{p['command']}": pool.submit(
            _attempt, recorded, tmp_path_factory.mktemp("case"), p["damage"], p["command"])
            for p in wanted if p["damage"].process}
        done = {f"{p['damage'].name}-{p['command']}": _attempt(recorded, tmp_path_factory.mktemp("case"), p["damage"],
                                                               p["command"])
                for p in wanted if not p["damage"].process}
        return done | {key: future.result() for key, future in futures.items()}


@pytest.mark.parametrize("damage, command", CASES)
def test_damaged_input(outcomes: dict[str, Outcome], damage: Damage, command: str,
                       record_property: Callable[[str, object], None]) -> None:
    record_property(FAULT_CASE, (command, damage.kind))  # conftest's summary counts them by command and class
    o, expect = outcomes[f"{damage.name}-{command}"], damage.expect[command]
    r = o.result
    assert "Traceback" not in r.stderr and "NANFORENSICS_DEBUG" not in r.stderr, r.stderr
    assert o.untouched, "the command changed the directory it examined"
    if expect.outcome == ERROR:
        assert r.code == 2, (r.code, r.stderr, r.stdout[-2000:])
        [line] = error_lines(r.stderr) or [""]
        assert line.startswith("nanforensics: error: "), r.stderr
        for needle in expect.needles:
            assert needle in line, (needle, line)
        assert o.json_report == EARLIER and not o.markdown_written, "a failed command wrote a report"
    else:
        assert r.code in (0, 1, 3), (r.code, r.stderr)
        report = json.loads(o.json_report)
        if command == "replay":
            assert report["responsible_step"] == DEFECT_STEP
        if expect.outcome == WORKS and command == "postmortem":
            assert report["verdict"] == "nonfinite", report["headline"]
        if expect.outcome == PARTIAL:
            assert report["responsible_step"] is None and report["window"] is not None, report["headline"]
            failed = [a["detail"] for a in report["analyses"] if a["status"] == "failed"]
            assert any(all(n in d for n in expect.needles) for d in failed), report["analyses"]


# ---- the readers under random corruption of a valid checkpoint file -------------------------------------


@pytest.fixture(scope="module")
def model_file(recorded: Path) -> bytes:
    """A recorded checkpoint's model.safetensors, as bytes."""
    return (recorded / MODEL).read_bytes()


@contextmanager
def time_limit(seconds: float) -> Iterator[None]:
    """A hang becomes a test failure (hypothesis' deadline only measures examples that finish)."""
    def expire(signum: int, frame: object) -> None:
        raise TimeoutError(f"a reader ran past {seconds} s")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


_edits = st.lists(st.tuples(st.one_of(st.integers(0, 800), st.integers(0, 1 << 20)), st.binary(min_size=1, max_size=8)),
                  min_size=1, max_size=4)


@settings(max_examples=300, deadline=2000, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(edits=_edits, keep=st.one_of(st.none(), st.integers(0, 1 << 20)))
def test_corrupt_checkpoint_is_bad_input_or_readable(tmp_path: Path, model_file: bytes,
                                                     edits: list[tuple[int, bytes]], keep: int | None) -> None:
    data = bytearray(model_file)
    for position, junk in edits:  # the header is the first ~550 bytes: half the edits land in it
        position %= len(data)
        data[position:position + len(junk)] = junk
    path = tmp_path / "model.safetensors"
    path.write_bytes(bytes(data[:keep]) if keep is not None else bytes(data))
    readers: list[Callable[[], object]] = [
        lambda: TensorFile(path).load_all(),
        lambda: [f.read(e) for f in [SafetensorsFile(path)] for e in f.entries],
        lambda: scan_checkpoint(open_checkpoint(path), full=True),
    ]
    for read in readers:
        try:
            with time_limit(10):
                read()
        except BadInput as e:
            assert "model.safetensors" in str(e) and "\n" not in str(e)


# ---- hostile inputs the readers meet outside a run: Hugging Face folders, sockets, outputs through hard links ----


@pytest.mark.parametrize("state, needles", [
    ('{"global_step": "\u00b2"}', ("global_step '²'", "not a step number")),
    ('{"global_step": "' + "9" * 5000 + '"}', ("global_step '999", "not a step number")),
    ('{"global_step": 1e300}', ("global_step 1e+300",)),
    (DEEP, ("nested too deeply",)),
    (None, ("not a regular file (a FIFO)",)),
], ids=["superscript", "5000-digits", "1e300", "deep", "fifo"])
def test_trainer_state_is_bad_input_naming_file_and_field(tmp_path, state, needles):
    save_file({"w": torch.ones(2)}, tmp_path / "model.safetensors")
    path = tmp_path / "trainer_state.json"
    if state is None:
        os.mkfifo(path)
    else:
        path.write_text(state)
    with time_limit(10), pytest.raises(BadInput) as refused:
        open_checkpoint(tmp_path)
    message = str(refused.value)
    assert message.startswith(f"{path}: ") and "\n" not in message and all(n in message for n in needles), message


def test_a_socket_is_not_a_step_log(tmp_path):
    import socket

    from nanforensics.runs.steplog import read_steps

    path = tmp_path / "steps.jsonl"
    with socket.socket(socket.AF_UNIX) as server:
        server.bind(str(path))
        with time_limit(10), pytest.raises(BadInput, match="not a regular file \\(a socket\\)"):
            read_steps(path)


def test_outputs_through_hard_links_and_the_step_summary_are_refused(tmp_path):
    from nanforensics.outputs import check_outputs

    run, saved = tmp_path / "run", tmp_path / "saved.json"
    run.mkdir()
    saved.write_text("{}")
    os.link(saved, tmp_path / "alias.json")  # the same file under another name: an append would change the input
    with pytest.raises(BadInput, match="alias.json is .*saved.json, an input"):
        check_outputs([saved], {"--markdown": str(tmp_path / "alias.json")})
    with pytest.raises(BadInput, match="GITHUB_STEP_SUMMARY.*never writes into"):
        check_outputs([run], {"$GITHUB_STEP_SUMMARY": str(run / "summary.md")})
    with pytest.raises(BadInput, match="--json.*lies inside --out"):
        check_outputs([run], {"--out": str(tmp_path / "out"), "--json": str(tmp_path / "out" / "r.json")},
                      folders=("--out",))
    check_outputs([run, saved], {"--json": str(tmp_path / "report.json"), "--markdown": "-", "--html": None})



@pytest.mark.parametrize("loss", ["1" + "0" * 400, "-" + "9" * 400])
def test_a_logged_loss_no_float_holds_is_a_bad_record(tmp_path, loss):
    """An integer beyond a float's range where a loss is (found by the fuzzer in an incident's steps.jsonl: it reached
    ``float()`` and the catch-all): ``decode_float``, the decoder every reader of logged numbers calls (steps,
    micro-batch losses, meta.json's tagged floats), says a bad number, and the reader names the file and line."""
    from nanforensics.finite import decode_float
    from nanforensics.runs.steplog import read_steps

    with pytest.raises(ValueError, match="beyond a float's range"):
        decode_float(int(loss))
    path = tmp_path / "steps.jsonl"
    path.write_text(f'{{"step": 0, "loss": 0.5}}\n{{"step": 1, "loss": {loss}}}\n')
    with pytest.raises(BadInput) as refused:
        read_steps(path)
    message = str(refused.value)
    assert message.startswith(f"{path}: line 2 is not a step record") and "\n" not in message, message


BAD_TAGS = {"float not a number": {"$float": "bogus"}, "float of a list": {"$float": [1]},
            "tensor by number": {"$tensor": 5}}
TAGGED_PLACES = ("param_groups", "state_scalars", "scaler")


@pytest.mark.parametrize("place", TAGGED_PLACES)
@pytest.mark.parametrize("tag", sorted(BAD_TAGS))
def test_a_tag_in_meta_json_that_does_not_decode_is_a_one_line_error(tmp_path, recorded, place, tag):
    """meta.json's ``{"$float"}``/``{"$tensor"}`` tags have one reader (``state_from_json``), which names the file:
    a scaler's bad ``$float`` once reached the catch-all as "ValueError: bad number" without a file."""
    ck = tmp_path / "ck"
    shutil.copytree(recorded / "checkpoints" / "step_00000010", ck)
    meta = json.loads((ck / "meta.json").read_text())
    bad = BAD_TAGS[tag]
    if place == "param_groups":
        meta["param_groups"][0]["lr"] = bad
    elif place == "state_scalars":
        meta["state_scalars"] = {meta["param_names"][0]: {"extra": [0.5, bad]}}
    else:
        meta["scaler"] = {"scale": bad, "growth_factor": 2.0, "backoff_factor": 0.5, "growth_interval": 2000,
                          "_growth_tracker": 0}
    (ck / "meta.json").write_text(json.dumps(meta))
    result = run_cli("scan", ck)
    assert result.code == 2, (result.code, result.stdout, result.stderr)
    lines = error_lines(result.stderr)
    assert len(lines) == 1 and "meta.json" in lines[0] and "Traceback" not in result.stderr, result.stderr


def test_the_tag_writer_and_reader_round_trip_without_tensors(tmp_path):
    """Hyperparameters and state scalars (no extras file): a tensor is kept inline (its bytes, dtype and shape), inf
    and nan as tags, and a tensor reference is refused where the writer never puts one."""
    from nanforensics.runs.checkpoint import state_from_json, state_to_json

    state = {"lr": torch.tensor(0.5), "betas": (0.9, 0.999), "prev_loss": math.nan, "bound": [-math.inf, 1]}
    written = json.loads(json.dumps(state_to_json(state, None, "g"), allow_nan=False))
    back = state_from_json(written, None, tmp_path / "meta.json")
    assert back["lr"].dtype == torch.float32 and back["lr"].shape == () and back["lr"].item() == 0.5
    assert back["betas"] == [0.9, 0.999] and math.isnan(back["prev_loss"])
    assert back["bound"] == [-math.inf, 1]
    with pytest.raises(BadInput, match="meta.json: refers to a tensor where the recorder writes plain numbers"):
        state_from_json({"x": {"$tensor": "x"}}, None, tmp_path / "meta.json")
