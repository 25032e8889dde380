"""Following a log as the job writes it (``spikeops watch --log``)."""

from __future__ import annotations

from spikeops.probes.base import (
    Gap,
)
from spikeops.probes.training_log.model import (
    StepRecord,
)
from spikeops.probes.training_log.builder import (
    _Builder,
)
from spikeops.probes.training_log.formats import (
    _flush_wrap,
    _feed_line,
)

__all__ = ["LineReader"]


# --------------------------------------------------------------------------- following a log


class LineReader:
    """The line recognisers of ``parse``, one line at a time, for following a growing log
    (``spikeops watch --log``).

    ``feed(line)`` returns the step records that are complete: a record is held back until a
    line of another step arrives, because two lines of one step (DeepSpeed's ``step=`` and
    ``steps:`` lines, or two ranks) merge into one record, and a DeepSpeed ``OVERFLOW!`` line
    marks the step after it. ``flush()`` releases the held record (call it when the log goes
    quiet, or at its end). Memory stays bounded: released records are not kept. A
    ``trainer_state.json`` document is not a log to follow; use ``parse_trainer_state``."""

    def __init__(self) -> None:
        self._builder = _Builder()
        self._released: StepRecord | None = None

    @property
    def lines(self) -> int:
        return self._builder.lines

    @property
    def gaps(self) -> list[Gap]:
        """Lines that looked like steps but could not be read (bounded, as in ``parse``)."""
        return list(self._builder.gaps)

    def feed(self, line: str) -> list[StepRecord]:
        builder = self._builder
        builder.lines += 1
        try:
            _feed_line(builder, builder.lines, line.rstrip("\r\n"))
        except Exception as exc:  # noqa: BLE001 - a reader bug must not stop the follower
            builder.gap(f"line not read ({type(exc).__name__})", builder.lines)
        done = []
        while len(builder.records) > 1:
            record = builder.records.popleft()
            if record is not self._released:
                done.append(record)
        return done

    def flush(self) -> list[StepRecord]:
        builder = self._builder
        try:
            _flush_wrap(builder)
        except Exception as exc:  # noqa: BLE001
            builder.gap(f"wrapped line not read ({type(exc).__name__})", builder.lines)
        records = builder.records
        fresh = [record for record in records if record is not self._released]
        if not fresh:
            return []
        while len(records) > 1:
            records.popleft()
        self._released = records[-1]
        return fresh


__all__ += ["LineReader"]
