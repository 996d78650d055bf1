"""nanforensics: record a training run, replay it, and name the batch that made it NaN.

Library first: ``Recorder`` in the training loop; ``replay_run`` (and ``scan_checkpoint``/``bisect``)
after it died; ``replay_checkpoint`` for a run nobody recorded (its checkpoint and the training
script). The command line is a thin layer over these. The names below are imported on first use,
so that ``import nanforensics`` (and the CLI's start-up) costs only what is used.

Its first statements are the bootstrap of ``python -m nanforensics`` (and of torchrun's workers, started so): Python
put the working directory first on ``sys.path``, and this package is imported before its ``__main__``, so the working
directory comes off before this package imports anything: ``cd RUN && python -m nanforensics replay .`` must not
import a ``typing.py`` of the run. Only modules every interpreter has loaded before (``sys``, ``os``) come first.
"""

import os
import sys


def _drop_working_directory() -> None:
    """Under ``python -m nanforensics`` (``sys.argv[0]`` is ``-m`` while the package is imported), the working
    directory Python put first on ``sys.path`` comes off. The trust policy puts it back for the import of a run's code
    it allows, and only then (``runs.imports``)."""
    argv = sys.orig_argv
    named = any(a == "-m" and argv[i + 1:i + 2] == ["nanforensics"] or (a.startswith("-") and a.endswith("mnanforensics"))
                for i, a in enumerate(argv))
    if sys.argv[:1] == ["-m"] and named and not sys.flags.safe_path and sys.path and \
            os.path.realpath(sys.path[0] or os.curdir) == os.path.realpath(os.getcwd()):
        del sys.path[0]


_drop_working_directory()

import importlib  # noqa: E402 - after the working directory is off sys.path
from typing import TYPE_CHECKING, Any  # noqa: E402

__version__ = "0.1.0"

_EXPORTS = {
    "BadInput": "errors",
    "Recorder": "runs.recorder",
    "GuardPolicy": "runs.guard",
    "GuardStop": "runs.guard",
    "ReplayOptions": "replay.engine",
    "replay_run": "replay.engine",
    "replay_checkpoint": "replay.unrecorded",
    "bisect_and_replay": "replay.unrecorded",
    "ReplayReport": "report",
    "repair_run": "replay.repair",
    "open_checkpoint": "formats.discover",
    "scan_checkpoint": "checkpoints.scan",
    "bisect": "checkpoints.bisect",
}
__all__ = ["BadInput", "GuardPolicy", "GuardStop", "Recorder",
           "ReplayOptions", "ReplayReport", "bisect", "bisect_and_replay", "open_checkpoint",
           "repair_run", "replay_checkpoint", "replay_run", "scan_checkpoint"]

if TYPE_CHECKING:
    from .checkpoints.bisect import bisect
    from .checkpoints.scan import scan_checkpoint
    from .errors import BadInput
    from .formats.discover import open_checkpoint
    from .replay.engine import ReplayOptions, replay_run
    from .replay.repair import repair_run
    from .replay.unrecorded import bisect_and_replay, replay_checkpoint
    from .report import ReplayReport
    from .runs.guard import GuardPolicy, GuardStop
    from .runs.recorder import Recorder


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'nanforensics' has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
    globals()[name] = value
    return value
