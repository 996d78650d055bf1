"""The spread heatmap in characters, for terminals and Markdown: steps across, tensors (or layers) down,
parameters and optimizer state side by side. Shades carry the level, so it reads without colour too."""

from __future__ import annotations

from rich.console import Console
from rich.text import Text

from ..replay.spread import grouped
from ..report import SpreadMap
from ..words import count
from .escaping import visible

MAX_ROWS = 24
SHADES = ("··", "░░", "▒▒", "▓▓", "██")
STYLES = ("grey42", "yellow", "dark_orange", "red", "bold red")
LEVEL_NAMES = ("none", "1% or less", "under half", "half or more", "all")


def level(bad: int, total: int) -> int:
    """0 none non-finite, 1 up to 1%, 2 under half, 3 half or more, 4 every value."""
    if bad <= 0 or total <= 0:
        return 0
    if bad >= total:
        return 4
    return 1 if 100 * bad <= total else 2 if 2 * bad < total else 3


def lines(m: SpreadMap) -> list[list[tuple[str, str]]]:
    """The heatmap as lines of (text, rich style) segments."""
    g = grouped(m, MAX_ROWS)
    with_state = any(r.state_total for r in g.rows)
    width = max(2 * len(g.steps), len("parameters"))
    names = [visible(r.name) for r in g.rows]
    label = max(map(len, names))  # whole names: a line runs past the width rather than cut one
    gap = "   "
    out: list[list[tuple[str, str]]] = []
    head = [(" " * label + gap, ""), ("parameters".ljust(width), "bold")]
    out.append(head + ([(gap + "optimizer state", "bold")] if with_state else []))
    if g.responsible_step in g.steps:
        at = g.steps.index(g.responsible_step)
        mark = (" " * (2 * at) + "▼").ljust(width)
        out.append([(" " * label + gap, ""), (mark, "bold red")] + ([(gap + mark, "bold red")] if with_state else []))
    for r, name in zip(g.rows, names):
        line = [(name.ljust(label) + gap, "")]
        line += [(SHADES[lv], STYLES[lv]) for lv in (level(b, r.params_total) for b in r.params_nonfinite)]
        line.append((" " * (width - 2 * len(g.steps)), ""))
        if with_state:
            line.append((gap, ""))
            line += [(SHADES[lv], STYLES[lv]) if r.state_total else ("  ", "")
                     for lv in (level(b, r.state_total) for b in r.state_nonfinite)]
        out.append(line)
    marked = f", ▼ the responsible step {g.responsible_step}" if g.responsible_step in g.steps else ""
    out.append([(f"non-finite values after each of steps {g.steps[0]}-{g.steps[-1]}{marked}", "dim")])
    out.append([("  ".join(f"{s} {n}" for s, n in zip(SHADES, LEVEL_NAMES)), "dim")])
    if len(g.rows) < len(m.rows):
        out.append([(f"{count(len(m.rows), 'tensor')} shown as {count(len(g.rows), 'layer')}", "dim")])
    return out


def render_terminal(m: SpreadMap, console: Console) -> None:
    whole = " (whole model; per tensor in a post-mortem)" if m.basis == "totals" else ""
    title = "spread of non-finite values" + whole
    console.print(Text(title, style="bold"))
    for line in lines(m):
        console.print(Text.assemble(*line), no_wrap=True, crop=False)


def render_text(m: SpreadMap) -> str:
    """Plain characters, for a Markdown code block."""
    return "\n".join("".join(text for text, _ in line).rstrip() for line in lines(m))
