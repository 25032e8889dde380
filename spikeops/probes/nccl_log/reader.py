"""The streaming reader: one pass over a log of any size, events per process and rank."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any
from spikeops.probes.base import Gap, LineSource, clip, numbered_lines
from spikeops.probes.nccl_log.model import (
    MAX_EVENTS,
    EVENT_KINDS,
    NcclEvent,
    NcclProcess,
    NcclLog,
)
from spikeops.probes.nccl_log.version import (
    normalise_version,
)
from spikeops.probes.nccl_log.lines import (
    _NCCL,
    _NCCL_MID,
    _NCCL_START,
    _NCCL_LOOSE,
    _NCCL_LEVEL,
    _BARE_VERSION,
    _ANY_VERSION,
    _MAX_LINE,
    _BINARY,
    _Line,
    _strip,
)
from spikeops.probes.nccl_log.events import (
    _DIST_CONTEXT,
    _DESYNC_AT,
    _DESYNC_NOT_FINISHED,
    _DESYNC_NOT_JOINED,
    _DESYNC_NEVER,
    _COMM,
    _MAX_COMMS,
    _EXPLANATION,
    _TERMINATE,
    _FRAME,
    _WATCHDOG_FRAME,
    _STACK_LIKE,
    _ranks,
    _classify,
    _text_rank,
)

__all__ = ["parse", "detect", "summarize"]


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
