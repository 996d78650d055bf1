"""torchrun's environment, read without importing torch (the command line reads it before anything else)."""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import time
from typing import NoReturn


def torchrun_env() -> tuple[int, int, int] | None:
    """(rank, world size, local rank) as torchrun sets them; None outside torchrun."""
    env = os.environ
    if "RANK" not in env or "WORLD_SIZE" not in env:
        return None
    return int(env["RANK"]), int(env["WORLD_SIZE"]), int(env.get("LOCAL_RANK", "0"))


def reporting() -> bool:
    """Whether this process speaks for the job: always, except on a rank other than 0 under torchrun."""
    env = torchrun_env()
    return env is None or env[0] == 0


def exit_on_stop(code: int) -> None:
    """Under torchrun, make a stop from torchrun end this process with ``code`` rather than -15: torchrun stops
    every other worker (SIGTERM) as soon as one exits non-zero."""
    if torchrun_env() is not None:
        signal.signal(signal.SIGTERM, lambda signum, frame: exit_now(code))


def leave(code: int, wait_for_rank_zero: bool = False, grace_s: float = 30.0) -> NoReturn:
    """End this process with ``code``.

    A rank other than 0 that left first over an error every rank met alike would have torchrun stop rank 0 before
    it names the error: ``wait_for_rank_zero`` makes such a rank wait (at most ``grace_s``) for the stop that rank
    0's own exit brings (``exit_on_stop``)."""
    env = torchrun_env()
    if env is None:
        sys.exit(code)
    if wait_for_rank_zero and env[0] != 0:
        sys.stdout.flush()
        sys.stderr.flush()
        time.sleep(grace_s)
    exit_now(code)


def exit_now(code: int) -> NoReturn:
    """End the process now: the interpreter's shutdown would first restore SIGTERM's default action, and a stop
    from torchrun arriving then would end this rank with -15 instead of ``code``; one arriving during the flush
    below is ignored (its handler would flush again, inside this flush), since the process is ending anyway."""
    with contextlib.suppress(ValueError):  # signal.signal outside the main thread: that thread is not the one stopped
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
