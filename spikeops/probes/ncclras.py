"""``ncclras``: NCCL's RAS client (NCCL 2.24 and later), the job-wide view of a running job.

Every NCCL process runs a RAS thread; the threads watch each other over TCP and answer the
``ncclras`` client on ``localhost:28028`` with one report for the whole job: a job summary,
the communicators, and what is wrong. What it says, and what this parser keeps (written
from the format strings of NCCL's ``src/ras/client_support.cc``, 2.24-2.26, and the RAS
chapter of the NCCL user guide; hosts are IP addresses, as RAS prints them):

- ``Job summary``: nodes, processes and GPUs (``Nodes Processes GPUs ... (total)``);
- the communicators table (``Group Comms Nodes Ranks Ranks Ranks Status Errors``): per group
  of alike communicators its size, status (``RUNNING``, ``INIT``, ``FINALIZE``, ``ABORT``)
  and errors (``OK``, ``INCOMPLETE``, ``ERROR``, ``MISMATCH`` and their combinations);
- **Errors**: ``INCOMPLETE`` (job processes that sent no communicator data: unresponsive),
  ``DEAD`` (processes the RAS network considers dead), and per communicator (``#G-C
  (HASH) INCOMPLETE``: the ranks that did not answer; ``ERROR``: initialization or
  asynchronous errors, by rank);
- **Warnings**: ``TIMEOUT`` (timeouts while gathering), and per communicator ``MISMATCH``:
  ranks with a different status, or ranks that launched fewer collective operations than
  the others (``Rank 29 has launched up to operation 5``: a rank the others wait for).

A process line (``Process 3721 on node 10.0.0.4 managing GPU 5``) and a rank line (``Rank 29
-- GPU 5 managed by process 3721 on node 10.0.0.4``) keep their line and text for evidence.
When a group is too large to list (RAS details at most 10 outliers), only its count is
known, and that is kept too. Ranks are communicator ranks; in the world communicator
(``Ranks per comm`` = all GPUs) they are the global ranks.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from spikeops.probes.base import Gap, Kind, LineSource, RemoteProbe, clip, numbered_lines, register, register_remote

__all__ = ["RasProcess", "RasRank", "RasComm", "RasReport", "parse", "detect", "summarize", "KIND", "REMOTE"]


@dataclass
class RasProcess:
    pid: int | None
    host: str | None
    gpus: str | None
    line: int
    text: str


@dataclass
class RasRank:
    """A rank a communicator section names, with what it says about it."""

    rank: int
    gpu: str | None
    pid: int | None
    host: str | None
    line: int
    text: str
    #: ``launched up to operation N`` (0: none launched), for an operation-count mismatch.
    ops: int | None = None
    operation: str | None = None
    status: str | None = None
    error: str | None = None


@dataclass
class RasComm:
    """One ``#G-C (HASH) KIND`` section: ``kind`` is INCOMPLETE, ERROR or MISMATCH."""

    label: str
    comm_hash: str
    kind: str
    line: int
    missing: int | None = None
    ranks: list[RasRank] = field(default_factory=list)
    #: Operation -> {launched-up-to count -> number of ranks at it} (from the count lines).
    op_counts: dict[str, dict[int, int]] = field(default_factory=dict)

    def lagging(self) -> list[RasRank]:
        """Ranks that launched fewer operations of some kind than the most any rank did:
        the ones the others wait for."""
        out = []
        for rank in self.ranks:
            if rank.ops is None or rank.operation is None:
                continue
            most = max(self.op_counts.get(rank.operation, {rank.ops: 1}))
            if rank.ops < most:
                out.append(rank)
        return out


@dataclass
class RasReport:
    nccl_version: str | None = None
    nodes: int | None = None
    processes: int | None = None
    gpus: int | None = None
    #: (group, comms, nodes per comm, ranks per node, ranks per comm, ranks in group, status, errors)
    groups: list[tuple[int, int, int, str, int, int, str, str]] = field(default_factory=list)
    missing_count: int | None = None
    missing_processes: list[RasProcess] = field(default_factory=list)
    dead_count: int | None = None
    dead_processes: list[RasProcess] = field(default_factory=list)
    comms: list[RasComm] = field(default_factory=list)
    timeouts: int | None = None
    #: The client's own complaint (it could not reach NCCL: no job on this node).
    client_error: str | None = None
    gaps: list[Gap] = field(default_factory=list)

    def world_size(self) -> int | None:
        """The largest communicator's size: the world, whose ranks are global ranks."""
        sizes = [row[4] for row in self.groups]
        return max(sizes) if sizes else self.gpus

    def healthy(self) -> bool:
        return (not self.missing_count and not self.dead_count and not self.comms
                and all(row[7] == "OK" for row in self.groups) and bool(self.groups))


_VERSION = re.compile(r"^NCCL version (\S+)")
_NUMBERS = re.compile(r"^\s*(\d+(?:\s+\d+)*)\s*$")
_GROUP_ROW = re.compile(r"^\s*(\d+)\s+(\d+)\s+(\d+)\s+(\d+(?:-\d+)?)\s+(\d+)\s+(\d+)\s+([A-Z]+)\s+([A-Z,]+)\s*$")
_PROCESS = re.compile(r"^\s*Process (\d+) on node (\S*) managing GPUs? (.+?)\s*$")
_MISSING_PROCS = re.compile(r"^\s*Missing communicator data from (\d+) job process(?:es)?")
_DEAD = re.compile(r"^\s*(\d+) job process(?:es are| is) considered dead")
_COMM = re.compile(r"^#(\d+-\d+) \(([0-9a-fA-F]+)\) (INCOMPLETE|ERROR|MISMATCH)\s*$")
_MISSING_RANKS = re.compile(r"^\s*Missing communicator data from (\d+) ranks?")
_RANK = re.compile(
    r"^\s*Rank (?P<rank>\d+)"
    r"(?: has launched up to operation (?P<ops>\d+)| has not launched any operations(?P<none>)"
    r"| has status (?P<status>[A-Z]+)| reported (?P<error>.+?))?"
    r" -- (?:GPU (?P<gpu>.+?) managed by process (?P<pid>\d+) on node (?P<host>\S*)|\[process information not found\])\s*$")
_COUNT_OPS = re.compile(r"^\s*(\d+) ranks have (?:launched up to operation (\d+)|not launched any operations)\s*$")
_COUNT_STATUS = re.compile(r"^\s*(\d+) ranks have status ([A-Z]+)\s*$")
_COUNT_ERROR = re.compile(r"^\s*(\d+) ranks reported (.+?)\s*$")
_DIFFERENT_OPS = re.compile(r"^\s*Communicator ranks have different (\S+) operation counts")
_TIMEOUT = re.compile(r"^\s*Encountered (\d+) communication timeouts?")
_CLIENT_ERRORS = ("Failed to connect to the NCCL RAS service", "Connecting to ", "Connection timed out",
                  "NCCL unexpectedly closed the connection", "Unexpected response from NCCL",
                  "NCCL RAS protocol version mismatch", "Resolving ")
#: The rest of the client's refusal (it continues over two lines).
_CLIENT_HINTS = ("Please make sure that the NCCL", "the RAS client was started on a node", "the host/port arguments")
_KNOWN = re.compile(
    r"^(?:CUDA runtime version|Job summary|=+$|\s*Nodes\s+Processes|\(total\)|\s+per node|\s+Processes\s+GPUs"
    r"|\s+per process|Communicators\.\.\.|Group\s+Comms|\s+#\s+in group|No communicator data collected|Errors$"
    r"|Warnings$|INCOMPLETE$|DEAD$|TIMEOUT$|\s+Communicator ranks have different status|\s+Initialization error"
    r"|\s+Asynchronous error|\s+\[could not find information|The outlier node|\s+Node \S+ running process)")


def parse(source: LineSource) -> RasReport:
    """Read ``ncclras`` output. Lines it does not know are gaps; everything it knows is kept."""
    report = RasReport()
    section: str | None = None  # "summary", "missing", "dead", "comm"
    comm: RasComm | None = None
    count_op: tuple[str, int] | None = None  # (operation, ops) the next bare Rank lines belong to
    count_status: str | None = None
    count_error: str | None = None
    operation: str | None = None
    expect_totals = False
    for number, raw in numbered_lines(source):
        line = raw.rstrip()
        stripped = line.strip()
        if not stripped:
            continue
        version = _VERSION.match(stripped)
        if version:
            report.nccl_version = version.group(1)
            continue
        if any(stripped.startswith(marker) for marker in _CLIENT_ERRORS):
            if report.client_error is None or report.client_error.startswith("Connecting to "):
                report.client_error = clip(stripped, 200)
            continue
        if stripped.startswith(_CLIENT_HINTS):
            continue
        if stripped == "Job summary":
            section, comm = "summary", None
            continue
        if stripped in ("Errors", "Warnings"):
            section, comm = None, None
            continue
        if stripped == "INCOMPLETE":
            section, comm = "missing", None
            continue
        if stripped == "DEAD":
            section, comm = "dead", None
            continue
        if stripped == "TIMEOUT":
            section, comm = "timeout", None
            continue
        if "(total)" in line:
            expect_totals = True
        numbers = _NUMBERS.match(line)
        if numbers and section == "summary":
            values = [int(v) for v in numbers.group(1).split()]
            if len(values) == 5:  # nodes, processes per node, GPUs per process, processes, GPUs
                report.nodes, report.processes, report.gpus = values[0], values[3], values[4]
            elif len(values) == 3 and expect_totals:
                report.nodes, report.processes, report.gpus = values
            continue
        row = _GROUP_ROW.match(line)
        if row:
            group = row.groups()
            report.groups.append((int(group[0]), int(group[1]), int(group[2]), group[3], int(group[4]),
                                  int(group[5]), group[6], group[7]))
            continue
        header = _COMM.match(stripped)
        if header:
            comm = RasComm(header.group(1), header.group(2).lower(), header.group(3), number)
            report.comms.append(comm)
            section, count_op, count_status, count_error, operation = "comm", None, None, None, None
            continue
        missing = _MISSING_PROCS.match(line)
        if missing and section == "missing":
            report.missing_count = int(missing.group(1))
            continue
        dead = _DEAD.match(line)
        if dead:
            report.dead_count = int(dead.group(1))
            section = "dead"
            continue
        process = _PROCESS.match(line)
        if process and section in ("missing", "dead"):
            item = RasProcess(int(process.group(1)), process.group(2) or None, process.group(3), number,
                              clip(stripped))
            (report.missing_processes if section == "missing" else report.dead_processes).append(item)
            continue
        timeout = _TIMEOUT.match(line)
        if timeout:
            report.timeouts = int(timeout.group(1))
            continue
        if comm is not None:
            if (found := _MISSING_RANKS.match(line)):
                comm.missing = int(found.group(1))
                continue
            if (found := _DIFFERENT_OPS.match(line)):
                operation, count_op, count_status, count_error = found.group(1), None, None, None
                comm.op_counts.setdefault(operation, {})
                continue
            if (found := _COUNT_OPS.match(line)):
                ops = int(found.group(2) or 0)
                count_op, count_status, count_error = (operation or "?", ops), None, None
                comm.op_counts.setdefault(operation or "?", {})[ops] = int(found.group(1))
                continue
            if (found := _COUNT_STATUS.match(line)):
                count_status, count_op, count_error = found.group(2), None, None
                continue
            if (found := _COUNT_ERROR.match(line)):
                count_error, count_op, count_status = found.group(2), None, None
                continue
            if (found := _RANK.match(line)):
                rank = RasRank(int(found["rank"]), found["gpu"], int(found["pid"]) if found["pid"] else None,
                               found["host"] or None, number, clip(stripped), status=found["status"],
                               error=found["error"])
                if found["ops"] is not None or found["none"] is not None:
                    rank.ops = int(found["ops"] or 0)
                    rank.operation = operation or "?"
                    comm.op_counts.setdefault(rank.operation, {}).setdefault(rank.ops, 1)
                elif count_op is not None:
                    rank.operation, rank.ops = count_op
                elif count_status is not None:
                    rank.status = count_status
                elif count_error is not None:
                    rank.error = count_error
                comm.ranks.append(rank)
                continue
        if _KNOWN.match(line) or stripped.startswith(("Missing communicator data", "Encountered")):
            continue
        if len(report.gaps) < 200:
            report.gaps.append(Gap(f"not an ncclras line: {clip(stripped, 80)!r}", number))
    if report.client_error and not report.groups:
        report.gaps.append(Gap(f"ncclras could not query the job: {report.client_error}"))
    return report


def detect(sample: str) -> float:
    head = sample[:65536]
    markers = sum(marker in head for marker in (
        "Job summary\n===========", "Group     Comms     Nodes     Ranks", "Communicators...",
        "considered dead (unreachable via the RAS network)", "Missing communicator data from",
        "Failed to connect to the NCCL RAS service"))
    if markers >= 2:
        return 1.0
    if markers == 1:
        return 0.8
    return 0.0


def summarize(report: RasReport) -> list[str]:
    if report.client_error and not report.groups:
        return [f"ncclras could not query the job: {report.client_error}"]
    lines = [f"NCCL {report.nccl_version or '?'} RAS: {report.nodes} node(s), {report.processes} process(es), "
             f"{report.gpus} GPU(s); {len(report.groups)} communicator group(s)"]
    for row in report.groups:
        lines.append(f"  group {row[0]}: {row[1]} comm(s) of {row[4]} ranks, {row[6]}, {row[7]}")
    if report.dead_count:
        lines.append(f"  DEAD: {report.dead_count} process(es)")
        lines.extend(f"    {p.text}" for p in report.dead_processes[:10])
    if report.missing_count:
        lines.append(f"  INCOMPLETE: no data from {report.missing_count} process(es)")
        lines.extend(f"    {p.text}" for p in report.missing_processes[:10])
    for comm in report.comms:
        lagging = comm.lagging()
        what = f"{len(lagging)} rank(s) behind" if lagging else f"{len(comm.ranks)} rank(s) named"
        lines.append(f"  #{comm.label} {comm.kind}: {what}")
        lines.extend(f"    {r.text}" for r in (lagging or comm.ranks)[:5])
    if report.timeouts:
        lines.append(f"  {report.timeouts} timeout(s) while gathering")
    if report.healthy():
        lines.append("  every communicator RUNNING and OK")
    return lines


KIND = register(Kind(
    name="ncclras",
    description="NCCL RAS client (ncclras, NCCL 2.24+): job-wide dead, unresponsive and lagging ranks",
    command="ncclras",
    parse=parse,
    detect=detect,
    summarize=summarize,
    streaming=True,
))

#: Only where the node has the client; it asks the job's own RAS thread on this node.
REMOTE = register_remote(RemoteProbe(
    name="ncclras", filename="ncclras.txt",
    command=("command -v ncclras >/dev/null 2>&1 || { echo 'ncclras: not installed on this node' >&2; exit 127; }; "
             "exec ncclras -t 5"),
    kind="ncclras", order=94, max_bytes=8 << 20, baseline=False,
))
