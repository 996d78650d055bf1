"""Plain-language findings drawn from a replay report's facts: what happened and what would have helped."""

from __future__ import annotations

import math
from dataclasses import replace

from ..finite import value_name
from ..replay.reproduction import LOSS_ULPS, STATE_RTOL
from ..replay.spread import from_replay
from ..report import CheckpointComparison, CheckpointLoad, Event, OperationCulprit, OpSite, Precursor, ReplayReport
from ..runs.compiled import EAGER_KERNELS
from ..runs.cpu import describe as describe_cpu
from ..words import count, numbered, span


def describe(e: Event) -> str:
    """``grad fc2.weight[3, 7] = inf`` (``exp_avg_sq of ...`` for optimizer state; ``... (optimizer discriminator)``
    in a run of several optimizers; ``... on rank 1`` for a value of one rank of a distributed run)."""
    where = f"[{', '.join(map(str, e.index))}]" if e.index else ""
    subject = f"{e.state_key} of {e.tensor}" if e.state_key else e.tensor
    value = f" = {e.value}" if e.value else ""
    head = e.stage if subject == e.stage else f"{e.stage} {subject}"
    on = f" on rank {e.rank}" if e.rank is not None else ""
    of = f" (optimizer {e.optimizer})" if e.optimizer is not None else ""
    return f"{head}{where}{value}{of}{on}"


def describe_site(op: OpSite) -> str:
    where = f" in module `{op.module}`" if op.module else " outside any module"
    return f"{op.op}{where}" + (f" ({op.source})" if op.source else "")


_NONFINITE = ("nan", "inf", "-inf")


def _ranges(ranges: list[list[str]]) -> str:
    return ", ".join(f"[{lo}, {hi}]" for lo, hi in ranges)


def _inputs(site: OpSite) -> str:
    """``finite inputs [..]`` or ``inputs holding -inf ([..])``: read off the input ranges, never assumed."""
    if not site.input_ranges:
        return "no floating-point inputs"
    held = [v for v in _NONFINITE if any(v in r for r in site.input_ranges)]
    if not held:
        return f"finite inputs {_ranges(site.input_ranges)}"
    return f"inputs holding {' and '.join(held)} ({_ranges(site.input_ranges)})"


# The step function's own code, outside forward, backward and the optimizer, in words (OpSite.phase)
_STEP_CODE = {"before_update": "the step function's own code before optimizer.step(),",
              "after_update": "the step function's own code after optimizer.step(),"}


def phase_site(site: OpSite) -> str:
    """``forward aten::log in module `f` (...)``, or the step function's own code around the update, said so."""
    return f"{_STEP_CODE.get(site.phase, site.phase)} {describe_site(site)}"


def operation_sentence(op: OperationCulprit) -> str:
    """Where the origin's value was made, each clause read off the culprit's facts."""
    if op.site.phase == "backward" and op.forward is not None:
        subject = f"{op.site.op} in the backward of {describe_site(op.forward)}, autograd node {op.autograd_node},"
    else:
        subject = phase_site(op.site)
    text = (f"Operation: {subject} produced {op.output_value} at [{', '.join(map(str, op.output_index))}] "
            f"from {_inputs(op.site)}")
    if any(r is not None for r in op.inputs_at_index):
        at = ", ".join("(not shown)" if r is None else f"[{r[0]}, {r[1]}]" + (
            f" (all {r[0]})" if r[0] == r[1] and r[0] in _NONFINITE else "") for r in op.inputs_at_index)
        text += f"; the input elements that coordinate was computed from ranged over {at}"
    if len(op.site.output_ranges) > 1:  # a loss and its total weight, values and indices: the others tell why
        text += f"; its outputs ranged over {_ranges(op.site.output_ranges)}"
    if op.site.phase == "backward" and op.forward is not None:
        text += f"; the forward op's inputs ranged over {_ranges(op.forward.input_ranges)}"
    text += "."
    src = op.inf_source
    if src is not None:
        infs = " and ".join(v for v in ("-inf", "inf") if any(v in r for r in op.site.input_ranges)) or "±inf"
        if src.site is not None:
            held = f", and {src.tensor} held it before the step" if src.tensor else ""
            text += (f" The {infs} in its inputs was not computed: {phase_site(src.site)} wrote "
                     f"it as a constant (a mask){held}, so this operation, where it became NaN, is the cause.")
        else:
            text += (f" The {infs} in its inputs was not computed in this step: "
                     f"{src.tensor or 'a tensor from before the step'} already held it, so this operation, where it "
                     "became NaN, is the cause.")
    if op.nan_site is not None:
        where = "in the backward pass" if op.nan_site.phase == "backward" and op.site.phase != "backward" \
            else "downstream of it"
        node = f", autograd node {op.nan_node}," if op.nan_node else ""
        text += (f" NaN arose {where}, at {phase_site(op.nan_site)}{node} from "
                 f"{_inputs(op.nan_site)}.")
    if op.traced_from and op.path:
        text += f" Traced back from {op.traced_from}: {' <- '.join(reversed(op.path))}."
    return text


def _root_cause(r: ReplayReport) -> list[str]:
    out = []
    for d in r.data_defects:
        if r.responsible_step is None or d.step == r.responsible_step:
            kind = {"nonfinite": "a non-finite", "extreme": "an extreme", "subnormal": "a subnormal"}[d.kind]
            out.append(f"Data: the batch of step {d.step} holds {kind} value, {d.tensor}"
                       f"[{', '.join(map(str, d.index))}] = {d.value} ({count(d.count, 'such value')} in {d.file}).")
    if r.operation is not None:
        out.append(operation_sentence(r.operation))
    if r.samples is not None:
        ids = "; ".join(f"{k} = {v}" for k, v in r.samples.sample_leaves.items())
        out.append(f"Samples: {r.samples.message}" + (f" ({ids})" if ids else "") + ".")
    return out


_CAUSE = {
    "batch": "the batch itself holds a non-finite value: a data defect, before any computation",
    "forward": "in the forward pass, module {t}'s output is the first module output to hold it",
    "loss": "every module output was finite but the loss computation produced it",
    "grad": "the forward pass and the loss were finite; the backward pass made it",
    "optimizer_grad": "the gradients were finite after backward; the step function made them non-finite before "
                      "optimizer.step()",
    "optimizer_state": "the gradients were finite, but the optimizer state overflowed (a squared gradient past the "
                       "dtype's largest value, for instance)",
    "param": "gradients and optimizer state were finite; the parameter was non-finite once the step returned: "
             "optimizer.step() or the step function's own code after it produced it",
    "buffer": "gradients, optimizer state and parameters were finite, but a registered buffer was not: buffers are "
              "updated outside the optimizer{how}",
}
_RUNNING_STATS = ("running_mean", "running_var")  # BatchNorm's (and InstanceNorm's) running averages


def _is_running_stat(name: str) -> bool:
    return name.rpartition(".")[2] in _RUNNING_STATS


def _cause(o: Event, op: OperationCulprit | None) -> str:
    """Why the origin's stage is where it is; for a parameter, which code wrote it, where the operation trace says."""
    if o.stage == "param" and op is not None and op.site.phase == "optimizer":
        return "gradients and optimizer state were finite; the parameter update itself (optimizer.step()) produced it"
    if o.stage == "param" and op is not None and op.site.phase == "after_update":
        line = f" at {op.site.source}" if op.site.source else ""
        return (f"gradients and optimizer state were finite; the step function's own code produced it after the "
                f"update: {op.site.op}{line}, which ran after optimizer.step() returned")
    how = (" (BatchNorm updates its running statistics in the training forward, from each batch's own statistics)"
           if _is_running_stat(o.tensor) else "")
    return _CAUSE[o.stage].format(t=o.tensor, how=how)


def findings(r: ReplayReport) -> list[str]:
    out: list[str] = []
    o = r.origin
    if o is None:
        if r.verdict == "not_reproduced":
            out.append(f"The logged loss was non-finite at step {r.logged_first_nonfinite_loss_step}, but the replay "
                       "found no non-finite value: the failure did not reproduce here.")
        elif not r.loss_only_steps:  # those have their own sentence
            out.append(_nothing_reached(r))
    else:
        out.append(f"Origin: step {o.step}, {describe(o)} ({o.dtype}): {_cause(o, r.operation)}.")
        shown = first_shown(r)
        if shown is not None and shown < o.step:
            caught = r.amp is not None and any(c.step == shown for c in r.amp.caught)
            out.append(f"The logged loss was already non-finite at step {shown}, before the origin: "
                       + ("an overflow the scaler caught, skipping that step with the state intact."
                          if caught else "it reached neither the parameters nor the optimizer state."))
        elif shown is not None and shown != o.step:
            logged = next((s.logged_loss for s in r.spread if s.step == o.step), None)
            loss_text = f" ({logged:.6g})" if logged is not None and math.isfinite(logged) else ""
            inspect = (f"the step to inspect is step {o.step}, not step {shown}" if step_not_data(r) else
                       f"the batch to inspect is step {o.step}'s, not step {shown}'s")
            out.append(f"The loss logged at step {o.step} was finite{loss_text}: it is computed before the update. "
                       f"The logged loss first shows NaN at step {shown}, {count(shown - o.step, 'step')} later; "
                       f"{inspect}.")
        elif r.reproduced is None and (shown := _replayed_shown(r, o)) is not None:
            replayed = next((s.replayed_loss for s in r.spread if s.step == o.step), None)
            loss_text = f" ({replayed:.6g})" if replayed is not None and math.isfinite(replayed) else ""
            inspect = (f"the step to inspect is step {o.step}, not step {shown}" if step_not_data(r) else
                       f"the batch to inspect is step {o.step}'s, not step {shown}'s")
            out.append(f"The loss at step {o.step} was finite in the replay{loss_text}: it is computed before the "
                       f"update. It first shows NaN at step {shown}, {count(shown - o.step, 'step')} later, where a "
                       f"training log shows it too; {inspect}.")
        out += _unread(r) + _window(r)
        out += _root_cause(r)
        out += _batch_wide(r) + _coupled_drift(r) + _spikes(r)
        out += _clipping(r)
    out += _state(r)
    out += _buffers(r) + _loss_only(r)
    if o is None and r.loss_only_steps:  # the first loss-only step, explained: its op and its samples
        out += _root_cause(r)
    if r.fully_nonfinite_step is not None:
        out.append(f"Every parameter is non-finite by step {r.fully_nonfinite_step}.")
    out += _reproduction(r)
    return out + (_loaded(r.loaded) if r.loaded is not None else [])


def _replayed_shown(r: ReplayReport, o: Event) -> int | None:
    """With no loss logged, the first replayed non-finite loss after the origin's step, where none is at it: where
    the replay shows the failure. A loss-only step's NaN before the origin is not it (its own sentence says so)."""
    first = next((s.step for s in r.spread if s.step >= o.step and not math.isfinite(s.replayed_loss)), None)
    return first if first != o.step else None


def _loaded(c: CheckpointLoad) -> list[str]:
    """How a checkpoint the recorder did not write was read: each choice that shapes what the replay means."""
    basis = {"metadata": "its metadata", "trainer_state.json": "the steps trainer_state.json counts",
             "name": "its name"}.get(c.step_from, c.step_from)  # "--from-step" says itself
    advice = "" if c.step_from == "trainer_state.json" else \
        f"; a loop that saved it after running step {c.step} needs --from-step {c.step + 1}"
    out = [f"The checkpoint is taken as the state before step {c.step} (from {basis}): {c.batches}({c.step}) is the "
           f"first batch replayed{advice}."]
    if c.model_prefix_stripped:
        out.append(f"Model keys were saved with the prefix {c.model_prefix_stripped!r} (a wrapper), removed to "
                   "match the model by name.")
    if c.optimizer_matched == "order":
        shared = (f"{c.same_shape_params} of {c.optimizer_params} parameters share their shape with another of their "
                  "group, so the optimizer must list those in the order training did: a different order among them "
                  "goes unnoticed") if c.same_shape_params else \
            "no two parameters of a group share a shape"
        out.append(f"Optimizer state was matched to the parameters by order, as torch's load_state_dict does: the "
                   f"checkpoint records no parameter names. Every group's size and every state tensor's shape agree; "
                   f"{shared}.")
    if c.scheduler == "unused":
        out.append("The checkpoint holds an LR scheduler's state, but no scheduler factory was named (--scheduler): "
                   "the learning rate stays at the checkpoint's value, where training followed its schedule.")
    if "torch" not in c.rng_restored:
        why = f" ({c.rng_missing})" if c.rng_missing else ""
        effect = (f" The model's dropout ({', '.join(c.random_modules)}) draws its masks from it, so they differ from "
                  "training's: the replayed steps are not the run's, and a failure that needs particular masks may "
                  "not reproduce.") if c.random_modules else \
            " The model has no dropout module, so this matters only where the step function draws random numbers."
        out.append(f"The torch RNG state was not restored{why}: every pass of the replay starts from seed 0."
                   + effect)
    return out


def _unread(r: ReplayReport) -> list[str]:
    """An origin the forward did not carry at once (a NaN row of an embedding that no batch looks up for a while):
    from when the non-finite values sat in the model unread by any module output or loss, to the step whose
    forward first carries them."""
    o = r.origin
    assert o is not None
    carried = next((e for e in r.events if e.step > o.step and e.stage in ("forward", "loss")), None)
    if o.stage not in ("param", "optimizer_state", "buffer") or carried is None or carried.step <= o.step + 1:
        return []
    shown = first_shown(r)
    loss = ("; the logged loss first shows NaN there too" if shown == carried.step else
            f"; the logged loss first shows NaN at step {shown}" if shown is not None else "")
    what = describe(replace(o, value=""))
    went = "NaN" if o.value == "nan" else o.value
    return [f"{what[0].upper()}{what[1:]} went {went} at step {o.step}, but no module output and no loss held a non-finite value "
            f"at {span(o.step + 1, carried.step - 1)}: the forward first carries it at step {carried.step}, the first "
            f"step whose forward reads a non-finite value ({describe(carried)}){loss}."]


def _window(r: ReplayReport) -> list[str]:
    """A replay that ended (at --max-steps) before the run's own NaN loss judges every field over a shorter window."""
    shown = first_shown(r)
    if shown is None or shown <= r.setup.last_step:
        return []
    return [f"The replay ended at step {r.setup.last_step}, before the logged loss first shows NaN (step {shown}): "
            f"the replayed loss, the optimizer state and the reproduction are judged over "
            f"{span(r.setup.first_step, r.setup.last_step)} only."]


def first_shown(r: ReplayReport) -> int | None:
    """The first logged non-finite loss that is not a loss-only step: where the failure shows."""
    first = r.logged_first_nonfinite_loss_step
    if first not in r.loss_only_steps:
        return first
    return next((s.step for s in r.spread if s.logged_loss is not None and not math.isfinite(s.logged_loss)
                 and s.step not in r.loss_only_steps), None)


def _buffers(r: ReplayReport) -> list[str]:
    """Non-finite buffers: which, from when, what the parameters and losses did, and what reads the buffers."""
    e = next((e for e in r.events if e.stage == "buffer"), None)
    if e is None:
        return []
    others = e.tensors_nonfinite - 1
    what = f"Buffer {e.tensor}" + (f" and {count(others, 'other buffer')}" if others > 0 else "")
    param = next((p.step for p in r.events if p.stage == "param"), None)
    if param is not None and param < e.step:
        return [f"{what} went non-finite at step {e.step}, after the parameters (step {param}): a consequence, not "
                "the origin."]
    follows = (f"the parameters turned non-finite at step {param}" if param is not None else
               f"the parameters stayed finite through step {r.setup.last_step}")
    out = [f"{what} {'hold' if others else 'holds'} non-finite values from step {e.step}; {follows}. A buffer "
           "persists from step to step like optimizer state, so the run carries it on."]
    if _is_running_stat(e.tensor):
        later = [s for s in r.spread if s.step >= e.step]
        losses = ("the replayed losses stayed finite through step "
                  f"{later[-1].step}, since " if later and all(math.isfinite(s.replayed_loss) for s in later) else "")
        out.append(f"These are BatchNorm running statistics: {losses}in training mode BatchNorm normalises with each "
                   "batch's own statistics; in eval mode (evaluation, inference) it normalises with the running ones, "
                   "which keep a non-finite value ((1-momentum)*inf = inf). Reset them (reset_running_stats()) or "
                   "re-estimate them on clean batches.")
    return out


def _loss_only(r: ReplayReport) -> list[str]:
    """Steps whose loss was non-finite while nothing the model keeps was: harmless only where the replayed steps after
    them are healthy; the first sign of the failure where the origin follows with no healthy step between."""
    steps = r.loss_only_steps
    if not steps:
        return []
    o = r.origin
    by_step = {s.step: s for s in r.spread}
    healthy = {s.step for s in r.spread if math.isfinite(s.replayed_loss) and s.step not in steps
               and not any(e.step == s.step for e in r.events)}
    signs = [s for s in steps if o is not None and s < o.step and not any(s < h < o.step for h in healthy)]
    last = r.setup.last_step
    unseen = [s for s in steps if s not in signs and not any(h > s for h in healthy)]
    harmless = [s for s in steps if s not in signs and s not in unseen]
    out = []
    for group, verdict in ((harmless, "continue"), (unseen, "unseen"), (signs, "sign")):
        if not group:
            continue
        values = sorted({_loss(by_step[s].replayed_loss) for s in group if s in by_step
                         and not math.isfinite(by_step[s].replayed_loss)})
        value = " or ".join(values) or "non-finite"
        before = " before the origin" if o is not None and group[0] < o.step else ""
        head = (f"The loss was {value} at {numbered('step', group)}{before}, but no gradient, parameter, "
                "optimizer-state or buffer value was")
        if verdict == "continue":
            upto = group[-1]
            for step in sorted(x for x in by_step if x > group[-1]):
                if step not in healthy and step not in steps:
                    break
                upto = step
            # the steps right after it kept the model finite; or, where the next one did not (a caught overflow),
            # the healthy step that makes it harmless
            tail = (f"the replayed steps after it stayed finite through step {upto}" if upto > group[-1] else
                    f"the replay was healthy again at step {min(h for h in healthy if h > group[-1])}")
            text = f"{head}: the non-finite loss never reached the model, so training could continue ({tail})."
        elif verdict == "unseen":
            text = (f"{head}; the replay holds no healthy step after it (it ended at step {last}), so it does not show "
                    "whether training could continue.")
        else:
            text = (f"{head}, yet the replay does not show training continuing: the origin follows at step {o.step} "
                    f"with no healthy step between, so the non-finite loss was the first sign of that failure.")
        out.append(text + _loss_reason(r, group, values))
    return out


def _loss_reason(r: ReplayReport, steps: list[int], values: list[str]) -> str:
    """Why a loss could be non-finite with every gradient finite, from the value it had."""
    if values and all(v in ("inf", "-inf") for v in values):
        act = [p.activation_max_abs for p in r.precursors if p.step in steps and p.activation_max_abs is not None]
        largest = (f" (the largest activation at {numbered('step', steps)} was {max(act):.3g})" if act and
                   all(math.isfinite(a) for a in act) else "")
        return (f" An infinite loss with finite gradients is an overflow of large finite values{largest}: the loss "
                "reduced them past its dtype's largest value, while each gradient, its share of the reduction, stayed "
                "finite.")
    return (" Such a loss typically comes from a batch with no valid target: a mean over zero elements is 0/0 = NaN "
            "while its gradient is zero (cross_entropy when every label is ignore_index, -100).")


def _mismatch_text(c: CheckpointComparison) -> str:
    m = c.first_mismatch
    assert m is not None
    where = f"[{', '.join(map(str, m.index))}]" if m.index else ""
    apart = f", {m.ulps} ulp apart" if m.ulps is not None else ""
    return (f"{m.tensor}{where} is {m.recorded} in the checkpoint of step {c.step}, {m.replayed} in the replay"
            f"{apart} ({count(m.elements, 'value')} differ{'s' * (m.elements == 1)}, in "
            f"{count(c.mismatched_tensors, 'tensor')})")


def reproduction(r: ReplayReport) -> str:
    """Whether the replay reproduced the run, on what evidence: the state at a recorded checkpoint, or losses."""
    if r.reproduced is None:
        return "cannot be judged: there are no logged losses and no recorded checkpoints to compare the replay with"
    exact = [c for c in r.checkpoints_compared if c.matched]
    ulps = ("losses identical" if not r.loss_max_ulps else f"losses within {r.loss_max_ulps} ulp") \
        if r.loss_max_ulps is not None else "no finite loss to compare"
    if r.reproduced and exact:
        c = exact[-1]
        if not c.exact:
            return (f"reproduced within tolerance (parameters, optimizer state and buffers at step {c.step} within "
                    f"rtol {c.tolerance:g}: {c.rounded:,} of its {c.values:,} values differ, by up to "
                    f"{count(c.max_ulps or 0, 'ulp')}, the others bit-exact; {ulps})")
        if not c.nan_matched:
            return f"reproduced (parameters, optimizer state and buffers bit-exact at step {c.step}; {ulps})"
        return (f"reproduced (parameters, optimizer state and buffers equal at step {c.step}: {c.nan_matched:,} of "
                f"its {c.values:,} values NaN in both, the others bit-exact; {ulps})")
    if r.reproduced:
        return f"reproduced as far as losses show ({ulps}; no recorded checkpoint in the replayed window)"
    mismatch = next((c for c in r.checkpoints_compared if c.step == r.diverged_at_step and c.first_mismatch), None)
    if mismatch is not None:
        return f"not reproduced: the state diverged by step {mismatch.step}: {_mismatch_text(mismatch)}"
    s = next(s for s in r.spread if s.step == r.diverged_at_step)
    apart = f", {s.loss_ulps} ulp apart" if s.loss_ulps is not None else ""
    return (f"not reproduced: losses diverge from step {s.step} (logged {_loss(s.logged_loss)}, replayed "
            f"{_loss(s.replayed_loss)}{apart})")


def _loss(x: float | None) -> str:
    if x is None:
        return "-"
    return f"{x:.9g}" if math.isfinite(x) else "NaN" if math.isnan(x) else value_name(x)


def _reproduction(r: ReplayReport) -> list[str]:
    if r.reproduced is None:
        clean = (f"; it stays finite over {span(r.setup.first_step, r.setup.last_step)}, so a failure of the run "
                 "within them is not reproduced from the supplied batches") if r.verdict == "clean" else ""
        return [f"No losses were logged and no recorded checkpoint lies in the replayed window: whether the replay "
                f"reproduces the run cannot be judged{clean}."]
    cpus = _compiled(r) + _other_cpu(r)
    if not r.reproduced:
        text = reproduction(r)
        return [f"{text[0].upper()}{text[1:]}. The replay is not an exact copy of the run: non-deterministic kernels, "
                "another device or thread count, a loop that draws random numbers between steps, or files changed "
                "after recording."] + cpus
    if not r.loss_max_ulps:
        return cpus
    exact = [c.step for c in r.checkpoints_compared if c.exact]
    rounding = r.loss_max_ulps <= LOSS_ULPS
    if exact:
        why = (f"the state is bit-exact at step {exact[-1]}, so that is the loss's own rounding (its reduction summed "
               "in another order), not a divergence" if rounding else
               f"more than rounding, yet the state is bit-exact at step {exact[-1]}: the logged losses were not "
               "computed as the replay computes them (logged from another computation, or edited)")
    else:
        close = [c.step for c in r.checkpoints_compared if c.matched]
        why = ("few enough to be the loss's own rounding (its reduction summed in another order)" if rounding else
               ("within the tolerance for an eager replay of a run compiled with kernels of its own"
                if r.setup.compiled not in (None, *EAGER_KERNELS) else
                "within the tolerance for a replay on another device type or CPU")) + \
            (f"; the state matches the recorded one within tolerance at step {close[-1]}" if close else
             "; no recorded checkpoint in the replayed window confirms the state")
    return cpus + [f"Replayed losses differ from the logged ones by up to {r.loss_max_ulps} float32 ulp: {why}."]


def _compiled(r: ReplayReport) -> list[str]:
    """A run trained under torch.compile: the replay ran its module eagerly, and what the recorded state says of that."""
    backend = r.setup.compiled
    if backend is None:
        return []
    judged = [c for c in r.checkpoints_compared if c.error is None]
    c = judged[-1] if judged else None
    how = (f"{backend} runs the kernels eager mode runs" + (", so the state is compared bit for bit" if c is None or
                                                             not c.tolerance else "")
           if backend in EAGER_KERNELS else
           f"{backend} generates kernels of its own, which may round otherwise than eager mode's, so the state is "
           f"compared within rtol {c.tolerance if c is not None else STATE_RTOL:g}")
    state = ("no recorded checkpoint in the replayed window was compared" if c is None else
             f"it is bit-exact at step {c.step}" if c.exact else
             f"it matches within rtol {c.tolerance:g} at step {c.step}" if c.matched else f"it differs at step {c.step}")
    return [f"The run trained under torch.compile (backend {backend}); the replay ran the module it compiled eagerly, "
            f"where its hooks see every module's output and every operation. {how}: {state}."]


def _other_cpu(r: ReplayReport) -> list[str]:
    """Why the state was compared within a tolerance: the run was recorded on another kind of CPU, or on one its
    manifest does not name."""
    tolerant = [c for c in r.checkpoints_compared if c.error is None and c.tolerance > 0]
    if not tolerant or (r.setup.compiled not in (None, *EAGER_KERNELS) and r.setup.recorded_cpu == r.setup.replay_cpu):
        return []
    known = r.setup.recorded_cpu is not None
    rounded = [c.max_ulps for c in tolerant if c.max_ulps is not None]
    found = (f"differences up to {count(max(rounded), 'ulp')}" if rounded else
             "every value compared is bit-exact all the same")
    return [f"Recorded on {describe_cpu(r.setup.recorded_cpu)}, replayed on {describe_cpu(r.setup.replay_cpu)}: "
            f"kernels {'' if known else 'may '}sum in another order, so the state is compared within a tolerance "
            f"(rtol {tolerant[0].tolerance:g}) rather than bit for bit; {found}."]


def _nothing_reached(r: ReplayReport) -> str:
    """A run with no origin: clean, or clean apart from overflows the loss scaler caught."""
    window = span(r.setup.first_step, r.setup.last_step)
    caught = sorted({e.step for e in r.amp.caught}) if r.amp is not None else []
    # a recorded run replays from its last clean checkpoint: the steps before it were not checked
    before = (f"; steps before {r.setup.first_step} were not replayed (`--from-step 0` replays from the start)"
              if r.loaded is None and r.setup.first_step > 0 else "")
    if not caught:
        return (f"No non-finite value in any batch, activation, loss, gradient, optimizer state, parameter or buffer "
                f"over {window}{before}.")
    logged = r.logged_first_nonfinite_loss_step
    among = f" (the non-finite loss logged at step {logged} among them)" if logged in caught else ""
    return (f"No non-finite value reached the optimizer state or the parameters over {window}: the non-finite values "
            f"met at {numbered('step', caught)} were overflows the scaler caught{among}.")


def headline(r: ReplayReport) -> str:
    """The report's verdict in one line: the responsible step, or the steps replayed and what they showed."""
    if r.verdict == "nonfinite":
        shown = first_shown(r)
        if r.reproduced is None:  # nothing logged: the replay's own loss
            replayed = r.first_nonfinite_loss_step
            tail = f"; replayed loss first NaN at step {replayed}" if replayed is not None else \
                "; replayed losses all finite"
        else:
            tail = (f"; logged loss first NaN at step {shown}" if shown is not None else
                    "; logged losses all finite" if r.logged_first_nonfinite_loss_step is None else
                    "; logged losses non-finite only where the state stayed finite")
        if step_not_data(r):
            return f"step {r.responsible_step} failed batch-wide: the step, not its data{tail}"
        return f"responsible step {r.responsible_step}{tail}"
    if r.verdict == "not_reproduced" and r.logged_first_nonfinite_loss_step is None:  # bisect --code
        state = f"a non-finite loss only at {numbered('step', r.loss_only_steps)}" if r.loss_only_steps else \
            "all finite"
        return f"{span(r.setup.first_step, r.setup.last_step)} replayed from the supplied batches, {state}: " \
               "not reproduced"
    if r.verdict == "not_reproduced":
        return f"logged loss NaN at step {r.logged_first_nonfinite_loss_step}, not reproduced by the replay"
    if r.verdict == "loss_only":
        return f"non-finite loss at {numbered('step', r.loss_only_steps)} only: the model's state stayed finite"
    supplied = " from the supplied batches" if r.loaded is not None else ""
    return f"{span(r.setup.first_step, r.setup.last_step)} replayed{supplied}, all finite"


def narrate(r: ReplayReport) -> ReplayReport:
    """Set the report's sentences and its whole-model spread map from its facts, once they are final (again after
    a fact changes): the views render these and compute nothing."""
    for e in [*r.events, *([r.origin] if r.origin else []),
              *((r.amp.caught + ([r.amp.state_poisoned_by] if r.amp.state_poisoned_by else [])) if r.amp else [])]:
        e.text = describe(e)
    r.headline, r.reproduction, r.spread_map = headline(r), reproduction(r), from_replay(r)
    return r


def step_not_data(r: ReplayReport) -> bool:
    """Most of the responsible batch fails sample by sample, and that batch holds no data defect: the step (its
    learning rate, loss scale, or weights grown over many steps), not its data, is responsible."""
    return (r.samples is not None and r.samples.status == "batch_wide" and r.samples.compared_fails is not False
            and not r.samples.cause_leaves and not any(d.step == r.responsible_step for d in r.data_defects))


# The precursors that show a step drifting towards overflow: (what, its value at a step, whether it is a fraction
# of the dtype's largest value).
_DRIFT = (("the learning rate", lambda p: p.learning_rate, False),
          ("the gradient norm", lambda p: p.grad_norm, False),
          ("the largest parameter update", lambda p: p.update_max_abs, False),
          ("the largest activation", lambda p: p.activation_headroom, True))
RISE = 10.0  # a precursor that grew by this factor over the window before the origin is cited as rising


def rising(before: list[Precursor]) -> list[str]:
    """The precursors that rose at least ``RISE``-fold from the first to the last step of ``before``."""
    out = []
    for label, value, of_dtype in _DRIFT:
        values = [v for v in (value(p) for p in before) if v is not None and math.isfinite(v) and v > 0]
        if len(values) >= 2 and values[-1] >= RISE * values[0]:
            of = f" of {before[-1].activation_dtype}'s largest value" if of_dtype else ""
            out.append(f"{label} from {values[0]:.3g} to {values[-1]:.3g}{of}")
    return out


# The precursors a single step can set far apart from its neighbours: an LR schedule's one bad value, a loss scale
# grown by mistake, one enormous gradient, the update it made.
_SPIKING = (("the learning rate", lambda p: p.learning_rate),
            ("the gradient norm", lambda p: p.grad_norm),
            ("the largest parameter update", lambda p: p.update_max_abs))
JUMP = 100.0  # a precursor this many times both neighbouring steps' values is cited as a one-step spike


def spikes(r: ReplayReport) -> dict[int, list[str]]:
    """Per step before the origin, the precursors (and the loss scale) that were at least ``JUMP`` times their value
    at both neighbouring steps: a jump that came and went, which a rise from the window's first to its last step
    cannot show."""
    o = r.origin
    if o is None:
        return {}
    series = [(label, {p.step: value(p) for p in r.precursors}) for label, value in _SPIKING]
    if r.amp is not None and r.amp.scaler:
        series.append(("the loss scale", {a.step: a.scale for a in r.amp.steps}))
    out: dict[int, list[str]] = {}
    for label, at in series:
        for step, v in sorted(at.items()):
            sides = [at.get(step - 1), at.get(step + 1)]
            if step >= o.step or v is None or not math.isfinite(v) or any(
                    n is None or not math.isfinite(n) or n <= 0 for n in sides):
                continue
            near = max(sides)  # type: ignore[type-var]
            if v >= JUMP * near:
                out.setdefault(step, []).append(f"{label} jumped to {v:.3g}, {v / near:.3g} times its value at the "
                                                f"steps either side (at most {near:.3g})")
    return out


def _spikes(r: ReplayReport) -> list[str]:
    o = r.origin
    assert o is not None
    return [f"At step {s}, {count(o.step - s, 'step')} before the origin, {' and '.join(items)}, and fell back at step "
            f"{s + 1}: a one-step spike, which a comparison of the window's first and last steps does not show."
            for s, items in sorted(spikes(r).items())]


def _batch_wide(r: ReplayReport) -> list[str]:
    """A batch-wide failure: the whole batch is bad data, or, with clean data, the step is responsible, with the
    precursors that show its drift."""
    o = r.origin
    if o is None or r.samples is None or r.samples.status != "batch_wide":
        return []
    c = r.samples.compared_step
    if r.samples.cause_leaves:
        leaves, several = r.samples.cause_leaves, len(r.samples.cause_leaves) > 1
        return [f"Step {o.step}'s batch fails as a whole through its per-batch {'tensors' if several else 'tensor'} "
                f"{', '.join(leaves)} (kept whole when the batch was split): with step {c}'s in "
                f"{'their' if several else 'its'} place the same samples, from the same state, stay finite; "
                f"{'they are' if several else 'it is'} the cause, not particular samples nor the state the run had "
                "reached."]
    if any(d.step == o.step for d in r.data_defects):
        return [f"Most of step {o.step}'s batch fails sample by sample, and that batch holds data defects (see Data): "
                "the batch as a whole is bad data, not particular samples of it."]
    if not step_not_data(r):  # another batch passed from the same state
        before = [p for p in r.precursors if p.step < o.step]
        rose = rising(before)
        drift = f" Over {span(before[0].step, before[-1].step)} before it {_rose(rose)}." if rose else ""
        return [f"Most of step {o.step}'s batch fails sample by sample, yet the batch of step {c}, run from the same "
                "state, stays finite: the state the run had reached does not make every batch fail, so what this batch's "
                "samples share (a sequence length or padding, a setting the batch carries) is part of the cause, not "
                f"particular samples.{drift}"]
    other = (f"the batch of step {c}, run from the same state, fails too" if r.samples.compared_fails else
             "another batch would most likely fail the same way")
    head = (f"Step {o.step}, not its data, is responsible: most of its batch fails sample by sample, so the cause is "
            f"the state the run had reached (its learning rate, its loss scale, or weights grown over many steps), and "
            f"{other}")
    before = [p for p in r.precursors if p.step < o.step]
    if len(before) < 2:
        return [f"{head}; the replay holds no earlier steps to show a drift."]
    window = span(before[0].step, before[-1].step)
    rose = rising(before)
    if not rose:
        return [f"{head}; no precursor rose {RISE:g}-fold over {window}."]
    return [f"{head}. Over {window} {_rose(rose)}."]


def _rose(rose: list[str]) -> str:
    listed = ", ".join(rose[:-1]) + (" and " if len(rose) > 1 else "") + rose[-1]
    return f"{'these' if len(rose) > 1 else 'this'} rose: {listed}"


def _coupled_drift(r: ReplayReport) -> list[str]:
    """A failure that needs samples together, in a batch without data defects, after precursors rose: the drift
    is said beside the samples, since a run drifting towards overflow fails first on whichever samples push it
    over."""
    o = r.origin
    if (o is None or r.samples is None or r.samples.status != "coupled"
            or any(d.step == o.step for d in r.data_defects)):
        return []
    before = [p for p in r.precursors if p.step < o.step]
    rose = rising(before)
    if not rose:
        return []
    groups = ", ".join(map(str, r.samples.coupled_groups))
    return [f"Step {o.step}'s batch holds no data defect and its failure needs samples together ({groups}); over "
            f"{span(before[0].step, before[-1].step)} before it {_rose(rose)}."]


def _times_zero(value: str) -> str:
    return f"0*({value})" if value.startswith("-") else f"0*{value}"


def _clipping_spread(grad: Event, opt_grad: Event | None) -> list[str]:
    """The step function's code between backward and optimizer.step() (a clip) spread the non-finite gradients: it
    rewrote gradients, and optimizer.step() saw more non-finite values, and more NaN, than backward had left."""
    if (opt_grad is None or opt_grad.rewritten == 0 or opt_grad.elements_nonfinite <= grad.elements_nonfinite
            or opt_grad.nan_elements <= grad.nan_elements):
        return []
    why = ("a NaN gradient makes the total norm NaN, and so the factor max_norm/NaN" if grad.nan_elements else
           "the factor was not finite")
    return [f"Clipping spread it: backward left {count(grad.elements_nonfinite, 'non-finite gradient value')} "
            f"({grad.nan_elements:,} NaN) in {count(grad.tensors_nonfinite, 'tensor')}; the step function then rewrote "
            f"{count(opt_grad.rewritten, 'gradient tensor')} before optimizer.step(), which saw "
            f"{count(opt_grad.elements_nonfinite, 'non-finite value')} ({opt_grad.nan_elements:,} NaN) in "
            f"{count(opt_grad.tensors_nonfinite, 'tensor')}. A total-norm clip (clip_grad_norm_) scales every gradient "
            f"by one factor, max_norm/total norm: {why}, and every gradient it scaled became NaN."]


def _clipping(r: ReplayReport) -> list[str]:
    """What gradient clipping did, or would have done, with this step's non-finite gradient."""
    o = r.origin
    assert o is not None
    step_events = [e for e in r.events if e.step == o.step]
    grad = next((e for e in step_events if e.stage == "grad"), None)
    opt_grad = next((e for e in step_events if e.stage == "optimizer_grad"), None)
    if grad is None:
        return []
    spread = _clipping_spread(grad, opt_grad)
    if spread:
        return spread
    # The step function made NaN of the gradients between backward and optimizer.step() where the same coordinate went
    # from inf to NaN, or where it rewrote gradients and the NaN values grew in number while the non-finite ones did
    # not (the first non-finite gradient of backward and of the optimizer's order can be different tensors: NaN that
    # backward made is no evidence of it)
    same = opt_grad is not None and (opt_grad.tensor, opt_grad.index) == (grad.tensor, grad.index)
    turned = opt_grad is not None and opt_grad.rewritten > 0 and opt_grad.nan_elements > grad.nan_elements
    if grad.value in ("inf", "-inf") and (same or turned) and opt_grad is not None and opt_grad.value == "nan":
        return [f"The step function turned the {grad.value} gradient into NaN before optimizer.step(): that is what "
                f"gradient clipping does to an infinity (total norm inf, clip factor max_norm/inf = 0, and "
                f"{_times_zero(grad.value)} = NaN), so clipping cannot rescue it."]
    if (opt_grad is not None and opt_grad.value != grad.value) or (grad.value == "nan" and o.stage != "grad"):
        return []  # the step function changed the gradients, or they only carry an earlier stage's NaN
    norm = next((p.grad_norm for p in r.precursors if p.step == o.step), None)
    if norm is None:  # not measured: the first gradient event says which case it is
        norm = math.inf if grad.value in ("inf", "-inf") else math.nan
    if math.isnan(norm):
        return ["Gradient clipping would not have rescued this: the total gradient norm is NaN, so the clip factor "
                "max_norm/NaN is NaN, and clipping makes every gradient NaN."]
    if math.isinf(norm):
        value = "-inf" if grad.value == "-inf" else "inf"  # a NaN gradient with an infinite norm: inf's
        return [f"Gradient clipping would not have rescued this: the total gradient norm is inf, so the clip factor "
                f"max_norm/inf is 0, and {_times_zero(value)} = NaN."]
    return []


_SECOND_MOMENTS = {"exp_avg_sq", "max_exp_avg_sq"}  # Adam's v (and AMSGrad's max of it): the update divides by its root


def _state_kinds(r: ReplayReport, step: int, keys: list[str]) -> dict[str, str]:
    """Per state key, "NaN" or "infinities": what the key holds over all parameters at ``step``.

    The precursors' max |value| per key is NaN when any value is NaN and inf when an infinity is the worst;
    without them, the first non-finite value the replay met stands for the key.
    """
    measured = next((p.state_max_abs for p in r.precursors if p.step == step), {})
    first = {e.state_key: e.value for e in r.events if e.stage == "optimizer_state" and e.step == step}
    kinds = {}
    for key in keys:
        v = measured.get(key)
        nan = math.isnan(v) if v is not None and not math.isfinite(v) else first.get(key) == "nan"
        kinds[key] = "NaN" if nan else "infinities"
    return kinds


def _state(r: ReplayReport) -> list[str]:
    """What the optimizer state holds once it went non-finite, and what follows from it in this run."""
    state = [e for e in r.events if e.stage == "optimizer_state"]
    if not state:
        return []
    first = min(e.step for e in state)
    at_first = [e for e in state if e.step == first]
    kinds = _state_kinds(r, first, sorted({e.state_key or "" for e in at_first}))
    by_kind: dict[str, list[str]] = {}
    for e in sorted(at_first, key=lambda e: e.state_key or ""):
        by_kind.setdefault(kinds[e.state_key or ""], []).append(
            f"{e.state_key} ({count(e.elements_nonfinite, 'value')} in {count(e.tensors_nonfinite, 'tensor')})")
    holds = "; ".join(f"{kind} in {' and '.join(keys)}" for kind, keys in sorted(by_kind.items()))
    finite_keys = sorted(set(next((p.state_max_abs for p in r.precursors if p.step == first), {})) - set(kinds))
    param = next((e.step for e in r.events if e.stage == "param"), None)
    follows = (f"the parameters turned non-finite at step {param}" if param is not None else
               f"the parameters stayed finite through step {r.setup.last_step}")
    head = f"From step {first} the optimizer state holds {holds}"
    nan = [k for k, v in kinds.items() if v == "NaN"]
    if param is not None and param < first:
        via = " through that step's gradients" if any(e.step == first and e.stage == "grad" for e in r.events) else ""
        return [f"{head}; the parameters were non-finite from step {param}, before it: the state took the non-finite "
                f"values from them{via}, a consequence rather than the origin."]
    if nan:
        out = [f"{head}; {follows}. NaN in the state is absorbing: beta*NaN stays NaN, and no later gradient repairs "
               "it."]
    elif param is None and set(kinds) <= _SECOND_MOMENTS:
        others = f", while {', '.join(finite_keys)} stayed finite" if finite_keys else ""
        out = [f"{head}{others}; {follows}. Where v is inf, Adam's update m/(sqrt(v)+eps) is 0: those coordinates "
               "are frozen, they stop learning rather than turn NaN, and stay frozen while the inf lasts "
               "(beta2*inf = inf). Zeroing their state (--what-if reset-state) lets them learn again."]
    elif {"exp_avg", "exp_avg_sq"} <= set(kinds):
        out = [f"{head}; {follows}. Adam's update m/(sqrt(v)+eps) is inf/inf = NaN there, and the infinities persist "
               "(beta*inf = inf)."]
    else:
        out = [f"{head}; {follows}. An infinity in the state persists (beta*inf = inf)."]
    if param is not None:
        out.append("Skipping the step after optimizer.step() has written the state would not have saved the run: "
                   "skip before the state is written (check the gradients first, as GradScaler does), or repair or "
                   "reset the state.")
    return out
