"""By hand: does a run whose param group holds a tensor lr replay bit for bit from its checkpoint? For every
torch.optim optimizer and each form of lr, a run of eight steps is recorded under the real Recorder and its last four
steps replayed from the checkpoint before them, as replay rebuilds the optimizer (the test's ``_record_and_replay``);
prints what the reader gave back and what differs.

    python -m scripts.tensor_lrs        # from the repository root

Before meta.json kept a tensor inline, a float32 lr came back as the float it holds and Adam, AdamW, Adamax, NAdam,
Adafactor and ASGD replayed off by the last bits (LBFGS's history came back as nested lists and did not step)."""

from __future__ import annotations

import tempfile
from pathlib import Path

import torch
from tests.test_recorder_hyperparameters import OPTIMIZERS, _record_and_replay

FORMS = {"0.01 float32 []": torch.tensor(0.01), "0.003 float32 []": torch.tensor(0.003),
         "0.01 float32 [1]": torch.tensor([0.01]), "0.01 float64 []": torch.tensor(0.01, dtype=torch.float64)}


def main() -> None:
    differing = 0
    for cls in OPTIMIZERS:
        for name, lr in FORMS.items():
            with tempfile.TemporaryDirectory() as folder:
                try:
                    meta, differs = _record_and_replay(Path(folder) / "run", cls, [lr], steps=8, every=4)
                except Exception as e:  # the replayed step's: a state read back as something else
                    differing += 1
                    print(f"{cls.__name__:10} lr {name:17} replay raised {type(e).__name__}: {str(e)[:60]}")
                    continue
            read = meta["param_groups"][0]["lr"]
            kind = f"tensor {str(read.dtype).removeprefix('torch.')} {list(read.shape)}" \
                if isinstance(read, torch.Tensor) else type(read).__name__
            differing += bool(differs)
            print(f"{cls.__name__:10} lr {name:17} read back as {kind:22} {', '.join(differs) or 'bit for bit'}")
    print(f"{differing} of {len(OPTIMIZERS) * len(FORMS)} runs replay otherwise than they ran")


if __name__ == "__main__":
    main()
