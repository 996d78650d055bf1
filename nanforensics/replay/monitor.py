"""Per-step hooks that check every stage of a training step for non-finite values.

Two modes. *Detect* (the default) only says which stages and tensors went non-finite: cheap enough
to run on every replayed step. A CPU tensor's verdict is read on the spot (``finite.is_finite``: a
CPU reduction has finished when it returns, so there is nothing to wait for); on an accelerator each
tensor's ``aminmax`` stays on the device and the step ends with one host sync. *Locate* checks each
tensor the moment a hook sees it and, when one is bad, records its first coordinate and value before
later code mutates it (gradient clipping turns inf into NaN in place); inside ``optimizer.step()`` it
notes the write that first left each tensor non-finite (``StateWrites``), so that of the optimizer state
the one the update made non-finite first is named. Replay runs a step in locate mode only after detect
mode has flagged it.

What detect mode guarantees: a step is flagged iff a non-finite value is in the batch, in any tensor
of any module's forward output (every module, not only the root: a later module can absorb a NaN, a
mask or an index that drops it), in the loss, in a gradient as accumulated, in a gradient changed
between backward and ``optimizer.step()`` (clipping, unscaling), in the optimizer state or in the
parameters after the step. Values inside one module's forward that never reach its output are the
operation trace's business (rootcause/operations.py). docs/performance.md has the cost of each part.
In detect mode on CPU the optimizer state and the parameters of Adam, AdamW and SGD are read only on the steps where
their finiteness does not follow from the gradients' magnitudes read anyway (proof.py, and the assumption it states).
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import keystr, tree_flatten, tree_flatten_with_path, tree_leaves
from torch.utils.weak import WeakIdKeyDictionary

from .. import finite
from ..distributed.tensors import local_part
from ..distributed.wrapping import unsharded_params
from ..report import PARAM_STAGES, STAGES, Event
from ..runs.batches import leaves
from ..runs.checkpoint import optimizer_params
from ..runs.optimizers import owners
from .proof import StepProof, provable

_RANK = {s: i for i, s in enumerate(STAGES)}


def output_tensors(name: str, output: Any) -> list[tuple[str, Any]]:
    """Each leaf of module ``name``'s output (any nested structure pytree flattens: tuples, dicts, a PackedSequence,
    a Hugging Face ModelOutput) with its name: the module's for the first leaf, the module's and the leaf's place in
    the output for the others (``rnn[1][0]``: h_n of an LSTM's ``(output, (h_n, c_n))``, whether ``output`` is a
    tensor or a PackedSequence of four)."""
    try:
        places = [keystr(path) for path, _ in tree_flatten_with_path(output)[0]]
    except ValueError:  # a type registered with pytree without a way to name its children: their leaf numbers
        places = [f"[{i}]" for i in range(len(tree_leaves(output)))]
    return [(name if i == 0 else f"{name}{place}", t) for i, (place, t) in enumerate(zip(places, tree_leaves(output)))]


def output_module(model: torch.nn.Module, label: str) -> tuple[str, torch.nn.Module] | None:
    """The module whose output ``output_tensors`` named ``label``: the longest module name it starts with."""
    modules = {"<root>": model, **{n: m for n, m in model.named_modules() if n}}
    named = [n for n in modules if label == n or label.startswith((f"{n}[", f"{n}."))]
    return (max(named, key=len), modules[max(named, key=len)]) if named else None


class StateWrites(TorchDispatchMode):
    """Inside ``optimizer.step()``, in locate mode: the position, among the step's operations, of the write that first
    left each tensor non-finite (one written through a view counts for the tensor viewed).

    The first optimizer state to go non-finite is the first in the program order the update writes its state in, which
    neither the state's names nor their order in the state dict follow: Adafactor writes row_var then col_var, RMSprop
    square_avg, grad_avg, then momentum_buffer, foreach Rprop copies the gradients into prev before step_size and again
    after. Only the writes an operation's schema declares (in place, ``out=``) are read, once a tensor is found."""

    def __init__(self) -> None:
        super().__init__()
        self.ops = 0
        self.bad: WeakIdKeyDictionary = WeakIdKeyDictionary()  # tensor -> the operation that made it non-finite
        self.active = False

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        self.ops += 1
        for i, a in enumerate(func._schema.arguments):
            if a.alias_info is None or not a.alias_info.is_write:
                continue
            for t in tree_flatten(args[i] if i < len(args) else kwargs.get(a.name))[0]:
                if not isinstance(t, torch.Tensor) or _owner(t) in self.bad:
                    continue
                local, _ = local_part(t)  # a sharded tensor in this rank's shard, as ``check`` reads it
                if finite.checkable(local) and not finite.is_finite(local):
                    self.bad[_owner(t)] = self.ops
        return out

    def clear(self) -> None:
        """A new step: nothing written yet."""
        self.ops = 0
        self.bad.clear()

    def start(self) -> None:
        """Watch from here (an optimizer's ``step()`` begins), until ``stop``."""
        if not self.active:
            self.active = True
            self.__enter__()

    def stop(self) -> None:
        if self.active:
            self.active = False
            self.__exit__(None, None, None)

    def when(self, t: Any) -> float:
        """The operation of the step that made ``t`` non-finite; inf for one no watched write left non-finite."""
        return self.bad.get(_owner(t), math.inf) if isinstance(t, torch.Tensor) else math.inf


def _owner(t: torch.Tensor) -> torch.Tensor:
    """The tensor a write to ``t`` changes: the one it views, if it is a view."""
    return t if t._base is None else t._base


class StepMonitor:
    """Hooks on one model and its optimizer; ``begin`` and ``end`` bracket each step."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, defer: bool | None = None,
                 prove: bool = True) -> None:
        """``defer``: keep detect-mode verdicts on the device until ``end`` (the default off the CPU); True on a
        CPU model exercises that path where there is no accelerator. ``prove``: in detect mode on CPU, skip reading
        optimizer state and parameters proven finite (proof.py); False reads them every step."""
        self.model, self.optimizer = model, optimizer
        self.defer = defer
        on_cpu = all(p.device.type == "cpu" for p in optimizer_params(optimizer))
        self.proof = StepProof(optimizer) if prove and on_cpu and not defer and provable(optimizer) else None
        self._grad_max: dict[torch.Tensor, float] = {}  # param -> its gradient's largest magnitude, while proving
        self.proven = {"optimizer_state": 0, "param": 0}  # tensors of the step not read, by stage: proven finite
        self.param_names = {p: n for n, p in reversed(list(model.named_parameters(remove_duplicate=False)))}
        # Several optimizers stepping in turn (a GAN): the one stepping each parameter, by the parameter's name, for the
        # events that name it. A step is then several passes, each ending in one optimizer's step(): that optimizer's
        # state and parameters are checked right after it (a later pass reads them), and the step's events are
        # ordered by the pass they arose in before their stage. ``_updated``: what a pass checked, (tensor, version).
        self._owners = {self._name(p): o for p, o in owners(optimizer).items()}
        self._passes = 0
        # the pass the model last ran forward in: the returned loss, checked at the step's end, was computed from its
        # outputs, in that pass (a loss made before the first optimizer's step() ranks before that pass's gradients)
        self._forward_pass = 0
        self._pass_of: dict[tuple[str, str | None], int] = {}
        self._updated: dict[tuple[torch.Tensor, str | None], tuple[torch.Tensor, int]] = {}
        self._handles: list[Any] = []
        self._writes = StateWrites()  # locate mode: the order the update made its state non-finite in
        self.step = -1
        self.locate = False
        # detect-mode verdicts kept on the device until ``end``: (stage, name, state key, order, pass, min and max)
        self._pending: list[tuple[str, str, str | None, int, int, tuple[torch.Tensor, torch.Tensor]]] = []
        self._checks: dict[str, int] = {}  # stage -> its checks made so far in this step: an event's order
        self._events: dict[tuple[str, str | None], Event] = {}
        self._grad_seen: dict[torch.Tensor, tuple[torch.Tensor, int]] = {}  # param -> (its grad, version) at backward
        self._rewritten = 0  # gradients the step function rewrote between backward and optimizer.step() (located)
        # Buffers already non-finite before the first monitored step are constants (a -inf attention mask kept as a
        # non-persistent buffer), not state that went bad: the start checkpoint's persistent buffers are all finite.
        held = [(n, b) for n, b in model.named_buffers() if finite.checkable(b)]
        self._constant_buffers = {n for (n, _), ok in zip(held, finite.all_finite_flags([b for _, b in held])) if not ok}

    # -- installation ---------------------------------------------------------------------------

    def __enter__(self) -> "StepMonitor":
        for name, module in self.model.named_modules():
            self._handles.append(module.register_forward_hook(self._forward_hook(name or "<root>")))
        # an FSDP2 model's gradients accumulate in unsharded twins of its parameters: the local gradients, hooked there
        for p, name in unsharded_params(self.model, self.param_names).items():
            if p.requires_grad:
                self._handles.append(p.register_post_accumulate_grad_hook(self._grad_hook(name)))
        self._handles.append(self.optimizer.register_step_pre_hook(self._optimizer_pre_hook))
        self._handles.append(self.optimizer.register_step_post_hook(lambda *_: self._writes.stop()))  # before a pass ends
        if self.proof is not None:
            self._handles.append(self.optimizer.register_step_post_hook(self._optimizer_post_hook))
        if self._owners:
            self._handles.append(self.optimizer.register_step_post_hook(self._pass_end_hook))
        return self

    def __exit__(self, *exc: object) -> None:
        self._writes.stop()  # a step that raised inside the update
        for h in self._handles:
            h.remove()
        self._handles.clear()

    def _forward_hook(self, name: str) -> Any:
        def hook(module: torch.nn.Module, args: Any, output: Any) -> None:
            self._forward_pass = self._passes
            if isinstance(output, torch.Tensor):  # the common case, without flattening
                self.check("forward", name, output)
                return
            for label, t in output_tensors(name, output):
                self.check("forward", label, t)
        return hook

    def _grad_hook(self, name: str) -> Any:
        def hook(p: torch.Tensor) -> None:
            self._grad_seen[p] = (p.grad, p.grad._version)
            if self._proving():
                self._grad_max[p] = self._max_abs("grad", name, p.grad)
            else:
                self.check("grad", name, p.grad)
        return hook

    def _proving(self) -> bool:
        return self.proof is not None and not self.locate

    def _optimizer_pre_hook(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        for p in optimizer_params(optimizer):  # of several optimizers, the one stepping now
            if p.grad is None:
                continue
            # Detect mode skips a gradient nothing touched since backward (same tensor, same version
            # counter): the grad stage already checked those values. Clipping or unscaling bumps the version.
            seen = self._grad_seen.get(p)
            untouched = seen is not None and seen[0] is p.grad and seen[1] == p.grad._version
            if not self.locate and untouched:
                continue
            self._rewritten += seen is not None and not untouched
            if self._proving():
                self._grad_max[p] = self._max_abs("optimizer_grad", self._name(p), p.grad)
            else:
                self.check("optimizer_grad", self._name(p), p.grad)
        if self.proof is not None and self._proving():
            self.proof.before_step(self._grad_max)
        if self.locate:
            self._writes.start()

    def _optimizer_post_hook(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if self.proof is not None and self._proving():
            self.proof.after_step()

    def _pass_end_hook(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        """Several optimizers: after one of them stepped, its state and parameters, as this pass left them."""
        self._check_updated(optimizer_params(optimizer), optimizer.state)
        self._passes += 1

    # -- one step -------------------------------------------------------------------------------

    def _name(self, p: torch.Tensor) -> str:
        return self.param_names.get(p, f"param.{id(p):x}")

    def begin(self, step: int, batch: Any, locate: bool) -> None:
        self.step, self.locate = step, locate
        self._writes.stop()
        self._writes.clear()
        self._pending.clear()
        self._grad_seen.clear()
        self._rewritten = 0
        self._passes = self._forward_pass = 0
        self._pass_of.clear()
        self._updated.clear()
        self._grad_max.clear()
        self.proven = {"optimizer_state": 0, "param": 0}
        if self.proof is not None and locate:
            self.proof.forget()  # locate mode reads everything and keeps no bound
        self._events = {}
        self._checks.clear()
        for path, leaf in leaves(batch):
            self.check("batch", path, leaf)

    def end(self, loss: Any) -> list[Event]:
        """Check loss, optimizer state, parameters and buffers; return this step's events in stage order.

        In detect mode an event only names the stage and tensor; its index is empty.
        """
        if isinstance(loss, torch.Tensor):
            self.check("loss", "loss", loss)
        elif isinstance(loss, (int, float)) and not math.isfinite(loss):
            self._add("loss", "loss", None, torch.tensor(float(loss)))
        self._check_updated(optimizer_params(self.optimizer), self.optimizer.state)
        for name, b in self.model.named_buffers():  # looked up each step: a module may assign a new tensor
            if name not in self._constant_buffers:
                self.check("buffer", name, b)
        if self._pending:
            flags = finite.min_max_verdicts([pair for *_, pair in self._pending])
            for (stage, name, key, order, made_in, _), good in zip(self._pending, flags):
                if not good:
                    self._note(stage, name, key, index=[], value="", elements=0, dtype=None, order=order,
                               made_in=made_in)
            self._pending.clear()
        if ("optimizer_grad", None) in self._events:
            self._events[("optimizer_grad", None)].rewritten = self._rewritten
        return sorted(self._events.values(),
                      key=lambda e: (self._pass_of.get((e.stage, e.state_key), 0), _RANK[e.stage], e.order or 0))

    def _check_updated(self, params: list[torch.Tensor], state: Any) -> None:
        """The optimizer state, then the parameters, after the update; in locate mode the state in the order the update
        made it non-finite (``StateWrites``), so that a stage's first event is the first state to go non-finite and names
        the first parameter whose state did. Of several optimizers, a tensor a pass already checked is read again at the
        step's end only if something wrote it since (a clamp after ``step()``)."""
        held = [(p, key, t) for p in params for key, t in state.get(p, {}).items()]
        if self.locate:
            held.sort(key=lambda item: self._writes.when(item[2]))
        for p, key, t in [*held, *((p, None, p) for p in params)]:
            stage = "param" if key is None else "optimizer_state"
            if self._owners and isinstance(t, torch.Tensor):
                seen = self._updated.get((p, key))
                if seen is not None and seen[0] is t and seen[1] == t._version:
                    continue
                self._updated[(p, key)] = (t, t._version)
            if self.proof is None or not self._proving() or not finite.checkable(t):
                self.check(stage, self._name(p), t, state_key=key)
            elif self.proof.proven(p, key, t):
                self.proven[stage] += 1
            else:
                bound = self._max_abs(stage, self._name(p), t, key)
                if math.isfinite(bound):
                    self.proof.learn(p, key, t, bound)

    def check(self, stage: str, name: str, t: Any, state_key: str | None = None) -> None:
        # a sharded tensor (a DTensor at world size) is checked in this rank's shard, its coordinates the whole one's
        t, offset = local_part(t)
        if not finite.checkable(t):  # an empty shard too
            return
        self._checks[stage] = self._checks.get(stage, 0) + 1
        if not self.locate and (self.defer or (self.defer is None and t.device.type != "cpu")):
            self._pending.append((stage, name, state_key, self._checks[stage], self._pass(stage), finite.min_max(t)))
        elif not finite.is_finite(t):
            if self.locate:
                self._add(stage, name, state_key, t, offset)
            else:
                self._note(stage, name, state_key, index=[], value="", elements=0, dtype=None)

    def _max_abs(self, stage: str, name: str, t: Any, state_key: str | None = None) -> float:
        """Detect mode on CPU, keeping a proof: ``check`` by ``aminmax``, which also gives the largest magnitude
        the proof needs; inf when ``t`` holds a non-finite value."""
        t, _ = local_part(t)
        if not finite.checkable(t):
            return math.inf
        self._checks[stage] = self._checks.get(stage, 0) + 1
        lo, hi = finite.min_max(t)
        lo, hi = lo.item(), hi.item()
        if math.isfinite(lo) and math.isfinite(hi):
            return max(-lo, hi)
        self._note(stage, name, state_key, index=[], value="", elements=0, dtype=None)
        return math.inf

    def _add(self, stage: str, name: str, key: str | None, t: torch.Tensor, offset: list[int] | None = None) -> None:
        where = finite.locate(t)
        assert where is not None
        index = where.index if offset is None else [i + o for i, o in zip(where.index, offset)]
        self._note(stage, name, key, index=index, value=where.value, elements=finite.count_nonfinite(t),
                   dtype=str(t.dtype).removeprefix("torch."), nans=finite.count_nan(t))

    def _pass(self, stage: str) -> int:
        """The pass a value checked now arose in: the loss's is the pass the model last ran forward in."""
        return self._forward_pass if stage == "loss" else self._passes

    def _note(self, stage: str, name: str, key: str | None, *, index: list[int], value: str, elements: int,
              dtype: str | None, order: int | None = None, nans: int = 0, made_in: int | None = None) -> None:
        """An event of the step (or one more tensor of it); ``made_in``: the pass it was checked in, where the
        verdict was read later (deferred)."""
        event = self._events.get((stage, key))
        if event is None:
            self._events[(stage, key)] = Event(self.step, stage, name, index, value, key, elements, 1, dtype,
                                               order=order or self._checks.get(stage, 0), nan_elements=nans,
                                               optimizer=self._owners.get(name) if stage in PARAM_STAGES else None)
            if self._owners:
                self._pass_of[(stage, key)] = self._pass(stage) if made_in is None else made_in
        else:
            event.tensors_nonfinite += 1
            event.elements_nonfinite += elements
            event.nan_elements += nans


def totals(optimizer: torch.optim.Optimizer) -> tuple[int, int]:
    """Element counts of the parameters and of the optimizer's floating-point state."""
    params = optimizer_params(optimizer)
    state = sum(v.numel() for p in params for v in optimizer.state.get(p, {}).values() if finite.checkable(v))
    return sum(p.numel() for p in params), state


def buffers_total(model: torch.nn.Module) -> int:
    """Element count of the model's floating-point buffers: the ones a step can make non-finite."""
    return sum(b.numel() for b in model.buffers() if finite.checkable(b))
