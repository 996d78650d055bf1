"""A self-contained HTML report: one file that fetches nothing (inline CSS and SVG; no scripts, fonts or
links), so it opens from a CI artifact as it is. Pictures: the spread heatmap, the loss curve and the
precursor curves; text: the verdict, the propagation chain, the checkpoints read, the findings.

The page is templates/report.html.j2, rendered by Jinja2 with autoescaping and ``visible`` as the finaliser of
every value: this module passes plain values (text, numbers, colours and coordinates it chose), never HTML, so a
string from a run cannot become markup however it is spelled."""

from __future__ import annotations

import functools
import math
from typing import Any, Sequence

from jinja2 import Environment, PackageLoader, StrictUndefined

from ..checkpoints.bisect import BisectReport, CheckpointRef
from ..finite import Located
from ..postmortem import DONE, FAILED, SKIPPED, PostmortemReport, where
from ..report import ReplayReport, SpreadMap
from ..words import count, sample_positions, span
from . import heatmap
from .escaping import visible
from .postmortem import VERDICT, spread_map
from .replay import batch_label, counts, loaded_rows, precursor_rows, world_text

LEVEL_FILLS = ("#e5e7eb", "#fcd34d", "#fb923c", "#dc2626", "#7f1d1d")
PALETTE = ("#2563eb", "#16a34a", "#9333ea", "#ea580c", "#0891b2", "#be123c", "#4d7c0f", "#a16207")
_BADGE = {"nonfinite": "bad", "clean": "good", "not_reproduced": "warn", "loss_only": "warn", "poisoned": "bad",
          "non_monotonic": "warn"}
_STATUS_CLASS = {DONE: "done", SKIPPED: "skipped", FAILED: "failed"}  # allow-listed: a class name is never run text

Cell = list[tuple[str, str | None]]  # text segments, each plain, in <code> ("code") or a <span> of that class
Section = dict[str, Any]  # one part of the page, by its "kind" (the template's ``section`` macro)


def _finalize(value: Any) -> Any:
    """Every value the template writes, before autoescaping: control characters and bidi overrides made visible."""
    return visible(value) if isinstance(value, str) and not hasattr(value, "__html__") else value  # not a macro's


@functools.cache
def _template() -> Any:
    env = Environment(loader=PackageLoader("nanforensics.views", "templates"), autoescape=True, finalize=_finalize,
                      undefined=StrictUndefined, keep_trailing_newline=True)
    return env.get_template("report.html.j2")


def render_html(report: PostmortemReport | ReplayReport | BisectReport) -> str:
    if isinstance(report, PostmortemReport):
        return _postmortem(report)
    if isinstance(report, ReplayReport):
        return _page("nanforensics replay", report.verdict, VERDICT[report.verdict][1], report.headline,
                     _replay_sections(report, report.spread_map, None), report.schema)
    word = report.verdict.replace("_", "-").upper()
    first = report.first_poisoned
    head = (f"first poisoned checkpoint: step {first.step}" if first is not None
            else f"no poisoned checkpoint among {report.checkpoints}")
    replayed = report.replayed  # bisect --code: the replay from the last clean checkpoint, as every other view shows
    replay = [] if replayed is None else [_heading(f"Replay: {replayed.headline}"),
                                          *_replay_sections(replayed, replayed.spread_map, None)]
    return _page("nanforensics bisect", report.verdict, word, head, _bisect(report) + replay, report.schema)


# ---- pages -------------------------------------------------------------------------------------


def _page(title: str, verdict: str, word: str, head: str, sections: list[Section], footer: str) -> str:
    return _template().render(title=title, badge=_BADGE.get(verdict, "warn"), word=word, head=head,
                              sections=sections, footer=footer)


def _postmortem(r: PostmortemReport) -> str:
    kind = "a run recorded by nanforensics" if r.kind == "run" else "checkpoints only"
    facts: list[tuple[str, Cell]] = [("directory", [(r.directory, "code"), (f" ({kind})", None)])]
    if r.window is not None:
        facts.append(("origin window", _text(f"{where(r.window)}: " + "; ".join(r.window.basis))))
    analyses = [[("", _text(a.name.replace("_", " "))), (_STATUS_CLASS.get(a.status, ""), _text(a.status)),
                 ("", _text(a.detail))] for a in r.analyses]
    sections = [_facts(facts), _table("Analyses", None, analyses), _list("Post-mortem findings", r.findings)]
    curve = None
    if r.step_log is not None:
        log = r.step_log
        band = None if r.window is None else (log.first_step if r.window.first is None else r.window.first,
                                              log.last_step if r.window.last is None else r.window.last)
        curve = _chart("Logged loss", [("logged loss", log.curve_steps, log.curve_losses)],
                       _marks(r.responsible_step, log.first_nonfinite_loss_step), log=False, band=band,
                       y_title="loss")
    if r.replay is not None:
        sections += [_heading("Replay"), *_replay_sections(r.replay, spread_map(r), curve)]
    else:
        sections += [_heatmap(spread_map(r)), curve]
    if r.checkpoints is not None:
        sections += _bisect(r.checkpoints)
    return _page("nanforensics post-mortem", r.verdict, VERDICT[r.verdict][1], r.headline, _present(sections),
                 f"{r.generator}, {r.schema}")


def _replay_sections(r: ReplayReport, spread: SpreadMap | None, loss_chart: Section | None) -> list[Section]:
    facts: list[tuple[str, Cell]] = [("replayed", [(r.setup.run, "code"), (
        f": {span(r.setup.first_step, r.setup.last_step)} from the checkpoint at step {r.setup.from_checkpoint}, "
        f"{r.setup.device}{world_text(r)}", None)])]  # a path in <code>, which wraps anywhere (report.css)
    if r.responsible_batch is not None:
        facts.append((batch_label(r), [(f"step {r.responsible_batch.step}, ", None),
                                       (r.responsible_batch.file, "code")]))
    if r.origin is not None:
        facts.append(("origin", [(f"step {r.origin.step}, ", None), (r.origin.text, "code"),
                                 (f" ({r.origin.dtype or ''})", None)]
                      + ([(f", {r.pipeline.text}", None)] if r.pipeline is not None else [])))
    facts += [(label, _text(text)) for label, text in loaded_rows(r)]
    if r.operation is not None:
        op = r.operation
        cell: Cell = [(f"{op.site.phase} ", None), (op.site.op, "code")]
        if op.forward:
            cell += [(" ← ", None), (op.forward.op, "code")]
        cell.append((f" → {op.output_value}", None))
        for label, value in (("module", op.site.module), ("at", op.site.source)):
            if value:
                cell += [(f", {label} ", None), (value, "code")]
        facts.append(("operation", cell))
    if r.samples is not None:
        facts.append(("samples", _samples(r)))
    facts.append(("reproduction", _text(r.reproduction)))
    marks = _marks(r.responsible_step, r.logged_first_nonfinite_loss_step)
    if loss_chart is None and r.spread:
        steps = [s.step for s in r.spread]
        loss_chart = _chart("Loss", [("logged", steps, [s.logged_loss for s in r.spread]),
                                     ("replayed", steps, [s.replayed_loss for s in r.spread])], marks, log=False,
                            y_title="loss")
    precursors = None
    if r.precursors:
        steps = [p.step for p in r.precursors]
        precursors = _chart("Precursors", [(name, steps, values) for name, values in precursor_rows(r)],
                            marks, log=True, y_title="magnitude (log scale)")
    return _present([_facts(facts), _chain(r), _heatmap(spread), loss_chart, precursors, _list("Findings", r.findings)])


# ---- pieces ------------------------------------------------------------------------------------


def _present(sections: Sequence[Section | None]) -> list[Section]:
    return [s for s in sections if s]


def _text(text: str) -> Cell:
    return [(text, None)]


def _heading(title: str) -> Section:
    return {"kind": "heading", "title": title}


def _facts(rows: list[tuple[str, Cell]]) -> Section:
    return {"kind": "facts", "rows": rows}


def _table(title: str | None, head: list[str] | None, rows: list[list[tuple[str, Cell]]]) -> Section:
    """Rows of (CSS class, cell) pairs; the class is one this module chose."""
    return {"kind": "table", "title": title, "head": head, "rows": rows}


def _list(title: str, items: Sequence[str]) -> Section | None:
    return {"kind": "list", "title": title, "entries": list(items)} if items else None


def _chain(r: ReplayReport) -> Section | None:
    if not r.events:
        return None
    steps = [(step, [(e.text, counts(e)) for e in r.events if e.step == step]) for step in sorted({e.step for e in r.events})]
    return {"kind": "chain", "steps": steps}


def _bisect(b: BisectReport) -> list[Section]:
    def ref(c: CheckpointRef | None) -> Cell:
        return _text("none") if c is None else [(f"step {c.step}: ", None), (c.path, "code")]

    order = {id(h): n for n, h in enumerate(b.history, 1)}
    reads = [[("", _text(str(h.step))), ("", [(h.path, "code")]), ("", _text(h.format)), ("", _text(h.verdict)),
              ("", _text(str(order[id(h)])))] for h in sorted(b.history, key=lambda h: h.index)]
    out = [_heading("Checkpoints"),
           _facts([("first poisoned", ref(b.first_poisoned)), ("last clean", ref(b.last_clean)),
                   ("read", _text(f"{b.scans} of {b.checkpoints} (ordered by {b.order})"))]),
           _table(None, ["step", "checkpoint", "layout", "verdict", "read"], reads)]
    unread = b.skipped + [f"{h.path}/{name}" for h in b.history for name in h.skipped]
    if unread:
        out.append(_list("Files not read", unread))
    if b.poisoned_tensors:
        rows = [[("", [(t.name, "code")]), ("", _text(t.group)), ("", _text(f"{t.nonfinite:,}")),
                 ("", _text(_first(t.first_nonfinite)))] for t in b.poisoned_tensors[:40]]
        out.append(_table(None, ["poisoned tensor", "group", "non-finite", "first at"], rows))
    return _present(out)


def _samples(r: ReplayReport) -> Cell:
    s = r.samples
    assert s is not None
    if not s.samples:
        return _text(s.message)
    cell: Cell = [(f"{sample_positions(s.samples, s.micro_batch_samples)} of {s.batch_size}", None)]
    for n, (k, v) in enumerate(s.sample_leaves.items()):
        cell += [(" (" if n == 0 else "; ", None), (k, "code"), (f" = {v}", None)]
    if s.sample_leaves:
        cell.append((")", None))
    return cell + [(" ", None), (s.status, "dim")]


def _first(where: Located | None) -> str:
    return "-" if where is None else f"{where.index} = {where.value}"


def _marks(responsible: int | None, nan_loss: int | None) -> list[tuple[int, str, str]]:
    marks = [(responsible, "responsible step", "#dc2626")] if responsible is not None else []
    if nan_loss is not None and nan_loss != responsible:
        marks.append((nan_loss, "first NaN loss", "#ca8a04"))
    return marks


# ---- SVG ---------------------------------------------------------------------------------------


def _el(tag: str, attrs: dict[str, object], text: str | None = None, title: str | None = None) -> dict[str, Any]:
    """One SVG element for the template: attribute values and text are plain values, escaped there."""
    return {"tag": tag, "attrs": list(attrs.items()), "text": text, "title": title}


def _svg(title: str, width: int, height: int, elements: list[dict[str, Any]],
         legend: list[tuple[str, str, str]], caption: str | None = None) -> Section:
    """A picture with its legend: (kind, colour, label) items, kind "swatch", "mark" or "cross"."""
    return {"kind": "svg", "title": title, "width": width, "height": height, "elements": elements, "legend": legend,
            "caption": caption}


def _heatmap(m: SpreadMap | None) -> Section | None:
    if m is None:
        return None
    rows = m.page_rows
    cell, gap, top = 20, 32, 46
    label_w = 24 + round(7.5 * max(len(visible(r.name)) for r in rows))  # whole names: the picture scales to the page
    with_state = any(r.state_total for r in rows)
    panel_w = max(cell * len(m.steps), 130)
    width = label_w + panel_w + (gap + panel_w if with_state else 0) + 8
    height = top + cell * len(rows) + 8
    every = max(1, math.ceil(len(m.steps) / 12))
    parts = []
    panels = [("parameters", label_w, "params")] + ([("optimizer state", label_w + panel_w + gap, "state")]
                                                    if with_state else [])
    for title, x0, kind in panels:
        parts.append(_el("text", {"x": x0, "y": 14, "font-weight": 600, "font-size": 13}, title))
        for i, step in enumerate(m.steps):
            x = x0 + i * cell
            if i % every == 0 or step == m.responsible_step:
                parts.append(_el("text", {"x": x + cell / 2, "y": top - 4, "text-anchor": "middle", "font-size": 10,
                                          "fill": "#6b7280"}, str(step)))
            if step == m.responsible_step:
                parts.append(_el("path", {"d": f"M{x + 4} 21 L{x + cell - 4} 21 L{x + cell / 2} 29 Z",
                                          "fill": "#dc2626"}, title=f"responsible step {step}"))
        for j, row in enumerate(rows):
            total = row.params_total if kind == "params" else row.state_total
            bads = row.params_nonfinite if kind == "params" else row.state_nonfinite
            if not total:
                continue
            for i, (step, bad) in enumerate(zip(m.steps, bads)):
                parts.append(_el("rect", {"x": x0 + i * cell, "y": top + j * cell, "width": cell - 2,
                                          "height": cell - 2, "fill": LEVEL_FILLS[heatmap.level(bad, total)]},
                                 title=f"{row.name} after step {step}: {bad:,} of {total:,} {title} values non-finite"))
    for j, row in enumerate(rows):
        parts.append(_el("text", {"x": label_w - 10, "y": top + j * cell + cell - 6, "text-anchor": "end",
                                  "font-family": "ui-monospace,Menlo,Consolas,monospace", "font-size": 12}, row.name))
    legend = [("swatch", fill, name) for fill, name in zip(LEVEL_FILLS, heatmap.LEVEL_NAMES)]
    basis = "per tensor" if m.basis == "per_tensor" else "whole model (the replay report's totals)"
    if len(rows) < len(m.rows):
        basis += f"; {count(len(m.rows), 'tensor')} shown as {count(len(rows), 'layer')}"
    return _svg("Spread of non-finite values", width, height, parts, legend,
                f"non-finite values after each step, {basis}")


def _chart(title: str, series: list[tuple[str, list[int], list[float | None]]], marks: list[tuple[int, str, str]],
           *, log: bool, y_title: str, band: tuple[int, int] | None = None) -> Section | None:
    """Lines over steps with titled axes; where a curve goes non-finite a cross in its colour, in a row of its
    own above the plot, joined to its last finite point; missing values are gaps; ``band`` shades the steps the
    origin lies in when no replay pinned it."""
    finite = [v for _, _, ys in series for v in ys if v is not None and math.isfinite(v) and (v > 0 or not log)]
    steps = [x for _, xs, _ in series for x in xs]
    if not steps:
        return None
    onsets = [(n, _onsets(xs, ys, log)) for n, (_, xs, ys) in enumerate(series)]
    rows = [n for n, at in onsets if at]  # a row of crosses for each curve that goes non-finite
    width, left, right, bottom = 760, 84, 16, 44
    top = 18 + 12 * len(rows)
    height = top + 190 + bottom
    y_of = math.log10 if log else float
    lo, hi = (min(map(y_of, finite)), max(map(y_of, finite))) if finite else (0.0, 1.0)
    levels = _log_levels(lo, hi) if log else _nice_levels(lo, hi)
    lo, hi = levels[0], levels[-1]
    x_lo, x_hi = min(steps), max(steps)
    px = lambda x: left + (x - x_lo) / max(1, x_hi - x_lo) * (width - left - right)  # noqa: E731
    sx = lambda x: f"{px(x):.1f}"  # noqa: E731
    sy = lambda v: f"{top + (hi - y_of(v)) / (hi - lo) * (height - top - bottom):.1f}"  # noqa: E731
    parts = []
    for value in levels:
        y = top + (hi - value) / (hi - lo) * (height - top - bottom)
        parts += [_el("line", {"x1": left, "x2": width - right, "y1": f"{y:.1f}", "y2": f"{y:.1f}", "stroke": "#e5e7eb"}),
                  _el("text", {"x": left - 6, "y": f"{y + 4:.1f}", "text-anchor": "end", "font-size": 11,
                               "fill": "#374151"}, _log_label(round(value)) if log else _linear_label(value, levels))]
    for x in _ticks(x_lo, x_hi):
        parts += [_el("line", {"x1": sx(x), "x2": sx(x), "y1": height - bottom, "y2": height - bottom + 4,
                               "stroke": "#6b7280"}),
                  _el("text", {"x": sx(x), "y": height - bottom + 16, "text-anchor": "middle", "font-size": 11,
                               "fill": "#374151"}, str(x))]
    parts += [_el("line", {"x1": left, "x2": width - right, "y1": height - bottom, "y2": height - bottom,
                           "stroke": "#6b7280"}),
              _el("text", {"x": f"{(left + width - right) / 2:.0f}", "y": height - 6, "text-anchor": "middle",
                           "font-size": 12, "fill": "#111827"}, "step"),
              _el("text", {"transform": f"translate(16 {(top + height - bottom) / 2:.0f}) rotate(-90)",
                           "text-anchor": "middle", "font-size": 12, "fill": "#111827"}, y_title)]
    if band is not None:
        a, b = px(max(band[0], x_lo)), px(min(band[1], x_hi))
        parts.append(_el("rect", {"x": f"{a:.1f}", "y": top, "width": f"{max(b - a, 2):.1f}",
                                  "height": height - top - bottom, "fill": "#fee2e2"},
                         title=f"the origin lies in {span(*band)}"))
    for step, label, color in marks:
        if x_lo <= step <= x_hi:
            parts.append(_el("line", {"x1": sx(step), "x2": sx(step), "y1": top, "y2": height - bottom, "stroke": color,
                                      "stroke-dasharray": "4 3"}, title=f"{label} {step}"))
    for n, (name, xs, ys) in enumerate(series):
        color = PALETTE[n % len(PALETTE)]
        runs: list[list[tuple[str, str]]] = [[]]
        for x, v in zip(xs, ys):
            if v is None or not math.isfinite(v) or (log and v <= 0):
                runs.append([])
                continue
            runs[-1].append((sx(x), sy(v)))
        for run in runs:
            if len(run) > 1:
                parts.append(_el("polyline", {"fill": "none", "stroke": color, "stroke-width": 1.6,
                                              "points": " ".join(f"{x},{y}" for x, y in run)}))
            elif run:
                parts.append(_el("circle", {"cx": run[0][0], "cy": run[0][1], "r": 2, "fill": color}))
    for row, n in enumerate(rows):
        name, xs, ys = series[n]
        color, y_mark = PALETTE[n % len(PALETTE)], 14 + 12 * row
        for x, value, before in dict(onsets)[n]:
            if before is not None:
                parts.append(_el("line", {"x1": sx(before[0]), "y1": sy(before[1]), "x2": sx(x), "y2": f"{y_mark:.1f}",
                                          "stroke": color, "stroke-width": 1.2, "stroke-dasharray": "2 2"}))
            parts.append(_el("text", {"x": sx(x), "y": f"{y_mark + 4:.1f}", "text-anchor": "middle", "fill": color,
                                      "font-size": 13, "font-weight": 700}, "×", f"{name} is {value} from step {x}"))
    legend = [("swatch", PALETTE[n % len(PALETTE)], name) for n, (name, _, _) in enumerate(series)]
    if rows:
        legend.append(("cross", "#dc2626", "where a curve goes non-finite (in its colour)"))
    legend += [("mark", color, f"{label} {step}") for step, label, color in marks if x_lo <= step <= x_hi]
    if band is not None:
        legend.append(("swatch", "#fee2e2", f"origin window, {span(*band)}"))
    return _svg(title, width, height, parts, legend)


def _onsets(xs: list[int], ys: list[float | None], log: bool) -> list[tuple[int, str, tuple[int, float] | None]]:
    """Where the curve turns non-finite: (step, value, its last drawn point before, if any)."""
    out: list[tuple[int, str, tuple[int, float] | None]] = []
    last, was_bad = None, False
    for x, v in zip(xs, ys):
        if v is None:
            continue
        bad = not math.isfinite(v)
        if bad and not was_bad:
            out.append((x, str(v), last))
        if not bad and (v > 0 or not log):
            last = (x, v)
        was_bad = bad
    return out


def _nice_step(span: float, parts: int) -> float:
    """1, 2, 2.5 or 5 times a power of ten, near span / parts."""
    raw = span / parts
    power = 10 ** math.floor(math.log10(raw))
    return next(m * power for m in (1, 2, 2.5, 5, 10) if m * power >= raw)


def _nice_levels(lo: float, hi: float) -> list[float]:
    """Grid values on round numbers that cover [lo, hi]."""
    if hi - lo < 1e-12 * max(1.0, abs(hi)):
        lo, hi = lo - max(1.0, abs(lo)) / 2, hi + max(1.0, abs(hi)) / 2
    step = _nice_step(hi - lo, 4)
    first, last = math.floor(lo / step), math.ceil(hi / step)
    return [k * step for k in range(first, last + 1)]


def _linear_label(value: float, levels: list[float]) -> str:
    """As many decimals as the grid's step needs (0.25 two, 20 none)."""
    step, digits = levels[1] - levels[0], 0
    while abs(step * 10 ** digits - round(step * 10 ** digits)) > 1e-6 and digits < 12:
        digits += 1
    return f"{value:.{digits}f}" if abs(value) < 1e6 else f"{value:.3g}"


def _log_levels(lo: float, hi: float) -> list[float]:
    """Whole decades covering [lo, hi], every one or every few (at most about 8 lines)."""
    first, last = math.floor(lo), max(math.ceil(hi), math.floor(lo) + 1)
    every = max(1, math.ceil((last - first) / 8))
    last = first + every * math.ceil((last - first) / every)
    return [float(k) for k in range(first, last + 1, every)]


def _log_label(power: int) -> str:
    """0.001 .. 1000 written out, powers of ten beyond as 1e-6, 1e9."""
    return f"{10.0 ** power:g}" if -3 <= power <= 3 else f"1e{power}"


def _ticks(lo: int, hi: int, n: int = 8) -> list[int]:
    """Steps on round numbers, about ``n`` of them."""
    step = max(1, round(_nice_step(max(1, hi - lo), n)))
    return list(range(math.ceil(lo / step) * step, hi + 1, step))
