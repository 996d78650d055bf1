"""The command line: parses arguments, calls the library, renders. No logic of its own."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.console import Console

from .errors import BadInput

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  help="Forensics for training runs that died with NaN: name the batch responsible.")

EXIT_CLEAN, EXIT_FOUND, EXIT_BAD_INPUT, EXIT_NOT_REPRODUCED = 0, 1, 2, 3


def stdout_console() -> Console:
    return Console(highlight=False)


def stderr_console() -> Console:
    return Console(stderr=True, highlight=False)


def emit_json(report: object, destination: Optional[str]) -> None:
    if destination is None:
        return
    from .report import write_json

    try:
        write_json(report, destination)
    except OSError as e:
        raise BadInput(destination, f"cannot write the JSON report ({e.strerror or e})") from None


# ---- commands ---------------------------------------------------------------------------------


# ---- entry point ------------------------------------------------------------------------------


def main() -> None:
    """Bad input becomes one line on stderr and exit code 2, never a traceback."""
    try:
        app(standalone_mode=False)
    except BadInput as e:
        stderr_console().print(f"nanforensics: error: {e}", markup=False, soft_wrap=True)
        sys.exit(EXIT_BAD_INPUT)
    except typer.Exit as e:
        sys.exit(e.exit_code)
    except (typer.Abort, KeyboardInterrupt):
        stderr_console().print("nanforensics: aborted")
        sys.exit(130)
    except Exception as e:  # click's usage errors and anything unforeseen
        import click

        if isinstance(e, click.ClickException):
            e.show()
            sys.exit(EXIT_BAD_INPUT)
        if os.environ.get("NANFORENSICS_DEBUG"):
            raise
        stderr_console().print(f"nanforensics: error: {e.__class__.__name__}: {e} "
                               "(set NANFORENSICS_DEBUG=1 for the traceback)", markup=False, soft_wrap=True)
        sys.exit(EXIT_BAD_INPUT)
