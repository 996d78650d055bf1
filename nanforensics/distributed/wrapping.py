"""The data-parallel wrappers a recorded run used: read off the user's wrapped model, and built again for replay.

DDP replicates the model and all-reduces (averages) gradients; FSDP2 (``fully_shard``) shards parameters, gradients
and optimizer state along dimension 0 and reduce-scatters (averages) gradients. Both leave each rank's forward and
backward a function of its own shard alone, and both average the local gradients: the two facts the single-process
emulation rests on. Tensor parallelism splits one sample's computation across the ranks of a group that share one
batch: its plan is read off the hooks ``parallelize_module`` leaves (``describe_mesh``) and applied again for replay
(``parallelize``), and the emulation runs its layers whole.
"""

from __future__ import annotations

import sys
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

import torch
from torch import nn

from ..errors import BadInput
from ..runs.compiled import own_name, unwrapped
from ..runs.layout import DDP, DTYPES, FSDP2, STYLES, TP, Mesh, World
from ..words import every
from .tensors import is_dtensor


def _fsdp_module_class() -> type | None:
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # torch < 2.6 has fully_shard only under torch.distributed._composable
        return None
    return FSDPModule


def _dtype_name(dtype: torch.dtype | None) -> str | None:
    return None if dtype is None else str(dtype).removeprefix("torch.")


def describe(model: nn.Module, world_size: int) -> tuple[str, nn.Module, dict[str, Any]]:
    """(kind, the model as the user defined it, the options replay needs to wrap it again); ValueError for what
    replay could not rebuild."""
    from torch.nn.parallel import DistributedDataParallel

    ddp = unwrapped(model)  # torch.compile(DDP(module)): the wrapper inside the compiled one
    if isinstance(ddp, DistributedDataParallel):
        if getattr(ddp, "_comm_hooks", None):
            raise ValueError("the DDP model has a communication hook, which changes how gradients are reduced; "
                             "nanforensics cannot rebuild it for replay")
        return DDP, ddp.module, {"broadcast_buffers": bool(ddp.broadcast_buffers),
                                 "find_unused_parameters": bool(ddp.find_unused_parameters),
                                 "gradient_as_bucket_view": bool(ddp.gradient_as_bucket_view)}
    if type(ddp).__name__ == "FullyShardedDataParallel":
        raise ValueError("FSDP1 (FullyShardedDataParallel) is not supported; shard with FSDP2's fully_shard")
    fsdp = _fsdp_module_class()
    # FSDP2 under torch.compile, or over a compiled module (which fully_shard turns into an FSDP module itself):
    # modules named as in the model the factory builds
    sharded = [(own_name(name), m) for name, m in model.named_modules() if fsdp is not None and isinstance(m, fsdp)]
    mesh = describe_mesh(model, world_size)
    if sharded:
        return FSDP2, model, {"modules": [_fsdp_options(name, m, world_size, mesh) for name, m in reversed(sharded)]}
    if mesh is not None:
        if mesh.data_ranks != 1:
            raise ValueError(f"the model is tensor-parallel over {mesh.tp_dim!r} of a {mesh.shape} mesh but nothing "
                             f"averages its gradients over {', '.join(mesh.data_dims)}: shard it with fully_shard on "
                             "the data-parallel dimensions, or train tensor-parallel over every rank")
        return TP, model, {}
    raise ValueError(f"under torch.distributed with {world_size} ranks, pass the model wrapped by "
                     "DistributedDataParallel or fully_shard (FSDP2), as the loop trains it")


def describe_mesh(model: nn.Module, world_size: int) -> Mesh | None:
    """The DeviceMesh the model's DTensor parameters live on, when it is not one dimension of every rank sharded by
    FSDP2 alone: its shape and names, the tensor-parallel dimension and plan, each parameter's placements. ValueError
    for a layout replay could not rebuild."""
    params = {n: p for n, p in model.named_parameters() if is_dtensor(p)}
    plan = _tp_plan(model)
    # meshes compared by what they are (a mesh made again, or a root looked up twice, is another object)
    roots = {(tuple(r.mesh.flatten().tolist()), r.mesh_dim_names): r
             for r in (p.device_mesh._get_root_mesh() for p in params.values())}
    if not plan and all(m.ndim == 1 and m.size() == world_size for m in roots.values()):
        return None
    if len(roots) != 1:
        raise ValueError("the model's DTensor parameters live on more than one DeviceMesh")
    root = next(iter(roots.values()))
    names = root.mesh_dim_names
    if names is None or root.mesh.flatten().tolist() != list(range(world_size)):
        raise ValueError("nanforensics replays meshes made by init_device_mesh(device, shape, mesh_dim_names=...) over "
                         f"every one of the {world_size} ranks in order")
    tp_dims = {m.mesh_dim_names for _, _, m in plan}
    if len(tp_dims) > 1 or any(dims is None or len(dims) != 1 for dims in tp_dims):
        raise ValueError("the tensor-parallel plan spans more than one named mesh dimension")
    tp_dim = next(iter(tp_dims))[0] if tp_dims else None
    return Mesh(tuple(root.shape), tuple(names), tp_dim, tuple(spec for _, spec, _ in plan), placements(model))


def placements(model: nn.Module) -> dict[str, dict[str, str]]:
    """Each DTensor parameter's placement on each named mesh dimension, as the manifest writes it."""
    return {own_name(n): {d: repr(pl) for d, pl in zip(p.device_mesh.mesh_dim_names or (), p.placements)}
            for n, p in model.named_parameters() if is_dtensor(p)}


def check_placements(rebuilt: dict[str, dict[str, str]], world: World, manifest: Path) -> None:
    """BadInput unless the placements replay rebuilt (the plan, then ``fully_shard``) are the recorded ones: another
    placement shards another slice to each rank, so a replay over it would not be the run's."""
    if world.mesh is None or rebuilt == world.mesh.placements:
        return
    recorded = world.mesh.placements
    name = next(n for n in sorted(recorded.keys() | rebuilt.keys()) if recorded.get(n) != rebuilt.get(n))
    raise BadInput(manifest, f"distributed.mesh.placements of {name!r} are {_shown(recorded.get(name))} but replay "
                             f"rebuilt {_shown(rebuilt.get(name))} from the recorded plan and wrapping")


def _shown(placed: dict[str, str] | None) -> str:
    return "none (not a DTensor)" if placed is None else ", ".join(f"{d}={pl}" for d, pl in placed.items()) or "{}"


def _tp_plan(model: nn.Module) -> list[tuple[str, dict[str, Any], Any]]:
    """(module name, its ``parallelize_module`` style as the manifest writes it, its mesh) for every module a
    ColwiseParallel, RowwiseParallel or SequenceParallel style distributed: read off the hooks ``distribute_module``
    registers, whose closures hold the style's layouts. ValueError for another style."""
    import functools

    wanted = {"ColwiseParallel": "colwise", "RowwiseParallel": "rowwise", "SequenceParallel": "sequence"}
    out = []
    for name, module in model.named_modules():
        found: dict[str, Any] = {}
        for hook in [*module._forward_pre_hooks.values(), *module._forward_hooks.values()]:
            cells = [c.cell_contents for c in getattr(hook, "__closure__", None) or ()]
            fn = next((c for c in cells if isinstance(c, functools.partial)), None)
            mesh = next((c for c in cells if type(c).__name__ == "DeviceMesh"), None)
            if fn is None or mesh is None:
                continue
            owner, _, role = getattr(fn.func, "__qualname__", "").partition(".")
            if owner not in wanted:
                raise ValueError(f"module {name!r} is distributed by {owner or fn.func!r}; nanforensics rebuilds "
                                 f"{', '.join(wanted)}")
            found["style"], found["mesh"] = wanted[owner], mesh
            found[role] = fn.args
        if found:
            style = found["style"]
            inputs, outputs = found.get("_prepare_input_fn", ()), found.get("_prepare_output_fn", ())
            if style == "sequence":
                layout = repr(inputs[0][0]) if inputs else "Shard(dim=1)"
                spec = {"input_layouts": layout, "output_layouts": layout, "use_local_output": bool(outputs[0])}
            else:
                spec = {"input_layouts": repr(inputs[0][0]), "output_layouts": repr(outputs[0][0]),
                        "use_local_output": bool(outputs[1])}
            out.append((name, {"module": own_name(name), "style": style, **spec}, found["mesh"]))
    assert all(s["style"] in STYLES for _, s, _ in out)
    return out


def _fsdp_options(name: str, module: nn.Module, world_size: int, layout: Mesh | None) -> dict[str, Any]:
    state = module._get_fsdp_state()  # type: ignore[operator]
    groups = state._fsdp_param_groups
    for group in groups:
        mesh = group.mesh_info.mesh
        dims = tuple(mesh.mesh_dim_names or ())
        if layout is None and (mesh.ndim != 1 or mesh.size() != world_size):
            raise ValueError(f"module {name or '<root>'!r} is sharded over a {tuple(mesh.shape)} mesh; nanforensics "
                             f"replays FSDP2 over one dimension of {every(world_size, 'rank')} or a named DeviceMesh")
        if layout is not None and dims != layout.data_dims:
            raise ValueError(f"module {name or '<root>'!r} is sharded over mesh dimensions {dims}; nanforensics "
                             f"replays fully_shard over every data-parallel dimension, {layout.data_dims}")
    mp = state._mp_policy
    odd = [d for d in (mp.param_dtype, mp.reduce_dtype, mp.output_dtype) if d is not None and _dtype_name(d) not in DTYPES]
    if odd:
        raise ValueError(f"module {name or '<root>'!r}'s MixedPrecisionPolicy computes in {odd[0]}; nanforensics "
                         f"replays FSDP2 in {', '.join(DTYPES)}")
    return {"module": name,
            "reshard_after_forward": all(g.post_forward_mesh_info is not None for g in groups),
            "mp_policy": {"param_dtype": _dtype_name(mp.param_dtype), "reduce_dtype": _dtype_name(mp.reduce_dtype),
                          "output_dtype": _dtype_name(mp.output_dtype), "cast_forward_inputs": mp.cast_forward_inputs}}


def mixed_precision(world: World) -> bool:
    """Whether FSDP2 computes or reduces in another dtype than the parameters'."""
    return any(v is not None for spec in world.wrapping.get("modules", [])
               for k, v in spec["mp_policy"].items() if k.endswith("dtype"))


# ---- at world size: the real wrappers ------------------------------------------------------------------------


_DDP_DEFAULTS = {"broadcast_buffers": True, "find_unused_parameters": False, "gradient_as_bucket_view": False}


def wrap_ddp(module: nn.Module, recorded: dict[str, Any], device: torch.device, group: Any = None) -> nn.Module:
    """DDP as the run built it (its ``recorded`` options), over ``group`` (all ranks unless given: a pipeline stage's
    data-parallel ranks); options at their defaults are left out (newer torch deprecates some by name).

    Gradients are never views of DDP's buckets here: the checks read each local gradient as backward accumulates it,
    and a bucket view may be scaled or reduced in place by then. Copied or not, the arithmetic is the same."""
    from torch.nn.parallel import DistributedDataParallel

    ids = [device.index if device.index is not None else torch.cuda.current_device()] if device.type == "cuda" else None
    wanted = {**{k: v for k, v in recorded.items() if k in _DDP_DEFAULTS}, "gradient_as_bucket_view": False}
    options = {k: v for k, v in wanted.items() if _DDP_DEFAULTS.get(k) != v}
    return DistributedDataParallel(module, device_ids=ids, process_group=group, **options)


def shard_fsdp2(module: nn.Module, world: World, device: torch.device) -> None:
    """``fully_shard`` as the run applied it, children before their parents; the unsharded parameters are then
    materialised once, so hooks can be put on them (the local gradients accumulate there, before the reduce-scatter)."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh(device.type, (world.world_size,)) if world.mesh is None else parallelize(module, world, device)
    shard_modules(module, world.wrapping["modules"], mesh)


def shard_modules(module: nn.Module, specs: list[dict[str, Any]], mesh: Any) -> None:
    """``fully_shard`` over ``mesh`` on each module of ``specs`` (as the manifest lists them: children before their
    parents), then the unsharded parameters materialised once (a pipeline stage's data-parallel ranks too)."""
    from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

    for spec in specs:
        policy = {k: getattr(torch, v) if k.endswith("dtype") and v is not None else v
                  for k, v in spec["mp_policy"].items()}
        fully_shard(module.get_submodule(spec["module"]), mesh=mesh, mp_policy=MixedPrecisionPolicy(**policy),
                    reshard_after_forward=spec["reshard_after_forward"])
    for m in module.modules():
        if isinstance(m, FSDPModule):
            m.unshard()
            m.reshard()


def parallelize(module: nn.Module, world: World, device: torch.device) -> Any:
    """The run's DeviceMesh made again, its tensor-parallel plan applied to ``module``; returns the mesh of its
    data-parallel dimensions (the one ``fully_shard`` shards over: HSDP where it has two)."""
    from torch.distributed.device_mesh import init_device_mesh

    layout = world.mesh
    assert layout is not None
    root = init_device_mesh(device.type, layout.shape, mesh_dim_names=layout.dim_names)
    if layout.plan:
        apply_plan(module, root[layout.tp_dim], layout.plan)
    dims = layout.data_dims
    return root[dims if len(dims) > 1 else dims[0]] if dims else None


def apply_plan(module: nn.Module, mesh: Any, plan: Any) -> None:
    """``parallelize_module`` on ``mesh`` with the recorded ``plan`` (its entries as the manifest writes them)."""
    from torch.distributed.tensor.parallel import parallelize_module

    parallelize_module(module, mesh, {spec["module"]: _style(spec) for spec in plan})


def _placement(text: str) -> Any:
    """A placement as the manifest writes it (``Mesh`` checked it against its pattern): Replicate() or Shard(dim=d)."""
    from torch.distributed.tensor import Replicate, Shard

    return Replicate() if text == "Replicate()" else Shard(int(text.removeprefix("Shard(dim=").rstrip(")")))


def _style(spec: dict[str, Any]) -> Any:
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel

    if spec["style"] == "sequence":
        return SequenceParallel(sequence_dim=_placement(spec["input_layouts"]).dim,
                                use_local_output=spec["use_local_output"])
    cls = ColwiseParallel if spec["style"] == "colwise" else RowwiseParallel
    return cls(input_layouts=_placement(spec["input_layouts"]), output_layouts=_placement(spec["output_layouts"]),
               use_local_output=spec["use_local_output"])


def unsharded_params(model: nn.Module, names: dict[torch.Tensor, str]) -> dict[torch.Tensor, str]:
    """For an FSDP2 model, each parameter's unsharded twin by the parameter's name: the tensor backward accumulates
    the local gradient into. Parameters of other models map to themselves."""
    fsdp = getattr(sys.modules.get("torch.distributed.fsdp"), "FSDPModule", None)  # no FSDP2 module before its import
    twins: dict[torch.Tensor, str] = {}
    for m in model.modules():
        if fsdp is None or not isinstance(m, fsdp):
            continue
        for group in m._get_fsdp_state()._fsdp_param_groups:  # type: ignore[operator]
            for fp in group.fsdp_params:
                if hasattr(fp, "_unsharded_param") and fp.sharded_param in names:
                    twins[fp._unsharded_param] = names[fp.sharded_param]
    covered = set(twins.values())
    return twins | {p: n for p, n in names.items() if n not in covered}


# ---- on one process: what the step function sees of the wrapper ---------------------------------------------------


class EmulatedDDP(nn.Module):
    """DDP's face to a step function, over the one model of the emulation: ``forward``, ``module``, ``no_sync()``.

    As in DDP, a forward pass run inside ``no_sync()`` marks its backward as one that only accumulates: the gradients
    are averaged over the ranks only after a backward whose forward ran outside it.
    """

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self.module = module
        self.require_backward_grad_sync = True
        self.sync_pending = True

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if torch.is_grad_enabled():
            self.sync_pending = self.require_backward_grad_sync
        return self.module(*args, **kwargs)

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        before, self.require_backward_grad_sync = self.require_backward_grad_sync, False
        try:
            yield
        finally:
            self.require_backward_grad_sync = before

    def syncs(self) -> bool:
        return self.sync_pending


class EmulatedFSDP:
    """FSDP2's methods a step function calls, mixed into the emulation's model class (as ``fully_shard`` itself swaps
    the class): ``set_requires_gradient_sync`` (gradient accumulation), and no-op ``unshard``/``reshard``."""

    _requires_gradient_sync = True

    def set_requires_gradient_sync(self, requires_gradient_sync: bool, *, recurse: bool = True) -> None:
        self._requires_gradient_sync = requires_gradient_sync

    def unshard(self, async_op: bool = False) -> None:
        return None

    def reshard(self) -> None:
        return None

    def syncs(self) -> bool:
        return self._requires_gradient_sync


def emulated(module: nn.Module, world: World) -> nn.Module:
    """What the step function is given in the emulation of ``world``."""
    if world.kind == DDP:
        return EmulatedDDP(module)
    cls = type(module)
    module.__class__ = type(f"Emulated{cls.__name__}", (EmulatedFSDP, cls), {})
    return module
