"""Reports are plain dataclasses; this turns them into JSON (the one machine-readable view)."""

from __future__ import annotations

import dataclasses
import json
import math
import sys
from pathlib import Path
from typing import Any

from .runs.files import write_bytes_atomic


def to_jsonable(obj: Any) -> Any:
    """Dataclasses become dicts; non-finite floats become "nan"/"inf"/"-inf" (JSON has no such numbers)."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: to_jsonable(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, dict):
        return {str(k): to_jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [to_jsonable(v) for v in obj]
    if isinstance(obj, Path):
        return str(obj)
    if isinstance(obj, float) and not math.isfinite(obj):
        return "nan" if math.isnan(obj) else ("inf" if obj > 0 else "-inf")
    return obj


def to_json(report: Any) -> str:
    return json.dumps(to_jsonable(report), indent=2, allow_nan=False) + "\n"


def write_json(report: Any, destination: str) -> None:
    """``-`` is stdout; a path is written atomically, so a failed run leaves an earlier report as it was."""
    text = to_json(report)
    if destination == "-":
        sys.stdout.write(text)
        sys.stdout.flush()
    else:
        write_bytes_atomic(Path(destination), text.encode(), durable=False)
