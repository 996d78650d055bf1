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
