"""The view of a repair: what changed, what was written, and the replay that verifies it."""

from __future__ import annotations

import math
from typing import Any

from rich.console import Console, Group
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

from ..replay.repair import RepairReport
from .escaping import markup, visible
from .layout import print_whole


def _loss_range(losses: list[float | None]) -> str:
    values = [x for x in losses if x is not None]
    if not values:
        return "-"
    shown = [f"{x:.4g}" if math.isfinite(x) else str(x) for x in (values[0], values[-1])]
    return shown[0] if len(values) == 1 else f"{shown[0]} -> {shown[1]}"


def render_repair_terminal(r: RepairReport, console: Console) -> None:
    style, word = ("bold white on green", "REPAIRED") if r.written else ("bold white on red", "NOT WRITTEN")
    title = Text.assemble((f" {word} ", style), "  ", (visible(f"{r.change} at step {r.responsible_step}"), "bold"))
    facts = Table.grid(padding=(0, 2))
    facts.add_column(style="dim")
    facts.add_column()
    facts.add_row("run", markup(r.run))
    facts.add_row("change", markup(f"step {r.responsible_step}: {r.description}"))
    facts.add_row("checkpoint", markup(f"{r.checkpoint}  (state before step {r.resume_step})" if r.written
                                       else f"none written to {r.out}"))
    v = r.verification
    check = Table(title=markup("verification: " + v.description), title_justify="left", show_edge=False)
    for col in ("steps", "stays finite", "first non-finite", "loss"):
        check.add_column(col)
    check.add_row(f"{v.step}-{v.last_step}" if v.losses else "none logged", "yes" if v.finite else "no",
                  "-" if v.finite else markup(f"step {v.first_nonfinite_step}: {v.first_nonfinite}"), _loss_range(v.losses),
                  style="green" if v.finite else "red")
    parts: list[Any] = [facts, Text(), check, Text(), Text("\n".join(f"- {visible(f)}" for f in r.findings))]
    print_whole(console, Panel(Group(*parts), title=title, title_align="left", border_style=style.split()[-1]))
