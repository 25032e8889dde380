"""The spike thresholds the diagnosis and the watcher share.

Both judge "is this step a spike?" the same way (robust z-score against a trailing level,
and a material fraction of it): the diagnosis over a finished window with pandas
(``spikeops.diagnosis.symptom``), the watcher online, step by step (``spikeops.watch``). They
live here, apart from either, so the watcher (and the CLI that builds its parser) does not
import pandas to read four numbers, and the two can never drift apart.

The rest are the diagnosis's rules for the logs real runs print (every 10-100 steps, pasted
excerpts of a few lines): ratios to the running level that work from a handful of points,
and the levels no healthy run reaches whatever its history.
"""

from __future__ import annotations

__all__ = [
    "Z_SPIKE", "REL_SPIKE", "MIN_HISTORY", "SHORT_HISTORY", "WINDOW",
    "RATIO_SHORT", "CLIMB_RISES", "CLIMB_REL", "ABSURD_LOSS", "ABSURD_LR", "MIN_POINTS",
    "JUMP_WINDOW", "JUMP_QUANTILE", "JUMP_FACTOR", "JUMP_MIN_HISTORY", "ROUTINE_MEMORY", "ROUTINE_MARGIN",
    "ORDER_OF_MAGNITUDE", "PERSIST_POINTS", "ROUTINE_CEILING",
    "STALL_FACTOR", "STALL_MIN_S", "stall_threshold",
]

#: A spike is this many noise units above the running level...
Z_SPIKE = 6.0
#: ...and at least this fraction of the level (noise-free synthetic curves have tiny noise).
REL_SPIKE = 0.10
#: Steps of history before a step can be judged. Short excerpts (a log tail pasted into a
#: ticket) must still be judged, so two will do; until five, the noise scale is floored at
#: 1 % of the level, because one or two differences say little about the noise.
MIN_HISTORY = 2
SHORT_HISTORY = 5
#: Trailing window of the running level, in logged steps.
WINDOW = 50
#: With fewer than SHORT_HISTORY logged points before it (the second point of an excerpt
#: included), a point this many times the running level is a spike on its own: there is no
#: noise estimate yet, and a healthy loss does not jump by half between two log lines.
RATIO_SHORT = 1.5
#: A climb: this many consecutive rises between logged points, CLIMB_REL (50 %) in all.
CLIMB_RISES = 3
CLIMB_REL = 0.5
#: A loss this high is broken whatever the run's own history (cross-entropy over any
#: vocabulary stays below ~15; a flat 1.5e5 is a run that diverged before the excerpt).
ABSURD_LOSS = 1e4
#: An Adam learning rate above this is a configuration error, not a schedule.
ABSURD_LR = 1.0
#: Fewer logged loss values than this, with nothing anomalous among them, cannot tell a
#: healthy run: the symptom is ``unknown``, never ``none``.
MIN_POINTS = 3

# ------------------------------------------------------------------ a run's own texture
#
# A healthy run logged every step jumps now and then (a hard batch: 3.6 -> 5.2 -> 3.8 in one
# step, every few hundred steps in public runs), far beyond its median step-to-step change.
# Such a one-step excursion is judged against the run's own jumps, not its median noise:

#: ...against the JUMP_QUANTILE of its |step-to-step changes| over the last JUMP_WINDOW logged
#: points: a one-step excursion is a spike only when it is JUMP_FACTOR times that (once
#: JUMP_MIN_HISTORY points give the quantile a meaning)...
JUMP_WINDOW = 500
JUMP_QUANTILE = 0.99
JUMP_FACTOR = 2.0
JUMP_MIN_HISTORY = 100
#: ...and against its history of jumps: one that the run already made (an excursion at least
#: 1/ROUTINE_MARGIN as large, relative to the level, within the last ROUTINE_MEMORY logged
#: points, that came back) is routine: recorded, not an incident, unless it stays up.
ROUTINE_MEMORY = 2000
ROUTINE_MARGIN = 1.5
#: A loss that doubles in one step is never a run's texture, however often it did before
#: (healthy per-step runs jump to 1.5-1.8x their level and straight back; 2x is trouble).
ROUTINE_CEILING = 2.0
#: A jump this many times the level is an incident whatever the history (even of two points).
ORDER_OF_MAGNITUDE = 10.0
#: An excursion still up after this many logged points did not come back: an incident, routine
#: size or not, short history or long (the observation window of a single spike).
PERSIST_POINTS = 5
#: A job is stalled when no new step came for this many times its typical step time...
STALL_FACTOR = 10.0
#: ...and never less than this (seconds): a checkpoint save or an evaluation pauses the step
#: counter for minutes in a healthy run.
STALL_MIN_S = 300.0


def stall_threshold(step_seconds: float, log_seconds: float, *, factor: float = STALL_FACTOR,
                    minimum: float = STALL_MIN_S) -> float:
    """Seconds of silence after the last logged step that make a stall: ``factor`` x the
    typical step time (at least ``minimum``), plus the typical interval between logged
    steps (a job that logs every 100 steps is silent that long between two healthy lines,
    and the counter may have stopped anywhere in it). The diagnosis, the watcher and the
    Prometheus rule (infra/monitoring) apply the same rule."""
    return max(factor * max(step_seconds, 0.0), minimum) + max(log_seconds, 0.0)
