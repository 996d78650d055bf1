"""Views of a PostmortemReport: rich for the CI log, Markdown for $GITHUB_STEP_SUMMARY, JUnit XML for test
dashboards. The replay and bisect sections are those commands' own views."""

from __future__ import annotations

import io
import xml.etree.ElementTree as ET
from typing import Any

from rich.console import Console, Group
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

from ..postmortem import DONE, FAILED, SKIPPED, PostmortemReport
from ..report import SpreadMap
from ..rootcause.findings import step_not_data
from . import checkpoints, heatmap, replay
from .escaping import visible, xml_document
from .layout import print_whole

VERDICT = {
    "nonfinite": ("bold white on red", "NON-FINITE"),
    "clean": ("bold white on green", "CLEAN"),
    "not_reproduced": ("bold black on yellow", "NOT REPRODUCED"),
    "loss_only": ("bold black on yellow", "LOSS ONLY"),
}
_STATUS_STYLE = {DONE: "green", SKIPPED: "yellow", FAILED: "red"}


def spread_map(r: PostmortemReport) -> SpreadMap | None:
    """Per tensor where the post-mortem measured it, else the replay's whole-model totals."""
    if r.tensor_spread is not None:
        return r.tensor_spread
    return r.replay.spread_map if r.replay is not None else None


def label(name: str) -> str:
    return name.replace("_", " ")


def render_terminal(r: PostmortemReport, console: Console) -> None:
    style, word = VERDICT[r.verdict]
    table = Table.grid(padding=(0, 2))
    table.add_column(style="dim")
    table.add_column(no_wrap=True)
    table.add_column()
    kind = "a recorded run" if r.kind == "run" else "checkpoints only"
    table.add_row("directory", "", Text(f"{visible(r.directory)}  ({kind})"))  # Text: paths and errors are not markup
    for a in r.analyses:
        table.add_row(Text(visible(label(a.name))), Text(visible(a.status), style=_STATUS_STYLE.get(a.status, "")),
                      Text(visible(a.detail)))
    parts: list[Any] = [Text(visible(r.headline), style="bold"), Text(), table]
    if r.findings:
        parts += [Text(), Text("\n".join(f"- {visible(f)}" for f in r.findings))]
    title = Text.assemble((f" {word} ", style), "  ", ("nanforensics post-mortem", "bold"))
    print_whole(console, Panel(Group(*parts), title=title, title_align="left", border_style=style.split()[-1]))
    m = spread_map(r)
    if m is not None:
        heatmap.render_terminal(m, console)
    if r.replay is not None:
        replay.render_terminal(r.replay, console)
    elif r.checkpoints is not None:  # the evidence when there is no replay; beside one, the summary row suffices
        checkpoints.render_bisect_terminal(r.checkpoints, console)


def failure_message(r: PostmortemReport) -> str:
    """One line for a CI dashboard: the responsible step, its batch and the origin, or the window."""
    batch = r.replay.responsible_batch if r.replay is not None and r.responsible_step is not None else None
    return r.headline + (f" (batch {batch.file})" if batch and not step_not_data(r.replay) else "")


def render_text(r: PostmortemReport, width: int = 100) -> str:
    """The terminal view as plain text, without colour or markup: what the CI log shows."""
    console = Console(file=io.StringIO(), width=width, color_system=None, highlight=False, emoji=False)
    render_terminal(r, console)
    return console.file.getvalue()  # type: ignore[attr-defined]


def render_junit(r: PostmortemReport) -> str:
    """A suite with the diagnosis as one test case (failed unless clean) and one case per analysis.

    Test-case names are the same for every run (the directory is a suite property), so a dashboard's history
    lines up across runs; each case has its ``time``, the suite its ``timestamp``; the failure body is the
    plain-text report.
    """
    failures = int(r.verdict != "clean")
    errors = sum(a.status == FAILED for a in r.analyses)
    skipped = sum(a.status == SKIPPED for a in r.analyses)
    total = sum(a.seconds or 0.0 for a in r.analyses)
    suite = ET.Element("testsuite", name="nanforensics.postmortem", tests=str(1 + len(r.analyses)),
                       failures=str(failures), errors=str(errors), skipped=str(skipped), time=f"{total:.3f}",
                       **({"timestamp": r.started} if r.started else {}))
    ET.SubElement(ET.SubElement(suite, "properties"), "property", name="directory", value=r.directory)
    case = ET.SubElement(suite, "testcase", classname="nanforensics.postmortem", name="no non-finite values",
                         time=f"{total:.3f}")
    if failures:
        failure = ET.SubElement(case, "failure", type=r.verdict, message=failure_message(r))
        failure.text = "\n" + render_text(r)
    for a in r.analyses:
        case = ET.SubElement(suite, "testcase", classname="nanforensics.postmortem.analysis", name=a.name,
                             time=f"{a.seconds or 0.0:.3f}")
        if a.status == FAILED:
            ET.SubElement(case, "error", message=a.detail)
        elif a.status == SKIPPED:
            ET.SubElement(case, "skipped", message=a.detail)
        else:
            ET.SubElement(case, "system-out").text = a.detail
    root = ET.Element("testsuites", name="nanforensics", tests=suite.get("tests", "0"), failures=str(failures),
                      errors=str(errors), skipped=str(skipped), time=f"{total:.3f}")
    root.append(suite)
    return xml_document(root)
