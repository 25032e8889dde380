"""``ibstat`` and ``ibstatus``: each port's state, physical state, rate and lids."""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from spikeops.probes.base import Gap, LineSource, clip, numbered_lines
from spikeops.probes.infiniband.model import (
    _rate_label,
    _below_peers,
    _int_auto,
    normalise_phys_state,
    normalise_state,
    parse_rate,
)

__all__ = ["IbPort", "IbCa", "IbToolError", "IbStat", "ports_below_peers", "parse_ibstat", "parse_ibstatus", "summarize_ibstat", "detect_ibstat", "detect_ibstatus"]


# --------------------------------------------------------------------------------------
# ibstat / ibstatus
# --------------------------------------------------------------------------------------


@dataclass
class IbPort:
    """One port as ``ibstat``/``ibstatus`` report it.

    ``state`` and ``physical_state`` use ibstat's words whatever the tool (``Active``,
    ``LinkUp``); ``rate_gbps`` is the port's data rate; ``rate_text`` is the width/speed in
    the kernel's words (``4X HDR``) where the tool prints it. ``line``/``text`` cite the port's
    first line; ``lines`` gives the line of each field (``"state": 77``) so a finding can
    quote the exact ``State: Down`` line.
    """

    ca: str | None
    port: int
    state: str | None = None
    physical_state: str | None = None
    rate_gbps: float | None = None
    rate_text: str | None = None
    base_lid: int | None = None
    sm_lid: int | None = None
    lmc: int | None = None
    capability_mask: str | None = None
    port_guid: str | None = None
    link_layer: str | None = None
    line: int = 0
    text: str = ""
    lines: dict[str, int] = field(default_factory=dict)
    extra: dict[str, str] = field(default_factory=dict)

    @property
    def active(self) -> bool:
        """Usable for traffic: logically Active and physically LinkUp."""
        return self.state == "Active" and self.physical_state == "LinkUp"


@dataclass
class IbCa:
    """A channel adapter (HCA) block: ``CA 'mlx5_0'`` with its identity and ports."""

    name: str | None
    node_type: str | None = "CA"
    ca_type: str | None = None
    ports_count: int | None = None
    firmware: str | None = None
    hardware_version: str | None = None
    node_guid: str | None = None
    system_guid: str | None = None
    ports: list[IbPort] = field(default_factory=list)
    line: int = 0
    text: str = ""
    extra: dict[str, str] = field(default_factory=dict)


@dataclass
class IbToolError:
    """An error the tool printed (``ibpanic: ... stat of IB device 'mlx5_8' failed``).

    Kept as evidence, not only as a gap: a device that disappears from under ibstat is itself
    a hardware symptom. ``device`` is the device the message names, when it names one.
    """

    line: int
    text: str
    device: str | None = None


@dataclass
class IbStat:
    """What ``ibstat`` or ``ibstatus`` showed: adapters with their ports, and tool errors."""

    cas: list[IbCa] = field(default_factory=list)
    errors: list[IbToolError] = field(default_factory=list)
    gaps: list[Gap] = field(default_factory=list)

    def ports(self) -> list[IbPort]:
        """Every port of every adapter, in output order."""
        return [port for ca in self.cas for port in ca.ports]

    def ca(self, name: str) -> IbCa | None:
        return next((ca for ca in self.cas if ca.name == name), None)


def ports_below_peers(ports: Sequence[IbPort], ca_types: dict[str, str] | None = None) -> list[IbPort]:
    """Active ports whose rate is below the usual rate of the same link layer and adapter model.

    Peers are ports with the same link layer and, where known, the same adapter model: a
    node's 100 G front-end NIC (MT4125) is not a degraded 400 G GPU NIC (MT4129). Ports that
    are not Active are left out: their ``Rate`` is a leftover, and "not Active" already says
    more. ``ca_types`` maps CA names to models when the ports do not carry them.
    """
    types = ca_types or {}
    return _below_peers(
        [port for port in ports if port.active],
        lambda port: (port.link_layer, types.get(port.ca or "")),
        lambda port: port.rate_gbps,
    )


_CA_HEADER = re.compile(r"^(?P<type>CA|Switch|Router|iWARP RNIC|\?\?\?) '(?P<name>[^']*)'\s*$")
_PORT_HEADER = re.compile(r"^\s*Port (?P<port>\d+):\s*$")
_KEY_VALUE = re.compile(r"^\s*(?P<key>[A-Za-z][A-Za-z _]*?)\s*:\s*(?P<value>.*?)\s*$")
_TOOL_ERROR = re.compile(
    r"^\s*(?:ibpanic|ibwarn|iberror|ibstat|ibstatus|umad|ls|cat|grep|perfquery|ibnetdiscover"
    r"|ibswinfo|error|warning)\b[^:]*:\s",
    re.I,
)
_NAMED_DEVICE = re.compile(r"device '(?P<device>[^']+)'")

_CA_FIELDS = {
    "CA type": "ca_type",
    "Number of ports": "ports_count",
    "Firmware version": "firmware",
    "Hardware version": "hardware_version",
    "Node GUID": "node_guid",
    "System image GUID": "system_guid",
}
_PORT_FIELDS = {
    "State": "state",
    "Physical state": "physical_state",
    "Rate": "rate_gbps",
    "Base lid": "base_lid",
    "LMC": "lmc",
    "SM lid": "sm_lid",
    "Capability mask": "capability_mask",
    "Port GUID": "port_guid",
    "Link layer": "link_layer",
}


def _tool_error(number: int, line: str) -> IbToolError:
    named = _NAMED_DEVICE.search(line)
    return IbToolError(number, clip(line), named["device"] if named else None)


def _set_ca_field(ca: IbCa, key: str, value: str) -> None:
    attr = _CA_FIELDS[key]
    if attr == "ports_count":
        ca.ports_count = _int_auto(value)
    else:
        setattr(ca, attr, value or None)


def _set_port_field(port: IbPort, key: str, value: str) -> None:
    attr = _PORT_FIELDS[key]
    if attr == "state":
        port.state = normalise_state(value)
    elif attr == "physical_state":
        port.physical_state = normalise_phys_state(value)
    elif attr == "rate_gbps":
        port.rate_gbps, text = parse_rate(value)
        port.rate_text = text or port.rate_text
    elif attr in ("base_lid", "sm_lid", "lmc"):
        setattr(port, attr, _int_auto(value))
    else:
        setattr(port, attr, value or None)


def _check_port_counts(stat: IbStat) -> None:
    """A CA that announces more ports than were printed means the output was cut."""
    for ca in stat.cas:
        if ca.ports_count is not None and ca.ports and len(ca.ports) < ca.ports_count:
            stat.gaps.append(
                Gap(f"CA {ca.name!r} has {ca.ports_count} ports, {len(ca.ports)} printed", ca.line)
            )


def parse_ibstat(source: LineSource) -> IbStat:
    """Read ``ibstat`` (any infiniband-diags version; also ``ibstat -s`` and ``ibstat CA PORT``).

    Fields are told apart by name, not indentation, since versions indent differently. Tool
    errors (``ibpanic:``, ``ibwarn:``) become ``errors`` and gaps; everything read before
    them is kept, because ibstat stops at the first device it cannot stat.
    """
    stat = IbStat()
    ca: IbCa | None = None
    port: IbPort | None = None
    for number, line in numbered_lines(source):
        stripped = line.strip()
        if not stripped:
            continue
        header = _CA_HEADER.match(line)
        if header:
            ca = IbCa(header["name"], header["type"], line=number, text=clip(line))
            stat.cas.append(ca)
            port = None
            continue
        if _TOOL_ERROR.match(line):
            error = _tool_error(number, line)
            stat.errors.append(error)
            stat.gaps.append(Gap(f"tool error: {error.text}", number))
            continue
        port_header = _PORT_HEADER.match(line)
        if port_header:
            if ca is None:  # ``ibstat mlx5_0 1`` prints one port without its CA
                ca = IbCa(None, None, line=number, text=clip(line))
                stat.cas.append(ca)
            port = IbPort(ca.name, int(port_header["port"]), line=number, text=clip(line))
            ca.ports.append(port)
            continue
        kv = _KEY_VALUE.match(line)
        if not kv:
            stat.gaps.append(Gap(f"not an ibstat line: {clip(stripped, 80)!r}", number))
            continue
        key, value = kv["key"], kv["value"]
        if key in _PORT_FIELDS and port is not None:
            _set_port_field(port, key, value)
            port.lines[_PORT_FIELDS[key]] = number
        elif key in _CA_FIELDS and ca is not None:
            _set_ca_field(ca, key, value)
        elif port is not None:
            port.extra[key] = value
        elif ca is not None:
            ca.extra[key] = value
        else:
            stat.gaps.append(Gap(f"field outside any CA block: {clip(stripped, 80)!r}", number))
    _check_port_counts(stat)
    if not stat.cas and not stat.errors:
        stat.gaps.append(Gap("no CA found"))
    return stat


_IBSTATUS_HEADER = re.compile(r"^Infiniband device '(?P<device>[^']*)' port (?P<port>\d+) status:\s*$")
_IBSTATUS_FIELDS = {
    "base lid": "base_lid",
    "sm lid": "sm_lid",
    "state": "state",
    "phys state": "physical_state",
    "rate": "rate",
    "link_layer": "link_layer",
    "link layer": "link_layer",
}


def _set_ibstatus_field(port: IbPort, attr: str, value: str) -> None:
    if attr == "state":
        port.state = normalise_state(value)
    elif attr == "physical_state":
        port.physical_state = normalise_phys_state(value)
    elif attr == "rate":
        port.rate_gbps, port.rate_text = parse_rate(value)
    elif attr in ("base_lid", "sm_lid"):
        setattr(port, attr, _int_auto(value))
    else:
        port.link_layer = value or None


def parse_ibstatus(source: LineSource) -> IbStat:
    """Read ``ibstatus`` into the same shape as ibstat: one CA per device, its ports under it.

    ibstatus cats sysfs files, so it prints the kernel's words (``4: ACTIVE``) and hex lids;
    both are converted to ibstat's conventions, and ``rate_text`` keeps ``4X HDR``.
    """
    stat = IbStat()
    port: IbPort | None = None
    for number, line in numbered_lines(source):
        stripped = line.strip()
        if not stripped:
            continue
        header = _IBSTATUS_HEADER.match(line)
        if header:
            name = header["device"]
            ca = stat.ca(name)
            if ca is None:
                ca = IbCa(name, None, line=number, text=clip(line))
                stat.cas.append(ca)
            port = IbPort(name, int(header["port"]), line=number, text=clip(line))
            ca.ports.append(port)
            continue
        if _TOOL_ERROR.match(line):
            error = _tool_error(number, line)
            stat.errors.append(error)
            stat.gaps.append(Gap(f"tool error: {error.text}", number))
            continue
        kv = _KEY_VALUE.match(line)
        if not kv or port is None:
            stat.gaps.append(Gap(f"not an ibstatus line: {clip(stripped, 80)!r}", number))
            continue
        key, value = kv["key"].lower(), kv["value"]
        attr = _IBSTATUS_FIELDS.get(key)
        if attr is None:
            port.extra[kv["key"]] = value
            continue
        _set_ibstatus_field(port, attr, value)
        port.lines[attr if attr != "rate" else "rate_gbps"] = number
    if not stat.cas and not stat.errors:
        stat.gaps.append(Gap("no 'Infiniband device ... status:' block found"))
    return stat


def _port_label(port: IbPort) -> str:
    return f"{port.ca or '?'} port {port.port}"


def summarize_ibstat(stat: IbStat) -> list[str]:
    """Ports and their states; anything not Active/LinkUp or slower than its peers."""
    ports = stat.ports()
    active = [port for port in ports if port.active]
    by_layer = Counter((port.link_layer or "?", _rate_label(port.rate_gbps)) for port in active)
    mix = ", ".join(f"{n}x {layer} {rate} Gb/s" for (layer, rate), n in sorted(by_layer.items()))
    head = f"{len(stat.cas)} adapters, {len(ports)} ports, {len(active)} Active/LinkUp"
    lines = [head + (f": {mix}" if mix else "")]
    for port in ports:
        if not port.active:
            lines.append(
                f"  NOT ACTIVE {_port_label(port)}: {port.state}/{port.physical_state}, "
                f"rate {_rate_label(port.rate_gbps)}, {port.link_layer} (line {port.line})"
            )
    types = {ca.name: ca.ca_type for ca in stat.cas if ca.name and ca.ca_type}
    for port in ports_below_peers(ports, types):
        lines.append(
            f"  SLOW {_port_label(port)}: {_rate_label(port.rate_gbps)} Gb/s below its "
            f"{port.link_layer} peers (line {port.line})"
        )
    for error in stat.errors:
        lines.append(f"  TOOL ERROR line {error.line}: {error.text}")
    return lines


def detect_ibstat(sample: str) -> float:
    has_ca = re.search(r"^(?:CA|Switch|Router) '[^']*'\s*$", sample, re.M) is not None
    has_port = re.search(r"^\s*Port \d+:\s*$", sample, re.M) is not None
    has_fields = re.search(r"^\s*(?:CA type|Physical state|Link layer):", sample, re.M) is not None
    if has_ca and (has_port or has_fields):
        return 0.95
    if has_port and re.search(r"^\s*Physical state:", sample, re.M):
        return 0.7
    if re.search(r"^ibpanic: .*stat of IB device", sample, re.M):
        return 0.5
    return 0.0


def detect_ibstatus(sample: str) -> float:
    if re.search(r"^Infiniband device '[^']*' port \d+ status:\s*$", sample, re.M):
        return 0.95
    return 0.0
