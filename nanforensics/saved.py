"""Saved JSON reports read back into their dataclasses, so ``nanforensics report`` re-renders without replaying."""

from __future__ import annotations

from pathlib import Path

from .checkpoints.bisect import BISECT_SCHEMA, BisectReport
from .errors import BadInput
from .postmortem import POSTMORTEM_SCHEMA, PostmortemReport
from .report import REPLAY_SCHEMA, ReplayReport, from_jsonable
from .runs.files import load_json

SavedReport = ReplayReport | BisectReport | PostmortemReport
SCHEMAS: dict[str, type] = {REPLAY_SCHEMA: ReplayReport, BISECT_SCHEMA: BisectReport,
                            POSTMORTEM_SCHEMA: PostmortemReport}


def load_report(path: Path) -> SavedReport:
    """The report saved at ``path``; a file of another schema, or a newer version of one, is refused by name."""
    data = load_json(path)
    schema = data.get("schema") if isinstance(data, dict) else None
    if schema not in SCHEMAS:
        family = str(schema).rpartition("/")[0]
        newer = next((s for s in SCHEMAS if s.rpartition("/")[0] == family), None)
        if newer is not None:
            raise BadInput(path, f"schema {schema!r} is not {newer!r}, the version this nanforensics reads; upgrade it")
        what = f"schema {schema!r}" if schema is not None else 'no "schema" field'
        raise BadInput(path, f"not a report nanforensics re-renders ({what}; it reads {', '.join(SCHEMAS)})")
    try:
        return from_jsonable(SCHEMAS[schema], data)
    except ValueError as e:
        raise BadInput(path, f"malformed {schema} report: {e}") from None
