"""Operation level: re-run the responsible step with every aten operation checked, forward and backward.

The first operation whose output is non-finite while its floating-point inputs were finite is the
cause inside the step. A backward operation is traced to the forward operation it differentiates
(through the autograd node running it) and so to the module and source line that created it — the
question ``detect_anomaly`` answers with a traceback, answered here with the module path and the
input ranges that made it overflow.
"""

from __future__ import annotations

import os
import sys
from typing import Any, Callable

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from .. import finite
from ..report import OperationCulprit, OpSite

_TORCH_DIR = os.path.dirname(torch.__file__)


def _user_source() -> str | None:
    """The innermost frame outside torch and this module: the user's line that issued the op."""
    frame = sys._getframe(1)
    while frame is not None:
        name = frame.f_code.co_filename
        if not name.startswith(_TORCH_DIR) and name != __file__:
            return f"{os.path.relpath(name) if not name.startswith('<') else name}:{frame.f_lineno} in {frame.f_code.co_name}"
        frame = frame.f_back
    return None


def _fmt(x: float) -> str:
    return finite.value_name(x) if x != x or abs(x) == float("inf") else f"{x:.4g}"


def _floating(tree: Any) -> list[torch.Tensor]:
    return [t for t in tree_leaves(tree) if finite.checkable(t)]


def _ranges(tensors: list[torch.Tensor]) -> list[list[str]]:
    return [[_fmt(float(v)) for v in finite.extremes(t)] for t in tensors]


def _op_name(func: Any) -> str:
    name = getattr(func, "__name__", None) or str(func)
    if hasattr(func, "_schema"):  # an OpOverload: aten.div.Tensor
        return f"aten::{func.__name__}"
    module = getattr(func, "__module__", "") or ""
    return f"{module.removeprefix('torch._C._nn').removeprefix('torch._C')}.{name}".lstrip(".") if module else name


class _ModuleStack:
    """Which module is running: forward pre/post hooks on every module."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.stack: list[str] = []
        self._handles = []
        for name, module in model.named_modules():
            self._handles.append(module.register_forward_pre_hook(self._push(name or "<root>")))
            self._handles.append(module.register_forward_hook(self._pop))

    def _push(self, name: str) -> Callable[..., None]:
        def hook(module: torch.nn.Module, args: Any) -> None:
            self.stack.append(name)
        return hook

    def _pop(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        if self.stack:
            self.stack.pop()

    def current(self) -> str | None:
        return self.stack[-1] if self.stack else None

    def remove(self) -> None:
        for h in self._handles:
            h.remove()


class _ForwardSites(TorchFunctionMode):
    """Remembers, for each autograd node created in the forward pass, where its forward op ran."""

    def __init__(self, modules: _ModuleStack) -> None:
        super().__init__()
        self.modules = modules
        self.sites: dict[Any, OpSite] = {}

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        inputs = _floating((args, kwargs))
        out = func(*args, **kwargs)
        nodes = {t.grad_fn for t in tree_leaves(out) if isinstance(t, torch.Tensor) and t.grad_fn is not None}
        if nodes:
            outs = _floating(out)
            site = OpSite(_op_name(func), "forward", self.modules.current(), _user_source(),
                          [str(t.dtype).removeprefix("torch.") for t in inputs], _ranges(inputs),
                          [str(t.dtype).removeprefix("torch.") for t in outs])
            for node in nodes:
                self.sites.setdefault(node, site)
        return out


class _FirstNonFinite(TorchDispatchMode):
    """Checks every aten op; keeps the first whose output is non-finite from finite inputs."""

    def __init__(self, modules: _ModuleStack, forward_sites: _ForwardSites) -> None:
        super().__init__()
        self.modules, self.forward_sites = modules, forward_sites
        self.in_optimizer = False
        self.culprit: OperationCulprit | None = None

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if self.culprit is not None:
            return func(*args, **kwargs)
        inputs = _floating((args, kwargs))
        before = [finite.extremes(t) for t in inputs]  # read before the op: in-place ops overwrite inputs
        out = func(*args, **kwargs)
        if not inputs or not all(finite.verdicts(before)):
            return out
        outs = _floating(out)
        bad = next((t for t, ok in zip(outs, finite.verdicts([finite.extremes(t) for t in outs])) if not ok), None)
        if bad is None:
            return out
        node = torch._C._current_autograd_node()
        phase = "backward" if node is not None else ("optimizer" if self.in_optimizer else "forward")
        forward = self.forward_sites.sites.get(node) if node is not None else None
        site = OpSite(_op_name(func), phase,
                      forward.module if forward else self.modules.current(),
                      forward.source if forward else (_user_source() if phase != "backward" else None),
                      [str(t.dtype).removeprefix("torch.") for t in inputs],
                      [[_fmt(float(v)) for v in e] for e in before],
                      [str(t.dtype).removeprefix("torch.") for t in outs])
        where = finite.locate(bad)
        assert where is not None
        self.culprit = OperationCulprit(site, where.value, where.index,
                                        autograd_node=node.name() if node is not None else None, forward=forward)
        return out


def trace_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer,
               run_step: Callable[[], Any]) -> OperationCulprit | None:
    """Run one step (``run_step``) under the checks; the model and optimizer are stepped as usual."""
    modules = _ModuleStack(model)
    sites = _ForwardSites(modules)
    checker = _FirstNonFinite(modules, sites)

    def enter(*_: Any) -> None:
        checker.in_optimizer = True

    def leave(*_: Any) -> None:
        checker.in_optimizer = False

    hooks = [optimizer.register_step_pre_hook(enter), optimizer.register_step_post_hook(leave)]
    try:
        with sites, checker:
            run_step()
    finally:
        modules.remove()
        for h in hooks:
            h.remove()
    return checker.culprit
