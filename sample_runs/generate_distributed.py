"""Regenerate the shipped distributed sample run: python sample_runs/generate_distributed.py [--out DIR]

``ddp_two_ranks`` is a real 2-rank DDP job, gloo on CPU, launched with torch.distributed.run and recorded by the
project's recorder on both ranks (tests/distributed_job.py): each rank trains the seed model on its own shard of one
dataset, and only rank 1's shard holds the near-zero reading (sample-00075, at step 4). Deterministic: fixed seeds,
one thread per rank, a fixed timestamp; every tensor and JSON value comes out the same.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
from generate import CODE  # noqa: E402 - the samples' shipped code, which the manifest names

import distributed_job  # noqa: E402 - the test job, outside the installed package

SAMPLES = {"ddp_two_ranks": "ddp"}  # shipped name: the job's run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path(__file__).parent)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run(distributed_job.command(Path(tmp), list(SAMPLES.values()), "--code", CODE), cwd=ROOT,
                       check=True)
        for name, run in SAMPLES.items():
            shutil.rmtree(args.out / name, ignore_errors=True)
            shutil.move(str(Path(tmp) / run), str(args.out / name))
            print(f"{name}: recorded by {distributed_job.WORLD} ranks")


if __name__ == "__main__":
    main()
