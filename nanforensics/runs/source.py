"""What a replay reads, whichever way the run was kept: a run recorded by ``Recorder`` (``runs.run``, one process or
every rank of a distributed job), or the checkpoints a trainer wrote with the user's own batch function
(``runs.unrecorded``). The replay engine, sessions, what-ifs and root-cause passes see only these two protocols."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Protocol, Sequence

import torch

from .steplog import LoggedStep

if TYPE_CHECKING:
    from ..report import CheckpointLoad, CpuIdentity
    from .layout import World
    from .run import Rebuilt


class StartPoint(Protocol):
    """A checkpoint a replay can start from: the state before step ``step``."""

    path: Path
    step: int


class StepSource(Protocol):
    """The run's side: its checkpoints, the batch of each step, and the losses it logged (if any)."""

    @property
    def path(self) -> Path: ...  # what the report names as the run

    @property
    def steps(self) -> list[LoggedStep]: ...  # the logged losses; empty when none were logged

    @property
    def last_step(self) -> int | None: ...  # the last step the run has; None when nothing logged its end

    @property
    def num_threads(self) -> int | None: ...  # the recording's CPU thread count, when known

    @property
    def device(self) -> str | None: ...  # the device the run trained on, when known

    @property
    def cpu(self) -> CpuIdentity | None: ...  # the CPU the run was recorded on, when known

    @property
    def compiled(self) -> str | None: ...  # the torch.compile backend the run trained under, when known

    @property
    def checkpoint_folder(self) -> Path: ...  # named by errors about its checkpoints

    @property
    def code_file(self) -> Path: ...  # named by errors the user's code raises

    @property
    def world(self) -> World | None: ...  # a distributed run's ranks and wrapping; None for one process

    def checkpoints(self) -> Sequence[StartPoint]: ...

    def batch(self, step: int, rank: int | None = None) -> Any: ...  # rank: whose shard, in a distributed run

    def batch_origin(self, step: int, rank: int | None = None) -> str | None:
        """Where the batch of ``step`` (``rank``'s shard) comes from, for the report; None when the run does not have
        it. A distributed run without a rank: every rank's, when each is there."""


class StepCode(Protocol):
    """The user's side: the step function, and the model and optimizer rebuilt at a checkpoint."""

    step_fn: Callable[..., Any]
    imported: list[str]  # the callables imported, as import strings

    @property
    def step_name(self) -> str: ...

    @property
    def loaded(self) -> CheckpointLoad | None: ...  # how a checkpoint not of the run format was loaded

    def build(self, run: Any, checkpoint: Any, device: torch.device) -> Rebuilt: ...
