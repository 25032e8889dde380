"""What an incident cost, and the incident as ``spikeops incidents list --json`` prints it.

shared/spec/ledger.md: ``gpu_hours = gpus × (steps_rolled_back × step_seconds + downtime_s) / 3600``,
where the steps rolled back are the spike step minus the step resumed from (the compute done
again) and the downtime runs from the spike to the resumed job running again, or to now while
it is not (a job left stopped keeps costing). Two bounds keep a forgotten incident from
counting forever: when a later incident of the same lineage exists, the job ran again before
it, so the downtime ends there at the latest; and a job that was never stopped (a single
spike watched while it trained on) had no downtime.

The spike's time comes from the job's metrics; one logged more than ``MAX_DETECTION_S`` (a
day) before the alert, or after it, is a clock or a replayed log, not a detection delay, and
the downtime then starts at the alert.

A term that is unknown counts as 0 and is reported as null (``steps_rolled_back`` without a
resume, ``step_seconds`` without timed metrics); ``gpu_hours`` is null without the GPU count.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from datetime import UTC, datetime
from typing import Any

from spikeops.timeparse import parse_any

__all__ = ["TIMES", "MAX_DETECTION_S", "step_seconds", "lost_time", "incident_view", "downtime_start",
           "downtime_end"]

#: The times of an incident, in the order they happen (``t_<name>`` columns of the ledger).
TIMES = ("spike", "alert", "stopped", "diagnosed", "approved", "resumed_running")
#: The longest a spike is believed to precede its alert (beyond: a clock or a replayed log).
MAX_DETECTION_S = 86400.0
#: ... and how far after the alert its logged time may be (clocks of different machines).
_CLOCK_SKEW_S = 300.0
#: Logged points before the spike the step time is measured on.
_STEP_WINDOW = 200


def step_seconds(points: Sequence[tuple[int, Any]], spike: int | None) -> float | None:
    """Wall-clock seconds per training step before the spike: the median over the logged
    points (step, time) of (Δtime / Δsteps); None without two timed points."""
    timed = sorted((int(step), moment) for step, moment in points
                   if moment is not None and (spike is None or int(step) <= spike))
    timed = timed[-_STEP_WINDOW:]
    rates = []
    for (s0, t0), (s1, t1) in zip(timed, timed[1:]):
        try:
            seconds = (t1 - t0).total_seconds()
        except (TypeError, AttributeError):
            continue
        if s1 > s0 and seconds > 0:
            rates.append(seconds / (s1 - s0))
    if not rates:
        return None
    rates.sort()
    middle = len(rates) // 2
    value = rates[middle] if len(rates) % 2 else (rates[middle - 1] + rates[middle]) / 2
    return round(value, 3)


def _time(row: Mapping[str, Any], name: str) -> datetime | None:
    value = row.get(f"t_{name}")
    moment = parse_any(value) if value else None
    return moment if isinstance(moment, datetime) else None


def downtime_start(row: Mapping[str, Any]) -> datetime | None:
    """When training stopped being useful: the spike, when its logged time is plausible next
    to the alert; else the alert (else when the incident opened)."""
    spike, alert = _time(row, "spike"), _time(row, "alert")
    if spike is not None and (alert is None or -_CLOCK_SKEW_S <= (alert - spike).total_seconds() <= MAX_DETECTION_S):
        return spike
    if alert is not None:
        return alert
    opened = parse_any(row["opened"]) if row.get("opened") else None
    return opened if isinstance(opened, datetime) else None


def downtime_end(row: Mapping[str, Any], now: datetime, next_opened: str | None = None) -> datetime | None:
    """When the job was running again: the resumed job seen running; else, for a job that was
    stopped, the next incident of its lineage (it ran again before that) or now; None for a
    job that was never stopped."""
    running = _time(row, "resumed_running")
    if running is not None:
        return running
    if _time(row, "stopped") is None and not row.get("held_for_person"):
        return None
    later = parse_any(next_opened) if next_opened else None
    return min(later, now) if isinstance(later, datetime) else now


def lost_time(row: Mapping[str, Any], *, now: datetime | None = None, next_opened: str | None = None) -> dict[str, Any]:
    """The ``lost`` object of ledger.md for one incident row."""
    now = now or datetime.now(UTC)
    resumed = row.get("resumed_from") or {}
    spike = row.get("spike_step")
    rolled = None
    if spike is not None and resumed.get("step") is not None:
        rolled = max(0, int(spike) - int(resumed["step"]))
    start = downtime_start(row)
    end = downtime_end(row, now, next_opened)
    downtime = 0.0
    if end is not None and isinstance(start, datetime):
        downtime = max(0.0, (end - start).total_seconds())
    seconds = row.get("step_seconds")
    gpus = row.get("gpus")
    gpu_hours = None
    if gpus:
        gpu_hours = round(int(gpus) * ((rolled or 0) * float(seconds or 0.0) + downtime) / 3600, 3)
    return {"steps_rolled_back": rolled, "step_seconds": seconds, "gpus": gpus, "downtime_s": round(downtime, 1),
            "gpu_hours": gpu_hours, "still_down": end is not None and _time(row, "resumed_running") is None
            and next_opened is None}


def incident_view(row: Mapping[str, Any], *, now: datetime | None = None, next_opened: str | None = None,
                  ) -> dict[str, Any]:
    """One incident in ledger.md's ``incidents list --json`` shape (plus the documented
    extensions: layer, confidence, spike_step, plan, auto_resumed, outcome, bundle)."""
    return {
        "incident_id": row.get("incident_id"), "cluster": row.get("cluster"), "job_id": row.get("job_id"),
        "lineage": row.get("lineage"), "opened": row.get("opened"), "symptom": row.get("symptom"),
        "cause": row.get("cause"), "culprit_nodes": list(row.get("culprit_nodes") or []),
        "recurrence_of": row.get("recurrence_of"), "resumed_as": row.get("resumed_as"),
        "resumed_from": row.get("resumed_from"), "auto_resumes_in_window": row.get("auto_resumes_in_window"),
        "held_for_person": bool(row.get("held_for_person")),
        "times": {name: row.get(f"t_{name}") for name in TIMES},
        "lost": lost_time(row, now=now, next_opened=next_opened),
        "layer": row.get("layer"), "confidence": row.get("confidence"), "spike_step": row.get("spike_step"),
        "plan": row.get("plan"), "auto_resumed": row.get("auto_resumed"), "outcome": row.get("outcome"),
        "bundle": row.get("bundle"),
    }
