"""Every range of steps a view or a progress line writes goes through ``words.span``: a window of one step reads
"step 20", never "steps 20-20", and a window of two still reads "steps 20-21". Each view renders the same real
replay of the committed sample (read, never written), once replayed for one step and once for two."""

from __future__ import annotations

import dataclasses
import functools
import re

import pytest
from nanforensics.postmortem import Window, where
from nanforensics.replay import spread
from nanforensics.replay.engine import ReplayOptions, replay_run
from nanforensics.report import ReplayReport
from nanforensics.views import heatmap, markdown
from nanforensics.views import replay as terminal
from nanforensics.views.html import render_html
from rich.console import Console

from conftest import ROOT

SAMPLE = ROOT / "sample_runs" / "seed_adam"
ONE_STEP_WRITTEN_AS_A_RANGE = re.compile(r"\bsteps (\d+)-\1\b")


class Phases:
    """The progress lines a replay announces, kept as text."""

    def __init__(self) -> None:
        self.names: list[str] = []

    def phase(self, what: str, total: int | None = None, unit: str = "step", at_most: bool = False) -> None:
        self.names.append(what)

    def update(self, done: int, total: int | None = None) -> None:
        pass


@functools.cache
def _replayed(steps: int) -> tuple[ReplayReport, list[str]]:
    phases = Phases()
    return replay_run(SAMPLE, ReplayOptions(from_step=20, max_steps=steps), phases), phases.names


def _views(r: ReplayReport) -> str:
    console = Console(record=True, width=140, color_system=None)
    terminal.render_terminal(r, console)
    m = spread.from_replay(r)
    assert m is not None
    return "\n".join([console.export_text(), str(markdown.render_replay(r)), render_html(r), heatmap.render_text(m)])


@pytest.mark.parametrize("steps", [1, 2])
def test_every_view_and_progress_line_writes_a_window_of_one_step_as_a_step(steps: int) -> None:
    r, phases = _replayed(steps)
    last = 20 + steps - 1
    assert (r.setup.first_step, r.setup.last_step) == (20, last)
    text = _views(r) + "\n".join(phases)
    assert not ONE_STEP_WRITTEN_AS_A_RANGE.search(text), ONE_STEP_WRITTEN_AS_A_RANGE.search(text)
    window = "step 20" if steps == 1 else "steps 20-21"
    assert f"{window}, cpu" in text and f"over {window} on cpu" in text  # the terminal's and Markdown's facts
    assert f"non-finite values after each of {window}" in text and f"replaying {window}" in text


def test_a_precursor_window_of_one_step_is_titled_with_its_step() -> None:
    r, _ = _replayed(2)
    full = replay_run(SAMPLE, ReplayOptions())
    assert len(full.precursors) > 1
    one = dataclasses.replace(r, precursors=full.precursors[-1:])
    last = full.precursors[-1].step
    text = _views(one)
    assert f"precursors, step {last} (log scale" in text and f"### Precursors, step {last}\n" in text
    every = _views(dataclasses.replace(r, precursors=full.precursors))
    assert f"precursors, steps {full.precursors[0].step}-{last} (log scale" in every


@pytest.mark.parametrize(("first", "last", "text"), [(5, 5, "in step 5"), (5, 6, "in steps 5-6"),
                                                     (None, 6, "at or before step 6"), (5, None, "at or after step 5")])
def test_a_post_mortem_window_is_placed_in_words(first: int | None, last: int | None, text: str) -> None:
    assert where(Window(first, last, [])) == text

