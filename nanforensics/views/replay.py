"""Two views of a ReplayReport: rich for the terminal, Markdown for CI summaries and issues."""

from __future__ import annotations

import math
from typing import Any

from rich.console import Console, Group
from rich.panel import Panel
from rich.table import Table
from rich.text import Text
from rich.tree import Tree

from ..finite import worst
from ..report import AmpReport, DataDefect, Event, ReplayReport, StepRecord, WhatIfResult
from ..rootcause.findings import step_not_data
from ..words import count, numbered, sample_positions, span
from . import heatmap
from .escaping import markup, visible
from .layout import print_whole

_VERDICT = {
    "nonfinite": ("bold white on red", "NON-FINITE"),
    "clean": ("bold white on green", "CLEAN"),
    "not_reproduced": ("bold black on yellow", "NOT REPRODUCED"),
    "loss_only": ("bold black on yellow", "LOSS ONLY"),
}


def loss_text(x: float | None) -> str:
    if x is None:
        return "-"
    return f"{x:.6g}" if math.isfinite(x) else str(x)


def _leaf_text(value: Any) -> str:
    if isinstance(value, list) and len(value) > 4:
        return f"{value[0]} ... {value[-1]} ({len(value)})"
    return str(value)


_BARS = "▁▂▃▄▅▆▇█"
TREND_WIDTH = 60  # characters of a sparkline where no console says the width (Markdown)
CHAIN_STEPS = (3, 2)  # steps of the propagation chain shown before and after the elided middle of a long one
SPREAD_ROWS = (6, 5)  # rows of the spread table shown before and after the elided middle of a long one


def resample(values: list[float | None], width: int) -> list[float | None]:
    """At most ``width`` values: consecutive ones merged by ``finite.worst``, each character standing for as many
    steps (a non-finite value wins its character: that is what the line is for)."""
    if len(values) <= width:
        return values
    per = math.ceil(len(values) / max(1, width))
    return [worst(values[i:i + per]) for i in range(0, len(values), per)]


def sparkline(values: list[float | None], width: int = TREND_WIDTH) -> str:
    """Log-scale sparkline of at most ``width`` characters; a non-finite value is '!', a missing one a space."""
    values = resample(values, width)
    finite = [abs(v) for v in values if v is not None and math.isfinite(v) and v != 0]
    lo, hi = (math.log10(min(finite)), math.log10(max(finite))) if finite else (0.0, 0.0)
    out = []
    for v in values:
        if v is None:
            out.append(" ")
        elif not math.isfinite(v):
            out.append("!")
        elif v == 0 or hi == lo:
            out.append(_BARS[0])
        else:
            out.append(_BARS[round((math.log10(abs(v)) - lo) / (hi - lo) * (len(_BARS) - 1))])
    return "".join(out)


def precursor_rows(r: ReplayReport) -> list[tuple[str, list[float | None]]]:
    """(metric, value per replayed precursor step) for every metric the report has."""
    p = r.precursors
    rows: list[tuple[str, list[float | None]]] = [("learning rate", [x.learning_rate for x in p])] if any(
        x.learning_rate is not None for x in p) else []
    rows += [("grad norm", [x.grad_norm for x in p]), ("max |grad|", [x.grad_max_abs for x in p]),
             ("max |update|", [x.update_max_abs for x in p])]
    for key in sorted({k for x in p for k in x.state_max_abs}):
        rows.append((f"max |{key}|", [x.state_max_abs.get(key) for x in p]))
    dtype = next((x.activation_dtype for x in p if x.activation_dtype), "")
    rows.append((f"max |activation| ({dtype})", [x.activation_max_abs for x in p]))
    return rows


def last_finite(values: list[float | None]) -> str:
    v = next((v for v in reversed(values) if v is not None and math.isfinite(v)), None)
    return "-" if v is None else f"{v:.3g}"


def spread_rows(r: ReplayReport) -> tuple[list[StepRecord], int, list[StepRecord]]:
    """From the step before the origin (the clean steps before it are all zeros): the first rows, how many are
    elided in the middle of a long table, the last rows."""
    start = (r.responsible_step - 1) if r.responsible_step is not None else r.loss_only_steps[0] - 1 \
        if r.loss_only_steps else r.spread[-1].step - 2 if r.spread else 0
    return elided([s for s in r.spread if s.step >= start], *SPREAD_ROWS)


def spread_columns(buffers: bool) -> list[str]:
    """The spread table's columns; the buffers' only where the run has any."""
    return ["step", "logged loss", "replayed loss", "parameters", "optimizer state"] + ["buffers"] * buffers


def spread_cells(x: StepRecord, buffers: bool, grouped: bool) -> list[str]:
    """One step of the spread table: its losses, then non-finite of total per group (``grouped``: 1,649 not 1649)."""
    number = "{:,}" if grouped else "{}"
    counts = [(x.params_nonfinite, x.params_total), (x.state_nonfinite, x.state_total)] + \
        [(x.buffers_nonfinite, x.buffers_total)] * buffers
    return [str(x.step), loss_text(x.logged_loss), loss_text(x.replayed_loss)] + \
        [f"{number.format(bad)}/{number.format(total)}" for bad, total in counts]


def elided(items: list[Any], head: int, tail: int) -> tuple[list[Any], int, list[Any]]:
    """(the first ``head`` items, how many are left out, the last ``tail``), or (all, 0, []) when they fit."""
    if len(items) <= head + tail + 1:
        return items, 0, []
    return items[:head], len(items) - head - tail, items[-tail:]


def left_out(n: int, noun: str) -> str:
    return f"... {count(n, noun)} more (every one in the JSON report)"


def counts(e: Event) -> str:
    """``220 values in 3 tensors``; empty for a single value."""
    if e.tensors_nonfinite <= 1 and e.elements_nonfinite <= 1:
        return ""
    return f"{count(e.elements_nonfinite, 'value')} in {count(e.tensors_nonfinite, 'tensor')}"


def counts_suffix(e: Event) -> str:
    text = counts(e)
    return f"  ({text})" if text else ""


def batch_label(r: ReplayReport) -> str:
    return "batch (not the cause)" if step_not_data(r) else "responsible batch"


_DEFECT = {"nonfinite": "non-finite", "extreme": "extreme", "subnormal": "subnormal"}
DEFECTS_SHOWN = 5


def defect_lines(defects: list[DataDefect]) -> list[str]:
    """One line per data defect, the first ``DEFECTS_SHOWN``, then how many more the JSON holds."""
    out = [f"step {d.step}{shard_text(d.rank)}  {d.tensor}[{', '.join(map(str, d.index))}] = {d.value}  {_DEFECT[d.kind]} "
           f"({count(d.count, 'such value')})" for d in defects[:DEFECTS_SHOWN]]
    more = len(defects) - DEFECTS_SHOWN
    return out + ([f"... and {more} more (every one in the JSON report)"] if more > 0 else [])


def loaded_rows(r: ReplayReport) -> list[tuple[str, str]]:
    """(label, text) for a checkpoint the recorder did not write: what was loaded, and how."""
    c = r.loaded
    if c is None:
        return []
    optimizer = f"optimizer matched by {c.optimizer_matched} ({c.optimizer_params} parameters)"
    rng = f"RNG {', '.join(c.rng_restored)} restored" if c.rng_restored else "RNG not restored"
    return [("checkpoint", f"{c.checkpoint}  ({c.layout}; the state before step {c.step}; {optimizer}; {rng})"),
            ("batches", f"{c.batches}(step)")]


def world_text(r: ReplayReport) -> str:
    """``, 2 ranks (ddp, emulated)`` for a distributed run, ``, 4 ranks (fsdp2 on mesh dp=2 x tp=2, torchrun)`` on a
    DeviceMesh; nothing for a single process."""
    s = r.setup
    mesh = "" if s.mesh_shape is None or s.mesh_dim_names is None else \
        " on mesh " + " x ".join(f"{name}={size}" for name, size in zip(s.mesh_dim_names, s.mesh_shape))
    return f", {s.world_size} ranks ({s.wrapping}{mesh}, {s.ranks_replayed})" if s.world_size is not None else ""


def shard_text(rank: int | None, r: ReplayReport | None = None, owner: str | None = None) -> str:
    """Whose part of the batch: a rank's shard (``owner``, the rank in the report's words, where it has them), or a
    pipeline's micro-batch."""
    if r is not None and r.pipeline is not None:
        return r.pipeline.batch_text
    return f", {owner or f'rank {rank}'}'s shard" if rank is not None else ""


def origin_text(r: ReplayReport) -> str:
    """The origin, and for a pipeline the stage and micro-batch it arose in."""
    assert r.origin is not None
    return r.origin.text + (f" ({r.pipeline.text})" if r.pipeline is not None else "")


RANK_COLUMNS = ("rank", "logged loss first non-finite", "replay differs from step", "logged there", "replayed there")


def rank_rows(r: ReplayReport) -> list[tuple[str, ...]]:
    return [(str(c.rank), "-" if c.logged_first_nonfinite_loss_step is None else str(c.logged_first_nonfinite_loss_step),
             "-" if c.diverged_at_step is None else str(c.diverged_at_step), loss_text(c.logged_loss), loss_text(c.replayed_loss))
            for c in r.ranks]


WHATIF_COLUMNS = ("change", "stays finite", "first non-finite", "NaN loss at", "loss trend")


def whatif_rows(results: list[WhatIfResult]) -> list[tuple[str, ...]]:
    return [("as recorded" if w.intervention == "none" else w.intervention, "yes" if w.finite else "no",
             "-" if w.finite else f"step {w.first_nonfinite_step}: {w.first_nonfinite}",
             "-" if w.first_nonfinite_loss_step is None else str(w.first_nonfinite_loss_step),
             sparkline(w.losses)) for w in results]


def whatif_details(results: list[WhatIfResult]) -> list[str]:
    return [f"{w.intervention}: {w.detail}" for w in results if w.detail]


def whatif_title(results: list[WhatIfResult]) -> str:
    w = results[0]
    return f"what-if: step {w.step} changed, each replayed from the checkpoint, checked through step {w.last_step}"


def whatif_parts(r: ReplayReport) -> list[Any]:
    if not r.what_if:
        return []
    table = Table(title=whatif_title(r.what_if), title_justify="left", show_edge=False)
    for col in WHATIF_COLUMNS:
        table.add_column(col, no_wrap=col == "change")
    for row in whatif_rows(r.what_if):
        table.add_row(*map(markup, row), style="green" if row[1] == "yes" else "red")
    details = whatif_details(r.what_if)
    return [table] + ([Text("\n".join(f"- {visible(d)}" for d in details))] if details else [])


def verdict_word(r: ReplayReport) -> str:
    return _VERDICT[r.verdict][1]


def render_terminal(r: ReplayReport, console: Console) -> None:
    style, word = _VERDICT[r.verdict]
    s = r.setup
    title = Text.assemble((f" {word} ", style), "  ", (visible(r.headline), "bold"))
    facts = Table.grid(padding=(0, 2))
    facts.add_column(style="dim")
    facts.add_column()
    if r.loaded is None:
        facts.add_row("run", Text(visible(f"{s.run}  (checkpoint step {s.from_checkpoint}, "
                                          f"{span(s.first_step, s.last_step)}, {s.device}, {count(s.num_threads, 'thread')}"
                                          f"{world_text(r)})")))
    else:
        facts.add_row("replayed", Text(visible(f"{span(s.first_step, s.last_step)}, {s.device}, "
                                               f"{count(s.num_threads, 'thread')}")))
    for label, text in loaded_rows(r):
        facts.add_row(label, Text(visible(text)))
    if r.responsible_batch:
        b = r.responsible_batch
        extra = visible("  ".join(f"{k}: {_leaf_text(v)}" for k, v in b.leaves.items()))
        facts.add_row(batch_label(r), Text(visible(f"step {b.step}{shard_text(b.rank, r, b.owner)}  {b.file}")
                                           + (f"\n{extra}" if extra else "")))
    if r.data_defects:
        facts.add_row("data", Text("\n".join(map(visible, defect_lines(r.data_defects)))))
    if r.origin:
        facts.add_row("origin", Text(visible(f"step {r.origin.step}  {origin_text(r)}  ({r.origin.dtype})"),
                                     style="bold red"))
    if r.samples is not None and r.samples.samples:
        ids = "  ".join(f"{k}: {_leaf_text(v)}" for k, v in r.samples.sample_leaves.items())
        where = sample_positions(r.samples.samples, r.samples.micro_batch_samples)
        # a pipeline's micro-batch: the positions name it
        batch = r.responsible_batch if r.pipeline is None else None
        shard = shard_text(batch.rank, owner=batch.owner) if batch else ""
        facts.add_row("samples", Text(visible(f"{where} of {r.samples.batch_size}{shard}"
                                              + (f"  ({ids})" if ids else ""))))
    elif r.samples is not None:
        through = f", through per-batch {', '.join(r.samples.cause_leaves)}" if r.samples.cause_leaves else ""
        facts.add_row("samples", Text(visible(f"batch-wide: most samples fail alone{through}"
                                              if r.samples.status == "batch_wide"
                                              else r.samples.status.replace("_", " "))))
    if r.operation is not None:
        op = r.operation
        via = f" <- {op.forward.op}" if op.forward else ""
        facts.add_row("operation", Text(visible(f"{op.site.phase} {op.site.op}{via} -> {op.output_value}  "
                                                f"module {op.site.module or '(none)'}  {op.site.source or ''}")))
    facts.add_row("reproduction", Text(visible(r.reproduction)))
    if r.loss_only_steps:
        facts.add_row("loss only", numbered("step", r.loss_only_steps)
                      + ": a non-finite loss; every gradient, parameter, optimizer state and buffer finite")
    parts: list[Any] = [facts]
    if r.events:
        chain = Tree("[bold]propagation chain")
        first, more, last = elided(sorted({e.step for e in r.events}), *CHAIN_STEPS)
        for i, step in enumerate(first + last):
            if more and i == len(first):
                chain.add(Text(left_out(more, "step"), style="dim"))
            node = chain.add(f"[bold]step {step}")
            for e in (e for e in r.events if e.step == step):
                node.add(Text(visible(e.text + counts_suffix(e))))
        parts += [Text(), chain]
    first, more, last = spread_rows(r)
    if first:
        table = Table(title="spread of non-finite values", title_justify="left", show_edge=False)
        buffers = any(x.buffers_total for x in first + last)
        for col in spread_columns(buffers):
            table.add_column(col, justify="right")
        for i, x in enumerate(first + last):
            if more and i == len(first):
                table.add_row("...", Text(left_out(more, "step"), style="dim", justify="left"))
            mark = "bold red" if x.params_nonfinite or x.state_nonfinite or x.buffers_nonfinite else ""
            table.add_row(*spread_cells(x, buffers, grouped=True), style=mark)
        parts += [Text(), table]
    if r.precursors:
        steps = span(r.precursors[0].step, r.precursors[-1].step)
        rows = [(name, values, last_finite(values)) for name, values in precursor_rows(r)]
        per = math.ceil(len(r.precursors) / _trend_width(console, rows))
        scale = f", a character per {per} steps" if per > 1 else ""
        table = Table(title=f"precursors, {steps} (log scale, ! = non-finite{scale})", title_justify="left",
                      show_edge=False)
        for col, justify in (("metric", "left"), ("trend", "left"), ("last finite", "right")):
            table.add_column(col, justify=justify)  # type: ignore[arg-type]
        for name, values, last_value in rows:
            table.add_row(markup(name), sparkline(values, _trend_width(console, rows)), last_value)
        parts += [Text(), table]
    if r.ranks:
        table = Table(title="ranks: logged losses against the replay's", title_justify="left", show_edge=False)
        for col in RANK_COLUMNS:
            table.add_column(col, justify="right")
        for row in rank_rows(r):
            table.add_row(*row, style="bold red" if row[2] != "-" else "")
        parts += [Text(), table]
    for extra in amp_parts(r) + whatif_parts(r):
        parts += [Text(), extra]
    if r.findings:
        parts += [Text(), Text("\n".join(f"- {visible(f)}" for f in r.findings))]
    print_whole(console, Panel(Group(*parts), title=title, title_align="left", border_style=style.split()[-1]))
    if r.spread_map is not None and r.responsible_step is not None:
        heatmap.render_terminal(r.spread_map, console)


def _trend_width(console: Console, rows: list[tuple[str, list[float | None], str]]) -> int:
    """The characters a precursor sparkline gets: the console's width less the panel's borders, the other two
    columns and the table's padding and rules."""
    label = max(len(name) for name, _, _ in rows)
    last = max([len(x) for _, _, x in rows] + [len("last finite")])
    return max(10, console.width - 4 - label - last - 8)


# ---- mixed precision: the loss scaler as a control loop ------------------------------------------------

AMP_COLUMNS = ("step", "scale", "after", "optimizer.step()", "overflow", "outcome")


def amp_rows(amp: AmpReport) -> list[tuple[str, ...]]:
    """The steps where the control loop did something: a skip, a back-off or growth, an overflow."""
    rows = []
    for s in amp.steps:
        if not (s.skipped or s.overflow or s.adjustment != "hold"):
            continue
        outcome = ("caught: state intact" if s.caught else "reached the optimizer state"
                   if amp.state_poisoned_by is not None and amp.state_poisoned_by.step == s.step else "")
        rows.append((str(s.step), "-" if s.scale is None else f"{s.scale:g}",
                     "-" if s.next_scale is None else f"{s.next_scale:g} ({s.adjustment})",
                     "skipped" if s.skipped else "ran", s.overflow or "", outcome))
    return rows


def amp_headline(amp: AmpReport) -> str:
    precision = f"autocast {amp.autocast}" if amp.autocast else f"{amp.param_dtype} parameters"
    caught = ", ".join(str(e.step) for e in amp.caught) or "none"
    failure = amp.state_poisoned_by.text if amp.state_poisoned_by else "none"
    return (f"{precision}, {'a GradScaler' if amp.scaler else 'no GradScaler'}; caught before the moments were "
            f"written (benign): {caught}; first to reach the optimizer state (the failure): {failure}")


def amp_parts(r: ReplayReport) -> list[Any]:
    """Terminal renderables for ``r.amp`` (none without it)."""
    if r.amp is None:
        return []
    table = Table(title=markup(f"mixed precision: {amp_headline(r.amp)}"), title_justify="left", show_edge=False)
    for col in AMP_COLUMNS:
        table.add_column(col, justify="right" if col in ("step", "scale") else "left")
    for row in amp_rows(r.amp):
        table.add_row(*map(markup, row), style="bold red" if row[-1].startswith("reached") else "")
    return [table]
