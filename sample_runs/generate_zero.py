"""Regenerate the shipped DeepSpeed ZeRO sample: python sample_runs/generate_zero.py [--out DIR]  (the deepspeed extra)

``zero2`` is what DeepSpeed's own engine writes for a ZeRO stage-2 job of two ranks (gloo on CPU, torch's AdamW as the
client optimizer), ``engine.save_checkpoint`` after each of four steps: tests/zero_checkpoints.py's ``w2/s2/run``,
where one coordinate of rank 0's fp32 master partition turns NaN before step 3's save, so ``global_step3`` is the
first poisoned checkpoint. The two scripts DeepSpeed copies beside its checkpoints (``zero_to_fp32.py``,
``zero_to_torch.py``) are left out: DeepSpeed's code, which nothing here reads. Its files are DeepSpeed's pickles, so a
machine without DeepSpeed can still read them with nanforensics (which never imports DeepSpeed).
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SAMPLES = {"zero2": "w2/s2/run"}  # shipped name: the generator's folder
LEFT_OUT = ("zero_to_fp32.py", "zero_to_torch.py")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path(__file__).parent)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run([sys.executable, str(ROOT / "tests" / "zero_checkpoints.py"), tmp], check=True,
                       capture_output=True)
        for name, made in SAMPLES.items():
            shutil.rmtree(args.out / name, ignore_errors=True)
            shutil.copytree(Path(tmp) / made, args.out / name, ignore=shutil.ignore_patterns(*LEFT_OUT))
            print(f"{name}: {sorted(p.name for p in (args.out / name).glob('global_step*'))}")


if __name__ == "__main__":
    main()
