"""A training job under the recorder, run as a subprocess by the fault tests (killed, or starved of disk)."""

from __future__ import annotations

import resource
import signal
import sys

import scenarios

if __name__ == "__main__":
    run_dir, steps = sys.argv[1], int(sys.argv[2])
    if len(sys.argv) > 3:  # a file-size limit stands in for a full disk: writes past it fail with EFBIG
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        limit = int(sys.argv[3])
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
    every = int(sys.argv[4]) if len(sys.argv) > 4 else 3  # often enough that a kill lands between checkpoints
    scenarios.record(run_dir, "adam_near_zero", steps=steps, defect_step=10**9, checkpoint_every=every)
    print("finished", flush=True)
