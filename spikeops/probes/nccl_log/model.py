"""What an NCCL / PyTorch-distributed log is read into: events, processes, versions."""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime
from typing import Any
from spikeops.probes import base
from spikeops.probes.base import Gap

__all__ = ["MAX_EVENTS", "EVENT_KINDS", "NcclEvent", "NcclProcess", "NcclLog", "NcclVersion"]


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
