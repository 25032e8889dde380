"""Running every probe of a node in one SSH session (``[ssh] sessions = "single"``).

A session costs a real node more than the probe it runs: sshd forks, and the login shell
starts and reads its profile (``/etc/profile.d``, Lmod) each time. So all probes of a node go
through one session: a small POSIX-sh runner (``node_runner.sh``) is written to the session's
stdin, runs each probe in the background with its own ``timeout``, byte cap (a file-size
limit), exit status and stderr, and sends finished probes back in groups (protocol ``S2``,
described in the runner: a few header lines, then one tar archive of their outputs, so every
length on the wire is the one tar took). Outputs stream into the bundle's temp files as they
arrive, through the same accounting as a session per probe (``runner.accept_stdout``,
``runner.finish``), so the two modes write the same files and probes.json for the same node,
but for the differences in docs/inventory.md ("Sessions").

The collector stays in charge of the bounds and of time (the node keeps no clock): it starts
at most ``sessions`` probes at a time (the slot frees when the probe's group arrives), asks the
node to send what a probe has ``GIVE_UP_AFTER`` seconds after its timeout (``_g``), gives up on
it ``SINGLE_GRACE`` seconds after whatever the node says, and gives up on the node at its
deadline. If the session dies, the probes already received are kept and the others are
reported as not finished. A node that cannot run the runner (no tar, no writable spool
directory, no FIFO) says so before any probe starts; the caller then falls back to a session
per probe.

The session itself is a ``Conduit``: a paramiko channel here (``ChannelConduit``), or an
OpenSSH client process (``spikeops.collect.openssh``).
"""

from __future__ import annotations

import re
import secrets
import selectors
import shlex
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Protocol

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
    discovery_bound,
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
    "Conduit",
    "ChannelConduit",
    "run_single",
    "runner_script",
    "start_line",
    "probe_line",
    "give_up_line",
    "DEFAULT_SPOOL",
    "SESSION_COMMAND",
    "SINGLE_GRACE",
    "GIVE_UP_AFTER",
    "MIN_BLOCKS",
]

#: What the session runs; the runner then arrives on its stdin.
SESSION_COMMAND = "exec sh -s"
#: Where the runner keeps outputs until they are sent: the first writable of these on the node.
DEFAULT_SPOOL = ("/dev/shm", "${TMPDIR:-/tmp}", "/tmp", "/var/tmp")
#: Seconds past a probe's timeout before the collector asks the node for what the probe has
#: (``timeout -k 2`` has killed it a second before, unless it cannot die).
GIVE_UP_AFTER = 3.0
#: Seconds past a probe's timeout before the collector stops waiting for it at all.
SINGLE_GRACE = GRACE_SECONDS + 1
#: The node's file-size limit never goes below this (64 KiB of stderr and one byte, in
#: 512-byte blocks): a probe's stdout and stderr share the limit.
MIN_BLOCKS = (STDERR_CAP + 1 + 511) // 512
_CHUNK = 1 << 16
_HEADER_MAX = 256
_HEADER = re.compile(rb"^S2 (hello|fail|t|end)(?: (.*))?$")
_GROUP = re.compile(rb"^(\d+) (\d+)$")
_PROBE_FIELDS = re.compile(rb"^(\d+) (-|\d+) (done|stuck)$")
_MEMBER = re.compile(rb"^([oe])(\d+)$")
_BLOCK = 512


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


def start_line(spool: Sequence[str] | None = None, token: str | None = None) -> bytes:
    """``_s2_start TOKEN DIR...``: TOKEN names the session's spool directory
    (``spikeops-TOKEN``, random unless given); the default spool candidates are left for the
    node's shell to expand (``$TMPDIR``), configured ones are quoted."""
    words = list(DEFAULT_SPOOL) if not spool else [shlex.quote(path) for path in spool]
    for word in words:
        if "\n" in word:
            raise ValueError(f"spool directory {word!r} holds a newline")
    token = token or secrets.token_hex(8)
    if not re.fullmatch(r"[0-9A-Za-z]{1,32}", token):
        raise ValueError(f"bad spool token {token!r}")
    return (f"_s2_start {token} " + " ".join(words) + "\n").encode()


def probe_line(index: int, probe: PlannedProbe) -> bytes:
    """``_r INDEX BLOCKS TIMEOUT 'COMMAND'``: the node's file-size limit is the cap plus one
    byte (so an output past the cap is seen as such), in 512-byte blocks, and at least
    ``MIN_BLOCKS``. COMMAND is what a session per probe runs, less its leading ``exec``."""
    blocks = max((probe.max_bytes + 1 + _BLOCK - 1) // _BLOCK, MIN_BLOCKS)
    seconds = max(1, int(round(probe.timeout)))
    command = probe.remote.removeprefix("exec ")
    return f"_r {index} {blocks} {seconds} {shlex.quote(command)}\n".encode()


def give_up_line(indices: Sequence[int]) -> bytes:
    """``_g INDEX...``: send what these probes have, as they are."""
    return ("_g " + " ".join(str(index) for index in indices) + "\n").encode()


# ------------------------------------------------------------------------------- frames


class FrameError(Exception):
    """The session's stdout is not the runner's protocol (a shell too old, a login banner
    printed on stdout by a profile script after the hello, a runner of another version)."""


@dataclass(frozen=True)
class Header:
    """One probe of an ``S2 t`` group: its exit status (None: never reported one) and state."""

    index: int
    status: int | None
    state: str


def _octal(field_: bytes) -> int:
    """A tar number: octal digits (NUL- or space-ended), or GNU's base-256 for big values."""
    if field_[:1] and field_[0] & 0x80:
        value = field_[0] & 0x3F
        for byte in field_[1:]:
            value = value * 256 + byte
        return value
    digits = field_.split(b"\0", 1)[0].strip()
    if not digits or any(c not in b"01234567" for c in digits):
        raise FrameError(f"bad number in a tar header: {field_!r}")
    return int(digits, 8)


def _tar_header(block: bytes) -> tuple[bytes, int, bytes]:
    """(name, size, type) of a tar header block whose checksum holds."""
    stored = _octal(block[148:156])
    if stored != sum(block[:148]) + 8 * 32 + sum(block[156:]):
        raise FrameError("a tar header's checksum does not match")
    name = block[:100].split(b"\0", 1)[0]
    prefix = block[345:500].split(b"\0", 1)[0] if block[257:262] == b"ustar" else b""
    if prefix:
        name = prefix + b"/" + name
    return name.removeprefix(b"./"), _octal(block[124:136]), block[156:157]


class FrameReader:
    """Incremental parser of the runner's stdout, fed whatever chunks the session gives.

    ``S2 t COUNT NFILES`` and COUNT lines ``INDEX STATUS STATE``, then, when NFILES > 0, a tar
    archive of files ``oINDEX`` (stdout) and ``eINDEX`` (stderr); then ``S2 t`` again, or
    ``S2 end``. Yields ``("hello", text)``, ``("fail", reason)``, ``("probe", Header)`` for each
    probe of a group as its line arrives, ``("out", (index, bytes))`` and ``("err", (index,
    bytes))`` as the archive brings them, ``("probe-end", index)`` for each probe of the group
    once the archive has ended, and ``("end", "")``. Payloads are passed on as they arrive,
    never gathered, so a 16 MiB output costs a chunk of memory, not 16 MiB. Bytes before the
    hello (a profile script that prints on a non-interactive login) are skipped; after it,
    anything that is not the protocol raises FrameError.
    """

    def __init__(self) -> None:
        self._buffer = bytearray()
        self._hello = False
        self._group: list[Header] = []
        self._lines = 0          # header lines of the group still to come
        self._archive = False    # inside the group's tar archive
        self._after = False      # past an archive: the zero blocks that pad it may follow
        self._member: tuple[str, int] | None = None  # ("out"|"err"|"skip", index) being read
        self._left = 0           # bytes of the member's data still to come
        self._pad = 0            # padding after it
        self.ended = False
        self.skipped = 0

    @property
    def reported(self) -> set[int]:
        """Probes the node has reported whose bytes are still arriving."""
        return {header.index for header in self._group}

    def feed(self, data: bytes) -> Iterator[tuple[str, Any]]:
        self._buffer.extend(data)
        while not self.ended:
            if self._archive:
                if not (yield from self._tar()):
                    return
                continue
            if self._after:
                zeros = len(self._buffer) - len(self._buffer.lstrip(b"\0"))
                del self._buffer[:zeros]
                if not self._buffer:
                    return
                self._after = False
            newline = self._buffer.find(b"\n")
            if newline < 0:
                if len(self._buffer) > _HEADER_MAX:
                    if self._hello:
                        raise FrameError(f"no frame header in {bytes(self._buffer[:60])!r}...")
                    self.skipped += len(self._buffer) - _HEADER_MAX
                    del self._buffer[:-_HEADER_MAX]
                return
            line = bytes(self._buffer[:newline])
            del self._buffer[:newline + 1]
            yield from self._line(line)

    def _line(self, line: bytes) -> Iterator[tuple[str, Any]]:
        if self._lines:
            fields = _PROBE_FIELDS.match(line)
            if not fields:
                raise FrameError(f"bad probe line in a group: {line[:80]!r}")
            index, status, state = fields.groups()
            header = Header(int(index), None if status == b"-" else int(status), state.decode())
            self._group.append(header)
            self._lines -= 1
            yield "probe", header
            if not self._lines and not self._archive:
                yield from self._close_group()
            return
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
        if kind == b"end":
            self.ended = True
            yield "end", ""
            return
        group = _GROUP.match(rest) if kind == b"t" else None
        if group is None or int(group.group(1)) == 0:
            raise FrameError(f"unexpected frame {line[:80]!r}")
        self._lines = int(group.group(1))
        self._archive = int(group.group(2)) > 0

    def _close_group(self) -> Iterator[tuple[str, Any]]:
        group, self._group = self._group, []
        for header in group:
            yield "probe-end", header.index

    def _tar(self) -> Iterator[tuple[str, Any]]:
        """Advance through the archive; False when more bytes are needed."""
        if self._lines:  # the group's lines come first
            newline = self._buffer.find(b"\n")
            if newline < 0:
                return False
            line = bytes(self._buffer[:newline])
            del self._buffer[:newline + 1]
            yield from self._line(line)
            return True
        if self._member is not None:
            if self._left:
                if not self._buffer:
                    return False
                take = min(self._left, len(self._buffer))
                chunk = bytes(self._buffer[:take])
                del self._buffer[:take]
                self._left -= take
                kind, index = self._member
                if kind != "skip":
                    yield kind, (index, chunk)
                return True
            if self._pad:
                take = min(self._pad, len(self._buffer))
                del self._buffer[:take]
                self._pad -= take
                if self._pad:
                    return False
            self._member = None
            return True
        if len(self._buffer) < _BLOCK:
            return False
        block = bytes(self._buffer[:_BLOCK])
        del self._buffer[:_BLOCK]
        if block.count(0) == _BLOCK:  # the end of the archive
            self._archive = False
            self._after = True
            yield from self._close_group()
            return True
        name, size, kind = _tar_header(block)
        self._left, self._pad = size, (-size) % _BLOCK
        if kind in (b"0", b"\0", b"7"):
            member = _MEMBER.match(name)
            index = int(member.group(2)) if member else -1
            if member is None or index not in self.reported:
                raise FrameError(f"unexpected file {name[:60]!r} in a group")
            self._member = ("out" if member.group(1) == b"o" else "err", index)
        else:  # pax or GNU extension headers, directories: nothing of ours
            self._member = ("skip", -1)
        return True


# ------------------------------------------------------------------------------- the conduit


class Conduit(Protocol):
    """One session's byte streams, as run_single needs them."""

    def selectables(self) -> list[Any]:
        """What to wait on (objects with ``fileno``) until there is something to read."""

    def send(self, data: bytes) -> None:
        """Write to the session's stdin (OSError or EOFError when it is gone)."""

    def receive(self) -> tuple[list[bytes], bytes, bool]:
        """What stdout and stderr hold now, without waiting, and whether stdout is over."""

    def close(self) -> None:
        """End the session (idempotent)."""


class ChannelConduit:
    """A paramiko channel running ``SESSION_COMMAND`` on an open transport."""

    def __init__(self, channel: Any) -> None:
        self.channel = channel

    @classmethod
    def open(cls, transport: Any, timeout: float) -> ChannelConduit:
        channel = transport.open_session(timeout=timeout)
        channel.exec_command(SESSION_COMMAND)
        return cls(channel)

    def selectables(self) -> list[Any]:
        return [self.channel]

    def send(self, data: bytes) -> None:
        self.channel.sendall(data)

    def receive(self) -> tuple[list[bytes], bytes, bool]:
        channel = self.channel
        err = bytearray()
        while channel.recv_stderr_ready():
            err.extend(channel.recv_stderr(_CHUNK))
        out: list[bytes] = []
        eof = False
        while channel.recv_ready():
            data = channel.recv(_CHUNK)
            if not data:
                eof = True
                break
            out.append(data)
        closed = eof or ((channel.closed or channel.eof_received) and not channel.recv_ready())
        return out, bytes(err), closed

    def close(self) -> None:
        self.channel.close()


# ------------------------------------------------------------------------------- the session


@dataclass
class SingleResult:
    """What one session brought back. ``fallback`` (with no runs) when the node cannot run
    the runner and nothing was started; ``lost`` when the session died before its end;
    ``stderr`` what the session printed on its stderr (the first 64 KiB)."""

    runs: list[ProbeRun] = field(default_factory=list)
    fallback: str | None = None
    lost: str | None = None
    stderr: bytes = b""


@dataclass
class _Session:
    conduit: Conduit
    reader: FrameReader
    probes: deque[PlannedProbe]
    open_sink: Callable[[PlannedProbe], AtomicSink]
    expand_interfaces: Callable[[list[str]], list[PlannedProbe]] | None
    sessions: int
    active: dict[int, Active] = field(default_factory=dict)
    runs: list[ProbeRun] = field(default_factory=list)
    asked: set[int] = field(default_factory=set)
    discovering: bool = False
    finishing: bool = False
    next_index: int = 0
    stderr: bytearray = field(default_factory=bytearray)

    def start_more(self) -> None:
        """Send as many probes as there are free slots; ``_f`` once nothing is left to send
        (the node then ends the session after the last group)."""
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
        if not self.probes and not self.discovering and not self.finishing:
            lines.append(b"_f\n")
            self.finishing = True
        if lines:
            self.conduit.send(b"".join(lines))

    def ask_overdue(self, now: float) -> None:
        """``_g`` for the probes ``GIVE_UP_AFTER`` seconds past their timeout, once each."""
        overdue = [index for index, entry in self.active.items()
                   if index not in self.asked and now >= entry.t0 + entry.probe.timeout + GIVE_UP_AFTER]
        if overdue:
            self.asked.update(overdue)
            self.conduit.send(give_up_line(overdue))

    def next_wakeup(self, now: float) -> float:
        """When something is due: a probe to ask about, or one to give up on."""
        times = [entry.deadline for entry in self.active.values()]
        times += [entry.t0 + entry.probe.timeout + GIVE_UP_AFTER for index, entry in self.active.items()
                  if index not in self.asked]
        return min(times, default=now + 1.0)

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


def open_channel(transport: Any, channel_timeout: float) -> Callable[[], Conduit]:
    """The paramiko way to the session: a channel on an open transport."""
    return lambda: ChannelConduit.open(transport, channel_timeout)


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
    conduit: Callable[[], Conduit] | None = None,
    hello_timeout: float | None = None,
    discovery_timeout: float | None = None,
) -> SingleResult:
    """Run ``probes`` (and the per-interface ones the node's listing calls for) in one
    session: a channel on ``transport``, or what ``conduit`` opens. Never raises for a
    probe's or the session's failure."""
    t0 = time.monotonic()
    first = (discovery_probe(discovery_bound(channel_timeout, discovery_timeout))
             if expand_interfaces is not None else None)
    try:
        session_io = (conduit or open_channel(transport, channel_timeout))()
    except Exception as exc:  # paramiko: SSHException, ChannelException, EOFError, OSError
        return SingleResult(fallback=f"could not start the runner session ({type(exc).__name__}: {exc})")
    try:
        session_io.send(runner_script() + start_line(spool))
    except Exception as exc:
        session_io.close()
        return SingleResult(fallback=f"could not start the runner session ({type(exc).__name__}: {exc})")
    pending: deque[PlannedProbe] = deque(probes)
    if first is not None:
        pending.appendleft(first)
    session = _Session(session_io, FrameReader(), pending, open_sink, expand_interfaces, max(1, sessions),
                       discovering=expand_interfaces is not None)
    selector = selectors.DefaultSelector()
    for item in session_io.selectables():
        selector.register(item, selectors.EVENT_READ)
    hello: bool | None = None
    lost: str | None = None
    end_by = 0.0
    hello_deadline = t0 + (hello_timeout if hello_timeout is not None else channel_timeout)
    try:
        while True:
            now = time.monotonic()
            if hello is None and now >= hello_deadline:
                return SingleResult(fallback=f"the runner did not start within {hello_deadline - t0:g} s",
                                    stderr=bytes(session.stderr))
            wake = hello_deadline if hello is None else session.next_wakeup(now)
            if node_deadline is not None:
                wake = min(wake, node_deadline)
            selector.select(max(0.0, min(1.0, wake - now)))
            events, closed, garbled = _drain(session)
            for kind, value in events:
                if kind == "hello":
                    hello = True
                    session.start_more()
                elif kind == "fail":
                    return SingleResult(fallback=f"the node cannot run the runner: {value}",
                                        stderr=bytes(session.stderr))
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
                                        + (f" ({detail[-1][:200]})" if detail else ""),
                                        stderr=bytes(session.stderr))
                if session.active or session.probes or not session.finishing:
                    lost = "the SSH session ended before every probe had reported"
                break
            if hello:
                _expire(session, node_deadline)
                session.start_more()
                session.ask_overdue(time.monotonic())
    except (OSError, EOFError) as exc:  # a send on a dead session
        lost = f"the SSH session failed ({type(exc).__name__}: {exc})"
    except BaseException:
        for entry in session.active.values():
            if entry.sink is not None:
                entry.sink.discard()
        raise
    finally:
        selector.close()
        session_io.close()
    return SingleResult(_wrap_up(session, lost), lost=lost, stderr=bytes(session.stderr))


def _drain(session: _Session) -> tuple[list[tuple[str, Any]], bool, str | None]:
    """Everything the session holds, parsed (the frames before any garbage included);
    whether it is done for good; and what was wrong with the stream, if anything."""
    events: list[tuple[str, Any]] = []
    out, err, closed = session.conduit.receive()
    room = STDERR_CAP - len(session.stderr)
    if err and room > 0:
        session.stderr.extend(err[:room])
    for data in out:
        try:
            for event in session.reader.feed(data):
                events.append(event)
        except FrameError as exc:
            return events, True, str(exc)
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
            continue  # its group is arriving: the node has reported it
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
