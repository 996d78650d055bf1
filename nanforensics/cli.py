"""The command line: parses arguments, calls the library, renders. No logic of its own."""

from __future__ import annotations

import os
import sys
from contextlib import contextmanager
from pathlib import Path
from typing import Annotated, Callable, Iterator, Optional

import typer
from rich.console import Console

from .errors import BadInput

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  help="Forensics for training runs that died with NaN: name the batch responsible.")



@app.callback()
def _commands() -> None:
    """Forensics for training runs that died with NaN: name the batch responsible."""


EXIT_CLEAN, EXIT_FOUND, EXIT_BAD_INPUT, EXIT_NOT_REPRODUCED = 0, 1, 2, 3


def stdout_console() -> Console:
    return Console(highlight=False)


def stderr_console() -> Console:
    return Console(stderr=True, highlight=False)


@contextmanager
def step_progress(what: str) -> Iterator[Optional[Callable[[int, int, int], None]]]:
    """A transient progress bar on stderr when it is a terminal; nothing in logs and pipes."""
    console = stderr_console()
    if not console.is_terminal:
        yield None
        return
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    with Progress(TextColumn(f"{what} step {{task.fields[step]}}"), BarColumn(), MofNCompleteColumn(),
                  TimeElapsedColumn(), console=console, transient=True) as bar:
        task = bar.add_task(what, total=None, step="")

        def update(step: int, first: int, last: int) -> None:
            bar.update(task, completed=step - first + 1, total=last - first + 1, step=step)

        yield update


def emit_json(report: object, destination: Optional[str]) -> None:
    if destination is None:
        return
    from .report import write_json

    try:
        write_json(report, destination)
    except OSError as e:
        raise BadInput(destination, f"cannot write the JSON report ({e.strerror or e})") from None


# ---- commands ---------------------------------------------------------------------------------

_REPLAY_EXIT = {"clean": EXIT_CLEAN, "nonfinite": EXIT_FOUND, "not_reproduced": EXIT_NOT_REPRODUCED}


def emit_markdown(text: str, destination: Optional[str]) -> None:
    if destination is None:
        return
    from .runs.files import write_bytes_atomic

    try:
        write_bytes_atomic(Path(destination), text.encode(), durable=False)
    except OSError as e:
        raise BadInput(destination, f"cannot write the Markdown report ({e.strerror or e})") from None


@app.command()
def replay(
    run_dir: Annotated[Path, typer.Argument(help="Run directory written by nanforensics.Recorder.")],
    from_step: Annotated[Optional[int], typer.Option(help="Replay from the last checkpoint at or before this "
                                                          "step, instead of before the first NaN loss.")] = None,
    device: Annotated[str, typer.Option(help="auto (cuda when present), cpu or cuda.")] = "auto",
    after: Annotated[int, typer.Option(min=0, help="Steps replayed after every parameter is non-finite.")] = 1,
    max_steps: Annotated[Optional[int], typer.Option(min=1, help="Replay at most this many steps.")] = None,
    json_out: Annotated[Optional[str], typer.Option("--json", help="Write the report as JSON to PATH (- for "
                                                                   "stdout, which silences the terminal view).")] = None,
    markdown: Annotated[Optional[str], typer.Option(help="Write the report as Markdown to PATH.")] = None,
    code_path: Annotated[Optional[list[Path]], typer.Option(help="Folder to import the run's model and step "
                                                                 "function from (repeatable).")] = None,
    trust_run_dir: Annotated[bool, typer.Option(help="Allow importing code that lies inside the run "
                                                     "directory.")] = False,
) -> None:
    """Replay a run's steps with per-step checks; name the batch and coordinate where NaN began.

    Exit codes: 0 no non-finite value, 1 found and attributed, 2 bad input, 3 logged NaN not reproduced.
    """
    from .replay import ReplayOptions, replay_run
    from .views.replay import render_markdown, render_terminal

    options = ReplayOptions(from_step=from_step, device=device, after=after, max_steps=max_steps,
                            code_paths=code_path or [], trust_run_dir=trust_run_dir)
    with step_progress("replaying") as progress:
        report = replay_run(run_dir, options, progress=progress)
    emit_json(report, json_out)
    emit_markdown(render_markdown(report), markdown)
    if json_out != "-":
        render_terminal(report, stdout_console())
    raise typer.Exit(_REPLAY_EXIT[report.verdict])


# ---- entry point ------------------------------------------------------------------------------


def main() -> None:
    """Bad input becomes one line on stderr and exit code 2, never a traceback.

    Usage errors are click's own (exit code 2 too); everything else unforeseen is one line as well,
    with the traceback behind NANFORENSICS_DEBUG=1.
    """
    try:
        app()
    except BadInput as e:
        stderr_console().print(f"nanforensics: error: {e}", markup=False, soft_wrap=True)
        sys.exit(EXIT_BAD_INPUT)
    except Exception as e:
        if os.environ.get("NANFORENSICS_DEBUG"):
            raise
        stderr_console().print(f"nanforensics: error: {e.__class__.__name__}: {e} "
                               "(set NANFORENSICS_DEBUG=1 for the traceback)", markup=False, soft_wrap=True)
        sys.exit(EXIT_BAD_INPUT)
