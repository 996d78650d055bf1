"""Distributed runs: recorded under torchrun, replayed at world size or with every rank emulated on one process.

Supported: DistributedDataParallel and FSDP2 (``fully_shard``) over one dimension of all ranks, with gradient
accumulation (DDP's ``no_sync()``, FSDP2's ``set_requires_gradient_sync``). Both keep each rank's forward and backward a
function of the shared parameters and that rank's own batch shard, and average the local gradients: so the first
non-finite *local* gradient names a rank and, within its shard, a sample, and one process can emulate the world.

On a DeviceMesh: tensor parallelism alone (``parallelize_module`` with ColwiseParallel, RowwiseParallel,
SequenceParallel), FSDP2 over tensor parallelism (the plan on ``tp``, ``fully_shard`` on ``dp``) and HSDP. The ranks of
a tensor-parallel group share one batch, recorded once; the data-parallel groups play the part ranks play above. At
world size each rank checks its own shards at the DTensor's global coordinates, so a local computation names a rank
and its mesh coordinate, and a group's batch a sample; on one process the tensor-parallel layers are rebuilt whole,
which sums in another order (reproduction judged within a tolerance).

Not supported: tensor parallelism over part of the ranks with nothing averaging the rest, other parallel styles (the
plan is read back off the hooks of the three above), FSDP1, DDP communication hooks (they change the reduction's
arithmetic).

Pipeline stages (``torch.distributed.pipelining``, one stage per rank, optionally ``dp`` pipelines side by side with
each stage under DDP or FSDP2 over its data-parallel ranks, and each stage's own LR scheduler) are recorded and replayed at
world size by ``pipeline`` (their manifest section: ``stages``, ``data_parallel``); they are never emulated on one
process. A model compiled inside or around DDP or FSDP2 is recorded under the compiled module's own names.

Modules: ``layout`` (the run directory and its manifest section), ``wrapping`` (reading and rebuilding the wrappers),
``record`` (the recorder on each rank), ``checkpoint`` (DCP shards and per-rank RNG states), ``sessions`` (emulation
and torchrun replay), ``events`` and ``findings`` (ranks in the report), ``world`` (torchrun's process group).
"""
