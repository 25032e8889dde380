"""Symptom classification: healthy curves stay quiet; each symptom's shape is recognised."""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
from hypothesis import given, settings, strategies as st

from spikeops.diagnosis.symptom import classify


def frame(loss, grad=None, lr=None, scale=None, start=1000, skipped=None) -> pd.DataFrame:
    loss = np.asarray(loss, dtype=float)
    n = len(loss)
    bad = ~np.isfinite(loss)
    data = {
        "loss": np.where(bad, np.nan, loss), "loss_bad": bad,
        "grad_norm": np.asarray(grad if grad is not None else np.full(n, 0.9), dtype=float),
        "grad_bad": np.zeros(n, dtype=bool),
        "lr": np.asarray(lr if lr is not None else np.full(n, 3e-4), dtype=float),
        "loss_scale": np.asarray(scale if scale is not None else np.full(n, np.nan), dtype=float),
        "throughput": np.full(n, 1000.0),
        "skipped": np.asarray(skipped if skipped is not None else np.zeros(n, dtype=bool)),
        "line": np.arange(1, n + 1),
    }
    return pd.DataFrame(data, index=np.arange(start, start + n))


def healthy(rng: np.random.Generator, n: int, noise: float, warmup: int, decay: float, lr_drop: bool) -> np.ndarray:
    t = np.arange(n)
    curve = 2.0 + 6.0 * np.exp(-t / decay)
    curve[:warmup] += np.linspace(3.0, 0.0, warmup) if warmup else 0
    if lr_drop:
        curve[n // 2:] -= 0.05  # an LR step-down lowers the loss a notch
    return curve * (1 + rng.normal(0, noise, n))


@settings(max_examples=120, deadline=None)
@given(seed=st.integers(0, 10_000), n=st.integers(60, 1500), noise=st.floats(0.0, 0.03),
       warmup=st.integers(0, 50), decay=st.floats(50, 5000), lr_drop=st.booleans())
def test_healthy_curves_are_not_anomalies(seed, n, noise, warmup, decay, lr_drop):
    rng = np.random.default_rng(seed)
    result = classify(frame(healthy(rng, n, noise, warmup, decay, lr_drop)))
    assert result.symptom == "none", (result, seed)
    assert result.spike_step is None


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 10_000), height=st.floats(1.3, 5.0), at=st.integers(100, 350))
def test_single_spike_then_recovery(seed, height, at):
    rng = np.random.default_rng(seed)
    loss = healthy(rng, 400, 0.01, 10, 300, False)
    loss[at] *= height
    result = classify(frame(loss))
    assert result.symptom == "single_spike"
    assert result.spike_step == 1000 + at


def test_spike_without_recovery_and_instant_nan():
    rng = np.random.default_rng(1)
    loss = healthy(rng, 300, 0.01, 10, 200, False)
    stuck = loss.copy()
    stuck[200:] *= 2.2
    result = classify(frame(stuck))
    assert (result.symptom, result.spike_step) == ("spike_no_recovery", 1200)
    nan = loss.copy()
    nan[250:] = math.nan
    result = classify(frame(nan))
    assert (result.symptom, result.spike_step) == ("instant_nan", 1250)


def test_isolated_nan_step_that_recovers_is_a_single_spike():
    rng = np.random.default_rng(2)
    loss = healthy(rng, 300, 0.01, 10, 200, False)
    loss[220] = math.nan
    result = classify(frame(loss))
    assert (result.symptom, result.spike_step) == ("single_spike", 1220)


def test_grad_norm_climb_sets_the_onset_before_the_spike():
    rng = np.random.default_rng(3)
    loss = healthy(rng, 300, 0.01, 10, 200, False)
    grad = 0.9 * (1 + rng.normal(0, 0.05, 300))
    for offset, factor in enumerate([2, 4, 8, 16, 32, 64]):
        grad[244 + offset] = 0.9 * factor
    loss[250:] *= 3
    result = classify(frame(loss, grad=grad))
    assert result.spike_step == 1250
    assert result.precursors["grad_norm"] == 1244
    assert result.onset_step == 1244


def test_creeping_increase_after_a_resume():
    rng = np.random.default_rng(4)
    n = 800
    loss = healthy(rng, n, 0.01, 0, 60, False)  # settled by step 400
    loss[400:] += np.linspace(0, 0.4, n - 400)
    result = classify(frame(loss))
    assert result.symptom == "creeping_increase"
    assert 1300 <= result.onset_step <= 1480


def test_spike_outside_the_focus_is_history():
    rng = np.random.default_rng(5)
    loss = healthy(rng, 400, 0.01, 10, 300, False)
    loss[100] *= 3
    assert classify(frame(loss)).spike_step == 1100
    assert classify(frame(loss), focus_from=1300).symptom == "none"


def test_restart_relogged_steps_are_handled_upstream():
    from spikeops.diagnosis.evidence.metrics import _later_run_wins

    steps = np.array([1, 2, 3, 4, 5, 3, 4, 5, 6])
    assert _later_run_wins(steps).tolist() == [True, True, False, False, False, True, True, True, True]


# --------------------------------------------------------------------------- stalled


def _timed(n: int, step_s: float, end: pd.Timestamp) -> pd.DataFrame:
    data = frame(2.0 + 0.01 * np.sin(np.arange(n)))
    data["time"] = pd.to_datetime([end - pd.Timedelta(seconds=step_s * (n - 1 - i)) for i in range(n)], utc=True)
    return data


def test_a_step_counter_that_stopped_is_stalled_only_past_the_rule_and_inside_the_window():
    last = pd.Timestamp("2026-11-29T12:00:00Z")
    data = _timed(100, 6.0, last)
    window_start = last - pd.Timedelta(minutes=30)
    quiet = classify(data, now=last + pd.Timedelta(seconds=305), since=window_start)
    assert quiet.symptom == "none"  # 300 s minimum + one 6 s record interval not yet passed
    hung = classify(data, now=last + pd.Timedelta(seconds=1800), since=window_start)
    assert hung.symptom == "stalled" and hung.spike_step == hung.onset_step == int(data.index[-1])
    assert hung.silent_seconds == 1800.0 and hung.step_seconds == 6.0 and "no step after" in hung.notes[0]
    # the window says when the incident is: a bundle made long after a run, or one whose
    # window ends before the last step, or one without a window, is no stall
    assert classify(data, now=last + pd.Timedelta(days=400), since=last + pd.Timedelta(days=399)).symptom == "none"
    assert classify(data, now=last - pd.Timedelta(minutes=5), since=window_start).symptom == "none"
    assert classify(data).symptom == "none"


def test_a_loss_anomaly_before_the_silence_is_what_it_is_not_a_stall():
    last = pd.Timestamp("2026-11-29T12:00:00Z")
    data = _timed(100, 6.0, last)
    data.loc[data.index[-1], ["loss", "loss_bad"]] = [np.nan, True]
    assert classify(data, now=last + pd.Timedelta(hours=1), since=last - pd.Timedelta(hours=1)).symptom == "instant_nan"


def test_slow_steps_and_sparse_logging_raise_the_stall_threshold():
    from spikeops.diagnosis.symptom import StallRule

    last = pd.Timestamp("2026-11-29T12:00:00Z")
    data = _timed(50, 1000.0, last)  # a line every 100 steps of 10 s
    data.index = np.arange(0, 5000, 100)
    since = last - pd.Timedelta(hours=3)
    # max(10 x 10 s, 300 s) + the 1,000 s between two lines
    assert classify(data, now=last + pd.Timedelta(seconds=1299), since=since).symptom == "none"
    assert classify(data, now=last + pd.Timedelta(seconds=1301), since=since).symptom == "stalled"
    short = StallRule(factor=3, minimum=5)
    fast = _timed(30, 0.1, last)
    assert classify(fast, now=last + pd.Timedelta(seconds=5.05), since=since, stall_rule=short).symptom == "none"
    assert classify(fast, now=last + pd.Timedelta(seconds=5.2), since=since, stall_rule=short).symptom == "stalled"
