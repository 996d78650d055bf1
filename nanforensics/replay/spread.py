"""Where the non-finite values are after each step, per parameter and its optimizer state: the data
behind the spread heatmaps.

A replay report keeps, per step, only the totals (non-finite parameters and state values over the
whole model). ``trace`` measures per tensor by re-running the replayed window plainly from the
replay's start checkpoint and counting every parameter and state tensor after each step; it runs
only when the replay found an origin, over the few steps from just before it to the replay's end.
"""

from __future__ import annotations

import math

import torch

from .. import finite
from ..distributed.sessions import open_session
from ..errors import BadInput
from ..progress import SILENT, Progress
from ..report import ReplayReport, SpreadMap, TensorSpread
from ..runs.checkpoint import optimizer_params, param_names
from ..runs.run import Run, UserCode
from ..words import span
from .session import pinned_threads

CONTEXT_STEPS = 2  # clean steps shown before the responsible one
TEXT_ROWS = 24  # the most rows a terminal's or a Markdown block's heatmap draws
PAGE_ROWS = 48  # the most an HTML page's draws


def from_replay(r: ReplayReport) -> SpreadMap | None:
    """The whole model as one row, from the report's per-step totals: all a saved replay report knows."""
    start = (r.responsible_step - CONTEXT_STEPS) if r.responsible_step is not None else None
    records = [s for s in r.spread if start is None or s.step >= start]
    if not records:
        return None
    row = TensorSpread("whole model", records[-1].params_total, records[-1].state_total,
                       [s.params_nonfinite for s in records], [s.state_nonfinite for s in records])
    return layered(SpreadMap([s.step for s in records], [row], r.responsible_step, "totals"))


def trace(run: Run, code: UserCode, replay: ReplayReport, progress: Progress = SILENT) -> SpreadMap:
    """Per-tensor counts after each step from just before the origin to the end of the replay."""
    if replay.responsible_step is None:
        raise ValueError("trace needs a replay that found the origin")
    s = replay.setup
    checkpoint = next((c for c in run.checkpoints() if c.step == s.from_checkpoint), None)
    if checkpoint is None:
        raise BadInput(run.path / "checkpoints", f"the replay's start checkpoint (step {s.from_checkpoint}) is gone")
    device = torch.device(s.device)
    first = max(s.first_step, replay.responsible_step - CONTEXT_STEPS)
    steps = list(range(first, s.last_step + 1))
    with pinned_threads(s.num_threads if device.type == "cpu" else None):
        session = open_session(run, code, checkpoint, device)
        if session.step < first:
            progress.phase(f"re-running {span(session.step, first - 1)} from the checkpoint", None)
        session.advance_to(first)
        params = optimizer_params(session.optimizer)
        names = param_names(session.model, session.optimizer)
        counts: list[tuple[list[int], list[int]]] = [([], []) for _ in params]
        progress.phase(f"counting non-finite values per tensor, {span(first, s.last_step)}", len(steps))
        for done, _ in enumerate(steps, 1):
            session.run_step()
            progress.update(done)
            for p, (bad_params, bad_state) in zip(params, counts):
                bad_params.append(finite.count_nonfinite(p))
                bad_state.append(sum(finite.count_nonfinite(v) for v in session.optimizer.state.get(p, {}).values()
                                     if finite.checkable(v)))
        state_totals = [sum(v.numel() for v in session.optimizer.state.get(p, {}).values() if finite.checkable(v))
                        for p in params]
    rows = [TensorSpread(n, p.numel(), st, bp, bs) for n, p, st, (bp, bs) in zip(names, params, state_totals, counts)]
    return layered(SpreadMap(steps, rows, replay.responsible_step, "per_tensor"))


def disagreement(m: SpreadMap, replay: ReplayReport) -> int | None:
    """The first step whose per-tensor sums differ from the replay's totals (a non-deterministic re-run)."""
    totals = {r.step: (r.params_nonfinite, r.state_nonfinite) for r in replay.spread}
    for i, step in enumerate(m.steps):
        sums = (sum(r.params_nonfinite[i] for r in m.rows), sum(r.state_nonfinite[i] for r in m.rows))
        if step in totals and totals[step] != sums:
            return step
    return None


def layered(m: SpreadMap) -> SpreadMap:
    """``m`` with the rows its views draw: merged here, once, so that a view only draws (and a saved report re-renders
    what was shown)."""
    m.text_rows, m.page_rows = grouped(m, TEXT_ROWS), grouped(m, PAGE_ROWS)
    return m


def grouped(m: SpreadMap, max_rows: int) -> list[TensorSpread]:
    """At most ``max_rows`` rows: tensors merged into their modules (fc1.weight, fc1.bias -> fc1), and when
    there are still too many, modules into runs of neighbours (layers.0 .. layers.3), in model order."""
    if len(m.rows) <= max_rows:
        return m.rows
    modules = [r.name.rpartition(".")[0] or r.name for r in m.rows]
    names = list(dict.fromkeys(modules))
    if len(names) > max_rows:
        per = math.ceil(len(names) / max_rows)
        runs = [names[i:i + per] for i in range(0, len(names), per)]
        label = {n: run[0] if len(run) == 1 else f"{run[0]} .. {run[-1]}" for run in runs for n in run}
        modules = [label[k] for k in modules]
    return _merged(m, modules)


def _merged(m: SpreadMap, keys: list[str]) -> list[TensorSpread]:
    out: dict[str, TensorSpread] = {}
    for key, r in zip(keys, m.rows):
        g = out.setdefault(key, TensorSpread(key, 0, 0, [0] * len(m.steps), [0] * len(m.steps)))
        g.params_total += r.params_total
        g.state_total += r.state_total
        g.params_nonfinite = [a + b for a, b in zip(g.params_nonfinite, r.params_nonfinite)]
        g.state_nonfinite = [a + b for a, b in zip(g.state_nonfinite, r.state_nonfinite)]
    return list(out.values())
