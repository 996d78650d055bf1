"""Several command lines of the CLI at world size in ONE torchrun launch: each rank imports torch and the replay's
modules once, then forks one child per command, which runs the real entry point (``nanforensics.cli.main``) as that
rank of a fresh job and ends as the CLI ends a rank (``os._exit``). What the tests of a replay at world size read, per
command: each rank's stdout, stderr and exit code, in OUT/N/rank_R.{out,err,code}.

    python -m torch.distributed.run --standalone --nproc-per-node P tests/replays_job.py OUT ARGS_JSON

ARGS_JSON: a JSON list of argument lists (``[["replay", RUN, "--json", PATH], ...]``). A launch costs the launcher's
and every rank's start and torch import (most of a small replay's seconds on 2 cores); the children share them. Each
command's ranks meet on a store of their own, as torchrun gives each attempt of a job a new one: rank 0 hosts it here
(in the parent, as torchrun's agent does), its port handed on through the launch's store.

What a child does not have that a torchrun worker has: torchrun watching it (a rank's non-zero exit stopping the
others). The tests that check that (exit codes 2 and 4 on every rank) launch torchrun per command.
"""

from __future__ import annotations

import json
import os
import sys
from datetime import timedelta
from pathlib import Path

import torch.distributed as dist
import torch.distributed.checkpoint  # noqa: F401  (what a replay imports, imported once for every child)
import torch.distributed.fsdp  # noqa: F401
import torch.distributed.pipelining  # noqa: F401
import torch.distributed.tensor  # noqa: F401
from nanforensics import cli
from nanforensics.replay import engine  # noqa: F401


def child(args: list[str], out: Path, rank: int, port: int) -> None:
    """This rank of the command ``args``, its output into ``out``; never returns."""
    code = 1
    try:
        for fd, name in ((1, "out"), (2, "err")):
            os.dup2(os.open(out / f"rank_{rank}.{name}", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644), fd)
        os.environ["MASTER_PORT"] = str(port)
        sys.argv = ["nanforensics", *args]
        try:
            cli.main()
            code = 0
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else 1
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def main() -> None:
    out, commands = Path(sys.argv[1]), json.loads(sys.argv[2])
    rank, size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    assert os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True", "run under torch.distributed.run"
    launch = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), size, is_master=False,
                           timeout=timedelta(seconds=300))
    for n, args in enumerate(commands):
        folder = out / str(n)
        folder.mkdir(parents=True, exist_ok=True)
        store = None
        if rank == 0:  # the job's store, as torchrun's agent hosts one: every rank a client of it
            store = dist.TCPStore(os.environ["MASTER_ADDR"], 0, size, is_master=True, wait_for_workers=False,
                                  timeout=timedelta(seconds=300))
            launch.set(f"replays/{n}", str(store.port))
        port = int(launch.get(f"replays/{n}"))
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            child(args, folder, rank, port)
        _, status = os.waitpid(pid, 0)
        (folder / f"rank_{rank}.code").write_text(str(os.waitstatus_to_exitcode(status)))
        launch.set(f"replays/{n}/done/{rank}", "1")
        launch.wait([f"replays/{n}/done/{r}" for r in range(size)])  # the store outlives every rank's child
        del store
    print(f"{len(commands)} commands on rank {rank}", flush=True)


if __name__ == "__main__":
    main()
