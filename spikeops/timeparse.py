"""Reading the timestamps that tools print, into aware UTC datetimes.

The bundle spec says times without a zone are UTC; every function here follows that rule so
evidence from different tools lines up on one clock. A timestamp that cannot be placed on
the wall clock (syslog without a year, dmesg seconds since boot) returns None rather than a
guess: the diagnosis treats such evidence as "time unknown".
"""

from __future__ import annotations

import re
from datetime import UTC, datetime, timedelta

__all__ = ["parse_iso", "parse_any", "parse_ctime", "parse_syslog", "parse_yearless", "year_for", "from_unix", "iso"]

_ISO = re.compile(
    r"^(?P<date>\d{4}-\d{2}-\d{2})[T ](?P<h>\d{2}):(?P<m>\d{2})(?::(?P<s>\d{2})(?:[.,](?P<frac>\d+))?)?"
    r"\s*(?P<tz>Z|[+-]\d{2}:?\d{2}|UTC)?$"
)


def parse_iso(text: str) -> datetime | None:
    """ISO 8601 with '.' or ',' fractions (dmesg prints a comma), any zone or none (UTC)."""
    match = _ISO.match(text.strip())
    if not match:
        return None
    frac = (match["frac"] or "0")[:6].ljust(6, "0")
    try:
        year, month, day = (int(part) for part in match["date"].split("-"))
        moment = datetime(
            year, month, day, int(match["h"]), int(match["m"]), int(match["s"] or 0), int(frac)
        )
    except ValueError:
        return None
    tz = match["tz"]
    if tz and tz not in ("Z", "UTC"):
        sign = 1 if tz[0] == "+" else -1
        digits = tz[1:].replace(":", "")
        offset = timedelta(hours=int(digits[:2]), minutes=int(digits[2:]))
        try:
            moment = moment - sign * offset
        except OverflowError:  # year 1 or 9999 shifted past the calendar's edge
            return None
    return moment.replace(tzinfo=UTC)


def from_unix(seconds: float) -> datetime | None:
    try:
        return datetime.fromtimestamp(float(seconds), tz=UTC)
    except (OverflowError, OSError, ValueError):
        return None


_MONTHS = {m: i for i, m in enumerate("Jan Feb Mar Apr May Jun Jul Aug Sep Oct Nov Dec".split(), 1)}
_CTIME = re.compile(
    r"^(?:[A-Z][a-z]{2}\s+)?(?P<mon>[A-Z][a-z]{2})\s+(?P<day>\d{1,2})\s+"
    r"(?P<h>\d{2}):(?P<m>\d{2}):(?P<s>\d{2})(?:\.(?P<frac>\d+))?\s+(?P<year>\d{4})$"
)


def parse_ctime(text: str) -> datetime | None:
    """``Sun Feb 23 16:24:18 2025`` as printed by ``dmesg -T`` and nvidia-smi."""
    match = _CTIME.match(text.strip())
    if not match or match["mon"] not in _MONTHS:
        return None
    try:
        return datetime(
            int(match["year"]),
            _MONTHS[match["mon"]],
            int(match["day"]),
            int(match["h"]),
            int(match["m"]),
            int(match["s"]),
            int((match["frac"] or "0")[:6].ljust(6, "0")),
            tzinfo=UTC,
        )
    except ValueError:
        return None


_SYSLOG = re.compile(r"^(?P<mon>[A-Z][a-z]{2})\s+(?P<day>\d{1,2})\s+(?P<h>\d{2}):(?P<m>\d{2}):(?P<s>\d{2})$")


def parse_syslog(text: str, year: int | None) -> datetime | None:
    """``Jan  3 07:39:44`` carries no year: without one the time is unknown, not guessed."""
    match = _SYSLOG.match(text.strip())
    if not match or year is None or match["mon"] not in _MONTHS:
        return None
    try:
        return datetime(
            year, _MONTHS[match["mon"]], int(match["day"]), int(match["h"]), int(match["m"]),
            int(match["s"]), tzinfo=UTC,
        )
    except ValueError:
        return None


#: A yearless time up to this far after the reference still takes the reference's year (the
#: incident is dated when it opens; the job printed its last lines just before).
_YEARLESS_GRACE = timedelta(days=2)


def year_for(month: int, day: int, reference: datetime) -> int:
    """The year of a yearless ``month``/``day`` seen near ``reference`` (the incident): the
    reference's own, or the year before when that would put the date in the future."""
    try:
        candidate = datetime(reference.year, month, day, tzinfo=UTC)
    except ValueError:  # Feb 29 in a common year: the leap year before is the one meant
        return reference.year - 1
    return reference.year - 1 if candidate > reference.astimezone(UTC) + _YEARLESS_GRACE else reference.year


def parse_yearless(text: str, reference: datetime | None) -> datetime | None:
    """``May 19 07:08:57`` (syslog, a kernel line copied into a job's log) on the wall clock
    of ``reference``: its year, or the year before when that would be in the future. Without a
    reference the time stays unknown (None), never guessed."""
    match = _SYSLOG.match(text.strip())
    if not match or reference is None or match["mon"] not in _MONTHS:
        return None
    return parse_syslog(text, year_for(_MONTHS[match["mon"]], int(match["day"]), reference))


def parse_any(value: object) -> datetime | None:
    """A bundle ``time`` field: ISO 8601 text or Unix seconds (number or numeric string)."""
    if value is None or isinstance(value, bool):
        return None
    if isinstance(value, int | float):
        return from_unix(value)
    if isinstance(value, str):
        text = value.strip()
        if re.fullmatch(r"\d+(?:\.\d+)?", text):
            return from_unix(float(text))
        return parse_iso(text) or parse_ctime(text)
    return None


def iso(moment: datetime | None) -> str | None:
    """The one way spikeops writes times: ISO 8601 in UTC with a ``Z``."""
    if moment is None:
        return None
    moment = moment.astimezone(UTC)
    text = moment.isoformat(timespec="microseconds" if moment.microsecond else "seconds")
    return text.replace("+00:00", "Z")
