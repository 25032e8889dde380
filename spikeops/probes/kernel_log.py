"""The kernel log: NVIDIA Xid and NVSwitch SXid reports, and GPUs that dropped off the bus.

Nodes hand us their kernel log in whatever form the collector could get, sometimes several
forms in one file, so the timestamp is read per line:

- ``dmesg --time-format iso`` ``2025-01-21T02:21:33,498559+00:00 msg`` (comma before the
  microseconds), also with ``-x``/``--decode``'s ``kern  :warn  : `` prefix;
- ``dmesg -T``/``--ctime`` ``[Sun Feb 23 16:24:18 2025] msg`` (no zone: UTC per the spec);
- ``journalctl -k -o short-iso-precise`` ``2026-11-29T18:01:02.123456+0000 host kernel: msg``
  (also ``short-iso`` and rsyslog's RFC 3339 form, which look the same);
- plain ``dmesg`` ``[  123.456789] msg``: seconds since boot, on the wall clock only when the
  caller knows the boot time;
- syslog ``Jan  3 07:39:44 host kernel: [17256.647980] msg``: no year, so on the wall clock
  only when the caller gives one;
- lines with no timestamp at all (an Xid line pasted into a ticket): time unknown.

A ``> `` markdown quote prefix is removed (logs travel through issue trackers and chats).
One kernel record can span lines: dmesg and journalctl print the rest of a multi-line
message indented under the first line, with no timestamp; syslog repeats the record's
stamp on every piece. Those pieces are joined to the record they continue, which keeps the
first line's number, so ``The NVIDIA GPU 0000:5d:00.0 ... has fallen off the bus`` is read
as one message with its address.

Only events are kept (the parser streams): Xids, SXids, and "GPU lost" messages that say a
GPU is gone or must be reset even when no Xid line made it into the log.
"""

from __future__ import annotations

import math
import re
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import TypeVar

from spikeops.probes.base import RemoteProbe, Gap, Kind, LineSource, MAX_EVENTS, clip, numbered_lines, register, register_remote
from spikeops.probes.xid_catalog import SXidInfo, XidInfo, lookup, lookup_sxid
from spikeops.timeparse import iso, parse_ctime, parse_iso, parse_syslog

__all__ = [
    "REMOTE",
    "XidEvent",
    "SXidEvent",
    "GpuLostEvent",
    "KernelLog",
    "parse",
    "detect",
    "summarize",
    "normalize_pci",
    "FORMATS",
    "GPU_LOST_REASONS",
    "KIND",
]

#: Names of the timestamp forms, as reported in ``KernelLog.format``.
FORMATS = ("dmesg-iso", "dmesg-ctime", "dmesg", "journal", "syslog", "bare")
#: The stable ``GpuLostEvent.reason`` values.
GPU_LOST_REASONS = ("fallen_off_bus", "probe_failed", "reset_required", "crash_dump", "init_failed", "pcie_fatal")

#: A joined record longer than this stops growing: no kernel message is that long, garbage is.
_MAX_RECORD_CHARS = 4096
#: Individual gaps kept per input; the rest are counted in one gap.
_MAX_GAPS = 200
#: How many records back a GPU named by the driver still explains a message that names none.
_CONTEXT_RECORDS = 8


# ---------------------------------------------------------------------------------- results


@dataclass(frozen=True, slots=True)
class XidEvent:
    """One ``NVRM: Xid`` line. ``pci`` is ``domain:bus:device`` in lower case (``0000:9b:00``),
    the form :func:`normalize_pci` makes of nvidia-smi's ``00000000:9B:00.0``, so the two can
    be matched. ``pid``/``process`` are None when the driver printed ``<unknown>`` or an older
    driver printed none. ``time`` is None when the line cannot be put on the wall clock;
    ``uptime_s`` keeps the seconds since boot when the line had them."""

    line: int
    text: str
    time: datetime | None
    uptime_s: float | None
    pci: str
    code: int
    pid: int | None
    process: str | None
    message: str
    info: XidInfo
    gpu_instance: int | None = None
    compute_instance: int | None = None


@dataclass(frozen=True, slots=True)
class SXidEvent:
    """One ``nvidia-nvswitchN: SXid`` line. ``severity`` is the line's own word (``Fatal`` or
    ``Non-fatal``), None on the follow-up ``Severity 1 Engine instance ...`` and ``Data {...}``
    lines, which are kept as events of the same code. ``pci`` is the switch's address."""

    line: int
    text: str
    time: datetime | None
    uptime_s: float | None
    pci: str
    code: int
    severity: str | None
    link: int | None
    message: str
    switch: str
    info: SXidInfo


@dataclass(frozen=True, slots=True)
class GpuLostEvent:
    """A GPU gone or in need of a reset, said in words rather than an Xid number. ``reason`` is
    one of :data:`GPU_LOST_REASONS`; ``pci`` may be None when neither the message nor the
    driver lines just before it named the GPU."""

    line: int
    text: str
    time: datetime | None
    uptime_s: float | None
    pci: str | None
    reason: str


@dataclass
class KernelLog:
    """Events read from one kernel log. ``format`` is the timestamp form most records used
    (one of :data:`FORMATS`, or ``"empty"``); ``formats`` counts records per form."""

    format: str = "empty"
    lines: int = 0
    xids: list[XidEvent] = field(default_factory=list)
    sxids: list[SXidEvent] = field(default_factory=list)
    gpu_lost: list[GpuLostEvent] = field(default_factory=list)
    boot_time_known: bool = False
    formats: dict[str, int] = field(default_factory=dict)
    gaps: list[Gap] = field(default_factory=list)

    def xids_between(self, start: datetime, end: datetime) -> list[XidEvent]:
        """Xids whose wall-clock time lies in ``[start, end]``; events of unknown time are
        not included (ask :meth:`unknown_time_xids` for them)."""
        start, end = _as_utc(start), _as_utc(end)
        return [e for e in self.xids if e.time is not None and start <= e.time <= end]

    def unknown_time_xids(self) -> list[XidEvent]:
        """Xids that cannot be placed in time (plain dmesg without a boot time, syslog without
        a year, bare lines): the diagnosis decides how far to trust them."""
        return [e for e in self.xids if e.time is None]


# ------------------------------------------------------------------------------ timestamps

_QUOTE = re.compile(r"^>(?: |$)")
_DECODE = re.compile(
    r"^(?:kern|user|mail|daemon|auth|syslog|lpr|news|uucp|cron|authpriv|ftp|res[0-3]|local[0-7])"
    r"\s*:\s*(?:emerg|alert|crit|err|warn|notice|info|debug)\s*:\s?"
)
_RAW_LEVEL = re.compile(r"^<\d{1,3}>(?=\[)")  # dmesg -r
_DMESG_ISO = re.compile(
    r"^(?P<ts>\d{4}-\d{2}-\d{2}T\d{2}:\d{2}:\d{2},\d{1,9}(?:[+-]\d{2}:?\d{2}|Z)?)(?:\s(?P<msg>.*))?$"
)
_JOURNAL = re.compile(
    r"^(?P<ts>\d{4}-\d{2}-\d{2}T\d{2}:\d{2}:\d{2}(?:\.\d{1,9})?(?:[+-]\d{2}:?\d{2}|Z)?)"
    r"\s+(?P<host>\S+)\s+(?P<ident>[^\s:\[]+)(?:\[\d+\])?:(?:\s(?P<msg>.*))?$"
)
_CTIME = re.compile(
    r"^\[(?P<ts>[A-Z][a-z]{2} [A-Z][a-z]{2} +\d{1,2} \d{2}:\d{2}:\d{2}(?:\.\d+)? \d{4})\](?:\s(?P<msg>.*))?$"
)
_UPTIME = re.compile(r"^\[\s*(?P<up>\d{1,12}\.\d{1,9})\](?:\[\s*[TC]\d+\])?(?:\s(?P<msg>.*))?$")
#: ``dmesg --reltime``/``-H``/``--delta``: ``[  +0.000844]`` is the gap since the previous
#: message (or ``[Jan 3 07:39] `` with -H): no wall-clock time, read like plain dmesg.
_RELTIME = re.compile(r"^\[\s*\+\s*\d{1,12}\.\d{1,9}\](?:\s(?P<msg>.*))?$")
_SYSLOG = re.compile(
    r"^(?P<ts>(?:Jan|Feb|Mar|Apr|May|Jun|Jul|Aug|Sep|Oct|Nov|Dec) +\d{1,2} \d{2}:\d{2}:\d{2})"
    r"(?:\.(?P<frac>\d{1,9}))?\s+(?P<host>\S+)\s+(?P<ident>[^\s:\[]+)(?:\[\d+\])?:(?:\s(?P<msg>.*))?$"
)
_MONTHS = {m: i for i, m in enumerate("Jan Feb Mar Apr May Jun Jul Aug Sep Oct Nov Dec".split(), 1)}
_JOURNAL_MARKER = re.compile(r"^-- .* --$|^-- No entries --$")


@dataclass(slots=True)
class _Stamp:
    """What the front of one line says about when it was logged. The wall time is worked
    out only for lines that turn out to hold an event (most lines do not, and reading a
    date costs more than the rest of the line)."""

    fmt: str  # one of FORMATS
    message: str
    ts: str | None = None  # the timestamp text, for dmesg-iso, journal, dmesg-ctime, syslog
    frac: str | None = None  # syslog's optional fraction of a second
    uptime: float | None = None
    year: int | None = None  # for syslog: the year the builder assigned to this line
    kernel: bool = True  # False: a syslog/journal line from another program
    key: str | None = None  # identity of the stamp, for syslog's repeated-stamp pieces


def _safe_time(parse: Callable[[str], datetime | None], text: str) -> datetime | None:
    """timeparse may raise on extreme dates (year 9999 with a negative offset overflows);
    a parser must not, so such a stamp is just unreadable."""
    try:
        return parse(text)
    except (ValueError, OverflowError):
        return None


def _uptime(text: str | None) -> float | None:
    if text is None:
        return None
    value = float(text)
    return value if math.isfinite(value) else None


def _kernel_message(message: str) -> tuple[str, float | None]:
    """Syslog and journal lines may carry printk's own ``[uptime]`` after ``kernel:``."""
    match = _UPTIME.match(message)
    if match:
        return (match["msg"] or ""), _uptime(match["up"])
    return message, None


def _read_stamp(body: str) -> _Stamp:
    """Recognise the timestamp form at the start of a line (already unquoted and stripped)."""
    body = _RAW_LEVEL.sub("", _DECODE.sub("", body, count=1), count=1)
    match = _DMESG_ISO.match(body)
    if match:
        return _Stamp("dmesg-iso", (match["msg"] or "").strip(), ts=match["ts"])
    match = _JOURNAL.match(body)
    if match:
        message, uptime = _kernel_message((match["msg"] or "").strip())
        return _Stamp(
            "journal", message.strip(), ts=match["ts"], uptime=uptime, kernel=match["ident"] == "kernel",
        )
    match = _CTIME.match(body)
    if match:
        return _Stamp("dmesg-ctime", (match["msg"] or "").strip(), ts=match["ts"])
    match = _UPTIME.match(body)
    if match:
        return _Stamp("dmesg", (match["msg"] or "").strip(), uptime=_uptime(match["up"]))
    match = _RELTIME.match(body)
    if match:
        return _Stamp("dmesg", (match["msg"] or "").strip())
    match = _SYSLOG.match(body)
    if match:
        message, uptime = _kernel_message((match["msg"] or "").strip())
        return _Stamp(
            "syslog", message.strip(), ts=match["ts"], frac=match["frac"], uptime=uptime,
            kernel=match["ident"] == "kernel",
            key=f"{match['host']} {match['ts']} {uptime}" if uptime is not None else None,
        )
    return _Stamp("bare", body.strip())


def _wall_time(stamp: _Stamp, boot_time: datetime | None) -> datetime | None:
    """The stamp on the wall clock, or None when it cannot be placed there (or is broken)."""
    if stamp.fmt == "dmesg":
        return _after_boot(boot_time, stamp.uptime)
    if stamp.ts is None:
        return None
    if stamp.fmt in ("dmesg-iso", "journal"):
        return _safe_time(parse_iso, stamp.ts)
    if stamp.fmt == "dmesg-ctime":
        return _safe_time(parse_ctime, stamp.ts)
    if stamp.fmt == "syslog" and stamp.year is not None:
        year = stamp.year
        moment = _safe_time(lambda text: parse_syslog(text, year), stamp.ts)
        if moment is not None and stamp.frac:
            moment = moment.replace(microsecond=int(stamp.frac[:6].ljust(6, "0")))
        return moment
    return None


def _time_expected(stamp: _Stamp) -> bool:
    """Whether this stamp should have given a wall time (so None means it was broken)."""
    if stamp.fmt in ("dmesg-iso", "journal", "dmesg-ctime"):
        return True
    return stamp.fmt == "syslog" and stamp.year is not None


def _as_utc(moment: datetime) -> datetime:
    """The spec's rule: a time without a zone is UTC."""
    return moment.replace(tzinfo=UTC) if moment.tzinfo is None else moment.astimezone(UTC)


def _after_boot(boot_time: datetime | None, uptime: float | None) -> datetime | None:
    if boot_time is None or uptime is None:
        return None
    try:
        return boot_time + timedelta(seconds=uptime)
    except (OverflowError, ValueError):
        return None


# ------------------------------------------------------------------------------- messages

_PCI = r"[0-9a-fA-F]{4,8}:[0-9a-fA-F]{2}:[0-9a-fA-F]{2}"
#: Substrings that make a line an Xid / SXid report (or a damaged one).
_XID_MARK = "NVRM: Xid ("
_SXID_MARK = "SXid ("
_XID = re.compile(
    rf"NVRM: Xid \((?:PCI:)?(?P<pci>{_PCI})(?:\.[0-7])?(?P<attr>[^)]*)\): (?P<code>\d{{1,6}})(?P<rest>,.*)?$"
)
_MIG = re.compile(r"GPU-I:(?P<gi>\d+)(?:\s+GPU-CI:(?P<ci>\d+))?")
_PID = re.compile(r"pid=(?P<pid>'[^']*'|<[^>]*>|[^,\s]*)(?P<sep>,\s*|$)")
_NAME = re.compile(r"name=(?P<name>'[^']*'|<[^>]*>|[^,]*?)(?P<sep>,\s*|$)")
_SXID = re.compile(
    rf"(?P<switch>nvidia-nvswitch\d*): SXid \((?:PCI:)?(?P<pci>{_PCI})(?:\.[0-7])?[^)]*\): "
    rf"(?P<code>\d{{1,6}})(?P<rest>,.*)?$"
)
_SEVERITY = re.compile(r"^(?P<sev>Fatal|Non-fatal|Non-Fatal|Nonfatal|Non fatal)\b,?\s*", re.I)
_LINK = re.compile(r"\bLink (?P<link>\d{1,4})\b")
_ANY_PCI = re.compile(rf"(?<![0-9A-Za-z])(?P<pci>{_PCI})(?:\.[0-7])?(?![0-9A-Za-z])")
_PROBE_FAILED = (
    re.compile(rf"^nvidia: probe of (?P<pci>{_PCI})(?:\.[0-7])? failed with error -?\d+"),
    re.compile(rf"^nvidia (?P<pci>{_PCI})(?:\.[0-7])?: probe with driver nvidia failed with error -?\d+"),
)
#: The PCIe error handler giving up on a GPU after an uncorrected (fatal) error: the AER core
#: found no recovery callback in the nvidia driver, so the GPU stays off the bus until reset.
_PCIE_FATAL = re.compile(
    rf"^nvidia (?P<pci>{_PCI})(?:\.[0-7])?: (?:AER: can'?t recover|device has no AER-aware driver)"
)
#: NVRM messages that mean a GPU is gone, in the order they are tried.
_LOST_RULES: tuple[tuple[str, re.Pattern[str]], ...] = (
    ("fallen_off_bus", re.compile(r"fallen off the bus", re.I)),
    ("init_failed", re.compile(r"RmInitAdapter failed|rm_init_adapter failed", re.I)),
    ("reset_required", re.compile(r"needs? to be reset|requires? (?:a )?reset|reset (?:is )?required", re.I)),
    ("crash_dump", re.compile(r"GPU crash dump has been created", re.I)),
)


def normalize_pci(text: str) -> str | None:
    """``domain:bus:device`` in lower case with a 4-digit domain, from any of the spellings
    tools use (``PCI:0000:9b:00``, ``0000:5d:00.0``, nvidia-smi's ``00000000:9B:00.0``);
    the function number is dropped because the driver's Xid line never prints it."""
    match = _ANY_PCI.search(text.strip().removeprefix("PCI:"))
    if not match:
        return None
    domain, bus, device = match["pci"].split(":")
    return f"{domain[-4:]}:{bus}:{device}".lower()


@dataclass(frozen=True, slots=True)
class _XidFields:
    pid: int | None
    process: str | None
    message: str
    truncated: bool


def _unknown(value: str) -> bool:
    return value.strip("'\" ") in ("", "<unknown>", "unknown", "N/A")


def _xid_fields(rest: str) -> _XidFields:
    """Split what follows the Xid code. Drivers print ``pid=N, name=P, msg`` (since ~R525),
    ``pid=N, msg`` (older), or just ``msg`` (oldest). Every field is followed by a comma in a
    whole line, so a field that ends the line means the line was cut: its value is dropped
    rather than trusted (``pid=28`` may be the start of ``pid=2823801``)."""
    body = rest.lstrip(",").lstrip()
    pid: int | None = None
    process: str | None = None
    match = _PID.match(body)
    if match:
        if not match["sep"]:
            return _XidFields(None, None, "", True)
        value = match["pid"].strip("'\"")
        pid = int(value) if value.isdigit() else None
        body = body[match.end():]
        match = _NAME.match(body)
        if match:
            if not match["sep"]:
                return _XidFields(pid, None, "", True)
            process = None if _unknown(match["name"]) else match["name"].strip("'\" ")
            body = body[match.end():]
    return _XidFields(pid, process, body.strip(), not rest.strip(", "))


def _severity(word: str) -> str:
    return "Fatal" if word.lower() == "fatal" else "Non-fatal"


# -------------------------------------------------------------------------------- builder

_E = TypeVar("_E", XidEvent, SXidEvent, GpuLostEvent)


#: Every line of the head is read in full, so the log's timestamp format and its unstamped
#: lines are known; after that only lines that can hold or continue a GPU event are.
_FULL_READ_LINES = 2000
#: Substrings every event line holds: Xid and GPU-lost lines carry "NVRM", SXids "SXid",
#: probe failures "nvidia: probe of ..." / "... probe with driver nvidia failed". Plain `in`
#: tests are ~20x cheaper than reading the line's timestamp.


def _could_matter(raw: str, pending: bool) -> bool:
    if "NVRM" in raw or "Xid" in raw or "probe" in raw or "AER" in raw:
        return True
    # An indented (possibly quoted) line may continue the pending record.
    return pending and (raw[:1].isspace() or raw.startswith(">"))


@dataclass(slots=True)
class _Tally:
    """A count of lines of one sort and where the first was: a streaming parser keeps no
    list that grows with the input."""

    count: int = 0
    first: int | None = None

    def add(self, line: int) -> None:
        self.count += 1
        if self.first is None:
            self.first = line


@dataclass(slots=True)
class _Record:
    """One kernel record being assembled from its first line and any continuation lines."""

    line: int
    text: str
    stamp: _Stamp

    @property
    def message(self) -> str:
        return self.stamp.message


class _Builder:
    """Holds one pending record (continuations may follow it) and the result so far."""

    def __init__(self, boot_time: datetime | None, year: int | None) -> None:
        self.boot_time = _as_utc(boot_time) if boot_time is not None else None
        self.year = year
        self.result = KernelLog(boot_time_known=self.boot_time is not None)
        self.pending: _Record | None = None
        self.formats: Counter[str] = Counter()
        self.dropped: Counter[str] = Counter()
        self.first_dropped: dict[str, int] = {}
        self.unstamped = _Tally()
        self.bad_stamps = _Tally()
        self.gaps_dropped = 0
        self.record_index = 0
        self.last_gpu: tuple[int, str] | None = None
        self.syslog_month: int | None = None
        self.year_offset = 0

    # -- lines -------------------------------------------------------------------------

    def feed(self, number: int, raw: str) -> None:
        self.result.lines = number
        if number > _FULL_READ_LINES and not _could_matter(raw, self.pending is not None):
            # Fast path for the bulk of a multi-GB log: a line with no GPU marker that
            # cannot continue a pending record only ends that record.
            self._flush()
            return
        body = _QUOTE.sub("", raw, count=1)
        stripped = body.strip()
        if not stripped or _JOURNAL_MARKER.match(stripped) or stripped.startswith("```"):
            return
        stamp = _read_stamp(stripped)
        if self._continues(body, stripped, stamp):
            self._extend(stripped, stamp)
            return
        self._flush()
        if stamp.fmt == "syslog":
            stamp.year = self._syslog_year(stamp.ts or "")
        self.pending = _Record(number, raw, stamp)

    def _continues(self, body: str, stripped: str, stamp: _Stamp) -> bool:
        """dmesg/journalctl indent the rest of a multi-line record under it, unstamped;
        syslog gives every piece the record's own stamp (same host, time and uptime)."""
        pending = self.pending
        if pending is None or _XID_MARK in stripped or _SXID_MARK in stripped:
            return False
        if stamp.fmt == "bare":
            return body[:1].isspace() and pending.stamp.fmt != "bare"
        return (
            stamp.fmt == "syslog" and stamp.key is not None and stamp.key == pending.stamp.key
            and stamp.message.startswith("NVRM:") and pending.message.startswith("NVRM:")
            and not pending.message.rstrip().endswith((".", "!", "?"))
        )

    def _extend(self, stripped: str, stamp: _Stamp) -> None:
        pending = self.pending
        assert pending is not None
        if len(pending.stamp.message) >= _MAX_RECORD_CHARS:
            return
        raw_piece = stamp.message if stamp.fmt != "bare" else stripped
        piece = raw_piece
        if pending.message.startswith("NVRM:"):
            piece = piece.removeprefix("NVRM:").strip()
        pending.stamp.message = f"{pending.message} {piece}"[:_MAX_RECORD_CHARS]
        pending.text = f"{pending.text} {raw_piece}"[:_MAX_RECORD_CHARS]

    def _syslog_year(self, text: str) -> int | None:
        """Syslog has no year: with the caller's year (that of the log's first line), a
        month going backwards (Dec -> Jan) is taken as the turn of a year."""
        month = _MONTHS.get(text[:3])
        if month is not None:
            if self.syslog_month is not None and month < self.syslog_month - 6:
                self.year_offset += 1
            self.syslog_month = month
        return None if self.year is None else self.year + self.year_offset

    def _time(self, record: _Record) -> datetime | None:
        time = _wall_time(record.stamp, self.boot_time)
        if time is None and _time_expected(record.stamp):
            self.bad_stamps.add(record.line)
        return time

    # -- records -----------------------------------------------------------------------

    def _flush(self) -> None:
        record, self.pending = self.pending, None
        if record is None or not record.stamp.kernel:
            return
        self.record_index += 1
        self.formats[record.stamp.fmt] += 1
        if record.stamp.fmt == "bare":
            self.unstamped.add(record.line)
        self._extract(record)

    def _extract(self, record: _Record) -> None:
        message = record.message
        if _XID_MARK in message:
            self._xid(record)
        elif _SXID_MARK in message:
            self._sxid(record)
        else:
            self._gpu_lost(record)
        if message.startswith("NVRM:"):
            pci = normalize_pci(message)
            if pci is not None:
                self.last_gpu = (self.record_index, pci)

    def _xid(self, record: _Record) -> None:
        match = _XID.search(record.message)
        if not match:
            self._gap(f"unreadable Xid line: {clip(record.message, 120)!r}", record.line)
            return
        fields = _xid_fields(match["rest"] or "")
        if fields.truncated:
            self._gap("Xid line ends early (cut off?); its unfinished fields were not read", record.line)
        mig = _MIG.search(match["attr"] or "")
        code = int(match["code"])
        event = XidEvent(
            line=record.line, text=clip(record.text), time=self._time(record), uptime_s=record.stamp.uptime,
            pci=normalize_pci(match["pci"]) or match["pci"].lower(), code=code, pid=fields.pid,
            process=fields.process, message=fields.message, info=lookup(code),
            gpu_instance=int(mig["gi"]) if mig else None,
            compute_instance=int(mig["ci"]) if mig and mig["ci"] else None,
        )
        self._keep("Xid", self.result.xids, event)

    def _sxid(self, record: _Record) -> None:
        match = _SXID.search(record.message)
        if not match:
            self._gap(f"unreadable SXid line: {clip(record.message, 120)!r}", record.line)
            return
        rest = (match["rest"] or "").lstrip(",").strip()
        severity_match = _SEVERITY.match(rest)
        severity = _severity(severity_match["sev"]) if severity_match else None
        message = rest[severity_match.end():] if severity_match else rest
        link = _LINK.search(message) if severity is not None else None
        code = int(match["code"])
        event = SXidEvent(
            line=record.line, text=clip(record.text), time=self._time(record), uptime_s=record.stamp.uptime,
            pci=normalize_pci(match["pci"]) or match["pci"].lower(), code=code, severity=severity,
            link=int(link["link"]) if link else None, message=message.strip(),
            switch=match["switch"], info=lookup_sxid(code),
        )
        self._keep("SXid", self.result.sxids, event)

    def _gpu_lost(self, record: _Record) -> None:
        message = record.message
        reason, pci = _lost_reason(message)
        if reason is None:
            return
        if pci is None and self.last_gpu is not None:
            index, last = self.last_gpu
            if self.record_index - index <= _CONTEXT_RECORDS:
                pci = last
        event = GpuLostEvent(
            line=record.line, text=clip(record.text), time=self._time(record),
            uptime_s=record.stamp.uptime, pci=pci, reason=reason,
        )
        self._keep("GPU-lost", self.result.gpu_lost, event)

    # -- limits and gaps -----------------------------------------------------------------

    def _keep(self, kind: str, events: list[_E], event: _E) -> None:
        if len(events) < MAX_EVENTS:
            events.append(event)
            return
        self.dropped[kind] += 1
        self.first_dropped.setdefault(kind, event.line)

    def _gap(self, reason: str, line: int | None) -> None:
        if len(self.result.gaps) < _MAX_GAPS:
            self.result.gaps.append(Gap(reason, line))
        else:
            self.gaps_dropped += 1

    def finish(self) -> KernelLog:
        self._flush()
        result = self.result
        result.formats = dict(self.formats)
        if self.formats:
            stamped = {k: v for k, v in self.formats.items() if k != "bare"}
            result.format = max(stamped, key=stamped.__getitem__) if stamped else "bare"
        if self.unstamped.count and result.format != "bare":
            self._gap(
                f"{self.unstamped.count} line(s) had no kernel timestamp and were read as "
                f"time-unknown (first at line {self.unstamped.first})", self.unstamped.first,
            )
        if self.bad_stamps.count:
            self._gap(
                f"{self.bad_stamps.count} event line(s) had a timestamp that could not be read; "
                f"their time is unknown (first at line {self.bad_stamps.first})", self.bad_stamps.first,
            )
        for kind, count in self.dropped.items():
            result.gaps.append(
                Gap(f"{count} more {kind} event(s) not kept (limit {MAX_EVENTS})", self.first_dropped[kind])
            )
        if self.gaps_dropped:
            result.gaps.append(Gap(f"{self.gaps_dropped} more unreadable line(s) not listed"))
        return result


def _lost_reason(message: str) -> tuple[str | None, str | None]:
    """Which GPU-lost message this is, and the GPU it names (None when it names none)."""
    if message.startswith("nvidia"):
        for pattern in _PROBE_FAILED:
            match = pattern.match(message)
            if match:
                return "probe_failed", normalize_pci(match["pci"])
        match = _PCIE_FATAL.match(message)
        if match:
            return "pcie_fatal", normalize_pci(match["pci"])
    if not message.startswith("NVRM:"):
        return None, None
    for reason, pattern in _LOST_RULES:
        if pattern.search(message):
            found = _ANY_PCI.search(message)
            return reason, normalize_pci(found["pci"]) if found else None
    return None, None


# ------------------------------------------------------------------------------ public API


def parse(source: LineSource, *, boot_time: datetime | None = None, year: int | None = None) -> KernelLog:
    """Read a kernel log (any of the module's forms, mixed), keeping only GPU events.

    ``boot_time`` puts plain dmesg's seconds-since-boot on the wall clock; ``year`` does the
    same for syslog lines. Without them those events keep ``time=None`` (with ``uptime_s``
    where the line had it) rather than a guessed time.
    """
    builder = _Builder(boot_time, year)
    for number, raw in numbered_lines(source):
        builder.feed(number, raw)
    return builder.finish()


_DETECT_STAMP = re.compile(
    r"^(?:\d{4}-\d{2}-\d{2}T\d{2}:\d{2}:\d{2},\d{6}[+-]\d{2}:\d{2}\s"  # dmesg --time-format iso
    r"|\[\s*\d+\.\d{6}\](?:\[\s*[TC]\d+\])?\s"  # dmesg
    r"|\[\s*\+\s*\d+\.\d{6}\]\s"  # dmesg --reltime / --delta
    r"|\[[A-Z][a-z]{2} [A-Z][a-z]{2} +\d{1,2} \d{2}:\d{2}:\d{2} \d{4}\]\s"  # dmesg -T
    r"|\d{4}-\d{2}-\d{2}T\d{2}:\d{2}:\d{2}(?:\.\d+)?(?:[+-]\d{2}:?\d{2}|Z)?\s+\S+\s+kernel:\s"  # journal
    r"|[A-Z][a-z]{2} +\d{1,2} \d{2}:\d{2}:\d{2}(?:\.\d+)?\s+\S+\s+kernel:\s)"  # syslog
)


def detect(sample: str) -> float:
    """Certain on an Xid/SXid line (even a lone one without a timestamp); confident on NVRM
    lines or a file whose lines mostly carry kernel timestamps; NCCL and training logs carry
    none of these, so they score 0."""
    nonblank = stamped = 0
    nvrm = False
    for line in sample.splitlines()[:2000]:
        body = _QUOTE.sub("", line, count=1).strip()
        if not body:
            continue
        nonblank += 1
        if _XID.search(body) or _SXID.search(body):
            return 0.95
        nvrm = nvrm or "NVRM: " in body
        if _DETECT_STAMP.match(_RAW_LEVEL.sub("", _DECODE.sub("", body, count=1), count=1)):
            stamped += 1
    if not nonblank:
        return 0.0
    ratio = stamped / nonblank
    if nvrm and stamped:
        return 0.9
    if stamped >= 3 and ratio >= 0.6:
        return 0.8
    if nvrm:
        return 0.6
    if stamped and ratio >= 0.3:
        return 0.4
    return 0.0


def _span(events: Sequence[XidEvent | SXidEvent | GpuLostEvent]) -> str:
    times = [e.time for e in events if e.time is not None]
    unknown = len(events) - len(times)
    if not times:
        return "time unknown"
    text = f"{iso(min(times))} .. {iso(max(times))}"
    return text + (f" (+{unknown} of unknown time)" if unknown else "")


def _clock(log: KernelLog) -> str:
    """Whether the events can be placed in the incident window: that decides if they count."""
    events: list[XidEvent | SXidEvent | GpuLostEvent] = [*log.xids, *log.sxids, *log.gpu_lost]
    if not events:
        if log.format in ("dmesg-iso", "dmesg-ctime", "journal") or (log.format == "dmesg" and log.boot_time_known):
            return "wall-clock"
        return "unknown" if log.format in ("dmesg", "syslog", "bare") else "-"
    known = sum(1 for e in events if e.time is not None)
    if known == len(events):
        return "wall-clock"
    if known == 0:
        hint = {"dmesg": " (seconds since boot; boot time not given)", "syslog": " (syslog has no year)"}
        return "unknown" + hint.get(log.format, "")
    return f"mixed ({known} of {len(events)} events on the wall clock)"


def summarize(log: KernelLog) -> list[str]:
    """What was read, then every Xid/SXid code with its meaning and class, and lost GPUs."""
    lines = [f"kernel log: {log.lines} lines, format {log.format}, times {_clock(log)}"]
    if log.xids:
        pcis = ", ".join(sorted({e.pci for e in log.xids}))
        lines.append(f"Xid: {len(log.xids)} event(s) on {pcis}; {_span(log.xids)}")
        for code, count in sorted(Counter(e.code for e in log.xids).items()):
            info = lookup(code)
            flag = ", implicates the GPU" if info.implicates_gpu else ""
            lines.append(f"  Xid {code} {info.name} [{info.category}{flag}]: {count}")
    if log.sxids:
        switches = ", ".join(sorted({f"{e.switch} {e.pci}" for e in log.sxids}))
        lines.append(f"SXid: {len(log.sxids)} event(s) on {switches}; {_span(log.sxids)}")
        for code, count in sorted(Counter(e.code for e in log.sxids).items()):
            info = lookup_sxid(code)
            fatal = sum(1 for e in log.sxids if e.code == code and e.severity == "Fatal")
            lines.append(f"  SXid {code} {info.name} [{'fatal' if info.fatal else 'non-fatal'}]: "
                         f"{count} line(s), {fatal} marked Fatal")
    for event in log.gpu_lost:
        when = iso(event.time) or (f"uptime {event.uptime_s}s" if event.uptime_s is not None else "time unknown")
        lines.append(f"GPU lost: {event.reason} on {event.pci or 'unknown GPU'} at {when} (line {event.line})")
    if not (log.xids or log.sxids or log.gpu_lost):
        lines.append("no Xid, SXid or lost-GPU messages")
    if log.gaps:
        lines.append(f"{len(log.gaps)} gap(s): {log.gaps[0].reason}")
    return lines


KIND = register(
    Kind(
        name="kernel-log",
        description="kernel log (dmesg iso/-T/plain, journalctl -k, syslog): NVIDIA Xid, SXid, lost GPUs",
        command="dmesg --time-format iso",
        parse=parse,
        detect=detect,
        summarize=summarize,
        streaming=True,
    )
)

#: Wall-clock times first (``--time-format iso`` needs util-linux 2.24+ and may need root
#: under ``kernel.dmesg_restrict``); journald's copy next (current boot only: an Xid from a
#: previous boot is history); ``dmesg -T``; plain ``dmesg`` last, whose events count as
#: "time unknown". The kernel ring buffer bounds the size.
REMOTE = register_remote(RemoteProbe(
    name="kernel", filename="kernel.log",
    command=("dmesg --time-format iso 2>/dev/null || journalctl -k -b -o short-iso-precise --no-pager -q "
             "2>/dev/null || dmesg -T 2>/dev/null || dmesg"),
    kind="kernel-log", order=20, max_bytes=32 << 20, keep="tail",
))
