"""The Markdown views (CI step summaries, issues): templates whose every value is escaped on its way out.

A value from a run (a sample id, a file or tensor name, a sentence that quotes one) must stay text: it must not open
HTML, a link or an image, emphasis, a code span, math, or a table cell. The templates in ``templates/*.md.j2`` write
the Markdown; the environment's finalizer passes every ``{{ value }}`` through ``md_text`` unless a filter has already
made it Markdown of its own (``code``, ``fenced``: a code span or block that holds any text literally). So no value
reaches the page unescaped, whichever template or field it comes from; templates never put a value at the start of
a line, where ``-``, ``1.`` or ``=`` would act. What Markdown cannot stop: GitHub's own text filters (emoji
``:name:``, ``@mentions``, issue ``#refs``, bare URLs made links) act on any text outside code.
"""

from __future__ import annotations

import functools
from typing import Any, Iterable

from jinja2 import Environment, PackageLoader, StrictUndefined

from ..checkpoints.bisect import BisectReport
from ..checkpoints.scan import ScanReport
from ..postmortem import PostmortemReport
from ..report import Event, ReplayReport
from ..saved import SavedReport
from ..words import span
from . import checkpoints, heatmap, postmortem, replay
from .escaping import Markdown, code, fenced, md_text


def _finalize(value: Any) -> Any:
    return value if isinstance(value, Markdown) else md_text(value)


@functools.cache
def _environment() -> Environment:
    env = Environment(loader=PackageLoader("nanforensics.views", "templates"), autoescape=False, finalize=_finalize,
                      undefined=StrictUndefined, trim_blocks=True, lstrip_blocks=True, keep_trailing_newline=True)
    env.filters.update(code=code, fenced=fenced, row=row, rule=rule)
    env.globals.update(span=span)
    return env


def _render(template: str, **context: Any) -> Markdown:
    return Markdown(_environment().get_template(template).render(**context))


def row(cells: Iterable[object]) -> Markdown:
    """A GFM table row, each cell escaped (or Markdown a filter wrote)."""
    return Markdown("| " + " | ".join(_finalize(c) for c in cells) + " |")


def rule(aligns: Iterable[str]) -> Markdown:
    """A table's delimiter row: ``":"`` aligns that column right, ``""`` leaves it left."""
    return Markdown("|" + "".join(f"---{a}|" for a in aligns))


def render_replay(r: ReplayReport) -> Markdown:
    def chain(steps: list[int]) -> list[tuple[int, Event, str]]:
        return [(i, e, replay.counts_suffix(e)) for i, e in enumerate(r.events, 1) if e.step in steps]

    chain_head, chain_more, chain_tail = replay.elided(sorted({e.step for e in r.events}), *replay.CHAIN_STEPS)
    head, more, tail = replay.spread_rows(r)
    buffers = any(x.buffers_total for x in head + tail)
    columns = replay.spread_columns(buffers)
    return _render("replay.md.j2", r=r, s=r.setup, word=replay.verdict_word(r).lower(), world=replay.world_text(r),
                   loaded=replay.loaded_rows(r), batch_label=replay.batch_label(r).capitalize(),
                   shard=replay.shard_text(r.responsible_batch.rank, r, r.responsible_batch.owner) if r.responsible_batch else "",
                   origin=replay.origin_text(r) if r.origin else "",
                   defects=replay.defect_lines(r.data_defects), left_out=replay.left_out,
                   chain_head=chain(chain_head), chain_more=chain_more, chain_tail=chain(chain_tail),
                   spread_columns=columns, spread_align=[":"] * len(columns), spread_more=more,
                   spread_head=[replay.spread_cells(x, buffers, grouped=False) for x in head],
                   spread_tail=[replay.spread_cells(x, buffers, grouped=False) for x in tail],
                   precursors=[(name, replay.sparkline(values), replay.last_finite(values))
                               for name, values in replay.precursor_rows(r)] if r.precursors else [],
                   rank_columns=replay.RANK_COLUMNS, ranks=replay.rank_rows(r),
                   amp=replay.amp_headline(r.amp) if r.amp is not None else None,
                   amp_columns=replay.AMP_COLUMNS, amp_rows=replay.amp_rows(r.amp) if r.amp is not None else [],
                   whatif=replay.whatif_title(r.what_if) if r.what_if else None,
                   whatif_columns=replay.WHATIF_COLUMNS, whatif_rows=replay.whatif_rows(r.what_if),
                   whatif_details=replay.whatif_details(r.what_if))


def render_scan(r: ScanReport) -> Markdown:
    return _render("scan.md.j2", r=r, **checkpoints.scan_parts(r))


def render_bisect(r: BisectReport) -> Markdown:
    return _render("bisect.md.j2", r=r, **checkpoints.bisect_parts(r),
                   replayed=render_replay(r.replayed) if r.replayed is not None else None)


def render_postmortem(r: PostmortemReport) -> Markdown:
    m = postmortem.spread_map(r)
    return _render("postmortem.md.j2", r=r, word=postmortem.VERDICT[r.verdict][1].lower(),
                   analyses=[(postmortem.label(a.name), a.status, a.detail) for a in r.analyses],
                   spread=heatmap.render_text(m) if m is not None else None,
                   replay=render_replay(r.replay) if r.replay is not None else None,
                   bisect=render_bisect(r.checkpoints) if r.checkpoints is not None else None)


def render(r: SavedReport) -> Markdown:
    """Any saved report, by its kind: what ``nanforensics report --markdown`` writes."""
    if isinstance(r, PostmortemReport):
        return render_postmortem(r)
    if isinstance(r, ReplayReport):
        return render_replay(r)
    return render_bisect(r)
