"""Running every probe of a node in one SSH session (``[ssh] sessions = "single"``).

A session costs a real node more than the probe it runs: sshd forks, and the login shell
starts and reads its profile (``/etc/profile.d``, Lmod) each time. So all probes of a node go
through one session: a small POSIX-sh runner (``node_runner.sh``) is written to the session's
stdin, runs each probe in the background with its own ``timeout``, byte cap, exit status and
stderr, and sends each finished probe back as one length-prefixed frame (protocol ``S1``,
described in the runner). Frames stream into the bundle's temp files as they arrive, through
the same accounting as a session per probe (``runner.accept_stdout``, ``runner.finish``), so
the two modes write the same files and the same probes.json for the same node.

The collector stays in charge of the bounds: it starts at most ``sessions`` probes at a time
(the slot frees when the probe's frame arrives), gives up on a probe ``GRACE_SECONDS + 1`` after
its timeout whatever the node says, and gives up on the node at its deadline. The runner
gives up on a probe that keeps its output open 2.5 s after its timeout, so normally the node
reports it first. If the session dies, the probes already received are kept and the others
are reported as not finished. A node that cannot run the runner (no writable spool
directory, no FIFO) says so before any probe starts; the caller then falls back to a session
per probe on the same connection.
"""

from __future__ import annotations

import re
import selectors
import shlex
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from spikeops.bundle import AtomicSink
from spikeops.collect.plan import PlannedProbe, physical_interfaces
from spikeops.collect.runner import (
    DISCOVERY_NAME,
    GRACE_SECONDS,
    STDERR_CAP,
    Active,
    ProbeRun,
    accept_stderr,
    accept_stdout,
    discovery_failed,
    discovery_probe,
    finish,
    not_run,
)

__all__ = [
    "SingleResult",
    "FrameReader",
    "FrameError",
    "Header",
    "run_single",
    "runner_script",
    "start_line",
    "probe_line",
    "DEFAULT_SPOOL",
    "SESSION_COMMAND",
    "SINGLE_GRACE",
]

#: What the session runs; the runner then arrives on its stdin.
SESSION_COMMAND = "exec sh -s"
#: Where the runner keeps outputs until they are sent: the first writable of these on the node.
DEFAULT_SPOOL = ("/dev/shm", "${TMPDIR:-/tmp}", "/tmp", "/var/tmp")
#: Seconds past a probe's timeout before the collector stops waiting for its frame (the
#: runner's own give-up is at 2.5 s, plus up to a half-second tick and the send).
SINGLE_GRACE = GRACE_SECONDS + 1
_CHUNK = 1 << 16
_HEADER_MAX = 256
_HEADER = re.compile(rb"^S1 (hello|fail|x|b|end)(?: (.*))?$")
_PROBE_FIELDS = re.compile(rb"^(\d+) (-|\d+) (done|stuck) (\d+) (\d+)$")


def runner_script() -> bytes:
    """The runner's text as sent: ``node_runner.sh`` (beside this module) without its comment
    lines, read once."""
    global _SCRIPT
    if _SCRIPT is None:
        text = Path(__file__).with_name("node_runner.sh").read_text(encoding="utf-8")
        lines = [line for line in text.splitlines() if line.strip() and not line.lstrip().startswith("#")]
        _SCRIPT = ("\n".join(lines) + "\n").encode()
    return _SCRIPT


_SCRIPT: bytes | None = None


def start_line(spool: Sequence[str] | None = None, quiet: float = 1) -> bytes:
    """``_s1_start QUIET DIR...``: QUIET is the shortest probe timeout in whole seconds (the
    runner's ticker sleeps that long first); the default spool candidates are left for the
    node's shell to expand (``$TMPDIR``), configured ones are quoted."""
    words = list(DEFAULT_SPOOL) if not spool else [shlex.quote(path) for path in spool]
    for word in words:
        if "\n" in word:
            raise ValueError(f"spool directory {word!r} holds a newline")
    return (f"_s1_start {max(1, int(quiet))} " + " ".join(words) + "\n").encode()


def probe_line(index: int, probe: PlannedProbe) -> bytes:
    """``_r INDEX KEEP_BLOCKS TIMEOUT 'COMMAND'``: what the node keeps is the cap plus one byte
    (so an output past the cap is seen as such), rounded up to 512-byte blocks. COMMAND is
    what a session per probe runs, less its leading ``exec`` (the runner waits for it)."""
    blocks = (probe.max_bytes + 1 + 511) // 512
    seconds = max(1, int(round(probe.timeout)))
    command = probe.remote.removeprefix("exec ")
    return f"_r {index} {blocks} {seconds} {shlex.quote(command)}\n".encode()


# ------------------------------------------------------------------------------- frames


class FrameError(Exception):
    """The session's stdout is not the runner's protocol (a shell too old, a login banner
    printed on stdout by a profile script after the hello, a runner of another version)."""


@dataclass(frozen=True)
class Header:
    """``S1 x``: one finished probe, whose ``out`` stdout bytes and ``err`` stderr bytes follow."""

    index: int
    status: int | None
    state: str
    out: int
    err: int


class FrameReader:
    """Incremental parser of the runner's stdout, fed whatever chunks the channel gives.

    Frames: ``S1 x INDEX STATUS STATE NOUT NERR`` then the probe's bytes; or ``S1 b COUNT``,
    then COUNT such header lines, then their bytes one probe after the other (the runner sends
    the probes that finished together with one ``wc`` and one ``cat``). Yields
    ``("hello", text)``, ``("fail", reason)``, ``("probe", Header)``, ``("out", (index, bytes))``,
    ``("err", (index, bytes))``, ``("probe-end", index)`` and ``("end", "")``. Payloads are
    passed on as they arrive, never gathered, so a 16 MiB output costs a chunk of memory, not
    16 MiB. Bytes before the hello (a profile script that prints on a non-interactive login)
    are skipped; after it, anything that is not a frame raises FrameError.
    """

    def __init__(self) -> None:
        self._buffer = bytearray()
        self._hello = False
        self._header: Header | None = None
        self._queue: deque[Header] = deque()
        self._expect = 0
        self._left_out = 0
        self._left_err = 0
        self.ended = False
        self.skipped = 0

    @property
    def reported(self) -> set[int]:
        """Probes the node has reported whose bytes are still arriving."""
        return {header.index for header in self._queue} | ({self._header.index} if self._header else set())

    def feed(self, data: bytes) -> Iterator[tuple[str, Any]]:
        self._buffer.extend(data)
        while not self.ended:
            if self._header is None and self._queue and not self._expect:
                yield from self._next_payload()
                continue
            if self._header is not None:
                if not self._buffer:
                    return
                yield from self._payload()
                continue
            if not self._buffer:
                return
            newline = self._buffer.find(b"\n")
            if newline < 0:
                if len(self._buffer) > _HEADER_MAX and self._hello:
                    raise FrameError(f"no frame header in {bytes(self._buffer[:60])!r}...")
                if not self._hello and len(self._buffer) > _HEADER_MAX:
                    self.skipped += len(self._buffer) - _HEADER_MAX
                    del self._buffer[:-_HEADER_MAX]
                return
            line = bytes(self._buffer[:newline])
            del self._buffer[:newline + 1]
            yield from self._line(line)

    def _line(self, line: bytes) -> Iterator[tuple[str, Any]]:
        match = _HEADER.match(line)
        if not self._hello:
            if match and match.group(1) in (b"hello", b"fail"):
                self._hello = match.group(1) == b"hello"
                yield match.group(1).decode(), (match.group(2) or b"").decode("utf-8", "replace")
            else:
                self.skipped += len(line) + 1
            return
        if not match:
            raise FrameError(f"not a frame header: {line[:80]!r}")
        kind, rest = match.group(1), match.group(2) or b""
        if kind == b"end" and not self._expect:
            self.ended = True
            yield "end", ""
        elif kind == b"b" and not self._expect and rest.isdigit() and int(rest) > 0:
            self._expect = int(rest)
        elif kind == b"x":
            fields = _PROBE_FIELDS.match(rest)
            if not fields:
                raise FrameError(f"bad probe frame header: {line[:80]!r}")
            index, status, state, out, err = fields.groups()
            self._queue.append(Header(int(index), None if status == b"-" else int(status), state.decode(),
                                      int(out), int(err)))
            self._expect = max(0, self._expect - 1)
        else:
            raise FrameError(f"unexpected frame {line[:80]!r}")

    def _next_payload(self) -> Iterator[tuple[str, Any]]:
        header = self._queue.popleft()
        self._header, self._left_out, self._left_err = header, header.out, header.err
        yield "probe", header
        if header.out == 0 and header.err == 0:
            self._header = None
            yield "probe-end", header.index

    def _payload(self) -> Iterator[tuple[str, Any]]:
        assert self._header is not None
        if self._left_out:
            take = min(self._left_out, len(self._buffer))
            chunk = bytes(self._buffer[:take])
            del self._buffer[:take]
            self._left_out -= take
            yield "out", (self._header.index, chunk)
        if not self._left_out and self._left_err and self._buffer:
            take = min(self._left_err, len(self._buffer))
            chunk = bytes(self._buffer[:take])
            del self._buffer[:take]
            self._left_err -= take
            yield "err", (self._header.index, chunk)
        if not self._left_out and not self._left_err:
            index = self._header.index
            self._header = None
            yield "probe-end", index


# ------------------------------------------------------------------------------- the session


@dataclass
class SingleResult:
    """What one session brought back. ``fallback`` (with no runs) when the node cannot run
    the runner and nothing was started; ``lost`` when the session died before its end."""

    runs: list[ProbeRun] = field(default_factory=list)
    fallback: str | None = None
    lost: str | None = None


@dataclass
class _Session:
    channel: Any
    reader: FrameReader
    probes: deque[PlannedProbe]
    open_sink: Callable[[PlannedProbe], AtomicSink]
    expand_interfaces: Callable[[list[str]], list[PlannedProbe]] | None
    sessions: int
    active: dict[int, Active] = field(default_factory=dict)
    runs: list[ProbeRun] = field(default_factory=list)
    discovering: bool = False
    finishing: bool = False
    next_index: int = 0
    stderr: bytearray = field(default_factory=bytearray)

    def start_more(self) -> None:
        """Send as many probes as there are free slots; ``_f`` once nothing is left to send."""
        lines = []
        while self.probes and len(self.active) < self.sessions:
            probe = self.probes.popleft()
            index, self.next_index = self.next_index, self.next_index + 1
            run = ProbeRun(probe.name, probe.filename, probe.command, datetime.now(UTC))
            now = time.monotonic()
            memory = bytearray() if probe.name == DISCOVERY_NAME else None
            sink = None if memory is not None else self.open_sink(probe)
            self.active[index] = Active(probe, run, sink, now, now + probe.timeout + SINGLE_GRACE, memory)
            lines.append(probe_line(index, probe))
        if not self.probes and not self.active and not self.discovering and not self.finishing:
            lines.append(b"_f\n")
            self.finishing = True
        if lines:
            self.channel.sendall(b"".join(lines))

    def settle(self, index: int, entry: Active, now: float) -> None:
        """A probe is over (reported, or given up on): its run joins the results, and a
        finished interface listing turns into the per-interface probes."""
        finish(entry, now)
        self.active.pop(index, None)
        if entry.probe.name != DISCOVERY_NAME:
            self.runs.append(entry.run)
            return
        self.discovering = False
        run = entry.run
        if run.error is None and self.expand_interfaces is not None:
            listing = bytes(entry.memory or b"").decode("utf-8", "replace").splitlines()
            self.probes.extendleft(reversed(self.expand_interfaces(physical_interfaces(listing))))
        if run.error is not None or run.exit not in (0, None):
            self.runs.append(discovery_failed(entry))


def run_single(
    transport: Any,
    probes: list[PlannedProbe],
    open_sink: Callable[[PlannedProbe], AtomicSink],
    *,
    sessions: int,
    expand_interfaces: Callable[[list[str]], list[PlannedProbe]] | None = None,
    channel_timeout: float = 10.0,
    node_deadline: float | None = None,
    spool: Sequence[str] | None = None,
) -> SingleResult:
    """Run ``probes`` (and the per-interface ones the node's listing calls for) in one
    session on an open transport. Never raises for a probe's or the session's failure."""
    t0 = time.monotonic()
    first = discovery_probe(min(channel_timeout, 10.0)) if expand_interfaces is not None else None
    quiet = min([probe.timeout for probe in probes] + ([first.timeout] if first else []), default=1.0)
    try:
        channel = transport.open_session(timeout=channel_timeout)
        channel.exec_command(SESSION_COMMAND)
        channel.sendall(runner_script() + start_line(spool, quiet))
    except Exception as exc:  # paramiko: SSHException, ChannelException, EOFError, OSError
        return SingleResult(fallback=f"could not start the runner session ({type(exc).__name__}: {exc})")
    pending: deque[PlannedProbe] = deque(probes)
    if first is not None:
        pending.appendleft(first)
    session = _Session(channel, FrameReader(), pending, open_sink, expand_interfaces, max(1, sessions),
                       discovering=expand_interfaces is not None)
    selector = selectors.DefaultSelector()
    selector.register(channel, selectors.EVENT_READ)
    hello: bool | None = None
    lost: str | None = None
    end_by = 0.0
    try:
        hello_deadline = t0 + channel_timeout
        while True:
            now = time.monotonic()
            if hello is None and now >= hello_deadline:
                return SingleResult(fallback=f"the runner did not start within {channel_timeout:g} s")
            deadlines = [entry.deadline for entry in session.active.values()]
            deadlines.append(hello_deadline if hello is None else now + 1.0)
            if node_deadline is not None:
                deadlines.append(node_deadline)
            selector.select(max(0.0, min(1.0, min(deadlines) - now)))
            events, closed, garbled = _drain(channel, session)
            for kind, value in events:
                if kind == "hello":
                    hello = True
                    session.start_more()
                elif kind == "fail":
                    return SingleResult(fallback=f"the node cannot run the runner: {value}")
                else:
                    _on_frame(session, kind, value)
            if garbled is not None:
                lost = f"the runner's output is garbled ({garbled})"
                break
            if session.reader.ended:
                break
            now = time.monotonic()
            if node_deadline is not None and now >= node_deadline:
                _expire(session, node_deadline)
                break
            if session.finishing and not session.active:
                # all reported: the end frame normally follows at once; do not wait on it
                end_by = end_by or now + 1.0
                if now >= end_by:
                    break
            if closed:
                if hello is None:
                    detail = bytes(session.stderr).decode("utf-8", "replace").strip().splitlines()
                    return SingleResult(fallback="the runner session ended before it started"
                                        + (f" ({detail[-1][:200]})" if detail else ""))
                if session.active or session.probes or not session.finishing:
                    lost = "the SSH session ended before every probe had reported"
                break
            if hello:
                _expire(session, node_deadline)
                session.start_more()
    except (OSError, EOFError) as exc:  # sendall on a dead transport
        lost = f"the SSH session failed ({type(exc).__name__}: {exc})"
    except BaseException:
        for entry in session.active.values():
            if entry.sink is not None:
                entry.sink.discard()
        raise
    finally:
        selector.close()
        channel.close()
    return SingleResult(_wrap_up(session, lost), lost=lost)


def _drain(channel: Any, session: _Session) -> tuple[list[tuple[str, Any]], bool, str | None]:
    """Everything the channel holds, parsed (the frames before any garbage included);
    whether the channel is done for good; and what was wrong with the stream, if anything."""
    events: list[tuple[str, Any]] = []
    while channel.recv_stderr_ready():
        data = channel.recv_stderr(_CHUNK)
        room = STDERR_CAP - len(session.stderr)
        if room > 0:
            session.stderr.extend(data[:room])
    eof = False
    while channel.recv_ready():
        data = channel.recv(_CHUNK)
        if not data:
            eof = True
            break
        try:
            for event in session.reader.feed(data):
                events.append(event)
        except FrameError as exc:
            return events, True, str(exc)
    closed = eof or ((channel.closed or channel.eof_received) and not channel.recv_ready())
    return events, closed, None


def _on_frame(session: _Session, kind: str, value: Any) -> None:
    if kind == "probe":
        entry = session.active.get(value.index)
        if entry is not None:
            entry.run.exit = value.status
            if value.state == "stuck":
                entry.run.error = "timeout"
    elif kind in ("out", "err"):
        index, data = value
        entry = session.active.get(index)
        if entry is not None:
            (accept_stdout if kind == "out" else accept_stderr)(entry, data)
    elif kind == "probe-end":
        entry = session.active.get(value)
        if entry is not None:
            if entry.truncated or entry.run.error == "timeout":
                entry.run.exit = None  # given up on, as a session per probe would have been
            session.settle(value, entry, time.monotonic())


def _expire(session: _Session, node_deadline: float | None) -> None:
    """Give up on probes past their own deadline (or the node's): timed out, whatever they
    had sent kept; their frames, should they come, are dropped."""
    now = time.monotonic()
    receiving = session.reader.reported
    for index, entry in list(session.active.items()):
        if index in receiving:
            continue  # its frame is arriving: the node has reported it
        if now >= entry.deadline or (node_deadline is not None and now >= node_deadline):
            entry.run.error = "timeout"
            entry.run.exit = None
            session.settle(index, entry, now)
    if node_deadline is not None and now >= node_deadline:
        for probe in session.probes:
            session.runs.append(not_run(probe, "the node's collection deadline passed"))
        session.probes.clear()


def _wrap_up(session: _Session, lost: str | None) -> list[ProbeRun]:
    """The runs, once the session is over: what was still running when it ended is
    recorded as not finished (with what it had sent), what was never started as not run."""
    now = time.monotonic()
    for index, entry in list(session.active.items()):
        if lost is not None:
            note = f"spikeops: {lost}".encode()
            if entry.stderr and not entry.stderr.endswith(b"\n"):
                note = b"\n" + note
            entry.stderr.extend(note[: max(0, STDERR_CAP - len(entry.stderr))])
            entry.run.exit = None
            entry.run.error = "command-failed"
        session.settle(index, entry, now)
    for probe in session.probes:
        session.runs.append(not_run(probe, lost or "the session ended"))
    session.probes.clear()
    return session.runs
