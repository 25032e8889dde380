"""Symptom classification from the step metrics, with robust statistics.

The question is the seed's first one: which kind of divergence is this? The answer decides
the protective move (stop at once for NaN, observe for a single spike), so it must not be
fooled by what healthy training looks like: noise, warmup, a decaying loss, an LR step, an
fp16 loss scale that breathes. And real runs log every 10-100 steps, and what reaches us is
often an excerpt of a few lines. Hence:

- the running level is a trailing rolling **median** (a spike does not drag it up), and the
  noise scale comes from the median absolute *first difference*, which a trend or a slow
  decay does not inflate (unlike a MAD around a moving level);
- a logged point is anomalous when it is far above the level in noise units (z > 6) **and**
  by a material fraction of it (> 10 %); while the history is short (an excerpt), when it is
  1.5x the level; inside a climb (three rises, 50 % in all); or absurd whatever the history
  (a loss of 1e4, an infinite perplexity);
- only steps in the incident window can be the spike (a long run has old, recovered
  wobbles); precursors may start before it;
- the spike is the **peak of the excursion** that begins at the first anomalous point;
  recovery compares the last points after the peak with the level before the excursion;
- a creeping increase is a sustained rise of the rolling median above its minimum, gradual
  (no anomalous step) and monotone enough (rank correlation with the step);
- fewer than three logged loss values with nothing anomalous among them is ``unknown``:
  unread is not healthy.

The onset is where the trouble first touched the run: the first step of the excursion, or the
earliest step of an unbroken run of precursors leading into the peak (the grad norm departing
from the run's own trend, the loss elevated, the loss scale falling or steps skipped).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import pandas as pd

from spikeops.thresholds import (
    ABSURD_LOSS,
    JUMP_FACTOR,
    JUMP_MIN_HISTORY,
    JUMP_QUANTILE,
    JUMP_WINDOW,
    ROUTINE_CEILING,
    ROUTINE_MARGIN,
    ROUTINE_MEMORY,
    CLIMB_REL,
    CLIMB_RISES,
    MIN_HISTORY,
    MIN_POINTS,
    RATIO_SHORT,
    STALL_FACTOR,
    STALL_MIN_S,
    REL_SPIKE,
    SHORT_HISTORY,
    WINDOW,
    Z_SPIKE,
    stall_threshold,
)

__all__ = ["SymptomResult", "StallRule", "classify", "stall", "throughput_drop", "departures", "routine_jumps",
           "Z_SPIKE", "REL_SPIKE", "MIN_HISTORY", "SHORT_HISTORY", "WINDOW"]



@dataclass
class SymptomResult:
    symptom: str
    spike_step: int | None = None
    onset_step: int | None = None
    #: The pre-spike running loss level (for summaries and the numeric rules).
    level: float | None = None
    #: Precursor kind -> first step of its run into the spike ("grad_norm", "loss", "loss_scale").
    precursors: dict[str, int] = field(default_factory=dict)
    recovered: bool | None = None
    #: Relative throughput change, last steps vs the run before them (-0.4 = 40 % slower).
    throughput_change: float | None = None
    notes: list[str] = field(default_factory=list)
    #: Logged loss values the symptom was judged on (finite or not).
    points: int = 0
    #: Why the symptom is ``unknown``: what could not be read (empty otherwise).
    unread: list[str] = field(default_factory=list)
    #: The first step of the excursion that peaks at ``spike_step`` (the first anomalous step).
    excursion_start: int | None = None
    #: Which rule made the spike anomalous: "z", "ratio", "climb", "absurd", "nan", "zero".
    rule: str | None = None
    #: For ``stalled``: seconds without a new step when the incident opened, and the run's
    #: typical seconds per step before it.
    silent_seconds: float | None = None
    step_seconds: float | None = None


@dataclass(frozen=True)
class StallRule:
    """When silence is a stall (``spikeops.thresholds.stall_threshold``)."""

    factor: float = STALL_FACTOR
    minimum: float = STALL_MIN_S


#: Logged points whose spacing gives the typical step time.
STALL_HISTORY = 50


def stall(frame: pd.DataFrame, now: object, rule: StallRule | None = None, *,
          since: object = None) -> tuple[int, float, float, float] | None:
    """``(last step, seconds silent, seconds per step, threshold)`` when the step counter
    stopped long enough before ``now`` (the end of the incident's window), else None. The
    last logged row must carry a time, at or after ``since`` (the window's start: the stall
    began in the window), and two timed rows are needed to know the step time."""
    if now is None or frame is None or len(frame) < 2 or "time" not in frame:
        return None
    times = frame["time"]
    if pd.isna(times.iloc[-1]):
        return None
    if since is not None and times.iloc[-1] < pd.Timestamp(since):
        return None
    timed = times.dropna().tail(STALL_HISTORY + 1)
    if len(timed) < 2:
        return None
    seconds = np.diff((timed - timed.iloc[0]).dt.total_seconds().to_numpy())  # whatever the time unit
    steps = np.diff(timed.index.to_numpy().astype(float))
    good = (seconds > 0) & (steps > 0)
    if not good.any():
        return None
    per_step = float(np.median(seconds[good] / steps[good]))
    per_line = float(np.median(seconds[good]))
    rule = rule or StallRule()
    threshold = stall_threshold(per_step, per_line, factor=rule.factor, minimum=rule.minimum)
    silent = (pd.Timestamp(now) - times.iloc[-1]).total_seconds()
    if silent <= threshold:
        return None
    return int(frame.index[-1]), float(silent), per_step, threshold


def _noise(values: pd.Series, window: int) -> pd.Series:
    """Per-step noise scale from the trailing median |first difference| (trend-robust)."""
    diffs = values.diff().abs()
    return 1.4826 * diffs.rolling(window, min_periods=1).median().shift(1) / math.sqrt(2)


def _level(values: pd.Series, window: int) -> pd.Series:
    return values.rolling(window, min_periods=MIN_HISTORY).median().shift(1)


def _z(values: pd.Series, window: int = WINDOW) -> tuple[pd.Series, pd.Series, pd.Series]:
    level = _level(values, window)
    noise = _noise(values, window)
    history = values.notna().astype(float).rolling(window, min_periods=1).sum().shift(1)
    floor = (level.abs() * np.where(history < SHORT_HISTORY, 1e-2, 1e-4)).clip(lower=1e-12)
    scale = np.maximum(noise.fillna(0.0), floor)
    return (values - level) / scale, level, scale


def _walk_back(flags: pd.Series, start_pos: int) -> int | None:
    """Position of the earliest True in the unbroken run ending at ``start_pos``."""
    array = flags.to_numpy()
    position = start_pos
    if position < 0 or not array[position]:
        return None
    while position > 0 and array[position - 1]:
        position -= 1
    return position


#: Logged points before the spike over which a precursor's departure is judged, and the
#: trailing points its baseline trend is fitted to.
DEPARTURE_LOOKBACK = 200
DEPARTURE_WINDOW = 20
#: A value departs from its trend when it is this factor above it (and 3 noise units)...
DEPARTURE_FACTOR = 1.3
#: ...and a run of departures this long becomes the new normal (a level shift, not a precursor).
DEPARTURE_MAX_RUN = 25


def _trend(xs: np.ndarray, ys: np.ndarray) -> tuple[float, float, float]:
    """Theil-Sen line through (xs, ys) and the robust spread of its residuals: a few odd
    points do not bend it, and it follows a steady rise (warmup) that a median would not."""
    i, j = np.triu_indices(len(xs), k=1)
    dx = xs[j] - xs[i]
    keep = dx != 0
    slope = float(np.median((ys[j] - ys[i])[keep] / dx[keep])) if keep.any() else 0.0
    intercept = float(np.median(ys - slope * xs))
    spread = 1.4826 * float(np.median(np.abs(ys - (intercept + slope * xs))))
    return slope, intercept, spread


def departures(values: pd.Series, bad: pd.Series | None = None, *, end: int | None = None) -> np.ndarray:
    """Which logged points depart upward from the run's own trend (log scale), up to ``end``.

    Walks forward keeping a baseline of the points that did not depart (departing points
    never pull the baseline up), fits the baseline's recent trend, and flags a point that is
    DEPARTURE_FACTOR above both the trend and the recent median, by 3 noise units. Early
    training's steady grad-norm rise is the trend itself, not a departure; a grad norm that
    doubles step after step is. With fewer than five baseline points the recent median and
    RATIO_SHORT stand in for the trend. A non-finite value departs."""
    array = values.to_numpy(dtype=float)
    broken = bad.to_numpy(dtype=bool) if bad is not None else np.zeros(len(array), dtype=bool)
    stop = len(array) if end is None else max(0, min(end, len(array)))
    start = max(0, stop - DEPARTURE_LOOKBACK)
    flags = np.zeros(len(array), dtype=bool)
    xs: list[float] = []
    ys: list[float] = []
    for position in range(max(0, start - DEPARTURE_WINDOW), start):
        value = array[position]
        if math.isfinite(value) and value > 0:
            xs.append(float(position))
            ys.append(math.log(value))
    run = 0
    for position in range(start, stop):
        value = array[position]
        if broken[position]:
            flags[position] = True
            run += 1
            continue
        if not math.isfinite(value) or value <= 0:
            continue
        y = math.log(value)
        recent = ys[-DEPARTURE_WINDOW:]
        if recent:
            median = float(np.median(recent[-5:]))
            if len(recent) >= SHORT_HISTORY:
                slope, intercept, spread = _trend(np.asarray(xs[-DEPARTURE_WINDOW:]), np.asarray(recent))
                expected = max(intercept + slope * position, median)
                threshold = max(math.log(DEPARTURE_FACTOR), 3 * spread)
            else:
                expected, threshold = median, math.log(RATIO_SHORT)
            if y - expected > threshold and run < DEPARTURE_MAX_RUN:
                flags[position] = True
                run += 1
                continue
        run = 0
        xs.append(float(position))
        ys.append(y)
        if len(xs) > 4 * DEPARTURE_WINDOW:
            del xs[:-DEPARTURE_WINDOW], ys[:-DEPARTURE_WINDOW]
    return flags


def _precursors(frame: pd.DataFrame, spike_pos: int) -> dict[str, int]:
    """Runs of precursor signals ending right before (or at) the spike."""
    found: dict[str, int] = {}
    steps = frame.index
    grad = frame["grad_norm"]
    if grad.notna().sum() + int(frame["grad_bad"].sum()) >= 2:
        elevated = pd.Series(departures(grad, frame["grad_bad"], end=spike_pos), index=frame.index)
        position = _walk_back(elevated, spike_pos - 1)
        if position is not None:
            found["grad_norm"] = int(steps[position])
    loss = frame["loss"]
    z, level, _ = _z(loss)
    elevated = ((z > 3) & ((loss - level) > 0.02 * level.abs())).fillna(False)
    position = _walk_back(elevated, spike_pos - 1)
    if position is not None:
        found["loss"] = int(steps[position])
    scale = frame["loss_scale"]
    if scale.notna().sum() >= 2 and scale.nunique() > 1:
        falling = ((scale < scale.shift(1)) | frame["skipped"]).fillna(False)
        position = _walk_back(falling, spike_pos)
        if position is not None and position < spike_pos:
            found["loss_scale"] = int(steps[position])
    return found


def throughput_drop(frame: pd.DataFrame, tail: int = 1000) -> tuple[int, float] | None:
    """(first step, relative drop) of a sustained throughput drop at the end of the run.

    One change point over the last ``tail`` steps, by the largest two-sample t statistic of
    the mean before and after (cumulative sums: linear time); kept only when the level after
    is >= 10 % lower and the statistic is far beyond noise. A slow node (thermal throttling,
    congestion) slows every rank from the step it started."""
    values = frame["throughput"].dropna()
    if len(values) < 40:
        return None
    values = values.iloc[-tail:]
    data = values.to_numpy(dtype=float)
    n = len(data)
    cumulative = np.cumsum(data)
    squares = np.cumsum(data * data)
    positions = np.arange(10, n - 5)
    if len(positions) == 0:
        return None
    before_n = positions.astype(float)
    after_n = n - before_n
    before_mean = cumulative[positions - 1] / before_n
    after_mean = (cumulative[-1] - cumulative[positions - 1]) / after_n
    total_var = (squares[-1] - cumulative[-1] ** 2 / n) / max(1, n - 2)
    noise = math.sqrt(max(total_var, 1e-12))
    diffs = np.abs(np.diff(data))
    noise = min(noise, 1.4826 * float(np.median(diffs)) / math.sqrt(2) or noise)
    t_stat = (before_mean - after_mean) / (max(noise, 1e-12) * np.sqrt(1 / before_n + 1 / after_n))
    best = int(np.argmax(t_stat))
    position = int(positions[best])
    drop = 1.0 - after_mean[best] / before_mean[best] if before_mean[best] else 0.0
    if drop < 0.10 or t_stat[best] < 8:
        return None
    return int(values.index[position]), float(drop)


def _throughput_change(frame: pd.DataFrame) -> float | None:
    values = frame["throughput"].dropna()
    if len(values) < 20:
        return None
    tail = max(3, min(20, len(values) // 10))
    before = values.iloc[:-tail].tail(200).median()
    after = values.iloc[-tail:].median()
    if not before or not math.isfinite(before):
        return None
    return float(after / before - 1.0)


def _first_bad(frame: pd.DataFrame, focus: np.ndarray) -> int | None:
    """First non-finite loss in focus that stays non-finite: the instant-NaN step."""
    bad = frame["loss_bad"].to_numpy() & focus
    if not bad.any():
        return None
    position = int(np.argmax(bad))
    after_bad = frame["loss_bad"].to_numpy()[position:] | frame["loss"].isna().to_numpy()[position:]
    return position if after_bad.mean() >= 0.8 else None


def _sustained_bad_grad(frame: pd.DataFrame, focus: np.ndarray) -> int | None:
    """A grad norm gone non-finite for good (not fp16 overflow steps, which are skipped).

    On a long tail, 90 % of what follows must be non-finite too; on the last one or two logged
    points (an excerpt that ends there: class 9's "NaN carried only by the grad norm on a
    single line") all of it, and only without an fp16 loss scale in the log, whose overflow
    steps print an inf grad norm in healthy training."""
    bad = (frame["grad_bad"].to_numpy() & ~frame["skipped"].to_numpy()) & focus
    if not bad.any():
        return None
    position = int(np.argmax(bad))
    rest = frame["grad_bad"].to_numpy()[position:] | frame["grad_norm"].isna().to_numpy()[position:]
    if len(rest) >= 3:
        return position if rest.mean() >= 0.9 else None
    scale = frame["loss_scale"].dropna()
    fp16 = bool((scale > 1).any() or scale.nunique() > 1)  # bf16 runs print a constant 1.0
    return position if rest.all() and not fp16 else None


def _zero_loss(frame: pd.DataFrame, focus: np.ndarray) -> int | None:
    """A loss stuck at exactly 0.0 after non-zero values: what NaN-guarded code prints
    (a fused kernel's masked NaN, all labels ignored). Exact zeros to the end of the log."""
    loss = frame["loss"].to_numpy()
    zero = (loss == 0.0) & focus
    if not zero.any():
        return None
    position = int(np.argmax(zero))
    before = loss[:position]
    before = before[~np.isnan(before)]
    after = loss[position:]
    after = after[~np.isnan(after)]
    # A jump to zero from a real loss, not a fine-tune whose tiny loss rounds to 0.0 at last.
    if not len(before) or before[-1] < 0.01 or len(after) < 2 or (after != 0.0).any():
        return None
    return position


def _creeping(loss: pd.Series) -> tuple[bool, int | None, str]:
    finite = loss.dropna()
    n = len(finite)
    if n < 30:
        return False, None, "too few steps to judge a trend"
    window = max(10, min(100, n // 10))
    rolling = finite.rolling(window, min_periods=window).median()
    if rolling.notna().sum() < 3:
        return False, None, "too few steps to judge a trend"
    low_pos = int(np.nanargmin(rolling.to_numpy()))
    low = float(rolling.iloc[low_pos])
    rise = float(rolling.iloc[-1]) - low
    sigma = 1.4826 * float(finite.diff().abs().median()) / math.sqrt(2)
    margin = max(5 * 1.2533 * sigma / math.sqrt(window), 0.02 * abs(low))
    after = finite.iloc[max(0, low_pos - window // 2):]
    if rise <= margin or len(after) < 2 * window:
        return False, None, ""
    order = pd.Series(np.arange(len(after)), dtype=float)
    corr = float(pd.Series(after.to_numpy()).rank().corr(order.rank()))
    if not corr > 0.3:
        return False, None, ""
    # The trend turned where the rolling median left its minimum for good.
    threshold = low + margin / 2
    above = rolling.to_numpy() > threshold
    start = low_pos
    while start < len(above) and not above[start]:
        start += 1
    onset_pos = max(0, start - window // 2)
    return True, int(finite.index[onset_pos]), f"rolling median rose {rise:.4g} ({rise / abs(low):.1%}) since step {finite.index[low_pos]}"


def _climbs(loss: pd.Series) -> np.ndarray:
    """Points inside a climb: CLIMB_RISES consecutive rises between logged points adding up
    to CLIMB_REL, flagged from the first point 10 % above where the climb began (a loss that
    climbs 60 % over five logged intervals has no single jump for the other rules)."""
    values = loss.to_numpy(dtype=float)
    flags = np.zeros(len(values), dtype=bool)
    begin = 0
    for position in range(1, len(values)):
        if not (values[position] > values[position - 1]):
            begin = position
            continue
        base = values[begin]
        if position - begin >= CLIMB_RISES and base > 0 and values[position] >= (1 + CLIMB_REL) * base:
            first = next(p for p in range(begin + 1, position + 1) if values[p] >= (1 + REL_SPIKE) * base)
            flags[first:position + 1] = True
    return flags


def routine_jumps(loss: pd.Series, level: pd.Series, flagged: np.ndarray) -> np.ndarray:
    """Which flagged points are one-step excursions the run makes routinely: the next logged
    point is back (not flagged), and either the excursion is within JUMP_FACTOR times the
    JUMP_QUANTILE of the run's own step-to-step changes over the JUMP_WINDOW points before it,
    or the run made a comparable one (ROUTINE_MARGIN) that came back within ROUTINE_MEMORY
    points before it; never a loss that doubles (ROUTINE_CEILING). Judged on the run's own
    texture, not its median noise: a per-step log of a healthy run jumps 20-80 % now and then
    (a hard batch) and comes straight back."""
    out = np.zeros(len(loss), dtype=bool)
    finite = np.flatnonzero(loss.notna().to_numpy())
    if len(finite) < 3 or not flagged[finite].any():
        return out
    values = loss.to_numpy(dtype=float)[finite]
    levels = level.to_numpy(dtype=float)[finite]
    flags = flagged[finite]
    changes = np.abs(np.diff(values))
    past: list[tuple[int, float]] = []
    for i in np.flatnonzero(flags):
        base = levels[i]
        if not math.isfinite(base) or base == 0 or i + 1 >= len(values) or flags[i + 1]:
            continue  # the last point, or one that stays up: not a one-step jump
        size = (values[i] - base) / abs(base)
        if values[i] >= ROUTINE_CEILING * base:
            past.append((i, size))
            continue  # a loss that doubles in one step is never a run's texture
        window = changes[max(0, i - 1 - JUMP_WINDOW): max(0, i - 1)]
        within_texture = len(window) >= JUMP_MIN_HISTORY and \
            values[i] - base < JUMP_FACTOR * float(np.quantile(window, JUMP_QUANTILE))
        made_before = any(earlier >= size / ROUTINE_MARGIN for at, earlier in past if i - at <= ROUTINE_MEMORY)
        past.append((i, size))
        if within_texture or made_before:
            out[finite[i]] = True
    return out


def _anomalies(frame: pd.DataFrame) -> tuple[pd.Series, pd.Series, pd.Series, pd.Series]:
    """(anomalous, rule, level, scale) per logged step.

    Four ways to be anomalous: far above the running level in noise units and by 10 % (the
    long-history rule); RATIO_SHORT times the level while the history is short (sparse
    logs and excerpts: the second logged point onwards); inside a climb; or absurd (a loss of
    ABSURD_LOSS or more, an infinite perplexity). A non-finite loss that does not last is the
    tallest possible spike."""
    loss = frame["loss"]
    z, level, scale = _z(loss)
    history = loss.notna().astype(int).cumsum().shift(1).fillna(0)
    previous = loss.ffill().shift(1)
    base = level.where(level.notna(), previous)
    # One point of history has no level and no noise yet: the point before, floored at 1 %.
    scale = scale.where(np.isfinite(scale), (base.abs() * 1e-2).clip(lower=1e-12))
    relative = (loss - base) / base.abs()
    by_z = (z > Z_SPIKE) & (relative > REL_SPIKE) & level.notna()
    by_z = by_z & ~routine_jumps(loss, level, by_z.fillna(False).to_numpy(dtype=bool))
    # From two points of history there is a first noise estimate: the jump must also clear it
    # (a noisy fine-tuning loss swings by half between log lines).
    noisy = (history >= 2) & ((loss - base) <= 3 * scale)
    by_ratio = (history >= 1) & (history < SHORT_HISTORY) & (base > 0) & (loss >= RATIO_SHORT * base) & ~noisy
    by_climb = pd.Series(_climbs(loss.dropna()), index=loss.dropna().index).reindex(loss.index, fill_value=False)
    absurd = loss >= ABSURD_LOSS
    if "perplexity_bad" in frame:
        absurd = absurd | frame["perplexity_bad"].fillna(False).astype(bool)
    rule = pd.Series(None, index=loss.index, dtype=object)
    for name, flags in (("climb", by_climb), ("ratio", by_ratio), ("z", by_z), ("absurd", absurd),
                        ("nan", frame["loss_bad"])):
        rule = rule.where(~flags.fillna(False).astype(bool), name)
    anomalous = (by_z | by_ratio | by_climb | absurd).fillna(False) | frame["loss_bad"]
    return anomalous.astype(bool), rule, base, scale


#: Anomalous points this close (non-anomalous logged points between) are one excursion.
EXCURSION_GAP = 2
#: Logged points of an excursion searched for its peak (a plateau that stays up is not
#: searched to its end: its spike is where it jumped).
PEAK_SEARCH = 10


def _excursion(frame: pd.DataFrame, anomalous: np.ndarray, first: int, scale: float) -> tuple[int, int]:
    """(peak, last) positions of the excursion that starts at ``first``: the anomalous points
    that follow with at most EXCURSION_GAP quiet points between. The peak moves forward only
    to a point materially higher (10 % and 3 noise units) than the peak so far, within the
    first PEAK_SEARCH points: the peak of a climb, not a plateau's noise."""
    last = first
    position = first + 1
    while position < len(anomalous) and position - last <= EXCURSION_GAP + 1:
        if anomalous[position]:
            last = position
        position += 1
    loss = frame["loss"].to_numpy(dtype=float)
    bad = frame["loss_bad"].to_numpy()
    peak = first
    if bad[first]:
        return peak, last
    for position in range(first + 1, min(last, first + PEAK_SEARCH) + 1):
        value, top = loss[position], loss[peak]
        if bad[position]:
            break
        if math.isfinite(value) and value > top * (1 + REL_SPIKE) and value - top > 3 * scale:
            peak = position
    return peak, last


#: A run whose first logged step is at most this started from scratch: its first logged
#: points are start-up (the fp16 scale still calibrating, the optimizer's first moments).
STARTUP_STEPS = 100


def _judge(frame: pd.DataFrame, first: int, rules: pd.Series, level: pd.Series, scale: pd.Series,
           anomalous: np.ndarray) -> SymptomResult:
    """The symptom of the excursion that starts at position ``first``: its peak is the spike;
    the last points after it, against the level before it, say whether it recovered."""
    steps = frame.index.to_numpy()
    loss = frame["loss"]
    peak, _ = _excursion(frame, anomalous, first, float(scale.iloc[first]))
    result = SymptomResult("none", spike_step=int(steps[peak]), excursion_start=int(steps[first]), rule=rules.iloc[first])
    base = level.iloc[first]
    if not math.isfinite(base):
        base = float(loss.iloc[:first].dropna().tail(WINDOW).median()) if first else math.nan
    result.level = float(base) if math.isfinite(base) else None
    post = frame.iloc[peak + 1:]
    post_loss = post["loss"].where(~post["loss_bad"])
    if result.level is None and bool(frame["loss_bad"].iloc[first]) and len(post) \
            and not bool(post["loss_bad"].iloc[-1]) and math.isfinite(float(post["loss"].iloc[-1])):
        # Non-finite from the first logged point, finite after it: the NaN did not last (the
        # spec's instant NaN stays), the tallest spike there is, and it is over.
        result.recovered = True
        result.symptom = "single_spike"
        result.notes.append("non-finite at the start of the log and finite after it: the NaN did not last")
    elif result.level is None:
        # Anomalous from the first logged point (an absurd loss): no level to come back to.
        result.recovered = False
        result.symptom = "spike_no_recovery"
        result.notes.append("anomalous from the first logged point: the trouble began before the log")
    elif len(post) == 0 or post_loss.notna().sum() == 0:
        result.recovered = None
        climbing = peak > first
        result.symptom = "single_spike" if len(post) == 0 and not climbing else "spike_no_recovery"
        if len(post) == 0 and not climbing:
            result.notes.append("the spike is the last logged step: recovery not yet observable")
        elif len(post) == 0:
            result.notes.append("the loss climbed to the last logged step")
    else:
        after = post_loss.dropna()
        tail = after.tail(max(3, min(10, len(after) // 3)))
        tolerance = max(4 * float(scale.iloc[first]), 0.05 * abs(result.level))
        bad_tail = bool(post["loss_bad"].tail(10).any())
        result.recovered = bool(tail.median() <= result.level + tolerance) and not bad_tail
        result.symptom = "single_spike" if result.recovered else "spike_no_recovery"
    result.precursors = _precursors(frame, peak)
    result.onset_step = min([result.excursion_start, result.spike_step, *result.precursors.values()])
    return result


def _stalled(result: SymptomResult, frame: pd.DataFrame, now: object, since: object,
             rule: StallRule | None) -> bool:
    found = stall(frame, now, rule, since=since)
    if found is None:
        return False
    last, silent, per_step, threshold = found
    result.symptom = "stalled"
    # The last step logged: the trouble may already have touched it (a checkpoint being
    # written at it when a rank hung), so a resume starts from a verified one before it.
    result.spike_step = result.onset_step = result.excursion_start = last
    result.silent_seconds, result.step_seconds = silent, per_step
    result.unread = []
    finite = frame["loss"].dropna()
    result.level = float(finite.tail(WINDOW).median()) if len(finite) else None
    result.notes.insert(0, f"no step after {last} for {silent:,.0f} s (a step took {per_step:.3g} s; stalled "
                           f"beyond {threshold:,.0f} s)")
    return True


def classify(frame: pd.DataFrame, focus_from: int | None = None, *, now: object = None, since: object = None,
             stall_rule: StallRule | None = None) -> SymptomResult:
    """Classify the run's symptom. ``focus_from``: the first step that may be the spike
    (the incident window's start); None means the whole run. ``now``/``since``: the end and
    start of the incident's window; a run with no loss anomaly whose step counter stopped
    in the window, long before its end, is ``stalled``."""
    if frame is None or len(frame) == 0:
        return SymptomResult("unknown", notes=["no step metrics"], unread=["no step metrics were read"])
    frame = frame.copy()
    for column in ("grad_norm", "loss_scale", "throughput"):
        if column not in frame:
            frame[column] = np.nan
    for column in ("loss_bad", "grad_bad", "skipped"):
        frame[column] = frame[column].fillna(False).astype(bool) if column in frame else False
    steps = frame.index.to_numpy()
    focus = steps >= focus_from if focus_from is not None else np.ones(len(steps), dtype=bool)
    points = int(frame["loss"].notna().sum() + frame["loss_bad"].sum())
    result = SymptomResult("none", throughput_change=_throughput_change(frame), points=points)

    nan_pos = _first_bad(frame, focus)
    rule = "nan"
    if nan_pos is None:
        nan_pos = _sustained_bad_grad(frame, focus)
    if nan_pos is None:
        nan_pos, rule = _zero_loss(frame, focus), "zero"
    if nan_pos is not None:
        result.symptom = "instant_nan"
        result.rule = rule
        result.spike_step = result.excursion_start = int(steps[nan_pos])
        result.precursors = _precursors(frame, nan_pos)
        result.onset_step = min([result.spike_step, *result.precursors.values()])
        finite = frame["loss"].iloc[:nan_pos].dropna()
        result.level = float(finite.tail(WINDOW).median()) if len(finite) else None
        if rule == "zero":
            result.notes.append("the loss is stuck at exactly 0.0: NaN-guarded code prints that")
        return result

    loss = frame["loss"]
    anomalous, rules, level, scale = _anomalies(frame)
    anomalous = (anomalous & focus).to_numpy().copy()
    from_scratch = int(steps[0]) <= STARTUP_STEPS
    while anomalous.any():
        first = int(np.argmax(anomalous))
        judged = _judge(frame, first, rules, level, scale, anomalous)
        if from_scratch and first < SHORT_HISTORY and judged.symptom == "single_spike" \
                and judged.rule not in ("nan", "absurd"):
            # The first logged steps of a run from scratch: the loss scale and the optimizer
            # are still settling, and a bump that comes back is start-up, not an incident.
            _, last = _excursion(frame, anomalous, first, float(scale.iloc[first]))
            anomalous[first:last + 1] = False
            result.notes.append(f"step {judged.spike_step}: a start-up transient (recovered), not counted")
            continue
        judged.throughput_change, judged.points = result.throughput_change, points
        judged.notes = result.notes + judged.notes
        return judged

    creeping, onset, note = _creeping(loss.where(~frame["loss_bad"]))
    if note:
        result.notes.append(note)
    if creeping:
        result.symptom = "creeping_increase"
        result.onset_step = onset
        finite = loss.dropna()
        result.level = float(finite.loc[:onset].tail(WINDOW).median()) if onset is not None else None
        return result
    if _stalled(result, frame, now, since, stall_rule):
        return result
    if points < MIN_POINTS:
        result.symptom = "unknown"
        what = "no loss value" if points == 0 else f"only {points} logged loss value{'s' if points > 1 else ''}"
        result.unread.append(f"{what} to judge ({MIN_POINTS} or more are needed to call a run healthy)")
        result.notes.insert(0, result.unread[-1])
    return result
