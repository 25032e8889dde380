"""Hardware and scheduler errors that the training job printed itself.

When a GPU dies under a job, the first (and often the only) trace anyone has is what the job
printed: PyTorch's ``RuntimeError: CUDA error: uncorrectable ECC error encountered``, an older
``cuda runtime error (39)``, TensorFlow's ``CUDA_ERROR_ECC_UNCORRECTABLE``, an ``NVRM: Xid``
line echoed by a wrapper, ``nvidia-smi`` saying a GPU ``is lost``, NCCL or the IB stack saying
a port went down, Slurm's ``srun: error: Node failure on NODE``. These are evidence for the
hardware layer like the node-side probes are, and people paste exactly these lines into
issue threads. This parser reads them from any log (``train.log``, a node's ``train.log`` or
``nccl.log``), behind whatever launcher prefix (``[rank12]:``, ``[default3]:``, ``12: ``,
``[1,0]<stdout>:``) or timestamp.

Every event says who printed it as far as the line tells: the global rank (``[rank12]:``,
``Rank 12``, srun's task id), the local rank (``[default3]:``), a CUDA device ordinal
(``CUDA device ordinal 0``, NCCL's ``[3]``), a PCI address, a host (NCCL's ``host:pid:tid``
prefix, Slurm's node names). Which node that makes it is the diagnosis's business: it knows
the job's rank map. Times are kept when the line carries one; a line without is "this run".

The kinds (``JobError.kind``):

- ``ecc_uncorrectable``: CUDA reports an uncorrectable ECC error (a GPU memory fault);
- ``xid``: an ``NVRM: Xid`` line in the job's output (``code`` from the line);
- ``gpu_lost``: a GPU fallen off the bus / lost / needing a reset, as the driver or nvidia-smi
  words it in the job's output;
- ``ib_port_error``: the InfiniBand port went down or erred (``Got async event : port error``,
  ``IBV_EVENT_PORT_ERR``, ``link down``);
- ``node_failure``: the scheduler says a node failed (``srun: error: Node failure on X``,
  ``... DUE TO NODE FAILURE``);
- ``cuda_launch_failure``: ``unspecified launch failure`` (a kernel died: a GPU fault or a
  program bug; never enough alone to blame the GPU);
- ``cuda_device_error``: other CUDA errors that can mean a bad device: ``an illegal memory
  access`` / ``an illegal instruction was encountered``, and ``CUDA error: unknown error``
  (what the NCCL watchdog raises when a GPU dies under it); a program bug can print them too,
  so they point at the device, never convict it alone;
- ``checkpoint_load``: the job could not read a checkpoint (``PytorchStreamReader failed
  reading zip archive: failed finding central directory``, ``Error(s) in loading
  state_dict``, a safetensors header error); ``details["path"]`` is the checkpoint when a
  line nearby names it;
- ``checkpoint_save``: the job could not write one (``No space left on device`` or a quota
  while saving, ``PytorchStreamWriter failed writing``): the checkpoint left behind is cut
  short; ``disk_full``: the same disk errors away from any saving (not checkpoint evidence).

A kernel line copied into the job's log with its syslog prefix (``May 19 07:08:57 gpu-17
kernel: NVRM: Xid ...``) names its host, and its time carries no year: ``parse(...,
reference=...)`` dates it in the incident's year, or the year before when that would put it
in the future (without a reference its time stays unknown).
"""

from __future__ import annotations

import re
from collections import deque
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from spikeops.probes.base import MAX_EVENTS, Gap, Kind, LineSource, clip, numbered_lines, register
from spikeops.probes import kernel_log
from spikeops.probes.kernel_log import normalize_pci
from spikeops.probes.nccl_log import strip_launcher
from spikeops.timeparse import parse_yearless

__all__ = ["JOB_ERROR_KINDS", "JobError", "JobErrors", "parse", "detect", "summarize", "KIND"]

#: Every ``JobError.kind`` this parser emits.
JOB_ERROR_KINDS = ("ecc_uncorrectable", "xid", "gpu_lost", "ib_port_error", "node_failure", "cuda_launch_failure",
                   "cuda_device_error", "checkpoint_load", "checkpoint_save", "disk_full")


@dataclass
class JobError:
    """One error line the job printed, with whatever the line says about where it happened."""

    kind: str
    line: int
    text: str
    time: datetime | None = None
    rank: int | None = None
    local_rank: int | None = None
    device: int | None = None
    pci: str | None = None
    host: str | None = None
    code: int | None = None
    details: dict[str, Any] = field(default_factory=dict)


@dataclass
class JobErrors:
    events: list[JobError] = field(default_factory=list)
    lines: int = 0
    gaps: list[Gap] = field(default_factory=list)
    #: Python exceptions the job raised (``RuntimeError: ...``), counted; the last one kept:
    #: not hardware evidence, but what a person reading the log wants to know first.
    exceptions: int = 0
    last_exception: str | None = None
    last_exception_line: int | None = None

    def of(self, kind: str) -> list[JobError]:
        return [event for event in self.events if event.kind == kind]


_PCI = r"[0-9a-fA-F]{4,8}:[0-9a-fA-F]{2}:[0-9a-fA-F]{2}(?:\.[0-7])?"
#: The rules are the phrasings of the error itself, never a counter's name: a health check the
#: job prints (``uncorrectable ECC errors: 0``) is not an error.
_RULES: tuple[tuple[str, re.Pattern[str]], ...] = (
    ("ecc_uncorrectable", re.compile(
        r"uncorrectable ECC error (?:encountered|was detected|detected)|CUDA_ERROR_ECC_UNCORRECTABLE"
        r"|cudaErrorECCUncorrectable", re.I)),
    ("xid", re.compile(rf"NVRM: Xid \((?:PCI:)?(?P<pci>{_PCI})[^)]*\):\s*(?P<code>\d{{1,4}})\b")),
    ("gpu_lost", re.compile(
        r"fallen off the bus|\bGPU is lost\b|GPU has been lost|Unable to determine the device handle for GPU"
        r"|\bGPU (?:\S+ )?(?:needs to be reset|requires (?:a )?reset)", re.I)),
    ("ib_port_error", re.compile(
        r"Got async event\s*:\s*(?:port error|link (?:down|error)|port (?:down|inactive))"
        r"|\bIBV_EVENT_(?:PORT_ERR|LINK_DOWN|DEVICE_FATAL)\b|\bib\d*: link (?:is )?down\b"
        r"|\bmlx\d_\d+:? (?:port \d+ )?link (?:is )?down", re.I)),
    ("node_failure", re.compile(
        r"\bNode failure on (?P<host>[\w.\[\],-]+)|DUE TO NODE FAILURE|\bNODE_FAIL\b", re.I)),
    ("cuda_launch_failure", re.compile(r"unspecified launch failure|CUDA_ERROR_LAUNCH_FAILED", re.I)),
    ("cuda_device_error", re.compile(
        r"an illegal (?:memory access|instruction) was encountered|cudaErrorIllegal(?:Address|Instruction)\b"
        r"|CUDA_ERROR_ILLEGAL_(?:ADDRESS|INSTRUCTION)\b|CUDA error: unknown error|\bcudaErrorUnknown\b", re.I)),
    ("checkpoint_load", re.compile(
        r"PytorchStreamReader failed reading|failed finding central directory|Error\(s\) in loading state_dict"
        r"|SafetensorError: Error while deserializing|\bHeaderTooLarge\b|\bMetadataIncompleteBuffer\b"
        r"|\bInvalidHeader(?:Deserialization)?\b|UnpicklingError: invalid load key", re.I)),
    ("checkpoint_save", re.compile(r"PytorchStreamWriter failed writing|SafetensorError: Error while serializing", re.I)),
    ("disk_full", re.compile(r"No space left on device|\[Errno 28\]|\bStorageFull\b|Disk quota exceeded|\[Errno 122\]",
                             re.I)),
)
#: Words of a line that is saving a checkpoint (a traceback frame or the job's own message).
_SAVING = re.compile(r"\bsav(?:e|ing)\b|torch\.save|_save\b|serializ|save_pretrained|save_checkpoint|write_record"
                     r"|checkpoint_hook|safe_save", re.I)
#: Words of a line about loading a checkpoint (where the job says which one).
_LOADING = re.compile(r"\bload(?:ing|ed)?\b|resum|restor|torch\.load|from_pretrained", re.I)
#: A checkpoint's path as jobs print it: a file with a checkpoint extension, or a directory
#: named like one (``global_step1200``, ``checkpoint-500``, ``step-12000``).
_CKPT_PATH = re.compile(
    r"(?P<path>(?:[A-Za-z]:\\|~?/|\.{1,2}/)?[\w.@+-]+(?:[/\\][\w.@+-]+)*\.(?:pth?|ckpt|bin|safetensors|pkl|tar|distcp)\b"
    r"|(?:[A-Za-z]:\\|~?/|\.{1,2}/)?(?:[\w.@+-]+[/\\])*(?:checkpoint|ckpt|global_step|iter|step|epoch)[-_]?\d+\b/?)",
    re.I,
)
#: Lines of the job's output looked back at for the checkpoint an error is about.
_CONTEXT_LINES = 30
#: A syslog prefix in front of a copied kernel or daemon line: its time (no year) and host.
_SYSLOG_PREFIX = re.compile(
    r"^(?P<ts>[A-Z][a-z]{2} +\d{1,2} \d{2}:\d{2}:\d{2})(?:\.\d+)? (?P<host>[A-Za-z][\w.-]{0,254}) "
    r"(?:kernel|[\w./-]+(?:\[\d+\])?):"
)
_RANK = re.compile(r"\[(?:PG [^\]]{0,80}?)?Rank (\d{1,7})\]|\b(?:global )?rank[ =:]?\s?(\d{1,7})\b", re.I)
_DEVICE = re.compile(
    r"\b(?:CUDA )?device(?: ordinal)?[ :=#]+(\d{1,3})\b|\bcuda:(\d{1,3})\b|\bGPU (\d{1,3})\b(?![:.])|\bcudaDev (\d{1,3})\b",
    re.I,
)
_EXCEPTION = re.compile(r"^(?:[\w.]+\.)?(?:[A-Z]\w*(?:Error|Exception)|KeyboardInterrupt|SystemExit)(?::\s|$)")
_PCI_ANY = re.compile(rf"(?<![0-9A-Za-z]){_PCI}(?![0-9A-Za-z])")
_NCCL_HOST = re.compile(r"^(?P<host>[A-Za-z][\w.-]{0,254}):\d{1,10}:\d{1,10}\s+\[(?P<dev>-?\d{1,6})\]")
_ON_HOST = re.compile(r"\b(?:on (?:host|node)|hostname[ =:]+|host[ =:]+)\s*(?P<host>[A-Za-z][\w.-]{0,254})", re.I)
_STEP_ON = re.compile(r"\bJOB \d+ ON (?P<host>[\w.-]+) CANCELLED", re.I)
#: A line longer than this is not read (rules read no further; a binary blob is not a log).
_MAX_LINE = 8192


def _first_int(match: re.Match[str] | None) -> int | None:
    if match is None:
        return None
    return next((int(group) for group in match.groups() if group is not None), None)


def _checkpoint_path(lines: list[str], wanted: re.Pattern[str]) -> str | None:
    """The newest checkpoint path on a line (the error's or one above it) whose words say
    it is being loaded or saved (``wanted``); None when no such line names one."""
    for line in reversed(lines):
        if not wanted.search(line):
            continue
        found = [m["path"] for m in _CKPT_PATH.finditer(line) if not m["path"].lower().endswith((".py", ".so"))]
        if found:
            return found[-1].rstrip("/.,:;'\"")
    return None


def _event(kind: str, match: re.Match[str], number: int, raw: str, body: str, said: dict[str, Any]) -> JobError:
    event = JobError(kind=kind, line=number, text=clip(raw), time=said.get("time"))
    event.rank = said.get("rank")
    if event.rank is None and said.get("task") is not None:
        event.rank = said["task"]  # srun -l: the task id is the global rank in SPMD launches
    if event.rank is None:
        event.rank = _first_int(_RANK.search(body))
    event.local_rank = said.get("local_rank")
    nccl = _NCCL_HOST.match(body)
    if nccl is not None:
        event.host = nccl["host"]
        event.device = int(nccl["dev"]) if int(nccl["dev"]) >= 0 else None
    if event.device is None:
        event.device = _first_int(_DEVICE.search(body))
    pci = _PCI_ANY.search(body)
    event.pci = normalize_pci(pci.group(0)) if pci else None
    groups = match.groupdict()
    if kind == "xid":
        event.code = int(groups["code"])
        event.pci = normalize_pci(groups["pci"])
    elif kind == "node_failure":
        host = groups.get("host") or (m["host"] if (m := _STEP_ON.search(body)) else None)
        event.host = host.rstrip(".,") if host else None
        event.details["named"] = bool(groups.get("host"))
    if event.host is None and kind != "node_failure":
        on = _ON_HOST.search(body)
        event.host = on["host"] if on else None
    event.details["message"] = clip(body, 300)
    return event


def _classify(body: str) -> tuple[str, re.Match[str]] | None:
    for kind, pattern in _RULES:
        match = pattern.search(body)
        if match is not None:
            return kind, match
    return None


def parse(source: LineSource, *, reference: datetime | None = None) -> JobErrors:
    """Read the hardware and scheduler errors a job printed, streaming, never raising.

    Several ranks print the same error: each line is kept (up to ``MAX_EVENTS`` per kind),
    because which ranks printed it is what ties it to a node. ``reference`` (the incident's
    time) dates syslog-stamped lines, which carry no year."""
    result = JobErrors()
    counts: dict[str, int] = {}
    dropped: dict[str, int] = {}
    recent: deque[str] = deque(maxlen=_CONTEXT_LINES)
    for number, raw in numbered_lines(source):
        result.lines = number
        if not raw or len(raw) > _MAX_LINE:
            continue
        recent.append(raw)
        if ("Error" in raw or "Exception" in raw) and _EXCEPTION.match(strip_launcher(raw)[0].strip()):
            result.exceptions += 1
            if result.last_exception is None or ": " in raw or ": " not in result.last_exception:
                result.last_exception, result.last_exception_line = clip(raw, 300), number
        # Cheap gate: every rule's text holds one of these (most lines hold none).
        lowered = raw.lower()
        if not any(key in lowered for key in ("ecc", "xid", "bus", "lost", "reset", "device", "async event",
                                              "ibv_event", "down", "node", "launch", "illegal", "unknown error",
                                              "stream", "state_dict", "safetensor", "header", "load key", "errno",
                                              "storagefull", "quota")):
            continue
        try:
            body, said = strip_launcher(raw)
            found = _classify(body)
            if found is None:
                continue
            kind, match = found
            context = list(recent)
            if kind == "disk_full" and any(_SAVING.search(line) for line in context):
                kind = "checkpoint_save"  # no space left while saving: the checkpoint is cut short
            if counts.get(kind, 0) >= MAX_EVENTS:
                dropped[kind] = dropped.get(kind, 0) + 1
                continue
            counts[kind] = counts.get(kind, 0) + 1
            event = _event(kind, match, number, raw, body.strip(), said)
            if kind in ("checkpoint_load", "checkpoint_save"):
                event.details["path"] = _checkpoint_path(context, _LOADING if kind == "checkpoint_load" else _SAVING)
            stamp = _SYSLOG_PREFIX.match(body.strip())
            if stamp is not None:
                event.host = event.host or stamp["host"]
                event.time = event.time or parse_yearless(stamp["ts"], reference)
                event.details["syslog_time"] = stamp["ts"]
            result.events.append(event)
        except Exception as exc:  # noqa: BLE001 - one odd line must not lose the rest
            result.gaps.append(Gap(f"line not read ({type(exc).__name__})", number))
    for kind, count in sorted(dropped.items()):
        result.gaps.append(Gap(f"{count} more {kind} lines not kept (limit {MAX_EVENTS})"))
    return result


def detect(sample: str) -> float:
    """A job's error output. Above a short NCCL excerpt (0.8) when it holds a GPU or node
    error (the hardware error is the news); below a real NCCL log, training log or kernel log
    (0.95); a bare traceback, which nothing else reads, weakly (so ``spikeops parse`` still
    says what it holds)."""
    hits: set[str] = set()
    traceback = False
    for line in sample.splitlines()[:4000]:
        found = _classify(line)
        if found is not None:
            hits.add(found[0])
        traceback = traceback or "Traceback (most recent call last)" in line or bool(_EXCEPTION.match(line.strip()))
    if hits and kernel_log.detect(sample) >= 0.5:
        return 0.3  # the driver's own lines in a kernel log: the kernel-log reader's
    if hits & {"ecc_uncorrectable", "xid", "gpu_lost", "node_failure"}:
        return 0.9
    if hits:
        return 0.6
    return 0.3 if traceback else 0.0


def summarize(result: JobErrors) -> list[str]:
    if not result.events:
        out = [f"{result.lines} lines: no hardware or scheduler errors printed by the job"]
    else:
        out = [f"{result.lines} lines: {len(result.events)} error line(s) the job printed"]
    for kind in JOB_ERROR_KINDS:
        events = result.of(kind)
        if not events:
            continue
        first = events[0]
        where = []
        for name in ("host", "rank", "local_rank", "device", "pci", "code"):
            value = getattr(first, name)
            if value is not None:
                where.append(f"{name.replace('_', ' ')} {value}")
        out.append(f"  {kind}: {len(events)} (first at line {first.line}"
                   + (f"; {', '.join(where)}" if where else "; names no host, rank or device") + ")")
    if result.exceptions:
        out.append(f"  {result.exceptions} Python exception line(s); last at line {result.last_exception_line}: "
                   f"{result.last_exception}")
    if result.gaps:
        out.append(f"  {len(result.gaps)} gap(s), first: {result.gaps[0].reason}")
    return out


KIND = register(
    Kind(
        name="job-errors",
        description="hardware and scheduler errors the job printed: CUDA ECC errors, echoed Xids, lost GPUs, "
                    "IB port errors, Slurm node failures",
        command="the job's stdout/stderr log",
        parse=parse,
        detect=detect,
        summarize=summarize,
        streaming=True,
    )
)
