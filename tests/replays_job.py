"""Several command lines run at world size by ONE torchrun launch: each rank imports torch and the replay's modules
once, then forks one child per command, which runs as that rank of a job of its own and ends as the command ends a
rank (the CLI: ``os._exit``). A command is the CLI's arguments (``["replay", RUN, "--json", PATH]``: the real entry
point, ``nanforensics.cli.main``), a job script and its arguments (``["tests/mesh_job.py", OUT, ...]``: run as
``__main__``, as torchrun runs it), or ``["digest", PATH...]``: rank 0 writes each folder's ``tree_digest`` (what the
tests compare after a replay to find the run untouched), taken after the commands before it and before those after.
Each command's ranks' stdout, stderr and exit code: OUT/N/rank_R.{out,err,code}.

    python -m torch.distributed.run --standalone --nproc-per-node P tests/replays_job.py OUT COMMANDS_JSON

A launch costs the launcher's and every rank's start and torch import (most of a small replay's seconds on 2 cores);
the children share them. Each command's ranks meet on a store of their own, as torchrun gives each attempt of a job a
new one: rank 0 hosts it here (in the parent, as torchrun's agent does), its port handed on through the launch's store.

Each rank watches its child as torchrun watches a worker: once another rank's child has exited non-zero, its own is
stopped, so a command never hangs on a rank that has gone. The tests of what torchrun itself does then (a rank that
dies, the exit codes 2 and 4 every rank ends with) launch torchrun per command.
"""

from __future__ import annotations

import json
import os
import runpy
import signal
import sys
import time
import traceback
from datetime import timedelta
from pathlib import Path

import torch.distributed as dist
import torch.distributed.checkpoint  # noqa: F401  (what a replay imports, imported once for every child)
import torch.distributed.fsdp  # noqa: F401
import torch.distributed.pipelining  # noqa: F401
import torch.distributed.tensor  # noqa: F401
from nanforensics import cli
from nanforensics.replay import engine  # noqa: F401

from conftest import tree_digest

MONITOR_S, STOP_S = 0.1, 30  # torchrun's defaults: its monitor interval, the grace after SIGTERM


def child(args: list[str], out: Path, rank: int, port: int) -> None:
    """This rank of the command ``args``, its output into ``out``; never returns."""
    code = 1
    try:
        for fd, name in ((1, "out"), (2, "err")):
            os.dup2(os.open(out / f"rank_{rank}.{name}", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644), fd)
        os.environ["MASTER_PORT"] = str(port)
        script = args[0] if args[0].endswith(".py") else None
        sys.argv = [*args] if script else ["nanforensics", *args]
        try:
            if script:
                sys.path[0] = str(Path(script).resolve().parent)
                runpy.run_path(script, run_name="__main__")
            else:
                cli.main()
            code = 0
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else 0 if e.code is None else 1
    except BaseException:  # what a process would print before it ends with 1
        traceback.print_exc()
        code = 1
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def watch(pid: int, launch: dist.Store, failed: str, rank: int, size: int) -> int:
    """This rank's child's exit code, watched as torchrun watches its workers (every ``MONITOR_S``): once another
    rank's child has exited non-zero, this one is stopped (SIGTERM, SIGKILL ``STOP_S`` later), so that no command
    waits on a rank that has gone."""
    stopped = None
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            code = os.waitstatus_to_exitcode(status)
            if code != 0:
                launch.set(f"{failed}/{rank}", str(code))
            return code
        if stopped is None and any(launch.check([f"{failed}/{r}"]) for r in range(size) if r != rank):
            stopped = time.monotonic()
            os.kill(pid, signal.SIGTERM)
        elif stopped is not None and time.monotonic() - stopped > STOP_S:
            os.kill(pid, signal.SIGKILL)
        time.sleep(MONITOR_S)


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
        if args[0] == "digest":
            if rank == 0:
                (folder / "digest.json").write_text(json.dumps({path: tree_digest(Path(path)) for path in args[1:]}))
            for name, text in (("out", ""), ("err", ""), ("code", "0")):  # a command of no process of its own
                (folder / f"rank_{rank}.{name}").write_text(text)
        else:
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
            (folder / f"rank_{rank}.code").write_text(str(watch(pid, launch, f"replays/{n}/failed", rank, size)))
        launch.set(f"replays/{n}/done/{rank}", "1")
        launch.wait([f"replays/{n}/done/{r}" for r in range(size)])  # the store outlives every rank's child
        del store
    print(f"{len(commands)} commands on rank {rank}", flush=True)


if __name__ == "__main__":
    main()
