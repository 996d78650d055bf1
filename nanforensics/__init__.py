"""nanforensics: record a training run, replay it, and name the batch that made it NaN.

Library first: ``Recorder`` in the training loop; ``replay_run`` (and ``scan``/``bisect``)
after it died. The command line is a thin layer over these.
"""

from .bisect import bisect
from .errors import BadInput
from .formats.discover import open_checkpoint
from .recorder import Recorder
from .repair import repair_run
from .replay import ReplayOptions, replay_run
from .report import ReplayReport
from .scan import scan_checkpoint

__all__ = ["BadInput", "Recorder", "ReplayOptions", "ReplayReport", "bisect", "open_checkpoint", "repair_run",
           "replay_run", "scan_checkpoint"]
__version__ = "0.1.0"
