"""The one error type the CLI turns into a one-line message and exit code 2."""

from __future__ import annotations

from pathlib import Path


class BadInput(Exception):
    """Input the tool cannot use: names the file (or option) and what is wrong with it."""

    def __init__(self, where: str | Path | None, problem: str) -> None:
        self.where = str(where) if where is not None else None
        self.problem = problem
        self.rank: int | None = None  # under torchrun: the rank it arose on, once the ranks replay apart
        super().__init__(f"{self.where}: {problem}" if self.where else problem)


def shown(value: object, limit: int = 40) -> str:
    """A value from a damaged file, short enough for an error line; an int of thousands of digits, whose ``str``
    would raise, is described by its size instead."""
    if isinstance(value, int) and value.bit_length() > 64:
        return f"<an integer of {value.bit_length()} bits>"
    try:
        text = repr(value)
    except RecursionError:
        return f"<a {type(value).__name__} nested too deeply>"
    return text if len(text) <= limit else text[:limit - 3] + "..."
