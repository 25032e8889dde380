"""``ethtool -S IFACE``: NIC statistics, any driver.

Every counter is kept, raw, "as it is": interpretation (is a pause frame count rising?) is
the diagnosis's job and works on deltas against a baseline. Drivers name per-queue counters
in their own ways; those are kept apart from the NIC-wide totals so a sum over queues is
never mistaken for, or added to, the port counter:

- mlx5:    ``rx0_packets``, ``tx3_bytes``, ``ch0_events``, ``xdpsq1_xmit``
- i40e:    ``tx-0.packets``, ``rx-12.bytes``
- ice/ixgbe/virtio: ``rx_queue_0_packets``, ``tx_queue_7_bytes``
- ena:     ``queue_0_tx_cnt``
- bnxt_en: ``[0]: rx_ucast_packets`` (ring index in brackets)

Per-priority counters such as mlx5's ``rx_prio0_discards`` are port counters, not queues.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from spikeops.probes.base import RemoteProbe, Gap, Kind, LineSource, numbered_lines, register, register_remote

__all__ = [
    "REMOTE","EthtoolStats", "parse", "KIND"]


@dataclass
class EthtoolStats:
    """NIC-wide counters and per-queue counters, by name as the driver prints them."""

    counters: dict[str, int] = field(default_factory=dict)
    queues: dict[str, dict[str, int]] = field(default_factory=dict)
    gaps: list[Gap] = field(default_factory=list)

    def queue_total(self, counter: str) -> int:
        """Sum of one per-queue counter over all queues (0 when no queue has it)."""
        return sum(values.get(counter, 0) for values in self.queues.values())


_LINE = re.compile(r"^\s*(?P<name>\S(?:.*?\S)?)\s*:\s*(?P<value>-?\d+)\s*$")
_BNXT_RING = re.compile(r"^\[(?P<index>\d+)\]:\s*(?P<name>.+)$")
_QUEUE_PATTERNS = (
    re.compile(r"^(?P<dir>rx|tx)-(?P<index>\d+)\.(?P<name>.+)$"),  # i40e
    re.compile(r"^(?P<dir>rx|tx)_queue_(?P<index>\d+)_(?P<name>.+)$"),  # ice, ixgbe, virtio
    re.compile(r"^queue_(?P<index>\d+)_(?P<dir>rx|tx)_(?P<name>.+)$"),  # ena
    re.compile(r"^(?P<dir>rx|tx|ch|xdpsq)(?P<index>\d+)_(?P<name>.+)$"),  # mlx5
)


def _split_queue(name: str) -> tuple[str, str] | None:
    ring = _BNXT_RING.match(name)
    if ring:
        return f"ring{ring['index']}", ring["name"].strip()
    for pattern in _QUEUE_PATTERNS:
        match = pattern.match(name)
        if match:
            return f"{match['dir'].rstrip('_')}{match['index']}", match["name"]
    return None


def parse(source: LineSource) -> EthtoolStats:
    """Read ``ethtool -S`` output; lines that are not ``name: value`` are skipped quietly
    unless they look like counters gone wrong, which become gaps."""
    stats = EthtoolStats()
    for number, line in numbered_lines(source):
        stripped = line.strip()
        if not stripped or stripped.endswith("statistics:") or set(stripped) <= set("-=# "):
            continue
        match = _LINE.match(line)
        if not match:
            if ":" in stripped and not stripped.startswith(("ethtool", "#", "Cannot", "no stats")):
                stats.gaps.append(Gap(f"not a counter line: {stripped[:80]!r}", number))
            elif stripped.startswith(("Cannot", "no stats")):
                stats.gaps.append(Gap(stripped[:120], number))
            continue
        name, value = match["name"], int(match["value"])
        queue = _split_queue(name)
        if queue:
            stats.queues.setdefault(queue[0], {})[queue[1]] = value
        else:
            stats.counters[name] = value
    if not stats.counters and not stats.queues:
        stats.gaps.append(Gap("no counters found"))
    return stats


def detect(sample: str) -> float:
    if re.search(r"^NIC statistics:\s*$", sample, re.M):
        return 0.95
    lines = [line for line in sample.splitlines()[:200] if line.strip()]
    counter_lines = sum(1 for line in lines if line.startswith((" ", "\t")) and _LINE.match(line))
    if lines and counter_lines / len(lines) > 0.8 and counter_lines >= 5:
        return 0.4
    return 0.0


def summarize(stats: EthtoolStats) -> list[str]:
    nonzero = {k: v for k, v in stats.counters.items() if v}
    lines = [
        f"{len(stats.counters)} NIC counters ({len(nonzero)} non-zero), "
        f"{len(stats.queues)} queues with {sum(len(q) for q in stats.queues.values())} per-queue counters"
    ]
    watch = re.compile(r"pause|discard|drop|err|out_of_buffer|crc|timeout|reset", re.I)
    flagged = {k: v for k, v in nonzero.items() if watch.search(k)}
    for name, value in sorted(flagged.items()):
        lines.append(f"  {name}: {value:,}")
    return lines


KIND = register(
    Kind(
        name="ethtool",
        description="ethtool -S IFACE: NIC statistics (any driver), per-queue counters kept apart",
        command="ethtool -S {iface}",
        parse=parse,
        detect=detect,
        summarize=summarize,
        streaming=True,
    )
)

#: One run per interface the node has (``{iface}`` comes from ``$SPIKEOPS_SYSFS/class/net``).
REMOTE = register_remote(RemoteProbe(
    name="ethtool", filename="ethtool-{iface}.txt", command="ethtool -S {iface}",
    kind="ethtool", order=30, max_bytes=4 << 20, per_interface=True,
))
