"""Distributed runs: recorded under torchrun, replayed at world size or with every rank emulated on one process.

Supported: DistributedDataParallel and FSDP2 (``fully_shard``) over one dimension of all ranks, with gradient
accumulation (DDP's ``no_sync()``, FSDP2's ``set_requires_gradient_sync``). Both keep each rank's forward and backward a
function of the shared parameters and that rank's own batch shard, and average the local gradients: so the first
non-finite *local* gradient names a rank and, within its shard, a sample, and one process can emulate the world.

Pipeline stages (``torch.distributed.pipelining``, one stage per rank) are recorded and replayed at world size by
``pipeline`` (their manifest section: ``stages``); they are never emulated on one process.

Not supported: tensor parallelism. It splits one sample's computation across ranks (a layer's columns), so no
rank's shard of the data is responsible on its own and no single process holds what one
rank computed; the recorder refuses models whose parameters are DTensors without ``fully_shard``. Neither are HSDP and
2-D meshes, FSDP1, or DDP communication hooks (they change the reduction's arithmetic).

Modules: ``layout`` (the run directory and its manifest section), ``wrapping`` (reading and rebuilding the wrappers),
``record`` (the recorder on each rank), ``checkpoint`` (DCP shards and per-rank RNG states), ``sessions`` (emulation
and torchrun replay), ``events`` and ``findings`` (ranks in the report), ``world`` (torchrun's process group).
"""
