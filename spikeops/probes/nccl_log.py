"""NCCL ``NCCL_DEBUG=INFO`` output, PyTorch distributed (c10d / ProcessGroupNCCL) errors,
and the node's NCCL version file.

A loss spike that every rank shows at once often starts in the communication layer: an IB
completion error that NCCL retried into a hang, a watchdog that killed a collective, a rank
that never joined an AllReduce, or one node running a different NCCL build. This module reads
what those layers print, in the shapes they really print it:

- NCCL's own lines, ``host:pid:tid [cudaDev] NCCL INFO|WARN ...``. WARNs carry the source
  location (``transport/net_ib.cc:1296``) and, since 2.23, a ``[%F %T]`` wall-clock stamp;
  NCCL 2.7-2.11 print the version as a bare ``NCCL version 2.10.3+cuda11.3`` line with no
  host prefix, on the rank that made the unique id.
- PyTorch lines, raw (``RuntimeError: NCCL error in: ...``, the ``TORCH_NCCL_DESYNC_DEBUG``
  report) or behind c10/glog prefixes (``[E ProcessGroupNCCL.cpp:475]``,
  ``E1129 18:01:02.123456  1234 ProcessGroupNCCL.cpp:616]``). glog stamps have no year, so
  their time is only placed on the clock when the caller supplies one.
- Launcher prefixes that wrap all of the above: ``srun -l`` task ids (``12: ``), torchrun's
  ``[default3]:`` / ``[rank3]:`` tags and the ISO or bracketed stamps some wrappers add.

Everything else in a log (training output, bash traces) is ignored without a gap: the bundle's
``nccl.log`` is a grep of a bigger log, and a training log handed to this parser must still
yield its NCCL lines.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from spikeops.probes import base
from spikeops.probes.base import RemoteProbe, Gap, Kind, LineSource, clip, numbered_lines, register, to_number, register_remote
from spikeops.timeparse import parse_iso

__all__ = [
    "REMOTE", "REMOTE_VERSION",
    "strip_launcher",
    "EVENT_KINDS",
    "NcclEvent",
    "NcclProcess",
    "NcclLog",
    "NcclVersion",
    "parse",
    "parse_version",
    "normalise_version",
    "detect",
    "detect_version",
    "summarize",
    "summarize_version",
    "KIND",
    "VERSION_KIND",
]

#: Events of one kind kept per log (the shared limit; a module global so tests can lower it).
MAX_EVENTS = base.MAX_EVENTS

#: Every ``NcclEvent.kind`` this parser emits; the diagnosis matches on these names.
EVENT_KINDS: tuple[str, ...] = (
    "warn",
    "ib_completion_error",
    "ib_port_error",
    "system_error",
    "internal_error",
    "invalid_usage",
    "remote_error",
    "connection_error",
    "watchdog_timeout",
    "desync",
    "cuda_error",
    "timeout",
    "abort",
)

# --------------------------------------------------------------------------------------
# Result types
# --------------------------------------------------------------------------------------


@dataclass
class NcclEvent:
    """One line (or one wrapped WARN) that says something went wrong in communication.

    ``rank`` is the global rank when the line or its process tells it; ``time`` is None when
    the line carries no stamp that can be put on the wall clock (``stamp`` keeps the raw one).
    """

    kind: str
    line: int
    text: str
    time: datetime | None = None
    host: str | None = None
    pid: int | None = None
    rank: int | None = None
    cuda_dev: int | None = None
    details: dict[str, Any] = field(default_factory=dict)
    stamp: str | None = None


@dataclass
class NcclProcess:
    """What NCCL told about one process (one ``host:pid``), usually one rank on one GPU.

    A process may sit in several communicators (data, tensor, pipeline groups); ``comms``
    keeps each one's ``(rank, nranks)`` and ``rank``/``nranks`` come from the largest, which
    is the world communicator when there is one.
    """

    host: str
    pid: int
    first_line: int
    cuda_dev: int | None = None
    rank: int | None = None
    nranks: int | None = None
    bus_id: str | None = None
    version: str | None = None
    version_raw: str | None = None
    network: str | None = None
    net_devices: list[str] = field(default_factory=list)
    net_plugin: str | None = None
    bootstrap: str | None = None
    transports: list[str] = field(default_factory=list)
    comms: dict[str, tuple[int, int]] = field(default_factory=dict)

    @property
    def key(self) -> str:
        return f"{self.host}:{self.pid}"


@dataclass
class NcclLog:
    """Processes, NCCL versions and communication events read from one log.

    ``versions`` maps a normalised version to the ``host:pid`` keys that printed it; ``""``
    stands for a version line no process can be tied to (a PyTorch exception, a bare line
    at the top of a log).
    """

    processes: dict[str, NcclProcess] = field(default_factory=dict)
    versions: dict[str, set[str]] = field(default_factory=dict)
    events: list[NcclEvent] = field(default_factory=list)
    lines: int = 0
    gaps: list[Gap] = field(default_factory=list)

    def versions_by_host(self) -> dict[str, set[str]]:
        """Host → versions seen there; a mismatch across hosts is a diagnosis of its own."""
        by_host: dict[str, set[str]] = {}
        for version, keys in self.versions.items():
            for key in keys:
                host = key.rsplit(":", 1)[0] if key else ""
                by_host.setdefault(host, set()).add(version)
        return by_host

    def events_of(self, kind: str) -> list[NcclEvent]:
        return [event for event in self.events if event.kind == kind]


@dataclass
class NcclVersion:
    """The node's NCCL version as ``nccl-version.txt`` states it, normalised to ``X.Y.Z``."""

    version: str | None
    raw: str
    line: int | None
    gaps: list[Gap] = field(default_factory=list)


# --------------------------------------------------------------------------------------
# Versions
# --------------------------------------------------------------------------------------

_TUPLE_VERSION = re.compile(r"\(\s*(\d{1,2})\s*,\s*(\d{1,3})\s*,\s*(\d{1,3})\s*\)")
_DOTTED_VERSION = re.compile(r"(?<![\d.])v?(\d{1,2})\.(\d{1,3})\.(\d{1,3})(?!\.?\d)")
_DOTTED_IN_NAME = re.compile(r"(?<!\d)(\d{1,2})\.(\d{1,3})\.(\d{1,3})(?!\.?\d)")
_INT_CODE = re.compile(r"\s*(\d{4,5})\s*")


def _from_code(code: int) -> str | None:
    """``NCCL_VERSION_CODE`` as old torch returns it: ``X*1000+Y*100+Z`` before 2.9
    (2708 → 2.7.8), ``X*10000+Y*100+Z`` from 2.9 on (21805 → 2.18.5)."""
    if 2000 <= code <= 2899:
        return f"{code // 1000}.{(code % 1000) // 100}.{code % 100}"
    if 20900 <= code <= 39999:
        return f"{code // 10000}.{(code % 10000) // 100}.{code % 100}"
    return None


def normalise_version(text: str) -> str | None:
    """``"2.18.5"`` from any way a node states its NCCL version, None when it states none.

    Accepts ``2.18.5``, ``2.18.5+cuda12.2``, ``(2, 18, 5)``, ``NCCL version 2.18.5+cuda12.2``,
    ``libnccl.so.2.18.5`` and the integer code old torch returns (``21805``, ``2708``). The
    CUDA suffix is dropped so a log line and the version file compare equal.
    """
    if not isinstance(text, str):
        return None
    text = text[:4096]
    match = _TUPLE_VERSION.search(text)
    if match is None:
        match = _DOTTED_VERSION.search(text)
    if match is None and "libnccl" in text:
        match = _DOTTED_IN_NAME.search(text.split("libnccl", 1)[1])
    if match is not None:
        major, minor, patch = (int(part) for part in match.groups())
        if 1 <= major <= 9:
            return f"{major}.{minor}.{patch}"
        return None
    code = _INT_CODE.fullmatch(text)
    if code is not None:
        return _from_code(int(code[1]))
    return None


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


# --------------------------------------------------------------------------------------
# Event rules
# --------------------------------------------------------------------------------------

_DIST_CONTEXT = re.compile(
    r"NCCL|nccl|c10d|ProcessGroup|torch\.distributed|Dist\w*Error|WorkNCCL|[Gg]loo|TCPStore|"
    r"[Rr]endezvous|\[(?:PG [^\]]*)?Rank \d+\]"
)
_RULES: tuple[tuple[str, re.Pattern[str], bool], ...] = (
    # (kind, pattern, needs a distributed context on a non-NCCL line); first match wins.
    ("cuda_error", re.compile(r"\bCUDA error: |\bCuda failure\b|\bCUDA failure\b"), False),
    (
        "ib_completion_error",
        re.compile(r"Got completion from peer|Got CQE with error|\bIBV_WC_[A-Z_]*ERR\b"),
        False,
    ),
    (
        # The HCA's own asynchronous events: the port (the cable, the switch port) went bad.
        "ib_port_error",
        re.compile(
            r"Got async event\s*:\s*(?:port error|link (?:down|error)|port (?:down|inactive))"
            r"|\bIBV_EVENT_(?:PORT_ERR|LINK_DOWN)\b"
        ),
        False,
    ),
    (
        "abort",
        re.compile(
            r"NCCL communicator was aborted|\bncclCommAbort\b|[Aa]borting (?:the )?(?:NCCL )?communicator"
            r"|taking the entire process down|watchdog thread terminated with exception"
        ),
        False,
    ),
    ("watchdog_timeout", re.compile(r"[Cc]aught collective operation timeout"), False),
    ("system_error", re.compile(r"unhandled system error|\bncclSystemError\b"), False),
    (
        "remote_error",
        re.compile(r"\bncclRemoteError\b|remote process exited or there was a network error"),
        False,
    ),
    (
        "invalid_usage",
        re.compile(
            r"\bncclInvalidUsage\b|\bncclInvalidArgument\b|NCCL error.{0,300}?\binvalid (?:usage|argument)\b"
        ),
        False,
    ),
    (
        "internal_error",
        re.compile(
            r"unhandled cuda error|\bncclUnhandledCudaError\b|\bncclInternalError\b"
            r"|NCCL error.{0,300}?\binternal error\b"
        ),
        False,
    ),
    (
        "connection_error",
        re.compile(
            r"\bConnect to \S+ failed|Connection refused|Connection reset by peer"
            r"|[Cc]onnection closed by (?:remote )?peer|\bNo route to host\b|Broken pipe"
        ),
        True,
    ),
    (
        "timeout",
        re.compile(
            r"\bNCCL timeout\b|\b[Tt]imed out\b|\bTIMED OUT\b|\bSocket Timeout\b|\bTimeout at NCCL work\b"
            r"|\b[Tt]imeout waiting\b"
        ),
        True,
    ),
)

_RANK_IN_TEXT = re.compile(r"\[(?:PG [^\[\]]{0,80}?)?Rank (\d+)\]|\bon rank (\d+)\b")
_WORK = re.compile(r"WorkNCCL\(((?:[^()]|\([^()]*\))*)\)")
_WORK_FIELD = re.compile(r"(\w+(?:\(\w+\))?)=(\[[^\]]*\]|[^,\s)]+)")
_RAN_FOR = re.compile(r"ran for (\d+) milliseconds")
_WORK_KEYS = {
    "SeqNum": "seq",
    "OpType": "op",
    "NumelIn": "numel_in",
    "NumelOut": "numel_out",
    "Timeout(ms)": "timeout_ms",
    "TensorShape": "tensor_shape",
}
_WORK_PROGRESS = re.compile(
    r"Timeout at NCCL work: (\d+), last enqueued NCCL work: (-?\d+), last completed NCCL work: (-?\d+)"
)

#: ``enum ibv_wc_status`` from libibverbs' verbs.h, for lines that print only the number.
_IBV_WC_STATUS = (
    "IBV_WC_SUCCESS", "IBV_WC_LOC_LEN_ERR", "IBV_WC_LOC_QP_OP_ERR", "IBV_WC_LOC_EEC_OP_ERR",
    "IBV_WC_LOC_PROT_ERR", "IBV_WC_WR_FLUSH_ERR", "IBV_WC_MW_BIND_ERR", "IBV_WC_BAD_RESP_ERR",
    "IBV_WC_LOC_ACCESS_ERR", "IBV_WC_REM_INV_REQ_ERR", "IBV_WC_REM_ACCESS_ERR",
    "IBV_WC_REM_OP_ERR", "IBV_WC_RETRY_EXC_ERR", "IBV_WC_RNR_RETRY_EXC_ERR",
    "IBV_WC_LOC_RDD_VIOL_ERR", "IBV_WC_REM_INV_RD_REQ_ERR", "IBV_WC_REM_ABORT_ERR",
    "IBV_WC_INV_EECN_ERR", "IBV_WC_INV_EEC_STATE_ERR", "IBV_WC_FATAL_ERR",
    "IBV_WC_RESP_TIMEOUT_ERR", "IBV_WC_GENERAL_ERR", "IBV_WC_TM_ERR", "IBV_WC_TM_RNDV_INCOMPLETE",
)
_IB_PEER = re.compile(r"from peer\s+(?!with\b)(\S+?)(?:<(\d+)>)?,?\s+with\b")
_IB_STATUS = re.compile(r"with error (\d+)|\bstatus=(?:(\w+)\()?(\d+)\)?")
_IB_OPCODE = re.compile(r"\bopcode[ =](?:(\w+)\()?(\d+)\)?")
_IB_LEN = re.compile(r"\blen[ =](\d+)")
_IB_VENDOR = re.compile(r"\bvendor[ _]err[ =](0x[0-9a-fA-F]+|\d+)(?:\s+\((\w+)\))?")
_IB_HCA = re.compile(r"\bhca (\S+)")
_IB_LOCAL_GID = re.compile(r"\blocalGid\s+(\S+)")
_IB_REMOTE_GID = re.compile(r"\bremoteGids?\s*(\S+)")
_IB_QP = re.compile(r"\bqp_num=(\d+)")
_IB_NAME = re.compile(r"\bIBV_WC_[A-Z_]*ERR\b")

_CUDA_ERROR = re.compile(r"\bCUDA error: (.+?)\s*$")
_CUDA_FAILURE = re.compile(r"\bCuda failure (?:(\d+) )?'([^']*)'")
_NCCL_ERROR_IN = re.compile(r"NCCL error in: (\S+?:\d+)")
_ERROR_TYPE = re.compile(r"^([\w.]+(?:Error|Exception)):")
_CONNECT_PEER = re.compile(
    r"\b(?:Connect to|from|to|peer)\s+(\[?[\w.:%-]{1,255}?\]?)<(\d{1,5})>|\bConnect to (\S{1,255}?) failed"
)
_FAILED_REASON = re.compile(r"failed\s*:\s*(.+?)\s*$")
_TIMEOUT_AFTER = re.compile(r"after (\d+(?:\.\d+)?)\s*(?:s\b|sec|seconds)")

_DESYNC_AT = re.compile(r"(?:\[(\d+)\]\s+)?Timeout at collective: (\w+), #(\d+)")
_DESYNC_NOT_FINISHED = re.compile(r"\[([\d,\s]+)\] joined but didn't finish collective #(\d+)")
_DESYNC_NOT_JOINED = re.compile(
    r"\[([\d,\s]+)\] finished collective #(\d+), but didn't join collective #(\d+)"
)
_DESYNC_NEVER = re.compile(r"ranks \[([\d,\s]+)\] are the lagging ranks that caused this timeout")

_COMM = re.compile(r"\bcomm (0x[0-9a-fA-F]{1,32}) rank (\d{1,9}) nranks (\d{1,9})\b", re.I)
#: A process may open a communicator per parallel group; thousands would only cost memory.
_MAX_COMMS = 256
_EXPLANATION = re.compile(r"^(nccl[A-Z]\w*(?:Error|Usage|Argument)):\s*(.*)$")
_TERMINATE = re.compile(r"terminate called after throwing an instance of '([^']+)'")
_FRAME = re.compile(r"^\s*(?:frame #\d+:|Exception raised from\s+(.+?)\s*(?:\(most recent call first\):?)?$)")
_WATCHDOG_FRAME = re.compile(
    r"ProcessGroupNCCL::(?:workCleanupLoop|ncclCommWatchdog|watchdogHandler|Watchdog)|ncclCommWatchdog"
)
_STACK_LIKE = re.compile(r"^\s*(?:\[|\+ |Traceback|File \"|[\w.]+(?:Error|Exception)\b|frame #)")


def _ranks(text: str) -> list[int]:
    return [int(part) for part in re.findall(r"\d+", text)]


def _work_details(message: str) -> dict[str, Any]:
    """Fields of ``WorkNCCL(SeqNum=2, OpType=ALLREDUCE, ..., Timeout(ms)=8000)`` by our names."""
    details: dict[str, Any] = {}
    work = _WORK.search(message)
    if work:
        for key, value in _WORK_FIELD.findall(work[1]):
            name = _WORK_KEYS.get(key)
            if name is None:
                continue
            number = to_number(value) if name != "op" and not value.startswith("[") else None
            details[name] = number if number is not None else value
    ran = _RAN_FOR.search(message)
    if ran:
        details["ran_ms"] = int(ran[1])
    progress = _WORK_PROGRESS.search(message)
    if progress:
        details["seq"] = int(progress[1])
        details["last_enqueued"] = int(progress[2])
        details["last_completed"] = int(progress[3])
    return details


def _ib_details(message: str) -> dict[str, Any]:
    """Peer, verbs status, opcode, length, vendor error and direction of a failed completion."""
    details: dict[str, Any] = {}
    peer = _IB_PEER.search(message)
    if peer:
        details["peer"] = peer[1]
        if peer[2]:
            details["peer_port"] = int(peer[2])
    status = _IB_STATUS.search(message)
    if status:
        code = int(status[1] or status[3])
        details["status"] = code
        name = status[2]
        if name is None and 0 <= code < len(_IBV_WC_STATUS):
            name = _IBV_WC_STATUS[code]
        if name is not None:
            details["status_name"] = name
    else:
        named = _IB_NAME.search(message)
        if named:
            details["status_name"] = named[0]
    opcode = _IB_OPCODE.search(message)
    if opcode:
        details["opcode"] = int(opcode[2])
        if opcode[1]:
            details["opcode_name"] = opcode[1]
    length = _IB_LEN.search(message)
    if length:
        details["len"] = int(length[1])
    vendor = _IB_VENDOR.search(message)
    if vendor:
        raw_vendor = vendor[1]
        details["vendor_err"] = (
            int(raw_vendor, 16) if raw_vendor.lower().startswith("0x") else int(raw_vendor)
        )
        if vendor[2]:
            details["direction"] = vendor[2]
    for name, pattern in (
        ("hca", _IB_HCA), ("local_gid", _IB_LOCAL_GID), ("remote_gid", _IB_REMOTE_GID),
    ):
        found = pattern.search(message)
        if found:
            details[name] = found[1]
    qp = _IB_QP.search(message)
    if qp:
        details["qp_num"] = int(qp[1])
    return details


def _nccl_error_details(message: str, phrase: str) -> dict[str, Any]:
    details: dict[str, Any] = {"reason": phrase}
    version = _ANY_VERSION.search(message)
    if version:
        details["nccl_version"] = normalise_version(version[1])
    where = _NCCL_ERROR_IN.search(message)
    if where:
        details["where"] = where[1]
    error_type = _ERROR_TYPE.match(message.strip())
    if error_type:
        details["error_type"] = error_type[1]
    return details


def _connection_details(message: str, phrase: str) -> dict[str, Any]:
    details: dict[str, Any] = {}
    peer = _CONNECT_PEER.search(message)
    if peer:
        details["peer"] = peer[1] or peer[3]
        if peer[2]:
            details["peer_port"] = int(peer[2])
    reason = _FAILED_REASON.search(message)
    details["reason"] = reason[1] if reason else phrase
    return details


def _details_for(kind: str, message: str, phrase: str) -> dict[str, Any]:
    """The values a person would read off a line of this kind, by stable names."""
    if kind == "ib_completion_error":
        return _ib_details(message)
    if kind == "cuda_error":
        failure = _CUDA_FAILURE.search(message)
        if failure:
            details: dict[str, Any] = {"error": failure[2]}
            if failure[1]:
                details["code"] = int(failure[1])
            return details
        error = _CUDA_ERROR.search(message)
        return {"error": error[1].rstrip(".") if error else phrase}
    if kind in ("system_error", "internal_error", "invalid_usage", "remote_error"):
        return _nccl_error_details(message, phrase)
    if kind == "connection_error":
        return _connection_details(message, phrase)
    details = _work_details(message)
    details["reason"] = phrase
    if kind == "timeout":
        after = _TIMEOUT_AFTER.search(message)
        if after:
            details["after_s"] = to_number(after[1])
    return details


def _classify(message: str, context: bool) -> tuple[str, dict[str, Any]] | None:
    """First rule that matches; generic phrases (timeouts, refused connections) count only
    where the line is about distributed communication, so a wandb retry is not an NCCL fault."""
    for kind, pattern, needs_context in _RULES:
        match = pattern.search(message)
        if match is None or (needs_context and not context):
            continue
        return kind, _details_for(kind, message, match[0].strip())
    return None


def _text_rank(message: str) -> int | None:
    match = _RANK_IN_TEXT.search(message)
    if match is None:
        return None
    return int(match[1] or match[2])


# --------------------------------------------------------------------------------------
# The streaming reader
# --------------------------------------------------------------------------------------


@dataclass
class _PendingWarn:
    """A WARN held back one line: NCCL messages get wrapped (by terminals, by documents),
    and the tail of a wrapped IB error holds its vendor error and direction."""

    number: int
    raw: str
    message: str
    prefixed: _Line
    host: str | None
    pid: int | None
    cuda_dev: int | None
    rank_hint: int | None
    source: str | None
    func: str | None
    continuation: list[str] = field(default_factory=list)


class _Reader:
    """State for one pass over a log; every method is total (never raises on odd text)."""

    def __init__(self, year: int | None) -> None:
        self.year = year
        self.log = NcclLog()
        self.counts: dict[str, int] = {}
        self.dropped: dict[str, int] = {}
        self.recognised = 0
        self.binary_lines = 0
        self.first_binary: int | None = None
        self.pending: _PendingWarn | None = None
        self.last_process_by_tag: dict[str, str] = {}
        self.last_event: NcclEvent | None = None
        self.last_event_tag = ""
        self.block: NcclEvent | None = None
        self.block_tag = ""
        self.desync: dict[str, Any] | None = None
        self.terminate: tuple[str, int, str] | None = None
        self.after_last_error: tuple[int, str] | None = None

    # -- events -------------------------------------------------------------------------

    def emit(self, event: NcclEvent, tag: str) -> None:
        count = self.counts.get(event.kind, 0)
        if count >= MAX_EVENTS:
            self.dropped[event.kind] = self.dropped.get(event.kind, 0) + 1
            return
        self.counts[event.kind] = count + 1
        self.log.events.append(event)
        self.last_event = event
        self.last_event_tag = tag

    # -- processes ----------------------------------------------------------------------

    def process(self, host: str, pid: int, number: int) -> NcclProcess:
        key = f"{host}:{pid}"
        proc = self.log.processes.get(key)
        if proc is None:
            proc = NcclProcess(host=host, pid=pid, first_line=number)
            self.log.processes[key] = proc
        return proc

    def add_version(self, raw: str, key: str) -> None:
        version = normalise_version(raw)
        if version is None:
            return
        self.log.versions.setdefault(version, set()).add(key)
        proc = self.log.processes.get(key) if key else None
        if proc is not None and proc.version is None:
            proc.version, proc.version_raw = version, raw

    def read_info(self, proc: NcclProcess, message: str) -> None:
        """What an INFO line says about its process: version, rank, network, transports."""
        text = message.strip()
        version = _BARE_VERSION.fullmatch(text)
        if version:
            self.add_version(version[1], proc.key)
            return
        comm = _COMM.search(text)
        if comm:
            rank, nranks = int(comm[2]), int(comm[3])
            if len(proc.comms) < _MAX_COMMS or comm[1] in proc.comms:
                proc.comms[comm[1]] = (rank, nranks)
            if proc.nranks is None or nranks > proc.nranks:
                proc.rank, proc.nranks = rank, nranks
                dev = re.search(r"\bcudaDev (\d+)", text)
                bus = re.search(r"\bbusId (\w+)", text)
                if dev:
                    proc.cuda_dev = int(dev[1])
                if bus:
                    proc.bus_id = bus[1]
            return
        network = re.match(r"Using network (.+?)\s*$", text)
        if network:
            proc.network = network[1]
            return
        net = re.match(r"NET/(\w+)\s*:\s*Using (.*)$", text)
        if net:
            if proc.network is None:
                proc.network = net[1]
            if not proc.net_devices:
                devices = net[2].split(";", 1)[0]
                proc.net_devices = re.findall(r"\[\d+\](\S+)", devices)[:32]
            return
        if text.startswith("NET/OFI"):
            if proc.network is None:
                proc.network = "OFI"
            plugin = re.search(r"Initializing (aws-ofi-nccl \S+)", text)
            if plugin:
                proc.net_plugin = plugin[1]
            return
        bootstrap = re.match(r"Bootstrap\s*:\s*Using (.+?)\s*$", text)
        if bootstrap:
            proc.bootstrap = bootstrap[1]
            return
        via = re.search(r"\bvia (\S+)", text)
        if via and len(proc.transports) < 16:
            transport = re.sub(r"/\d+$", "", via[1])
            if transport not in proc.transports:
                proc.transports.append(transport)

    # -- WARN lines (held one line for their wrapped tail) ------------------------------

    def flush_warn(self) -> None:
        pending, self.pending = self.pending, None
        if pending is None:
            return
        message = " ".join([pending.message.strip(), *pending.continuation]).strip()
        text = " ".join([pending.raw.strip(), *pending.continuation])
        kind, details = _classify(message, context=True) or ("warn", {})
        details["message"] = clip(message)
        if pending.source:
            details["source"] = pending.source
        if pending.func:
            details["func"] = pending.func
        self.add_launcher(details, pending.prefixed)
        event = NcclEvent(
            kind=kind, line=pending.number, text=clip(text), time=pending.prefixed.time,
            host=pending.host, pid=pending.pid, rank=pending.rank_hint,
            cuda_dev=pending.cuda_dev, details=details, stamp=pending.prefixed.stamp,
        )
        self.emit(event, pending.prefixed.tag)

    def continues_warn(self, prefixed: _Line) -> bool:
        """A wrapped WARN's tail: right after it, same launcher tag, no record prefix of its
        own, short, and not shaped like any other kind of log line."""
        pending = self.pending
        if pending is None or len(pending.continuation) >= 2:
            return False
        body = prefixed.body.strip()
        if not body or len(body) > 300 or prefixed.stamped or prefixed.tag != pending.prefixed.tag:
            return False
        if _BINARY.search(body):
            return False
        if _NCCL.match(body) or _BARE_VERSION.fullmatch(body) or _STACK_LIKE.match(body):
            return False
        return _classify(body, context=False) is None

    @staticmethod
    def add_launcher(details: dict[str, Any], prefixed: _Line) -> None:
        if prefixed.task is not None:
            details["task"] = prefixed.task
        if prefixed.local_rank is not None:
            details["local_rank"] = prefixed.local_rank
        if prefixed.severity is not None:
            details["severity"] = prefixed.severity
        if prefixed.logger is not None:
            details["logger"] = prefixed.logger

    # -- one line -----------------------------------------------------------------------

    def feed(self, number: int, raw: str) -> None:
        self.log.lines = number
        if _BINARY.search(raw):
            self.binary_lines += 1
            if self.first_binary is None:
                self.first_binary = number
        raw = raw[:_MAX_LINE]
        prefixed = _strip(raw, self.year)
        if self.pending is not None:
            if self.continues_warn(prefixed):
                self.pending.continuation.append(prefixed.body.strip())
                return
            self.flush_warn()
        body = prefixed.body.strip()
        if not body:
            return
        nccl = _NCCL.match(body)
        if nccl:
            self.recognised += 1
            self.nccl_line(number, raw, nccl, prefixed)
            return
        if _NCCL_START.match(body):
            self.log.gaps.append(Gap(f"unreadable NCCL line: {body[:80]!r}", number))
            return
        loose = _NCCL_LOOSE.match(body)
        if loose:
            self.recognised += 1
            self.loose_line(number, raw, loose, prefixed)
            return
        if _NCCL_LEVEL.search(body):
            self.log.gaps.append(Gap(f"unreadable NCCL line: {body[:80]!r}", number))
            return
        bare = _BARE_VERSION.fullmatch(body)
        if bare:
            self.recognised += 1
            self.add_version(bare[1], self.last_process_by_tag.get(prefixed.tag, ""))
            return
        self.other_line(number, raw, body, prefixed)

    def nccl_line(self, number: int, raw: str, match: re.Match[str], prefixed: _Line) -> None:
        host, pid = match["host"], int(match["pid"])
        proc = self.process(host, pid, number)
        self.last_process_by_tag[prefixed.tag] = proc.key
        mid = _NCCL_MID.match(match["mid"].strip())
        dev = int(mid["dev"]) if mid and mid["dev"] is not None else None
        if dev is not None and proc.cuda_dev is None:
            proc.cuda_dev = dev
        if match["level"] in ("WARN", "ERROR", "ABORT"):
            rank_hint = int(mid["rank"]) if mid and mid["rank"] else prefixed.rank
            self.pending = _PendingWarn(
                number=number, raw=raw, message=match["msg"], prefixed=prefixed, host=host,
                pid=pid, cuda_dev=dev, rank_hint=rank_hint,
                source=mid["src"] if mid else None, func=mid["func"] if mid else None,
            )
            return
        self.read_info(proc, match["msg"])

    def loose_line(self, number: int, raw: str, match: re.Match[str], prefixed: _Line) -> None:
        """An NCCL line without its process prefix: no host or pid, but the same message (a
        WARN still waits one line for its wrapped tail; an INFO may state the version)."""
        message = match["msg"]
        if match["level"] in ("WARN", "ERROR", "ABORT"):
            self.pending = _PendingWarn(
                number=number, raw=raw, message=message, prefixed=prefixed, host=None, pid=None,
                cuda_dev=None, rank_hint=prefixed.rank, source=None, func=None,
            )
            return
        version = _BARE_VERSION.fullmatch(message.strip())
        if version:
            self.add_version(version[1], self.last_process_by_tag.get(prefixed.tag, ""))

    def other_line(self, number: int, raw: str, body: str, prefixed: _Line) -> None:
        """PyTorch and launcher lines: versions, exceptions, desync reports, stack frames."""
        frame = _FRAME.match(body)
        if frame:
            self.annotate_block(frame, body, prefixed.tag)
            return
        self.block = None
        terminate = _TERMINATE.search(body)
        if terminate:
            self.terminate = (terminate[1], number, prefixed.tag)
            self.recognised += 1
            return
        version = _ANY_VERSION.search(body)
        if version:
            self.recognised += 1
            self.add_version(version[1], "")
        if self.explain(number, body, prefixed.tag):
            return
        if self.desync_line(number, raw, body, prefixed):
            return
        context = bool(
            _DIST_CONTEXT.search(body)
            or (prefixed.logger and _DIST_CONTEXT.search(prefixed.logger))
            or (self.after_last_error and self.after_last_error[0] == number - 1)
        )
        self.after_last_error = (number, prefixed.tag) if body == "Last error:" else None
        classified = _classify(body, context)
        if classified is None:
            return
        self.recognised += 1
        kind, details = classified
        self.add_launcher(details, prefixed)
        rank = _text_rank(body)
        if rank is None:
            rank = prefixed.rank
        if kind in ("watchdog_timeout", "timeout", "abort") and rank is not None:
            details.setdefault("rank", rank)
        if self.terminate and self.terminate[2] == prefixed.tag and number - self.terminate[1] <= 3:
            details["exception"] = self.terminate[0]
        self.terminate = None
        event = NcclEvent(
            kind=kind, line=number, text=clip(raw), time=prefixed.time, rank=rank,
            details=details, stamp=prefixed.stamp,
        )
        self.emit(event, prefixed.tag)
        self.block, self.block_tag = event, prefixed.tag

    def annotate_block(self, frame: re.Match[str], body: str, tag: str) -> None:
        """Stack frames under an exception tell which thread raised it: a CUDA error caught by
        ProcessGroupNCCL's watchdog is a GPU fault surfacing through NCCL, not a NCCL bug."""
        event = self.block
        if event is None or tag != self.block_tag:
            return
        if frame[1]:
            event.details.setdefault("raised_from", frame[1])
        if _WATCHDOG_FRAME.search(body):
            event.details["thread"] = "watchdog"

    def explain(self, number: int, body: str, tag: str) -> bool:
        """``ncclSystemError: System call ... failed.`` right under the exception it explains
        belongs to that event rather than being a second one."""
        match = _EXPLANATION.match(body)
        event = self.last_event
        if match is None or event is None:
            return False
        if event.line < number - 2 or self.last_event_tag != tag or event.host is not None:
            return False
        event.details.setdefault("nccl_error", match[1])
        event.details["explanation"] = clip(match[2])
        self.recognised += 1
        return True

    def desync_line(self, number: int, raw: str, body: str, prefixed: _Line) -> bool:
        """``TORCH_NCCL_DESYNC_DEBUG`` report: the ranks that lagged, and on which collective."""
        at = _DESYNC_AT.search(body)
        if at:
            self.recognised += 1
            self.desync = {
                "line": number, "tag": prefixed.tag, "op": at[2], "collective": int(at[3]),
                "reporting_rank": int(at[1]) if at[1] else _text_rank(body),
            }
            return True
        details: dict[str, Any]
        not_joined = _DESYNC_NOT_JOINED.search(body)
        not_finished = _DESYNC_NOT_FINISHED.search(body)
        never = _DESYNC_NEVER.search(body)
        if not_joined:
            details = {
                "lagging_ranks": _ranks(not_joined[1]), "state": "finished_not_joined",
                "finished": int(not_joined[2]), "collective": int(not_joined[3]),
            }
        elif not_finished:
            details = {
                "lagging_ranks": _ranks(not_finished[1]), "state": "joined_not_finished",
                "collective": int(not_finished[2]),
            }
        elif never:
            details = {"lagging_ranks": _ranks(never[1]), "state": "never_joined"}
        else:
            return False
        self.recognised += 1
        context = self.desync
        rank = None
        if context and context["tag"] == prefixed.tag and number - context["line"] <= 20:
            details.setdefault("collective", context["collective"])
            details["op"] = context["op"]
            details["reporting_rank"] = context["reporting_rank"]
            rank = context["reporting_rank"]
        self.add_launcher(details, prefixed)
        event = NcclEvent(
            kind="desync", line=number, text=clip(raw), time=prefixed.time, rank=rank,
            details=details, stamp=prefixed.stamp,
        )
        self.emit(event, prefixed.tag)
        return True

    # -- the end ------------------------------------------------------------------------

    def finish(self) -> NcclLog:
        self.flush_warn()
        for event in self.log.events:
            if event.host is None or event.pid is None:
                continue
            proc = self.log.processes.get(f"{event.host}:{event.pid}")
            if proc is not None:
                if event.rank is None:
                    event.rank = proc.rank
                if event.cuda_dev is None:
                    event.cuda_dev = proc.cuda_dev
        for kind, count in sorted(self.dropped.items()):
            self.log.gaps.append(Gap(f"{count} more {kind} events not kept (limit {MAX_EVENTS})"))
        if self.binary_lines:
            self.log.gaps.append(
                Gap(f"{self.binary_lines} lines with binary or undecodable bytes", self.first_binary)
            )
        if not self.recognised and not self.log.processes:
            self.log.gaps.append(Gap("no NCCL or PyTorch distributed lines found"))
        return self.log


def parse(source: LineSource, year: int | None = None) -> NcclLog:
    """Read NCCL and PyTorch distributed lines from a log, streaming, never raising.

    ``year`` places glog stamps (``E1129 18:01:02.123456``) on the wall clock; without it
    their events keep the raw stamp and ``time`` stays None.
    """
    reader = _Reader(year)
    try:
        for number, line in numbered_lines(source):
            try:
                reader.feed(number, line if isinstance(line, str) else str(line))
            except Exception as exc:  # a rule bug must cost one line, not the whole log
                reader.pending = None
                reader.log.gaps.append(Gap(f"line not read ({type(exc).__name__})", number))
    except Exception as exc:  # the source itself failed (a broken iterator)
        reader.log.gaps.append(Gap(f"input ended early ({type(exc).__name__})", reader.log.lines + 1))
    return reader.finish()


# --------------------------------------------------------------------------------------
# nccl-version.txt
# --------------------------------------------------------------------------------------

_STRICT_VERSION_FORMS = re.compile(
    r"v?[1-3]\.\d{1,2}\.\d{1,2}(?:[+-][\w.+-]*)?"
    r"|\(\s*[1-3]\s*,\s*\d{1,2}\s*,\s*\d{1,2}\s*\)"
    r"|NCCL version:?\s*v?[1-3]\.\d{1,2}\.\d{1,2}\S*"
    r"|.*\blibnccl\.so\.[1-3]\.\d{1,2}\.\d{1,2}\b.*"
)
_MAX_VERSION_LINES = 1000


def parse_version(source: LineSource) -> NcclVersion:
    """Read ``nccl-version.txt``: the first line stating a version in one of the known forms
    wins; a second, different version or a file stating none becomes a gap."""
    best: tuple[int, int, str, str] | None = None  # (priority, line, raw, version)
    versions: dict[str, int] = {}
    last_text = ""
    gaps: list[Gap] = []
    try:
        for number, line in numbered_lines(source):
            if number > _MAX_VERSION_LINES:
                gaps.append(Gap(f"only the first {_MAX_VERSION_LINES} lines read", number))
                break
            text = line.strip()
            if not text:
                continue
            last_text = text
            version = normalise_version(text)
            if version is None:
                continue
            if _STRICT_VERSION_FORMS.fullmatch(text) or _INT_CODE.fullmatch(text):
                priority = 0
            elif "nccl" in text.lower():
                priority = 1
            else:
                priority = 2
            versions.setdefault(version, number)
            if best is None or priority < best[0]:
                best = (priority, number, text, version)
    except Exception as exc:
        gaps.append(Gap(f"input ended early ({type(exc).__name__})"))
    if best is None:
        gaps.append(Gap(f"no NCCL version found: {last_text[:120]!r}" if last_text else "empty file"))
        return NcclVersion(version=None, raw=clip(last_text), line=None, gaps=gaps)
    for version, number in versions.items():
        if version != best[3]:
            gaps.append(Gap(f"another NCCL version {version} ignored", number))
    return NcclVersion(version=best[3], raw=clip(best[2]), line=best[1], gaps=gaps)


# --------------------------------------------------------------------------------------
# Detection and summaries
# --------------------------------------------------------------------------------------

_TORCH_MARKER = re.compile(
    r"ProcessGroupNCCL|[Cc]aught collective operation timeout|WorkNCCL\(|\bnccl[A-Z]\w*Error\b"
    r"|\bc10d\b|NCCL error in:|didn't join collective|Timeout at collective|\bc10::\w*Error\b"
    r"|\bCUDA error: |torch\.distributed\.\w*Error|NCCL communicator was aborted"
)
_TRAINING = re.compile(
    r"\biteration\s+\d+.*\blm loss\b|\bLoss: ?-?[\d.]|\bloss[=:]\s*-?[\d.]|'loss':\s*-?[\d.]"
)
_KERNEL = re.compile(r"NVRM:|\bkernel:|^\s*\[\s*\d+\.\d+\]")


def detect(sample: str) -> float:
    """NCCL lines and PyTorch distributed errors; only a moderate claim on a training log that
    merely carries some (the training parser owns those), none on kernel logs."""
    lines = [line for line in sample.splitlines()[:4000] if line.strip()]
    if not lines:
        return 0.0
    nccl = torch = training = kernel = bare = 0
    for line in lines:
        body = _strip(line, None).body.strip()
        if _NCCL.match(body) or _NCCL_LOOSE.match(body):
            nccl += 1
        elif _BARE_VERSION.fullmatch(body):
            bare += 1
        elif _TORCH_MARKER.search(body):
            torch += 1
        if _TRAINING.search(line):
            training += 1
        if _KERNEL.search(line):
            kernel += 1
    ours = nccl + torch
    if ours == 0:
        return 0.2 if bare else 0.0
    if kernel > ours:
        return 0.0
    share = ours / len(lines)
    if training >= 2 or (training and share < 0.5):
        return 0.5
    if share >= 0.3 or ours >= 20:
        return 0.95
    if share >= 0.1:
        return 0.8
    return 0.4


def detect_version(sample: str) -> float:
    """Only a tiny file that is nothing but a version in a known form; a bare integer code
    is a weak guess (many one-number files exist)."""
    if len(sample) > 1024:
        return 0.0
    lines = [line.strip() for line in sample.splitlines() if line.strip()]
    if not lines or len(lines) > 5:
        return 0.0
    score = 0.0
    for line in lines:
        if _STRICT_VERSION_FORMS.fullmatch(line) and normalise_version(line):
            score = max(score, 0.9)
        elif _INT_CODE.fullmatch(line) and normalise_version(line):
            score = max(score, 0.45)
    return score


def _ranges(numbers: list[int]) -> str:
    """``0-7,16-31``: rank lists are long, their holes are what matters."""
    if not numbers:
        return "none"
    ordered = sorted(set(numbers))
    spans: list[tuple[int, int]] = []
    for number in ordered:
        if spans and number == spans[-1][1] + 1:
            spans[-1] = (spans[-1][0], number)
        else:
            spans.append((number, number))
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in spans)


def summarize(log: NcclLog) -> list[str]:
    hosts = sorted({proc.host for proc in log.processes.values()})
    ranks = [proc.rank for proc in log.processes.values() if proc.rank is not None]
    nranks = sorted({proc.nranks for proc in log.processes.values() if proc.nranks is not None})
    lines = [
        f"{log.lines} lines: {len(log.processes)} NCCL processes on {len(hosts)} hosts, "
        f"ranks {_ranges(ranks)}" + (f" of {'/'.join(map(str, nranks))}" if nranks else "")
    ]
    networks = sorted({proc.network for proc in log.processes.values() if proc.network})
    if networks:
        lines.append(f"  network: {', '.join(networks)}")
    by_host = log.versions_by_host()
    if len(log.versions) > 1:
        spread = "; ".join(
            f"{version} on {', '.join(sorted({k.rsplit(':', 1)[0] or '?' for k in keys}))}"
            for version, keys in sorted(log.versions.items())
        )
        lines.append(f"  !! MIXED NCCL VERSIONS: {spread}")
    elif log.versions:
        (version,) = log.versions
        hosts_stating = sorted(host for host in by_host if host)
        where = f"printed on {', '.join(hosts_stating)}" if hosts_stating else "from an error message"
        lines.append(f"  NCCL {version} ({where})")
    for kind in EVENT_KINDS:
        events = log.events_of(kind)
        if events:
            where = ", ".join(str(event.line) for event in events[:5])
            more = " ..." if len(events) > 5 else ""
            lines.append(f"  {kind}: {len(events)} (lines {where}{more})")
    if log.gaps:
        lines.append(f"  {len(log.gaps)} gaps")
    return lines


def summarize_version(result: NcclVersion) -> list[str]:
    if result.version is None:
        return [f"no NCCL version read ({result.gaps[0].reason if result.gaps else 'empty'})"]
    return [f"NCCL {result.version} (line {result.line}: {result.raw})"]


KIND = register(
    Kind(
        name="nccl-log",
        description="NCCL_DEBUG=INFO lines and PyTorch distributed (c10d/ProcessGroupNCCL) errors: "
        "processes, ranks, NCCL versions, network, WARNs, IB errors, watchdog timeouts, desyncs",
        command="the job's NCCL_DEBUG=INFO and PyTorch distributed lines",
        parse=parse,
        detect=detect,
        summarize=summarize,
        streaming=True,
    )
)

VERSION_KIND = register(
    Kind(
        name="nccl-version",
        description="the node's NCCL version (torch.cuda.nccl.version(), libnccl.so.X.Y.Z, ...)",
        command="python3 -c 'import torch; print(torch.cuda.nccl.version())'",
        parse=parse_version,
        detect=detect_version,
        summarize=summarize_version,
        streaming=False,
    )
)

#: The NCCL and torch.distributed lines of the job's logs on this node (the inventory's
#: ``[job] nccl_log``); the newest lines are kept when they exceed the cap, since the
#: failure is at the end.
REMOTE = register_remote(RemoteProbe(
    name="nccl", filename="nccl.log",
    command="grep -h -a -E 'NCCL|ProcessGroupNCCL|c10d|torch\\.distributed|Watchdog' {files}",
    kind="nccl-log", order=60, max_bytes=64 << 20, keep="tail", needs="nccl_log",
))
#: The NCCL version of the job's environment; the inventory's ``[job] nccl_version`` replaces it.
REMOTE_VERSION = register_remote(RemoteProbe(
    name="nccl-version", filename="nccl-version.txt",
    command=("python3 -c 'import torch; print(torch.cuda.nccl.version())' 2>/dev/null || "
             "ls -1 /usr/lib/*/libnccl.so.2.* /usr/local/lib/libnccl.so.2.* /usr/lib64/libnccl.so.2.*"
             " 2>/dev/null | head -n 1 | grep ."),
    kind="nccl-version", order=70, max_bytes=64 << 10,
))
