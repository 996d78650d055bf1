"""Terminal output that stays readable in a pipe or a CI log, as pytest's and ruff's does: text wraps at the
console's width ($COLUMNS where set, else the terminal's, else 80) between words, but no word (a tensor name,
a path) is broken across lines and no table column is cut off. A line runs past the width instead, when
a word or a row of identifiers is longer than it."""

from __future__ import annotations

from typing import Any

from rich.console import Console, RenderableType
from rich.measure import Measurement
from rich.panel import Panel
from rich.table import Table

_UNBOUNDED = 1 << 16


def print_whole(console: Console, renderable: RenderableType, **options: Any) -> None:
    """``console.print``, widened for this one renderable when it needs more than the console's width: a table
    to its natural width (its cells are identifiers and numbers, which rich would otherwise cut), anything
    else to the narrowest width that breaks no word (rich's minimum measurement)."""
    need = _needed(console, renderable)
    width = console.width
    if need <= width:
        console.print(renderable, **options)
        return
    console.width = need
    try:
        console.print(renderable, **options)
    finally:
        console.width = width


def _needed(console: Console, renderable: RenderableType) -> int:
    if isinstance(renderable, Panel):  # rich measures a panel at its content's widest: measure the content
        return _needed(console, renderable.renderable) + 4  # borders and padding
    measured = Measurement.get(console, console.options.update_width(_UNBOUNDED), renderable)
    return measured.maximum if isinstance(renderable, Table) else measured.minimum
