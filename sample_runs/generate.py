"""Regenerate the shipped sample runs: python sample_runs/generate.py [--out DIR]

Each run is a real training run of tests/scenarios.py under the project's own recorder (its model and step function
are sample_runs/code/regressor.py's, which the manifests name, so the runs replay without the tests),
deterministic on CPU (fixed seeds, thread count and timestamp: every tensor and JSON value
comes out the same; safetensors may order its metadata keys differently), stopped a step
after the first NaN loss as a job that aborts on NaN would be. ``unrecorded/ckpts`` is what
``unrecorded/train.py``, which knows nothing of the recorder, saves with ``torch.save``.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import random
import sys
from pathlib import Path

import torch

try:
    import numpy
except ImportError:  # torch runs without it; the shipped runs were recorded with it
    numpy = None

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
import scenarios  # noqa: E402 - the test scenarios, outside the installed package

CODE = "sample_runs/code/regressor.py"  # shipped beside the runs: the code their manifests name
SAMPLES = {
    # name: (scenario, steps, defect step)
    "seed_adam": ("adam_near_zero", 40, 27),
    "clean": ("clean", 40, 27),
    "sgd_momentum": ("sgd_near_zero", 40, 27),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path(__file__).parent)
    args = parser.parse_args()
    os.environ.setdefault("SOURCE_DATE_EPOCH", "1764633600")  # 2025-12-02: fixed, so files are byte-identical
    torch.set_num_threads(2)
    random.seed(0)
    if numpy is not None:
        numpy.random.seed(0)  # torch imports numpy when present; its RNG state is checkpointed too
    for name, (scenario, steps, defect_step) in SAMPLES.items():
        losses = scenarios.record(args.out / name, scenario, steps=steps, defect_step=defect_step,
                                  checkpoint_every=10, stop_on_nan=True, overwrite=True,
                                  code=CODE)  # replayed from the checkout's root, or with --code-path sample_runs/code
        print(f"{name}: {len(losses)} steps, last logged loss {losses[-1]:.4g}")
    script = Path(__file__).resolve().parent / "unrecorded" / "train.py"
    spec = importlib.util.spec_from_file_location("unrecorded_train", script)
    assert spec is not None and spec.loader is not None
    train = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(train)
    train.main(args.out / "unrecorded" / "ckpts")


if __name__ == "__main__":
    main()
