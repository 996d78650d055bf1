"""The CPU this process runs on, as a run's manifest records it and a replay compares it.

Kernels dispatch on the CPU's instruction set (AVX512, AVX2, NEON...) and sum in another order on another one, so
a replay on another kind of CPU rounds the last bit differently: the state is then compared within a tolerance.
"""

from __future__ import annotations

import platform
from functools import cache
from pathlib import Path

import torch

from ..report import CpuIdentity


def _model() -> str:
    """The CPU's model name: /proc/cpuinfo's on Linux, platform.processor() elsewhere; "" when neither says."""
    try:
        for line in Path("/proc/cpuinfo").read_text(errors="replace").splitlines():
            key, _, value = line.partition(":")
            if key.strip() in ("model name", "Model", "cpu model") and value.strip():
                return value.strip()
    except OSError:
        pass
    return platform.processor()


@cache
def this_cpu() -> CpuIdentity:
    return CpuIdentity(model=_model(), capability=torch.backends.cpu.get_cpu_capability(), machine=platform.machine())


def describe(cpu: CpuIdentity | None) -> str:
    """A CPU as a report names it: "AMD EPYC 7B13 (x86_64, AVX2)"; an unknown one says so."""
    if cpu is None:
        return "an unknown CPU (the run's manifest does not name it)"
    return f"{cpu.model or 'an unnamed CPU'} ({cpu.machine}, capability {cpu.capability})"
