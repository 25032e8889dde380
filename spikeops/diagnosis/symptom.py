"""Symptom classification from the step metrics, with robust statistics.

The question is the seed's first one: which kind of divergence is this? The answer decides
the protective move (stop at once for NaN, observe for a single spike), so it must not be
fooled by what healthy training looks like: noise, warmup, a decaying loss, an LR step, an
fp16 loss scale that breathes. Hence:

- the running level is a trailing rolling **median** (a spike does not drag it up), and the
  noise scale comes from the median absolute *first difference*, which a trend or a slow
  decay does not inflate (unlike a MAD around a moving level);
- a step is anomalous only when it is far above the level in noise units (z > 6) **and** by
  a material fraction of the level (> 10 %), after at least five steps of history;
- only steps in the incident window can be the spike (a long run has old, recovered
  wobbles); precursors may start before it;
- recovery compares the last steps after the spike with the pre-spike level;
- a creeping increase is a sustained rise of the rolling median above its minimum, gradual
  (no anomalous step) and monotone enough (rank correlation with the step).

The onset is where the trouble first touched the run: the earliest step of an unbroken run
of precursors leading into the spike (grad norm elevated, loss elevated, loss scale falling
or steps skipped), else the spike itself.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import pandas as pd

from spikeops.thresholds import MIN_HISTORY, REL_SPIKE, SHORT_HISTORY, WINDOW, Z_SPIKE

__all__ = ["SymptomResult", "classify", "throughput_drop", "Z_SPIKE", "REL_SPIKE", "MIN_HISTORY", "SHORT_HISTORY", "WINDOW"]



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


def _precursors(frame: pd.DataFrame, spike_pos: int) -> dict[str, int]:
    """Runs of precursor signals ending right before (or at) the spike."""
    found: dict[str, int] = {}
    steps = frame.index
    grad = frame["grad_norm"]
    if grad.notna().sum() >= MIN_HISTORY:
        z, level, _ = _z(grad)
        elevated = ((grad > 1.3 * level) & (z > 3)) | frame["grad_bad"]
        position = _walk_back(elevated.fillna(False), spike_pos - 1)
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
    """A grad norm gone non-finite for good (not fp16 overflow steps, which are skipped)."""
    bad = (frame["grad_bad"].to_numpy() & ~frame["skipped"].to_numpy()) & focus
    if not bad.any():
        return None
    position = int(np.argmax(bad))
    rest = frame["grad_bad"].to_numpy()[position:] | frame["grad_norm"].isna().to_numpy()[position:]
    return position if len(rest) >= 3 and rest.mean() >= 0.9 else None


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


def classify(frame: pd.DataFrame, focus_from: int | None = None) -> SymptomResult:
    """Classify the run's symptom. ``focus_from``: the first step that may be the spike
    (the incident window's start); None means the whole run."""
    if frame is None or len(frame) == 0:
        return SymptomResult("none", notes=["no step metrics"])
    frame = frame.copy()
    for column in ("grad_norm", "loss_scale", "throughput"):
        if column not in frame:
            frame[column] = np.nan
    for column in ("loss_bad", "grad_bad", "skipped"):
        frame[column] = frame[column].fillna(False).astype(bool) if column in frame else False
    steps = frame.index.to_numpy()
    focus = steps >= focus_from if focus_from is not None else np.ones(len(steps), dtype=bool)
    result = SymptomResult("none", throughput_change=_throughput_change(frame))

    nan_pos = _first_bad(frame, focus)
    if nan_pos is None:
        nan_pos = _sustained_bad_grad(frame, focus)
    if nan_pos is not None:
        result.symptom = "instant_nan"
        result.spike_step = int(steps[nan_pos])
        result.precursors = _precursors(frame, nan_pos)
        result.onset_step = min([result.spike_step, *result.precursors.values()])
        finite = frame["loss"].iloc[:nan_pos].dropna()
        result.level = float(finite.tail(WINDOW).median()) if len(finite) else None
        return result

    loss = frame["loss"]
    z, level, scale = _z(loss)
    anomalous = (z > Z_SPIKE) & ((loss - level) > REL_SPIKE * level.abs()) & level.notna()
    # A non-finite loss that did not last is the tallest possible spike.
    anomalous = (anomalous.fillna(False) | frame["loss_bad"]) & focus
    if anomalous.any():
        spike_pos = int(np.argmax(anomalous.to_numpy()))
        result.spike_step = int(steps[spike_pos])
        base = level.iloc[spike_pos]
        if not math.isfinite(base):
            base = float(loss.iloc[:spike_pos].dropna().tail(WINDOW).median())
        result.level = float(base)
        post = frame.iloc[spike_pos + 1:]
        post_loss = post["loss"].where(~post["loss_bad"])
        if len(post) == 0 or post_loss.notna().sum() == 0:
            result.recovered = None
            result.symptom = "single_spike" if len(post) == 0 else "spike_no_recovery"
            if len(post) == 0:
                result.notes.append("the spike is the last logged step: recovery not yet observable")
        else:
            after = post_loss.dropna()
            tail = after.tail(max(3, min(10, len(after) // 3)))
            tolerance = max(4 * float(scale.iloc[spike_pos]), 0.05 * abs(result.level))
            bad_tail = bool(post["loss_bad"].tail(10).any())
            result.recovered = bool(tail.median() <= result.level + tolerance) and not bad_tail
            result.symptom = "single_spike" if result.recovered else "spike_no_recovery"
        result.precursors = _precursors(frame, spike_pos)
        result.onset_step = min([result.spike_step, *result.precursors.values()])
        return result

    creeping, onset, note = _creeping(loss.where(~frame["loss_bad"]))
    if note:
        result.notes.append(note)
    if creeping:
        result.symptom = "creeping_increase"
        result.onset_step = onset
        finite = loss.dropna()
        result.level = float(finite.loc[:onset].tail(WINDOW).median()) if onset is not None else None
    return result
