"""Any saved report to the terminal or Markdown: ``nanforensics report`` re-renders with the commands' own views."""

from __future__ import annotations

from rich.console import Console

from ..postmortem import PostmortemReport
from ..report import ReplayReport
from ..saved import SavedReport
from . import checkpoints, heatmap, postmortem, replay


def render_terminal(r: SavedReport, console: Console) -> None:
    if isinstance(r, PostmortemReport):
        postmortem.render_terminal(r, console)
    elif isinstance(r, ReplayReport):
        replay.render_terminal(r, console)
        if r.spread_map is not None and r.responsible_step is not None:
            heatmap.render_terminal(r.spread_map, console)
    else:
        checkpoints.render_bisect_terminal(r, console)


def render_markdown(r: SavedReport) -> str:
    if isinstance(r, PostmortemReport):
        return postmortem.render_markdown(r)
    if isinstance(r, ReplayReport):
        return replay.render_markdown(r)
    return checkpoints.render_bisect_markdown(r)
