"""The sysfs port counters (``grep -H . /sys/class/infiniband/*/ports/*/counters/*``,
``hw_counters/`` too), as printed or as a captured tree."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from spikeops.probes.base import Gap, LineSource, clip, numbered_lines
from spikeops.probes.infiniband.model import (
    _rate_label,
    _below_peers,
    _nonblank,
    normalise_phys_state,
    normalise_state,
    parse_rate,
)

__all__ = ["ERROR_COUNTERS", "HW_ERROR_COUNTERS", "CONGESTION_COUNTERS", "IbPortCounters", "IbCounters", "parse_counters", "render_sysfs_tree", "summarize_counters", "detect_counters"]


# --------------------------------------------------------------------------------------
# sysfs counters
# --------------------------------------------------------------------------------------

#: IB PortCounters that count faults on the link (ib_link_flap / nccl_error evidence).
ERROR_COUNTERS: tuple[str, ...] = (
    "symbol_error",
    "link_downed",
    "link_error_recovery",
    "port_rcv_errors",
    "port_rcv_remote_physical_errors",
    "excessive_buffer_overrun_errors",
    "port_xmit_discards",
    "local_link_integrity_errors",
    "port_xmit_constraint_errors",
    "port_rcv_constraint_errors",
)
#: mlx5 ``hw_counters`` that count transport-level trouble (retransmits, drops, timeouts).
HW_ERROR_COUNTERS: tuple[str, ...] = (
    "out_of_buffer",
    "out_of_sequence",
    "packet_seq_err",
    "local_ack_timeout_err",
    "roce_adp_retrans",
    "roce_adp_retrans_to",
    "roce_slow_restart",
    "rnr_nak_retry_err",
    "implied_nak_seq_err",
    "req_cqe_error",
    "resp_cqe_error",
    "req_remote_access_errors",
    "req_remote_invalid_request",
    "resp_local_length_error",
    "resp_remote_access_errors",
    "rx_icrc_encapsulated",
)
#: Counters that rise when the fabric is congested rather than broken.
CONGESTION_COUNTERS: tuple[str, ...] = (
    "port_xmit_wait",
    "np_cnp_sent",
    "rp_cnp_handled",
    "np_ecn_marked_roce_packets",
)

#: Device and port attribute files worth reading beside the counters (sysfs names).
_DEVICE_ATTRS = (
    "board_id", "fw_ver", "hca_type", "hw_rev", "node_desc", "node_guid", "node_type", "sys_image_guid",
)
_PORT_ATTRS = (
    "state", "phys_state", "rate", "link_layer", "lid", "sm_lid", "lid_mask_count", "sm_sl", "cap_mask",
)
_COUNTER_GROUPS = ("counters", "hw_counters")

_PATH_VALUE = re.compile(r"^(?P<path>[^:\s][^:]*?):(?P<value>.*)$")
_PORT_PATH = re.compile(r"(?:^|/)(?P<device>[^/]+)/ports/(?P<port>\d+)/(?P<rest>[^/].*)$")
_DEVICE_PATH = re.compile(r"(?:^|/infiniband/)(?P<device>[^/]+)/(?P<name>" + "|".join(_DEVICE_ATTRS) + r")$")


@dataclass
class IbPortCounters:
    """One port's sysfs counters and attributes.

    ``counters`` are the IB PortCounters (``counters/``), ``hw_counters`` the driver's RDMA
    counters (``hw_counters/``), both by file name. ``state``/``phys_state`` are in ibstat's
    words (``Active``, ``LinkUp``) and ``attributes`` keeps every attribute file as printed
    (``"state": "4: ACTIVE"``). ``lines`` gives the input line of each value
    (``"counters/link_downed": 5``) so a finding can cite it.
    """

    device: str
    port: int
    counters: dict[str, int] = field(default_factory=dict)
    hw_counters: dict[str, int] = field(default_factory=dict)
    state: str | None = None
    phys_state: str | None = None
    rate_gbps: float | None = None
    rate_text: str | None = None
    link_layer: str | None = None
    attributes: dict[str, str] = field(default_factory=dict)
    line: int = 0
    lines: dict[str, int] = field(default_factory=dict)

    @property
    def active(self) -> bool:
        return self.state == "Active" and self.phys_state == "LinkUp"

    def value(self, name: str) -> int | None:
        """A counter by name from either group (``link_downed``, ``out_of_buffer``)."""
        if name in self.counters:
            return self.counters[name]
        return self.hw_counters.get(name)


@dataclass
class IbCounters:
    """Every (device, port) found in a sysfs capture, plus device attributes (``fw_ver``...)."""

    ports: list[IbPortCounters] = field(default_factory=list)
    devices: dict[str, dict[str, str]] = field(default_factory=dict)
    gaps: list[Gap] = field(default_factory=list)

    def port(self, device: str, port: int = 1) -> IbPortCounters | None:
        return next((p for p in self.ports if p.device == device and p.port == port), None)


def _counter_value(text: str) -> int | None:
    value = text.strip()
    return int(value) if re.fullmatch(r"\d+", value) else None


def _apply_port_value(
    entry: IbPortCounters, rest: str, value: str, number: int, gaps: list[Gap]
) -> None:
    """File one ``ports/N/<rest>:value`` line into the port's record."""
    group, _, name = rest.partition("/")
    if group in _COUNTER_GROUPS and name and "/" not in name:
        count = _counter_value(value)
        if count is None:
            where = f"{entry.device} port {entry.port} {rest}"
            gaps.append(Gap(f"{where}: not a count: {clip(value, 60)!r}", number))
            return
        target = entry.counters if group == "counters" else entry.hw_counters
        if name in target:
            gaps.append(Gap(f"{entry.device} port {entry.port} {rest} repeated; later value kept", number))
        target[name] = count
    else:
        entry.attributes[rest] = value.strip()
        if rest == "state":
            entry.state = normalise_state(value)
        elif rest == "phys_state":
            entry.phys_state = normalise_phys_state(value)
        elif rest == "rate":
            entry.rate_gbps, entry.rate_text = parse_rate(value)
        elif rest == "link_layer":
            entry.link_layer = value.strip() or None
    entry.lines[rest] = number


def parse_counters(source: LineSource) -> IbCounters:
    """Read ``grep -H . /sys/class/infiniband/*/ports/*/counters/*`` and its relatives.

    Accepts absolute or relative paths (``mlx5_0/ports/1/counters/link_downed:0``),
    ``hw_counters/``, port attribute files (``state``, ``rate``...) and device attribute files
    (``fw_ver``...). grep's own complaints (``grep: ...: Invalid argument`` for a counter the
    driver cannot read) and anything else that is not ``path:value`` become gaps.
    """
    result = IbCounters()
    index: dict[tuple[str, int], IbPortCounters] = {}
    for number, line in numbered_lines(source):
        if not line.strip():
            continue
        pair = _PATH_VALUE.match(line)
        if not pair or line.startswith("grep:"):
            result.gaps.append(Gap(f"not a sysfs path:value line: {clip(line, 100)!r}", number))
            continue
        path, value = pair["path"].strip(), pair["value"]
        port_match = _PORT_PATH.search(path)
        if port_match:
            key = (port_match["device"], int(port_match["port"]))
            entry = index.get(key)
            if entry is None:
                entry = index[key] = IbPortCounters(key[0], key[1], line=number)
                result.ports.append(entry)
            _apply_port_value(entry, port_match["rest"], value, number, result.gaps)
            continue
        device_match = _DEVICE_PATH.search(path)
        if device_match:
            result.devices.setdefault(device_match["device"], {})[device_match["name"]] = value.strip()
            continue
        result.gaps.append(Gap(f"not an InfiniBand sysfs path: {clip(path, 100)!r}", number))
    if not result.ports:
        result.gaps.append(Gap("no InfiniBand port counters found"))
    return result


# The one I/O function of this module: a sysfs tree copied as a directory.

_MAX_FILE_BYTES = 4096
_MAX_DEVICES = 256
_MAX_PORTS = 64
_MAX_FILES_PER_GROUP = 2048
_SYSFS_PREFIX = "/sys/class/infiniband"


def _read_small(path: Path) -> str | None:
    """A sysfs value file (often without a trailing newline in copies); None if unreadable."""
    try:
        with path.open("rb") as handle:
            data = handle.read(_MAX_FILE_BYTES)
    except OSError:
        return None
    return data.decode("utf-8", errors="replace")


def _is_dir(path: Path) -> bool:
    try:
        return path.is_dir()
    except OSError:
        return False


def _is_file(path: Path) -> bool:
    try:
        return path.is_file()
    except OSError:
        return False


def _listdir(path: Path, limit: int) -> list[Path]:
    try:
        return sorted(path.iterdir())[:limit]
    except OSError:
        return []


def _sysfs_devices(root: Path) -> list[tuple[str, Path]]:
    """``(device, dir)`` pairs: the directory is one device, or holds devices."""
    if _is_dir(root / "ports"):
        return [(root.name, root)]
    return [
        (child.name, child)
        for child in _listdir(root, _MAX_DEVICES)
        if _is_dir(child / "ports")
    ]


def _grep_lines(path: Path, shown: str) -> list[tuple[str, int, str]]:
    """What ``grep -H . FILE`` prints for one file: each non-empty line behind its path."""
    content = _read_small(path)
    if content is None:
        return []
    return [(shown, i, f"{shown}:{text}") for i, text in enumerate(content.splitlines()) if text]


def _device_lines(device: str, directory: Path) -> tuple[list[tuple[str, int, str]], bool]:
    """Lines for one device and whether it had any port data at all."""
    lines: list[tuple[str, int, str]] = []
    shown = f"{_SYSFS_PREFIX}/{device}"
    for attr in _DEVICE_ATTRS:
        if _is_file(directory / attr):
            lines += _grep_lines(directory / attr, f"{shown}/{attr}")
    has_ports = False
    for port_dir in _listdir(directory / "ports", _MAX_PORTS):
        if not port_dir.name.isdigit() or not _is_dir(port_dir):
            continue
        port_shown = f"{shown}/ports/{port_dir.name}"
        for attr in _PORT_ATTRS:
            if _is_file(port_dir / attr):
                has_ports = True
                lines += _grep_lines(port_dir / attr, f"{port_shown}/{attr}")
        for group in _COUNTER_GROUPS:
            for counter in _listdir(port_dir / group, _MAX_FILES_PER_GROUP):
                if _is_file(counter):
                    has_ports = True
                    lines += _grep_lines(counter, f"{port_shown}/{group}/{counter.name}")
    return lines, has_ports


def render_sysfs_tree(path: Path) -> str | None:
    """Render a copy of ``/sys/class/infiniband`` (or of one device under it) as the text
    ``grep -H . .../counters/* .../hw_counters/* .../state ...`` prints on the node.

    Paths are shown under ``/sys/class/infiniband/<dev>/...`` whatever the copy's location,
    so a rendered tree parses exactly like a capture. Each file is read up to 4 KiB;
    unreadable ones are skipped as grep would skip them (its complaint goes to stderr).
    Returns None when the directory does not look like that tree. Never raises.
    """
    try:
        root = Path(path)
        if not _is_dir(root):
            return None
        rendered: list[tuple[str, int, str]] = []
        any_ports = False
        for device, directory in _sysfs_devices(root):
            lines, has_ports = _device_lines(device, directory)
            rendered += lines
            any_ports = any_ports or has_ports
    except (OSError, ValueError):
        return None
    if not any_ports:
        return None
    rendered.sort(key=lambda item: (item[0], item[1]))
    return "".join(text + "\n" for _, _, text in rendered)


def summarize_counters(result: IbCounters) -> list[str]:
    """Ports with state and rate, anything not Active, slow ports, non-zero error and
    congestion counters (absolute values: growth is judged against the baseline)."""
    ports = result.ports
    active = [p for p in ports if p.active]
    with_state = [p for p in ports if p.state is not None]
    head = f"{len(ports)} ports on {len({p.device for p in ports})} devices"
    # The bundle's probe greps counters only: no state files, so no claim about link state.
    if with_state:
        head += f", {len(active)} of {len(with_state)} with a state Active/LinkUp"
    lines = [head]
    for port in with_state:
        lines.append(
            f"  {port.device} port {port.port}: {port.state}/{port.phys_state} "
            f"{port.attributes.get('rate', '?')} {port.link_layer or '?'}"
        )
    models = {name: attrs.get("hca_type") for name, attrs in result.devices.items()}
    for port in _below_peers(
        active, lambda p: (p.link_layer, models.get(p.device)), lambda p: p.rate_gbps
    ):
        rate = _rate_label(port.rate_gbps)
        lines.append(f"  SLOW {port.device} port {port.port}: {rate} Gb/s below its peers")
    for title, names in (
        ("errors", ERROR_COUNTERS + HW_ERROR_COUNTERS),
        ("congestion", CONGESTION_COUNTERS),
    ):
        for name in names:
            hits = [(p, p.value(name)) for p in ports if p.value(name)]
            if hits:
                shown = ", ".join(f"{p.device}:{p.port}={v:,}" for p, v in hits[:4])
                more = f", +{len(hits) - 4} more" if len(hits) > 4 else ""
                lines.append(f"  {title}: {name} non-zero on {len(hits)}/{len(ports)} ports ({shown}{more})")
    return lines


def detect_counters(sample: str) -> float:
    lines = _nonblank(sample)
    hits = [line for line in lines if _PATH_VALUE.match(line) and _PORT_PATH.search(line.split(":", 1)[0])]
    if not hits:
        return 0.0
    share = len(hits) / len(lines)
    if any(line.startswith(_SYSFS_PREFIX + "/") for line in hits) and share >= 0.5:
        return 0.95
    if share >= 0.8 and any(re.search(r"/ports/\d+/(?:hw_)?counters/", line) for line in hits):
        return 0.8
    return 0.3 if share >= 0.5 else 0.0
