"""The spike thresholds the diagnosis and the watcher share.

Both judge "is this step a spike?" the same way (robust z-score against a trailing level,
and a material fraction of it): the diagnosis over a finished window with pandas
(``spikeops.diagnosis.symptom``), the watcher online, step by step (``spikeops.watch``). They
live here, apart from either, so the watcher (and the CLI that builds its parser) does not
import pandas to read four numbers, and the two can never drift apart.
"""

from __future__ import annotations

__all__ = ["Z_SPIKE", "REL_SPIKE", "MIN_HISTORY", "SHORT_HISTORY", "WINDOW"]

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
