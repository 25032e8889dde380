"""Layer 3, communication: which rank did the job wait for, and did the ranks agree?

The seed asks to "confirm that communication ops match the parallelism strategy (PP
send/recv misalignment)". PyTorch's flight recorder answers it rank by rank: each rank's
dump lists the collectives it issued, numbered per process group (``collective_seq_id``),
so across ranks:

- **collective_mismatch**: at one sequence number of one group, ranks issued different
  operations (``all_reduce`` on some, ``broadcast`` on others) or the same operation with
  different sizes. The program's parallel plan is wrong on some ranks (a pipeline stage
  sending where its peer also sends, a branch only some ranks take): a software fault. It
  convicts no node; the fix is the parallel configuration, and resuming the same code would
  hang again.
- **collective_hang**: the ranks that wait in sequence number S (issued, not finished) wait
  for members of the group whose dump shows they never issued S: those ranks never joined.
  The finding names them, their nodes, S and the operation, and where their processes are
  (``stacks/``: a data loader, a checkpoint write, a dead GPU's kernel). It convicts nobody by
  itself: a rank stuck in its data loader is not a bad node; a node that also shows hardware
  evidence is convicted by the hardware rule, which then carries this evidence too
  (``join_hardware``).
- NCCL RAS (``ncclras.txt``) names dead and unresponsive processes and ranks that launched
  fewer operations than their peers, job-wide, without dumps: the same kind of finding.

Ranks come from the dumps' file names (torch appends the global rank); a rank's node is the
node whose folder held that rank's dump when only one did (node-local dumps: the process wrote
it there), else the job's rank map (``incident.json``: on a shared file system every node
holds every dump, and identical dumps are read once). Dumps whose newest entry is older than the job are
another run's and are set aside. Rings wrap: only sequence numbers every compared rank still
holds are compared.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from spikeops.diagnosis.context import Context
from spikeops.diagnosis.model import EvidenceLine, Finding, RuledOut
from spikeops.probes.flight_recorder import FlightRecorderDump, FrEntry, rank_from_name

__all__ = ["RULES", "comm_collective_mismatch", "comm_collective_hang", "comm_ras_ranks", "join_hardware",
           "rank_traces", "RankTrace", "HANG_CONFIDENCE", "MISMATCH_CONFIDENCE", "RAS_CONFIDENCE"]

HANG_CONFIDENCE = 0.85
#: Some members of the group left no dump: the waiting ranks are certain, the missing ones
#: are only "not known to have joined".
PARTIAL_CONFIDENCE = 0.55
MISMATCH_CONFIDENCE = 0.9
RAS_CONFIDENCE = 0.7
#: Operations whose inputs must have the same sizes on every rank (others may be uneven:
#: all_gather_v, all_to_all with splits, gather/scatter).
_SIZED = frozenset({"all_reduce", "allreduce", "broadcast", "reduce", "reduce_scatter", "_reduce_scatter_base",
                    "reduce_scatter_tensor", "allreduce_coalesced", "all_reduce_coalesced", "barrier"})


@dataclass
class RankTrace:
    """One rank's dump as the diagnosis uses it."""

    rank: int
    file: str
    nodes: list[str]
    dump: FlightRecorderDump
    #: (group key, seq) -> the newest entry of that collective.
    by_seq: dict[tuple[str, int], FrEntry] = field(default_factory=dict)


def _group_key(entry: FrEntry) -> str:
    return entry.pg_name if entry.pg_name is not None else (entry.pg_desc or "?")


def _digest(dump: FlightRecorderDump) -> str:
    tail = [(e.collective_seq_id, e.p2p_seq_id, e.profiling_name, e.state, e.retired, e.time_created_ns)
            for e in dump.entries[-64:]]
    return hashlib.sha1(repr((len(dump.entries), tail)).encode()).hexdigest()


def rank_traces(ctx: Context) -> tuple[dict[int, RankTrace], list[str]]:
    """Every rank's usable dump (duplicates from a shared file system read once), and what
    was set aside: a name without a rank, another run's dump, two different dumps of one rank."""
    traces: dict[int, RankTrace] = {}
    digests: dict[int, str] = {}
    notes: list[str] = []
    started = ctx.job.started
    started_ns = int(started.timestamp() * 1e9) if started is not None else None
    for node in ctx.reachable:
        for name, dump in sorted(node.flight_recorder.items()):
            where = node.file(f"flight-recorder/{name}")
            if not dump.complete or not dump.entries:
                continue  # said in missing by the loader
            rank = rank_from_name(name)
            if rank is None:
                notes.append(f"{where}: no rank at the end of the name (torch writes PREFIX<rank>); not compared")
                continue
            newest = dump.newest_ns()
            if started_ns is not None and newest is not None and newest < started_ns - 60e9:
                notes.append(f"{where}: its newest entry is older than the job's start: another run's dump, set aside")
                continue
            digest = _digest(dump)
            if rank in traces:
                if digests[rank] == digest:
                    traces[rank].nodes.append(node.name)  # the same file seen from another node
                    continue
                if (newest or 0) <= (traces[rank].dump.newest_ns() or 0):
                    notes.append(f"{where}: a second, older dump of rank {rank} (kept {traces[rank].file})")
                    continue
                notes.append(f"{traces[rank].file}: a second, older dump of rank {rank} (kept {where})")
            trace = RankTrace(rank, where, [node.name], dump)
            for entry in dump.entries:
                if not entry.is_p2p and entry.collective_seq_id is not None and entry.collective_seq_id > 0:
                    trace.by_seq[(_group_key(entry), entry.collective_seq_id)] = entry
            traces[rank], digests[rank] = trace, digest
    return traces, notes


def _members(traces: dict[int, RankTrace], group: str) -> set[int]:
    """The ranks of a process group: its ``pg_config`` (matched by name; a dump with one
    group, such as gloo's, whose config is keyed by the empty name, means that group; the
    default group is the config with the most ranks), else the ranks that used the group."""
    used = {rank for rank, trace in traces.items() if any(key[0] == group for key in trace.by_seq)}
    for trace in traces.values():
        config = trace.dump.pg_config
        match = config.get(group) or next((c for c in config.values() if c.name == group), None)
        if match is None and len(config) == 1:
            match = next(iter(config.values()))
        if match is None:
            default = any(e.pg_desc == "default_pg" for e in trace.dump.entries if _group_key(e) == group)
            if default and config:
                match = max(config.values(), key=lambda c: len(c.ranks or []))
        if match is not None and match.ranks:
            return set(match.ranks) | used
    return used


def _node_of(ctx: Context, rank: int, traces: dict[int, RankTrace]) -> str | None:
    """The node a rank ran on: where its dump was, when only one node held it (the process
    wrote it there: physical evidence, whatever order a scheduler lists the nodes in), else
    the job's rank map (a shared file system shows every dump on every node)."""
    trace = traces.get(rank)
    if trace is not None and len(set(trace.nodes)) == 1:
        return trace.nodes[0]
    return ctx.node_of_rank(rank)


def _fold(ranks: Iterable[int]) -> str:
    items = sorted(set(ranks))
    if not items:
        return "none"
    runs, start, prev = [], items[0], items[0]
    for value in items[1:] + [None]:  # type: ignore[list-item]
        if value is not None and value == prev + 1:
            prev = value
            continue
        runs.append(f"{start}" if start == prev else f"{start}-{prev}")
        if value is not None:
            start = prev = value
    return ",".join(runs)


def _op(entry: FrEntry) -> str:
    return entry.op or entry.profiling_name or "?"


def _shape(entry: FrEntry) -> tuple[Any, ...]:
    sizes = entry.input_sizes if _op(entry) in _SIZED else None
    return (_op(entry), repr(sizes))


def _entry_line(trace: RankTrace, entry: FrEntry, what: str) -> EvidenceLine:
    return EvidenceLine(trace.file, None, f"rank {trace.rank} {what}: entry {entry.index}: {entry.describe()}")


def _stack_lines(ctx: Context, nodes: Iterable[str]) -> tuple[list[EvidenceLine], list[str]]:
    """Where the job's processes on these nodes are: those outside any collective first
    (what the others wait for: a data loader, a checkpoint write), then a count of those
    waiting in one; evidence cites the main thread's innermost frame."""
    lines, said = [], []
    wanted = set(nodes)
    for node in ctx.reachable:
        if node.name not in wanted or not node.stacks:
            continue
        outside, waiting = [], []
        for name, dump in sorted(node.stacks.items()):
            for process in dump.processes[:1]:
                frame = process.waits_in()
                if frame is None:
                    continue
                line = EvidenceLine(node.file(f"stacks/{name}"), frame.at,
                                    f"process {process.pid} main thread: {frame.text()}")
                (waiting if process.in_collective() else outside).append((process, frame, line))
        for process, frame, line in outside[:3]:
            lines.append(line)
            said.append(f"on {node.name} process {process.pid} is in {frame.text()}")
        if waiting:
            lines.extend(line for _, _, line in waiting[:1])
            said.append(f"{len(waiting)} process(es) on {node.name} wait in a collective")
        if len(outside) > 3:
            said.append(f"{len(outside) - 3} more process(es) on {node.name} outside any collective")
    return lines, said


def _by_group(traces: dict[int, RankTrace]) -> dict[str, list[int]]:
    groups: dict[str, set[int]] = {}
    for trace in traces.values():
        for group, seq in trace.by_seq:
            groups.setdefault(group, set()).add(seq)
    return {group: sorted(seqs) for group, seqs in groups.items()}


def _mismatches(traces: dict[int, RankTrace]) -> list[tuple[str, int, dict[tuple[Any, ...], list[int]]]]:
    """(group, seq, {(op, sizes): ranks}) of the first sequence number, per group, at which
    the ranks that issued it disagree."""
    found = []
    for group, seqs in _by_group(traces).items():
        holders = [t for t in traces.values() if any(key[0] == group for key in t.by_seq)]
        # compare only what every holder still has in its ring
        start = max(min(seq for (g, seq) in t.by_seq if g == group) for t in holders)
        for seq in seqs:
            if seq < start:
                continue
            shapes: dict[tuple[Any, ...], list[int]] = {}
            for trace in holders:
                entry = trace.by_seq.get((group, seq))
                if entry is not None:
                    shapes.setdefault(_shape(entry), []).append(trace.rank)
            if len(shapes) > 1:
                found.append((group, seq, shapes))
                break
    return found


def _p2p_mismatches(traces: dict[int, RankTrace]) -> list[tuple[str, str, list[EvidenceLine], list[int]]]:
    """Point-to-point ops (NCCL records them; gloo does not): the k-th send from a to b must
    meet the k-th receive on b from a with the same sizes. Judged only where both rings hold
    the same number of them (a ring that wrapped, or a side that is behind, cannot be paired
    by position: that is a hang's question, not a mismatch's)."""
    out = []
    sends: dict[tuple[str, int, int], list[tuple[RankTrace, FrEntry]]] = {}
    recvs: dict[tuple[str, int, int], list[tuple[RankTrace, FrEntry]]] = {}
    for trace in traces.values():
        for entry in trace.dump.entries:
            if not entry.is_p2p or entry.src is None or entry.dst is None or entry.op not in ("send", "recv"):
                continue
            key = (_group_key(entry), entry.src, entry.dst)
            (sends if entry.op == "send" else recvs).setdefault(key, []).append((trace, entry))
    for key, sent in sends.items():
        got = recvs.get(key, [])
        if len(got) != len(sent):
            continue
        for (s_trace, s_entry), (r_trace, r_entry) in zip(sent, got, strict=True):
            if s_entry.input_sizes and r_entry.input_sizes and repr(s_entry.input_sizes) != repr(r_entry.input_sizes):
                out.append((key[0], f"send {key[1]}->{key[2]} of {s_entry.input_sizes} met a receive of "
                                    f"{r_entry.input_sizes}",
                            [_entry_line(s_trace, s_entry, "sends"), _entry_line(r_trace, r_entry, "receives")],
                            [s_trace.rank, r_trace.rank]))
                break
    return out


def comm_collective_mismatch(ctx: Context) -> list[Finding]:
    traces, notes = rank_traces(ctx)
    ctx.missing.extend(notes)
    if not traces:
        return []
    findings = []
    for group, seq, shapes in _mismatches(traces):
        ordered = sorted(shapes.items(), key=lambda item: (-len(item[1]), min(item[1])))
        majority = ordered[0][1] if len(ordered[0][1]) > len(ordered[1][1]) else []
        odd = sorted(r for shape, ranks in ordered if ranks is not majority for r in ranks)
        evidence = []
        for shape, ranks in ordered[:4]:
            trace = traces[min(ranks)]
            others = f" (as did rank(s) {_fold(r for r in ranks if r != trace.rank)})" if len(ranks) > 1 else ""
            evidence.append(_entry_line(trace, trace.by_seq[(group, seq)], "issued" + others))
        said = "; ".join(f"rank(s) {_fold(ranks)}: {shape[0]}" + (f" {shape[1]}" if shape[1] != "None" else "")
                         for shape, ranks in ordered[:4])
        nodes = sorted({n for r in odd for n in [_node_of(ctx, r, traces)] if n})
        findings.append(Finding(
            layer="communication", cause="collective_mismatch", confidence=MISMATCH_CONFIDENCE,
            summary=(f"the ranks disagree at collective {seq} of process group {group!r}: {said}; a software fault "
                     "(the parallel configuration: a pipeline send/recv or a branch only some ranks take), not a node"),
            nodes=nodes, ranks=odd, evidence=evidence[:6], convicts=False,
        ))
    for group, what, evidence, ranks in _p2p_mismatches(traces):
        findings.append(Finding(
            layer="communication", cause="collective_mismatch", confidence=MISMATCH_CONFIDENCE - 0.05,
            summary=f"point-to-point ops misaligned in process group {group!r}: {what} (pipeline send/recv)",
            nodes=sorted({n for r in ranks for n in [_node_of(ctx, r, traces)] if n}), ranks=sorted(ranks),
            evidence=evidence, convicts=False,
        ))
    if not findings:
        groups = _by_group(traces)
        ctx.ruled_out.append(RuledOut("communication", f"the flight recorder dumps of {len(traces)} rank(s) agree on "
                                      f"every collective they share ({len(groups)} process group(s))"))
    return findings


def comm_collective_hang(ctx: Context) -> list[Finding]:
    traces, _ = rank_traces(ctx)
    if not traces:
        if not any(node.flight_recorder for node in ctx.reachable):
            ctx.missing.append("flight-recorder/: no dump collected (which rank a hang waits for is not known; "
                               "set TORCH_FR_BUFFER_SIZE in the job)")
        return []
    mismatched = {(group, seq) for group, seq, _ in _mismatches(traces)}
    findings = []
    for group, seqs in _by_group(traces).items():
        pending: list[tuple[int, RankTrace, FrEntry]] = []
        for trace in traces.values():
            for (g, seq), entry in trace.by_seq.items():
                if g == group and entry.pending:
                    pending.append((seq, trace, entry))
        if not pending:
            continue
        seq = min(item[0] for item in pending)
        if (group, seq) in mismatched:
            continue  # the ranks are in different collectives: the mismatch says it
        waiting = sorted({trace.rank for s, trace, _ in pending if s == seq})
        members = _members(traces, group)
        behind, unknown = [], []
        for rank in sorted(members):
            trace = traces.get(rank)
            if trace is None:
                unknown.append(rank)
                continue
            mine = [s for (g, s) in trace.by_seq if g == group]
            if not mine:  # nothing of this group in its ring (wrapped by other groups, or none yet)
                unknown.append(rank)
            elif max(mine) < seq:
                behind.append(rank)
        sample = next(entry for s, trace, entry in pending if s == seq and trace.rank == waiting[0])
        op = f"{sample.profiling_name or _op(sample)}" + (f" {sample.input_sizes}" if sample.input_sizes else "")
        evidence = [_entry_line(traces[waiting[0]], sample, "waits")]
        if not behind and not unknown:
            ctx.ruled_out.append(RuledOut("communication", f"every rank of process group {group!r} entered collective "
                                          f"{seq} ({op}): none is missing (the collective itself is stuck)"))
            continue
        named = behind or unknown
        for rank in named[:4]:
            trace = traces.get(rank)
            if trace is not None:
                last = max((e for (g, s), e in trace.by_seq.items() if g == group),
                           key=lambda e: e.collective_seq_id or 0)
                evidence.append(_entry_line(trace, last, "last issued"))
        nodes = sorted({n for r in named for n in [_node_of(ctx, r, traces)] if n})
        unplaced = [r for r in named if _node_of(ctx, r, traces) is None]
        stacks, said = _stack_lines(ctx, nodes)
        evidence.extend(stacks[:4])
        where = f" on {', '.join(nodes)}" if nodes else ""
        if unplaced:
            where += f" (node of rank(s) {_fold(unplaced)} not known: no rank map)"
        if behind:
            summary = (f"rank(s) {_fold(waiting)} wait in collective {seq} of process group {group!r} ({op}); "
                       f"rank(s) {_fold(behind)}{where} never entered it (their last was "
                       f"{max((max(s for (g, s) in traces[r].by_seq if g == group) for r in behind))})")
            confidence = HANG_CONFIDENCE if not unknown else HANG_CONFIDENCE - 0.05
        else:
            summary = (f"rank(s) {_fold(waiting)} wait in collective {seq} of process group {group!r} ({op}); "
                       f"rank(s) {_fold(unknown)}{where} left no dump of it and are not known to have entered it")
            confidence = PARTIAL_CONFIDENCE
        if said:
            summary += "; " + "; ".join(said[:3])
        if unknown and behind:
            summary += f"; nothing of this group in the dumps of rank(s) {_fold(unknown)}"
        findings.append(Finding(
            layer="communication", cause="collective_hang", confidence=confidence, summary=summary,
            nodes=nodes, ranks=named, evidence=evidence[:8], convicts=False,
        ))
    return findings


# ---------------------------------------------------------------------------- NCCL RAS


def _ras_node(ctx: Context, host: str | None, rank: int | None, world: bool) -> str | None:
    named = ctx.node_named(host)
    if named is not None:
        return named
    if host:
        for node in ctx.nodes:
            if host in node.addresses:
                return node.name
    if world and rank is not None:
        return ctx.node_of_rank(rank)
    return None


def comm_ras_ranks(ctx: Context) -> list[Finding]:
    """NCCL RAS's dead and unresponsive processes, and ranks that launched fewer operations
    than their peers (the same report on every node; the one that names the most is used)."""
    reports = [(node, node.ncclras) for node in ctx.reachable if node.ncclras is not None and node.ncclras.groups]
    if not reports:
        return []
    node, report = max(reports, key=lambda item: (len(item[1].dead_processes) + len(item[1].missing_processes)
                                                  + sum(len(c.ranks) for c in item[1].comms)))
    file = node.file("ncclras.txt")
    world = report.world_size()
    evidence: list[EvidenceLine] = []
    ranks: set[int] = set()
    nodes: set[str] = set()
    hosts: set[str] = set()
    said: list[str] = []
    for kind, processes, count in (("dead", report.dead_processes, report.dead_count),
                                   ("unresponsive", report.missing_processes, report.missing_count)):
        if not count:
            continue
        said.append(f"{count} process(es) {kind}")
        for process in processes:
            evidence.append(EvidenceLine(file, process.line, process.text))
            place = _ras_node(ctx, process.host, None, False)
            nodes.update([place] if place else [])
            hosts.update([process.host] if process.host and not place else [])
    sizes = {row[0]: row[4] for row in report.groups}
    for comm in report.comms:
        named = comm.lagging() if comm.kind == "MISMATCH" else comm.ranks if comm.kind == "INCOMPLETE" else []
        in_world = sizes.get(int(comm.label.split("-")[0])) == world
        for rank in named:
            evidence.append(EvidenceLine(file, rank.line, rank.text))
            if in_world:
                ranks.add(rank.rank)
            place = _ras_node(ctx, rank.host, rank.rank, in_world)
            nodes.update([place] if place else [])
            hosts.update([rank.host] if rank.host and not place else [])
        if comm.kind == "MISMATCH" and named:
            said.append(f"communicator #{comm.label}: rank(s) {_fold(r.rank for r in named)} launched fewer "
                        f"{named[0].operation or ''} operations than the rest".replace("  ", " "))
        elif comm.kind == "INCOMPLETE" and named:
            said.append(f"communicator #{comm.label}: no answer from rank(s) {_fold(r.rank for r in named)}")
    if not evidence:
        if report.healthy():
            ctx.ruled_out.append(RuledOut("communication", f"NCCL RAS ({file}): every communicator RUNNING and OK"))
        return []
    where = f" on {', '.join(sorted(nodes))}" if nodes else ""
    if hosts:
        where += f" (host(s) {', '.join(sorted(hosts))} not matched to a node)"
    return [Finding(
        layer="communication", cause="collective_hang", confidence=RAS_CONFIDENCE,
        summary=f"NCCL RAS{where}: " + "; ".join(said),
        nodes=sorted(nodes), ranks=sorted(ranks), evidence=evidence[:8], convicts=False,
    )]


def join_hardware(findings: list[Finding]) -> None:
    """A node a collective finding names that a hardware finding convicts: the hardware rule
    convicts it, with the communication evidence joined (its ranks never joined because its
    GPU failed), and the collective finding steps below it (a consequence, not a cause)."""
    hardware = [f for f in findings if f.layer == "hardware" and f.convicts and f.confidence >= 0.5
                and f.cause != "thermal_throttle"]
    for hang in findings:
        if hang.cause not in ("collective_hang",):
            continue
        for fault in hardware:
            shared = sorted(set(hang.nodes) & set(fault.nodes))
            if not shared:
                continue
            for line in hang.evidence[:3]:
                if line not in fault.evidence:
                    fault.evidence.append(line)
            ranks = f"rank(s) {_fold(hang.ranks)} " if hang.ranks else ""
            fault.summary += f"; {ranks}on {', '.join(shared)} left the job waiting in a collective ({hang.cause})"
            if hang.confidence >= fault.confidence:
                hang.confidence = round(fault.confidence - 0.05, 2)
                hang.summary += f" (the hardware fault on {', '.join(shared)} explains it)"


RULES: tuple[Callable[[Context], list[Finding]], ...] = (
    comm_collective_mismatch,
    comm_collective_hang,
    comm_ras_ranks,
)
