"""Several optimizers in one training step (a GAN's generator and discriminator, each stepping its own parameters of
one model), seen by recording and replay as one optimizer.

An ``OptimizerSet`` is an ``Optimizer`` whose parameter groups are its members' groups in order, whose state is theirs,
and whose state dict numbers every member's parameters one after the other (torch's own layout, as one optimizer
over all the groups would): the checkpoint writer and reader, the monitor's hooks, snapshots and the operation trace
work on it unchanged. The step function is given the members as the loop gave them to the ``Recorder`` (``given``).
"""

from __future__ import annotations

from typing import Any, Callable, Iterable, Iterator, Mapping, Sequence

import torch
from torch.utils.hooks import RemovableHandle

GIVEN = ("list", "tuple", "dict")  # the container the loop passed, and the step function gets again

# What a run of several optimizers may not be recorded with (docs/recording.md, "Several optimizers"), and why: refused
# when the Recorder is built and when a manifest that names them is read, before anything runs.
UNSUPPORTED = {
    "guard": "its skip leaves a whole step unwritten, but of several optimizers stepping in turn (a GAN's) the first "
             "has written its update before the next one's gradients exist",
    "distributed": "their ranks' state is not recorded yet",
}


class _Handles:
    """One removable handle for a hook registered on every member."""

    def __init__(self, handles: list[RemovableHandle]) -> None:
        self.handles = handles

    def remove(self) -> None:
        for h in self.handles:
            h.remove()


class OptimizerSet(torch.optim.Optimizer):
    """Named optimizers over disjoint parameters, one optimizer to everything that inspects the run's state.

    ``torch.optim.Optimizer.__init__`` is not called: the groups and state live in the members, read through. The set
    itself is never stepped: the step function steps each member, and the hooks registered here run on each."""

    def __init__(self, members: Mapping[str, torch.optim.Optimizer], given: str) -> None:
        if given not in GIVEN:
            raise ValueError(f"given must be one of {GIVEN}, not {given!r}")
        self.members, self.given, self.defaults = dict(members), given, {}
        seen: dict[torch.Tensor, str] = {}
        for name, opt in self.members.items():
            if not isinstance(opt, torch.optim.Optimizer):
                raise TypeError(f"optimizer {name} is a {type(opt).__name__}, not a torch.optim.Optimizer")
            for p in optimizer_params(opt):
                if p in seen:
                    raise ValueError(f"a parameter is stepped by optimizers {seen[p]} and {name}: each parameter must "
                                     "belong to one optimizer")
                seen[p] = name
        self.owners = seen  # parameter -> the name of the optimizer stepping it

    def as_given(self) -> Any:
        """The members as the training loop passed them: what the step function receives."""
        return shaped(list(self.members), list(self.members.values()), self.given)

    @property
    def param_groups(self) -> list[dict[str, Any]]:  # type: ignore[override]
        return [g for opt in self.members.values() for g in opt.param_groups]

    @property
    def state(self) -> "_States":  # type: ignore[override]
        """Every member's state, read through (not copied: the monitor looks each parameter up)."""
        return _States(self)

    def group_owners(self) -> list[str]:
        """The name of the member each of ``param_groups`` belongs to (checkpoints' ``group_optimizers``)."""
        return [name for name, opt in self.members.items() for _ in opt.param_groups]

    def accounts(self, said: list[tuple[torch.optim.Optimizer, str | None]]) -> str | None:
        """What was done at each member's ``step()`` (a what-if's detail), each under the member's name."""
        names = {id(o): n for n, o in self.members.items()}
        return "; ".join(f"optimizer {names[id(o)]}: {text}" for o, text in said if text) or None

    def state_dict(self) -> dict[str, Any]:  # type: ignore[override]
        state: dict[int, Any] = {}
        groups: list[dict[str, Any]] = []
        offset = 0
        for opt in self.members.values():
            sd = opt.state_dict()
            state.update({offset + i: s for i, s in sd["state"].items()})
            groups += [{**g, "params": [offset + i for i in g["params"]]} for g in sd["param_groups"]]
            offset += len(optimizer_params(opt))
        return {"state": state, "param_groups": groups}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:  # type: ignore[override]
        groups = state_dict["param_groups"]
        if len(groups) != len(self.param_groups):
            raise ValueError(f"the state holds {len(groups)} parameter groups, the optimizers {len(self.param_groups)}")
        start = 0
        for opt in self.members.values():
            own = groups[start:start + len(opt.param_groups)]
            start += len(opt.param_groups)
            local = {i: n for n, i in enumerate(i for g in own for i in g["params"])}
            opt.load_state_dict({"state": {local[i]: s for i, s in state_dict["state"].items() if i in local},
                                 "param_groups": [{**g, "params": [local[i] for i in g["params"]]} for g in own]})

    def zero_grad(self, set_to_none: bool = True) -> None:
        for opt in self.members.values():
            opt.zero_grad(set_to_none=set_to_none)

    def register_step_pre_hook(self, hook: Callable[..., Any]) -> Any:  # type: ignore[override]
        """On every member: the hook runs before each member's ``step()``, given that member."""
        return _Handles([opt.register_step_pre_hook(hook) for opt in self.members.values()])

    def register_step_post_hook(self, hook: Callable[..., Any]) -> Any:  # type: ignore[override]
        return _Handles([opt.register_step_post_hook(hook) for opt in self.members.values()])


class _States(Mapping[torch.Tensor, Any]):
    """A set's state by parameter: each looked up in the member that steps it, as in that member's own ``state``
    (indexing a parameter without state yet gives it an empty one there, as torch does; ``get`` adds nothing)."""

    def __init__(self, optimizers: OptimizerSet) -> None:
        self.optimizers = optimizers

    def _own(self, p: Any) -> Any:
        owner = self.optimizers.owners.get(p) if isinstance(p, torch.Tensor) else None
        return self.optimizers.members[owner].state if owner is not None else None

    def __getitem__(self, p: torch.Tensor) -> Any:
        own = self._own(p)
        if own is None:
            raise KeyError(p)
        return own[p]

    def get(self, p: torch.Tensor, default: Any = None) -> Any:
        own = self._own(p)
        return own.get(p, default) if own is not None else default

    def __contains__(self, p: object) -> bool:
        own = self._own(p)
        return own is not None and p in own

    def __iter__(self) -> Iterator[torch.Tensor]:
        return (p for opt in self.optimizers.members.values() for p in opt.state)

    def __len__(self) -> int:
        return sum(len(opt.state) for opt in self.optimizers.members.values())


def optimizer_params(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """Every parameter the optimizer steps, in its order (the indices of its state dict)."""
    return [p for g in optimizer.param_groups for p in g["params"]]


def loose_params(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> list[tuple[str, torch.Tensor]]:
    """The parameters that require grad but no optimizer holds (Muon's biases, a frozen layer's that still requires
    grad), by name: nothing zeroes their gradients, so those carry over from step to step, and a replay must start
    from them as they were (a snapshot's, a checkpoint's)."""
    held = {id(p) for p in optimizer_params(optimizer)}
    return [(n, p) for n, p in model.named_parameters() if id(p) not in held and p.requires_grad]


def optimizer_set(optimizer: Any) -> torch.optim.Optimizer:
    """What the ``Recorder`` was given as its optimizer: one ``Optimizer`` as it is; a list or tuple of them (named
    by index, ``"0"``, ``"1"``) or a dict of them by name as an ``OptimizerSet``."""
    if isinstance(optimizer, torch.optim.Optimizer):
        return optimizer
    if isinstance(optimizer, Mapping):
        if not optimizer or not all(isinstance(k, str) and k for k in optimizer):
            raise TypeError("a dict of optimizers needs at least one, each under a non-empty string name")
        return OptimizerSet(optimizer, "dict")
    if isinstance(optimizer, (list, tuple)) and optimizer:
        return OptimizerSet({str(i): o for i, o in enumerate(optimizer)}, "tuple" if isinstance(optimizer, tuple)
                            else "list")
    what = f"an empty {type(optimizer).__name__}" if isinstance(optimizer, (list, tuple)) else type(optimizer).__name__
    raise TypeError(f"optimizer must be a torch.optim.Optimizer, or a list, tuple or dict of them, not {what}")


def members_of(optimizer: torch.optim.Optimizer) -> list[torch.optim.Optimizer]:
    """The optimizers whose ``step()`` the step function calls: a set's members, else the optimizer itself."""
    return list(optimizer.members.values()) if isinstance(optimizer, OptimizerSet) else [optimizer]


def shaped(names: Sequence[str], values: list[Any], given: str) -> Any:
    """One value per member, in the container the loop passed the optimizers in (``given``): a dict by the names, a
    tuple or a list in the members' order."""
    if given == "dict":
        return dict(zip(names, values))
    return tuple(values) if given == "tuple" else values


def as_given(held: Any) -> Any:
    """What the step function is called with: a set's members (optimizers, schedulers) as the loop passed them, else
    the one optimizer or scheduler."""
    return held.as_given() if isinstance(held, (OptimizerSet, SchedulerSet)) else held


def owners(optimizer: torch.optim.Optimizer) -> dict[torch.Tensor, str]:
    """Each parameter's optimizer by name, for a set (a report names which one); empty for one optimizer."""
    return optimizer.owners if isinstance(optimizer, OptimizerSet) else {}


def group_owners(optimizer: torch.optim.Optimizer) -> list[str] | None:
    """meta.json's ``group_optimizers``: None for one optimizer (the key is then absent)."""
    return optimizer.group_owners() if isinstance(optimizer, OptimizerSet) else None


def matched(values: Any, names: Sequence[str], given: str, what: str = "optimizer_factory") -> list[Any]:
    """What the ``Recorder`` got as ``what`` for a set (its factories, its schedulers), one per member in its order:
    None, or the same container shape as the optimizers (a list of the same length, a dict with the same names)."""
    if values is None:
        return [None] * len(names)
    if given == "dict" and isinstance(values, Mapping) and set(values) == set(names):
        return [values[n] for n in names]
    if given != "dict" and isinstance(values, (list, tuple)) and len(values) == len(names):
        return list(values)
    raise TypeError(f"{what} for several optimizers must be None or shaped like optimizer= (a list of as many, or a "
                    "dict with the same names)")


class SchedulerSet:
    """The LR schedulers of a run of several optimizers, each over one member (a GAN's StepLR for the generator, a
    cosine one for the discriminator), one scheduler to checkpoints and replay: its state is each one's under its
    optimizer's name. A member may have none."""

    def __init__(self, members: Mapping[str, Any], optimizers: OptimizerSet) -> None:
        self.members, self.names, self.given = dict(members), list(optimizers.members), optimizers.given

    def as_given(self) -> Any:
        """The schedulers as the loop passed them, None for a member without one: what the step function receives."""
        return shaped(self.names, [self.members.get(n) for n in self.names], self.given)

    def state_dict(self) -> dict[str, Any]:
        return {name: s.state_dict() for name, s in self.members.items()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if not isinstance(state, dict) or set(state) != set(self.members):
            held = sorted(state) if isinstance(state, dict) else type(state).__name__
            raise ValueError(f"it holds the schedulers of optimizers {held}, the run's are {sorted(self.members)}")
        for name, s in self.members.items():
            s.load_state_dict(state[name])


def scheduler_set(optimizers: OptimizerSet, schedulers: Any, factories: Any) -> tuple[SchedulerSet, list[Any]]:
    """The ``Recorder``'s ``scheduler=`` and ``scheduler_factory=`` for a set, each shaped like ``optimizer=``: the
    schedulers as one, and each member's factory (None where it has no scheduler)."""
    names = list(optimizers.members)
    given = matched(schedulers, names, optimizers.given, "scheduler")
    made = matched(factories, names, optimizers.given, "scheduler_factory")
    for name, scheduler, factory in zip(names, given, made):
        if (scheduler is None) != (factory is None):
            raise ValueError(f"optimizer {name}: pass its scheduler and its scheduler_factory together (or neither)")
        if scheduler is not None and getattr(scheduler, "optimizer", None) is not optimizers.members[name]:
            raise ValueError(f"the scheduler given for optimizer {name} schedules another optimizer: replay builds "
                             f"it with its factory over optimizer {name}")
    return SchedulerSet({n: s for n, s in zip(names, given) if s is not None}, optimizers), made


def unsupported(features: Iterable[str]) -> str | None:
    """Why a run of several optimizers cannot have ``features`` (the first of them ``UNSUPPORTED`` holds); None when
    it can. The one statement of the limit, for the recorder's error and the reader's."""
    refused = [f for f in features if f in UNSUPPORTED]
    return f"{refused[0]} is not supported with several optimizers: {UNSUPPORTED[refused[0]]} (docs/recording.md, " \
           "Several optimizers)" if refused else None
