"""Plain-language findings drawn from a replay report's facts: what happened and what would have helped."""

from __future__ import annotations

import math

from ..report import CheckpointLoad, Event, OpSite, ReplayReport


def describe(e: Event) -> str:
    """``grad fc2.weight[3, 7] = inf`` (``exp_avg_sq of ...`` for optimizer state)."""
    where = f"[{', '.join(map(str, e.index))}]" if e.index else ""
    subject = f"{e.state_key} of {e.tensor}" if e.state_key else e.tensor
    value = f" = {e.value}" if e.value else ""
    head = e.stage if subject == e.stage else f"{e.stage} {subject}"
    return f"{head}{where}{value}"


def describe_site(op: OpSite) -> str:
    where = f" in module `{op.module}`" if op.module else " outside any module"
    return f"{op.op}{where}" + (f" ({op.source})" if op.source else "")


def _root_cause(r: ReplayReport) -> list[str]:
    out = []
    for d in r.data_defects:
        if r.responsible_step is None or d.step == r.responsible_step:
            kind = {"nonfinite": "a non-finite", "extreme": "an extreme", "subnormal": "a subnormal"}[d.kind]
            out.append(f"Data: the batch of step {d.step} holds {kind} value, {d.tensor}"
                       f"[{', '.join(map(str, d.index))}] = {d.value} ({d.count} such in {d.file}).")
    op = r.operation
    if op is not None:
        ranges = ", ".join(f"[{lo}, {hi}]" for lo, hi in op.site.input_ranges)
        if op.site.phase == "backward" and op.forward is not None:
            fwd_ranges = ", ".join(f"[{lo}, {hi}]" for lo, hi in op.forward.input_ranges)
            out.append(f"Operation: {op.site.op} in the backward of {describe_site(op.forward)}, autograd node "
                       f"{op.autograd_node}, produced {op.output_value} at [{', '.join(map(str, op.output_index))}] "
                       f"from finite inputs {ranges}; the forward op's inputs ranged over {fwd_ranges}.")
        else:
            out.append(f"Operation: {op.site.phase} {describe_site(op.site)} produced {op.output_value} at "
                       f"[{', '.join(map(str, op.output_index))}] from finite inputs {ranges}.")
    if r.samples is not None:
        ids = "; ".join(f"{k} = {v}" for k, v in r.samples.sample_leaves.items())
        out.append(f"Samples: {r.samples.message}" + (f" ({ids})" if ids else "") + ".")
    return out


_CAUSE = {
    "batch": "the batch itself holds a non-finite value: a data defect, before any computation",
    "forward": "the forward pass produced it from finite inputs (an overflow or an invalid operation in module {t})",
    "loss": "every module output was finite but the loss computation produced it",
    "grad": "the forward pass and the loss were finite; the backward pass overflowed",
    "optimizer_grad": "the gradients were finite after backward; the step function made them non-finite before "
                      "optimizer.step()",
    "optimizer_state": "the gradients were finite, but the optimizer state overflowed (a squared gradient past the "
                       "dtype's largest value, for instance)",
    "param": "gradients and optimizer state were finite; the parameter update itself produced it",
}


def findings(r: ReplayReport) -> list[str]:
    out: list[str] = []
    o = r.origin
    if o is None:
        if r.verdict == "not_reproduced":
            out.append(f"The logged loss was non-finite at step {r.logged_first_nonfinite_loss_step}, but the replay "
                       "found no non-finite value: the failure did not reproduce here.")
        else:
            out.append("No non-finite value in any batch, activation, loss, gradient, optimizer state or parameter "
                       f"over steps {r.setup.first_step}-{r.setup.last_step}.")
    else:
        out.append(f"Origin: step {o.step}, {describe(o)} ({o.dtype}): {_CAUSE[o.stage].format(t=o.tensor)}.")
        shown = r.logged_first_nonfinite_loss_step
        if shown is not None and shown < o.step:
            caught = r.amp is not None and any(c.step == shown for c in r.amp.caught)
            out.append(f"The logged loss was already non-finite at step {shown}, before the origin: "
                       + ("an overflow the scaler caught, skipping that step with the state intact."
                          if caught else "it reached neither the parameters nor the optimizer state."))
        elif shown is not None and shown != o.step:
            logged = next((s.logged_loss for s in r.spread if s.step == o.step), None)
            loss_text = f" ({logged:.6g})" if logged is not None and math.isfinite(logged) else ""
            out.append(f"The loss logged at step {o.step} was finite{loss_text}: it is computed before the update. "
                       f"The logged loss first shows NaN at step {shown}, {shown - o.step} step(s) later; "
                       f"the batch to inspect is step {o.step}'s, not step {shown}'s.")
        elif r.reproduced is None and r.first_nonfinite_loss_step not in (None, o.step):
            replayed = next((s.replayed_loss for s in r.spread if s.step == o.step), None)
            loss_text = f" ({replayed:.6g})" if replayed is not None and math.isfinite(replayed) else ""
            shown = r.first_nonfinite_loss_step
            out.append(f"The loss at step {o.step} was finite in the replay{loss_text}: it is computed before the "
                       f"update. It first shows NaN at step {shown}, {shown - o.step} step(s) later, where a training "
                       f"log shows it too; the batch to inspect is step {o.step}'s, not step {shown}'s.")
        out += _root_cause(r)
        step_events = [e for e in r.events if e.step == o.step]
        grad_inf = next((e for e in step_events if e.stage == "grad" and e.value in ("inf", "-inf")), None)
        opt_grad = next((e for e in step_events if e.stage == "optimizer_grad"), None)
        if grad_inf and opt_grad and opt_grad.value == "nan":
            out.append(f"The step function turned the {grad_inf.value} gradient into NaN before optimizer.step(): "
                       "gradient clipping cannot rescue an infinity (total norm = inf, clip factor = max_norm/inf = 0, "
                       "inf*0 = NaN).")
        elif grad_inf:
            out.append("Gradient clipping would not have rescued this: the total norm is inf, the clip factor "
                       "max_norm/inf is 0, and inf*0 = NaN.")
    state = [e for e in r.events if e.stage == "optimizer_state"]
    if state:
        first = min(e.step for e in state)
        keys = sorted({e.state_key or "" for e in state if e.step == first})
        out.append(f"Optimizer state ({', '.join(keys)}) holds non-finite values from step {first}: the state is "
                   "absorbing (beta*NaN stays NaN, no later gradient repairs it). Skipping the step after "
                   "optimizer.step() has written it would not save the run: skip before the state is written "
                   "(check the gradients first, as GradScaler does), or repair or reset the state.")
    if r.fully_nonfinite_step is not None:
        out.append(f"Every parameter is non-finite by step {r.fully_nonfinite_step}.")
    if r.reproduced is False:
        out.append(f"Replayed losses differ from the logged ones from step {r.diverged_at_step}: the replay is not "
                   "an exact copy of the run (non-deterministic kernels, another device or thread count, or a loop "
                   "that draws random numbers between steps).")
    elif r.reproduced is None:
        clean = (f"; it stays finite over steps {r.setup.first_step}-{r.setup.last_step}, so a failure of the run "
                 "within them is not reproduced from the supplied batches") if r.origin is None else ""
        out.append(f"No losses were logged to compare with: whether the replay reproduces the run cannot be "
                   f"judged{clean}.")
    return out + (_loaded(r.loaded) if r.loaded is not None else [])


def _loaded(c: CheckpointLoad) -> list[str]:
    """How a checkpoint the recorder did not write was read: each choice that shapes what the replay means."""
    basis = {"metadata": "its metadata", "trainer_state.json": "the steps trainer_state.json counts",
             "name": "its name", "--from-step": "--from-step"}.get(c.step_from, c.step_from)
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
