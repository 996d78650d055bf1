"""The HTML report as a reader uses it: the facts table answers what, where and which samples; the charts have
titled axes, round-numbered ticks and a mark where a curve goes non-finite; checkpoints are listed in step order;
the precursor curves reach far enough back to show a drift."""

from __future__ import annotations

import math
import re
from html.parser import HTMLParser

from nanforensics.replay.engine import PRECURSOR_STEPS
from nanforensics.views.html import render_html

import scenarios
from conftest import DEFECT_STEP, ROOT
from postmortem_cases import examined


class Page(HTMLParser):
    """Text by element: table rows as lists of cell texts, SVG texts with their <title>s, headings."""

    def __init__(self, html: str) -> None:
        super().__init__()
        self.rows: list[list[str]] = []
        self.svgs: list[list[str]] = []  # per chart, every <text> (and <title>) content
        self.headings: list[str] = []
        self._cell: list[str] | None = None
        self._tag = ""
        self.feed(html)

    def handle_starttag(self, tag, attrs):
        self._tag = tag
        if tag == "tr":
            self.rows.append([])
        elif tag in ("td", "th"):
            self._cell = []
        elif tag == "svg":
            self.svgs.append([])

    def handle_endtag(self, tag):
        if tag in ("td", "th") and self._cell is not None:
            self.rows[-1].append("".join(self._cell).strip())
            self._cell = None

    def handle_data(self, data):
        if self._cell is not None:
            self._cell.append(data)
        if self._tag in ("text", "title") and self.svgs:
            self.svgs[-1].append(data)
        if self._tag == "h2":
            self.headings.append(data)


def facts(page: Page) -> dict[str, str]:
    return {row[0]: row[1] for row in page.rows if len(row) == 2}


def test_the_facts_table_names_the_operation_and_the_samples(runs):
    page = Page(render_html(examined(runs["adam_near_zero"])))
    f = facts(page)
    assert "aten::div.Tensor" in f["operation"] and "torch.log" in f["operation"] and "features" in f["operation"]
    sample = scenarios.DEFECT_SAMPLE
    assert f["samples"].startswith(f"{sample} of 64") and f"s{DEFECT_STEP:05d}-{sample:02d}" in f["samples"]
    assert "ranks (" not in f["replayed"]  # one process: no world to name


def test_the_facts_table_names_the_world_of_a_distributed_run():
    f = facts(Page(render_html(examined(ROOT / "sample_runs" / "ddp_two_ranks"))))
    assert f["replayed"].endswith(", 2 ranks (ddp, emulated)") and "on rank 1" in f["origin"]


def test_charts_have_titled_axes_round_ticks_and_non_finite_marks(runs):
    page = Page(render_html(examined(runs["adam_near_zero"])))
    charts = dict(zip([h for h in page.headings if h in ("Logged loss", "Precursors")], page.svgs[1:]))
    loss, precursors = charts["Logged loss"], charts["Precursors"]
    assert "step" in loss and "loss" in loss and "magnitude (log scale)" in precursors
    ticks = [float(t) for t in loss if re.fullmatch(r"-?\d+(\.\d+)?", t) and "." in t]
    gaps = {round(b - a, 9) for a, b in zip(ticks, ticks[1:])}
    [gap] = gaps
    assert round(gap / 10 ** math.floor(math.log10(gap)), 6) in (1, 2, 2.5, 5)  # 1, 2, 2.5 or 5 times 10^k
    assert {"0.01", "0.1", "1", "10", "100"} <= set(precursors)  # decades written out
    # Every curve that goes non-finite is marked where it does, named in the mark's title.
    marks = [t for t in precursors if " from step " in t]
    assert f"grad norm is inf from step {DEFECT_STEP}" in marks or f"grad norm is nan from step {DEFECT_STEP}" in marks
    assert any(t.startswith("max |exp_avg_sq| is ") for t in marks)
    assert any(t.startswith(f"logged loss is nan from step {DEFECT_STEP + 1}") for t in loss)


def test_checkpoints_in_step_order_with_their_layout(runs):
    page = Page(render_html(examined(runs["adam_near_zero"])))
    header = next(row for row in page.rows if row[:3] == ["step", "checkpoint", "layout"])
    table = page.rows[page.rows.index(header) + 1:]
    table = table[:next((i for i, row in enumerate(table) if len(row) != len(header)), len(table))]
    steps = [int(row[0]) for row in table]
    assert steps == sorted(steps) == [0, 10, 20] and {row[2] for row in table} == {"nanforensics"}
    assert sorted(int(row[4]) for row in table) == [1, 2, 3]  # the order they were read in


def test_the_precursor_window_reaches_back_to_show_a_drift(runs):
    """The run's start checkpoint (step 10) is 7 steps before the event; the curves start at checkpoint 0."""
    r = examined(runs["adam_near_zero"]).replay
    assert r.setup.from_checkpoint == 10 and DEFECT_STEP - 10 < PRECURSOR_STEPS
    assert r.precursors[0].step == 0 and r.reproduced and r.responsible_step == DEFECT_STEP
