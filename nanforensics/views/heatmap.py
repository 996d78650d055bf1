"""The spread heatmap in characters, for terminals and Markdown: steps across, tensors (or layers) down,
parameters and optimizer state side by side. Shades carry the level, so it reads without colour too."""

from __future__ import annotations

from rich.console import Console
from rich.text import Text

from ..report import SpreadMap
from ..words import count, span
from .escaping import visible

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


def columns(n: int, room: int) -> list[int | None]:
    """The step indices shown in ``room`` columns: all of them, or the first and the last with None for the middle."""
    if n <= room:
        return list(range(n))
    head = max(1, (room - 1) // 2)
    tail = max(1, room - 1 - head)
    return list(range(head)) + [None] + list(range(n - tail, n))


def lines(m: SpreadMap, width: int | None = None) -> list[list[tuple[str, str]]]:
    """The heatmap as lines of (text, rich style) segments, at most ``width`` characters wide where the names allow:
    the steps in the middle of a long map are left out, marked ``…``."""
    rows = m.text_rows
    with_state = any(r.state_total for r in rows)
    names = [visible(r.name) for r in rows]
    label = max(map(len, names))  # whole names: a line runs past the width rather than cut one
    gap = "   "
    blocks = 2 if with_state else 1
    room = len(m.steps) if width is None else max(3, (width - label - len(gap) * blocks) // (2 * blocks))
    shown = columns(len(m.steps), room)
    cells = 2 * len(shown)
    block = max(cells, len("parameters"))
    out: list[list[tuple[str, str]]] = []
    head = [(" " * label + gap, ""), ("parameters".ljust(block), "bold")]
    out.append(head + ([(gap + "optimizer state", "bold")] if with_state else []))
    at = m.steps.index(m.responsible_step) if m.responsible_step in m.steps else None
    if at is not None and at in shown:
        mark = (" " * (2 * shown.index(at)) + "▼").ljust(block)
        out.append([(" " * label + gap, ""), (mark, "bold red")] + ([(gap + mark, "bold red")] if with_state else []))

    def cells_of(counts: list[int], total: int, present: bool = True) -> list[tuple[str, str]]:
        return [("… ", "dim") if i is None else (SHADES[level(counts[i], total)], STYLES[level(counts[i], total)])
                if present else ("  ", "") for i in shown]

    for r, name in zip(rows, names):
        line = [(name.ljust(label) + gap, "")] + cells_of(r.params_nonfinite, r.params_total)
        line.append((" " * (block - cells), ""))
        if with_state:
            line += [(gap, "")] + cells_of(r.state_nonfinite, r.state_total, bool(r.state_total))
        out.append(line)
    marked = f", ▼ the responsible step {m.responsible_step}" if at is not None and at in shown else ""
    out.append([(f"non-finite values after each of {span(m.steps[0], m.steps[-1])}{marked}", "dim")])
    if None in shown:
        out.append([(f"… {count(len(m.steps) - len(shown) + 1, 'step')} in the middle left out (every one in the "
                     "JSON report)", "dim")])
    out.append([("  ".join(f"{s} {n}" for s, n in zip(SHADES, LEVEL_NAMES)), "dim")])
    if len(rows) < len(m.rows):
        out.append([(f"{count(len(m.rows), 'tensor')} shown as {count(len(rows), 'layer')}", "dim")])
    return out


def render_terminal(m: SpreadMap, console: Console) -> None:
    whole = " (whole model; per tensor in a post-mortem)" if m.basis == "totals" else ""
    title = "spread of non-finite values" + whole
    console.print(Text(title, style="bold"))
    for line in lines(m, console.width):
        console.print(Text.assemble(*line), no_wrap=True, crop=False)


TEXT_WIDTH = 120  # a Markdown code block's, which no console sizes


def render_text(m: SpreadMap) -> str:
    """Plain characters, for a Markdown code block."""
    return "\n".join("".join(text for text, _ in line).rstrip() for line in lines(m, TEXT_WIDTH))
