"""Progress of long work as events: the library says which phase it is in and how far along it is; a caller draws
it (the command line: a bar on a terminal, plain lines in a CI log). The library itself never prints.

A phase is one piece of work with a unit and, where known, a total: ``replaying steps 0-1902`` (steps),
``attributing samples`` (passes of the whole step, at most n), ``what-if`` (replays). ``update`` says how many
units are done, and may revise the total when the work learns where it ends (a replay that stops early).
"""

from __future__ import annotations

from typing import Protocol


class Progress(Protocol):
    def phase(self, what: str, total: int | None = None, unit: str = "step", at_most: bool = False) -> None:
        """A new phase begins; ``total`` units (an upper bound when ``at_most``), None when unknown."""

    def update(self, done: int, total: int | None = None) -> None:
        """``done`` units of the current phase are done; ``total`` revises the phase's total where given."""


class Silent:
    """Progress that goes nowhere: the default of every library call."""

    def phase(self, what: str, total: int | None = None, unit: str = "step", at_most: bool = False) -> None:
        pass

    def update(self, done: int, total: int | None = None) -> None:
        pass


SILENT = Silent()


class BytesRead:
    """A checkpoint scan's bytes read (``checkpoints.scan.Progress``) as phases of ``progress``: one per file."""

    def __init__(self, progress: Progress) -> None:
        self.progress, self.done = progress, 0

    def start(self, label: str, total_bytes: int) -> None:
        self.done = 0
        self.progress.phase(f"reading {label}", total_bytes, unit="byte")

    def advance(self, nbytes: int) -> None:
        self.done += nbytes
        self.progress.update(self.done)
