"""What ``spikeops parse`` says about a training log."""

from __future__ import annotations

import math
from spikeops.probes.training_log.model import (
    StepRecord,
    TrainingLog,
)
from spikeops.probes.training_log.files import (
    latest_per_step,
    first_loss_doubling,
)

__all__ = ["summarize"]


# --------------------------------------------------------------------------- summary


def _fmt(value: float | None) -> str:
    if value is None:
        return "-"
    return f"{value:.6g}"


def _scale_drops(steps: list[StepRecord]) -> list[tuple[float, float, int]]:
    drops = []
    previous: float | None = None
    for record in steps:
        if record.loss_scale is None:
            continue
        if previous is not None and record.loss_scale < previous:
            drops.append((previous, record.loss_scale, record.step))
        previous = record.loss_scale
    return drops


def _list_steps(values: list[int], limit: int = 8) -> str:
    shown = ", ".join(str(value) for value in values[:limit])
    return shown + (f", ... ({len(values)} in all)" if len(values) > limit else "")


def summarize(log: TrainingLog) -> list[str]:
    """What was read (format, step range) and what is alarming (non-finite values, skipped
    steps, loss-scale drops, grad-norm peak, the first loss doubling as a hint)."""
    steps = latest_per_step(log.records)
    if not steps:
        out = [f"{log.format}: {log.lines} lines, no training steps found"]
        if log.overflow_events:
            scales = [e.reduced_to for e in log.overflow_events if e.reduced_to is not None]
            out.append(f"{len(log.overflow_events)} loss-scale line(s) (overflows)"
                       + (f": scale {_fmt(scales[0])} -> {_fmt(scales[-1])}" if scales else "")
                       + ("; the scaler reached its minimum" if any(e.minimum for e in log.overflow_events) else ""))
        out += [f"  gap: {gap.reason}" for gap in log.gaps[:3]]
        return out
    ordinal = " (ordinal: the log prints no step numbers)" if log.step_is_ordinal else ""
    out = [f"{log.format}: {len(steps)} steps {steps[0].step}..{steps[-1].step}{ordinal} from {log.lines} lines"]
    read = [name for name in ("loss", "lr", "grad_norm", "loss_scale", "throughput", "tokens", "time", "perplexity")
            if any(getattr(r, name) is not None for r in steps)]
    unread = [name for name in ("loss", "lr", "grad_norm", "loss_scale") if name not in read]
    out.append(f"fields read: {', '.join(read) or 'none'}" + (f"; not in the log: {', '.join(unread)}" if unread else ""))
    with_loss = [r for r in steps if r.loss is not None]
    finite = [r for r in with_loss if math.isfinite(r.loss or 0.0)]
    if with_loss:
        last = with_loss[-1]
        line = f"last loss {_fmt(last.loss)} at step {last.step}"
        if finite:
            low = min(finite, key=lambda r: r.loss or 0.0)
            high = max(finite, key=lambda r: r.loss or 0.0)
            line += f"; min {_fmt(low.loss)} (step {low.step}), max {_fmt(high.loss)} (step {high.step})"
        out.append(line)
    vanished = [r.step for r in steps if r.loss_missing]
    missing = [r.step for r in steps if r.loss is None and not r.loss_missing]
    if vanished:
        out.append(f"NO LOSS PRINTED at step(s) {_list_steps(vanished)} while the other lines print one: "
                   "Megatron leaves out a NaN average, read as non-finite")
    if missing:
        out.append(f"no loss logged at step(s) {_list_steps(missing)}")
    nonfinite = [r.step for r in steps if r.nan]
    if nonfinite:
        out.append(f"NON-FINITE loss/grad norm at step(s) {_list_steps(nonfinite)}")
    kept = {id(r) for r in steps}
    superseded = sorted({r.step for r in log.records if r.nan and id(r) not in kept})
    if superseded:
        out.append(f"NON-FINITE loss/grad norm before a restart at step(s) {_list_steps(superseded)} "
                   "(re-logged later)")
    skipped = [r.step for r in steps if r.skipped]
    if skipped:
        out.append(f"skipped step(s) {_list_steps(skipped)}")
    drops = _scale_drops(steps)
    if drops:
        shown = ", ".join(f"{_fmt(a)} -> {_fmt(b)} (step {s})" for a, b, s in drops[:6])
        out.append(f"loss scale drops: {shown}" + (f", ... ({len(drops)} in all)" if len(drops) > 6 else ""))
    grads = [r for r in steps if r.grad_norm is not None and math.isfinite(r.grad_norm)]
    if grads:
        peak = max(grads, key=lambda r: r.grad_norm or 0.0)
        out.append(f"grad norm max {_fmt(peak.grad_norm)} at step {peak.step}")
    doubling = first_loss_doubling(steps)
    if doubling:
        before, at = doubling
        out.append(f"hint: loss more than doubled at step {at.step} ({_fmt(before.loss)} -> {_fmt(at.loss)})")
    if log.overflow_events:
        out.append(f"{len(log.overflow_events)} overflow (skipped step) line(s)")
    for restart in log.restarts[:3]:
        out.append(f"restart at line {restart.line}: step {restart.from_step} -> {restart.to_step}")
    if log.rank_memory:
        peak_mem = max(log.rank_memory, key=lambda m: m.max_allocated_mb or 0.0)
        out.append(
            f"memory reports from {len({m.rank for m in log.rank_memory})} ranks; "
            f"max allocated {_fmt(peak_mem.max_allocated_mb)} MB on rank {peak_mem.rank}"
        )
    if log.gaps:
        out.append(f"{len(log.gaps)} gap(s), first: {log.gaps[0].reason}")
    return out
