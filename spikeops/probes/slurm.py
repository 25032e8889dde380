"""Slurm's view of the nodes: ``scontrol show node`` and ``sinfo -R``.

Slurm drains a node when slurmd or a health check reports trouble (``gres/gpu count reported
lower than configured``, an NHC failure), and admins drain nodes by hand with a reason. For a
loss spike that is hardware evidence with a name and a time on it, and it is also what the
scheduler side of spikeops acts on: it drains nodes with reasons that start with
``REASON_PREFIX`` and must never undo a drain someone else wrote (``is_spikeops_reason``).

``scontrol show node`` prints ``Key=value`` pairs, several per line, continuation lines indented
by three spaces, a blank line between nodes (``-o``: one node per line). Values may hold spaces
(``OS=Linux 4.14.61-aufs-1 #1 SMP Tue Aug 7 ...``, ``Reason=memory issues? [root@...]``), so a
line is split at `` Key=`` boundaries whose key has Slurm's shape (``[A-Z][A-Za-z0-9_/]*``), and
the free-text fields that Slurm prints last (``Reason``, ``Comment``, ``Extra``) run on to the
next field that may follow them, because their text is the admin's and may hold anything. A
multi-line reason is continued on lines indented further. Lines that are neither (shell
prompts pasted with the output) are skipped; a forum that stripped the indentation changes
nothing, since keys, not indentation, start fields.

``sinfo -R`` is a fixed-width table (default ``%20E %9u %19H %N``): columns are cut at the
header's word positions, so ``sinfo -R -o`` layouts with other widths read the same way.
sinfo truncates a reason to its column; ``truncated`` says when a reason filled it.

Times: Slurm prints the controller's local time without a zone. Per the project rule (bundle
spec: a time without a zone is UTC) they are read as UTC; on a controller not set to UTC they
are off by its offset. The text as printed stays in ``SlurmNode.fields``.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import datetime

from ClusterShell.NodeSet import RESOLVER_NOGROUP, NodeSet

from spikeops.probes.base import Gap, Kind, LineSource, clip, join_text, numbered_lines, register
from spikeops.timeparse import iso, parse_iso

__all__ = [
    "REASON_PREFIX",
    "is_spikeops_reason",
    "SlurmNode",
    "SlurmNodes",
    "SinfoReason",
    "SinfoReasons",
    "parse_show_node",
    "parse_sinfo_reasons",
    "expand_nodelist",
    "fold_nodes",
    "MAX_EXPANDED_NODES",
    "detect_show_node",
    "detect_sinfo_reasons",
    "summarize_show_node",
    "summarize_sinfo_reasons",
    "SHOW_NODE_KIND",
    "SlurmJob",
    "parse_show_job",
    "FINISHED_JOB_STATES",
    "SINFO_REASONS_KIND",
]

#: Every drain reason spikeops writes starts with this; anything else belongs to someone else.
REASON_PREFIX = "spikeops:"
#: A node list is expanded only up to this many names: ``gpu[0-999999999]`` must not cost memory.
MAX_EXPANDED_NODES = 100_000


def is_spikeops_reason(reason: str | None) -> bool:
    """True when a drain reason was written by spikeops, so spikeops may resume the node.

    sinfo cuts reasons at 20 characters, which keeps the 9-character prefix intact.
    """
    return reason is not None and reason.strip().startswith(REASON_PREFIX)


# --------------------------------------------------------------------------- scontrol show node


@dataclass
class SlurmNode:
    """One node as ``scontrol show node`` printed it; ``fields`` holds every pair verbatim."""

    name: str
    state: str
    base_state: str
    flags: frozenset[str]
    reason: str | None
    reason_user: str | None
    reason_time: datetime | None
    gres: str | None
    gres_used: str | None
    partitions: list[str]
    cpus_total: int | None
    cpus_alloc: int | None
    real_memory_mb: int | None
    alloc_memory_mb: int | None
    boot_time: datetime | None
    slurmd_start_time: datetime | None
    version: str | None
    fields: dict[str, str]
    line: int
    text: str
    #: Line of ``Reason=`` (the line a drain finding cites), None when the node has no reason.
    reason_line: int | None = None

    @property
    def drained(self) -> bool:
        """Drained or draining: Slurm will start no new job here."""
        return "DRAIN" in self.flags or self.base_state in ("DRAINED", "DRAINING", "DRAIN")

    @property
    def down(self) -> bool:
        return self.base_state in ("DOWN", "FAIL", "FAILING") or "FAIL" in self.flags

    @property
    def drained_by_spikeops(self) -> bool:
        return self.drained and is_spikeops_reason(self.reason)


@dataclass
class SlurmNodes:
    """Every node read from one ``scontrol show node`` capture, in print order."""

    nodes: list[SlurmNode] = field(default_factory=list)
    gaps: list[Gap] = field(default_factory=list)

    def by_name(self) -> dict[str, SlurmNode]:
        return {node.name: node for node in self.nodes}

    def unavailable(self) -> list[SlurmNode]:
        """Nodes Slurm will not schedule on (drained, draining, down, failed)."""
        return [node for node in self.nodes if node.drained or node.down]


_KEY_AT_START = re.compile(r"^[A-Z][A-Za-z0-9_/]*=")
_KEY = re.compile(r"(?:^|(?<=\s))(?P<key>[A-Z][A-Za-z0-9_/]*)=")
#: Fields Slurm prints after the free-text ``Reason`` (src/api/node_info.c), in order.
_TAIL = ("Reason", "Comment", "Extra", "InstanceId", "InstanceType", "ReservationName")
_FREE_TEXT = {"Reason", "Comment", "Extra"}
_STAMP = re.compile(r"\s*\[(?P<user>[^\[\]@\s]+)@(?P<time>[^\[\]]+)\]")
_NULL = {"", "(null)", "N/A", "n/a", "None", "none"}
#: sinfo-style state suffixes (``idle*``); scontrol spells these out as flags.
_SUFFIX_FLAGS = {"*": "NOT_RESPONDING", "~": "POWERED_DOWN", "#": "POWERING_UP", "%": "POWERING_DOWN",
                 "!": "POWER_DOWN", "$": "MAINTENANCE", "@": "REBOOT_REQUESTED", "^": "REBOOT_ISSUED",
                 "-": "PLANNED"}


def _pairs(text: str) -> list[tuple[str, str]]:
    """Split ``Key=value Key2=value two`` at key boundaries; free-text fields run on."""
    marks = list(_KEY.finditer(text))
    pairs: list[tuple[str, str]] = []
    index = 0
    while index < len(marks):
        mark = marks[index]
        key = mark["key"]
        follow = index + 1
        if key in _FREE_TEXT:
            allowed = set(_TAIL[_TAIL.index(key) + 1 :])
            while follow < len(marks) and marks[follow]["key"] not in allowed:
                follow += 1
        end = marks[follow].start() if follow < len(marks) else len(text)
        pairs.append((key, text[mark.end() : end].strip()))
        index = follow
    return pairs


def _is_prompt(line: str) -> bool:
    """A shell prompt pasted above the output: ``$ scontrol ...``, ``[u@h dir]$ sinfo -R``."""
    return bool(re.search(r"(?:^|[\s\]\)~:\w])[$#]\s+[\w./-]", line))


def _int(value: str | None) -> int | None:
    if value is None or not re.fullmatch(r"\d+", value.strip()):
        return None
    return int(value)


def _time(value: str | None) -> datetime | None:
    """Slurm's ``2019-01-29T10:42:12`` (controller local time, read as UTC); ``None``/``Unknown`` -> None."""
    if value is None or value.strip() in _NULL or value.strip() == "Unknown":
        return None
    return parse_iso(value)


def _split_state(state: str) -> tuple[str, frozenset[str]]:
    """``IDLE+DRAIN`` -> (``IDLE``, {``DRAIN``}); ``idle*`` -> (``IDLE``, {``NOT_RESPONDING``})."""
    parts = [p for p in state.strip().split("+")]
    base = parts[0] if parts else ""
    flags = {p.upper() for p in parts[1:] if p}
    while base and base[-1] in _SUFFIX_FLAGS:
        flags.add(_SUFFIX_FLAGS[base[-1]])
        base = base[:-1]
    return base.upper(), frozenset(flags)


def _split_reason(value: str) -> tuple[str, str | None, datetime | None]:
    """``memory issues? [root@2019-01-29T10:42:12]`` -> text, user, time."""
    stamps = list(_STAMP.finditer(value))
    if not stamps:
        return value.strip(), None, None
    stamp = stamps[-1]
    text = (value[: stamp.start()] + value[stamp.end() :]).strip()
    return text, stamp["user"], _time(stamp["time"])


@dataclass
class _Draft:
    line: int
    text: str
    fields: dict[str, str] = field(default_factory=dict)
    reason_line: int | None = None


def _build(draft: _Draft) -> SlurmNode:
    f = draft.fields
    state = f.get("State", "")
    base, flags = _split_state(state)
    reason_raw = f.get("Reason")
    reason, user, when = _split_reason(reason_raw) if reason_raw else (None, None, None)
    gres = f.get("Gres")
    gres_used = f.get("GresUsed")
    return SlurmNode(
        name=f.get("NodeName", ""),
        state=state,
        base_state=base,
        flags=flags,
        reason=reason or None,
        reason_user=user,
        reason_time=when,
        gres=None if gres is None or gres in _NULL else gres,
        gres_used=None if gres_used is None or gres_used in _NULL else gres_used,
        partitions=[p for p in f.get("Partitions", "").split(",") if p.strip()],
        cpus_total=_int(f.get("CPUTot")),
        cpus_alloc=_int(f.get("CPUAlloc")),
        real_memory_mb=_int(f.get("RealMemory")),
        alloc_memory_mb=_int(f.get("AllocMem")),
        boot_time=_time(f.get("BootTime")),
        slurmd_start_time=_time(f.get("SlurmdStartTime")),
        version=f.get("Version") or None,
        fields=dict(f),
        line=draft.line,
        text=draft.text,
        reason_line=draft.reason_line,
    )


def parse_show_node(source: LineSource) -> SlurmNodes:
    """Read ``scontrol show node [-o]`` output, any number of nodes, prompts and all."""
    result = SlurmNodes()
    draft: _Draft | None = None
    in_reason = False
    for number, line in numbered_lines(source):
        stripped = line.strip()
        if not stripped:
            in_reason = False
            continue
        if _KEY_AT_START.match(stripped):
            pairs = _pairs(stripped)
            if pairs and pairs[0][0] == "NodeName":
                if draft is not None:
                    result.nodes.append(_build(draft))
                draft = _Draft(line=number, text=clip(line))
            elif draft is None:
                result.gaps.append(Gap(f"field line before any NodeName=: {stripped[:60]!r}", number))
                in_reason = False
                continue
            for key, value in pairs:
                if key in draft.fields and key != "NodeName":
                    result.gaps.append(Gap(f"{key}= printed twice for {draft.fields.get('NodeName')}", number))
                draft.fields[key] = value
                if key == "Reason":
                    draft.reason_line = number
            in_reason = pairs[-1][0] == "Reason" if pairs else False
        elif in_reason and draft is not None and line[:4].isspace():
            draft.fields["Reason"] = draft.fields.get("Reason", "") + "\n" + stripped
        elif _is_prompt(line):
            in_reason = False
        else:
            in_reason = False
            result.gaps.append(Gap(f"not scontrol output: {clip(stripped, 120)!r}", number))
    if draft is not None:
        result.nodes.append(_build(draft))
    if not result.nodes:
        result.gaps.append(Gap("no NodeName= record found"))
    return result


# --------------------------------------------------------------------------- node lists


def _nodelist_size(text: str) -> int:
    """Upper bound of the names a node list expands to, without expanding it."""
    total = 0
    depth = 0
    element = []
    for char in text + ",":
        if char == "[":
            depth += 1
        elif char == "]":
            depth = max(depth - 1, 0)
        if char == "," and depth == 0:
            size = 1
            for group in re.findall(r"\[([^\[\]]*)\]", "".join(element)):
                count = 0
                for low, high in re.findall(r"(\d+)-(\d+)", group):
                    count += abs(int(high) - int(low)) + 1
                count += len(re.findall(r"(?:^|,)\s*\d+\s*(?=,|$)", group))
                size *= max(count, 1)
                if size > MAX_EXPANDED_NODES:
                    return size
            total += size
            element = []
        else:
            element.append(char)
    return total


def expand_nodelist(text: str) -> tuple[list[str], str | None]:
    """``gpu[004-009]`` -> the names, with ClusterShell; (names, None) or ([], why not)."""
    text = text.strip()
    if not text:
        return [], None
    if _nodelist_size(text) > MAX_EXPANDED_NODES:
        return [], f"node list {text[:60]!r} expands past {MAX_EXPANDED_NODES} names"
    try:
        return list(NodeSet(text, resolver=RESOLVER_NOGROUP)), None
    except Exception as exc:  # ClusterShell raises its own and builtin errors on bad syntax
        return [], f"node list {text[:60]!r} not understood: {str(exc)[:80]}"


def fold_nodes(names: Iterable[str]) -> str:
    """``gpu009, gpu010`` -> ``gpu[009-010]`` for summaries; a plain join if ClusterShell refuses."""
    names = list(names)
    try:
        return str(NodeSet.fromlist(names, resolver=RESOLVER_NOGROUP))
    except Exception:  # a name with brackets or other syntax ClusterShell reserves
        return ",".join(names)


# --------------------------------------------------------------------------- scontrol show job

#: Job states after which nothing runs and nothing will (src/common/slurm_protocol_defs.c).
FINISHED_JOB_STATES = frozenset({"BOOT_FAIL", "CANCELLED", "COMPLETED", "DEADLINE", "FAILED", "NODE_FAIL",
                                 "OUT_OF_MEMORY", "PREEMPTED", "TIMEOUT", "REVOKED", "SPECIAL_EXIT"})


#: Job keys include ``AllocNode:Sid=`` and ``Socks/Node=``.
_JOB_KEY = re.compile(r"(?:^|(?<=\s))(?P<key>[A-Z][A-Za-z0-9_/:]*)=")


@dataclass
class SlurmJob:
    """One job as ``scontrol show job -d -o`` printed it; ``fields`` holds every pair."""

    job_id: str
    name: str | None
    state: str
    reason: str | None
    nodes: list[str]
    partition: str | None
    work_dir: str | None
    command: str | None
    comment: str | None
    batch: bool
    requeue: bool
    fields: dict[str, str]

    @property
    def finished(self) -> bool:
        return self.state in FINISHED_JOB_STATES


def parse_show_job(source: LineSource) -> list[SlurmJob]:
    """Jobs from ``scontrol show job -d -o`` (one line each) or the multi-line form."""
    text = join_text(source)
    blocks = [b for b in re.split(r"\n\s*\n|\n(?=JobId=)", text) if "JobId=" in b]
    jobs = []
    for block in blocks:
        line = " ".join(part.strip() for part in block.splitlines())
        marks = list(_JOB_KEY.finditer(line))  # job fields carry no free text with " Key=" inside
        fields = {mark["key"]: line[mark.end(): marks[i + 1].start() if i + 1 < len(marks) else len(line)].strip()
                  for i, mark in enumerate(marks)}
        nodes, _ = expand_nodelist(fields.get("NodeList", "")) if fields.get("NodeList", "") not in _NULL else ([], None)
        comment = fields.get("Comment")
        jobs.append(SlurmJob(
            job_id=fields.get("JobId", ""),
            name=fields.get("JobName") or None,
            state=fields.get("JobState", "").upper(),
            reason=None if fields.get("Reason") in _NULL or fields.get("Reason") is None else fields.get("Reason"),
            nodes=nodes,
            partition=fields.get("Partition") or None,
            work_dir=fields.get("WorkDir") or None,
            command=fields.get("Command") or None,
            comment=None if comment is None or comment in _NULL else comment,
            batch=fields.get("BatchFlag") == "1",
            requeue=fields.get("Requeue") == "1",
            fields=fields,
        ))
    return jobs


# --------------------------------------------------------------------------- sinfo -R


@dataclass
class SinfoReason:
    """One ``sinfo -R`` row: a reason, who set it and when, on which nodes."""

    reason: str
    truncated: bool
    user: str | None
    time: datetime | None
    nodelist: str
    nodes: list[str]
    line: int
    text: str = ""
    #: Present when the layout has a STATE column (``sinfo -R -l``, ``-o ... %t``).
    state: str | None = None


@dataclass
class SinfoReasons:
    rows: list[SinfoReason] = field(default_factory=list)
    gaps: list[Gap] = field(default_factory=list)

    def nodes(self) -> list[str]:
        """Every node with a reason, each once, in print order."""
        seen: dict[str, None] = {}
        for row in self.rows:
            for node in row.nodes:
                seen.setdefault(node, None)
        return list(seen)


_COLUMN_NAMES = {"REASON": "reason", "USER": "user", "TIMESTAMP": "time", "STATE": "state",
                 "NODELIST": "nodelist", "HOSTNAMES": "nodelist"}
#: sinfo's default ``-R`` layout, ``%20E %9u %19H %N``, for output printed with ``-h``.
_DEFAULT_COLUMNS = [("reason", 0), ("user", 21), ("time", 31), ("nodelist", 51)]
_TIMESTAMP = re.compile(r"^(?:\d{4}-\d{2}-\d{2}T\d{2}:\d{2}:\d{2}|Unknown|None)$")


def _header_columns(line: str) -> list[tuple[str, int]] | None:
    """Column names and start positions from a ``REASON  USER  TIMESTAMP  NODELIST`` header."""
    words = list(re.finditer(r"\S+", line))
    if not words or any(not re.fullmatch(r"[A-Z_]+", w.group()) for w in words):
        return None
    names = [w.group() for w in words]
    if "REASON" not in names or not ({"NODELIST", "HOSTNAMES"} & set(names)):
        return None
    return [(_COLUMN_NAMES.get(w.group(), w.group().lower()), w.start()) for w in words]


def _fits_default(line: str) -> bool:
    if len(line) <= 51 or line[20] != " " or line[30] != " " or line[50] != " ":
        return False
    return bool(_TIMESTAMP.match(line[31:50].strip())) and bool(line[51:].strip())


def _looks_like_row(line: str, columns: list[tuple[str, int]]) -> bool:
    """A row, not a prompt: its TIMESTAMP cell holds a time (a reason may contain ``# ``)."""
    cells = _cells(line, columns)
    if "time" not in cells:
        return bool(cells.get("nodelist", ("", 0))[0].strip())
    return bool(_TIMESTAMP.match(cells["time"][0].strip()))


def _cells(line: str, columns: list[tuple[str, int]]) -> dict[str, tuple[str, int]]:
    """Each column's text, and its width (start of next column minus the separating space)."""
    cells: dict[str, tuple[str, int]] = {}
    for index, (name, start) in enumerate(columns):
        if index + 1 < len(columns):
            end = columns[index + 1][1]
            cells[name] = (line[start : end - 1] if end - 1 > start else "", end - 1 - start)
        else:
            cells[name] = (line[start:], 0)
    return cells


def _sinfo_row(number: int, line: str, columns: list[tuple[str, int]], gaps: list[Gap]) -> SinfoReason | None:
    cells = _cells(line, columns)
    reason_raw, width = cells.get("reason", ("", 0))
    reason = reason_raw.strip()
    nodelist = cells.get("nodelist", ("", 0))[0].strip()
    if not nodelist:
        gaps.append(Gap(f"sinfo row without a node list: {clip(line, 100)!r}", number))
        return None
    time_text = cells.get("time", ("", 0))[0].strip()
    when = _time(time_text)
    if when is None and time_text not in ("", "Unknown", "None"):
        gaps.append(Gap(f"timestamp {time_text[:30]!r} not ISO (SLURM_TIME_FORMAT?)", number))
    nodes, problem = expand_nodelist(nodelist)
    if problem:
        gaps.append(Gap(problem, number))
    user = cells.get("user", ("", 0))[0].strip() or None
    state = (cells["state"][0].strip() or None) if "state" in cells else None
    return SinfoReason(
        reason=reason,
        truncated=width > 0 and len(reason_raw.rstrip()) >= width,
        user=user,
        time=when,
        nodelist=nodelist,
        nodes=nodes,
        line=number,
        text=clip(line),
        state=state,
    )


def parse_sinfo_reasons(source: LineSource) -> SinfoReasons:
    """Read ``sinfo -R`` (any ``-o`` widths, by the header; the default layout without one)."""
    result = SinfoReasons()
    columns: list[tuple[str, int]] | None = None
    for number, line in numbered_lines(source):
        if not line.strip():
            continue
        header = _header_columns(line)
        if header is not None:
            columns = header
            continue
        if columns is None and _fits_default(line):
            row = _sinfo_row(number, line, _DEFAULT_COLUMNS, result.gaps)
        elif columns is not None and (_looks_like_row(line, columns) or not _is_prompt(line)):
            row = _sinfo_row(number, line, columns, result.gaps)
        elif _is_prompt(line):
            continue
        else:
            result.gaps.append(Gap(f"not sinfo -R output: {clip(line.strip(), 120)!r}", number))
            continue
        if row is not None:
            result.rows.append(row)
    if columns is None and not result.rows:
        result.gaps.append(Gap("no sinfo -R header (REASON ... NODELIST) found"))
    return result


# --------------------------------------------------------------------------- detect, summarize


def detect_show_node(sample: str) -> float:
    if not re.search(r"^\s*NodeName=\S", sample, re.M):
        return 0.0
    if re.search(r"\bCPU(?:Alloc|Tot)=\d", sample):
        return 0.95
    return 0.6 if re.search(r"\bState=[A-Z]", sample) else 0.2  # slurm.conf also has NodeName=


def detect_sinfo_reasons(sample: str) -> float:
    for line in sample.splitlines()[:200]:
        if _header_columns(line) is not None and re.match(r"\s*REASON\s", line):
            return 0.95
    rows = sum(1 for line in sample.splitlines()[:200] if _fits_default(line))
    return 0.4 if rows >= 2 else 0.0


def _when(times: list[datetime]) -> str:
    if not times:
        return "time unknown"
    low, high = min(times), max(times)
    if low == high:
        return iso(low) or ""
    return f"{iso(low)}..{iso(high)}"


def _plural(count: int, noun: str) -> str:
    return f"{count} {noun}" + ("" if count == 1 else "s")


def summarize_show_node(result: SlurmNodes) -> list[str]:
    states: dict[str, list[str]] = {}
    for node in result.nodes:
        states.setdefault(node.state or "?", []).append(node.name)
    lines = [f"{_plural(len(result.nodes), 'node')}: " + "; ".join(
        f"{state} {fold_nodes(names)}" for state, names in states.items())]
    groups: dict[tuple[str, str, str], list[SlurmNode]] = {}
    for node in result.unavailable():
        groups.setdefault((node.state, node.reason or "", node.reason_user or "?"), []).append(node)
    for (state, reason, user), nodes in groups.items():
        times = [n.reason_time for n in nodes if n.reason_time is not None]
        mark = " [spikeops]" if is_spikeops_reason(reason) else ""
        lines.append(f"  {fold_nodes(n.name for n in nodes)} {state}: {reason or '(no reason)'!r} "
                     f"by {user}, {_when(times)}{mark}")
    return lines


def summarize_sinfo_reasons(result: SinfoReasons) -> list[str]:
    lines = [f"{_plural(len(result.rows), 'reason')} over {_plural(len(result.nodes()), 'node')}"]
    groups: dict[tuple[str, bool, str], list[SinfoReason]] = {}
    for row in result.rows:
        groups.setdefault((row.reason, row.truncated, row.user or "?"), []).append(row)
    for (reason, truncated, user), rows in groups.items():
        names = [n for row in rows for n in row.nodes]
        times = [row.time for row in rows if row.time is not None]
        mark = " [spikeops]" if is_spikeops_reason(reason) else ""
        lines.append(f"  {reason}{'…' if truncated else ''} by {user}, {_when(times)}: "
                     f"{fold_nodes(names) if names else ','.join(r.nodelist for r in rows)} "
                     f"({_plural(len(names), 'node')}){mark}")
    return lines


SHOW_NODE_KIND = register(
    Kind(
        name="scontrol-show-node",
        description="scontrol show node [-o]: Slurm node state, drain reason (who/when), GRES",
        command="scontrol show node",
        parse=parse_show_node,
        detect=detect_show_node,
        summarize=summarize_show_node,
    )
)

SINFO_REASONS_KIND = register(
    Kind(
        name="sinfo-reasons",
        description="sinfo -R: why nodes are drained or down, by whom, when, node lists expanded",
        command="sinfo -R",
        parse=parse_sinfo_reasons,
        detect=detect_sinfo_reasons,
        summarize=summarize_sinfo_reasons,
    )
)
