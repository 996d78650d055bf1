"""Sample level: which samples of the responsible batch produce the non-finite gradient.

Every pass is the whole step on a subset of the batch (forward, backward, clipping, scaler and accumulation as the
step function does them, ``optimizer.step()`` and the code after it), with the model, gradients, optimizer, scaler,
scheduler and RNG restored before every pass, so nothing is touched. A subset fails when anything the replay watches
goes non-finite, the update's writes included: the one predicate "this sample fails alone" means, whatever stage the
step's own failure is in. A step whose forward fails can hold samples whose forward stays finite and whose update
overflows (an LR spike, a large finite gradient whose square overflows Adam's moments): judged on forward and
backward alone they would pass.

How the samples are judged (``Split.judged``, the report's ``judged``, and its message says which):

- ``each_alone``: a batch of up to ``ALONE_UP_TO`` samples has every sample run alone (one pass each, after the whole
  batch): the samples named are exactly those that fail alone, whatever the step does with the batch. Group testing
  cannot promise that: it trusts that a set holding a sample that fails alone fails too, and a step that couples its
  samples breaks it. BatchNorm in training normalises a sample among the others; a loss averaged over the batch
  (``reduction="mean"``, PyTorch's default, or KL's ``batchmean``) weighs a sample alone B times what it weighs in the
  batch, so under a slow overflow it fails alone and passes in the half that held it (the oracle's seed 250601). A
  mean over the batch leaves no trace a pass could read (a sum divided by a count is one), so no cheap check says
  when halving is sound: below the limit it is not used, nor the hint's shortcut, which trusts the same.
- ``group_testing``: a larger batch is halved, recursing into the halves that still fail: k bad samples cost
  O(k log B) passes instead of B. Each sample named failed alone; a sample that fails alone may still hide in a half
  that passed, and the message says that halving trusted the halves that passed.
- ``probes``: a larger batch found batch-wide by the probes below, before any halving.

Halving turns to every sample alone (B passes more, at most, ``each_alone`` again) when it finds a failing set whose
halves both pass (*coupled*: BatchNorm statistics, a loss normalised over the batch), when a sample found failing
alone (a probe, the hint) is one halving did not name (a set that passed held it), or when the step called
``batch_norm`` in training: each shows a passing set can hold a sample that fails alone. A group is coupled only when
none of its samples fails alone; it is reported as such, never narrowed down by guessing. Judging each sample alone,
a failure that needs samples together is found by one more pass, the batch without the samples that fail alone
(when some do): where it still fails, halving it names the coupled group.

A failure is *batch-wide* when most samples fail alone: the step (its learning rate, loss scale, or
weights grown over many steps), not its data, is then responsible. Deciding that must not cost a
pass per sample: single samples are tried first in an order drawn at random, and as soon as more than half the
batch fails alone the batch is batch-wide, exactly (a batch of 8 that all fail: 5 samples run alone). Above ``ALONE_UP_TO``,
up to ``PROBES`` and one more than half the batch are tried before halving, stopping at the first that passes;
when all of them fail, the batch is batch-wide, wrong with a chance below 2**-PROBES when at most half fail.
Otherwise halving names the samples, and a batch whose named samples are more than half of it is batch-wide as
well; exactly half is not.

Above ``ALONE_UP_TO``, before any of that, the sample the failure's own coordinates point at (the origin's first
coordinate, or that of the operation the trace found, when the tensor's first dimension is the batch's) is tried
alone and the rest of the batch without it: when only it fails, three passes in all (the whole batch, the sample,
the rest) name it, trusting the rest's pass as halving trusts a half's.

Which leaves are the samples' rows (``batch_size``, ``whole_leaves``): the batch size is the first dimension shared
by the most tensors of the batch (of one dimension at least); a tie is broken by the length of the batch's per-sample
lists (ids), and is otherwise unsplittable. A tensor whose first dimension is the batch size is split with the
samples; every other leaf is kept whole: a 0-dim tensor, a tensor of another first dimension (a label mask over the
vocabulary, a class-weight vector), a value that is no tensor. A per-batch tensor whose length happens to equal the
batch size cannot be told from a per-sample one by its shape: it is split like one, unless the step function names
it whole, ``train_step.nanforensics_whole = ["batch['class_weight']"]`` (the paths the report writes). When a batch
fails as a whole, each per-batch tensor is swapped for the step before's (one pass each): one whose swap leaves the
batch finite is named as the cause, a batch-wide failure from a per-batch tensor rather than from the step's state.

A step function can opt out (its batch is not split along dimension 0) by setting
``train_step.nanforensics_splittable = False``. In an optimizer step recorded as several micro-batches
(gradient accumulation), positions count across the micro-batches in order, and each sample found is also
given as (micro-batch, position in it).
"""

from __future__ import annotations

import random
from collections import Counter
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any, Callable, Collection

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from ..errors import BadInput
from ..progress import SILENT, Progress
from ..replay.amp import scaler_caught
from ..replay.monitor import StepMonitor
from ..replay.session import Session
from ..report import Event, OperationCulprit, SampleAttribution, loss_only
from ..runs.batches import MICRO_BATCHES, data_leaves, leaves, micro_batches, per_sample
from ..words import count, sample_positions

PROBES = 8  # single samples tried, at most, before a larger batch is called batch-wide
ALONE_UP_TO = 32  # a batch of up to this many samples has every sample judged alone (the module's docstring): a pass
# per sample, and one more; the cost grows with the batch, so above it halving's O(k log B) is kept (one bad sample in
# 64: 14 passes by halving, 66 judged alone, 2.9 times as long on tests/scenarios.py's MLP)


def named_whole(step_fn: Any) -> list[str]:
    """The batch leaves the step function names per-batch (``nanforensics_whole``): kept whole whatever their shape."""
    return [str(p) for p in getattr(step_fn, "nanforensics_whole", ())]


def batch_size(batch: Any, whole: Collection[str] = ()) -> int | None:
    """The batch size by the rule of the module's docstring (summed over the micro-batches of a step made of
    several), or None when the rule finds none; ``whole``: paths of leaves named per-batch, never counted."""
    parts = micro_batches(batch)
    if parts is None:
        return _size(batch, whole)
    sizes = [_size(p, whole, _part(j)) for j, p in enumerate(parts)]
    return None if None in sizes else sum(sizes)  # type: ignore[arg-type]


def _part(j: int) -> str:
    return f"batch[{MICRO_BATCHES!r}][{j}]"


def _first_dims(batch: Any, whole: Collection[str] = (), path: str = "batch") -> Counter[int]:
    """How many of the batch's tensors (of one dimension or more, not named ``whole``) have each first dimension: what
    the rows rule decides the batch size from, and what its message explains."""
    return Counter(t.shape[0] for p, t in leaves(batch, path) if isinstance(t, torch.Tensor) and t.ndim >= 1
                   and p not in whole)


def _size(batch: Any, whole: Collection[str] = (), path: str = "batch") -> int | None:
    """The first dimension shared by the most tensors, a tie broken by the per-sample lists' length."""
    counts = _first_dims(batch, whole, path)
    tied = [n for n, c in counts.items() if c == max(counts.values())]
    if len(tied) > 1:
        tied = [n for n in tied if any(per_sample(v, n) for _, v in data_leaves(batch, size=n))]
    return tied[0] if len(tied) == 1 else None


def whole_leaves(batch: Any, size: int, whole: Collection[str] = ()) -> list[str]:
    """The paths of the tensors a split keeps whole: per-batch ones (named ``whole``, or of another first
    dimension than the samples'), 0-dim ones excepted (a temperature, a scale: never a tensor of the data)."""
    parts = micro_batches(batch)
    spans = [(_part(j), p, n) for j, (p, (_, n)) in enumerate(zip(parts, _spans(batch, whole)))] if parts else \
        [("batch", batch, size)]
    return [p for at, part, n in spans for p, t in leaves(part, at)
            if isinstance(t, torch.Tensor) and t.ndim >= 1 and not _split(p, t, n, whole)]


def _split(path: str, t: torch.Tensor, size: int, whole: Collection[str]) -> bool:
    """Whether tensor leaf ``path`` holds the samples' rows: its first dimension is theirs, and it is not named whole."""
    return t.ndim >= 1 and t.shape[0] == size and path not in whole


def _spans(batch: Any, whole: Collection[str] = ()) -> list[tuple[int, int]]:
    """(first position, size) of each micro-batch of a step made of several."""
    out, start = [], 0
    for j, part in enumerate(micro_batches(batch) or []):
        n = _size(part, whole, _part(j)) or 0
        out.append((start, n))
        start += n
    return out


def select(batch: Any, indices: list[int], size: int, whole: Collection[str] = ()) -> Any:
    """The samples at ``indices`` (positions across the micro-batches of a step made of several, whose
    micro-batches left without a sample are dropped); ``whole``: paths of leaves kept whole whatever their shape."""
    parts = micro_batches(batch)
    if parts is None:
        return _select(batch, indices, size, whole, "batch")
    kept = []
    for j, (part, (start, n)) in enumerate(zip(parts, _spans(batch, whole))):
        mine = [i - start for i in indices if start <= i < start + n]
        if mine:
            kept.append(_select(part, mine, n, whole, _part(j)))
    return {**batch, MICRO_BATCHES: kept}


def _select(batch: Any, indices: list[int], size: int, whole: Collection[str], path: str) -> Any:
    """Tensors that hold the samples' rows (``_split``), and tensor-free lists of ``size`` items at any depth, are
    indexed; the rest is kept. ``path`` as ``leaves`` writes it."""
    if isinstance(batch, torch.Tensor):
        return batch[torch.tensor(indices, device=batch.device)] if _split(path, batch, size, whole) else batch
    if per_sample(batch, size):
        return type(batch)(batch[i] for i in indices)
    if isinstance(batch, (list, tuple)):
        return type(batch)(_select(v, indices, size, whole, f"{path}[{i}]") for i, v in enumerate(batch))
    if isinstance(batch, dict):
        return {k: _select(v, indices, size, whole, f"{path}[{k!r}]") for k, v in batch.items()}
    return batch


def swapped(batch: Any, donor: Any, path: str, at: str = "batch") -> Any:
    """``batch`` with its leaf at ``path`` taken from ``donor`` (another step's batch, the same leaf there)."""
    if at == path:
        return dict(leaves(donor)).get(path, batch)
    if isinstance(batch, (list, tuple)):
        return type(batch)(swapped(v, donor, path, f"{at}[{i}]") for i, v in enumerate(batch))
    if isinstance(batch, dict):
        return {k: swapped(v, donor, path, f"{at}[{k!r}]") for k, v in batch.items()}
    return batch


class _Tester:
    """Runs the whole step on subsets of the batch from the step's state, ``optimizer.step()`` and the code after it
    included, restored after each pass. ``whole``: the leaves kept whole in every subset (per-batch tensors)."""

    def __init__(self, session: Session, batch: Any, size: int, whole: Collection[str] = (), progress: Progress = SILENT,
                 loss_only: bool = False) -> None:
        self.session, self.batch, self.size, self.whole = session, batch, size, whole
        self.progress = progress
        self.loss_only = loss_only  # the step explained is loss-only: a subset fails as it did, by its loss alone
        self.snapshot = session.snapshot()
        self.passes = 0
        self.errors: list[str] = []
        self.batch_statistics = False  # the first pass (the whole batch) normalised over it: samples not independent

    def fails(self, indices: list[int]) -> bool | None:
        """One pass on the subset; True when it fails as the step did. None when a GradScaler caught the subset's
        overflow and skipped the update: that says nothing of its samples, each of which may fail alone where together
        they overflow (group testing is then not monotone); a single sample caught passes, as a step caught does."""
        verdict = self._judge(select(self.batch, indices, self.size, self.whole))
        return False if verdict is None and len(indices) == 1 else verdict

    def fails_on(self, subset: Any) -> bool:
        """One pass on ``subset`` (any batch) from the step's state: whether it fails as the step did."""
        return self._judge(subset) is True

    def _judge(self, subset: Any) -> bool | None:
        self.passes += 1
        self.progress.update(self.passes)
        s = self.session
        s.restore(self.snapshot)
        stepped: list[torch.optim.Optimizer] = []  # the optimizers whose step() was called (a GradScaler skips one
        # whose own gradients overflowed)
        first = _BatchStatistics() if self.passes == 1 else nullcontext()  # read once: the others pay nothing
        with StepMonitor(s.model, s.optimizer, prove=False) as monitor, first as statistics:
            handle = s.optimizer.register_step_post_hook(lambda o, *_: stepped.append(o))
            monitor.begin(s.step, subset, locate=False)
            try:
                loss = s.call_step(subset)
            except BadInput as e:  # e.g. BatchNorm refuses a single sample: this subset cannot be judged
                self.errors.append(e.problem)
                return False
            finally:
                handle.remove()
            events = monitor.end(loss)
        if statistics is not None:
            self.batch_statistics = statistics.read
        if scaler_caught(s.scaler, s.optimizer, stepped, events):
            return None  # the scaler caught this subset's overflow: benign, as the replay judges a step
        # it fails as the step did: loss-only as a loss-only step, else with an origin (a subset whose only fault is a
        # loss over no target is not the origin's failure)
        stages = {e.stage for e in events}
        return loss_only(stages) if self.loss_only else bool(stages) and not loss_only(stages)


class _BatchStatistics(TorchFunctionMode):
    """Whether the step normalised over the batch: ``batch_norm`` with ``training`` set (BatchNorm in training, or
    without running statistics), which reads every sample's values into every other's."""

    read = False

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func in (F.batch_norm, torch.batch_norm):  # training is the sixth argument of both
            self.read = self.read or bool(args[5] if len(args) > 5 else kwargs.get("training", False))
        return func(*args, **kwargs)


def group_test(group: list[int], fails: Callable[[list[int]], bool | None],
               verdict: bool | None = True) -> tuple[list[int], list[list[int]]]:
    """Adaptive halving over ``group``, a set of the batch's samples whose own verdict is ``verdict`` (the whole batch:
    known to fail): (failing samples, coupled groups). A half whose verdict is None (inconclusive, see
    ``_Tester.fails``) is halved as a failing one is, and is never coupled."""
    bad: list[int] = []
    coupled: list[list[int]] = []
    pending: list[tuple[list[int], bool | None]] = [(group, verdict)] if verdict is not False else []
    while pending:
        group, verdict = pending.pop(0)
        if len(group) == 1:
            bad.append(group[0])  # a single sample's verdict is never None
            continue
        halves = [(h, v) for h in split_in_two(group) if (v := fails(h)) is not False]
        if halves:
            pending += halves
        elif verdict:
            coupled.append(group)
    return sorted(bad), coupled


def split_in_two(group: list[int]) -> tuple[list[int], list[int]]:
    """The two halves halving tries of ``group``: what a coupled group's message names as tried."""
    half = len(group) // 2
    return group[:half], group[half:]


def coupled_text(group: list[int], alone_ran: bool) -> str:
    """What a coupled group's evidence shows, and no more: the group fails, each of the two halves halving tried passes
    (``split_in_two``), and, where every sample was run alone (``alone_ran``; a pair's halves are its samples), none
    of its samples fails alone. Other subsets were not tried."""
    first, second = split_in_two(group)
    alone = " nor any of them alone" if alone_ran and len(group) > 2 else ""
    return (f"samples {group} fail together, and neither half of them ({first}, {second}){alone} reproduces the failure: "
            "a failure that needs samples together (batch-coupled operations such as BatchNorm, or a loss normalised "
            "over the batch)")


def probe_order(size: int, probes: int = PROBES) -> list[int]:
    """The single samples tried first: one more than half the batch, at most ``probes``, drawn at random with
    a seed of the batch size (the same batch is always probed the same way)."""
    return random.Random(size).sample(range(size), min(size // 2 + 1, probes))


@dataclass
class Split:
    """What splitting a failing batch found."""

    status: str                # "attributed", "coupled" or "batch_wide"
    samples: list[int]         # failing alone: every one (attributed, coupled), or those found (batch_wide)
    coupled: list[list[int]]
    tried: list[int]           # the single samples tried before halving (every one, judged each alone)
    named: bool                # every failing sample was named (not only those tried until the batch was batch-wide)
    judged: str                # how: "each_alone", "group_testing" or "probes" (the module's docstring)


def split_batch(size: int, fails: Callable[[list[int]], bool | None], probes: int = PROBES,
                hint: int | None = None, batch_statistics: bool = False, alone_up_to: int = ALONE_UP_TO) -> Split:
    """Judge each sample alone (a batch of up to ``alone_up_to`` samples), else probe single samples, then halve: see
    the module's docstring. ``fails`` is asked each subset once.

    ``hint``: the sample the failure's own coordinates point at. Above ``alone_up_to``, when it fails alone and the
    rest of the batch does not fail, it is taken as the only sample that fails alone (a set holding one that does
    fails too, as halving trusts): two passes, not probing and halving; otherwise those go on as without it.

    ``batch_statistics``: the step normalised over the batch, so a sample can fail alone and pass among others (a
    set that passes says nothing of its samples): every sample is judged alone, the hint's shortcut not taken."""
    known: dict[tuple[int, ...], bool | None] = {}

    def once(indices: list[int]) -> bool | None:
        key = tuple(indices)
        if key not in known:
            known[key] = fails(indices)
        return known[key]

    if size <= alone_up_to:
        return _each_alone(size, once, probes)
    rest = [i for i in range(size) if i != hint]
    if hint is not None and not batch_statistics and 0 <= hint < size and once([hint]) and once(rest) is False:
        return Split("attributed", [hint], [], [hint], named=True, judged="group_testing")
    tried = probe_order(size, probes)
    failing: list[int] = []
    for i in tried:
        if not once([i]):
            break
        failing.append(i)
    else:
        return Split("batch_wide", sorted(failing), [], tried, named=False, judged="probes")
    bad, coupled = group_test(list(range(size)), once)
    judged = "group_testing"
    hidden = {k[0] for k, v in known.items() if len(k) == 1 and v} - set(bad)  # failed alone (a probe, the hint),
    # yet halving never named it: a set that passed held it
    if coupled or batch_statistics or hidden:  # a failing set whose halves pass proves the step couples its samples
        # too, as a sample that fails alone in a set that passes does: a set that passes can hold a sample that fails
        # alone, normalised among the others; halving proves nothing then, and every sample is judged alone. A group
        # holding one that fails alone is not coupled: that sample reproduces it
        bad = [i for i in range(size) if once([i])]
        coupled = [g for g in coupled if not set(g) & set(bad)]
        judged = "each_alone"
    if 2 * len(bad) > size:
        return Split("batch_wide", bad, [], tried, named=True, judged=judged)
    return Split("coupled" if coupled else "attributed", bad, coupled, tried, named=True, judged=judged)


def _each_alone(size: int, once: Callable[[list[int]], bool | None], probes: int) -> Split:
    """Every sample run alone, the probes first, until more than half fail (batch-wide, exactly); then, where some
    fail alone, the batch without them, halved where it still fails: a failure that needs samples together."""
    first = probe_order(size, probes)
    order = first + [i for i in range(size) if i not in first]
    failing: list[int] = []
    for n, i in enumerate(order, 1):
        if once([i]):
            failing.append(i)
            if 2 * len(failing) > size:
                return Split("batch_wide", sorted(failing), [], order[:n], named=False, judged="each_alone")
    rest = [i for i in range(size) if i not in failing]
    _, coupled = group_test(rest, once, once(rest) if failing else True)
    return Split("coupled" if coupled else "attributed", sorted(failing), coupled, order, named=True,
                 judged="each_alone")


def sample_hint(batch: Any, origin: Event, culprit: OperationCulprit | None) -> int | None:
    """The batch position the failure's coordinates point at: the first coordinate of the origin when it is a batch
    tensor or an activation, else of the culprit operation's non-finite output in the forward or backward pass, when
    it is below the batch size. A guess that the first dimension is the batch's: ``split_batch`` confirms it. None
    for a step of several micro-batches, whose positions the coordinate does not say."""
    size = batch_size(batch)
    if size is None or micro_batches(batch) is not None:
        return None
    if origin.stage in ("batch", "forward") and origin.index:
        index = origin.index
    elif culprit is not None and culprit.site.phase in ("forward", "backward") and culprit.output_index:
        index = culprit.output_index
    else:
        return None
    return index[0] if index[0] < size else None


def _listed(samples: list[int]) -> str:
    return ", ".join(map(str, samples))


def batch_wide_message(split: Split, size: int) -> str:
    """Why the batch, not a sample, is what fails: the counts behind the decision."""
    listed = _listed(split.samples)
    if split.named:
        found = f"{len(split.samples)} of the {size} samples, more than half, fail alone ({listed})"
    elif 2 * len(split.samples) > size:
        found = f"{len(split.samples)} of the {size} samples, more than half, were tried alone and each fails ({listed})"
    else:
        found = f"each of {len(split.samples)} samples drawn at random from the {size} fails alone ({listed})"
    return f"{found}: the failure is not in particular samples"


def max_passes(size: int, kept: int = 0) -> int:
    """The most passes attribution can take: the whole batch; every sample alone; the sets of two or more that halving
    runs (at most ``size - 2``, a halving tree's inner nodes but its root); one more set (the batch without the hinted
    sample, or without the samples that fail alone); for a batch-wide failure, the step before's batch and the batch
    with each of its ``kept`` per-batch tensors swapped."""
    return 1 + size + (size - 2) + 1 + 1 + kept


def attribute_samples(session: Session, hint: int | None = None, progress: Progress = SILENT,
                      loss_only: bool = False) -> SampleAttribution:
    """Group-test the batch of ``session.step`` (``hint``: see ``split_batch``; ``loss_only``: the step is loss-only,
    its samples are those whose loss alone is non-finite); the session's state is restored afterwards."""
    step_fn = session.code.step_fn
    batch = session.batch(session.step)
    logged = session.logged_batch(session.step)
    if getattr(step_fn, "nanforensics_splittable", True) is False:
        return SampleAttribution("opted_out", None, [], {}, 0, [],
                                 "the step function opted out of batch splitting (nanforensics_splittable = False)")
    named = named_whole(step_fn)
    size = batch_size(batch, named)
    if size is None or size < 2:
        return SampleAttribution("unsplittable", size, [], {}, 0, [], _unsplittable(batch, named))
    kept = whole_leaves(batch, size, named)
    progress.phase(f"attributing samples of step {session.step}: passes of the whole step", max_passes(size, len(kept)),
                   unit="pass", at_most=True)
    tester = _Tester(session, batch, size, named, progress, loss_only=loss_only)
    try:
        if not tester.fails(list(range(size))):
            return SampleAttribution("not_reproduced", size, [], {}, tester.passes, [],
                                     "the whole step on the whole batch, run again, stays finite", whole_leaves=kept)
        found = split_batch(size, tester.fails, hint=hint, batch_statistics=tester.batch_statistics)
        # "the step, not its data": tested, with the step before's batch run from this step's state; and each
        # per-batch tensor, with the step before's in its place
        before = session.step - 1
        compared = before if found.status == "batch_wide" and session.run.batch_origin(before) is not None else None
        donor = session.batch(before) if compared is not None else None
        compared_fails = tester.fails_on(donor) if compared is not None else None
        causes = [p for p in kept if donor is not None and _differs(batch, donor, p)
                  and not tester.fails_on(swapped(batch, donor, p))]
    finally:
        session.restore(tester.snapshot)
    passes = f"{count(tester.passes, 'pass', 'passes')} of the whole step, each through optimizer.step()"
    if found.status == "batch_wide":
        follows = (f"; it follows the batch's per-batch {'tensors' if len(causes) > 1 else 'tensor'} "
                   f"{', '.join(causes)}: with step {before}'s in {'their' if len(causes) > 1 else 'its'} place the "
                   "batch's step stays finite") if causes else ""
        return SampleAttribution("batch_wide", size, [], {}, tester.passes, [],
                                 f"{batch_wide_message(found, size)}{follows} ({passes})", compared_step=compared,
                                 compared_fails=compared_fails, whole_leaves=kept, cause_leaves=causes,
                                 judged=found.judged)
    samples = found.samples
    per_sample_leaves, located = _per_sample(logged, samples, size, named)
    alone = (f"{'samples' if len(samples) > 1 else 'sample'} {sample_positions(samples, located)} of {size} "
             f"{'produce' if len(samples) > 1 else 'produces'} the non-finite value alone")
    if found.coupled:
        why = (f" (single samples could not be run: {tester.errors[0]}; a per-batch tensor whose length equals the "
               "batch size is split with the samples unless train_step.nanforensics_whole names it)"
               if tester.errors else "")
        # a coupled group holds no sample that fails alone, judged each alone (split_batch), unless single samples
        # could not be run
        ran = found.judged == "each_alone" and not tester.errors
        message = (coupled_text(found.coupled[0], ran) + why
                   + (f"; {alone}" if samples else ""))  # last, beside the ids the finding appends
        return SampleAttribution("coupled", size, samples, per_sample_leaves, tester.passes, found.coupled, message,
                                 located, whole_leaves=kept, judged=found.judged)
    return SampleAttribution("attributed", size, samples, per_sample_leaves, tester.passes, [],
                             f"{alone} ({judged_text(found, size, passes)})", located, whole_leaves=kept,
                             judged=found.judged)


def judged_text(split: Split, size: int, passes: str) -> str:
    """How the samples named were found, and so how far the claim goes (``passes``: what it cost): every sample run
    alone names exactly those that fail alone; group testing names only such samples, and may miss one that a set
    which passed held."""
    if split.judged == "each_alone":
        return f"each of the {size} samples run alone: {passes}"
    return (f"found by group testing: {passes}; a sample that fails alone but passes among others, as a loss averaged "
            f"over the batch allows, may go unnamed: only a batch of up to {ALONE_UP_TO} samples has each sample run "
            "alone")


def _unsplittable(batch: Any, whole: Collection[str]) -> str:
    """Why the rule finds no batch size: no tensor to split, or first dimensions tied."""
    sizes = _first_dims(batch, whole)
    if not sizes:
        return "the batch holds no tensor of one dimension or more to split along"
    tied = ", ".join(f"{n} ({count(c, 'tensor')})" for n, c in sorted(sizes.items()))
    return (f"no first dimension is held by more of the batch's tensors than another ({tied}) and no per-sample list "
            "(ids) is as long as one of them: name the per-batch tensors in train_step.nanforensics_whole")


def _differs(batch: Any, donor: Any, path: str) -> bool:
    """``donor`` holds a tensor at ``path`` that can stand in for ``batch``'s there: the same shape and dtype, other
    values (an equal one would test nothing)."""
    mine, theirs = dict(leaves(batch)).get(path), dict(leaves(donor)).get(path)
    return (isinstance(mine, torch.Tensor) and isinstance(theirs, torch.Tensor) and mine.shape == theirs.shape
            and mine.dtype == theirs.dtype and not torch.equal(mine, theirs))


def _per_sample(logged: Any, samples: list[int], size: int,
                whole: Collection[str]) -> tuple[dict[str, list[Any]], list[list[int]]]:
    """The logged non-tensor leaves (ids) of ``samples``, by path; and in a step of several micro-batches,
    [micro-batch, position in it] of each sample."""
    spans = _spans(logged, whole)
    if not spans:
        return {k: [v[i] for i in samples] for k, v in data_leaves(logged, size=size) if per_sample(v, size)}, []
    located = [[j, i - start] for i in samples for j, (start, n) in enumerate(spans) if start <= i < start + n]
    leaves_of: dict[str, list[Any]] = {}
    for j, i in located:
        n = spans[j][1]
        for k, v in data_leaves(micro_batches(logged)[j], f"batch[{MICRO_BATCHES!r}][{j}]", size=n):  # type: ignore[index]
            if per_sample(v, n):
                leaves_of.setdefault(k, []).append(v[i])
    return leaves_of, located
