"""Post-mortems shared by the post-mortem and report tests, each computed once per session."""

from __future__ import annotations

import functools
from pathlib import Path

from nanforensics.postmortem import PostmortemReport, postmortem


@functools.cache
def examined(run: Path) -> PostmortemReport:
    return postmortem(run)
