"""The reference monitor: deliberately simple and slow, sharing no code with the replay (no proofs, no locate mode,
no skipped reads). Every step runs from the program's start with hooks on every module, every gradient, the optimizer
(before and after its step), a ``TorchDispatchMode`` over each optimizer's step that reads the state each op was given
after the op, and, for the origin step, one over every op; every checked tensor is read whole with ``torch.isfinite``.

What it reports (``Reference``): per step the first non-finite value of each stage in program order (stage, tensor,
coordinate, value; of the optimizer state, the tensor the update made non-finite first); the origin, the first step
with a non-finite value that is not loss-only; the loss-only steps (a non-finite loss, nothing but forward activations
non-finite with it); the op of that step that first made a non-finite value from finite inputs, of those whose value
reaches the origin, with its phase; and the samples of that step that fail alone (the step re-run from a snapshot on
each single sample).
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch._C._functorch import TransformType
from torch._functorch.pyfunctorch import retrieve_all_functorch_interpreters, temporarily_clear_interpreter_stack
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes
from torch.utils._pytree import keystr, tree_flatten, tree_flatten_with_path
from torch.utils.weak import WeakTensorKeyDictionary

ORDER = ("batch", "forward", "loss", "grad", "optimizer_grad", "optimizer_state", "param", "buffer")
LOSS_ONLY = {"forward", "loss"}
PERSISTENT = ("optimizer_state", "param", "buffer")  # what outlives the step
ALLOCATIONS = {"aten::empty", "aten::empty_like", "aten::empty_strided", "aten::new_empty", "aten::new_empty_strided",
               "aten::set_"}


@dataclass
class Found:
    """The first non-finite value of one stage of one step."""

    step: int
    stage: str
    tensor: str
    index: list[int]
    value: str
    state_key: str | None = None


@dataclass
class Reference:
    verdict: str  # nonfinite | loss_only | clean
    origin: Found | None
    loss_only_steps: list[int]
    op: str | None = None  # "aten::log", overload left out
    phase: str | None = None
    samples: list[int] = field(default_factory=list)  # those that fail alone, at the origin (or first loss-only) step
    batch_size: int | None = None
    steps: dict[int, list[Found]] = field(default_factory=dict)


def first_bad(t: torch.Tensor) -> tuple[list[int], str] | None:
    """The first non-finite coordinate in row-major order and its value; a sparse tensor's in its coordinates."""
    if t.is_sparse:
        t = t.coalesce()
        values = t.values()
        bad = (~torch.isfinite(values)).reshape(values.shape[0], -1)
        rows = torch.nonzero(bad.any(1))
        if len(rows) == 0:
            return None
        k = int(rows[0])
        j = int(torch.nonzero(bad[k])[0])
        inner = list(torch.unravel_index(torch.tensor(j), values.shape[1:])) if values.dim() > 1 else []
        return [int(i) for i in t.indices()[:, k]] + [int(i) for i in inner], _name(float(values.reshape(
            values.shape[0], -1)[k, j]))
    flat = t.detach().reshape(-1)
    bad = torch.nonzero(~torch.isfinite(flat))
    if len(bad) == 0:
        return None
    i = int(bad[0])
    return [int(c) for c in torch.unravel_index(torch.tensor(i), t.shape)], _name(float(flat[i]))


def _name(v: float) -> str:
    return "nan" if v != v else ("inf" if v > 0 else "-inf")


def _plain(t: Any) -> Any:
    """Inside vmap or grad: the real tensor under functorch's wrappers, each vmap's batch dimension moved in front, so
    a per-sample forward is read at [sample, ...] as it happens, in program order."""
    f = torch._C._functorch
    while isinstance(t, torch.Tensor) and f.is_functorch_wrapped_tensor(t):
        bdim = f.maybe_get_bdim(t) if f.is_batchedtensor(t) else -1
        t = f.get_unwrapped(t)
        if bdim >= 0:
            t = t.movedim(bdim, 0)
    return t


def _checkable(t: Any) -> bool:
    if not isinstance(t, torch.Tensor) or not (t.is_floating_point() or t.is_complex()) or t.numel() == 0:
        return False
    wrapped = torch._C._functorch.is_functorch_wrapped_tensor(t)  # inside vmap/grad: read outside the transform
    return not wrapped and not isinstance(t, torch._subclasses.FakeTensor)


def each(optimizer: Any) -> list[Any]:
    """The optimizers a program made: one, or each of the tuple a program of two returns (and so its schedulers)."""
    return list(optimizer) if isinstance(optimizer, (tuple, list)) else [optimizer]


class StepWatch:
    """Hooks for one run of one step: every stage's first non-finite value, in the order the hooks saw them."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, step: int,
                 constant_buffers: set[str], seen: Callable[[str, torch.Tensor], None] | None = None) -> None:
        """``seen``: told each stage's first non-finite tensor the moment it is found."""
        self.model, self.optimizer, self.step, self.seen = model, optimizer, step, seen
        self.names = {}
        for n, p in model.named_parameters(remove_duplicate=False):
            self.names.setdefault(p, n)
        self.constant_buffers = constant_buffers
        self.found: dict[str, Found] = {}
        self.stepped_by: set[int] = set()  # the optimizers whose step() ran, by id
        self.handles: list[Any] = []
        # the op of the step (counted inside optimizers' steps) after which each state tensor, (id(param), key), was
        # first seen non-finite: the state is read in that order, the order the update made it non-finite
        self.ops = 0
        self.became: dict[tuple[int, str], int] = {}
        self.watching: StateOrder | None = None

    def see(self, stage: str, name: str, t: Any, key: str | None = None) -> None:
        if stage in self.found:
            return
        with temporarily_clear_interpreter_stack():  # read as plain tensors, outside any transform
            t = _plain(t)  # (a dispatch mode watching the step, Births, marks the plain tensor as it marks t)
            with _disable_current_modes():  # and reads it unseen
                bad = first_bad(t.detach()) if _checkable(t) else None
        if bad is not None:
            self.found[stage] = Found(self.step, stage, name, bad[0], bad[1], key)
            if self.seen is not None:
                self.seen(stage, t)

    def __enter__(self) -> "StepWatch":
        for name, module in self.model.named_modules():
            self.handles.append(module.register_forward_hook(self._module(name or "<root>")))
        for p, name in self.names.items():
            if p.requires_grad:
                self.handles.append(p.register_post_accumulate_grad_hook(
                    lambda p, name=name: self.see("grad", name, p.grad)))
        self.handles += [o.register_step_pre_hook(self._before_update) for o in each(self.optimizer)]
        self.handles += [o.register_step_post_hook(lambda *a: self._stop_watching()) for o in each(self.optimizer)]
        return self

    def _module(self, name: str) -> Callable[..., None]:
        def hook(module: torch.nn.Module, args: Any, output: Any) -> None:
            for i, (path, t) in enumerate(tree_flatten_with_path(output)[0]):
                self.see("forward", name if i == 0 else name + keystr(path), t)
        return hook

    @property
    def stepped(self) -> bool:
        """Whether every optimizer's ``step()`` ran (a GradScaler skips each whose own gradients are not finite)."""
        return all(id(o) in self.stepped_by for o in each(self.optimizer))

    def _before_update(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        self.stepped_by.add(id(optimizer))
        for group in optimizer.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    self.see("optimizer_grad", self.names.get(p, "?"), p.grad)
        self.watching = StateOrder(self, optimizer)
        self.watching.__enter__()

    def _stop_watching(self) -> None:
        if self.watching is not None:
            self.watching.__exit__(None, None, None)
            self.watching = None

    def __exit__(self, *exc: object) -> None:
        self._stop_watching()
        for h in self.handles:
            h.remove()

    def finish(self, batch: Any, loss: Any) -> list[Found]:
        """The checks after the step, then every stage's first non-finite value in stage order."""
        held = [(p, key, t) for o in each(self.optimizer) for group in o.param_groups for p in group["params"]
                for key, t in o.state.get(p, {}).items()]
        for p, key, t in sorted(held, key=lambda h: self.became.get((id(h[0]), h[1]), math.inf)):
            self.see("optimizer_state", self.names.get(p, "?"), t, key)
        for o in each(self.optimizer):
            for group in o.param_groups:
                for p in group["params"]:
                    self.see("param", self.names.get(p, "?"), p)
        for name, b in self.model.named_buffers():
            if name not in self.constant_buffers:
                self.see("buffer", name, b)
        if isinstance(loss, torch.Tensor):
            self.see("loss", "loss", loss)
        for path, t in tree_flatten_with_path(batch)[0]:
            self.see("batch", "batch" + keystr(path), t)
        return [self.found[s] for s in ORDER if s in self.found]


class StateOrder(TorchDispatchMode):
    """Inside one optimizer's ``step()``: after every op, each of its state tensors that shares memory with a tensor the
    op was given is read whole (an op changes no tensor it is not given), and the first op after which one holds a
    non-finite value noted (``StepWatch.became``)."""

    def __init__(self, watch: StepWatch, optimizer: Any) -> None:
        super().__init__()
        self.watch, self.optimizer = watch, optimizer
        self.entries = -1
        self.held: dict[int | None, list[tuple[tuple[int, str], torch.Tensor]]] = {}  # memory -> state tensors there

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        self.watch.ops += 1
        with _disable_current_modes():  # read unseen by a mode watching the step (Births)
            entries = sum(map(len, self.optimizer.state.values()))
            if entries != self.entries:  # state created in this step (the first): where each tensor lies, again
                self.entries, self.held = entries, {}
                for group in self.optimizer.param_groups:
                    for p in group["params"]:
                        for key, t in self.optimizer.state.get(p, {}).items():
                            if _checkable(t):
                                self.held.setdefault(_memory(t), []).append(((id(p), key), t))
            given = {_memory(t) for t in _tensors([*args, *(kwargs or {}).values()])} | {None}
            for memory in given & self.held.keys():
                for where, t in self.held[memory]:
                    if where not in self.watch.became and (first_bad(t) if t.is_sparse else not torch.isfinite(t).all()):
                        self.watch.became[where] = self.watch.ops
        return out


def _tensors(values: list[Any]) -> list[torch.Tensor]:
    """The tensors among an op's arguments, each of a list (a foreach op's) too."""
    return [t for v in values for t in (v if isinstance(v, (list, tuple)) else [v]) if isinstance(t, torch.Tensor)]


def _memory(t: torch.Tensor) -> int | None:
    """Where a tensor's values lie; None for one with no storage of its own (sparse)."""
    try:
        return t.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):
        return None


def loss_only(found: list[Found]) -> bool:
    stages = {f.stage for f in found}
    return "loss" in stages and stages <= LOSS_ONLY


class Program:
    """A generated program's callables, run from its start: ``run`` steps it, ``snapshot``/``restore`` bracket a
    step that is run again."""

    def __init__(self, module: Any, extras: Callable[[Any, Any], dict[str, Any]]) -> None:
        self.module = module
        built = module.build_model()
        # a compiled model runs eagerly here: its hooks see every module (aot_eager runs the kernels eager mode runs),
        # and its parameters are named as the model the user wrote
        self.model = getattr(built, "_orig_mod", built)
        self.optimizer = module.make_optimizer(built)
        self.extras = extras(module, self.optimizer)
        held = [(n, b) for n, b in self.model.named_buffers() if _checkable(b)]
        self.constant_buffers = {n for n, b in held if not bool(torch.isfinite(b).all())}

    def snapshot(self) -> Any:
        """Everything a step reads: parameters, buffers, every gradient (a parameter no optimizer holds keeps its own
        from step to step), optimizer, scaler and scheduler state, the RNG."""
        grads = [None if p.grad is None else p.grad.detach() for p in self.model.parameters()]
        return copy.deepcopy((self.model.state_dict(), grads, [o.state_dict() for o in each(self.optimizer)],
                              {k: [x.state_dict() for x in each(v)] for k, v in self.extras.items()},
                              torch.get_rng_state()))

    def restore(self, snap: Any) -> None:
        model, grads, opt, extras, rng = copy.deepcopy(snap)
        self.model.load_state_dict(model)
        for p, g in zip(self.model.parameters(), grads):
            p.grad = g
        for o, state in zip(each(self.optimizer), opt):
            o.load_state_dict(state)
        for k, states in extras.items():
            for x, state in zip(each(self.extras[k]), states):
                x.load_state_dict(state)
        torch.set_rng_state(rng)

    def run(self, step: int, batch: Any) -> tuple[list[Found], bool]:
        """One step watched: its first non-finite value per stage, and whether ``optimizer.step()`` ran."""
        with StepWatch(self.model, self.optimizer, step, self.constant_buffers) as watch:
            loss = self.module.train_step(self.model, self.optimizer, batch, **self.extras)
        return watch.finish(batch, loss), watch.stepped

    def fails(self, step: int, batch: Any, want_loss_only: bool) -> bool:
        found, stepped = self.run(step, batch)
        found = caught(self, found, stepped)
        return bool(found) and loss_only(found) == want_loss_only


def caught(prog: Program, found: list[Found], stepped: bool) -> list[Found]:
    """A step whose overflow the GradScaler caught (it skipped the update) is benign, nothing found, unless something
    that outlives the step went non-finite anyway (BatchNorm's statistics, written by the forward): then all of it."""
    skipped = "scaler" in prog.extras and not stepped
    return [] if skipped and not any(f.stage in PERSISTENT for f in found) else found


def reference(module: Any, extras: Callable[[Any, Any], dict[str, Any]], steps: int) -> Reference:
    """The reference answer for a program: every step watched from the program's start."""
    prog = Program(module, extras)
    loss_only_steps: list[int] = []
    per_step: dict[int, list[Found]] = {}
    origin_step = None
    snaps: dict[int, Any] = {}
    for step in range(steps):
        snaps[step] = prog.snapshot()
        found, stepped = prog.run(step, module.make_batch(step))
        found = caught(prog, found, stepped)
        per_step[step] = found
        if found and loss_only(found):
            loss_only_steps.append(step)
        elif found:
            origin_step = step
            break
    explained = origin_step if origin_step is not None else (loss_only_steps[0] if loss_only_steps else None)
    out = Reference("nonfinite" if origin_step is not None else "loss_only" if loss_only_steps else "clean",
                    per_step[origin_step][0] if origin_step is not None else None, loss_only_steps, steps=per_step)
    if explained is None:
        return out
    batch = module.make_batch(explained)
    prog.restore(snaps[explained])
    out.op, out.phase = birth(prog, batch, per_step[explained][0].stage)
    size, singles = single_samples(batch)
    out.batch_size = size
    for i, one in enumerate(singles):
        prog.restore(snaps[explained])
        if prog.fails(explained, one, want_loss_only=origin_step is None):
            out.samples.append(i)
    return out


# ---- the op that made it ----------------------------------------------------------------------------------------

def _kinds(values: list[Any]) -> tuple[bool, bool]:
    """Whether any of these tensors holds a NaN, and whether any holds ±inf."""
    nan = inf = False
    for t in values:
        if isinstance(t, torch.Tensor) and (t.is_floating_point() or t.is_complex()) and t.numel() and not t.is_sparse \
                and not t.is_meta:
            nan = nan or bool(torch.isnan(t).any())
            inf = inf or bool(torch.isinf(t).any())
    return nan, inf


class Transforms(TorchFunctionMode):
    """Which torch.func transforms the user's code is inside, read where torch's Python API is called: below it, where
    ``Births`` runs, functorch has already unwrapped the tensors and hidden its interpreter stack. Also each autograd
    node a call created whose output is non-finite, with the first birth that reaches that output: its backward's
    birth is reached by it (log(0)'s -inf dropped by a where, then 0/0 in log's backward)."""

    def __init__(self, state: dict[str, Any]) -> None:
        super().__init__()
        self.state = state

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        keys = [i.key() for i in retrieve_all_functorch_interpreters()]
        before = self.state["inside"], self.state["differentiated"]
        self.state["inside"] = bool(keys)
        self.state["differentiated"] = any(k in (TransformType.Grad, TransformType.Jvp) for k in keys)
        try:
            out = func(*args, **(kwargs or {}))
        finally:
            self.state["inside"], self.state["differentiated"] = before
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.grad_fn is not None and t in self.state["reach"]:
                self.state["nodes"].setdefault(t.grad_fn, self.state["reach"][t])
        return out


class Births(TorchDispatchMode):
    """Every op whose output holds a NaN none of its inputs held, or an ±inf none held (a NaN made from ±inf counts):
    a non-tensor inf argument (``masked_fill(mask, -inf)``) is a constant written, not a value made.

    Each non-finite tensor an op writes is marked with the first birth that reaches it: the earliest of the op's own
    and its non-finite inputs' marks (``reach``). Several micro-batches make values that never meet: the first
    micro-batch's loss can overflow while a later one's forward overflows on its own.

    A birth inside a torch.func transform is kept only once a non-finite value leaves the transform: an op outside
    every transform reads one before any op outside has made one. A per-sample loss over no target is NaN inside
    ``vmap(grad(...))`` while its gradient, all the transform returns, is 0: that NaN never leaves."""

    def __init__(self, phase: Callable[[list[Any]], str], state: dict[str, Any]) -> None:
        super().__init__()
        self.phase, self.state = phase, state
        self.made: list[tuple[str, str]] = []
        self.pending: list[tuple[str, str]] = []  # made inside a transform, not yet seen leaving it
        self.births: list[tuple[str, str]] = []  # every birth, kept or pending, in program order
        self.reach: WeakTensorKeyDictionary = state["reach"]  # a non-finite tensor -> the first birth reaching it

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        inputs = tree_flatten((args, kwargs))[0]
        before = [_kinds([t]) for t in inputs]
        in_nan, in_inf = any(n for n, _ in before), any(i for _, i in before)
        inside = self.state["inside"]
        if not inside and (in_nan or in_inf) and self.pending and not self.made:
            self.made += self.pending  # what the transform made came out of it
        constant_inf = any(isinstance(a, float) and a in (float("inf"), float("-inf")) for a in inputs)
        came = [self.reach[t] for t, (n, i) in zip(inputs, before) if (n or i) and t in self.reach]
        out = func(*args, **kwargs)
        name = func._schema.name
        if name not in ALLOCATIONS and not constant_inf:
            # what it wrote: its outputs, and inputs it changed in place (BatchNorm's running statistics)
            written = [_kinds([t]) for t in inputs]
            out_nan, out_inf = _kinds(tree_flatten(out)[0])
            out_nan = out_nan or any(a[0] and not b[0] for a, b in zip(written, before))
            out_inf = out_inf or any(a[1] and not b[1] for a, b in zip(written, before))
            if (out_nan and not in_nan) or (out_inf and not in_inf and not in_nan):
                (self.pending if inside else self.made).append((name, self.phase(inputs)))
                came.append(len(self.births))
                node = torch._C._current_autograd_node()
                if node is not None and node in self.state["nodes"]:
                    came.append(self.state["nodes"][node])
                self.births.append((name, self.phase(inputs)))
        if came:
            for t in [*tree_flatten(out)[0], *inputs]:
                if isinstance(t, torch.Tensor) and any(_kinds([t])):
                    self.reach[t] = min(came + ([self.reach[t]] if t in self.reach else []))
        return out


def birth(prog: Program, batch: Any, stage: str) -> tuple[str | None, str | None]:
    """The first op, in program order, of the step that made a non-finite value from finite inputs and whose value
    reaches the origin (the first non-finite tensor of ``stage``; none reaches a value the batch brought in), and its
    phase:
    forward (inside a module, inside ``torch.func.grad``'s function, or building the graph), backward, optimizer
    (inside ``optimizer.step()``), before_update (the step's own code before the update, not building the graph),
    after_update (after it)."""
    state = {"depth": 0, "optimizer": False, "after": False, "inside": False, "differentiated": False,
             "reach": WeakTensorKeyDictionary(), "nodes": {}}

    def phase(inputs: list[Any]) -> str:
        if state["optimizer"]:
            return "optimizer"
        if torch._C._current_autograd_node() is not None:
            return "backward"
        if state["after"]:
            return "after_update"
        building = torch.is_grad_enabled() and any(isinstance(t, torch.Tensor) and t.requires_grad for t in inputs)
        if state["depth"] or building or state["differentiated"]:
            return "forward"
        return "before_update"

    handles = [torch.nn.modules.module.register_module_forward_pre_hook(lambda m, a: state.__setitem__(
        "depth", state["depth"] + 1)),
               torch.nn.modules.module.register_module_forward_hook(lambda m, a, o: state.__setitem__(
                   "depth", state["depth"] - 1)),
               *[o.register_step_pre_hook(lambda *a: state.__setitem__("optimizer", True)) for o in each(prog.optimizer)],
               *[o.register_step_post_hook(lambda *a: state.update(optimizer=False, after=True))
                 for o in each(prog.optimizer)]]
    mode = Births(phase, state)
    reached: list[int | None] = []

    def seen(found: str, t: torch.Tensor) -> None:
        if found == stage:
            reached.append(mode.reach.get(t))

    watch = StepWatch(prog.model, prog.optimizer, -1, prog.constant_buffers, seen)
    try:
        with Transforms(state), mode, watch:
            loss = prog.module.train_step(prog.model, prog.optimizer, batch, **prog.extras)
            watch.finish(batch, loss)
    finally:
        for h in handles:
            h.remove()
    return mode.births[reached[0]] if reached and reached[0] is not None else (None, None)


# ---- samples alone ------------------------------------------------------------------------------------------------

def single_samples(batch: Any) -> tuple[int | None, list[Any]]:
    """The batch's size and the batch of each single sample: every tensor or list as long as the batch (the size its
    tensors' first dimension and its lists share most) cut to that row, everything else kept whole; the samples of a
    batch of micro-batches counted across them in order."""
    if isinstance(batch, dict) and "micro_batches" in batch:
        out = []
        for micro in batch["micro_batches"]:
            n, singles = single_samples(micro)
            out += [{**batch, "micro_batches": [one]} for one in singles]
        return len(out), out
    sizes = [t.shape[0] for t in tree_flatten(batch)[0] if isinstance(t, torch.Tensor) and t.dim()]
    if not sizes:
        return None, []
    lists = [len(v) for v in (batch.values() if isinstance(batch, dict) else ()) if isinstance(v, list)]
    n = max(set(sizes), key=lambda k: ((sizes + lists).count(k), k))  # the size most leaves share, the larger on a tie

    def cut(node: Any, i: int) -> Any:
        if isinstance(node, torch.Tensor):
            return node[i:i + 1] if node.dim() and node.shape[0] == n else node
        if isinstance(node, dict):
            return {k: cut(v, i) for k, v in node.items()}
        if isinstance(node, (list, tuple)):
            if len(node) == n and not any(isinstance(t, torch.Tensor) for t in tree_flatten(node)[0]):
                return type(node)(node[i:i + 1])
            return type(node)(cut(v, i) for v in node)
        return node

    return n, [cut(batch, i) for i in range(n)]
