"""torchrun's environment, read without importing torch (the command line reads it before anything else)."""

from __future__ import annotations

import os


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
