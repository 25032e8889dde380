"""Layer 2, numeric: did gradients explode, was the LR too high, did fp16 scaling collapse?

Judged from the step table alone. These findings are primary only when the data layer is
clean (the engine enforces it): a grad-norm climb is what a bad sample causes too.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np
import pandas as pd

from spikeops.diagnosis.context import Context
from spikeops.diagnosis.model import EvidenceLine, Finding, RuledOut
from spikeops.thresholds import ABSURD_LR

__all__ = ["RULES", "numeric_grad_explosion", "numeric_lr_too_high", "numeric_loss_scale_collapse"]

#: A grad-norm climb this many logged steps long before the spike is an explosion's signature.
CLIMB_STEPS = 3
#: LR changes by more than this factor between consecutive logged steps: a schedule change.
LR_JUMP = 1.5
#: How close (logged steps) the spike must follow an LR peak or change to be blamed on it.
LR_NEAR = 50


def _position(ctx: Context, step: int) -> int:
    return int(np.searchsorted(ctx.metrics.frame.index.to_numpy(), step))


def numeric_grad_explosion(ctx: Context) -> list[Finding]:
    if ctx.metrics is None or ctx.spike is None:
        return []
    start = ctx.symptom.precursors.get("grad_norm")
    if start is None:
        ctx.ruled_out.append(RuledOut("numeric", "grad norm was not climbing before the spike"))
        return []
    climb = _position(ctx, ctx.spike) - _position(ctx, start)
    frame = ctx.metrics.frame
    before = frame["grad_norm"].loc[:start].iloc[:-1].dropna().tail(20)
    base = float(before.median()) if len(before) else float("nan")
    peak = frame["grad_norm"].loc[start:ctx.spike].max()
    ratio = peak / base if base and math.isfinite(base) and base > 0 else float("inf")
    confidence = 0.78 if climb >= CLIMB_STEPS else 0.45
    evidence = [line for line in (ctx.metric_line(start, "grad norm starts climbing"),
                                  ctx.metric_line(ctx.spike, "loss spike")) if line]
    return [Finding(
        layer="numeric", cause="grad_explosion", confidence=confidence,
        summary=f"grad norm climbs for {climb} logged step(s) from step {start} (x{ratio:.3g} over its "
                f"level) before the loss spike at step {ctx.spike}",
        step=start, evidence=evidence, onset_step=start,
    )]


def _absurd_lr(ctx: Context) -> list[Finding]:
    """A learning rate above ABSURD_LR: a configuration error whatever the loss does (no
    Adam schedule goes there; the relative rules see a flat LR and call it healthy)."""
    lr = ctx.metrics.frame["lr"].dropna()
    high = lr[lr > ABSURD_LR]
    if not len(high):
        return []
    step = int(high.index[0])
    anomalous = ctx.symptom.symptom not in ("none", "unknown")
    line = ctx.metric_line(step, "learning rate above 1")
    return [Finding(
        layer="numeric", cause="lr_too_high", confidence=0.78 if anomalous else 0.55,
        summary=f"the learning rate is {float(high.iloc[0]):.4g} at step {step}, above {ABSURD_LR:g}: no optimizer "
                "schedule for this kind of training goes there (check the configured LR)"
                + (f"; the loss is anomalous ({ctx.symptom.symptom.replace('_', ' ')})" if anomalous else ""),
        step=step, evidence=[line] if line else [], onset_step=step,
    )]


#: Logged LR values before a NaN over which a warm-up climb is judged.
WARMUP_POINTS = 5
#: A climbing LR at its peak: the first logged LR below this fraction of the highest (an LR
#: that only rose over the log, by at least 3 %).
WARMUP_RISE = 0.97


def _nan_in_warmup(ctx: Context, lr: pd.Series) -> list[Finding]:
    """A loss gone non-finite while the LR is still climbing in warm-up: the LR outran what
    the model can take before it reached its peak (the spec's ``lr_too_high``, extended).
    Climbing: the last logged LR values up to the NaN never fall, rise at least twice, and
    the LR at the NaN is the highest the run has had."""
    history = lr.loc[:ctx.spike].dropna()
    recent = history.tail(WARMUP_POINTS)
    if len(recent) < 3:
        return []
    steps = recent.diff().dropna()
    if (steps < 0).any() or int((steps > 0).sum()) < 2 or float(recent.iloc[-1]) < float(history.max()):
        return []
    start, top = float(recent.iloc[0]), float(recent.iloc[-1])
    first, last = int(recent.index[0]), int(recent.index[-1])
    evidence = [line for line in (ctx.metric_line(first, "LR climbing"), ctx.metric_line(last, "LR at the NaN"),
                                  ctx.metric_line(ctx.spike, "loss non-finite")) if line]
    return [Finding(
        layer="numeric", cause="lr_too_high", confidence=0.62,
        summary=f"the loss went non-finite at step {ctx.spike} while the learning rate was still climbing in warm-up "
                f"({start:.3g} at step {first} -> {top:.3g} at step {last}, {len(recent)} logged points, none lower): "
                "the LR outran what the model takes before its peak (test 0.3x LR, or a longer warm-up)",
        step=ctx.spike, evidence=_dedupe_lines(evidence), onset_step=None,
    )]


def _dedupe_lines(lines: list[EvidenceLine]) -> list[EvidenceLine]:
    seen, out = set(), []
    for line in lines:
        if (line.file, line.line) not in seen:
            seen.add((line.file, line.line))
            out.append(line)
    return out


def numeric_lr_too_high(ctx: Context) -> list[Finding]:
    if ctx.metrics is not None and len(ctx.metrics.frame):
        absurd = _absurd_lr(ctx)
        if absurd:
            return absurd
    if ctx.metrics is None or ctx.spike is None:
        return []
    lr = ctx.metrics.frame["lr"]
    if lr.notna().sum() < 3:
        ctx.missing.append(f"{ctx.metrics.file}: no learning rate logged (LR rule skipped)")
        return []
    if ctx.symptom.symptom == "instant_nan":
        warmup = _nan_in_warmup(ctx, lr)
        if warmup:
            return warmup
    spike_pos = _position(ctx, ctx.spike)
    window = lr.iloc[max(0, spike_pos - LR_NEAR): spike_pos + 1].dropna()
    ratios = (window / window.shift(1)).dropna()
    jumps = ratios[(ratios > LR_JUMP)]
    # A warmup's steps are not a schedule change: the LR rising monotonically from the first
    # logged value up to the jump is the warmup itself.
    history = lr.dropna()
    rising = (history.diff().fillna(0) >= 0).cummin()
    jumps = jumps[[not bool(rising.get(step, False)) for step in jumps.index]]
    reason = None
    step = None
    if len(jumps):
        step = int(jumps.index[0])
        reason = f"the LR jumped x{float(jumps.iloc[0]):.3g} at step {step}"
    else:
        # At its peak: the LR at the spike is within 5 % of the highest it reaches around it
        # (a warmup that overshoots breaks the loss near the top, sometimes just before).
        around = lr.iloc[max(0, spike_pos - LR_NEAR): spike_pos + LR_NEAR // 5 + 1].dropna()
        history = lr.loc[:ctx.spike].dropna()
        at_spike = float(lr.loc[ctx.spike]) if ctx.spike in lr.index and lr.notna().loc[ctx.spike] else None
        # A warm-up in the log: the LR never fell and rose by a visible amount (an excerpt may
        # hold only the last stretch of a long linear warm-up: a few percent of it).
        steps = history.diff().dropna()
        rising = len(history) > 5 and (float(history.iloc[0]) < 0.9 * float(history.max()) or (
            bool((steps >= 0).all()) and float(history.iloc[0]) < WARMUP_RISE * float(history.max())))
        if at_spike is not None and len(around) and at_spike >= 0.95 * float(around.max()) and rising \
                and float(around.max()) >= float(history.max()):
            step = int(history.idxmax())
            reason = f"the LR was at its peak ({at_spike:.3g}, warmup just ended) when the loss broke"
    if reason is None:
        ctx.ruled_out.append(RuledOut("numeric", "no LR peak or schedule change near the spike"))
        return []
    confidence = 0.72 if ctx.symptom.symptom == "spike_no_recovery" else 0.4
    evidence = [line for line in (ctx.metric_line(step, "LR change"), ctx.metric_line(ctx.spike, "loss spike")) if line]
    return [Finding(
        layer="numeric", cause="lr_too_high", confidence=confidence,
        summary=f"{reason}; the loss spiked at step {ctx.spike}"
                + (" and did not recover" if ctx.symptom.symptom == "spike_no_recovery" else ""),
        step=step, evidence=evidence, onset_step=step if len(jumps) else None,
    )]


#: Logged steps before the onset where a collapse may have begun.
COLLAPSE_LOOKBACK = 100
#: Halvings of one collapse follow each other within this many logged steps; the scaler's
#: normal breathing halves once per growth interval (hundreds to thousands of steps).
COLLAPSE_GAP = 5


def _collapse_start(run: pd.Series) -> int:
    """First drop of the cluster of drops that ends at the lowest scale."""
    values = run.to_numpy()
    drops = [index for index in range(1, len(values)) if values[index] < values[index - 1]]
    if not drops:
        return int(run.index[-1])
    first = drops[-1]
    for previous in reversed(drops[:-1]):
        if first - previous > COLLAPSE_GAP:
            break
        first = previous
    return int(run.index[first])


#: Scalers start this high (2^16..2^32) and halve on the first overflows until they fit: a
#: fall from here at the very start of a run, not down to the floor, is that calibration.
CALIBRATION_START = 2.0 ** 16
#: The start-up calibration happens in a run's first steps (32 halvings at most, one per
#: overflow step, hysteresis and logging intervals stretching it to a few hundred).
CALIBRATION_STEPS = 1000
#: Drops of one calibration follow each other within this many logged points; a longer hold
#: means the scale had settled, and a fall after it is a collapse.
CALIBRATION_GAP = 3


def _calibration_end(scale: pd.Series, bad: pd.Series | None = None) -> int:
    """Length (logged points) of the start-up calibration: fp16 loss scalers start high
    (2^16..2^32) and halve on the first overflows until the scale fits, then hold. A fall that
    starts at the first logged point of a run in its first CALIBRATION_STEPS steps, never
    grows, holds no longer than CALIBRATION_GAP points between drops, stays above the floor
    (1) and comes with a finite loss is that; a plateau first means a trained scale fell."""
    values = scale.to_numpy(dtype=float)
    steps = scale.index.to_numpy()
    if len(values) < 2 or steps[0] > CALIBRATION_STEPS:
        return 0
    last_drop, position = 0, 1
    while position < len(values) and steps[position] <= CALIBRATION_STEPS:
        if values[position] > values[position - 1]:
            break
        if values[position] < values[position - 1]:
            if position - last_drop > CALIBRATION_GAP or values[position] < 1:
                break
            last_drop = position
        position += 1
    if last_drop == 0:
        return 0
    if bad is not None and bool(bad.reindex(scale.index[:last_drop + 1]).fillna(False).any()):
        return 0  # a non-finite loss during the fall: not a scaler finding its level
    return last_drop + 1


def _scale_chain(events: list) -> list[tuple[float, object]]:
    """(scale after, event) for each scaler line, in file order; an ``attempted`` that
    differs from the scale before starts from it (a line missed between two)."""
    chain: list[tuple[float, object]] = []
    for event in events:
        if event.attempted is not None and (not chain or chain[-1][0] != event.attempted):
            chain.append((float(event.attempted), event))
        if event.reduced_to is not None:
            chain.append((float(event.reduced_to), event))
        elif event.minimum and chain:
            chain.append((chain[-1][0], event))
    return chain


def _collapse_from_lines(ctx: Context) -> list[Finding]:
    """The collapse read from the scaler's own lines: the last unbroken fall (no growth in
    between) down to the lowest scale, in halvings; at its floor (at minimum, stuck at 1 with
    overflows continuing, or below 1) it is a collapse however short the fall."""
    events = list(getattr(ctx.metrics, "overflows", []) or [])
    chain = _scale_chain(events)
    minimum = [event for event in events if event.minimum]
    if len(chain) < 2 and minimum:
        # The scaler's own word that it hit its floor (DeepSpeed exits on it): the collapse,
        # even when no overflow line before it made it into the log.
        last = minimum[-1]
        return [Finding(
            layer="numeric", cause="loss_scale_collapse", confidence=0.8,
            summary="the fp16 loss scaler reached its minimum and cannot decrease any more: repeated overflows "
                    "collapsed the loss scale",
            step=getattr(last, "step", None), evidence=[EvidenceLine(ctx.metrics.file, last.line, last.text)],
            onset_step=getattr(last, "step", None),
        )]
    if len(chain) < 2:
        return []
    values = [value for value, _ in chain]
    low_index = min(range(len(values)), key=lambda index: (values[index], -index))
    start = low_index
    while start > 0 and values[start - 1] >= values[start]:
        start -= 1
    high, low = values[start], values[low_index]
    falls = [event for (value, event), (before, _) in zip(chain[start + 1:low_index + 1], chain[start:low_index])
             if value < before]
    halvings = round(math.log2(high / low)) if low > 0 and high > 0 else 0
    at_floor = any(event.minimum for _, event in chain) or low < 1 \
        or sum(1 for event in events if event.attempted == 1 and event.reduced_to == 1) >= 2
    steps_before = ctx.metrics.frame.index
    first_event = chain[start][1]
    fall_steps = [getattr(event, "step", None) for event in [first_event, *falls]]
    known = [step for step in fall_steps if step is not None]
    first_logged = int(steps_before[0]) if len(steps_before) else None
    # The fall opens the log: before any step line, or at steps of the run's first ones.
    early = (not len(steps_before)
             or (known and max(known) <= CALIBRATION_STEPS)
             or (not known and first_event.line < int(ctx.metrics.frame["line"].min())
                 and (first_logged is None or first_logged <= CALIBRATION_STEPS)))
    settled = _settled_after(ctx, chain, low_index)
    if start == 0 and early and settled and high >= CALIBRATION_START and not at_floor:
        ctx.ruled_out.append(RuledOut("numeric", f"the loss scale fell from {high:g} to {low:g} at the start of "
                                                 "the log: the scaler's start-up calibration, not a collapse"))
        return []
    if not at_floor and (halvings < 3 or low / high > 0.1):
        ctx.ruled_out.append(RuledOut("numeric", f"loss scale did not collapse (the scaler's lines: {high:g} to {low:g})"))
        return []
    confidence = 0.8 if at_floor or low / high <= 0.01 else 0.65
    file = ctx.metrics.file
    cited = (falls or [chain[low_index][1]])
    evidence = [EvidenceLine(file, event.line, event.text) for event in (cited[:2] + cited[-1:] if len(cited) > 3 else cited)]
    if minimum:
        evidence.append(EvidenceLine(file, minimum[-1].line, minimum[-1].text))
    step = getattr(cited[0], "step", None)
    return [Finding(
        layer="numeric", cause="loss_scale_collapse", confidence=confidence,
        summary=f"the fp16 loss scale fell from {high:g} to {low:g} over {len(falls)} overflow line(s) "
                f"({halvings} halving(s))" + ("; the scaler reached its floor" if at_floor else ""),
        step=step, evidence=evidence, onset_step=step,
    )]


def _settled_after(ctx: Context, chain: list[tuple[float, object]], low_index: int) -> bool:
    """After the fall the scale held: no scaler line after the lowest one, or the steps
    logged after it carry a finite loss."""
    if low_index == len(chain) - 1:
        return True
    after_line = getattr(chain[low_index][1], "line", 0)
    frame = ctx.metrics.frame
    later = frame[frame["line"] > after_line]
    return bool(len(later)) and not bool(later["loss_bad"].any())


def numeric_loss_scale_collapse(ctx: Context) -> list[Finding]:
    if ctx.metrics is None:
        return []
    frame = ctx.metrics.frame
    scale = frame["loss_scale"].dropna()
    if len(scale) < 3 or scale.nunique() <= 1:
        return _collapse_from_lines(ctx)
    calibrated = _calibration_end(scale, frame["loss_bad"] if "loss_bad" in frame else None)
    if calibrated:
        ctx.ruled_out.append(RuledOut("numeric", f"the loss scale fell from {float(scale.iloc[0]):g} to "
                                                 f"{float(scale.iloc[calibrated - 1]):g} in the run's first steps and "
                                                 "then held, with a finite loss: the scaler's start-up calibration"))
    scale = scale.iloc[calibrated:]
    if len(scale) < 2:
        return []
    anchor = ctx.onset if ctx.onset is not None else ctx.spike
    if anchor is None:
        anchor = int(scale.index[-1])
    anchor_pos = int(np.searchsorted(scale.index.to_numpy(), anchor))
    region = scale.iloc[max(0, anchor_pos - COLLAPSE_LOOKBACK):]
    low_step = int(region.idxmin())
    low = float(region.min())
    start = _collapse_start(scale.loc[:low_step])
    start_pos = int(np.searchsorted(scale.index.to_numpy(), start))
    high = float(scale.iloc[start_pos - 1]) if start_pos > 0 else float(scale.iloc[0])
    if high <= 0 or not math.isfinite(high):
        return []
    ratio = low / high
    # Count halvings, not logged drops: with a log interval of 10, one logged drop can be 3.
    cluster = scale.loc[:low_step].iloc[max(0, start_pos - 1):].clip(lower=max(low, 1e-12) / 2)
    ratios = cluster.shift(1) / cluster
    drops = int(round(float(np.log2(ratios[(ratios > 1) & np.isfinite(ratios)]).sum())))
    skipped = int(frame["skipped"].loc[start:low_step].sum())
    # Dynamic scalers stop at 1 (DeepSpeed's and Megatron's floor); below it is broken even
    # when the fall from a low level is short.
    below_floor = high >= 1 and low < 1 and (drops >= 2 or skipped >= 2)
    if not below_floor and (ratio > 0.1 or (drops < 3 and skipped < 3)):
        ctx.ruled_out.append(RuledOut("numeric", f"loss scale did not collapse (its steepest recent fall: {high:g} to {low:g})"))
        return []
    if ctx.symptom.symptom == "instant_nan" and ctx.spike is not None and start >= ctx.spike:
        # fp16 scalers halve on every non-finite step: after a NaN the fall is its echo.
        ctx.ruled_out.append(RuledOut("numeric", f"the loss scale fell only after the NaN at step {ctx.spike}: a consequence"))
        return []
    confidence = 0.8 if ratio <= 0.01 or low < 1 else 0.6
    evidence = [line for line in (ctx.metric_line(start, "loss scale starts falling"),
                                  ctx.metric_line(low_step, "lowest loss scale")) if line]
    return [Finding(
        layer="numeric", cause="loss_scale_collapse", confidence=confidence,
        summary=f"fp16 loss scale fell from {high:g} to {low:g} ({math.log10(high / low) if low > 0 else float('inf'):.1f} "
                f"orders of magnitude, {drops} halving(s), {skipped} skipped step(s))",
        step=start, evidence=evidence, onset_step=start,
    )]


RULES: tuple[Callable[[Context], list[Finding]], ...] = (
    numeric_grad_explosion,
    numeric_lr_too_high,
    numeric_loss_scale_collapse,
)
