"""The library's progress events (``nanforensics.progress``) drawn on stderr: a bar on a terminal; in a log or a
pipe, one plain line per phase and at most one progress line every few seconds, so a CI log never looks hung.

Every view also remembers where the work is, so that an interrupted command can say what it was doing.
"""

from __future__ import annotations

import os
import time
from contextlib import contextmanager
from typing import Callable, Iterator

from rich.console import Console
from rich.progress import BarColumn, Progress, TaskID, TextColumn, TimeElapsedColumn, TimeRemainingColumn

from ..words import count
from .escaping import markup, visible

INTERVAL_ENV = "NANFORENSICS_PROGRESS_SECONDS"
INTERVAL_S = 5.0  # in a log, the least time between two progress lines of one phase


def _amount(n: int, unit: str) -> str:
    if unit == "byte":
        return f"{n / 1e6:,.1f} MB"
    return count(n, unit, unit + "es" if unit.endswith("s") else None)


def _seconds(s: float) -> str:
    s = round(s)
    return f"{s // 60} min {s % 60:02d} s" if s >= 60 else f"{s} s"


class Tracker:
    """Where the work is: the phase, its units and how many are done. Draws nothing (``--quiet``)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self.what: str | None = None
        self.total: int | None = None
        self.unit, self.at_most, self.done, self.began = "step", False, 0, clock()

    def phase(self, what: str, total: int | None = None, unit: str = "step", at_most: bool = False) -> None:
        self.what, self.total, self.unit, self.at_most, self.done, self.began = (what, total, unit, at_most, 0,
                                                                                 self.clock())

    def update(self, done: int, total: int | None = None) -> None:
        self.done = done
        if total is not None:
            self.total = total
        if self.total is not None and done >= self.total:
            self.at_most = False  # a bound reached is the total

    def where(self) -> str:
        """``replaying steps 0-1902 (523 of 1,903 steps)``; empty before the first phase."""
        if self.what is None:
            return ""
        if self.total is None:
            return self.what
        return f"{self.what} ({self.done:,} of {'at most ' if self.at_most else ''}{_amount(self.total, self.unit)})"

    def eta(self) -> str:
        """``about 31 s left`` (``at most`` for a bound); empty until a unit is done or where no total is known."""
        if self.total is None or self.done <= 0 or self.done >= self.total:
            return ""
        left = (self.clock() - self.began) / self.done * (self.total - self.done)
        return f"{'at most' if self.at_most else 'about'} {_seconds(left)} left"


def prefix(command: str) -> str:
    """What every progress line in a log starts with, ``nanforensics: [replay] ``: the command, and never a line an
    error or a report starts with."""
    return f"nanforensics: [{command}] "


class LogLines(Tracker):
    """Plain lines for a log: the phase as it begins, then a progress line at most every ``interval`` seconds."""

    def __init__(self, write: Callable[[str], None], command: str, interval: float = INTERVAL_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__(clock)
        self.write, self.prefix, self.interval, self.last = write, prefix(command), interval, clock()

    def phase(self, what: str, total: int | None = None, unit: str = "step", at_most: bool = False) -> None:
        super().phase(what, total, unit, at_most)
        self.last = self.began
        size = f" ({'at most ' if at_most else ''}{_amount(total, unit)})" if total is not None else ""
        self.write(f"{self.prefix}{what}{size}")

    def update(self, done: int, total: int | None = None) -> None:
        super().update(done, total)
        now = self.clock()
        if now - self.last < self.interval:
            return
        self.last = now
        eta = self.eta()
        self.write(f"{self.prefix}{self.where()}, {_seconds(now - self.began)} elapsed" + (f", {eta}" if eta else ""))


class Bar(Tracker):
    """A transient bar on a terminal: the phase, units done of the total, elapsed and remaining time."""

    def __init__(self, console: Console) -> None:
        super().__init__()
        self.bar = Progress(TextColumn("{task.description}"), BarColumn(), TextColumn("{task.fields[amount]}"),
                            TimeElapsedColumn(), TimeRemainingColumn(), console=console, transient=True)
        self.task: TaskID | None = None

    def phase(self, what: str, total: int | None = None, unit: str = "step", at_most: bool = False) -> None:
        super().phase(what, total, unit, at_most)
        if self.task is not None:
            self.bar.remove_task(self.task)
        self.task = self.bar.add_task(markup(what), total=total, amount="")
        self._show()

    def update(self, done: int, total: int | None = None) -> None:
        super().update(done, total)
        self._show()

    def _show(self) -> None:
        if self.task is None:
            return
        amount = f"{self.done:,}/{'≤' if self.at_most else ''}{_amount(self.total, self.unit)}" \
            if self.total is not None else _amount(self.done, self.unit)
        self.bar.update(self.task, completed=self.done, total=self.total, amount=amount)


def interval() -> float:
    """The least seconds between progress lines in a log: $NANFORENSICS_PROGRESS_SECONDS, else 5."""
    try:
        return max(0.0, float(os.environ.get(INTERVAL_ENV, INTERVAL_S)))
    except ValueError:
        return INTERVAL_S


@contextmanager
def progress_view(console: Console, command: str, shown: bool = True) -> Iterator[Tracker]:
    """The view for ``console`` (stderr): a bar on a terminal, lines in a log; a tracker that draws nothing when
    not ``shown`` (``--quiet``, or a rank other than 0 under torchrun)."""
    if not shown:
        yield Tracker()
    elif console.is_terminal:
        view = Bar(console)
        with view.bar:
            yield view
    else:
        yield LogLines(lambda line: console.print(visible(line), markup=False, highlight=False, soft_wrap=True), command,
                       interval())
