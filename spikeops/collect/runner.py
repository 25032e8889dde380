"""Running a node's probes over one SSH connection, a session (channel) per probe.

This is the ``[ssh] sessions = "per-probe"`` mode; ``spikeops.collect.single`` runs every
probe of a node in one session instead, and shares the accounting here (``accept_stdout``,
``finish``), so both modes turn the same output into the same files and probes.json.

One connection per node (a handshake costs more than every probe together on loopback, and
a real sshd's MaxStartups throttles handshakes, not channels), at most ``sessions`` channels
at a time (OpenSSH's MaxSessions defaults to 10). Each probe has its own deadline and byte
cap, enforced here as well as by ``timeout`` on the node: a hung tool, a node printing a
gigabyte, or a channel the node never closes cannot hold the collection past its bounds.
Output streams straight into the bundle's temp files, so memory does not grow with it.
"""

from __future__ import annotations

import selectors
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from spikeops.bundle import AtomicSink
from spikeops.collect.plan import IFACE_DISCOVERY, PlannedProbe, physical_interfaces, remote_command

__all__ = [
    "ProbeRun",
    "Active",
    "run_probes",
    "discovery_bound",
    "accept_stdout",
    "accept_stderr",
    "finish",
    "not_run",
    "discovery_probe",
    "discovery_failed",
    "DISCOVERY_NAME",
    "STDERR_CAP",
    "GRACE_SECONDS",
]

#: stderr kept per probe: enough for any tool's complaint, bounded against a flood.
STDERR_CAP = 64 << 10
#: Beyond a probe's timeout (the node's ``timeout`` kills at T, KILL at T+2) before the
#: collector stops waiting for it.
GRACE_SECONDS = 4.0
DISCOVERY_NAME = "net-interfaces"
_CHUNK = 1 << 16


@dataclass
class ProbeRun:
    """How one probe went; the fields of a probes.json entry and what the summary needs."""

    name: str
    filename: str
    command: str
    started: datetime
    exit: int | None = None
    seconds: float | None = None
    error: str | None = None
    stdout_bytes: int = 0
    stderr: bytes = b""
    written: bool = False

    @property
    def missing_tool(self) -> bool:
        return self.exit == 127


@dataclass
class Active:
    """A probe in flight: where its output goes and when it is given up on."""

    probe: PlannedProbe
    run: ProbeRun
    sink: AtomicSink | None
    t0: float
    deadline: float
    memory: bytearray | None = None
    stderr: bytearray = field(default_factory=bytearray)
    truncated: bool = False


def discovery_bound(channel_timeout: float, discovery_timeout: float | None) -> float:
    """The interface listing's own bound: the inventory's ``command_timeout`` when the caller
    has one, as for every other probe (a loaded node listed its interfaces in over 10 s while
    its other probes, bounded at 30, all finished), else the older 10 s at most."""
    return discovery_timeout if discovery_timeout is not None else min(channel_timeout, 10.0)


def discovery_probe(timeout: float) -> PlannedProbe:
    """The interface listing a node's per-interface probes are planned from."""
    return PlannedProbe(DISCOVERY_NAME, "", "", IFACE_DISCOVERY,
                        remote_command(IFACE_DISCOVERY, timeout, 64 << 10, "head"), timeout, 64 << 10, "head")


def run_probes(
    transport: Any,
    probes: list[PlannedProbe],
    open_sink: Callable[[PlannedProbe], AtomicSink],
    *,
    sessions: int,
    expand_interfaces: Callable[[list[str]], list[PlannedProbe]] | None = None,
    channel_timeout: float = 10.0,
    node_deadline: float | None = None,
    discovery_timeout: float | None = None,
) -> list[ProbeRun]:
    """Run ``probes`` (and, when ``expand_interfaces`` is given, one run per interface the
    node lists) on an open transport. Never raises for a probe's failure: it is recorded."""
    pending: deque[PlannedProbe] = deque(probes)
    if expand_interfaces is not None:
        pending.appendleft(discovery_probe(discovery_bound(channel_timeout, discovery_timeout)))
    active: dict[Any, Active] = {}
    runs: list[ProbeRun] = []
    selector = selectors.DefaultSelector()
    lost: str | None = None
    try:
        while pending or active:
            while pending and len(active) < sessions and lost is None:
                probe = pending.popleft()
                channel, entry = _start(transport, probe, open_sink, channel_timeout)
                if channel is None:
                    runs.append(entry.run)
                    if not transport.is_active():
                        lost = "connection lost"
                    continue
                active[channel] = entry
                selector.register(channel, selectors.EVENT_READ)
            if lost is not None:
                for probe in pending:
                    runs.append(not_run(probe, lost))
                pending.clear()
            if not active:
                continue
            now = time.monotonic()
            wait = max(0.0, min(1.0, min(entry.deadline for entry in active.values()) - now))
            selector.select(wait)
            for channel in list(active):
                entry = active[channel]
                state = _pump(channel, entry)
                now = time.monotonic()
                overdue = now >= entry.deadline or (node_deadline is not None and now >= node_deadline)
                if state is None and not overdue:
                    continue
                selector.unregister(channel)
                del active[channel]
                if state is None:
                    entry.run.error = "timeout"
                    state = "closed"
                channel.close()
                finish(entry, now)
                runs.append(entry.run)
                if entry.probe.name == DISCOVERY_NAME and expand_interfaces is not None:
                    runs.pop()
                    listing = bytes(entry.memory or b"").decode("utf-8", "replace").splitlines()
                    extra = expand_interfaces(physical_interfaces(listing)) if entry.run.error is None else []
                    if entry.run.error is not None or entry.run.exit not in (0, None):
                        runs.append(discovery_failed(entry))
                    pending.extendleft(reversed(extra))
    finally:
        for channel, entry in active.items():
            channel.close()
            if entry.sink is not None:
                entry.sink.discard()
        selector.close()
    return runs


def _start(transport: Any, probe: PlannedProbe, open_sink: Callable[[PlannedProbe], AtomicSink],
           channel_timeout: float) -> tuple[Any, Active]:
    started = datetime.now(UTC)
    run = ProbeRun(probe.name, probe.filename, probe.command, started)
    t0 = time.monotonic()
    try:
        channel = transport.open_session(timeout=channel_timeout)
        channel.exec_command(probe.remote)
    except Exception as exc:  # paramiko raises SSHException, ChannelException, EOFError, OSError
        run.error = "command-failed"
        run.stderr = f"spikeops: could not start the command over SSH ({type(exc).__name__}: {exc})".encode()
        run.seconds = round(time.monotonic() - t0, 3)
        return None, Active(probe, run, None, t0, t0)
    memory = bytearray() if probe.name == DISCOVERY_NAME else None
    sink = None if memory is not None else open_sink(probe)
    return channel, Active(probe, run, sink, t0, t0 + probe.timeout + GRACE_SECONDS, memory)


def accept_stderr(entry: Active, data: bytes) -> None:
    """Keep the first ``STDERR_CAP`` bytes of a probe's stderr; drop the rest."""
    room = STDERR_CAP - len(entry.stderr)
    if room > 0:
        entry.stderr.extend(data[:room])


def accept_stdout(entry: Active, data: bytes) -> bool:
    """Stream stdout into the probe's sink (or memory), up to its cap; True once the output
    went past the cap (what is beyond it is dropped, and the probe is then given up on)."""
    room = entry.probe.max_bytes - entry.run.stdout_bytes
    if len(data) > room:
        data = data[:room]
        entry.truncated = True
    if entry.memory is not None:
        entry.memory.extend(data)
    elif entry.sink is not None:
        entry.sink.write(data)
    entry.run.stdout_bytes += len(data)
    return entry.truncated


def _pump(channel: Any, entry: Active) -> str | None:
    """Move what has arrived into the sink; "done" when the command finished, "capped" when
    its output reached the cap (the channel is then abandoned), None while running."""
    while channel.recv_stderr_ready():
        accept_stderr(entry, channel.recv_stderr(_CHUNK))
    while channel.recv_ready():
        data = channel.recv(_CHUNK)
        if not data:
            break
        if accept_stdout(entry, data):
            return "capped"
    if channel.exit_status_ready() and (channel.eof_received or channel.closed) \
            and not channel.recv_ready() and not channel.recv_stderr_ready():
        entry.run.exit = channel.recv_exit_status()
        return "done"
    if channel.closed and not channel.recv_ready() and not channel.recv_stderr_ready():
        return "done"
    return None


def finish(entry: Active, now: float) -> None:
    """Settle a probe's probes.json fields from what was seen, and commit or discard its file.

    An output cut at its cap has no exit status (the probe was given up on when it passed
    the cap); a file is kept whenever there is output, even from a probe that failed."""
    run = entry.run
    run.seconds = round(now - entry.t0, 3)
    run.stderr = bytes(entry.stderr)
    if run.exit == -1:  # paramiko's "no exit status" (the command died of a signal)
        run.exit = None
    if run.error is None:
        if entry.truncated or (entry.probe.keep == "tail" and run.stdout_bytes >= entry.probe.max_bytes):
            run.error = "output-truncated"
        elif run.exit == 124:  # `timeout` on the node killed it
            run.error = "timeout"
        elif run.exit not in (0,):
            run.error = "command-failed"
        elif run.stdout_bytes == 0 and run.stderr:
            # A pipeline whose last stage succeeded although its source failed (grep on a
            # log that is not there): the complaint on stderr is the answer.
            run.error = "command-failed"
    if entry.sink is not None:
        if run.stdout_bytes > 0 or (run.exit == 0 and run.error is None):
            entry.sink.commit()
            run.written = True
        else:
            entry.sink.discard()


def not_run(probe: PlannedProbe, why: str) -> ProbeRun:
    """A probe that never ran (or never reported): command-failed, with why on its stderr."""
    run = ProbeRun(probe.name, probe.filename, probe.command, datetime.now(UTC), error="command-failed")
    run.stderr = f"spikeops: not run ({why})".encode()
    return run


def discovery_failed(entry: Active) -> ProbeRun:
    """The node would not list its interfaces: record it under the ethtool probe's name."""
    run = entry.run
    run.name, run.filename = "ethtool", ""
    run.error = run.error or "command-failed"
    return run
