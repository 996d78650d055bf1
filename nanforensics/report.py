"""Reports are plain dataclasses; this turns them into JSON (the one machine-readable view) and back."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from typing import Any, Collection, Literal, get_args

from .finite import encode_float

REPLAY_SCHEMA = "nanforensics.replay/1"

# The order in which a step touches its tensors; within a step, an earlier stage is the cause.
# Closed sets of words a report holds: a saved report with another word there is refused on loading (schema.py),
# so the views may look each up in a table.
Stage = Literal["batch", "forward", "loss", "grad", "optimizer_grad", "optimizer_state", "param", "buffer"]
STAGES: tuple[str, ...] = get_args(Stage)
Verdict = Literal["nonfinite", "clean", "not_reproduced", "loss_only"]
DefectKind = Literal["nonfinite", "extreme", "subnormal"]
# A step whose only non-finite values arose in these stages left the model's state intact: a non-finite loss with
# zero (or finite) gradients, as from a batch with no valid target.
LOSS_ONLY_STAGES = frozenset({"forward", "loss"})
PARAM_STAGES = frozenset({"grad", "optimizer_grad", "optimizer_state", "param"})  # an event names a parameter


def loss_only(stages: Collection[str]) -> bool:
    """Whether a step whose non-finite values lie in these stages is loss-only: a non-finite loss, nothing but forward
    activations beside it (a mean over no target), so no origin. The one rule replay and sample attribution share."""
    return "loss" in stages and set(stages) <= LOSS_ONLY_STAGES


@dataclass
class Event:
    """The first non-finite value met at one stage of one step (per state key for optimizer state).

    Stage ``buffer`` is the model's registered buffers (BatchNorm's running statistics, EMA shadows) after the step.
    """

    step: int
    stage: Stage
    tensor: str
    index: list[int]
    value: str  # "nan" | "inf" | "-inf"
    state_key: str | None = None
    elements_nonfinite: int = 0  # over every tensor of this stage (and state key) at this step
    tensors_nonfinite: int = 0
    dtype: str | None = None
    # distributed runs: the rank whose own values these are (its batch shard, activations, local gradients), or the
    # rank whose FSDP2 shard holds the coordinate; None for values every rank holds alike (DDP after the all-reduce)
    rank: int | None = None
    text: str = ""  # how the views name it, "grad fc2.weight[3, 7] = inf" (rootcause.findings.narrate)
    # the position of the check that met it among its stage's checks at this step, in hook order: ranks running the
    # same program check the same tensors in the same order, so across ranks the lower one was made first
    order: int | None = None
    nan_elements: int = 0  # of elements_nonfinite, the NaN ones (located steps): where NaN was made of infinities
    # optimizer_grad: the gradient tensors the step function rewrote (in place, or replaced) after backward had
    # accumulated them and before optimizer.step() (clipping, unscaling): the code between the two stages
    rewritten: int = 0
    # a run of several optimizers: the one that steps the parameter a grad, optimizer_grad, optimizer_state or param
    # event names (its name, or its position when the loop passed a list); None for one optimizer
    optimizer: str | None = None


@dataclass
class BatchRef:
    step: int
    file: str
    leaves: dict[str, Any]  # the batch's non-tensor leaves, such as sample ids
    rank: int | None = None  # distributed runs: the rank whose shard this is
    owner: str | None = None  # that rank in words, with its mesh coordinate on a DeviceMesh: "rank 2 (dp=1, tp=0)"


@dataclass
class StepRecord:
    """One replayed step: losses side by side, and how far the non-finite values have spread."""

    step: int
    logged_loss: float | None
    replayed_loss: float
    params_nonfinite: int
    params_total: int
    state_nonfinite: int
    state_total: int
    buffers_nonfinite: int = 0  # floating-point buffer values (integer buffers cannot be non-finite)
    buffers_total: int = 0
    loss_ulps: int | None = None  # |logged - replayed| in float32 ulps; None when either is missing or non-finite
    # distributed runs: each rank's logged and replayed loss (logged_loss and replayed_loss are their means)
    rank_logged_losses: list[float | None] | None = None
    rank_replayed_losses: list[float] | None = None


@dataclass
class TensorMismatch:
    """The first tensor whose replayed value differs from a recorded checkpoint's."""

    tensor: str          # model tensor name, or "exp_avg of fc1.weight" for optimizer state
    kind: str            # "parameter" | "buffer" | "optimizer_state"
    index: list[int]     # first differing coordinate; [] when the tensor is missing or its shape or dtype differs
    recorded: str        # the values there, as text ("0.0123", "nan", "missing", "float32[4, 8]")
    replayed: str
    elements: int        # differing elements
    ulps: int | None     # the difference at ``index`` in units in the last place of its dtype; None if not a float
    rank: int | None = None  # distributed runs (FSDP2): the rank whose shard of the tensor holds ``index``


@dataclass
class CheckpointComparison:
    """The replayed state, bit for bit, against a checkpoint the run recorded, as the replay passed it; within
    ``tolerance`` where the replay runs on another CPU than the run's (its kernels sum in another order)."""

    step: int            # the checkpoint's step: the state before that step, after step - 1
    path: str
    tensors: int         # tensors compared: parameters, buffers, optimizer state
    exact: bool          # every one equal bit for bit (NaN equal to NaN, whatever its payload)
    mismatched_tensors: int
    first_mismatch: TensorMismatch | None
    values: int = 0           # values compared
    nan_matched: int = 0      # of them, NaN on both sides: equal, but only in being NaN
    error: str | None = None  # the checkpoint could not be read: it decides nothing
    tolerance: float = 0.0    # relative tolerance the values were compared within; 0: bit for bit
    rounded: int = 0          # values that differ, but within ``tolerance``
    max_ulps: int | None = None  # the largest difference of those, in ulps of their dtype

    @property
    def matched(self) -> bool:
        """Bit-exact, or (compared within a tolerance) every value within it."""
        return self.error is None and (self.exact or (self.tolerance > 0 and self.first_mismatch is None))


@dataclass
class CpuIdentity:
    """The CPU a run was recorded or replayed on: its kernels' dispatch (capability) decides how they sum, so
    bit-exact replay is a property of replays on the same kind of CPU."""

    model: str       # e.g. "AMD EPYC 7B13", from /proc/cpuinfo (platform.processor() elsewhere); "" when unknown
    capability: str  # torch.backends.cpu.get_cpu_capability(): "AVX512", "AVX2", "DEFAULT", ...
    machine: str     # platform.machine(): "x86_64", "arm64", ...


@dataclass
class DataDefect:
    """A value in a logged batch that is non-finite, beyond the magnitude limit, or subnormal."""

    step: int
    file: str
    tensor: str          # batch leaf path, e.g. batch['x']
    kind: DefectKind
    count: int
    index: list[int]     # first such coordinate: [sample, feature, ...]
    value: str
    rank: int | None = None  # distributed runs: the rank whose shard holds it


@dataclass
class OpSite:
    """Where an aten operation ran: phase, module path, the user's source line."""

    op: str                       # e.g. "aten::div.Tensor"
    phase: str                    # "forward" | "backward" | "optimizer" | "before_update" | "after_update": the
                                  # step function's own code before (not building the graph) or after optimizer.step()
    module: str | None            # module path the op ran under ("<root>" for the model, None outside it)
    source: str | None            # "file.py:line in function" of the user's code
    input_dtypes: list[str]
    input_ranges: list[list[str]]  # [min, max] of each floating input, as strings ("inf", "2.8e-45", ...); for
                                   # the op a value was born in, of every tensor input (a -100 target, a mask)
    output_dtypes: list[str]
    output_ranges: list[list[str]] = field(default_factory=list)  # [min, max] of each floating output


@dataclass
class InfSource:
    """Where the ±inf came from that the culprit made NaN of, when it was not computed in the step."""

    kind: str                     # "constant": written on purpose (masked_fill/fill/full/where with an inf scalar:
                                  # a mask); "outside": only held before the step by a tensor the step read (a buffer)
    site: OpSite | None           # the operation nearest the culprit that wrote it ("constant")
    tensor: str | None = None     # a named parameter or buffer that held it before the step, if one did


@dataclass
class OperationCulprit:
    """The operation of the responsible step where the origin's non-finite value was born, found by following
    that value back along the data flow (see ``rootcause/operations.py``)."""

    site: OpSite
    output_value: str             # "nan" | "inf" | "-inf"
    output_index: list[int]
    autograd_node: str | None = None   # for a backward op, e.g. "LogBackward0"
    forward: OpSite | None = None      # for a backward op, the forward operation it differentiates
    note: str | None = None
    traced_from: str | None = None     # the origin value followed back, e.g. "forward blocks.0.attn.proj[5, 0, 0] = nan"
    path: list[str] = field(default_factory=list)  # ops from the culprit to the origin value (views left out,
                                                   # a long middle elided as "…")
    inputs_at_index: list[list[str] | None] = field(default_factory=list)  # per input: [min, max] of the elements
                                       # output_index was computed from (a softmax row); None where the op mixes
                                       # whole inputs (a matmul, a reduction) or overwrote that one in place
    inf_source: InfSource | None = None  # for a NaN made from ±inf that was not computed: where that inf came from
    nan_site: OpSite | None = None     # where NaN arose from the culprit's inf, when that is another operation
    nan_node: str | None = None        # nan_site's autograd node, for a backward op


@dataclass
class SampleAttribution:
    """Which samples of the responsible batch reproduce the non-finite gradient on their own."""

    status: str                   # "attributed" | "coupled" | "batch_wide" | "not_reproduced" | "opted_out" | "unsplittable"
    batch_size: int | None
    samples: list[int]            # positions in the batch
    sample_leaves: dict[str, list[Any]]  # logged non-tensor leaves (ids) of those samples
    passes: int                   # passes of the whole step spent
    coupled_groups: list[list[int]]
    message: str
    micro_batch_samples: list[list[int]] = field(default_factory=list)  # [micro-batch, position in it] of each
                                  # sample, when the optimizer step was several micro-batches (gradient accumulation)
    # batch_wide: the step whose batch was run from the responsible step's state too, and whether it failed there
    # (failing: the state is the cause; passing: what this batch's samples share, a length, a padding, is)
    compared_step: int | None = None
    compared_fails: bool | None = None
    # the batch's tensors kept whole when it was split (per-batch ones: a label mask, class weights), by path; and of
    # them, those that make a batch-wide failure: with the step before's in their place the batch stays finite
    whole_leaves: list[str] = field(default_factory=list)
    cause_leaves: list[str] = field(default_factory=list)
    # how the samples were judged (rootcause/samples.py): "each_alone" (every sample run alone: exactly those that fail
    # alone), "group_testing" (halving, which trusts a set that passes: a sample that fails alone can hide in one),
    # "probes" (batch-wide from single samples drawn at random); None where the batch was not split
    judged: str | None = None


@dataclass
class Precursor:
    """Per-step magnitudes that show a drift towards overflow before the event."""

    step: int
    grad_norm: float | None
    grad_max_abs: float | None
    update_max_abs: float | None
    state_max_abs: dict[str, float]   # per optimizer-state key (exp_avg_sq: Adam's v), over all parameters
    activation_max_abs: float | None
    activation_dtype: str | None
    activation_headroom: float | None  # max |activation| / the dtype's largest finite value
    learning_rate: float | None = None  # the largest of the param groups' "lr" at optimizer.step()


@dataclass
class ScalerStep:
    """One replayed step of the loss-scaling control loop (or of a loop that skips steps on its own)."""

    step: int
    scale: float | None       # the GradScaler's scale before the step; None without one
    next_scale: float | None  # after the step's scaler.update()
    adjustment: str           # "backoff" | "growth" | "hold" ("hold" too without a scaler)
    skipped: bool             # optimizer.step() did not run
    overflow: str | None      # where the step's first non-finite value arose: "data", "forward", "loss",
                              # "backward", "unscale", "optimizer" or "update"; None when all was finite
    caught: bool              # skipped with optimizer state and parameters intact: benign


@dataclass
class AmpReport:
    """Mixed precision: the scaler as a control loop, its caught overflows apart from the failure that got through."""

    autocast: str | None      # dtype the forward ran in under torch.autocast ("float16", "bfloat16")
    param_dtype: str
    scaler: bool
    steps: list[ScalerStep]
    caught: list[Event]       # first non-finite value of each step skipped before the moments were written
    state_poisoned_by: Event | None  # the first non-finite value that reached optimizer state: the real failure


@dataclass
class Unsound:
    """Optimizer state that is finite but unsound (checkpoints.soundness): which check, on which tensor (or
    hyperparameter) of which parameter and group, the first coordinate that breaks it, the values there, and what it
    does at the next update."""

    check: str
    tensor: str  # the checkpoint's name of the tensor, or "param_groups[g].key" for a hyperparameter
    param: str | None  # the parameter's name; "#i" (its position in the optimizer's order) where none is recorded
    group: int | None  # its param group
    index: list[int] | None  # the first coordinate that breaks the check
    values: dict[str, Any]  # the values there (or the hyperparameter's)
    message: str


@dataclass
class WhatIfResult:
    """One replay from the start checkpoint with one change at the responsible step, checked for K steps after."""

    intervention: str         # as given ("clip=1.0", "skip", ...); "none" for the replay as recorded
    description: str
    step: int                 # the step it changed
    last_step: int            # the last step checked
    finite: bool              # loss, parameters and optimizer state stayed finite from `step` to `last_step`
    first_nonfinite_step: int | None
    first_nonfinite: str | None  # what went first: "loss", "param fc1.weight", "exp_avg of fc1.weight"
    first_nonfinite_loss_step: int | None
    losses: list[float | None]   # per step from `step` to `last_step`; None where the step did not run
    detail: str | None        # what the change met (the total gradient norm it clipped, the values it reset)


@dataclass
class CheckpointLoad:
    """How a checkpoint written without the recorder was loaded into the model and optimizer the user's code built."""

    checkpoint: str
    layout: str                   # "torch.save dict", "nanforensics checkpoint", or a folder's files
    step: int                     # the state before this step: the first step replayed
    step_from: str                # "metadata" | "trainer_state.json" | "name" | "--from-step"
    batches: str                  # the batch function, as an import string
    model_prefix_stripped: str | None  # a wrapper's prefix ("module.", "_orig_mod.") removed from every key
    optimizer_matched: str        # "name": by the parameter names the file records; "order": it records none
    optimizer_params: int
    same_shape_params: int        # by order: parameters sharing their shape with another of their group
    scheduler: str                # "restored" | "none" | "unused": the checkpoint holds one, no factory was named
    rng_restored: list[str]       # generators restored from the checkpoint: "torch", "cuda", "python", "numpy"
    rng_missing: str | None       # why the others were not
    random_modules: list[str]     # dropout modules with p > 0: their masks depend on the torch RNG


@dataclass
class TensorSpread:
    """One parameter (or a layer of them) and its optimizer state: non-finite values after each step of the map."""

    name: str
    params_total: int
    state_total: int
    params_nonfinite: list[int]
    state_nonfinite: list[int]


@dataclass
class SpreadMap:
    """Where the non-finite values are after each step: the data behind the spread heatmaps (replay/spread.py)."""

    steps: list[int]  # the counts are taken after each of these steps
    rows: list[TensorSpread]  # in the optimizer's parameter order
    responsible_step: int | None
    basis: str  # "per_tensor": measured per tensor; "totals": the replay report's whole-model totals
    # the rows merged into layers for drawing (spread.layered): at most 24 for a terminal or Markdown, 48 for a page
    text_rows: list[TensorSpread] = field(default_factory=list)
    page_rows: list[TensorSpread] = field(default_factory=list)


@dataclass
class ReplaySetup:
    run: str
    from_checkpoint: int
    first_step: int
    last_step: int
    device: str
    num_threads: int
    imported: list[str]
    world_size: int | None = None  # distributed runs: the ranks recorded
    wrapping: str | None = None    # "ddp", "fsdp2" or "tp" (tensor parallelism alone)
    ranks_replayed: str | None = None  # "emulated": every rank on this process; "torchrun": one process per rank
    # a run on a DeviceMesh: its shape, dimension names and tensor-parallel dimension (None: HSDP)
    mesh_shape: list[int] | None = None
    mesh_dim_names: list[str] | None = None
    tp_dim: str | None = None
    # losses judged within this relative tolerance (besides float32 ulps): the replay sums in another order than the run
    loss_rtol: float | None = None
    # a replay on the CPU: the CPU the run names (None: its manifest does not say) and this one
    recorded_cpu: CpuIdentity | None = None
    replay_cpu: CpuIdentity | None = None
    # the torch.compile backend the run trained under (the manifest's); the replay ran the compiled module eagerly
    compiled: str | None = None


@dataclass
class RankCheck:
    """One rank of a distributed run: its logged losses against the replay's."""

    rank: int
    logged_first_nonfinite_loss_step: int | None
    diverged_at_step: int | None  # first step whose logged loss differs from the replayed one; None: all equal
    logged_loss: float | None     # at that step
    replayed_loss: float | None


@dataclass
class PipelineOrigin:
    """Where in a pipeline-parallel step the origin arose: the stage (and its rank) and the micro-batch."""

    stage: int
    rank: int
    microbatch: int | None  # None: after every micro-batch (the optimizer's update)
    microbatches: int
    schedule: str           # "ScheduleGPipe" or "Schedule1F1B"
    rows: list[int]         # [first, end) of the micro-batch's rows in the step's batch; [] with no micro-batch
    logged_microbatch_losses: list[float] = field(default_factory=list)  # the last stage's, at the origin's step
    replayed_microbatch_losses: list[float] = field(default_factory=list)
    text: str = ""        # how the views name where the origin arose, "stage 0 (rank 0), micro-batch 2 of 4"
    batch_text: str = ""  # how they name the responsible micro-batch, ", micro-batch 2 of 4 (rows 4-5)"
    mesh: dict[str, int] = field(default_factory=dict)  # with data parallelism, the rank's {"pp": stage, "dp": pipeline}


@dataclass
class ReplayReport:
    verdict: Verdict
    responsible_step: int | None
    responsible_batch: BatchRef | None
    first_nonfinite_loss_step: int | None
    logged_first_nonfinite_loss_step: int | None
    origin: Event | None
    events: list[Event]
    spread: list[StepRecord]
    state_poisoned: bool
    reproduced: bool | None  # replayed losses equal the logged ones; None: no logged loss to compare with
    diverged_at_step: int | None
    fully_nonfinite_step: int | None
    findings: list[str]
    setup: ReplaySetup
    data_defects: list[DataDefect] = field(default_factory=list)
    operation: OperationCulprit | None = None
    samples: SampleAttribution | None = None
    precursors: list[Precursor] = field(default_factory=list)
    schema: str = field(default=REPLAY_SCHEMA)
    amp: AmpReport | None = None
    what_if: list[WhatIfResult] = field(default_factory=list)
    loaded: CheckpointLoad | None = None  # a replay from a checkpoint the recorder did not write
    loss_only_steps: list[int] = field(default_factory=list)  # before the origin: a non-finite loss, state intact
    checkpoints_compared: list[CheckpointComparison] = field(default_factory=list)
    loss_max_ulps: int | None = None  # the largest |logged - replayed| loss difference, float32 ulps
    ranks: list[RankCheck] = field(default_factory=list)  # distributed runs, one per rank
    # The sentences and the picture the views render, drawn from the facts above once they are final
    # (rootcause.findings.narrate): views only render.
    headline: str = ""
    reproduction: str = ""  # whether the replay reproduced the logged losses, in one sentence
    spread_map: SpreadMap | None = None  # the whole model as one row, from the per-step totals in ``spread``
    unsound: list[Unsound] = field(default_factory=list)  # the start checkpoint's finite but unsound optimizer state
    pipeline: PipelineOrigin | None = None  # pipeline-parallel runs: the origin's stage and micro-batch


def to_jsonable(obj: Any) -> Any:
    """Dataclasses become dicts; non-finite floats become "nan"/"inf"/"-inf" (JSON has no such numbers)."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        fields = sorted(dataclasses.fields(obj), key=lambda f: f.name != "schema")  # schema first, for readers
        return {f.name: to_jsonable(getattr(obj, f.name)) for f in fields}
    if isinstance(obj, dict):
        return {str(k): to_jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [to_jsonable(v) for v in obj]
    if isinstance(obj, float):
        return encode_float(obj)
    return obj


def to_json(report: Any) -> str:
    return json.dumps(to_jsonable(report), indent=2, allow_nan=False) + "\n"
