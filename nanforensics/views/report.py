"""Any saved report to the terminal: ``nanforensics report`` re-renders with the commands' own views, so it prints
what the command printed (Markdown: views/markdown.py)."""

from __future__ import annotations

from rich.console import Console

from ..postmortem import PostmortemReport
from ..report import ReplayReport
from ..saved import SavedReport
from . import checkpoints, postmortem, replay


def render_terminal(r: SavedReport, console: Console) -> None:
    if isinstance(r, PostmortemReport):
        postmortem.render_terminal(r, console)
    elif isinstance(r, ReplayReport):
        replay.render_terminal(r, console)
    else:
        checkpoints.render_bisect_terminal(r, console)
