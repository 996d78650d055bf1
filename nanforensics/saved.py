"""Saved JSON reports read back into their dataclasses, so ``nanforensics report`` re-renders without replaying."""

from __future__ import annotations

from pathlib import Path

from .checkpoints.bisect import BISECT_SCHEMA, BisectReport
from .errors import BadInput, shown
from .inputs import examine, load_json
from .postmortem import POSTMORTEM_SCHEMA, PostmortemReport
from .replay.spread import layered
from .report import REPLAY_SCHEMA, ReplayReport
from .rootcause.findings import narrate
from .schema import load

SavedReport = ReplayReport | BisectReport | PostmortemReport
SCHEMAS: dict[str, type] = {REPLAY_SCHEMA: ReplayReport, BISECT_SCHEMA: BisectReport,
                            POSTMORTEM_SCHEMA: PostmortemReport}


def load_report(path: Path) -> SavedReport:
    """The report saved at ``path``; a file of another schema, or a newer version of one, is refused by name."""
    examine(path)
    data = load_json(path)
    schema = data.get("schema") if isinstance(data, dict) else None
    if schema not in SCHEMAS:
        family = str(schema).rpartition("/")[0]
        newer = next((s for s in SCHEMAS if s.rpartition("/")[0] == family), None)
        if newer is not None:
            raise BadInput(path, f"schema {shown(schema)} is not {newer!r}, the version this nanforensics reads; upgrade it")
        what = f"schema {shown(schema)}" if schema is not None else 'no "schema" field'
        raise BadInput(path, f"not a report nanforensics re-renders ({what}; it reads {', '.join(SCHEMAS)})")
    report = load(SCHEMAS[schema], data, path, "report")
    replay = report if isinstance(report, ReplayReport) else report.replay if isinstance(report, PostmortemReport) \
        else report.replayed
    if replay is not None and not replay.headline:  # written before reports carried their sentences
        narrate(replay)
    for m in (replay.spread_map if replay is not None else None,
              report.tensor_spread if isinstance(report, PostmortemReport) else None):
        if m is not None:
            layered(m)  # the rows drawn are derived from the rows measured, never taken from the file
    return report
