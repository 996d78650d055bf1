"""A self-contained HTML report: one file that fetches nothing (inline CSS and SVG; no scripts, fonts or
links), so it opens from a CI artifact as it is. Pictures: the spread heatmap, the loss curve and the
precursor curves; text: the verdict, the propagation chain, the checkpoints read, the findings."""

from __future__ import annotations

import math
from html import escape
from typing import Sequence

from ..checkpoints.bisect import BisectReport
from ..finite import Located
from ..postmortem import PostmortemReport, span
from ..replay.spread import SpreadMap, from_replay, grouped
from ..report import ReplayReport
from ..rootcause.findings import describe, reproduction
from ..words import count, sample_positions
from . import heatmap
from .postmortem import VERDICT, spread_map
from .replay import batch_label, counts, headline, loaded_rows, precursor_rows, world_text

LEVEL_FILLS = ("#e5e7eb", "#fcd34d", "#fb923c", "#dc2626", "#7f1d1d")
PALETTE = ("#2563eb", "#16a34a", "#9333ea", "#ea580c", "#0891b2", "#be123c", "#4d7c0f", "#a16207")
MAX_HEATMAP_ROWS = 48
_BADGE = {"nonfinite": "bad", "clean": "good", "not_reproduced": "warn", "loss_only": "warn", "poisoned": "bad",
          "non_monotonic": "warn"}

_CSS = """
body{font:14px/1.45 system-ui,-apple-system,Segoe UI,Roboto,sans-serif;color:#111827;margin:0;background:#f9fafb}
main{max-width:1040px;margin:0 auto;padding:24px}
h1{font-size:20px;margin:0 0 4px}h2{font-size:16px;margin:28px 0 8px;border-bottom:1px solid #e5e7eb}
.badge{display:inline-block;padding:2px 10px;border-radius:4px;font-weight:700;color:#fff;margin-right:8px}
.bad{background:#dc2626}.good{background:#16a34a}.warn{background:#ca8a04}
table{border-collapse:collapse;margin:6px 0}td,th{padding:3px 10px;border-bottom:1px solid #e5e7eb;text-align:left;
vertical-align:top}th{font-weight:600;color:#374151}code,.mono{font-family:ui-monospace,Menlo,Consolas,monospace;
font-size:13px}.dim{color:#6b7280}.done{color:#16a34a}.skipped{color:#a16207}.failed{color:#dc2626}
svg{background:#fff;border:1px solid #e5e7eb;border-radius:4px;max-width:100%;height:auto}
ol li,ul li{margin:2px 0}.legend{display:flex;flex-wrap:wrap;gap:4px 16px;font-size:12px;margin:4px 0}
.legend i{display:inline-block;width:10px;height:10px;margin-right:5px}.legend i.mark{width:0;height:10px;
border-left:2px dashed;margin:0 6px 0 4px}footer{margin-top:32px;color:#6b7280;font-size:12px}
"""


def render_html(report: PostmortemReport | ReplayReport | BisectReport) -> str:
    if isinstance(report, PostmortemReport):
        return _postmortem(report)
    if isinstance(report, ReplayReport):
        return _page("nanforensics replay", report.verdict, VERDICT[report.verdict][1], headline(report),
                     _replay_sections(report, from_replay(report), None), report.schema)
    word = report.verdict.replace("_", "-").upper()
    first = report.first_poisoned
    head = (f"first poisoned checkpoint: step {first.step}" if first is not None
            else f"no poisoned checkpoint among {report.checkpoints}")
    return _page("nanforensics bisect", report.verdict, word, head, _bisect(report), report.schema)


# ---- pages -------------------------------------------------------------------------------------


def _page(title: str, verdict: str, word: str, head: str, sections: list[str], footer: str) -> str:
    return ("<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
            "<meta name=\"viewport\" content=\"width=device-width, initial-scale=1\">"
            f"<title>{escape(title)}: {escape(head)}</title><style>{_CSS}</style></head><body><main>"
            f"<h1><span class=\"badge {_BADGE.get(verdict, 'warn')}\">{escape(word)}</span>{escape(head)}</h1>"
            + "".join(sections) + f"<footer>{escape(footer)}</footer></main></body></html>\n")


def _postmortem(r: PostmortemReport) -> str:
    facts = [("directory", f"<code>{escape(r.directory)}</code> "
                           f"({'a run recorded by nanforensics' if r.kind == 'run' else 'checkpoints only'})")]
    if r.window is not None:
        facts.append(("origin window", escape(f"{span(r.window)}: " + "; ".join(r.window.basis))))
    rows = "".join(f"<tr><td>{escape(a.name.replace('_', ' '))}</td><td class=\"{a.status}\">{a.status}</td>"
                   f"<td>{escape(a.detail)}</td></tr>" for a in r.analyses)
    sections = [_facts(facts), f"<h2>Analyses</h2><table>{rows}</table>", _list("Post-mortem findings", r.findings)]
    curve = None
    if r.step_log is not None:
        log = r.step_log
        band = None if r.window is None else (log.first_step if r.window.first is None else r.window.first,
                                              log.last_step if r.window.last is None else r.window.last)
        curve = _chart("Logged loss", [("logged loss", log.curve_steps, log.curve_losses)],
                       _marks(r.responsible_step, log.first_nonfinite_loss_step), log=False, band=band,
                       y_title="loss")
    if r.replay is not None:
        sections += ["<h2>Replay</h2>", *_replay_sections(r.replay, spread_map(r), curve)]
    else:
        sections += [s for s in (_heatmap(spread_map(r)), curve) if s]
    if r.checkpoints is not None:
        sections += _bisect(r.checkpoints)
    return _page("nanforensics post-mortem", r.verdict, VERDICT[r.verdict][1], r.headline, sections,
                 f"{r.generator}, {r.schema}")


def _replay_sections(r: ReplayReport, spread: SpreadMap | None, loss_chart: str | None) -> list[str]:
    facts = [("replayed", f"{escape(r.setup.run)}: steps {r.setup.first_step}-{r.setup.last_step} from the "
                          f"checkpoint at step {r.setup.from_checkpoint}, {escape(r.setup.device)}"
                          f"{escape(world_text(r))}")]
    if r.responsible_batch is not None:
        facts.append((batch_label(r), f"step {r.responsible_batch.step}, "
                                      f"<code>{escape(r.responsible_batch.file)}</code>"))
    if r.origin is not None:
        facts.append(("origin", f"step {r.origin.step}, <code>{escape(describe(r.origin))}</code> "
                                f"({escape(r.origin.dtype or '')})"))
    facts += [(label, escape(text)) for label, text in loaded_rows(r)]
    if r.operation is not None:
        op = r.operation
        via = f" &larr; <code>{escape(op.forward.op)}</code>" if op.forward else ""
        where = "".join(f", {label} <code>{escape(value)}</code>" for label, value in
                        (("module", op.site.module), ("at", op.site.source)) if value)
        facts.append(("operation", f"{escape(op.site.phase)} <code>{escape(op.site.op)}</code>{via} &rarr; "
                                   f"{escape(op.output_value)}{where}"))
    if r.samples is not None:
        facts.append(("samples", _samples(r)))
    facts.append(("reproduction", escape(reproduction(r))))
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
    return [s for s in (_facts(facts), _chain(r), _heatmap(spread), loss_chart, precursors,
                        _list("Findings", r.findings)) if s]


# ---- pieces ------------------------------------------------------------------------------------


def _facts(rows: list[tuple[str, str]]) -> str:
    """Rows of (label, HTML already escaped)."""
    return "<table>" + "".join(f"<tr><th>{escape(k)}</th><td>{v}</td></tr>" for k, v in rows) + "</table>"


def _list(title: str, items: Sequence[str]) -> str:
    if not items:
        return ""
    return f"<h2>{escape(title)}</h2><ul>" + "".join(f"<li>{escape(i)}</li>" for i in items) + "</ul>"


def _chain(r: ReplayReport) -> str:
    if not r.events:
        return ""
    items = []
    for step in sorted({e.step for e in r.events}):
        inner = "".join(f"<li><code>{escape(describe(e))}</code>"
                        + (f" <span class=\"dim\">({escape(counts(e))})</span>" if counts(e) else "")
                        + "</li>"
                        for e in r.events if e.step == step)
        items.append(f"<li>step {step}<ol>{inner}</ol></li>")
    return "<h2>Propagation chain</h2><ol>" + "".join(items) + "</ol>"


def _bisect(b: BisectReport) -> list[str]:
    def ref(c: object) -> str:
        return "none" if c is None else f"step {c.step}: <code>{escape(c.path)}</code>"  # type: ignore[attr-defined]

    order = {id(h): n for n, h in enumerate(b.history, 1)}
    reads = "".join(f"<tr><td>{h.step}</td><td><code>{escape(h.path)}</code></td><td>{escape(h.format)}</td>"
                    f"<td>{h.verdict}</td><td>{order[id(h)]}</td></tr>"
                    for h in sorted(b.history, key=lambda h: h.index))
    facts = _facts([("first poisoned", ref(b.first_poisoned)), ("last clean", ref(b.last_clean)),
                    ("read", f"{b.scans} of {b.checkpoints} (ordered by {b.order})")])
    out = [f"<h2>Checkpoints</h2>{facts}<table><tr><th>step</th><th>checkpoint</th><th>layout</th><th>verdict</th>"
           f"<th>read</th></tr>{reads}</table>"]
    unread = b.skipped + [f"{h.path}/{name}" for h in b.history for name in h.skipped]
    if unread:
        out.append(_list("Files not read", unread))
    if b.poisoned_tensors:
        rows = "".join(f"<tr><td><code>{escape(t.name)}</code></td><td>{t.group}</td><td>{t.nonfinite:,}</td>"
                       f"<td>{_first(t.first_nonfinite)}</td></tr>" for t in b.poisoned_tensors[:40])
        out.append("<table><tr><th>poisoned tensor</th><th>group</th><th>non-finite</th><th>first at</th></tr>"
                   f"{rows}</table>")
    return out


def _samples(r: ReplayReport) -> str:
    s = r.samples
    assert s is not None
    if not s.samples:
        return escape(s.message)
    ids = "; ".join(f"<code>{escape(k)}</code> = {escape(str(v))}" for k, v in s.sample_leaves.items())
    return (f"{escape(sample_positions(s.samples, s.micro_batch_samples))} of {s.batch_size}"
            + (f" ({ids})" if ids else "") + f" <span class=\"dim\">{escape(s.status)}</span>")


def _first(where: Located | None) -> str:
    return "-" if where is None else escape(f"{where.index} = {where.value}")


def _marks(responsible: int | None, nan_loss: int | None) -> list[tuple[int, str, str]]:
    marks = [(responsible, "responsible step", "#dc2626")] if responsible is not None else []
    if nan_loss is not None and nan_loss != responsible:
        marks.append((nan_loss, "first NaN loss", "#ca8a04"))
    return marks


# ---- SVG ---------------------------------------------------------------------------------------


def _heatmap(m: SpreadMap | None) -> str:
    if m is None:
        return ""
    g = grouped(m, MAX_HEATMAP_ROWS)
    cell, gap, top = 20, 32, 46
    label_w = 24 + round(7.5 * max(len(r.name) for r in g.rows))  # whole names: the picture scales to the page
    with_state = any(r.state_total for r in g.rows)
    panel_w = max(cell * len(g.steps), 130)
    width = label_w + panel_w + (gap + panel_w if with_state else 0) + 8
    height = top + cell * len(g.rows) + 8
    every = max(1, math.ceil(len(g.steps) / 12))
    parts = []
    panels = [("parameters", label_w, "params")] + ([("optimizer state", label_w + panel_w + gap, "state")]
                                                    if with_state else [])
    for title, x0, kind in panels:
        parts.append(f'<text x="{x0}" y="14" font-weight="600" font-size="13">{title}</text>')
        for i, step in enumerate(g.steps):
            x = x0 + i * cell
            if i % every == 0 or step == g.responsible_step:
                parts.append(f'<text x="{x + cell / 2}" y="{top - 4}" text-anchor="middle" font-size="10" '
                             f'fill="#6b7280">{step}</text>')
            if step == g.responsible_step:
                parts.append(f'<path d="M{x + 4} 21 L{x + cell - 4} 21 L{x + cell / 2} 29 Z" fill="#dc2626">'
                             f'<title>responsible step {step}</title></path>')
        for j, row in enumerate(g.rows):
            total = row.params_total if kind == "params" else row.state_total
            counts = row.params_nonfinite if kind == "params" else row.state_nonfinite
            if not total:
                continue
            for i, (step, bad) in enumerate(zip(g.steps, counts)):
                parts.append(f'<rect x="{x0 + i * cell}" y="{top + j * cell}" width="{cell - 2}" height="{cell - 2}" '
                             f'fill="{LEVEL_FILLS[heatmap.level(bad, total)]}"><title>{escape(row.name)} after step '
                             f'{step}: {bad:,} of {total:,} {title} values non-finite</title></rect>')
    for j, row in enumerate(g.rows):
        parts.append(f'<text x="{label_w - 10}" y="{top + j * cell + cell - 6}" text-anchor="end" '
                     f'font-family="ui-monospace,Menlo,Consolas,monospace" font-size="12">{escape(row.name)}</text>')
    legend = "".join(f'<span><i style="background:{fill}"></i>{name}</span>'
                     for fill, name in zip(LEVEL_FILLS, heatmap.LEVEL_NAMES))
    basis = "per tensor" if g.basis == "per_tensor" else "whole model (the replay report's totals)"
    if len(g.rows) < len(m.rows):
        basis += f"; {count(len(m.rows), 'tensor')} shown as {count(len(g.rows), 'layer')}"
    return (f'<h2>Spread of non-finite values</h2><svg role="img" width="{width}" height="{height}" '
            f'viewBox="0 0 {width} {height}" font-family="system-ui,sans-serif">' + "".join(parts) + "</svg>"
            f'<div class="legend">non-finite values after each step, {escape(basis)}: {legend}</div>')


def _chart(title: str, series: list[tuple[str, list[int], list[float | None]]], marks: list[tuple[int, str, str]],
           *, log: bool, y_title: str, band: tuple[int, int] | None = None) -> str | None:
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
    sx = lambda x: left + (x - x_lo) / max(1, x_hi - x_lo) * (width - left - right)  # noqa: E731
    sy = lambda v: top + (hi - y_of(v)) / (hi - lo) * (height - top - bottom)  # noqa: E731
    parts = []
    for value in levels:
        y = top + (hi - value) / (hi - lo) * (height - top - bottom)
        parts.append(f'<line x1="{left}" x2="{width - right}" y1="{y:.1f}" y2="{y:.1f}" stroke="#e5e7eb"/>'
                     f'<text x="{left - 6}" y="{y + 4:.1f}" text-anchor="end" font-size="11" fill="#374151">'
                     f'{_log_label(round(value)) if log else _linear_label(value, levels)}</text>')
    for x in _ticks(x_lo, x_hi):
        parts.append(f'<line x1="{sx(x):.1f}" x2="{sx(x):.1f}" y1="{height - bottom}" y2="{height - bottom + 4}" '
                     f'stroke="#6b7280"/><text x="{sx(x):.1f}" y="{height - bottom + 16}" text-anchor="middle" '
                     f'font-size="11" fill="#374151">{x}</text>')
    parts.append(f'<line x1="{left}" x2="{width - right}" y1="{height - bottom}" y2="{height - bottom}" '
                 f'stroke="#6b7280"/><text x="{(left + width - right) / 2:.0f}" y="{height - 6}" text-anchor="middle" '
                 f'font-size="12" fill="#111827">step</text>'
                 f'<text transform="translate(16 {(top + height - bottom) / 2:.0f}) rotate(-90)" text-anchor="middle" '
                 f'font-size="12" fill="#111827">{escape(y_title)}</text>')
    if band is not None:
        a, b = sx(max(band[0], x_lo)), sx(min(band[1], x_hi))
        parts.append(f'<rect x="{a:.1f}" y="{top}" width="{max(b - a, 2):.1f}" height="{height - top - bottom}" '
                     f'fill="#fee2e2"><title>the origin lies in steps {band[0]}-{band[1]}</title></rect>')
    for step, label, color in marks:
        if x_lo <= step <= x_hi:
            parts.append(f'<line x1="{sx(step):.1f}" x2="{sx(step):.1f}" y1="{top}" y2="{height - bottom}" '
                         f'stroke="{color}" stroke-dasharray="4 3"><title>{label} {step}</title></line>')
    for n, (name, xs, ys) in enumerate(series):
        color = PALETTE[n % len(PALETTE)]
        runs: list[list[str]] = [[]]
        for x, v in zip(xs, ys):
            if v is None or not math.isfinite(v) or (log and v <= 0):
                runs.append([])
                continue
            runs[-1].append(f"{sx(x):.1f},{sy(v):.1f}")
        for run in runs:
            if len(run) > 1:
                parts.append(f'<polyline fill="none" stroke="{color}" stroke-width="1.6" points="{" ".join(run)}"/>')
            elif run:
                x, y = run[0].split(",")
                parts.append(f'<circle cx="{x}" cy="{y}" r="2" fill="{color}"/>')
    for row, n in enumerate(rows):
        name, xs, ys = series[n]
        color, y_mark = PALETTE[n % len(PALETTE)], 14 + 12 * row
        for x, value, before in dict(onsets)[n]:
            joined = "" if before is None else (
                f'<line x1="{sx(before[0]):.1f}" y1="{sy(before[1]):.1f}" x2="{sx(x):.1f}" y2="{y_mark:.1f}" '
                f'stroke="{color}" stroke-width="1.2" stroke-dasharray="2 2"/>')
            parts.append(f'{joined}<text x="{sx(x):.1f}" y="{y_mark + 4:.1f}" text-anchor="middle" fill="{color}" '
                         f'font-size="13" font-weight="700">×<title>{escape(name)} is {value} from step {x}</title>'
                         f'</text>')
    legend = "".join(f'<span><i style="background:{PALETTE[n % len(PALETTE)]}"></i>{escape(name)}</span>'
                     for n, (name, _, _) in enumerate(series))
    if rows:
        legend += '<span><b style="color:#dc2626">×</b>&nbsp;where a curve goes non-finite (in its colour)</span>'
    legend += "".join(f'<span><i class="mark" style="border-color:{color}"></i>{label} {step}</span>'
                      for step, label, color in marks if x_lo <= step <= x_hi)
    if band is not None:
        legend += f'<span><i style="background:#fee2e2"></i>origin window, steps {band[0]}-{band[1]}</span>'
    return (f'<h2>{escape(title)}</h2><svg role="img" width="{width}" height="{height}" '
            f'viewBox="0 0 {width} {height}" font-family="system-ui,sans-serif">' + "".join(parts) + "</svg>"
            f'<div class="legend">{legend}</div>')


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
