"""Line prefixes (launchers, time stamps, glog) and NCCL's own line shape, stripped before an
event rule looks at a line."""

from __future__ import annotations

import re
from dataclasses import dataclass
from datetime import datetime
from typing import Any
from spikeops.timeparse import parse_iso

__all__ = ["strip_launcher"]


# --------------------------------------------------------------------------------------
# Line prefixes (launchers, stamps, glog) and NCCL's own line shape
# --------------------------------------------------------------------------------------

_SRUN = re.compile(r"^\s*(\d{1,6}): ")
_LAUNCHER_TAG = re.compile(r"^\[([A-Za-z_][A-Za-z_-]{0,30}?)(\d{1,6})\]:\s?")
_ISO_STAMP = re.compile(
    r"^\[?(\d{4}-\d{2}-\d{2}[T ]\d{2}:\d{2}:\d{2}(?:[.,]\d+)?(?:Z|[+-]\d{2}:?\d{2}| ?UTC)?)\]?\s+"
)
_GLOG = re.compile(
    r"^\[?(?P<sev>[IWEF])(?P<md>\d{3,4}) (?P<t>\d{2}:\d{2}:\d{2}(?:\.\d+)?)\s+(?:(?P<tid>\d+)\s+)?"
    r"(?P<src>[^\s\]]+:\d+)\]\s?"
)
_GLOG_SHORT = re.compile(r"^\[(?P<sev>[IWEF]) (?P<src>[^\s\]]+:\d+)\]\s?")

_NCCL = re.compile(
    r"^(?P<host>[^\s:\[\]]{1,255}):(?P<pid>\d{1,10}):(?P<tid>\d{1,10})\s+(?P<mid>.{0,400}?)"
    r"\bNCCL (?P<level>INFO|WARN|ERROR|TRACE|CALL|ABORT)\b ?(?P<msg>.*)$"
)
_NCCL_MID = re.compile(
    r"^\[(?P<dev>-?\d{1,6})\](?:\s+\[(?P<rank>\d{1,9})\])?(?:\s+\d+\.\d+)?(?:\s+(?P<src>\S+:\d+))?"
    r"(?:\s+\((?P<func>[^)]*)\))?\s*$"
)
_NCCL_START = re.compile(r"^[^\s:\[\]]+:\d+:\d+ \[-?\d+\]")
#: An NCCL line as people quote it, without the ``host:pid:tid [dev]`` prefix (an issue, a
#: chat, a log that was grepped with -h): ``NCCL WARN NET/IB : Got async event : port error``.
_NCCL_LOOSE = re.compile(
    r"^(?:[^\s:]{0,80}:\d+:\d+\s+)?(?:\[-?\d{1,6}\]\s+)?(?:\S+:\d+\s+)?"
    r"NCCL (?P<level>INFO|WARN|ERROR|ABORT)\b ?(?P<msg>.*)$"
)
_NCCL_LEVEL = re.compile(r"\bNCCL (?:INFO|WARN|ERROR)\b")
_BARE_VERSION = re.compile(r"NCCL version:?\s*(\S+)\s*")
_ANY_VERSION = re.compile(
    r"\bNCCL version:?\s*(\(\s*\d+\s*,\s*\d+\s*,\s*\d+\s*\)|[\w.+-]*\d[\w.+-]*)"
)
#: NCCL's own buffer is 1 KiB and PyTorch's messages are a few; rules read no further.
_MAX_LINE = 8192
_BINARY = re.compile(r"[\x00-\x08\x0e-\x1f\ufffd]")


@dataclass(frozen=True, slots=True)
class _Line:
    """A line with its wrappers taken off: who wrapped it, and when it was stamped."""

    body: str
    tag: str
    task: int | None = None
    local_rank: int | None = None
    rank: int | None = None
    time: datetime | None = None
    stamp: str | None = None
    severity: str | None = None
    logger: str | None = None
    stamped: bool = False


def _glog_time(md: str, clock: str, year: int | None) -> datetime | None:
    """glog ``MMDD`` (c10's own logger prints ``MDD`` for Jan-Sep) plus a caller's year."""
    if year is None:
        return None
    month, day = (md[:-2], md[-2:])
    try:
        return parse_iso(f"{int(year):04d}-{int(month):02d}-{int(day):02d}T{clock}")
    except (ValueError, OverflowError):
        return None


def _strip(line: str, year: int | None) -> _Line:
    """Peel launcher, stamp and glog prefixes, in whatever order the wrappers nested them."""
    rest = line
    tags: list[str] = []
    found: dict[str, Any] = {}
    for _ in range(8):
        match = _SRUN.match(rest)
        if match:
            tags.append(match[1])
            found.setdefault("task", int(match[1]))
            rest = rest[match.end():]
            continue
        match = _LAUNCHER_TAG.match(rest)
        if match:
            tags.append(f"[{match[1]}{match[2]}]")
            name = "rank" if match[1].lower() == "rank" else "local_rank"
            found.setdefault(name, int(match[2]))
            rest = rest[match.end():]
            continue
        match = _ISO_STAMP.match(rest)
        if match:
            found.setdefault("stamp", match[1])
            found["stamped"] = True
            if found.get("time") is None:
                found["time"] = parse_iso(match[1])
            rest = rest[match.end():]
            continue
        match = _GLOG.match(rest) or _GLOG_SHORT.match(rest)
        if match:
            groups = match.groupdict()
            found.setdefault("severity", groups["sev"])
            found.setdefault("logger", groups["src"])
            found["stamped"] = True
            if groups.get("md"):
                found.setdefault("stamp", f"{groups['md']} {groups['t']}")
                if found.get("time") is None:
                    found["time"] = _glog_time(groups["md"], groups["t"], year)
            rest = rest[match.end():]
            continue
        break
    return _Line(body=rest, tag="|".join(tags), **found)


def strip_launcher(line: str, year: int | None = None) -> tuple[str, dict[str, Any]]:
    """A log line without its launcher, stamp and glog prefixes, and what they said: ``task``
    (srun -l), ``rank`` ([rankN]:), ``local_rank`` ([defaultN]:), ``time``, ``stamp``. Shared
    with the other readers of the job's own output, which see the same wrappers."""
    peeled = _strip(line, year)
    said = {name: getattr(peeled, name) for name in ("task", "rank", "local_rank", "time", "stamp")
            if getattr(peeled, name) is not None}
    return peeled.body, said
