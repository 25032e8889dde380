"""Layer 4, hardware: did a machine die?

Hardware faults are node-correlated, and a faulty node keeps polluting the AllReduce, so
these rules are the ones that *convict* nodes (isolate them). The bar for that is evidence
that holds:

- a GPU-implicating Xid (or a GPU gone from the bus) **inside the window**; one whose time is
  unknown (plain dmesg) convicts only when the node's current state corroborates it (the GPU
  is missing or erroring in nvidia-smi, or its ECC grew); one outside the window is history;
  application-class Xids (13, 31, 43) point at the job, never at the node;
- uncorrectable ECC (or a row-remap failure) that **grew** since the node's baseline; without
  a baseline, only when a memory-class Xid in the window confirms it is new;
- an IB port whose ``link_downed``/``link_error_recovery`` grew since the baseline, that is
  down where its peers are up, or that runs slower than its peers;
- thermal throttling on a minority of nodes (it slows the job; on its own it does not
  explain a loss jump, so it convicts only when it is the primary cause: the engine decides).
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Callable
from typing import Any

from spikeops.diagnosis.context import Context
from spikeops.diagnosis.evidence import NodeFacts
from spikeops.diagnosis.model import EvidenceLine, Finding, RuledOut
from spikeops.diagnosis.symptom import throughput_drop
from spikeops.probes.base import clip
from spikeops.probes.kernel_log import normalize_pci
from spikeops.probes.xid_catalog import APPLICATION_CLASS, MEMORY_CLASS
from spikeops.timeparse import iso

__all__ = [
    "RULES",
    "hw_printed_errors",
    "hw_node_failure",
    "hw_device_errors",
    "hw_slowdown",
    "hw_gpu_xid",
    "hw_gpu_ecc",
    "hw_ib_link_flap",
    "hw_thermal_throttle",
    "ecc_growth",
    "nccl_bus_to_pci",
]

_SMI_LOST = ("unable to determine the device handle", "gpu is lost", "unknown error", "fallen off the bus",
             "no devices were found", "failed to initialize nvml")


def _rank_of_pci(ctx: Context, node: NodeFacts, pci: str | None) -> int | None:
    """The global rank on a GPU, from NCCL's ``cudaDev D busId B`` init lines."""
    if pci is None or node.nccl is None:
        return None
    for process in node.nccl.processes.values():
        bus = process.bus_id
        if bus is None or process.rank is None:
            continue
        if nccl_bus_to_pci(bus) == pci:
            return process.rank
    return None


def nccl_bus_to_pci(bus: str) -> str | None:
    """NCCL prints a GPU's bus id as the hex of its address digits run together
    (``0000:07:00.0`` -> ``7000``, ``0000:5d:00.0`` -> ``5d000``); the kernel's form back."""
    if ":" in bus:
        return normalize_pci(bus)
    try:
        value = int(bus, 16)
    except ValueError:
        return None
    domain, number, device = value >> 20, (value >> 12) & 0xFF, (value >> 4) & 0xFF
    return f"{domain:04x}:{number:02x}:{device:02x}"


_PCI_ANYWHERE = re.compile(r"([0-9A-Fa-f]{4,8}:[0-9A-Fa-f]{2}:[0-9A-Fa-f]{2})(?:\.[0-7])?")


def _pci_in(text: str) -> str | None:
    """A PCI address anywhere in a message, even glued to a word (``GPU0000:5D:00.0``)."""
    match = _PCI_ANYWHERE.search(text)
    return normalize_pci(match.group(1)) if match else None


def _smi_trouble(node: NodeFacts, pci: str | None) -> str | None:
    """Current-state corroboration that a GPU is in trouble (nvidia-smi/NVML saying so)."""
    messages = [m.text for m in getattr(node.smi, "errors", [])] + list(node.stderr.values())
    for message in messages:
        lowered = message.lower()
        if any(marker in lowered for marker in _SMI_LOST):
            if pci is None or _pci_in(message) in (None, pci):
                return message
    if node.smi is not None and pci is not None and node.smi.gpus:
        attached = getattr(node.smi, "attached_gpus", None)
        listed = {gpu.pci for gpu in node.smi.gpus}
        if pci not in listed and attached and len(listed) < attached:
            return f"GPU {pci} missing from nvidia-smi ({len(listed)} of {attached} listed)"
    return None


def ecc_growth(current: Any, baseline: Any) -> tuple[int, int | None]:
    """(uncorrectable errors now, growth since baseline or None without one)."""
    def totals(gpu: Any) -> tuple[int | None, int | None]:
        volatile = gpu.ecc_volatile.uncorrectable_total() if gpu.ecc_volatile else None
        aggregate = gpu.ecc_aggregate.uncorrectable_total() if gpu.ecc_aggregate else None
        return volatile, aggregate

    volatile, aggregate = totals(current)
    now = max(v for v in (volatile, aggregate, 0) if v is not None)
    if baseline is None:
        return now, None
    base_volatile, base_aggregate = totals(baseline)
    growths = []
    if aggregate is not None and base_aggregate is not None:
        growths.append(aggregate - base_aggregate)
    if volatile is not None and base_volatile is not None:
        growths.append(volatile - base_volatile)
    return now, max(growths) if growths else None


def _remap(gpu: Any) -> tuple[int, bool, bool]:
    rows = gpu.remapped_rows
    if rows is None:
        return 0, False, False
    return rows.uncorrectable or 0, bool(rows.pending), bool(rows.failure)


def _memory_grew(ctx: Context, node: NodeFacts, pci: str | None) -> bool:
    """Uncorrectable memory trouble on this GPU that is new (grew since the baseline)."""
    if node.smi is None or pci is None:
        return False
    current = next((gpu for gpu in node.smi.gpus if gpu.pci == pci), None)
    if current is None:
        return False
    base = next((gpu for gpu in node.smi_base.gpus if gpu.pci == pci), None) if node.smi_base else None
    _, growth = ecc_growth(current, base)
    if growth:
        return growth > 0
    if base is not None:
        rows_now, _, failure_now = _remap(current)
        rows_then, _, failure_then = _remap(base)
        return rows_now > rows_then or (failure_now and not failure_then)
    return False


def hw_gpu_xid(ctx: Context) -> list[Finding]:
    findings: list[Finding] = []
    history: list[str] = []
    application: list[str] = []
    kernels = 0
    for node in ctx.reachable:
        if node.kernel is None:
            continue
        kernels += 1
        events = [(x.pci, x.code, x.info, x) for x in node.kernel.xids]
        events += [(lost.pci, 79, None, lost) for lost in node.kernel.gpu_lost if lost.reason in GONE_REASONS]
        convicting: list[tuple[Any, str]] = []
        weak: list[tuple[Any, str]] = []
        for pci, code, info, event in events:
            where = f"Xid {code} on {node.name} ({pci})" if info is not None else f"GPU {pci} on {node.name} fell off the bus"
            if code in APPLICATION_CLASS:
                application.append(f"{where} at {iso(event.time) or 'an unknown time'}")
                continue
            implicates = info.implicates_gpu if info is not None else True
            if not implicates:
                continue
            if code in MEMORY_CLASS and _memory_grew(ctx, node, pci):
                continue  # the ECC rule owns it: memory-class Xid + ECC growth = gpu_ecc
            inside = ctx.in_window(event.time)
            if inside is False:
                history.append(f"{where} at {iso(event.time)} is outside the window")
                continue
            if inside is None:
                corroboration = _smi_trouble(node, pci) or ("ECC grew" if _memory_grew(ctx, node, pci) else None)
                if corroboration is None and code == 79 and _no_current_reading(node):
                    corroboration = "a GPU off the bus stays off until the node is reset, and no GPU reading was collected to show it back"
                if corroboration:
                    convicting.append((event, f"{where} (time unknown; nvidia-smi now: {clip(corroboration, 120)})"))
                else:
                    weak.append((event, f"{where} at an unknown time (plain dmesg?), not corroborated by the GPU's current state"))
                continue
            convicting.append((event, where))
        for group, confidence, convicts in ((convicting, 0.95, True), (weak, 0.45, False)):
            # An uncorroborated Xid of unknown time may be last week's: listed, never the cause.
            if not group:
                continue
            first = min(group, key=lambda pair: pair[0].line)[0]
            codes = sorted({getattr(e, "code", 79) for e, _ in group})
            pcis = sorted({e.pci for e, _ in group if e.pci})
            ranks = [r for r in (_rank_of_pci(ctx, node, pci) for pci in pcis) if r is not None]
            times = [e.time for e, _ in group if e.time is not None]
            onset = ctx.step_at(min(times)) if times else None
            names = ", ".join(f"{code} ({_name(code)})" for code in codes)
            evidence = [EvidenceLine(node.file("kernel.log"), e.line, e.text) for e, _ in sorted(group, key=lambda p: p[0].line)[:4]]
            trouble = _smi_trouble(node, pcis[0] if pcis else None)
            if trouble and node.smi_file:
                evidence.append(EvidenceLine(node.file(node.smi_file), None, clip(trouble)))
            findings.append(Finding(
                layer="hardware", cause="gpu_xid", confidence=confidence if (convicts or not times) else 0.45,
                summary=f"{node.name}: Xid {names} on GPU {', '.join(pcis) or '?'}"
                        + (f" at {iso(min(times))}" if times else " (time unknown)")
                        + ("" if convicts else ": not enough to isolate the node"),
                nodes=[node.name], ranks=ranks, step=onset, evidence=evidence, convicts=convicts, onset_step=onset,
                history=not convicts,
            ))
    if kernels == 0:
        ctx.missing.append("kernel.log: none collected (Xid events not checked)")
    for note in application[:5]:
        ctx.ruled_out.append(RuledOut("hardware", f"{note}: application-class Xid, points at the job, not the GPU"))
    for note in history[:5]:
        ctx.ruled_out.append(RuledOut("hardware", f"{note}: history, not this incident"))
    if kernels and not findings and not application and not history:
        ctx.ruled_out.append(RuledOut("hardware", f"no GPU Xid in the kernel logs of {kernels} node(s)"))
    return findings


#: GPU-lost messages that mean the GPU is gone from the bus (read like Xid 79).
GONE_REASONS = ("fallen_off_bus", "init_failed", "pcie_fatal")


def _no_current_reading(node: NodeFacts) -> bool:
    """No nvidia-smi / NVML reading of the node, and none attempted: nothing collected says
    the GPU came back (a failed attempt is the collector's trouble to report, not a reading)."""
    return node.smi is None and not any(name.startswith(("nvidia-smi", "nvml")) for name in node.probes)


def _name(code: int) -> str:
    from spikeops.probes.xid_catalog import lookup

    return lookup(code).name


def hw_gpu_ecc(ctx: Context) -> list[Finding]:
    findings = []
    checked = 0
    correctable_only: list[str] = []
    for node in ctx.reachable:
        if node.smi is None or not node.smi.gpus:
            continue
        checked += 1
        base_by_pci = {gpu.pci: gpu for gpu in node.smi_base.gpus} if node.smi_base else {}
        xids = {x.pci: x for x in (node.kernel.xids if node.kernel else [])
                if x.code in MEMORY_CLASS and ctx.in_window(x.time) is not False}
        for gpu in node.smi.gpus:
            base = base_by_pci.get(gpu.pci) if node.smi_base else None
            now, growth = ecc_growth(gpu, base)
            rows, pending, failure = _remap(gpu)
            rows_then, _, failure_then = _remap(base) if base is not None else (0, False, False)
            new_failure = failure and not failure_then
            xid = xids.get(gpu.pci)
            if base is not None:
                grew = (growth or 0) > 0 or rows > rows_then or new_failure
            else:
                grew = (now > 0 or rows > 0 or failure) and xid is not None
            if not grew:
                if now > 0 or rows > 0 or failure:
                    note = "unchanged since baseline" if base is not None else "no baseline, no memory Xid in the window"
                    findings.append(Finding(
                        layer="hardware", cause="gpu_ecc", confidence=0.3,
                        summary=f"{node.name} GPU {gpu.pci}: {now} uncorrectable ECC error(s), remapped rows "
                                f"uncorrectable {rows}{', pending' if pending else ''} ({note}): history, not this incident",
                        nodes=[node.name], evidence=[EvidenceLine(node.file(node.smi_file), gpu.line, f"GPU {gpu.bus_id}: uncorrectable ECC {now}")],
                        history=True,
                    ))
                elif (gpu.correctable_ecc() or 0) > 0:
                    correctable_only.append(f"{node.name} GPU {gpu.pci}")
                continue
            parts = []
            if growth:
                parts.append(f"uncorrectable ECC +{growth} since baseline (now {now})")
            elif base is None and now:
                parts.append(f"{now} uncorrectable ECC error(s)")
            if rows > rows_then:
                parts.append(f"remapped rows (uncorrectable) {rows_then} -> {rows}" + (", remap pending" if pending else ""))
            if new_failure or (failure and base is None):
                parts.append("row remapping FAILED (spare rows exhausted)")
            evidence = [EvidenceLine(node.file(node.smi_file), gpu.line, f"GPU {gpu.bus_id}: " + "; ".join(parts))]
            onset = None
            if xid is not None:
                evidence.insert(0, EvidenceLine(node.file("kernel.log"), xid.line, xid.text))
                onset = ctx.step_at(xid.time)
            ranks = [r for r in (_rank_of_pci(ctx, node, gpu.pci),) if r is not None]
            findings.append(Finding(
                layer="hardware", cause="gpu_ecc", confidence=0.93 if base is not None or xid else 0.75,
                summary=f"{node.name} GPU {gpu.pci}: " + "; ".join(parts)
                        + (f", with Xid {xid.code} ({xid.info.name})" if xid else ""),
                nodes=[node.name], ranks=ranks, step=onset, evidence=evidence, convicts=True, onset_step=onset,
            ))
    if checked == 0:
        ctx.missing.append("nvidia-smi -q: none collected (ECC not checked)")
    elif not any(f.convicts for f in findings):
        extra = f"; correctable errors only on {', '.join(correctable_only[:4])}" if correctable_only else ""
        ctx.ruled_out.append(RuledOut("hardware", f"no uncorrectable ECC growth on {checked} node(s){extra}"))
    return findings


def _port_key(port: Any) -> str:
    return f"{port.ca}/{port.port}"


def _rail_ports(node: NodeFacts) -> list[Any]:
    """The ports that carry the job's traffic: InfiniBand ones, or RoCE NICs of a model the
    node has several of (one per GPU rail). A frontend or management NIC (one or two per
    node, any speed) is not judged against its peers: fleets mix those."""
    if node.ibstat is None:
        return []
    model = {ca.name: ca.ca_type for ca in node.ibstat.cas}
    ports = node.ibstat.ports()
    models = Counter(model.get(port.ca) for port in ports)
    return [port for port in ports
            if (port.link_layer or "").lower() == "infiniband" or models[model.get(port.ca)] >= 4]


def hw_ib_link_flap(ctx: Context) -> list[Finding]:
    findings: list[Finding] = []
    reasons: dict[str, list[tuple[str, EvidenceLine]]] = {}
    checked = 0
    # Peers: the same HCA port on the other nodes (state and rate).
    states: dict[str, Counter[str]] = {}
    rates: dict[str, Counter[float]] = {}
    for node in ctx.reachable:
        if node.ibstat is None:
            continue
        for port in _rail_ports(node):
            states.setdefault(_port_key(port), Counter())[port.state or "?"] += 1
            if port.rate_gbps:
                rates.setdefault(_port_key(port), Counter())[port.rate_gbps] += 1
    for node in ctx.reachable:
        if node.ib is not None:
            checked += 1
            base = {f"{p.device}/{p.port}": p for p in node.ib_base.ports} if node.ib_base is not None else None
            for port in node.ib.ports:
                then = base.get(f"{port.device}/{port.port}") if base is not None else None
                for counter in ("link_downed", "link_error_recovery"):
                    now = port.counters.get(counter)
                    if now is None:
                        continue
                    if base is not None:
                        previous = then.counters.get(counter, 0) if then is not None else 0
                        if now > previous:
                            line = port.lines.get(counter) if hasattr(port, "lines") else None
                            reasons.setdefault(node.name, []).append((
                                f"{port.device} port {port.port} {counter} {previous} -> {now}",
                                EvidenceLine(node.file("ib-counters.txt"), line, f"{port.device}/ports/{port.port}/counters/{counter}:{now} (baseline {previous})"),
                            ))
                    elif now > 0:
                        findings.append(Finding(
                            layer="hardware", cause="ib_link_flap", confidence=0.3,
                            summary=f"{node.name} {port.device} port {port.port}: {counter} = {now} (no baseline: may be old)",
                            nodes=[node.name], evidence=[EvidenceLine(node.file("ib-counters.txt"), port.lines.get(counter) if hasattr(port, "lines") else None, f"{counter}:{now}")],
                            history=True,
                        ))
        if node.ibstat is not None:
            for port in _rail_ports(node):
                key = _port_key(port)
                peers = states.get(key, Counter())
                up_elsewhere = peers.get("Active", 0) - (1 if port.state == "Active" else 0)
                down_here_and_elsewhere = sum(peers.values()) - peers.get("Active", 0)
                infiniband = (port.link_layer or "").lower() == "infiniband"
                if port.state != "Active" and (up_elsewhere >= 3 * down_here_and_elsewhere
                                               or (infiniband and len(ctx.reachable) == 1)):
                    reasons.setdefault(node.name, []).append((
                        f"{port.ca} port {port.port} is {port.state}/{port.physical_state} while its peers are Active",
                        EvidenceLine(node.file("ibstat.txt"), port.line, port.text or f"State: {port.state}"),
                    ))
                elif port.state == "Active" and port.rate_gbps and rates.get(key):
                    usual, count = rates[key].most_common(1)[0]
                    if port.rate_gbps < usual and count >= max(2, 3 * rates[key][port.rate_gbps]):
                        reasons.setdefault(node.name, []).append((
                            f"{port.ca} port {port.port} runs at {port.rate_gbps:g} Gb/s, its peers at {usual:g}",
                            EvidenceLine(node.file("ibstat.txt"), port.lines.get("rate", port.line) if hasattr(port, "lines") else port.line, f"Rate: {port.rate_gbps:g}"),
                        ))
    for name, items in sorted(reasons.items()):
        findings.append(Finding(
            layer="hardware", cause="ib_link_flap", confidence=0.88,
            summary=f"{name}: " + "; ".join(text for text, _ in items[:3]),
            nodes=[name], evidence=[line for _, line in items[:4]], convicts=True, step=ctx.spike,
        ))
    if checked == 0 and not states:
        ctx.missing.append("ib-counters / ibstat: none collected (IB links not checked)")
    elif not reasons:
        ctx.ruled_out.append(RuledOut("hardware", "no IB link went down, flapped or negotiated a lower rate"))
    return findings


#: Clock-event reasons that mean the hardware slowed the GPU: too hot (HW/SW thermal
#: slowdown), or the board's power brake (the PSU or the board signalled it cannot feed the
#: GPU). The software power cap is not one: a GPU under full load sits at its power limit.
THROTTLE_REASONS = {
    "hw_thermal_slowdown": "temperature", "sw_thermal_slowdown": "temperature",
    "hw_power_brake_slowdown": "power (HW power brake)",
}


def _throttle_reasons(gpu: Any) -> list[str]:
    reasons = getattr(gpu, "clock_event_reasons", None) or {}
    active = [name for name in THROTTLE_REASONS if reasons.get(name)]
    if not active and reasons.get("hw_slowdown"):
        # HW Slowdown alone (older drivers do not say which): thermal or the power brake.
        active = ["hw_slowdown"]
    return active


def hw_thermal_throttle(ctx: Context) -> list[Finding]:
    hot: dict[str, list[tuple[Any, str]]] = {}
    kinds: set[str] = set()
    checked = 0
    for node in ctx.reachable:
        if node.smi is None or not node.smi.gpus:
            continue
        checked += 1
        for gpu in node.smi.gpus:
            slowdown = gpu.temperature_thresholds.get("slowdown") if gpu.temperature_thresholds else None
            too_hot = gpu.temperature_c is not None and isinstance(slowdown, int | float) and slowdown > 0 \
                and gpu.temperature_c >= slowdown
            active = _throttle_reasons(gpu)
            if active or too_hot:
                kinds.update(THROTTLE_REASONS.get(name, "temperature or power") for name in active)
                if too_hot and not active:
                    kinds.add("temperature")
                hot.setdefault(node.name, []).append((gpu, ", ".join(active) or f"{gpu.temperature_c} C >= slowdown {slowdown} C"))
    if not hot:
        if checked:
            ctx.ruled_out.append(RuledOut("hardware", f"no GPU throttling for temperature or the power brake on {checked} node(s)"))
        return []
    fleet_wide = len(hot) > max(1, checked // 2)
    confidence = 0.55 if ctx.symptom.symptom == "none" else 0.28
    if fleet_wide:
        confidence = min(confidence, 0.3)
    findings = []
    slowed = throughput_drop(ctx.metrics.frame) if ctx.metrics is not None else None
    for name, gpus in sorted(hot.items()):
        node = ctx.facts.node(name)
        temperatures = [g.temperature_c for g, _ in gpus if g.temperature_c is not None]
        ranks = [r for r in (_rank_of_pci(ctx, node, g.pci) for g, _ in gpus) if r is not None]
        evidence = [EvidenceLine(node.file(node.smi_file), g.line, f"GPU {g.bus_id}: {why}, {g.temperature_c} C") for g, why in gpus[:3]]
        if slowed is not None:
            line = ctx.metric_line(slowed[0], f"throughput {slowed[1]:.0%} lower from here")
            if line is not None:
                evidence.append(line)
        findings.append(Finding(
            layer="hardware", cause="thermal_throttle", confidence=confidence,
            summary=f"{name}: {len(gpus)} GPU(s) throttling for {' and '.join(sorted(kinds)) or 'temperature'} ({gpus[0][1]}"
                    + (f", up to {max(temperatures)} C" if temperatures else "") + ")"
                    + (" on most nodes: the room or the fleet, not this node" if fleet_wide else "")
                    + (f"; the job's throughput fell {slowed[1]:.0%} from step {slowed[0]}" if slowed else "")
                    + ("; slows the job, does not explain a loss jump" if ctx.symptom.symptom != "none" else ""),
            nodes=[name], ranks=ranks, step=slowed[0] if slowed else None,
            evidence=evidence, convicts=not fleet_wide, onset_step=slowed[0] if slowed else None,
        ))
    return findings


# ----------------------------------------------------------------- what the job printed


def _printed(ctx: Context, kinds: tuple[str, ...]) -> dict[str | None, list[tuple[Any, Any]]]:
    """Hardware errors of the given kinds the job printed, by the node each line ties to
    (None: the line names none), with the file they came from; errors whose time is outside
    the window are left out (a line without a time is this run's)."""
    grouped: dict[str | None, list[tuple[Any, Any]]] = {}
    for output in ctx.outputs():
        events = list(output.errors.events) if output.errors is not None else []
        if output.nccl is not None and "ib_port_error" in kinds:
            events += [event for event in output.nccl.events if event.kind == "ib_port_error"]
        for event in events:
            if getattr(event, "kind", None) not in kinds or ctx.in_window(event.time) is False:
                continue
            device = event.device if hasattr(event, "device") else getattr(event, "cuda_dev", None)
            local_rank = getattr(event, "local_rank", None)
            if local_rank is None and hasattr(event, "details"):
                local_rank = event.details.get("local_rank")
            node = ctx.output_node(output, host=event.host, rank=event.rank, device=device, local_rank=local_rank,
                                   pci=getattr(event, "pci", None))
            grouped.setdefault(node, []).append((output, event))
    for node in ctx.reachable:
        if node.nccl is not None and "ib_port_error" in kinds:
            for event in node.nccl.events:
                if event.kind == "ib_port_error" and ctx.in_window(event.time) is not False:
                    grouped.setdefault(node.name, []).append((_NodeFile(node.file("nccl.log"), node.name), event))
    return grouped


class _NodeFile:
    """A node's nccl.log seen as the job's output (for evidence lines)."""

    def __init__(self, file: str, node: str) -> None:
        self.file, self.node = file, node


def _printed_evidence(items: list[tuple[Any, Any]]) -> list[EvidenceLine]:
    return [EvidenceLine(output.file, event.line, event.text) for output, event in items[:4]]


def _printed_finding(ctx: Context, node: str | None, items: list[tuple[Any, Any]], cause: str,
                     what: str, named: float, unnamed: float) -> Finding:
    ranks = sorted({event.rank for _, event in items if event.rank is not None})
    times = [event.time for _, event in items if event.time is not None]
    onset = ctx.step_at(min(times)) if times else None
    where = f"on {node}" if node else "on a node the lines do not name (no host, rank or device)"
    return Finding(
        layer="hardware", cause=cause, confidence=named if node else unnamed,
        summary=f"the job printed {what} {where}: {len(items)} line(s), first at "
                f"{items[0][0].file}:{items[0][1].line}" + ("" if node else "; no node to isolate"),
        nodes=[node] if node else [], ranks=ranks, step=onset, evidence=_printed_evidence(items),
        convicts=node is not None, onset_step=onset,
    )


def hw_printed_errors(ctx: Context) -> list[Finding]:
    """GPU and fabric errors in the job's own output (CUDA's uncorrectable ECC error, an
    echoed Xid, a GPU lost, an IB port that went down): the hardware layer's evidence like the
    node-side probes; the node is a culprit when the line (or its file) ties it to one."""
    findings: list[Finding] = []
    for node, items in _printed(ctx, ("ecc_uncorrectable",)).items():
        findings.append(_printed_finding(ctx, node, items, "gpu_ecc", "an uncorrectable ECC error", 0.88, 0.6))
    for node, items in _printed(ctx, ("xid", "gpu_lost")).items():
        kept = []
        for output, event in items:
            code = getattr(event, "code", None)
            info = None if code is None else _lookup(code)
            if code is not None and (code in APPLICATION_CLASS or not info.implicates_gpu):
                ctx.ruled_out.append(RuledOut("hardware", f"Xid {code} printed in {output.file}:{event.line} "
                                                          "points at the application, not the GPU"))
                continue
            kept.append((output, event))
        if kept:
            codes = sorted({event.code for _, event in kept if getattr(event, "code", None) is not None})
            what = f"Xid {', '.join(map(str, codes))}" if codes else "a GPU lost from the bus"
            findings.append(_printed_finding(ctx, node, kept, "gpu_xid", what, 0.9, 0.55))
    for node, items in _printed(ctx, ("ib_port_error",)).items():
        findings.append(_printed_finding(ctx, node, items, "ib_link_flap", "an InfiniBand port error", 0.8, 0.7))
    return findings


def _lookup(code: int) -> Any:
    from spikeops.probes.xid_catalog import lookup

    return lookup(code)


def hw_node_failure(ctx: Context) -> list[Finding]:
    """A node that failed under the job (the scheduler says so), or that the collector could
    not reach while its peers answered: a finding about that node in the hardware layer. It
    says something happened to the node, not what: it convicts nobody (the spec's rules need
    the fault itself), and it tells what to collect from the node."""
    findings = []
    for node, items in _printed(ctx, ("node_failure",)).items():
        named = [(o, e) for o, e in items if e.host]
        if not named:
            continue
        hosts = sorted({e.host for _, e in named})
        findings.append(Finding(
            layer="hardware", cause="inconclusive", confidence=0.35,
            summary=f"the scheduler reports a node failure on {', '.join(hosts)}: nothing read says which part "
                    "failed (collect its kernel log and nvidia-smi -q); not enough to isolate it",
            # Named as the line names it, even a host the incident does not list: it never convicts.
            nodes=[node] if node else hosts, evidence=_printed_evidence(named),
        ))
    answered = [node for node in ctx.nodes if not node.unreachable]
    if answered:
        for node in ctx.nodes:
            if node.unreachable:
                findings.append(Finding(
                    layer="hardware", cause="inconclusive", confidence=0.3,
                    summary=f"{node.name} could not be reached while {len(answered)} peer(s) answered: the node may "
                            "have failed (check it out of band); nothing from it could be read, so it is not isolated",
                    nodes=[node.name],
                    evidence=[EvidenceLine(node.file("probes.json"), None, "every probe: unreachable")],
                ))
    return findings


#: What a device-pointing CUDA error can mean, for its finding's summary.
_DEVICE_ERRORS = {
    "cuda_device_error": "a CUDA error that can mean a bad GPU (an illegal memory access or instruction, or the "
                         "watchdog's 'unknown error')",
    "cuda_launch_failure": "an unspecified launch failure (a kernel died)",
}


def hw_device_errors(ctx: Context) -> list[Finding]:
    """CUDA errors the job printed that can mean a bad device, or a program bug: a hardware
    finding at low confidence, naming the node when the line (or its file, or its rank) does.
    It never convicts: the Xid, ECC and lost-GPU rules do, when the node's own evidence holds."""
    findings: list[Finding] = []
    for node, items in _printed(ctx, tuple(_DEVICE_ERRORS)).items():
        kinds = sorted({event.kind for _, event in items})
        what = " and ".join(_DEVICE_ERRORS[kind] for kind in kinds)
        where = f"on {node}" if node else "on a node the lines do not name"
        hosts = sorted({event.host for _, event in items if getattr(event, "host", None)})
        ranks = sorted({event.rank for _, event in items if event.rank is not None})
        findings.append(Finding(
            layer="hardware", cause="inconclusive", confidence=0.3,
            summary=f"the job printed {what} {where}: {len(items)} line(s), first at {items[0][0].file}:"
                    f"{items[0][1].line}; it points at the device, and a program bug prints it too: collect the "
                    "node's kernel log (Xid) and nvidia-smi -q before isolating it",
            nodes=[node] if node else hosts, ranks=ranks, evidence=_printed_evidence(items),
        ))
    return findings


def hw_slowdown(ctx: Context) -> list[Finding]:
    """A throughput drop with a flat loss: one slow GPU or node slows every rank. With throttle
    evidence the thermal rule names it; without, this says a slowdown happened, and what to
    read to find where (never a false alarm, never a conviction)."""
    if ctx.metrics is None or ctx.symptom.symptom != "none":
        return []
    slowed = throughput_drop(ctx.metrics.frame)
    if slowed is None:
        return []
    line = ctx.metric_line(slowed[0], f"throughput {slowed[1]:.0%} lower from here")
    return [Finding(
        layer="hardware", cause="inconclusive", confidence=0.35,
        summary=f"the job's throughput fell {slowed[1]:.0%} from step {slowed[0]} while the loss stayed flat: a "
                "slowdown (one slow GPU or node slows every rank); read each GPU's clocks and throttle reasons and the "
                "per-rank step times to find it",
        step=slowed[0], evidence=[line] if line else [], onset_step=slowed[0],
    )]


RULES: tuple[Callable[[Context], list[Finding]], ...] = (
    hw_gpu_xid,
    hw_gpu_ecc,
    hw_ib_link_flap,
    hw_thermal_throttle,
    hw_printed_errors,
    hw_node_failure,
    hw_device_errors,
    hw_slowdown,
)
