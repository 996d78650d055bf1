"""Record each training script of this folder under the recorder and replay it with the CLI of one source tree.

    python examples/failures/replay_all.py OUT [--tree /path/to/a/checkout] [--only NAME]

Each script injects one realistic defect (its docstring says which, and what a right report names). The recordings
go to OUT/NAME (kept when already there, so two trees replay the same run), each replay's JSON to
OUT/NAME.TREE.json, and a summary of the report is printed: verdict, step, origin, operation, samples, findings.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
SCRIPTS = ("unet_groupnorm", "ctc_speech", "selective_scan", "diffusion_snr", "gnn_mean")


def summary(r: dict) -> list[str]:
    o, op, s = r["origin"], r["operation"], r["samples"]
    lines = [f"verdict {r['verdict']}, responsible step {r['responsible_step']}, logged NaN loss "
             f"{r['logged_first_nonfinite_loss_step']}, replayed NaN loss {r['first_nonfinite_loss_step']}, "
             f"loss-only {r['loss_only_steps']}, state poisoned {r['state_poisoned']}, replayed steps "
             f"{r['setup']['first_step']}-{r['setup']['last_step']}, reproduced {r['reproduced']}"]
    if o:
        lines.append(f"origin {o['stage']} {o['tensor']}{o['index']} = {o['value']}")
    if op:
        site = op["site"]
        lines.append(f"operation {site['phase']} {site['op']} module {site['module']} ({site['source']}) -> "
                     f"{op['output_value']}")
    if s:
        lines.append(f"samples {s['status']} {s['samples']} {s['sample_leaves']}")
    return lines + [f"  - {f}" for f in r["findings"]]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out", type=Path)
    parser.add_argument("--tree", type=Path, default=HERE.parent.parent, help="the checkout whose CLI replays")
    parser.add_argument("--only", action="append", default=[])
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    recorder_env = {**os.environ, "PYTHONPATH": str(HERE.parent.parent)}
    replay_env = {**os.environ, "PYTHONPATH": str(args.tree.resolve()), "COLUMNS": "160"}
    for name in args.only or SCRIPTS:
        run = (args.out / name).resolve()
        if not run.exists():
            subprocess.run([sys.executable, str(HERE / f"{name}.py"), str(run)], env=recorder_env, check=True)
        report = run.with_name(f"{name}.{args.tree.resolve().name}.json")
        p = subprocess.run([sys.executable, "-m", "nanforensics", "replay", str(run), "--json", str(report)],
                           env=replay_env, cwd=args.tree, capture_output=True, text=True)
        print(f"== {name} (exit {p.returncode}, {args.tree})")
        if not report.exists():
            print(p.stderr.strip())
            continue
        print("\n".join(summary(json.loads(report.read_text()))))


if __name__ == "__main__":
    main()
