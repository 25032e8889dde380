"""Layer 3, communication: did sync break?

Communication faults move every rank at once; their traces are NCCL/PyTorch errors in the
window, NIC and HCA congestion counters rising, and mismatched NCCL versions. Counters are
judged as growth since the node's baseline capture; without a baseline only extreme absolute
values count, and weakly (a long-lived NIC accumulates pauses in healthy operation).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable

from spikeops.diagnosis.context import Context
from spikeops.diagnosis.counters import (
    DROP_ABSOLUTE,
    DROP_GROWTH,
    IB_WATCHED,
    PAUSE_ABSOLUTE,
    PAUSE_GROWTH,
    RETRANSMIT_COUNTERS,
    congestion_counter_high,
    ignored,
    is_drop,
    is_pause,
)
from spikeops.diagnosis.evidence import NodeFacts
from spikeops.diagnosis.model import EvidenceLine, Finding, RuledOut
from spikeops.diagnosis.symptom import throughput_drop
from spikeops.probes.nccl_log import normalise_version

__all__ = [
    "RULES",
    "comm_nccl_error",
    "comm_network_congestion",
    "comm_nccl_version_mismatch",
    "node_nccl_version",
    "counter_growth",
    "congestion_counter_high",
    "IB_WATCHED",
]

#: NCCL / PyTorch-distributed event kinds that mean communication broke (``cuda_error`` is
#: the GPU's or the program's, judged elsewhere).
COMM_EVENTS = frozenset({
    "warn", "ib_completion_error", "system_error", "internal_error", "invalid_usage", "remote_error",
    "connection_error", "watchdog_timeout", "desync", "timeout", "abort", "ib_port_error",
})
def _comm_events(node: NodeFacts) -> list:
    return [event for event in (node.nccl.events if node.nccl else []) if event.kind in COMM_EVENTS]


def _printed_comm_events(ctx: Context) -> tuple[dict[str, list], int]:
    """NCCL / PyTorch-distributed errors in the job's own output (train.log), by the node a
    line names (its NCCL prefix's host, its rank); "" for lines that name none."""
    grouped: dict[str, list] = {}
    outside = 0
    for output in ctx.outputs():
        if output.nccl is None:
            continue
        for event in output.nccl.events:
            if event.kind not in COMM_EVENTS:
                continue
            if ctx.in_window(event.time) is False:
                outside += 1
                continue
            node = ctx.output_node(output, host=event.host, rank=event.rank) or ""
            grouped.setdefault(node, []).append((output.file, event))
    return grouped, outside


def comm_nccl_error(ctx: Context) -> list[Finding]:
    per_node: dict[str, list] = {}
    outside = 0
    for node in ctx.reachable:
        for event in _comm_events(node):
            inside = ctx.in_window(event.time) if event.time is not None else True  # no timestamp: this run
            if inside is False:
                outside += 1
                continue
            per_node.setdefault(node.name, []).append((node.file("nccl.log"), event))
    printed, printed_outside = _printed_comm_events(ctx)
    outside += printed_outside
    for name, items in printed.items():
        per_node.setdefault(name, []).extend(items)
    retrans = _retransmit_growth(ctx)
    if not per_node and not retrans:
        if not any(node.nccl for node in ctx.reachable) and not any(o.nccl for o in ctx.outputs()):
            ctx.missing.append("nccl.log: none collected (communication errors not checked)")
        else:
            note = f" ({outside} outside the window)" if outside else ""
            ctx.ruled_out.append(RuledOut("communication", f"no NCCL warnings, IB completion errors or watchdog timeouts in the window{note}"))
        return []
    evidence: list[EvidenceLine] = []
    kinds: Counter[str] = Counter()
    for name, events in sorted(per_node.items()):
        for _, event in events:
            kinds[event.kind] += 1
        first_file, first = events[0]
        evidence.append(EvidenceLine(first_file, first.line, first.text))
    for name, counter, growth, line in retrans[:3]:
        evidence.append(EvidenceLine(f"nodes/{name}/ib-counters.txt", line, f"{counter} grew by {growth:,} since baseline"))
    nodes = sorted((set(per_node) - {""}) | {name for name, *_ in retrans})
    described = ", ".join(f"{count} {kind.replace('_', ' ')}" for kind, count in kinds.most_common())
    if retrans:
        described = (described + "; " if described else "") + f"IB retransmit counters grew on {len({n for n, *_ in retrans})} node(s)"
    confidence = 0.72 if len(nodes) >= 2 else 0.66
    if not per_node:
        confidence = 0.5
    where = f"on {len(nodes)} node(s)" if nodes else "in the job's output"
    return [Finding(
        layer="communication", cause="nccl_error", confidence=confidence,
        summary=f"communication errors in the window {where}: {described}",
        nodes=nodes, step=ctx.spike, evidence=evidence[:8],
    )]


def counter_growth(current: dict[str, int], baseline: dict[str, int] | None) -> dict[str, int]:
    """Growth of each counter since the baseline (absolute values when there is none)."""
    if baseline is None:
        return dict(current)
    return {name: value - baseline.get(name, 0) for name, value in current.items()}


def _ib_port_counters(node: NodeFacts, base: bool) -> dict[str, dict[str, int]]:
    source = node.ib_base if base else node.ib
    if source is None:
        return {}
    ports = {}
    for port in source.ports:
        merged = dict(port.counters)
        merged.update(port.hw_counters)
        ports[f"{port.device}/{port.port}"] = merged
    return ports


def _retransmit_growth(ctx: Context) -> list[tuple[str, str, int, int | None]]:
    hits = []
    for node in ctx.reachable:
        if node.ib is None or node.ib_base is None:
            continue
        base = _ib_port_counters(node, True)
        for port in node.ib.ports:
            values = dict(port.hw_counters)
            growth = counter_growth(values, {k: v for k, v in base.get(f"{port.device}/{port.port}", {}).items()})
            for name in RETRANSMIT_COUNTERS:
                if growth.get(name, 0) >= DROP_GROWTH:
                    hits.append((node.name, f"{port.device} port {port.port} {name}", growth[name], port.lines.get(name) if hasattr(port, "lines") else None))
    return hits


def _congestion_hits(node: NodeFacts) -> tuple[list[tuple[str, str, int, bool]], bool]:
    """(file, counter, growth-or-value, from_baseline) of congestion counters; and whether
    any baseline was available on this node."""
    hits = []
    had_baseline = False
    for name, stats in node.ethtool.items():
        base = node.ethtool_base.get(name)
        had_baseline |= base is not None or name in node.baselines
        growth = counter_growth(stats.counters, base.counters if base else None)
        for counter, value in growth.items():
            if ignored(counter):
                continue
            pause, drop = is_pause(counter), is_drop(counter)
            if base is not None and ((pause and value >= PAUSE_GROWTH) or (drop and value >= DROP_GROWTH)):
                hits.append((name, counter, value, True))
            elif base is None and ((pause and value >= PAUSE_ABSOLUTE) or (drop and value >= DROP_ABSOLUTE)):
                hits.append((name, counter, value, False))
    if node.ib is not None:
        base_ports = _ib_port_counters(node, True) if node.ib_base is not None else None
        had_baseline |= base_ports is not None or "ib-counters.txt" in node.baselines
        for key, values in _ib_port_counters(node, False).items():
            growth = counter_growth(values, base_ports.get(key, {}) if base_ports is not None else None)
            for counter in ("port_xmit_discards", "excessive_buffer_overrun_errors", "out_of_buffer"):
                value = growth.get(counter, 0)
                threshold = DROP_GROWTH if base_ports is not None else DROP_ABSOLUTE
                if value >= threshold:
                    hits.append(("ib-counters.txt", f"{key} {counter}", value, base_ports is not None))
    return hits, had_baseline


def comm_network_congestion(ctx: Context) -> list[Finding]:
    affected: dict[str, list[tuple[str, str, int, bool]]] = {}
    checked = baselined = 0
    for node in ctx.reachable:
        if not node.ethtool and node.ib is None:
            continue
        checked += 1
        hits, had_baseline = _congestion_hits(node)
        baselined += had_baseline
        if hits:
            affected[node.name] = hits
    if not checked:
        ctx.missing.append("ethtool -S / ib-counters: none collected (congestion not checked)")
        return []
    if not affected:
        how = "since the baselines" if baselined else "(no baselines: absolute values)"
        ctx.ruled_out.append(RuledOut("communication", f"no pause, discard or out-of-buffer growth on {checked} node(s) {how}"))
        return []
    grown = {name: hits for name, hits in affected.items() if any(h[3] for h in hits)}
    share = len(affected) / max(1, checked)
    if grown:
        confidence = 0.74 if (len(grown) >= 2 or share >= 0.25) else 0.45
    else:
        confidence = 0.35
    if ctx.symptom.throughput_change is not None and ctx.symptom.throughput_change < -0.2:
        confidence = min(0.8, confidence + 0.04)
    evidence = []
    for name, hits in sorted(affected.items())[:6]:
        file, counter, value, from_baseline = max(hits, key=lambda h: h[2])
        what = f"{counter} grew by {value:,} since baseline" if from_baseline else f"{counter} = {value:,} (no baseline)"
        evidence.append(EvidenceLine(f"nodes/{name}/{file}", None, what))
    slowed = throughput_drop(ctx.metrics.frame) if ctx.metrics is not None else None
    onset = None
    if slowed is not None and (ctx.spike is None or slowed[0] <= ctx.spike):
        onset = slowed[0]  # the fabric slowed every rank before the loss moved
        line = ctx.metric_line(onset, f"throughput {slowed[1]:.0%} lower from here")
        if line is not None:
            evidence.append(line)
    return [Finding(
        layer="communication", cause="network_congestion", confidence=confidence,
        summary=f"congestion counters (pause frames, discards, out-of-buffer) rising on {len(affected)} of {checked} node(s)"
                + (f"; throughput fell {slowed[1]:.0%} from step {slowed[0]}" if slowed else ""),
        nodes=sorted(affected), step=ctx.spike, evidence=evidence, onset_step=onset,
    )]


def node_nccl_version(node: NodeFacts) -> tuple[str | None, EvidenceLine | None]:
    """The node's NCCL version: nccl-version.txt first, else the version its ranks printed."""
    if node.nccl_version is not None and node.nccl_version.version:
        return node.nccl_version.version, EvidenceLine(node.file("nccl-version.txt"), node.nccl_version.line, node.nccl_version.raw)
    if node.nccl is not None:
        versions = {normalise_version(v) for v in node.nccl.versions} - {None}
        if len(versions) == 1:
            version = versions.pop()
            line = next((p.first_line for p in node.nccl.processes.values() if p.version == version), None)
            return version, EvidenceLine(node.file("nccl.log"), line, f"NCCL version {version}")
    return None, None


def _fold(names: Iterable[str]) -> str:
    from ClusterShell.NodeSet import NodeSet

    return str(NodeSet.fromlist(sorted(names)))


def comm_nccl_version_mismatch(ctx: Context) -> list[Finding]:
    versions: dict[str, tuple[str, EvidenceLine | None]] = {}
    for node in ctx.reachable:
        version, line = node_nccl_version(node)
        if version:
            versions[node.name] = (version, line)
    if len(versions) < 2:
        if not versions:
            ctx.missing.append("nccl-version.txt: not collected (NCCL versions not compared)")
        return []
    counts = Counter(version for version, _ in versions.values())
    if len(counts) == 1:
        only = next(iter(counts))
        ctx.ruled_out.append(RuledOut("communication", f"every node runs NCCL {only} ({len(versions)} node(s) checked)"))
        return []
    (majority, top), *rest = counts.most_common()
    if rest and rest[0][1] == top:
        minority = []
        confidence = 0.5
    else:
        minority = sorted(name for name, (version, _) in versions.items() if version != majority)
        confidence = 0.86
    evidence = [line for name, (_, line) in sorted(versions.items()) if line and (name in minority or not minority)][:6]
    majority_node = next(name for name, (version, _) in sorted(versions.items()) if version == majority)
    if versions[majority_node][1]:
        evidence.append(versions[majority_node][1])
    described = ", ".join(f"{version} on {count} node(s)" for version, count in counts.most_common())
    return [Finding(
        layer="communication", cause="nccl_version_mismatch", confidence=confidence,
        summary=f"mixed NCCL versions in one job: {described}"
                + (f"; the minority {_fold(minority)} differ from {majority}" if minority else ""),
        nodes=minority or sorted(versions), evidence=evidence, convicts=bool(minority),
    )]


RULES: tuple[Callable[[Context], list[Finding]], ...] = (
    comm_nccl_error,
    comm_network_congestion,
    comm_nccl_version_mismatch,
)
