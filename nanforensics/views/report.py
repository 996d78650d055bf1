"""Any saved report to the terminal: ``nanforensics report`` re-renders with the commands' own views (Markdown:
views/markdown.py)."""

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
