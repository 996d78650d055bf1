"""The command line: parses arguments, calls the library, renders. No logic of its own.

Each command imports what it uses when it runs: ``nanforensics --help`` and usage errors load
neither torch nor rich (docs/performance.md has the import times).
"""

from __future__ import annotations

import os
import signal
import sys
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Iterator, Mapping, Optional

import typer
from typer.core import TyperArgument, TyperGroup

from .errors import BadInput
from .outputs import append_output, check_outputs, expand, write_output
from .rootcause import DEFAULT_MAX_ABS
from .runs.paths import existing, run_directory

if TYPE_CHECKING:
    from rich.console import Console

    from .views.progress import Tracker

# Plain click help (no boxes, no <str> tags), rewrapped to the terminal or $COLUMNS as pytest's and ruff's is.
app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False, rich_markup_mode=None,
                  context_settings={"help_option_names": ["-h", "--help"]},
                  help="Forensics for training runs that died with NaN: name the batch responsible.")


def _print_version(asked: bool) -> None:
    if asked:
        from . import __version__

        typer.echo(f"nanforensics {__version__}")
        raise typer.Exit()


@app.callback()
def _commands(
    version: Annotated[bool, typer.Option("--version", "-V", callback=_print_version, is_eager=True,
                                          help="Print the version and exit.")] = False,
) -> None:
    """Forensics for training runs that died with NaN: name the batch responsible."""


EXIT_CLEAN, EXIT_FOUND, EXIT_BAD_INPUT, EXIT_NOT_REPRODUCED, EXIT_LOSS_ONLY, EXIT_UNSOUND = 0, 1, 2, 3, 4, 5
EXIT_INTERRUPTED = 130  # Ctrl-C, as shells report a process SIGINT ended (128 + 2)


def stdout_console() -> Console:
    from rich.console import Console

    return Console(highlight=False, emoji=False)  # ":skull:" in a run's name stays text, as markup does


def stderr_console() -> Console:
    from rich.console import Console

    return Console(stderr=True, highlight=False, emoji=False)


def say(line: str) -> None:
    """One line on stderr, through ``visible``: a file name or import string from a run neither acts on the
    terminal nor breaks the line (every error is one line)."""
    from .views.escaping import visible

    stderr_console().print(visible(line), markup=False, soft_wrap=True)


QuietOption = Annotated[bool, typer.Option("--quiet", "-q", help="No progress on stderr (phases, bars, progress "
                                                                  "lines).")]

_ACTIVITY: dict[str, object] = {}  # what the command is doing, for the message of an interrupt (Ctrl-C)


@contextmanager
def progress(command: str, quiet: bool = False, shown: bool = True) -> Iterator[Tracker]:
    """The library's progress drawn on stderr (views/progress.py): a bar on a terminal, plain lines in a log or a
    pipe; nothing with ``--quiet`` (nor on a rank other than 0 under torchrun: ``shown`` False). Either way it
    tracks the phase, which an interrupt names."""
    from .views.progress import progress_view

    with progress_view(stderr_console(), command, shown=shown and not quiet) as view:
        _ACTIVITY.update(command=command, tracker=view)
        yield view


def checked_outputs(inputs: list[Path], outputs: Mapping[str, Optional[str | Path]], **options: object) -> None:
    """``check_outputs``, and the outputs' state now, so an interrupt can tell whether any was written since."""
    check_outputs(inputs, outputs, **options)  # type: ignore[arg-type]
    _ACTIVITY["outputs"] = {str(p): _signature(str(p)) for p in outputs.values() if p is not None and str(p) != "-"}


def _signature(path: str) -> Optional[tuple[int, int]]:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_mtime_ns, st.st_size


class Interrupted(BaseException):
    """Ctrl-C (SIGINT), raised instead of KeyboardInterrupt, which typer turns into a silent exit 130; a
    BaseException, as KeyboardInterrupt is, so that nothing that reports the user's code's errors takes it for one."""


def _interrupted(signum: int, frame: object) -> None:
    raise Interrupted()


def interrupt_message() -> str:
    """What an interrupt stopped and what it left: the outputs written, which is none until the work is done."""
    tracker = _ACTIVITY.get("tracker")
    where = tracker.where() if tracker is not None else ""  # type: ignore[attr-defined]
    what = f"{_ACTIVITY['command']} interrupted" if "command" in _ACTIVITY else "interrupted"
    outputs = _ACTIVITY.get("outputs", {})
    written = [p for p, sig in outputs.items() if _signature(p) != sig]  # type: ignore[union-attr]
    left = f"already written: {', '.join(written)}" if written else "nothing was written"
    return f"nanforensics: {what}" + (f" while {where}" if where else "") + f"; {left}"


def announce_code(named: list[tuple[str, str]]) -> None:
    """The import strings of the code a command is about to run (field or option, import string), on stderr before
    any is imported."""
    from .distributed.env import reporting

    if named and reporting():  # under torchrun, rank 0 speaks for every rank
        say("nanforensics: run code: " + ", ".join(f"{field}={spec}" for field, spec in named))


_TRUST_CODE_HELP = ("Call the run's model factory, step function and optimizer even where the trust policy refuses "
                    "them (docs/security.md): only for a run you trust.")
TrustPackageOption = Annotated[Optional[list[str]], typer.Option(
    metavar="NAME", help="An installed distribution the run's code may come from, such as transformers for a model "
                         "class of it (repeatable; docs/security.md).")]


_MARKDOWN_HELP = "Write the report as Markdown to PATH (- for stdout)."
CreateDirsOption = Annotated[bool, typer.Option("--create-dirs", help="Create the missing folders of an output path "
                                                                      "(--json, --markdown, ...); without it, an "
                                                                      "output whose folder does not exist is refused.")]


def terminal_view(*destinations: Optional[str]) -> bool:
    """Whether the terminal view is drawn: not when a report goes to stdout (``-``), which it would garble."""
    return "-" not in destinations


def emit_json(report: object, destination: Optional[str]) -> None:
    if destination is None:
        return
    from .report import to_json

    write_output(destination, to_json(report), "--json")


# ---- commands ---------------------------------------------------------------------------------

_REPLAY_EXIT = {"clean": EXIT_CLEAN, "nonfinite": EXIT_FOUND, "not_reproduced": EXIT_NOT_REPRODUCED,
                "loss_only": EXIT_LOSS_ONLY}


def emit_text(text: str, destination: Optional[str], option: str) -> None:
    """A rendered report written atomically to ``destination`` (when given; ``-`` is stdout)."""
    if destination is not None:
        write_output(destination, text, option)


# A run nobody recorded: the user's training script names the callables replay needs.
CodeOption = Annotated[Optional[str], typer.Option(
    "--code", metavar="SCRIPT", help="Training script (train.py) or module (pkg.train) defining build_model(), "
                                     "train_step(model, optimizer, batch), batch_at(step) and make_optimizer(model), "
                                     "for checkpoints written without the recorder.")]
ModelOption = Annotated[Optional[str], typer.Option("--model", metavar="NAME", help="Name of the model factory in "
                                                                                    "--code [default: build_model].")]
StepOption = Annotated[Optional[str], typer.Option("--step", metavar="NAME", help="Name of the step function in "
                                                                                  "--code [default: train_step].")]
BatchesOption = Annotated[Optional[str], typer.Option("--batches", metavar="NAME", help="Name of the function giving "
                                                                                        "the batch of a step in --code "
                                                                                        "[default: batch_at].")]
OptimizerOption = Annotated[Optional[str], typer.Option("--optimizer", metavar="NAME", help="Name of the optimizer "
                                                                                            "factory in --code "
                                                                                            "[default: make_optimizer].")]
SchedulerOption = Annotated[Optional[str], typer.Option("--scheduler", metavar="NAME", help="Name of an LR scheduler "
                                                                                            "factory in --code; the step "
                                                                                            "function then gets "
                                                                                            "scheduler=.")]


def code_names(code: Optional[str], **names: Optional[str]) -> dict[str, Optional[str]]:
    """The callables' names by role; naming one without --code is a usage error."""
    given = [f"--{role}" for role, name in names.items() if name]
    if code is None and given:
        raise BadInput(given[0], "names a callable in the training script: give the script with --code")
    return names


def code_inputs(code: str) -> list[Path]:
    """A --code script is an input the outputs must not overwrite; a module name is none."""
    return [Path(code)] if code.endswith(".py") else []


@app.command(short_help="Replay a run; name the batch where NaN began.")
def replay(
    run_dir: Annotated[Optional[Path], typer.Argument(metavar="RUN_DIR", help="Run directory written by "
                                                                              "nanforensics.Recorder (or --checkpoint "
                                                                              "with --code).", readable=False)] = None,
    checkpoint: Annotated[Optional[Path], typer.Option(metavar="CHECKPOINT", help="A checkpoint your trainer wrote "
                                                                                  "(torch.save dict, Lightning .ckpt, "
                                                                                  "Hugging Face checkpoint-N folder, "
                                                                                  "...), replayed with --code.",
                                                       readable=False)] = None,
    code: CodeOption = None,
    model: ModelOption = None,
    step: StepOption = None,
    batches: BatchesOption = None,
    optimizer: OptimizerOption = None,
    scheduler: SchedulerOption = None,
    from_step: Annotated[Optional[int], typer.Option(metavar="STEP", help="Replay from the last checkpoint at or "
                                                                          "before this step, instead of before the "
                                                                          "first NaN loss; with --checkpoint, the step "
                                                                          "it was saved before.")] = None,
    device: Annotated[str, typer.Option(metavar="DEVICE", help="auto (cuda when present), cpu or cuda.")] = "auto",
    after: Annotated[int, typer.Option(metavar="N", min=0, help="Steps replayed after every parameter is non-finite.")] = 1,
    max_steps: Annotated[Optional[int], typer.Option(metavar="N", min=1, help="Replay at most this many steps (with "
                                                                              "--checkpoint: 100 unless given).")] = None,
    json_out: Annotated[Optional[str], typer.Option("--json", metavar="PATH", help="Write the report as JSON to PATH (- for "
                                                                   "stdout, which silences the terminal view).")] = None,
    markdown: Annotated[Optional[str], typer.Option(metavar="PATH", help=_MARKDOWN_HELP)] = None,
    code_path: Annotated[Optional[list[Path]], typer.Option(metavar="DIR", help="Folder to import the run's model and step "
                                                                 "function from (repeatable).")] = None,
    trust_run_dir: Annotated[bool, typer.Option(help="Allow importing code that lies inside the run "
                                                     "directory (or the checkpoint's folder).")] = False,
    trust_package: TrustPackageOption = None,
    trust_code: Annotated[bool, typer.Option(help=_TRUST_CODE_HELP)] = False,
    explain: Annotated[bool, typer.Option(help="Find the operation and the samples behind the responsible "
                                               "step (re-runs that one step).")] = True,
    data_max_abs: Annotated[float, typer.Option(metavar="VALUE", help="Batch values beyond this magnitude are reported as data "
                                                     "defects.")] = DEFAULT_MAX_ABS,
    what_if: Annotated[Optional[list[str]], typer.Option(metavar="CHANGE", help="Replay again from the checkpoint with the "
                                                              "responsible "
                                                              "step changed (repeatable): clip=MAX_NORM, skip, "
                                                              "skip-after-moments, reset-state, lr=VALUE, "
                                                              "drop-samples=I,J, drop-batch.")] = None,
    what_if_steps: Annotated[int, typer.Option(metavar="K", min=0, help="Steps after the responsible one a what-if must stay "
                                                           "finite for.")] = 5,
    read_all: Annotated[bool, typer.Option(help="Read every parameter and optimizer-state tensor at every step, also where "
                                                "the update rule proves them finite (for training code that writes "
                                                "parameters through .data, which the proof cannot see).")] = False,
    create_dirs: CreateDirsOption = False,
    quiet: QuietOption = False,
) -> None:
    """Replay a run's steps with per-step checks; name the batch and coordinate where NaN began.

    A run recorded by nanforensics.Recorder is replayed from RUN_DIR; a run nobody recorded from one of its
    checkpoints (--checkpoint) with the training script's own callables (--code). A distributed run replays with
    every rank emulated on this process, or at world size under
    `torchrun --nproc-per-node N -m nanforensics replay RUN_DIR` (rank 0 writes the report).

    Exit codes: 0 no non-finite value, 1 found and attributed, 2 bad input, 3 logged NaN not reproduced,
    4 a non-finite loss only (no gradient, parameter, optimizer state or buffer went non-finite).
    """
    names = code_names(code, model=model, step=step, batches=batches, optimizer=optimizer, scheduler=scheduler)
    if (run_dir is None) == (checkpoint is None):
        raise BadInput(None, "give a run directory, or --checkpoint with --code (one of the two)")
    if (checkpoint is None) != (code is None):
        raise BadInput("--checkpoint" if code is None else "--code", "--checkpoint and --code go together: the "
                                                                     "script builds what the checkpoint is loaded into")
    if checkpoint is not None and code is not None:  # what needs no tensor first: torch takes seconds to load
        checked_outputs([existing(checkpoint), *map(existing, code_inputs(code)), *(code_path or [])],
                        {"--json": json_out, "--markdown": markdown}, create_dirs=create_dirs)
    else:
        checked_outputs([run_directory(run_dir), *(code_path or [])], {"--json": json_out, "--markdown": markdown},
                        create_dirs=create_dirs)
    from .distributed.world import joined
    from .replay.engine import ReplayOptions, replay_run
    from .replay.session import resolve_device
    from .replay.unrecorded import replay_checkpoint
    from .replay.whatif import parse
    from .runs.run import run_code
    from .runs.unrecorded import code_specs
    from .views.markdown import render_replay
    from .views.replay import render_terminal

    announce_code(code_specs(code, names) if checkpoint is not None and code is not None else run_code(run_dir))
    options = ReplayOptions(from_step=from_step, device=device, after=after, max_steps=max_steps,
                            code_paths=code_path or [], trust_run_dir=trust_run_dir, trust_code=trust_code,
                            trust_packages=trust_package or [], explain=explain,
                            data_max_abs=data_max_abs, what_if=[parse(spec) for spec in what_if or []],
                            what_if_steps=what_if_steps, proof=not read_all)
    with joined(run_dir, resolve_device(device)) as world:
        with progress("replay", quiet, shown=world.writes) as view:
            if checkpoint is not None and code is not None:
                report = replay_checkpoint(checkpoint, code, names, options, progress=view)
            else:
                report = replay_run(run_dir, options, progress=view)
        if world.writes:  # under torchrun, rank 0 alone
            emit_json(report, json_out)
            emit_text(render_replay(report), markdown, "--markdown")
            if terminal_view(json_out, markdown):
                render_terminal(report, stdout_console())
        exit_code = world.agree(_REPLAY_EXIT[report.verdict])
    world.exit(exit_code)
    raise typer.Exit(exit_code)


@app.command(short_help="Write a checkpoint that resumes cleanly.")
def repair(
    run_dir: Annotated[Path, typer.Argument(metavar="RUN_DIR", help="Run directory written by nanforensics.Recorder (only read).",
                                            readable=False)],
    out: Annotated[Path, typer.Option(metavar="DIR", help="Folder to write the repaired checkpoint to (created; never inside "
                                           "the run).")],
    reset_state: Annotated[bool, typer.Option("--reset-state", help="Keep the responsible step and zero its "
                                                                    "poisoned optimizer-state coordinates, instead "
                                                                    "of leaving its batch out.")] = False,
    force: Annotated[bool, typer.Option("--force", help="Replace a non-empty --out folder.")] = False,
    verify_steps: Annotated[int, typer.Option(metavar="K", min=0, help="Logged steps replayed from the written checkpoint; all "
                                                          "must stay finite.")] = 5,
    device: Annotated[str, typer.Option(metavar="DEVICE", help="auto (cuda when present), cpu or cuda.")] = "auto",
    json_out: Annotated[Optional[str], typer.Option("--json", metavar="PATH", help="Write the repair report as JSON to PATH (- "
                                                                   "for stdout, which silences the terminal "
                                                                   "view).")] = None,
    code_path: Annotated[Optional[list[Path]], typer.Option(metavar="DIR", help="Folder to import the run's model and step "
                                                                 "function from (repeatable).")] = None,
    trust_run_dir: Annotated[bool, typer.Option(help="Allow importing code that lies inside the run "
                                                     "directory.")] = False,
    trust_package: TrustPackageOption = None,
    trust_code: Annotated[bool, typer.Option(help=_TRUST_CODE_HELP)] = False,
    create_dirs: CreateDirsOption = False,
    quiet: QuietOption = False,
) -> None:
    """Write a checkpoint that resumes cleanly: the responsible batch (or its bad samples) left out, verified.

    Exit codes: 0 written and verified, 1 the repaired run did not stay finite (nothing written), 2 bad input;
    nothing to repair (nothing written): the replay's own, 0 clean, 3 logged NaN not reproduced, 4 a non-finite loss
    only.
    """
    checked_outputs([run_directory(run_dir), *(code_path or [])], {"--out": str(out), "--json": json_out},
                    folders=("--out",), create_dirs=create_dirs)
    from .replay.repair import NothingToRepair, RepairOptions, repair_run
    from .runs.run import run_code
    from .views.repair import render_repair_terminal

    announce_code(run_code(run_dir))
    options = RepairOptions(reset_state=reset_state, verify_steps=verify_steps, force=force, device=device,
                            code_paths=code_path or [], trust_run_dir=trust_run_dir, trust_code=trust_code,
                            trust_packages=trust_package or [])
    try:
        with progress("repair", quiet) as view:
            report = repair_run(run_dir, out, options, progress=view)
    except NothingToRepair as e:
        from .views.escaping import visible

        stdout_console().print(visible(f"nanforensics: nothing to repair: {e.diagnosis.headline}; nothing written to "
                                       f"{out}"), markup=False, soft_wrap=True)
        raise typer.Exit(_REPLAY_EXIT[e.diagnosis.verdict]) from None
    emit_json(report, json_out)
    if terminal_view(json_out):
        render_repair_terminal(report, stdout_console())
    raise typer.Exit(EXIT_CLEAN if report.written else EXIT_FOUND)


_FULL_HELP = "Read and count every tensor instead of stopping at the first non-finite one."
_MARGIN_HELP = "Warn when a tensor's max |x| is within this factor of its dtype's largest finite value."


@app.command(short_help="Scan one checkpoint for non-finite values.")
def scan(
    checkpoint: Annotated[Path, typer.Argument(metavar="CHECKPOINT", help="A .pt/.pth/.safetensors file, a checkpoint "
                                                    "folder of a run (RUN/checkpoints/step_...), a Hugging Face "
                                                    "checkpoint folder or a DeepSpeed ZeRO one (global_stepN).",
                                             readable=False)],
    full: Annotated[bool, typer.Option("--full", help=_FULL_HELP)] = False,
    margin: Annotated[float, typer.Option(metavar="FACTOR", help=_MARGIN_HELP)] = 1000.0,
    json_out: Annotated[Optional[str], typer.Option("--json", metavar="PATH", help="Write the report as JSON to PATH (- for "
                                                                   "stdout, which silences the terminal view).")] = None,
    markdown: Annotated[Optional[str], typer.Option(metavar="PATH", help=_MARKDOWN_HELP)] = None,
    create_dirs: CreateDirsOption = False,
    quiet: QuietOption = False,
) -> None:
    """Scan one checkpoint: every tensor's non-finite values and headroom, model and optimizer state apart.

    Exit codes: 0 clean, 1 poisoned (parameters or optimizer state), 2 bad input, 5 finite but the optimizer state
    unsound (moments Adam cannot produce, a step counter reset, lr or loss scale inf, ...).
    """
    checked_outputs([existing(checkpoint)], {"--json": json_out, "--markdown": markdown}, create_dirs=create_dirs)
    from .checkpoints.scan import CLEAN, scan_checkpoint
    from .formats import open_checkpoint
    from .progress import BytesRead
    from .views.checkpoints import render_scan_terminal
    from .views.markdown import render_scan

    source = open_checkpoint(checkpoint)
    with progress("scan", quiet) as view:
        report = scan_checkpoint(source, full=full, margin=margin, progress=BytesRead(view))
    emit_json(report, json_out)
    emit_text(render_scan(report), markdown, "--markdown")
    if terminal_view(json_out, markdown):
        render_scan_terminal(report, stdout_console())
    raise typer.Exit(EXIT_FOUND if report.verdict != CLEAN else EXIT_UNSOUND if report.unsound else EXIT_CLEAN)


@app.command(short_help="Find the first poisoned checkpoint.")
def bisect(
    checkpoints: Annotated[list[str], typer.Argument(metavar="CHECKPOINT", help="Run directories, folders of checkpoints, globs "
                                                          "(quoted) or checkpoint files.")],
    linear: Annotated[bool, typer.Option("--linear", help="Read every checkpoint instead of bisecting.")] = False,
    full: Annotated[bool, typer.Option("--full", help=_FULL_HELP)] = False,
    margin: Annotated[float, typer.Option(metavar="FACTOR", help=_MARGIN_HELP)] = 1000.0,
    run_replay: Annotated[bool, typer.Option("--replay", help="Then replay the window from the last clean "
                                                              "checkpoint (runs of nanforensics only).")] = False,
    code: CodeOption = None,
    model: ModelOption = None,
    step: StepOption = None,
    batches: BatchesOption = None,
    optimizer: OptimizerOption = None,
    scheduler: SchedulerOption = None,
    max_steps: Annotated[Optional[int], typer.Option(metavar="N", min=1, help="With --code and no poisoned checkpoint: "
                                                                              "steps replayed from the last one "
                                                                              "[default: 100].")] = None,
    device: Annotated[str, typer.Option(metavar="DEVICE", help="With --code or --replay: auto (cuda when present), "
                                                               "cpu or cuda.")] = "auto",
    code_path: Annotated[Optional[list[Path]], typer.Option(metavar="DIR", help="With --code or --replay: folder to "
                                                                                "import the code from (repeatable).")] = None,
    trust_run_dir: Annotated[bool, typer.Option(help="With --code or --replay: allow importing code from inside the "
                                                     "checkpoint's folder or the run directory.")] = False,
    json_out: Annotated[Optional[str], typer.Option("--json", metavar="PATH", help="Write the report as JSON to PATH (- for "
                                                                   "stdout, which silences the terminal view).")] = None,
    markdown: Annotated[Optional[str], typer.Option(metavar="PATH", help=_MARKDOWN_HELP)] = None,
    trust_package: TrustPackageOption = None,
    trust_code: Annotated[bool, typer.Option(help=_TRUST_CODE_HELP + " With --replay or --code.")] = False,
    create_dirs: CreateDirsOption = False,
    quiet: QuietOption = False,
) -> None:
    """Find the first poisoned checkpoint in about log2(n) checkpoint reads; with --code, replay from the last
    clean one to name the step, batch and coordinate.

    Exit codes: 0 none poisoned, 1 poisoned found (or history not monotonic), 2 bad input, 5 none poisoned but a
    checkpoint read holds unsound optimizer state; with --code, the
    replay's: 0 clean, 1 found, 3 a poisoned checkpoint not reproduced from the supplied batches, 4 a non-finite
    loss only.
    """
    names = code_names(code, model=model, step=step, batches=batches, optimizer=optimizer, scheduler=scheduler)
    for option, given, wanted in (("--max-steps", max_steps is not None, code is not None),
                                  *((o, g, code is not None or run_replay) for o, g in (
                                      ("--code-path", bool(code_path)), ("--trust-run-dir", trust_run_dir),
                                      ("--trust-package", bool(trust_package)), ("--trust-code", trust_code),
                                      ("--device", device != "auto")))):
        if given and not wanted:  # every option a command accepts is used, or refused: never ignored
            raise BadInput(option, "is for the replay that follows the bisection: give it with "
                                   f"{'--code' if option == '--max-steps' else '--code or --replay'}")
    if code is not None and run_replay:
        raise BadInput("--code", "replays checkpoints written without the recorder; --replay is for runs of "
                                 "nanforensics: give one of the two")
    checked_outputs(expand(checkpoints) + (code_inputs(code) if code is not None else []) + list(code_path or []),
                    {"--json": json_out, "--markdown": markdown}, create_dirs=create_dirs)
    from .checkpoints.bisect import bisect as bisect_checkpoints
    from .progress import BytesRead
    from .views.checkpoints import render_bisect_terminal
    from .views.markdown import render_bisect

    if code is not None:
        from .runs.unrecorded import code_specs

        announce_code(code_specs(code, names))
    with progress("bisect", quiet) as view:
        if code is None:
            report = bisect_checkpoints(checkpoints, linear=linear, full=full, margin=margin, progress=BytesRead(view))
        else:
            from .replay.engine import ReplayOptions
            from .replay.unrecorded import bisect_and_replay

            report = bisect_and_replay(checkpoints, code, names, ReplayOptions(
                device=device, max_steps=max_steps or 100, code_paths=code_path or [], trust_run_dir=trust_run_dir,
                trust_code=trust_code, trust_packages=trust_package or []), linear=linear, full=full, margin=margin,
                scan_progress=BytesRead(view), progress=view)
    emit_json(report, json_out)
    emit_text(render_bisect(report), markdown, "--markdown")
    if terminal_view(json_out, markdown):
        render_bisect_terminal(report, stdout_console(), offer_replay=not run_replay)
    if report.replayed is not None:
        raise typer.Exit(_REPLAY_EXIT[report.replayed.verdict])
    if run_replay and report.replay is None:
        say(f"nanforensics: no replay: {report.replay_unavailable or 'not a run of nanforensics'}")
    elif run_replay and report.replay is not None:
        from .replay.engine import ReplayOptions, replay_run
        from .runs.run import run_code
        from .views.replay import render_terminal

        announce_code(run_code(Path(report.replay.run)))
        with progress("bisect --replay", quiet) as view:
            replayed = replay_run(report.replay.run, ReplayOptions(
                from_step=report.replay.from_step, device=device, code_paths=code_path or [],
                trust_run_dir=trust_run_dir, trust_code=trust_code, trust_packages=trust_package or []), progress=view)
        if terminal_view(json_out, markdown):
            render_terminal(replayed, stdout_console())
    raise typer.Exit(EXIT_FOUND if report.first_poisoned is not None else
                     EXIT_UNSOUND if any(rec.unsound for rec in report.history) else EXIT_CLEAN)


_SUMMARY_HELP = ("Write the summary as Markdown to PATH; by default it is appended to $GITHUB_STEP_SUMMARY when "
                 "that is set.")


def append_step_summary(text: str, destination: Optional[str]) -> None:
    """GitHub's job summary: appended to the file $GITHUB_STEP_SUMMARY names, as other steps do."""
    if destination is not None:
        append_output(destination, text, "$GITHUB_STEP_SUMMARY")


@app.command(short_help="Examine a failed job's run or checkpoints.")
def postmortem(
    directory: Annotated[Path, typer.Argument(metavar="DIR", help="A failed job's artifact: a run directory, or a folder of "
                                                   "checkpoints.", readable=False)],
    json_out: Annotated[Optional[str], typer.Option("--json", metavar="PATH", help="Write the report as JSON to PATH (- for "
                                                                   "stdout, which silences the terminal view).")] = None,
    markdown: Annotated[Optional[str], typer.Option(metavar="PATH", help=_SUMMARY_HELP)] = None,
    junit: Annotated[Optional[str], typer.Option(metavar="PATH", help="Write JUnit XML to PATH: the diagnosis as a failed test "
                                                      "case.")] = None,
    html: Annotated[Optional[str], typer.Option(metavar="PATH", help="Write a self-contained HTML report to PATH.")] = None,
    trust_code: Annotated[bool, typer.Option(help=_TRUST_CODE_HELP)] = False,
    code_path: Annotated[Optional[list[Path]], typer.Option(metavar="DIR", help="Folder to import the run's model and step "
                                                                 "function from, where they are not importable as "
                                                                 "they are (repeatable).")] = None,
    trust_package: TrustPackageOption = None,
    create_dirs: CreateDirsOption = False,
    quiet: QuietOption = False,
) -> None:
    """Everything the directory allows: step log, checkpoint bisection, replay, spread per tensor.

    Exit codes: 0 no non-finite value, 1 found (pinned to a step, or bracketed), 2 bad input,
    3 logged NaN reproduced neither by the replay nor in the checkpoints, 4 a non-finite loss only (the replay
    found every gradient, parameter, optimizer state and buffer finite).
    """
    summary_file = (os.environ.get("GITHUB_STEP_SUMMARY") or None) if markdown is None else None
    checked_outputs([existing(directory)], {"--json": json_out, "--markdown": markdown, "--junit": junit,
                                            "--html": html, "$GITHUB_STEP_SUMMARY": summary_file},
                    create_dirs=create_dirs)
    from .postmortem import postmortem as examine
    from .runs.run import run_code
    from .views.html import render_html
    from .views.markdown import render_postmortem
    from .views.postmortem import render_junit, render_terminal

    announce_code(run_code(directory))
    with progress("postmortem", quiet) as view:
        report = examine(directory, view, trust_code=trust_code, code_paths=code_path or [],
                         trust_packages=trust_package or [])
    emit_json(report, json_out)
    emit_text(render_junit(report), junit, "--junit")
    emit_text(render_html(report), html, "--html")
    summary = render_postmortem(report)
    if markdown is not None:
        emit_text(summary, markdown, "--markdown")
    else:
        append_step_summary(summary, summary_file)
    if terminal_view(json_out, markdown, junit, html):
        render_terminal(report, stdout_console())
    raise typer.Exit(_REPLAY_EXIT[report.verdict])


@app.command("report", short_help="Re-render a saved JSON report.")
def report_command(
    saved: Annotated[Path, typer.Argument(metavar="REPORT.json", help="A JSON report written by replay, bisect or "
                                                                          "postmortem --json.")],
    markdown: Annotated[Optional[str], typer.Option(metavar="PATH", help="Write it as Markdown to PATH (- for stdout).")] = None,
    html: Annotated[Optional[str], typer.Option(metavar="PATH", help="Write it as a self-contained HTML page to PATH.")] = None,
    create_dirs: CreateDirsOption = False,
) -> None:
    """Re-render a saved report on the terminal, as Markdown or as HTML, without replaying anything."""
    checked_outputs([existing(saved)], {"--markdown": markdown, "--html": html}, create_dirs=create_dirs)
    from .saved import load_report
    from .views.html import render_html
    from .views.markdown import render
    from .views.report import render_terminal

    loaded = load_report(saved)
    emit_text(render(loaded), markdown, "--markdown")
    emit_text(render_html(loaded), html, "--html")
    if terminal_view(markdown, html):
        render_terminal(loaded, stdout_console())


# ---- entry point ------------------------------------------------------------------------------


class _PlainArgument(TyperArgument):
    """An argument as click writes it, ``RUN_DIR``: typer's help adds a type tag (``<path>``) and braces."""

    def display_type_rich(self, ctx: typer.Context) -> None:
        return None

    def _usage_display_name(self) -> str:
        return self.display_name_raw + ("..." if self.nargs != 1 else "")


def _plain_arguments(group: TyperGroup) -> TyperGroup:
    for command in group.commands.values():
        for param in command.params:
            if type(param) is TyperArgument:
                param.__class__ = _PlainArgument
    return group


def main() -> None:
    """Bad input becomes one line on stderr and exit code 2, never a traceback.

    Usage errors are click's own (exit code 2 too); everything else unforeseen is one line as well,
    with the traceback behind NANFORENSICS_DEBUG=1.
    """
    from .distributed.env import exit_on_stop, leave, reporting
    from .views.escaping import unencodable_escaped

    unencodable_escaped(sys.stdout, sys.stderr)
    # Under torchrun, until the ranks agree on the replay's exit code a rank ends early only over an error (exit 2),
    # and torchrun then stops the others: they end with 2 as well.
    exit_on_stop(EXIT_BAD_INPUT)
    signal.signal(signal.SIGINT, _interrupted)
    try:
        _plain_arguments(typer.main.get_command(app))()
    except Interrupted:
        if reporting():
            stderr_console().print(interrupt_message(), markup=False, soft_wrap=True)
        leave(EXIT_INTERRUPTED)
    except BadInput as e:
        # Under torchrun rank 0 speaks for the job about the input every rank read alike; a rank that met a problem
        # while replaying its own part names itself.
        if reporting() or e.rank is not None:
            where = f"rank {e.rank}: " if e.rank is not None else ""
            say(f"nanforensics: error: {where}{e}")
        leave(EXIT_BAD_INPUT, wait_for_rank_zero=e.rank is None)
    except Exception as e:
        if os.environ.get("NANFORENSICS_DEBUG"):
            raise
        if isinstance(e, OSError) and e.filename is not None:  # a file the system refused (permissions): bad input
            message = f"{e.filename}: {e.strerror or e}"
        else:
            message = f"{e.__class__.__name__}: {e} (set NANFORENSICS_DEBUG=1 for the traceback)"
        say(f"nanforensics: error: {message}")
        leave(EXIT_BAD_INPUT)
