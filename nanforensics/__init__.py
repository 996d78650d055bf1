"""nanforensics: record a training run, replay it, and name the batch that made it NaN.

Library first: ``Recorder`` in the training loop; ``replay_run`` (and ``scan``/``bisect``)
after it died. The command line is a thin layer over these.
"""

from .errors import BadInput
from .recorder import Recorder
from .repair import repair_run
from .replay import ReplayOptions, replay_run
from .report import ReplayReport

__all__ = ["BadInput", "Recorder", "ReplayOptions", "ReplayReport", "repair_run", "replay_run"]
__version__ = "0.1.0"
