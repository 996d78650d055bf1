"""What a hostile run directory's manifest can name, importable like the scenarios' own code: each payload leaves a
marker file (the path in $NANFORENSICS_TEST_MARKER) if it is ever called. Importing this module runs nothing."""

from __future__ import annotations

import os
from os import system  # noqa: F401 - a re-export: hostile:system is os.system
from pathlib import Path
from subprocess import run  # noqa: F401 - a re-export: hostile:run is subprocess.run
from typing import Any

import torch

import scenarios

MARKER = "NANFORENSICS_TEST_MARKER"


def _mark() -> None:
    Path(os.environ[MARKER]).write_text("ran")


class Touch:
    """A class of the user's code that is none of what any role takes: a model, an optimizer, a scheduler."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        _mark()


class Builder:
    @classmethod
    def build(cls, marker: str, **kwargs: Any) -> torch.nn.Module:
        """A bound classmethod: a factory that works, but beyond the trust policy (only --trust-code calls it);
        it leaves its mark at ``marker``."""
        Path(marker).write_text("ran")
        return scenarios.build_model(**kwargs)


def not_an_optimizer(model: torch.nn.Module) -> int:
    """An optimizer factory the policy admits (a function of the user's code) that returns no optimizer."""
    return 42
