"""What the job printed (its logs, the nodes' ``train.log`` and ``nccl.log``), read from the
end and only on the lines that can hold an error."""

from __future__ import annotations

import bisect
import re
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any
from spikeops.diagnosis.evidence.metrics import (
    _count_newlines,
)

__all__ = ["JOB_OUTPUT_TAIL", "JobOutput", "read_job_output"]


# ------------------------------------------------------------------------------ job output

#: What the job printed is read from its end: a crash, an ECC error, a watchdog timeout are
#: the last things a failing job prints, and a weeks-long log must not cost the diagnosis.
JOB_OUTPUT_TAIL = 8 << 20


@dataclass
class JobOutput:
    """The errors one log of the job's own output holds: its NCCL / PyTorch-distributed
    events and the hardware and scheduler errors it printed. ``node`` is the node the file
    belongs to (``nodes/NODE/train.log``); None for the bundle's own ``train.log``."""

    file: str
    node: str | None
    nccl: Any = None
    errors: Any = None
    notes: list[str] = field(default_factory=list)


def _tail_text(path: Path, limit: int) -> tuple[int, str]:
    """(number of the first line kept, the text of the last ``limit`` bytes, whole lines)."""
    size = path.stat().st_size
    with open(path, "rb") as handle:
        start = max(0, size - limit)
        skipped = 0
        if start:
            skipped = _count_newlines(handle, start)
            handle.seek(start)
            handle.readline()  # the partial line the cut fell in
            skipped += 1
        text = handle.read().decode("utf-8", errors="replace")
    return skipped + 1, text


#: Words one of which every line the NCCL reader or the error reader acts on holds: the
#: readers cost ~0.1 ms a line, a training log is mostly step lines, so only the lines that
#: can matter (and the line after each: a wrapped message's tail) are handed to them, as the
#: collector's own grep does for nccl.log.
_GATE = (
    "NCCL", "nccl", "c10d", "ProcessGroup", "atchdog", "DistBackendError", "torch.distributed", "Connection",
    "Broken pipe", "No route", "imed out", "TIMED OUT", "imeout", "terminate called", "CUDA error", "uda failure",
    "CUDA failure", "Last error", "completion", "async event", "IBV_", "collective", "Socket", "what():",
    "Exception", "frame #", "ECC", "Xid", "fallen off", "GPU is lost", "been lost", "device handle", "reset",
    "link down", "link is down", "Node failure", "NODE FAIL", "NODE_FAIL", "launch failure", "LAUNCH_FAILED", "Error",
    # device-pointing CUDA errors; checkpoints that could not be loaded or written, and the
    # lines around them that say which checkpoint (loading it, saving it)
    "illegal", "PytorchStream", "central directory", "state_dict", "afetensor", "HeaderTooLarge", "No space left",
    "Errno", "StorageFull", "quota", "load key", "checkpoint", "ckpt", "save", "Saving", "serializ", "oading", "resum",
)
#: Lines one keyword may let through (a log full of one word is not read line by line).
_GATE_LIMIT = 200_000


def _gated(text: str) -> tuple[list[int], list[str]]:
    """(0-based line indexes, lines) of the lines the gate lets through, each with the next.
    Plain ``str.find`` per keyword: a scan in C, where one regex alternation of them costs
    seconds on a 16 MiB tail."""
    starts = [0] + [match.end() for match in re.finditer("\n", text)]
    lines_total = len(starts)
    wanted: set[int] = set()
    for key in _GATE:
        position, found = text.find(key), 0
        while position >= 0 and found < _GATE_LIMIT:
            index = bisect.bisect_right(starts, position) - 1
            wanted.update((index, index + 1))
            found += 1
            following = starts[index + 1] if index + 1 < lines_total else len(text)
            position = text.find(key, following)
    indexes = sorted(index for index in wanted if index < lines_total)
    lines = []
    for index in indexes:
        end = starts[index + 1] - 1 if index + 1 < lines_total else len(text)
        lines.append(text[starts[index]:end])
    return indexes, lines


def read_job_output(path: Path, relative: str, node: str | None, *, nccl: bool = True,
                    reference: datetime | None = None) -> JobOutput:
    """NCCL and hardware errors in a log of the job's output (its last JOB_OUTPUT_TAIL bytes);
    ``nccl=False`` for a file the NCCL reader already read whole (a node's nccl.log).
    ``reference``, the incident's time, dates the yearless syslog stamps of copied lines."""
    from spikeops.probes import job_errors, nccl_log

    output = JobOutput(relative, node)
    try:
        first, text = _tail_text(path, JOB_OUTPUT_TAIL)
    except OSError as exc:
        output.notes.append(f"{relative}: unreadable ({exc.strerror})")
        return output
    if first > 1:
        output.notes.append(f"{relative}: errors looked for in its last {JOB_OUTPUT_TAIL >> 20} MiB only")
    indexes, lines = _gated(text)
    output.nccl = nccl_log.parse(lines) if nccl else None
    output.errors = job_errors.parse(lines, reference=reference)
    # The readers numbered the lines they were given: back to the file's own numbers.
    for event in [*(output.nccl.events if output.nccl else []), *output.errors.events]:
        event.line = first + indexes[event.line - 1]
    if output.errors.last_exception_line is not None:
        output.errors.last_exception_line = first + indexes[output.errors.last_exception_line - 1]
    return output
