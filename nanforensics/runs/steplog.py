"""steps.jsonl: the loss the user's loop logged at each step."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

from ..errors import BadInput, shown
from ..finite import decode_float, encode_float
from ..inputs import excerpt, read_input

MAX_STEP = 2**63 - 1  # a step number beyond int64 is damage: nothing counts steps that far


def is_step(value: object) -> bool:
    """A step number: an int (not a float, not a bool) from 0 to ``MAX_STEP``."""
    return type(value) is int and 0 <= value <= MAX_STEP


def step_line(step: int, loss: float) -> str:
    return json.dumps({"step": step, "loss": encode_float(loss)}) + "\n"


@dataclass(frozen=True)
class LoggedStep:
    step: int
    loss: float


def read_steps(path: Path) -> list[LoggedStep]:
    """Every complete line; a torn last line (a job killed mid-write) is dropped, garbage elsewhere is an error."""
    raw = read_input(path)
    # The piece after the last newline is empty, or a line cut short by a killed writer: dropped.
    lines = raw.split(b"\n")[:-1]
    steps: list[LoggedStep] = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
            step, loss = obj["step"], decode_float(obj["loss"])
        except (ValueError, KeyError, TypeError, RecursionError):
            raise BadInput(path, f"line {number} is not a step record: {excerpt(line)}") from None
        if not is_step(step):
            raise BadInput(path, f"line {number}: step {shown(step)} is not a step number (an integer from 0 to "
                                 "2^63-1)")
        entry = LoggedStep(step, loss)
        if steps and entry.step != steps[-1].step + 1:
            raise BadInput(path, f"line {number}: step {entry.step} follows step {steps[-1].step}")
        steps.append(entry)
    return steps


def first_nonfinite(steps: list[LoggedStep]) -> int | None:
    return next((s.step for s in steps if not math.isfinite(s.loss)), None)
