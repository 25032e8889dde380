"""Online anomaly detection on a job's step metrics: one record in, at most one incident out.

``spikeops.diagnosis.symptom`` classifies a *finished* window with robust statistics; this is
its streaming counterpart, with the same reasoning and constants, in O(window) per step:

- the running level is the median of the last ``window`` finite values (a spike does not drag
  it up) and the noise scale is 1.4826 x the median |first difference| / sqrt(2), which a
  falling loss or a decaying LR does not inflate; a step is a **spike** when it is more than
  ``z`` noise units above the level *and* more than ``rel`` x the level above it, with at
  least ``min_history`` values seen and past ``warmup_steps``;
- a **NaN** is a non-finite loss (or the job's own NaN count). A non-finite grad norm is
  not one by itself: on an fp16 run it is an overflow step, skipped, and the loss scale
  halves (how dynamic loss scaling works; a run of them is judged as a loss-scale collapse).
  It is a NaN after ``grad_nan_steps`` records in a row while the scale is *not* falling
  (no scaler is absorbing it), or at once on a step the job says it did not skip;
- a **loss-scale collapse** is the scale falling to 1/``loss_scale_factor`` of its highest
  value in the last ``loss_scale_window`` records: normal scaling halves on an overflow and
  doubles back after a quiet interval, so it breathes by a factor 2-16, never 256;
- a **stall** (``tick``, called when a poll finds nothing new) is the step counter not
  advancing for ``stall_factor`` x the typical step time, at least ``stall_min_s``, plus
  the typical interval between records (``spikeops.thresholds.stall_threshold``, the
  diagnosis's own rule); times are the records' own ``time``, else when they were read;
- a **throughput drop** is at least ``throughput_steps`` records in a row each more than
  ``throughput_drop`` x the level below the median of the ``throughput_window`` records
  before them, whose median is more than ``throughput_z`` standard errors below it (a
  checkpoint save or an eval makes one or two slow steps, a throttled GPU or a flapping link
  makes all of them).

A loss jump is judged against the run's own texture, as the diagnosis judges it
(``symptom.routine_jumps``, the constants of ``spikeops.thresholds``): a one-step jump within
``jump_factor`` times the 99th percentile of the run's step-to-step changes, or one the run
already made (a comparable excursion that came back within ``routine_memory`` records), is
**routine**: it is recorded (``recorded``), and becomes an incident only if it does not come
back within ``persist_steps`` records. While the history is short (fewer than
``min_history`` values) a jump to ``RATIO_SHORT`` (1.5x) the level is held the same way, and
one of ``order_of_magnitude`` (10x) fires at once: a watcher started late still sees a loss
that jumps and stays there.

Debounce: the first anomaly opens an incident and is returned; everything after it (a NaN
that persists, the steps of a long spike, the grad-norm jump that came with the loss spike)
belongs to it and returns None. The incident closes, and the detector re-arms, only when
the metrics have been healthy for ``quiet_steps`` records in a row, at least
``cooldown_steps`` records and ``cooldown_s`` seconds (by the records' own ``time``, when
they carry one) after it opened. So one incident starts one flow run.

Level signals re-base when they fire: after a collapse the scale's peak restarts from the
collapsed value, after a drop the throughput baseline restarts, so a run that carries on at
its new level is not an incident forever and a further fall is a new one.

Records are mappings in the ``metrics.jsonl`` shape (shared/spec/bundle.md): ``step``,
``time``, ``loss``, ``lr``, ``grad_norm``, ``loss_scale``, ``tokens``, ``throughput``, and the
optional flags ``skipped`` (the optimizer skipped the step: fp16 overflow) and ``nan`` (the
job counted a non-finite loss). Any value may be missing, a string (``"nan"``, ``"1.5"``) or
garbage; a record without a whole-number step is ignored and counted. A step equal to the
last one is a duplicate (ignored); a smaller one is a restart (a resumed job re-logs the steps
after its checkpoint) and is judged like any other.
"""

from __future__ import annotations

import bisect
import math
import statistics
import time
from collections import deque
from collections.abc import Callable
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any

from spikeops.thresholds import (
    ABSURD_LOSS,
    JUMP_FACTOR,
    JUMP_MIN_HISTORY,
    JUMP_QUANTILE,
    JUMP_WINDOW,
    ORDER_OF_MAGNITUDE,
    PERSIST_POINTS,
    RATIO_SHORT,
    REL_SPIKE,
    ROUTINE_CEILING,
    ROUTINE_MARGIN,
    ROUTINE_MEMORY,
    SHORT_HISTORY,
    STALL_FACTOR,
    STALL_MIN_S,
    WINDOW,
    Z_SPIKE,
    stall_threshold,
)
from spikeops.errors import InputError
from spikeops.probes.bundle_files import read_float
from spikeops.timeparse import from_unix, iso, parse_any

__all__ = ["WatchConfig", "Anomaly", "Detector", "KINDS", "PROMETHEUS_FIELDS"]

#: Anomaly kinds, in the order they name an incident when several start on one step.
KINDS = ("nan", "loss_scale_collapse", "loss_spike", "grad_spike", "throughput_drop", "stalled")
#: Record fields a Prometheus query may fill (``[watch.prometheus]``).
PROMETHEUS_FIELDS = ("step", "loss", "lr", "grad_norm", "loss_scale", "tokens", "throughput")


@dataclass(frozen=True)
class WatchConfig:
    """Thresholds of ``spikeops watch`` (the ``[watch]`` table of spikeops.toml).

    Defaults and why (docs/watch.md says the same at more length):

    - ``loss_z`` = 6, ``loss_rel`` = 0.10: the diagnosis' own spike test (``Z_SPIKE``,
      ``REL_SPIKE``), so the watcher pages on what the diagnosis will call a spike. Six noise
      units is beyond any Gaussian noise in a run's lifetime; 10 % of the level keeps a
      loss printed with three digits (noise scale ~0) from paging on a rounding step.
    - ``grad_z`` = 6, ``grad_rel`` = 4.0: grad norms are heavy-tailed; healthy runs bump to
      2-3.5x their running median now and then (a hard batch on top of the step's own
      noise), while an explosion is 10-1000x: a spike must be above 5x the median (and a
      robust z over 6).
    - ``window`` = 50 (``WINDOW``, as the diagnosis): long enough for a stable median, short
      enough to follow warmup and LR decay.
    - ``min_history`` = 20: values seen before a spike can be judged; the median |difference|
      of 20 is within ~30 % of the true noise, which z > 6 absorbs. A watcher started in the
      middle of a run is blind for 20 records, not wrong for them.
    - ``warmup_steps`` = 100: no spike or level test below this step number; the first steps
      of a run (LR ramp, loss falling from ln(vocab), the fp16 scale searching down from
      2^32, compilation-slow steps) are all "anomalous" and all normal. NaN is judged from
      step 0.
    - ``grad_nan_steps`` = 3: an fp16 overflow step has an inf/NaN grad norm, is skipped
      and halves the loss scale, which is normal, and bursts of two or three happen; three
      non-finite grad norms in a row with the scale not falling (bf16, or a scaler at its
      minimum) are not. A step the job marks as not skipped is a NaN at once.
    - ``loss_scale_factor`` = 256, ``loss_scale_window`` = 2000: dynamic loss scaling halves
      on an overflow and doubles after 1000-2000 clean steps (DeepSpeed, Megatron, PyTorch's
      GradScaler), so within one growth interval the scale moves by a few halvings; 2^8
      below the recent peak is repeated overflow the scaler cannot absorb (the seed's "scale
      collapsed to tiny"); the Prometheus rule in infra/monitoring uses the same factor.
    - ``throughput_drop`` = 0.10, ``throughput_z`` = 6, ``throughput_steps`` = 10,
      ``throughput_window`` = 100: the diagnosis calls a sustained drop of 10 % or more a
      drop (``symptom.throughput_drop``); a throttled GPU costs the whole job 15-40 %. Ten
      slow records in a row, against the median of the hundred before, tell it from a
      checkpoint save or an eval, which slow one or two; their median must also be beyond
      the run's own jitter (z > 6 in standard errors of a median of ten, as the diagnosis
      judges a creeping rise), so a very noisy throughput does not fire on ten unlucky steps.
    - ``persist_steps`` = 5, ``jump_factor`` = 2, ``routine_memory`` = 2000,
      ``routine_margin`` = 1.5, ``order_of_magnitude`` = 10: a run's own texture
      (``spikeops.thresholds``). On public per-step logs of healthy runs a jump of 20-45 % that
      is gone the next step comes every few hundred steps; judged against the median noise
      alone each one paged (25 false incidents per 10,000 steps, bench/README.md). A routine
      jump is recorded, and pages only if it is still up ``persist_steps`` records later (the
      observation window of a single spike); so does any jump of 1.5x seen with a short
      history, and a jump of 10x pages at once.
    - ``quiet_steps`` = 20, ``cooldown_steps`` = 200, ``cooldown_s`` = 300: an incident ends
      after 20 healthy records in a row, and no sooner than 200 records and 5 minutes after
      it began (the incident flow needs minutes to stop a job; what shows up meanwhile is the
      same trouble seen again).
    - ``poll_s`` = 15 and ``prometheus`` (field -> PromQL): the Prometheus source, polled at
      Prometheus' default scrape interval.
    - ``stall_factor`` = 10, ``stall_min_s`` = 300: no new step for 10 typical step times (and
      never less than 5 minutes, which a checkpoint save or an evaluation can take), plus one
      typical interval between records: a hung job (``spikeops.thresholds``; the diagnosis
      and the Prometheus rule judge the same way, and the alert carries these two values so
      the diagnosis judges the stall this watcher saw).
    """

    loss_z: float = Z_SPIKE
    loss_rel: float = REL_SPIKE
    grad_z: float = Z_SPIKE
    grad_rel: float = 4.0
    window: int = WINDOW
    min_history: int = 20
    warmup_steps: int = 100
    grad_nan_steps: int = 3
    loss_scale_factor: float = 256.0
    loss_scale_window: int = 2000
    throughput_drop: float = REL_SPIKE
    throughput_z: float = Z_SPIKE
    throughput_steps: int = 10
    throughput_window: int = 100
    persist_steps: int = PERSIST_POINTS
    jump_factor: float = JUMP_FACTOR
    routine_memory: int = ROUTINE_MEMORY
    routine_margin: float = ROUTINE_MARGIN
    order_of_magnitude: float = ORDER_OF_MAGNITUDE
    quiet_steps: int = 20
    cooldown_steps: int = 200
    cooldown_s: float = 300.0
    poll_s: float = 15.0
    stall_factor: float = STALL_FACTOR
    stall_min_s: float = STALL_MIN_S
    prometheus: dict[str, str] = field(default_factory=dict)

    @classmethod
    def from_table(cls, table: Mapping[str, Any] | None) -> WatchConfig:
        """The ``[watch]`` table, checked: an unknown key, a wrong type or a value out of
        range is an InputError naming it."""
        if table is None:
            return cls()
        if not isinstance(table, Mapping):
            raise InputError("[watch] must be a table")
        known = {f.name: f for f in fields(cls)}
        values: dict[str, Any] = {}
        for key, value in table.items():
            spec = known.get(key)
            if spec is None:
                raise InputError(f"[watch] unknown key {key!r} (known: {', '.join(sorted(known))})")
            if key == "prometheus":
                values[key] = _queries(value)
                continue
            default = spec.default
            if isinstance(default, int) and not isinstance(default, bool):
                if isinstance(value, bool) or not isinstance(value, int):
                    raise InputError(f"[watch] {key} must be a whole number, not {value!r}")
                if value < 1:
                    raise InputError(f"[watch] {key} must be at least 1, not {value}")
            else:
                if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
                    raise InputError(f"[watch] {key} must be a number, not {value!r}")
                if value < 0:
                    raise InputError(f"[watch] {key} must not be negative, not {value}")
                value = float(value)
            values[key] = value
        config = cls(**values)
        if config.loss_scale_factor <= 1:
            raise InputError("[watch] loss_scale_factor must be above 1")
        if not 0 < config.throughput_drop < 1:
            raise InputError("[watch] throughput_drop must be a fraction between 0 and 1")
        if config.poll_s <= 0:
            raise InputError("[watch] poll_s must be above 0")
        if config.window < 3 or config.min_history < 3:
            raise InputError("[watch] window and min_history must be at least 3")
        if config.stall_factor < 1:
            raise InputError("[watch] stall_factor must be at least 1")
        return config


def _queries(value: Any) -> dict[str, str]:
    if not isinstance(value, Mapping):
        raise InputError("[watch.prometheus] must be a table of FIELD = \"PromQL\"")
    for name, query in value.items():
        if name not in PROMETHEUS_FIELDS:
            raise InputError(f"[watch.prometheus] unknown field {name!r} (known: {', '.join(PROMETHEUS_FIELDS)})")
        if not isinstance(query, str) or not query.strip():
            raise InputError(f"[watch.prometheus] {name} must be a PromQL string")
    return dict(value)


@dataclass(frozen=True)
class Anomaly:
    """The start of one incident: what fired, where, by how much."""

    kind: str
    step: int
    value: float | None
    score: float | None
    detail: str
    time: str | None = None
    #: The thresholds a rule fired at, when the diagnosis must judge by the same (a stall's
    #: ``stall_factor`` and ``stall_min_s``); sent with the alert.
    rule: dict[str, str] | None = None


# --------------------------------------------------------------------------- values


def _number(raw: Any) -> float | None:
    """A metric value as the bundle reads it (numbers, NaN tokens, ``"nan"``/``"1.5"``
    strings); None for garbage, never an exception."""
    try:
        return read_float(raw)
    except OverflowError:  # an integer beyond float's range: garbage, as good as infinite
        return math.inf


def _step(raw: Any) -> int | None:
    if isinstance(raw, bool):
        return None
    if isinstance(raw, int):
        return raw
    value = _number(raw)
    if value is None or not math.isfinite(value) or not value.is_integer():
        return None
    return int(value)


def _fmt(value: float) -> str:
    return f"{value:.4g}"


class _Robust:
    """Trailing median level and median-|difference| noise of one series (symptom._z, online)."""

    def __init__(self, window: int) -> None:
        self.values: deque[float] = deque(maxlen=window)
        self.diffs: deque[float] = deque(maxlen=window)

    def __len__(self) -> int:
        return len(self.values)

    def z(self, value: float) -> tuple[float, float, float]:
        """(z, level, noise scale) of ``value`` against the history before it."""
        level = statistics.median(self.values)
        noise = 1.4826 * statistics.median(self.diffs) / math.sqrt(2) if self.diffs else 0.0
        # The diagnosis' floor: 1 % of the level while one or two differences are all there is.
        floor = abs(level) * (1e-2 if len(self.values) < SHORT_HISTORY else 1e-4)
        scale = max(noise, floor, 1e-12)
        return (value - level) / scale, level, scale

    def add(self, value: float) -> None:
        if self.values:
            self.diffs.append(abs(value - self.values[-1]))
        self.values.append(value)


class _Quantile:
    """A quantile of the last ``window`` values, kept sorted (O(window) a step, small)."""

    def __init__(self, window: int) -> None:
        self.order: deque[float] = deque(maxlen=window)
        self.sorted: list[float] = []

    def __len__(self) -> int:
        return len(self.order)

    def add(self, value: float) -> None:
        if len(self.order) == self.order.maxlen:
            del self.sorted[bisect.bisect_left(self.sorted, self.order[0])]
        self.order.append(value)
        bisect.insort(self.sorted, value)

    def quantile(self, q: float) -> float:
        """Linear interpolation between the closest ranks (numpy's default)."""
        position = q * (len(self.sorted) - 1)
        low = int(position)
        high = min(low + 1, len(self.sorted) - 1)
        return self.sorted[low] + (self.sorted[high] - self.sorted[low]) * (position - low)


@dataclass
class _Excursion:
    """A loss jump being watched: does it come back, or stay up?"""

    step: int
    value: float
    level: float
    scale: float
    size: float
    routine: bool
    fired: bool
    index: int
    records: int = 1


class _SlidingMax:
    """Maximum over the last ``window`` values in amortised O(1) (a monotone deque)."""

    def __init__(self, window: int) -> None:
        self.window = window
        self.count = 0
        self.queue: deque[tuple[int, float]] = deque()

    def add(self, value: float) -> None:
        while self.queue and self.queue[-1][1] <= value:
            self.queue.pop()
        self.queue.append((self.count, value))
        self.count += 1
        while self.queue[0][0] <= self.count - 1 - self.window:
            self.queue.popleft()

    def peak(self) -> float | None:
        return self.queue[0][1] if self.queue else None

    def reset(self) -> None:
        self.queue.clear()


@dataclass
class _Finding:
    kind: str
    value: float | None
    score: float | None
    detail: str


# --------------------------------------------------------------------------- detector


class Detector:
    """``feed(record)`` for each record as it arrives; returns an ``Anomaly`` when a new
    incident starts, else None. ``incidents`` lists what it returned; ``counts`` says how
    many records were judged, ignored (no step), duplicates, restarts."""

    def __init__(self, config: WatchConfig | None = None, *, clock: Callable[[], float] = time.time) -> None:
        self.config = config or WatchConfig()
        #: Wall-clock seconds for records without a ``time`` and for ``tick`` (tests pass their own).
        self._clock = clock
        #: (seconds, step) of the last records, for the typical step time.
        self._progress: deque[tuple[float, int]] = deque(maxlen=51)
        window = self.config.window
        self._loss = _Robust(window)
        self._loss_changes = _Quantile(JUMP_WINDOW)
        self._loss_last: float | None = None
        self._jumps: deque[tuple[int, float]] = deque()
        self._excursion: _Excursion | None = None
        self._judged_records = 0
        #: Routine jumps that came back: recorded, not incidents.
        self.recorded: list[Anomaly] = []
        self._grad = _Robust(window)
        self._scale_peak = _SlidingMax(self.config.loss_scale_window)
        self._grad_bad_run = 0
        self._scale_last: float | None = None
        self._since_fall = 0
        self._throughput = _Robust(self.config.throughput_window)
        self._slow_run: list[float] = []
        self._open: Anomaly | None = None
        self._open_records = 0
        self._open_time: float | None = None
        self._quiet = 0
        self.incidents: list[Anomaly] = []
        self.counts = {"records": 0, "ignored": 0, "duplicates": 0, "restarts": 0}
        self.first_step: int | None = None
        self.last_step: int | None = None
        #: The last record fed brought no new step (a duplicate): as good as an idle poll.
        self.idle = False

    @property
    def in_incident(self) -> bool:
        return self._open is not None

    def feed(self, record: Mapping[str, Any]) -> Anomaly | None:
        step = _step(record.get("step")) if isinstance(record, Mapping) else None
        if step is None:
            self.counts["ignored"] += 1
            return None
        self.idle = False
        if step == self.last_step:
            self.counts["duplicates"] += 1
            self.idle = True  # nothing new (a poll of a gauge that did not move)
            return None
        if self.last_step is not None and step < self.last_step:
            self.counts["restarts"] += 1
        self.counts["records"] += 1
        self.first_step = step if self.first_step is None else self.first_step
        self.last_step = step
        moment = parse_any(record.get("time"))
        seen = moment.timestamp() if moment is not None else self._clock()
        if not self._progress or step > self._progress[-1][1]:
            self._progress.append((seen, step))
        else:  # a restart re-logs older steps: the step time starts over
            self._progress.clear()
            self._progress.append((seen, step))
        findings = self._judge(record, step)
        return self._debounce(findings, step, moment.timestamp() if moment else None, iso(moment))

    def stall(self, now: float | None = None) -> tuple[int, float, float, float] | None:
        """(last step, seconds without a new one, seconds per step, threshold) when the job
        has stalled by ``now`` (default: the clock), else None. Two records are needed to
        know the step time."""
        if len(self._progress) < 2:
            return None
        now = self._clock() if now is None else now
        pairs = list(self._progress)
        seconds = [b[0] - a[0] for a, b in zip(pairs, pairs[1:])]
        steps = [b[1] - a[1] for a, b in zip(pairs, pairs[1:])]
        good = [(s, n) for s, n in zip(seconds, steps) if s > 0 and n > 0]
        if not good:
            return None
        per_step = statistics.median(s / n for s, n in good)
        per_record = statistics.median(s for s, _ in good)
        threshold = stall_threshold(per_step, per_record, factor=self.config.stall_factor,
                                    minimum=self.config.stall_min_s)
        silent = now - pairs[-1][0]
        if silent <= threshold:
            return None
        return pairs[-1][1], silent, per_step, threshold

    def tick(self, now: float | None = None) -> Anomaly | None:
        """Nothing new arrived: a stall starts an incident (once; an incident already open
        covers it, and it closes when steps come again and stay healthy)."""
        if self._open is not None:
            return None
        found = self.stall(now)
        if found is None:
            return None
        step, silent, per_step, threshold = found
        when = iso(from_unix(now if now is not None else self._clock()))
        anomaly = Anomaly("stalled", step, silent, silent / per_step if per_step > 0 else None,
                          f"no step after {step} for {silent:,.0f} s (a step took {per_step:.3g} s; stalled beyond "
                          f"{threshold:,.0f} s)", when,
                          rule={"stall_factor": f"{self.config.stall_factor:g}",
                                "stall_min_s": f"{self.config.stall_min_s:g}"})
        self._open, self._open_records, self._open_time, self._quiet = anomaly, 0, None, 0
        self.incidents.append(anomaly)
        return anomaly

    # ---------------------------------------------------------------- rules

    def _judge(self, record: Mapping[str, Any], step: int) -> list[_Finding]:
        config = self.config
        judged = step >= config.warmup_steps
        loss = _number(record.get("loss"))
        grad = _number(record.get("grad_norm"))
        scale = _number(record.get("loss_scale"))
        skipped = record.get("skipped") is True
        found: list[_Finding] = []
        nan = self._nan(record, loss, grad, scale)
        if nan is not None:
            found.append(nan)
        if loss is not None and math.isfinite(loss):
            spike = self._loss_jump(loss, step, judged)
            if spike is not None:
                found.append(spike)
            self._loss.add(loss)
            if self._loss_last is not None:
                self._loss_changes.add(abs(loss - self._loss_last))
            self._loss_last = loss
            self._judged_records += 1
        if grad is not None and math.isfinite(grad) and not skipped:
            spike = self._spike(self._grad, grad, config.grad_z, config.grad_rel, judged)
            if spike is not None:
                times = f"{grad / spike[1]:.1f}x" if spike[1] > 0 else "far above"
                found.append(_Finding("grad_spike", grad, spike[0], f"grad norm {_fmt(grad)} is {times} its running "
                                      f"median {_fmt(spike[1])} (robust z {spike[0]:.1f})"))
            self._grad.add(grad)
        if scale is not None and math.isfinite(scale) and scale >= 0:
            collapse = self._collapse(scale, judged)
            if collapse is not None:
                found.append(collapse)
        throughput = _number(record.get("throughput"))
        if throughput is not None and math.isfinite(throughput) and throughput >= 0:
            drop = self._drop(throughput, judged)
            if drop is not None:
                found.append(drop)
        return found

    def _nan(self, record: Mapping[str, Any], loss: float | None, grad: float | None,
             scale: float | None) -> _Finding | None:
        if scale is not None and math.isfinite(scale):
            falling = self._scale_last is not None and scale < self._scale_last
            self._since_fall = 0 if falling else self._since_fall + 1
            self._scale_last = scale
        else:
            self._since_fall += 1
        if loss is not None and not math.isfinite(loss):
            return _Finding("nan", loss, None, f"loss is {loss}")
        if record.get("nan") is True:
            return _Finding("nan", loss, None, "the job counted a non-finite loss")
        if grad is None or math.isfinite(grad):
            self._grad_bad_run = 0
            return None
        self._grad_bad_run += 1
        if record.get("skipped") is False:
            return _Finding("nan", grad, None, f"grad norm is {grad} on a step the job did not skip")
        limit = self.config.grad_nan_steps
        if self._grad_bad_run >= limit and self._since_fall >= limit:
            return _Finding("nan", grad, None, f"grad norm non-finite for {self._grad_bad_run} records in a row "
                            "with the loss scale not falling")
        return None

    def _loss_jump(self, loss: float, step: int, judged: bool) -> _Finding | None:
        """A loss spike judged against the run's own texture (module docstring): fires at once
        when beyond it, holds a routine or short-history jump until it comes back (recorded)
        or stays up ``persist_steps`` records (an incident)."""
        config = self.config
        held = self._excursion
        if held is not None:
            threshold = max(config.loss_rel * abs(held.level), config.loss_z * held.scale) / 2
            if loss - held.level > threshold:
                held.records += 1
                if held.records >= config.persist_steps and not held.fired:
                    self._excursion = None
                    return _Finding("loss_spike", loss, held.size, f"loss {_fmt(loss)} still {held.size:.0%} above "
                                    f"its level {_fmt(held.level)} {held.records} records after it jumped at step "
                                    f"{held.step}: it did not come back")
                if held.records >= config.persist_steps:
                    self._excursion = None
                return None
            self._excursion = None
            self._jumps.append((held.index, held.size))
            if not held.fired:
                self.recorded.append(Anomaly("loss_spike", held.step, held.value, held.size,
                                             f"loss {_fmt(held.value)} jumped {held.size:.0%} above its level "
                                             f"{_fmt(held.level)} and came back: "
                                             + ("a jump this run makes routinely" if held.routine else
                                                "a short history, and it did not stay") + "; recorded, not an incident"))
        if judged and loss >= ABSURD_LOSS:
            # A level no healthy run reaches (the diagnosis' rule too), however long the history.
            self._excursion = _Excursion(step, loss, loss, 0.0, math.inf, False, True, self._judged_records)
            return _Finding("loss_spike", loss, None, f"loss {_fmt(loss)} is beyond any healthy run "
                            f"(>= {ABSURD_LOSS:g}): the run diverged")
        if not judged or not self._loss:
            return None
        index = self._judged_records
        while self._jumps and index - self._jumps[0][0] > config.routine_memory:
            self._jumps.popleft()
        if len(self._loss) < config.min_history:
            level = statistics.median(self._loss.values)
            if level <= 0 or loss < RATIO_SHORT * level:
                return None
            _, _, scale = self._loss.z(loss)
            size = loss / level - 1
            if loss >= ROUTINE_CEILING * level and len(self._loss) >= 2 or loss >= config.order_of_magnitude * level:
                # Doubling is never a run's texture; ten times the level needs no history at all.
                self._excursion = _Excursion(step, loss, level, scale, size, False, True, index)
                what = "an order of magnitude" if loss >= config.order_of_magnitude * level else "it doubled"
                return _Finding("loss_spike", loss, size, f"loss {_fmt(loss)} is {loss / level:.1f}x its level "
                                f"{_fmt(level)} ({what}, with {len(self._loss)} value(s) of history)")
            self._excursion = _Excursion(step, loss, level, scale, size, False, False, index)
            return None
        z, level, scale = self._loss.z(loss)
        if not (z > config.loss_z and loss - level > config.loss_rel * abs(level)):
            return None
        size = (loss - level) / abs(level) if level else math.inf
        big = level > 0 and loss >= config.order_of_magnitude * level
        texture = len(self._loss_changes) >= JUMP_MIN_HISTORY and \
            loss - level < config.jump_factor * self._loss_changes.quantile(JUMP_QUANTILE)
        made_before = any(earlier >= size / config.routine_margin for _, earlier in self._jumps)
        routine = (texture or made_before) and not big and loss < ROUTINE_CEILING * level
        unknown = len(self._loss_changes) < JUMP_MIN_HISTORY and loss < ROUTINE_CEILING * level
        # Until the run's texture is known (a watcher started late), a jump short of doubling
        # is held like a routine one: an incident if it stays up, recorded if it comes back.
        hold = routine or unknown
        self._excursion = _Excursion(step, loss, level, scale, size, routine, not hold, index)
        if hold:
            return None
        return _Finding("loss_spike", loss, z, f"loss {_fmt(loss)} is {z:.1f} noise units above its running median "
                        f"{_fmt(level)}, beyond the jumps this run makes")

    def _spike(self, series: _Robust, value: float, z_limit: float, rel: float,
               judged: bool) -> tuple[float, float] | None:
        if not judged or len(series) < self.config.min_history:
            return None
        z, level, _ = series.z(value)
        if z > z_limit and value - level > rel * abs(level):
            return z, level
        return None

    def _collapse(self, scale: float, judged: bool) -> _Finding | None:
        if not judged:
            return None  # the scale's search down from 2^16..2^32 at the start is not a collapse
        peak = self._scale_peak.peak()
        self._scale_peak.add(scale)
        if peak is None or peak <= 0 or scale * self.config.loss_scale_factor > peak:
            return None
        self._scale_peak.reset()
        self._scale_peak.add(scale)
        ratio = peak / scale if scale > 0 else math.inf
        return _Finding("loss_scale_collapse", scale, ratio,
                        f"loss scale {_fmt(scale)} is 1/{_fmt(ratio)} of its recent peak {_fmt(peak)}")

    def _drop(self, throughput: float, judged: bool) -> _Finding | None:
        config = self.config
        series = self._throughput
        if not judged or len(series) < config.min_history:
            series.add(throughput)
            return None
        _, level, noise = series.z(throughput)
        if level > 0 and throughput < (1 - config.throughput_drop) * level:
            self._slow_run.append(throughput)
            count = len(self._slow_run)
            if count < config.throughput_steps:
                return None
            slow = statistics.median(self._slow_run)
            if level - slow <= config.throughput_z * 1.2533 * noise / math.sqrt(count):
                return None  # slow, but not beyond this run's jitter yet: a longer run decides
            self._throughput = _Robust(config.throughput_window)  # re-base: the new level from here on
            for value in self._slow_run:
                self._throughput.add(value)
            self._slow_run = []
            return _Finding("throughput_drop", slow, 1 - slow / level,
                            f"throughput {_fmt(slow)} for {count} records, {1 - slow / level:.0%} "
                            f"below its median {_fmt(level)}")
        for value in self._slow_run:  # a short slow run was a stall: it joins the history
            series.add(value)
        self._slow_run = []
        series.add(throughput)
        return None

    # ---------------------------------------------------------------- debounce

    def _debounce(self, found: list[_Finding], step: int, seconds: float | None, when: str | None) -> Anomaly | None:
        config = self.config
        if self._open is not None:
            self._open_records += 1
            if found:
                self._quiet = 0
                return None
            self._quiet += 1
            waited = seconds is None or self._open_time is None or seconds - self._open_time >= config.cooldown_s
            if self._quiet >= config.quiet_steps and self._open_records >= config.cooldown_steps and waited:
                self._open = None
            return None
        if not found:
            return None
        found.sort(key=lambda finding: KINDS.index(finding.kind))
        first = found[0]
        detail = first.detail
        others = sorted({finding.kind for finding in found[1:]} - {first.kind}, key=KINDS.index)
        if others:
            detail += f" (also {', '.join(others)})"
        anomaly = Anomaly(first.kind, step, first.value, first.score, detail, when)
        self._open, self._open_records, self._open_time, self._quiet = anomaly, 0, seconds, 0
        self.incidents.append(anomaly)
        return anomaly
