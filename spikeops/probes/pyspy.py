"""``py-spy dump --pid PID``: where each thread of a live Python process is, innermost first.

A hung job's processes are alive and silent; their stacks say what each waits on: a rank
blocked in ``all_reduce`` waits for a peer, a rank in its data loader, a checkpoint write or
a ``sleep`` is the peer the others wait for. py-spy reads the interpreter's memory from the
outside (ptrace), so the job needs nothing installed and is paused only while it is read.
Never ``--locals``: local variables can hold tokens and passwords, and a bundle is shared.

The text as py-spy prints it::

    Process 18214: /usr/bin/python train.py --config x.yaml
    Python v3.11.7 (/usr/bin/python3.11)

    Thread 18214 (idle): "MainThread"
        all_reduce (torch/distributed/distributed_c10d.py:3252)
        wrapper (torch/distributed/c10d_logger.py:83)
        <module> (train.py:18)
    Thread 0x7F3A2C1FF640 (active+gil): "pt_autograd_0"
        ...

Thread states are py-spy's (``idle``, ``active``, ``gil``, ``active+gil``); thread ids are
decimal native ids (Linux) or hex addresses. With ``--native`` a frame may lack a line
number; with ``--subprocesses`` several ``Process`` blocks follow each other. What py-spy
prints when it cannot attach goes to stderr, and the collector keeps it as the probe's gap.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from spikeops.probes.base import MAX_EVENTS, Gap, Kind, LineSource, RemoteProbe, clip, numbered_lines, register
from spikeops.probes.base import register_remote

__all__ = ["StackFrame", "PyThread", "PyProcess", "PySpyDump", "parse", "detect", "summarize", "KIND", "REMOTE",
           "COLLECTIVE_FRAMES"]

#: Frames of torch.distributed that mean "waiting for the other ranks".
COLLECTIVE_FRAMES = re.compile(
    r"(?:^|[/.])(?:all_reduce|all_gather\w*|reduce_scatter\w*|broadcast\w*|barrier|all_to_all\w*|"
    r"monitored_barrier|send|recv|isend|irecv|gather|scatter|reduce|wait|batch_isend_irecv|_wait_tensor)$")


@dataclass(frozen=True)
class StackFrame:
    function: str
    file: str
    line: int | None
    #: The line of the dump the frame was printed on (evidence).
    at: int

    def text(self) -> str:
        return f"{self.function} ({self.file}{f':{self.line}' if self.line is not None else ''})"

    def collective(self) -> bool:
        """A frame of torch.distributed's collectives (the process waits for its peers)."""
        return "torch/distributed" in self.file and bool(COLLECTIVE_FRAMES.search(self.function))


@dataclass
class PyThread:
    thread_id: str
    state: str | None
    name: str | None
    line: int
    frames: list[StackFrame] = field(default_factory=list)

    @property
    def idle(self) -> bool:
        return self.state is not None and "idle" in self.state


@dataclass
class PyProcess:
    pid: int
    command: str
    line: int
    python: str | None = None
    threads: list[PyThread] = field(default_factory=list)

    def main_thread(self) -> PyThread | None:
        """The thread named MainThread, else the one whose id is the pid, else the first."""
        for thread in self.threads:
            if thread.name == "MainThread":
                return thread
        for thread in self.threads:
            if thread.thread_id == str(self.pid):
                return thread
        return self.threads[0] if self.threads else None

    def waits_in(self) -> StackFrame | None:
        """Where the main thread is: its innermost frame."""
        main = self.main_thread()
        return main.frames[0] if main is not None and main.frames else None

    def in_collective(self) -> bool:
        main = self.main_thread()
        return bool(main and any(frame.collective() for frame in main.frames[:6]))


@dataclass
class PySpyDump:
    processes: list[PyProcess] = field(default_factory=list)
    gaps: list[Gap] = field(default_factory=list)


_PROCESS = re.compile(r"^Process (\d+): (.*)$")
_PYTHON = re.compile(r"^Python (v\S+)(?: \((.*)\))?\s*$")
_THREAD = re.compile(r'^Thread (0x[0-9A-Fa-f]+|\d+)(?: \(([a-z+]+)\))?(?:: "(.*)")?\s*$')
_FRAME = re.compile(r"^\s{2,}(?P<function>\S(?:.*?\S)?) \((?P<file>[^()]*?)(?::(?P<line>\d+))?\)\s*$")
_LOCALS = re.compile(r"^\s{6,}\S")  # Arguments:/Locals: of --locals, never asked for, kept out


def parse(source: LineSource) -> PySpyDump:
    dump = PySpyDump()
    process: PyProcess | None = None
    thread: PyThread | None = None
    frames = 0
    for number, line in numbered_lines(source):
        if not line.strip():
            continue
        found = _PROCESS.match(line)
        if found:
            process = PyProcess(int(found.group(1)), clip(found.group(2), 300), number)
            dump.processes.append(process)
            thread = None
            continue
        found = _PYTHON.match(line)
        if found and process is not None:
            process.python = found.group(1)
            continue
        found = _THREAD.match(line)
        if found:
            if process is None:  # a dump whose header was cut off: keep the threads
                process = PyProcess(0, "", number)
                dump.processes.append(process)
                dump.gaps.append(Gap("no 'Process PID: command' header before the threads", number))
            thread = PyThread(found.group(1), found.group(2), found.group(3), number)
            process.threads.append(thread)
            continue
        found = _FRAME.match(line)
        if found and thread is not None and not _LOCALS.match(line):
            frames += 1
            if frames <= MAX_EVENTS:
                thread.frames.append(StackFrame(clip(found["function"], 200), clip(found["file"], 300),
                                                int(found["line"]) if found["line"] else None, number))
            continue
        if thread is not None and _LOCALS.match(line):
            continue  # --locals output: not kept (it may hold secrets)
        if line.lstrip().startswith(("Arguments:", "Locals:")):
            continue
        if len(dump.gaps) < 100:
            dump.gaps.append(Gap(f"not a py-spy dump line: {clip(line.strip(), 80)!r}", number))
    if frames > MAX_EVENTS:
        dump.gaps.append(Gap(f"{frames - MAX_EVENTS} more frames not kept"))
    if not dump.processes:
        dump.gaps.append(Gap("no process in the dump"))
    return dump


def detect(sample: str) -> float:
    head = sample[:65536]
    process = re.search(r"^Process \d+: ", head, re.M)
    thread = re.search(r'^Thread (?:0x[0-9A-Fa-f]+|\d+) \((?:idle|active|gil|active\+gil)\)', head, re.M)
    python = re.search(r"^Python v\d+\.\d+", head, re.M)
    score = 0.4 * bool(process) + 0.4 * bool(thread) + 0.2 * bool(python)
    return round(score, 2) if score >= 0.4 else 0.0


def summarize(dump: PySpyDump) -> list[str]:
    if not dump.processes:
        return ["no Python process in the dump"]
    lines = []
    for process in dump.processes[:8]:
        where = process.waits_in()
        state = "in a collective" if process.in_collective() else "main thread"
        lines.append(f"process {process.pid} ({clip(process.command, 60)}), {len(process.threads)} thread(s); "
                     f"{state}: {where.text() if where else 'no frames'}")
    return lines


KIND = register(Kind(
    name="py-spy",
    description="py-spy dump --pid PID: the Python stack of every thread of a live process",
    command="py-spy dump --pid {pid}",
    parse=parse,
    detect=detect,
    summarize=summarize,
    streaming=True,
    aliases=("stacks",),
))

#: ``py-spy dump`` of each of the job's processes on the node, as a tar archive of
#: ``PID.txt`` files the collector unpacks into ``nodes/NODE/stacks/``
#: (``spikeops.collect.plan`` writes the command around the job's process list).
REMOTE = register_remote(RemoteProbe(
    name="stacks", filename="stacks.tar", command="{stacks}",
    kind="py-spy", order=93, max_bytes=32 << 20, unpack="stacks", baseline=False,
))
