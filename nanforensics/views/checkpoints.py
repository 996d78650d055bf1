"""Views of ScanReport and BisectReport: rich for the terminal, Markdown for CI summaries and issues."""

from __future__ import annotations

from typing import Any, Sequence

from rich.console import Console
from rich.table import Table

from ..checkpoints.bisect import BisectReport, CheckpointRef, ScanRecord
from ..checkpoints.scan import (
    BY_NAME,
    CLEAN,
    POISONED_BUFFERS,
    POISONED_PARAMETERS,
    POISONED_STATE,
    ScanReport,
    TensorScan,
)
from ..formats import MODEL
from ..words import count
from . import replay
from .escaping import markup
from .layout import print_whole

SHOWN = 20  # tensors listed per table; the JSON report has all of them

_SCAN_VERDICT = {
    CLEAN: ("bold white on green", "CLEAN"),
    POISONED_PARAMETERS: ("bold white on red", "POISONED PARAMETERS"),
    POISONED_STATE: ("bold black on yellow", "POISONED OPTIMIZER STATE"),
    POISONED_BUFFERS: ("bold black on yellow", "POISONED BUFFERS"),
}
_BISECT_VERDICT = {
    "clean": ("bold white on green", "CLEAN"),
    "poisoned": ("bold white on red", "POISONED"),
    "non_monotonic": ("bold black on yellow", "NON-MONOTONIC"),
}
_MEANING = {
    CLEAN: "every tensor read is finite",
    POISONED_PARAMETERS: "the model's parameters hold non-finite values",
    POISONED_STATE: "optimizer state only: the parameters are still finite, but the next step reads this state "
                    "and goes non-finite (a NaN moment) or freezes those coordinates (an infinite second moment)",
    POISONED_BUFFERS: "buffers only (BatchNorm's running statistics, say): the parameters are finite, but these persist "
                      "into every later step, and eval mode (evaluation, inference) reads BatchNorm's",
}
_TENSOR_HEADERS = ["tensor", "group", "dtype", "shape", "non-finite", "first at", "max |x| / limit"]
_READ_HEADERS = ["#", "step", "checkpoint", "layout", "verdict", "bytes"]
_GROUP_HEADERS = ["group", "tensors", "read", "bytes", "non-finite tensors", "non-finite values", "near limit"]


def _step(step: int | None, source: str | None = None) -> str:
    if step is None:
        return "step unknown"
    return f"step {step}" + (f" from its {source}" if source else "")


def _layout(r: ScanReport) -> str:
    return f"layout {r.format}, {_step(r.step, r.step_source)}"


def _ref(ref: CheckpointRef | None) -> str:
    return "none" if ref is None else f"{_step(ref.step)}  {ref.path}"


def _group_rows(r: ScanReport) -> list[list[str]]:
    return [[name, str(g.tensors), str(g.read), f"{g.bytes:,}", str(g.nonfinite_tensors), str(g.nonfinite_values),
             str(g.near_limit)] for name, g in r.groups.items()]


def _tensor_row(t: TensorScan) -> list[str]:
    first = f"{t.first_nonfinite.index} = {t.first_nonfinite.value}" if t.first_nonfinite else "-"
    peak = "-" if t.max_abs is None or t.dtype_max is None else f"{t.max_abs:.3g} / {t.dtype_max:.3g}"
    group = "buffer" if t.buffer else t.group
    return [t.name, group, t.dtype, str(t.shape), str(t.nonfinite) if t.checked else "unchecked", first, peak]


def _notable(tensors: Sequence[TensorScan]) -> tuple[list[TensorScan], list[TensorScan]]:
    return [t for t in tensors if t.nonfinite], [t for t in tensors if t.near_limit and not t.nonfinite]


def _split_note(r: ScanReport) -> list[str]:
    """When a tensor counted as a parameter might be a buffer: the format does not say which is which."""
    unsure = [t.name for t in r.tensors if t.nonfinite and t.group == MODEL and t.buffer is None]
    if r.buffer_split != BY_NAME or not unsure:
        return []
    counted = "counted as a parameter, but may be a buffer" if len(unsure) == 1 else \
        "counted as parameters, but may be buffers"
    return [f"This format does not record which model tensors are buffers: {', '.join(unsure[:3])}"
            f"{' ...' if len(unsure) > 3 else ''} {counted} (only BatchNorm's running statistics are recognised by "
            "name)."]


def _scan_notes(r: ScanReport) -> list[str]:
    """The notes, then the verdict last: the line a CI log ends on, as pytest's summary is."""
    notes = _split_note(r)
    if not r.complete:
        notes.append("Stopped at the first non-finite tensor; --full reads and counts every tensor.")
    _, near = _notable(r.tensors)
    if near:
        notes.append(f"{count(len(near), 'finite tensor')} within a factor {r.margin:g} of their dtype's largest value: "
                     "a precursor of overflow.")
    return notes + _skipped_notes(r.skipped) + _soundness_notes(r) + [f"Verdict: {_meaning(r)}."]


def _meaning(r: ScanReport) -> str:
    if r.verdict == CLEAN and r.unsound:
        return (f"every tensor read is finite, but the optimizer state is unsound ({count(len(r.unsound), 'finding')}): "
                "a run resumed from it may go non-finite at its first updates")
    return _MEANING[r.verdict]


def _label(r: ScanReport) -> tuple[str, str]:
    return ("bold black on yellow", "UNSOUND OPTIMIZER STATE") if r.verdict == CLEAN and r.unsound else \
        _SCAN_VERDICT[r.verdict]


def _soundness_notes(r: ScanReport) -> list[str]:
    """What the optimizer state was checked as beyond finiteness, what could not be, and each finding."""
    if r.soundness is None:
        return ["Optimizer state not checked beyond finiteness: the scan stopped at a non-finite tensor."] \
            if r.verdict != CLEAN else []
    kinds = sorted(set(r.soundness.optimizers))
    notes = [f"Optimizer state checked beyond finiteness as {'; '.join(kinds)}."] if kinds else []
    notes += [f"Not checked: {n}." for n in r.soundness.notes]
    notes += [f"Unsound ({u.check}): {u.message}." for u in r.unsound[:SHOWN]]
    if len(r.unsound) > SHOWN:
        notes.append(f"... and {len(r.unsound) - SHOWN} more unsound findings (every one in the JSON report).")
    return notes


def _skipped_notes(skipped: list[str]) -> list[str]:
    """Files left unread, each named: a partial read must not look like a clean one."""
    return [f"Not read: {s}." for s in skipped]


def _bisect_notes(r: BisectReport) -> list[str]:
    how = "the step in their metadata" if r.order == "metadata" else "the number in their names"
    mode = "linear" if r.mode == "linear" else f"bisection, at most {r.max_scans}"
    notes = [f"{count(r.checkpoints, 'checkpoint')} ordered by {how}; {r.scans} read ({mode})."]
    if r.first_poisoned_verdict:
        notes.append(f"First poisoned: {_MEANING[r.first_poisoned_verdict]}.")
    if r.first_poisoned_scan is not None:
        notes += _split_note(r.first_poisoned_scan)
    if r.first_poisoned is not None and r.last_clean is not None:
        notes.append(f"The first non-finite value arose between {_step(r.last_clean.step)} and "
                     f"{_step(r.first_poisoned.step)}.")
    for nm in r.non_monotonic:
        notes.append(f"Not monotonic: {_step(nm.clean_after.step)} ({nm.clean_after.path}) is clean after poisoned "
                     f"{_step(nm.poisoned.step)}: a restart or a manual repair? Non-finite values are absorbing, so "
                     "bisection cannot be trusted here" + ("." if r.mode == "linear" else "; --linear reads them all."))
    if r.verdict == "clean" and r.mode == "bisect" and r.scans < r.checkpoints:
        notes.append("Only the first and last were read: absorption makes the ones between clean too, unless the run "
                     "was repaired in between (--linear reads them all).")
    unsound = [rec for rec in r.history if rec.unsound]
    if unsound:
        notes.append("Finite but unsound optimizer state (`nanforensics scan` says what): " + ", ".join(
            f"{_step(rec.step)} ({count(rec.unsound, 'finding')})" for rec in unsound) + ".")
    if r.replay_unavailable:
        notes.append(f"No replay: {r.replay_unavailable}.")
    notes += _skipped_notes(r.skipped)
    notes += _skipped_notes([f"{rec.path}/{s}" for rec in r.history for s in rec.skipped])
    return notes


def render_scan_terminal(r: ScanReport, console: Console) -> None:
    style, label = _label(r)
    print_whole(console, f"[{style}] {label} [/] {markup(r.path)}  [dim]{markup(_layout(r))}[/]")
    groups = Table(box=None, pad_edge=False)
    for h in _GROUP_HEADERS:
        groups.add_column(h, justify="left" if h == "group" else "right")
    for row in _group_rows(r):
        groups.add_row(*map(markup, row))
    print_whole(console, groups)
    _terminal_tensors(r.tensors, console)
    for note in _scan_notes(r):
        console.print(markup(note), soft_wrap=True)


def _terminal_tensors(tensors: Sequence[TensorScan], console: Console) -> None:
    for title, rows in zip(("non-finite", "near the dtype's limit"), _notable(tensors)):
        if not rows:
            continue
        table = Table(title=f"{title} ({len(rows)})", title_justify="left", box=None, pad_edge=False)
        for h in _TENSOR_HEADERS:  # identifiers and numbers: never wrapped or cut, the row runs on instead
            table.add_column(h, no_wrap=True)
        for t in rows[:SHOWN]:
            table.add_row(*map(markup, _tensor_row(t)))
        print_whole(console, table)
        if len(rows) > SHOWN:
            console.print(f"[dim]... and {len(rows) - SHOWN} more (every one in --json)[/]")


def render_bisect_terminal(r: BisectReport, console: Console, offer_replay: bool = False) -> None:
    """``offer_replay``: the bisect command without --replay, which that option would make replay the window."""
    style, label = _BISECT_VERDICT[r.verdict]
    print_whole(console, f"[{style}] {label} [/] first poisoned: {markup(_ref(r.first_poisoned))}")
    print_whole(console, f"{' ' * (len(label) + 2)} last clean:    {markup(_ref(r.last_clean))}")
    reads = Table(title="checkpoints read", title_justify="left", box=None, pad_edge=False)
    for h in _READ_HEADERS:
        reads.add_column(h)
    for n, rec in _history_rows(r):
        if rec is None:
            reads.add_row("", "", f"[dim]... {n} more like the rows around[/]", "", "", "")
        else:
            reads.add_row(str(n), str(rec.step), *map(markup, (rec.path, rec.format, rec.verdict)), f"{rec.bytes_read:,}")
    print_whole(console, reads)
    _terminal_tensors(r.poisoned_tensors, console)
    for note in _bisect_notes(r):
        console.print(markup(note), soft_wrap=True)
    if r.replay:
        console.print(f"Replay the window: [bold]{markup(r.replay.command)}[/]"
                      + ("  (or add --replay)" if offer_replay else ""), soft_wrap=True)
    if r.replayed is not None:
        replay.render_terminal(r.replayed, console)


def _history_rows(r: BisectReport) -> list[tuple[int, ScanRecord | None]]:
    """Reads in order, with long runs of one verdict (a linear scan) cut to their ends: (n, None) stands for n rows."""
    rows: list[tuple[int, ScanRecord | None]] = []
    run: list[tuple[int, ScanRecord]] = []
    for n, rec in [*enumerate(r.history, 1), (0, None)]:
        if rec is not None and run and rec.verdict == run[-1][1].verdict:
            run.append((n, rec))
            continue
        rows += run if len(run) <= 4 else [run[0], (len(run) - 2, None), run[-1]]
        run = [(n, rec)] if rec is not None else []
    return rows


def tensor_tables(tensors: Sequence[TensorScan]) -> list[tuple[str, int, list[list[str]], int]]:
    """(title, how many, the rows shown, how many more) for the non-finite tensors and those near their limit."""
    return [(title, len(rows), [_tensor_row(t) for t in rows[:SHOWN]], max(0, len(rows) - SHOWN))
            for title, rows in zip(("Non-finite tensors", "Near the dtype's limit"), _notable(tensors)) if rows]


def scan_parts(r: ScanReport) -> dict[str, Any]:
    """What the Markdown view of a scan shows, as text (views/markdown.py escapes it)."""
    return {"label": _label(r)[1], "layout": _layout(r), "group_headers": _GROUP_HEADERS, "groups": _group_rows(r),
            "tensor_headers": _TENSOR_HEADERS, "tensor_tables": tensor_tables(r.tensors), "notes": _scan_notes(r)}


def bisect_parts(r: BisectReport) -> dict[str, Any]:
    """What the Markdown view of a bisection shows; a history row of None stands for ``n`` rows left out."""
    return {"label": _BISECT_VERDICT[r.verdict][1], "first_poisoned": _ref(r.first_poisoned),
            "last_clean": _ref(r.last_clean), "read_headers": _READ_HEADERS,
            "history": [(n, rec, f"{rec.bytes_read:,}" if rec else "") for n, rec in _history_rows(r)],
            "tensor_headers": _TENSOR_HEADERS, "tensor_tables": tensor_tables(r.poisoned_tensors),
            "notes": _bisect_notes(r)}
