"""``python -m tests.fuzz --mutants 2000``: a long fuzz run, with figures per layout and command, the time, and the
crashes by class; ``--keep`` minimises each new class's first crash and adds it to corpus.json."""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(TESTS))  # the tests' helpers (conftest, scenarios) as the suite imports them

from tests.fuzz import campaign, seeds  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m tests.fuzz", description=__doc__)
    parser.add_argument("--mutants", type=int, default=200)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--spawn-every", type=int, default=25, help="every n-th call as a fresh process (0: never)")
    parser.add_argument("--layout", action="append", help="only these layouts (repeatable)")
    parser.add_argument("--time-limit", type=float, default=60.0)
    parser.add_argument("--seeds", type=Path, default=Path(tempfile.gettempdir()) / "nanforensics-fuzz-seeds")
    parser.add_argument("--keep", action="store_true", help="minimise each new class's first crash into corpus.json")
    opts = parser.parse_args()
    trees = seeds.build(opts.seeds)
    with tempfile.TemporaryDirectory(prefix="nanforensics-fuzz-") as scratch:
        figures = campaign.fuzz(trees, Path(scratch), mutants=opts.mutants, seed=opts.seed,
                                spawn_every=opts.spawn_every, layouts=opts.layout, time_limit=opts.time_limit,
                                progress=lambda line: print(line, flush=True))
        print("\n".join(figures.lines()), flush=True)
        if opts.keep:
            corpus = campaign.load_corpus()
            known = {c.violation for c in corpus}
            for crash in figures.crashes:
                if crash.violation not in known:
                    known.add(crash.violation)
                    corpus.append(campaign.minimise(crash, trees, Path(scratch), ))
                    print(f"kept: {corpus[-1].violation} <- {corpus[-1].mutation.describe()}", flush=True)
            campaign.save_corpus(corpus)


if __name__ == "__main__":
    main()
