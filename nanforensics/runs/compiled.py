"""Models under ``torch.compile``: the module they wrap, and the backend they were compiled with.

The recorder names a compiled model's parameters by the module it compiled (no ``_orig_mod.`` prefix) and writes the
backend into the manifest; replay runs that module eagerly, because its hooks must see every module's output and
every operation, which a compiled graph hides (docs: README, "Recurrent and compiled models").
"""

from __future__ import annotations

from typing import Any, Iterable

import torch

# Backends that run the aten kernels eager mode runs: an eager replay is held to the recorded state bit for bit (the
# comparison with the recorded checkpoints says whether it was). Any other backend (inductor) generates kernels of its
# own, and the state is compared within a tolerance.
EAGER_KERNELS = ("eager", "aot_eager")
ORIG_MOD = "_orig_mod."  # the prefix of a compiled wrapper's names for the module's tensors


def wrapped_names(names: Iterable[str]) -> bool:
    """Whether a checkpoint's names are a compiled wrapper's (every one under ``_orig_mod.``): as the recorder wrote
    them before it named a compiled model's tensors by the module it compiled."""
    names = list(names)
    return bool(names) and all(n.startswith(ORIG_MOD) for n in names)


def own_name(name: str) -> str:
    """A module's or tensor's name without the ``_orig_mod`` of any compiled wrapper along its path: the name it has
    in the model the factory builds (a loop may compile the whole model inside or around a distributed wrapper)."""
    return ".".join(part for part in name.split(".") if part != ORIG_MOD[:-1])


def compiled_backend(model: torch.nn.Module) -> str | None:
    """The backend ``model`` was compiled with (``torch.compile(module)`` or ``module.compile()``); None when it was
    not compiled."""
    if isinstance(model, torch._dynamo.eval_frame.OptimizedModule):
        return _backend(getattr(model, "dynamo_ctx", None))
    call = getattr(model, "_compiled_call_impl", None)
    if call is None:
        return None
    # module.compile() keeps torch.compile's function, whose closure holds the context that names the backend
    held = [c.cell_contents for c in getattr(call, "__closure__", None) or () if hasattr(c.cell_contents, "callback")]
    return _backend(held[0] if held else None)


def unwrapped(model: torch.nn.Module) -> torch.nn.Module:
    """The module ``torch.compile(module)`` wraps, whose names carry no ``_orig_mod.``; any other model itself."""
    return model._orig_mod if isinstance(model, torch._dynamo.eval_frame.OptimizedModule) else model


def eager(model: torch.nn.Module) -> torch.nn.Module:
    """A model replay built, to run eagerly: the module a compiled one wraps, a module compiled in place without its
    compiled call. Only for a model replay owns: the recorder never changes how the loop's model runs."""
    model = unwrapped(model)
    if getattr(model, "_compiled_call_impl", None) is not None:
        model._compiled_call_impl = None
    return model


def _backend(compiled: Any) -> str:
    """The backend's registered name, found along dynamo's wrappers of it; "unknown" where none says."""
    node, seen = getattr(compiled, "callback", compiled), 0
    while node is not None and seen < 16:
        for attr in ("compiler_name", "name"):
            if isinstance(value := getattr(node, attr, None), str):
                return value
        node, seen = getattr(node, "_torchdynamo_orig_backend", None), seen + 1
    return "unknown"
