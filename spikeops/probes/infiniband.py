"""InfiniBand / RoCE probe outputs: ``ibstat``, ``ibstatus``, the sysfs counters,
``perfquery``, ``ibnetdiscover -p`` and ``ibswinfo``.

A flapping or slow IB link turns into NCCL retransmits, stalls and sometimes a corrupted
AllReduce, so the hardware layer needs three facts from these tools: is every port
Active/LinkUp, did a port negotiate a lower rate than its peers, and which error or
congestion counters moved. Each tool prints those facts its own way:

- ``ibstat`` (infiniband-diags): ``CA 'mlx5_0'`` blocks, ``Port N:`` sub-blocks, ``Rate: 400``
  in Gb/s. Version 47 indents with tabs, 39 with spaces, so fields are recognised by name,
  never by indentation. ``ibpanic:`` ends the output early (a device vanished between the
  directory listing and the stat); what was printed before it is kept.
- ``ibstatus`` (a shell script over sysfs): kernel spellings ``4: ACTIVE``, ``5: LinkUp``,
  ``200 Gb/sec (4X HDR)``, hexadecimal lids. States are normalised to ibstat's words
  (``Active``) so a rule written against one tool works on the other.
- ``grep -H . /sys/class/infiniband/*/ports/*/counters/*``: ``path:value`` lines; the same
  with ``hw_counters/`` (mlx5 RDMA counters such as ``out_of_buffer``), port attribute files
  (``state``, ``rate``...) and relative paths. Counters are exact ints (``port_rcv_data``
  passes 2**47).
- ``perfquery``: ``# Port extended counters: Lid 1719 port 1 (CapMask: ...)`` headers and
  dotted ``Name:......value`` lines. Decimal values are ints; hexadecimal values
  (``CounterSelect:...0x0000``, select masks rather than counters) are kept as the printed
  string.
- ``ibnetdiscover -p``: one row per port, ``CA 134 1 0x... 4x EDR - SW 1719 10 0x... ( 'a' - 'b' )``;
  a port with nothing on the other end has no ``- ...`` half.
- ``ibswinfo``: a ``key | value`` report for unmanaged Mellanox switches (PSUs, fans,
  temperature).

Counters are kept raw: whether one grew is a question for the diagnosis, which compares
against ``baseline/``.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

from spikeops.probes.base import RemoteProbe, Gap, Kind, LineSource, clip, numbered_lines, register, register_remote

__all__ = [
    "REMOTE_IBSTAT", "REMOTE_IB_COUNTERS",
    # ibstat / ibstatus
    "IbPort",
    "IbCa",
    "IbToolError",
    "IbStat",
    "parse_ibstat",
    "parse_ibstatus",
    "ports_below_peers",
    "normalise_state",
    "normalise_phys_state",
    "parse_rate",
    # sysfs counters
    "IbPortCounters",
    "IbCounters",
    "parse_counters",
    "render_sysfs_tree",
    "ERROR_COUNTERS",
    "HW_ERROR_COUNTERS",
    "CONGESTION_COUNTERS",
    # perfquery
    "PerfQueryBlock",
    "PerfQuery",
    "parse_perfquery",
    # ibnetdiscover
    "IbLink",
    "IbLinks",
    "parse_ibnetdiscover_ports",
    # ibswinfo
    "SwitchInfo",
    "parse_ibswinfo",
    # detection, summaries and kinds
    "detect_ibstat",
    "detect_ibstatus",
    "detect_counters",
    "detect_perfquery",
    "detect_ibnetdiscover",
    "detect_ibswinfo",
    "summarize_ibstat",
    "summarize_counters",
    "summarize_perfquery",
    "summarize_ibnetdiscover",
    "summarize_ibswinfo",
    "KIND_IBSTAT",
    "KIND_IBSTATUS",
    "KIND_IB_COUNTERS",
    "KIND_PERFQUERY",
    "KIND_IBNETDISCOVER",
    "KIND_IBSWINFO",
    "KINDS",
]

T = TypeVar("T")

# --------------------------------------------------------------------------------------
# Shared vocabulary
# --------------------------------------------------------------------------------------

#: Kernel port states (drivers/infiniband/core/sysfs.c) in ibstat's words.
_STATE_WORDS = {
    "NOP": "Nop",
    "DOWN": "Down",
    "INIT": "Initializing",
    "INITIALIZING": "Initializing",
    "ARMED": "Armed",
    "ACTIVE": "Active",
    "ACTIVE_DEFER": "ActiveDefer",
    "ACTIVEDEFER": "ActiveDefer",
}
_STATE_CODES = {0: "Nop", 1: "Down", 2: "Initializing", 3: "Armed", 4: "Active", 5: "ActiveDefer"}
#: Physical states as both ibstat and the kernel spell them (``Phy Test`` in some kernels).
_PHYS_WORDS = {
    "sleep": "Sleep",
    "polling": "Polling",
    "disabled": "Disabled",
    "portconfigurationtraining": "PortConfigurationTraining",
    "linkup": "LinkUp",
    "linkerrorrecovery": "LinkErrorRecovery",
    "phytest": "PhyTest",
}
_PHYS_CODES = {
    1: "Sleep",
    2: "Polling",
    3: "Disabled",
    4: "PortConfigurationTraining",
    5: "LinkUp",
    6: "LinkErrorRecovery",
    7: "PhyTest",
}
_UNKNOWN_WORDS = {"", "???", "<unknown>", "unknown", "n/a", "na"}

_CODE_WORD = re.compile(r"^\s*(?:(?P<code>\d+)\s*:\s*)?(?P<word>.*?)\s*$")


def _normalise(text: str | None, codes: dict[int, str], by_word: Callable[[str], str]) -> str | None:
    """``4: ACTIVE`` / ``ACTIVE`` / ``4`` -> the canonical word; an unknown word stays as printed."""
    if text is None:
        return None
    match = _CODE_WORD.match(text)
    if not match:
        return None
    word = match["word"]
    if word.isdigit():
        return codes.get(int(word), word)
    if word.lower() in _UNKNOWN_WORDS:
        return codes.get(int(match["code"])) if match["code"] else None
    return by_word(word)


def normalise_state(text: str | None) -> str | None:
    """``4: ACTIVE`` (sysfs, ibstatus), ``ACTIVE`` or ``Active`` (ibstat) -> ``Active``.

    One vocabulary across tools lets the diagnosis ask "is it Active" once; an unknown word
    is kept as printed so nothing new is silently mapped to a wrong state.
    """
    return _normalise(text, _STATE_CODES, lambda word: _STATE_WORDS.get(word.upper().replace(" ", "_"), word))


def normalise_phys_state(text: str | None) -> str | None:
    """``5: LinkUp`` / ``LinkUp`` -> ``LinkUp``; ``Phy Test`` -> ``PhyTest``."""
    return _normalise(text, _PHYS_CODES, lambda word: _PHYS_WORDS.get(word.replace(" ", "").lower(), word))


_RATE = re.compile(r"^\s*(?P<gbps>\d+(?:\.\d+)?)\s*(?:Gb/sec)?\s*(?:\((?P<text>[^)]*)\))?\s*$")


def parse_rate(text: str | None) -> tuple[float | None, str | None]:
    """``200`` (ibstat), ``200 Gb/sec (4X HDR)`` (sysfs) -> ``(200.0, "4X HDR")``.

    The kernel prints SDR links without a speed word (``10 Gb/sec (4X)``) and half rates as
    ``2.5``, so the number is a float and the parenthesis is optional.
    """
    if text is None:
        return None, None
    match = _RATE.match(text)
    if not match:
        return None, None
    inner = match["text"]
    return float(match["gbps"]), (inner.strip() or None) if inner is not None else None


def _int_auto(text: str) -> int | None:
    """Lids are decimal in ibstat and ``0x33bf`` in sysfs/ibstatus."""
    value = text.strip()
    try:
        if value.lower().startswith("0x"):
            return int(value, 16)
        if re.fullmatch(r"\d+", value):
            return int(value)
    except ValueError:
        return None
    return None


def _below_peers(
    items: Sequence[T], group: Callable[[T], Hashable], rate: Callable[[T], float | None]
) -> list[T]:
    """Items whose rate is below the most common rate of their group.

    A link that trained at a lower rate (a bad cable renegotiating to a slower speed or fewer
    lanes) still says Active/LinkUp; only the comparison with its siblings shows it. Groups
    of one say nothing. On a tie the higher rate counts as "normal".
    """
    groups: dict[Hashable, list[tuple[T, float]]] = {}
    for item in items:
        value = rate(item)
        if value is not None:
            groups.setdefault(group(item), []).append((item, value))
    slow: list[T] = []
    for members in groups.values():
        if len(members) < 2:
            continue
        normal = _usual_rate([value for _, value in members])
        slow.extend(item for item, value in members if normal is not None and value < normal)
    return slow


def _usual_rate(rates: Sequence[float]) -> float | None:
    """The most common rate; on a tie the higher one, so a 50/50 split flags the slow half."""
    counts = Counter(rates)
    if not counts:
        return None
    return max(counts, key=lambda value: (counts[value], value))


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


def _rate_label(rate: float | None) -> str:
    if rate is None:
        return "?"
    return f"{rate:g}"


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


# --------------------------------------------------------------------------------------
# perfquery
# --------------------------------------------------------------------------------------


@dataclass
class PerfQueryBlock:
    """One ``# <title> counters: Lid N port M`` block.

    ``title`` is what precedes ``counters:`` (``Port extended``, ``Port``,
    ``PortRcvErrorDetails``). Counter values are ints when printed in decimal and the
    printed string when in hex (``CounterSelect: 0x0000`` is a select mask, not a count).
    ``port`` is None for "all ports" aggregates that do not print a number.
    """

    title: str
    lid: int | None
    port: int | None
    counters: dict[str, int | str] = field(default_factory=dict)
    cap_mask: str | None = None
    target: str = ""
    line: int = 0
    text: str = ""


@dataclass
class PerfQuery:
    blocks: list[PerfQueryBlock] = field(default_factory=list)
    gaps: list[Gap] = field(default_factory=list)

    def block(self, title: str, port: int | None = None) -> PerfQueryBlock | None:
        return next(
            (b for b in self.blocks if b.title == title and (port is None or b.port == port)), None
        )


_PQ_HEADER = re.compile(
    r"^#\s*(?P<title>[^:#]*?)\s*counters:\s*(?P<target>.*?)"
    r"\s+(?:port\s+(?P<port>\d+)|all ports)\b(?P<rest>.*)$"
)
_PQ_COUNTER = re.compile(r"^\s*(?P<name>[A-Za-z][\w\[\]]*):\.*\s*(?P<value>\S.*?)\s*$")
_PQ_CAPMASK = re.compile(r"CapMask:\s*(?P<mask>0x[0-9a-fA-F]+)")
_PQ_LID = re.compile(r"\bLid\s+(?P<lid>\d+)")
#: perfquery's error/congestion counters (current and infiniband-diags 1.4 names).
_PQ_ERROR = re.compile(r"Error|Discard|Downed|Recover", re.I)
_PQ_CONGESTION = re.compile(r"XmitWait|XmtWait|Congestion", re.I)


def _perf_value(text: str) -> int | str | None:
    if re.fullmatch(r"\d+", text):
        return int(text)
    if re.fullmatch(r"0x[0-9a-fA-F]+", text):
        return text
    return None


def parse_perfquery(source: LineSource) -> PerfQuery:
    """Read ``perfquery``, ``perfquery -x`` and the other ``# ... counters:`` dumps
    (``-E`` PortRcvErrorDetails, ``-D`` ...). Several blocks may follow one another (one per
    port, or one per LID when a script loops); each keeps its own header line for citing."""
    result = PerfQuery()
    block: PerfQueryBlock | None = None
    for number, line in numbered_lines(source):
        stripped = line.strip()
        if not stripped:
            continue
        header = _PQ_HEADER.match(stripped)
        if header:
            lid = _PQ_LID.search(header["target"])
            cap = _PQ_CAPMASK.search(header["rest"])
            block = PerfQueryBlock(
                title=header["title"],
                lid=int(lid["lid"]) if lid else None,
                port=int(header["port"]) if header["port"] else None,
                cap_mask=cap["mask"] if cap else None,
                target=header["target"],
                line=number,
                text=clip(line),
            )
            result.blocks.append(block)
            continue
        counter = _PQ_COUNTER.match(line)
        value = _perf_value(counter["value"]) if counter else None
        if counter is None or value is None:
            result.gaps.append(Gap(f"not a perfquery line: {clip(stripped, 100)!r}", number))
            continue
        if block is None:
            result.gaps.append(Gap("counters before any '# ... counters:' header", number))
            block = PerfQueryBlock(title="", lid=None, port=None, line=number, text=clip(line))
            result.blocks.append(block)
        block.counters[counter["name"]] = value
    if not result.blocks:
        result.gaps.append(Gap("no perfquery counters found"))
    return result


def summarize_perfquery(result: PerfQuery) -> list[str]:
    lines = [f"{len(result.blocks)} perfquery blocks"]
    for block in result.blocks:
        errors = {
            k: v for k, v in block.counters.items()
            if isinstance(v, int) and v and _PQ_ERROR.search(k) and not k.startswith("CounterSelect")
        }
        waits = {
            k: v for k, v in block.counters.items() if isinstance(v, int) and v and _PQ_CONGESTION.search(k)
        }
        where = f"{block.title or '?'} lid {block.lid} port {block.port}"
        lines.append(f"  {where}: {len(block.counters)} counters")
        for name, value in {**errors, **waits}.items():
            kind = "congestion" if name in waits else "errors"
            lines.append(f"    {kind}: {name} = {value:,}")
    return lines


# --------------------------------------------------------------------------------------
# ibnetdiscover -p
# --------------------------------------------------------------------------------------

#: Per-lane data rate in Gb/s (ibnetdiscover's speed words).
_LANE_GBPS = {
    "SDR": 2.5, "DDR": 5.0, "QDR": 10.0, "FDR10": 10.0, "FDR": 14.0,
    "EDR": 25.0, "HDR": 50.0, "NDR": 100.0, "XDR": 200.0,
}
_NODE = r"(?:CA|SW|RT|\?\?)"
_END = r"(?P<{p}type>" + _NODE + r")\s+(?P<{p}lid>\d+)\s+(?P<{p}port>\d+)\s+(?P<{p}guid>0x[0-9a-fA-F]+)"
_LINK_ROW = re.compile(
    r"^\s*" + _END.format(p="f") + r"\s+(?P<width>\d+x|\?\?\?)\s+(?P<speed>[A-Z0-9]+|\?\?\?)"
    r"(?:\s+-\s+" + _END.format(p="t") + r"\s+\(\s*'(?P<fname>.*)'\s+-\s+'(?P<tname>.*)'\s*\)"
    r"|\s+'(?P<uname>.*)'|\s+(?P<bare>\S.*?))?\s*$"
)


@dataclass
class IbLink:
    """One row of ``ibnetdiscover -p``: a port, its negotiated width/speed, and its peer.

    Every cable appears twice (once from each end). ``width``/``speed`` are as printed
    (``4x``, ``EDR``), None for ``???``; ``rate_gbps`` is their product. ``unlinked``: no
    peer on the other end. ``degraded``: a linked port below the usual width/speed of its
    kind of link (CA-SW or SW-SW) in this fabric; an unlinked port's speed is whatever its
    PortInfo holds (``4x SDR`` on unused or split ports) and is never called degraded.
    """

    from_type: str
    from_lid: int
    from_port: int
    from_guid: str
    width: str | None
    speed: str | None
    to_type: str | None = None
    to_lid: int | None = None
    to_port: int | None = None
    to_guid: str | None = None
    from_name: str | None = None
    to_name: str | None = None
    rate_gbps: float | None = None
    unlinked: bool = False
    degraded: bool = False
    line: int = 0
    text: str = ""


@dataclass
class IbLinks:
    links: list[IbLink] = field(default_factory=list)
    gaps: list[Gap] = field(default_factory=list)

    def degraded(self) -> list[IbLink]:
        return [link for link in self.links if link.degraded]

    def unlinked(self) -> list[IbLink]:
        return [link for link in self.links if link.unlinked]


def _link_rate(width: str | None, speed: str | None) -> float | None:
    if width is None or speed is None or speed not in _LANE_GBPS:
        return None
    return int(width[:-1]) * _LANE_GBPS[speed]


def _link_from_match(match: re.Match[str], number: int, line: str) -> IbLink:
    width = None if match["width"] == "???" else match["width"]
    speed = None if match["speed"] == "???" else match["speed"]
    linked = match["ttype"] is not None
    return IbLink(
        from_type=match["ftype"],
        from_lid=int(match["flid"]),
        from_port=int(match["fport"]),
        from_guid=match["fguid"],
        width=width,
        speed=speed,
        to_type=match["ttype"],
        to_lid=int(match["tlid"]) if linked else None,
        to_port=int(match["tport"]) if linked else None,
        to_guid=match["tguid"],
        from_name=match["fname"] if linked else (match["uname"] or match["bare"]),
        to_name=match["tname"],
        rate_gbps=_link_rate(width, speed),
        unlinked=not linked,
        line=number,
        text=clip(line),
    )


def _mark_degraded(links: list[IbLink]) -> None:
    """Flag linked ports below the usual rate of their link kind (CA-SW, SW-SW).

    Links are compared within their kind so HCAs cabled at HDR100 (``2x HDR``) are not
    called degraded next to ``4x HDR`` switch-to-switch links; a kind seen only once is
    compared with the whole fabric.
    """
    linked = [link for link in links if not link.unlinked and link.rate_gbps is not None]
    by_kind: dict[frozenset[str | None], list[float]] = {}
    for link in linked:
        by_kind.setdefault(frozenset((link.from_type, link.to_type)), []).append(link.rate_gbps or 0.0)
    fabric = _usual_rate([link.rate_gbps or 0.0 for link in linked])
    for link in linked:
        peers = by_kind[frozenset((link.from_type, link.to_type))]
        normal = _usual_rate(peers) if len(peers) >= 2 else fabric
        link.degraded = normal is not None and (link.rate_gbps or 0.0) < normal


def parse_ibnetdiscover_ports(source: LineSource) -> IbLinks:
    """Read ``ibnetdiscover -p`` (``--ports``) rows; other lines become gaps.

    Node names are quoted by current versions and bare in old ones (``Infiniscale-IV
    Mellanox Technologies``); both are read.
    """
    result = IbLinks()
    for number, line in numbered_lines(source):
        if not line.strip():
            continue
        match = _LINK_ROW.match(line)
        if not match or (match["bare"] or "").startswith("-"):  # a peer half we could not read
            result.gaps.append(Gap(f"not an ibnetdiscover -p row: {clip(line, 100)!r}", number))
            continue
        result.links.append(_link_from_match(match, number, line))
    _mark_degraded(result.links)
    if not result.links:
        result.gaps.append(Gap("no ibnetdiscover port rows found"))
    return result


def _usual_link(links: Sequence[IbLink]) -> str | None:
    counts = Counter(f"{x.width} {x.speed}" for x in links if not x.unlinked and x.rate_gbps is not None)
    return counts.most_common(1)[0][0] if counts else None


def summarize_ibnetdiscover(result: IbLinks) -> list[str]:
    links = result.links
    linked = [link for link in links if not link.unlinked]
    lines = [
        f"{len(links)} port rows: {len(linked)} linked ({len(linked) // 2} cables if every link "
        f"is listed from both ends), {len(result.unlinked())} unlinked; usual link {_usual_link(links)}"
    ]
    for link in result.degraded():
        lines.append(
            f"  DEGRADED {link.from_type} lid {link.from_lid} port {link.from_port} "
            f"({link.from_name}) -> {link.to_name}: {link.width} {link.speed} (line {link.line})"
        )
    for link in result.unlinked():
        lines.append(
            f"  unlinked {link.from_type} lid {link.from_lid} port {link.from_port} "
            f"({link.from_name}): {link.width or '???'} {link.speed or '???'}"
        )
    return lines


# --------------------------------------------------------------------------------------
# ibswinfo
# --------------------------------------------------------------------------------------


@dataclass
class SwitchInfo:
    """``ibswinfo -d lid-N``: an unmanaged switch's inventory and vitals.

    ``fields`` holds every top-level ``key | value`` as printed; ``psus`` one dict per power
    supply (``index``, ``status`` and its indented sub-fields as printed, plus ``power_w``).
    ``fans_rpm`` maps fan number to rpm. ``uptime_s`` is ``96d-01:55:47`` in seconds.
    """

    title: str | None = None
    fields: dict[str, str] = field(default_factory=dict)
    psus: list[dict[str, str | int | None]] = field(default_factory=list)
    temperature_c: int | None = None
    max_temperature_c: int | None = None
    module_temperatures_c: dict[int, int] = field(default_factory=dict)
    fans_rpm: dict[int, int] = field(default_factory=dict)
    fan_status: str | None = None
    uptime_s: int | None = None
    gaps: list[Gap] = field(default_factory=list)


_SW_KV = re.compile(r"^(?P<indent>\s*)(?P<key>\S.*?)\s+(?P<sep>\||:)\s+(?P<value>.*?)\s*$")
_SW_SEPARATOR = re.compile(r"^\s*(?:-{5,}|={5,})\s*$")
_SW_PSU = re.compile(r"^PSU(?P<index>\d+) status$|^psu(?P<index2>\d+)\.(?P<sub>.+)$", re.I)
_SW_FAN = re.compile(r"^fan#(?P<index>\d+)(?:\.speed)? \(rpm\)$")
_SW_QSFP = re.compile(r"^QSFP#(?P<index>\d+)(?:\.temp)? \(C\)$")
_SW_UPTIME = re.compile(r"^(?P<d>\d+)d-(?P<h>\d+):(?P<m>\d+):(?P<s>\d+)$")


def _sw_int(value: str) -> int | None:
    return int(value) if re.fullmatch(r"-?\d+", value.strip()) else None


def _sw_uptime(key: str, value: str) -> int | None:
    match = _SW_UPTIME.match(value.strip())
    if match:
        return int(match["d"]) * 86400 + int(match["h"]) * 3600 + int(match["m"]) * 60 + int(match["s"])
    return _sw_int(value) if "sec" in key else None


def _psu(info: SwitchInfo, index: int) -> dict[str, str | int | None]:
    for psu in info.psus:
        if psu["index"] == index:
            return psu
    psu: dict[str, str | int | None] = {"index": index}
    info.psus.append(psu)
    return psu


def _sw_psu_field(psu: dict[str, str | int | None], key: str, value: str) -> None:
    psu[key] = value
    if "power" in key.lower() and "(w)" in key.lower():
        psu["power_w"] = _sw_int(value)


def _sw_top_field(info: SwitchInfo, key: str, value: str, number: int) -> None:
    """A top-level key: vitals get typed fields, everything stays in ``fields``."""
    info.fields[key] = value
    lowered = key.lower()
    fan = _SW_FAN.match(key)
    qsfp = _SW_QSFP.match(key)
    if fan:
        rpm = _sw_int(value)
        if rpm is None:
            info.gaps.append(Gap(f"fan #{fan['index']} rpm not a number: {clip(value, 40)!r}", number))
        else:
            info.fans_rpm[int(fan["index"])] = rpm
    elif qsfp:
        temperature = _sw_int(value)
        if temperature is not None:
            info.module_temperatures_c[int(qsfp["index"])] = temperature
    elif lowered in ("temperature (c)", "cur.temp (c)"):
        info.temperature_c = _sw_int(value)
    elif lowered in ("max temp (c)", "max.temp (c)"):
        info.max_temperature_c = _sw_int(value)
    elif lowered in ("fan status", "fans"):
        info.fan_status = value or None
    elif lowered.startswith("uptime"):
        info.uptime_s = _sw_uptime(lowered, value)


def parse_ibswinfo(source: LineSource) -> SwitchInfo:
    """Read ibswinfo's full report (``key | value``) and its ``-o`` forms (``key : value``).

    Indented lines after ``PSUn status`` belong to that power supply (their names, such as
    ``fan status``, repeat top-level names, so indentation is what tells them apart).
    """
    info = SwitchInfo()
    psu: dict[str, str | int | None] | None = None
    seen_title_rule = False
    for number, line in numbered_lines(source):
        if not line.strip():
            continue
        if _SW_SEPARATOR.match(line):
            seen_title_rule = seen_title_rule or line.strip().startswith("=")
            psu = None
            continue
        kv = _SW_KV.match(line)
        if not kv:
            if seen_title_rule and info.title is None and not info.fields:
                info.title = line.strip()
            else:
                info.gaps.append(Gap(f"not an ibswinfo line: {clip(line, 100)!r}", number))
            continue
        key, value = kv["key"], kv["value"]
        if kv["indent"] and psu is not None:
            _sw_psu_field(psu, key, value)
            continue
        psu_match = _SW_PSU.match(key)
        if psu_match and psu_match["index"] is not None:
            psu = _psu(info, int(psu_match["index"]))
            psu["status"] = value
            continue
        if psu_match and psu_match["index2"] is not None:  # ``-o`` form: psu0.status : OK
            _sw_psu_field(_psu(info, int(psu_match["index2"])), psu_match["sub"], value)
            continue
        psu = None
        _sw_top_field(info, key, value, number)
    if not info.fields and not info.psus:
        info.gaps.append(Gap("no ibswinfo fields found"))
    return info


def summarize_ibswinfo(info: SwitchInfo) -> list[str]:
    name = info.fields.get("part number") or info.fields.get("part_number") or "?"
    firmware = info.fields.get("firmware version") or info.fields.get("fw_version") or "?"
    lines = [
        f"switch {info.title or '?'} {name}, firmware {firmware}, uptime {info.uptime_s} s, "
        f"temperature {info.temperature_c} C (max {info.max_temperature_c} C), "
        f"{len(info.psus)} PSUs, {len(info.fans_rpm)} fans"
    ]
    for psu in info.psus:
        bad = {k: v for k, v in psu.items() if isinstance(v, str) and v.upper() == "ERROR"}
        if bad or str(psu.get("status", "OK")).upper() not in ("OK", ""):
            lines.append(f"  PSU{psu['index']}: {psu}")
    if info.fan_status and info.fan_status.upper() != "OK":
        lines.append(f"  fan status: {info.fan_status}")
    for fan, rpm in info.fans_rpm.items():
        if rpm == 0:
            lines.append(f"  fan #{fan} stopped (0 rpm)")
    return lines


# --------------------------------------------------------------------------------------
# Detection and registration
# --------------------------------------------------------------------------------------


def _nonblank(sample: str, limit: int = 400) -> list[str]:
    return [line for line in sample.splitlines()[:limit] if line.strip()]


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


def detect_perfquery(sample: str) -> float:
    if re.search(r"^#\s*[^:#\n]*counters:\s*(?:Lid|DR path|GUID)\b.*?(?:port \d+|all ports)", sample, re.M):
        return 0.95
    return 0.0


def detect_ibnetdiscover(sample: str) -> float:
    lines = _nonblank(sample)
    rows = sum(1 for line in lines if _LINK_ROW.match(line))
    if not rows:
        return 0.0
    linked = sum(1 for line in lines if " - " in line and _LINK_ROW.match(line))
    share = rows / len(lines)
    if share >= 0.8 and linked:
        return 0.9
    return 0.5 if share >= 0.5 else 0.2


def detect_ibswinfo(sample: str) -> float:
    if re.search(r"^PSU\d+ status\s+\|", sample, re.M) or re.search(r"^part number\s+\|", sample, re.M):
        return 0.9
    return 0.0


KIND_IBSTAT = register(
    Kind(
        name="ibstat",
        description="ibstat: InfiniBand/RoCE adapters and port states, rates, lids (any infiniband-diags)",
        command="ibstat",
        parse=parse_ibstat,
        detect=detect_ibstat,
        summarize=summarize_ibstat,
    )
)
KIND_IBSTATUS = register(
    Kind(
        name="ibstatus",
        description="ibstatus: per-port state, physical state, rate (4X HDR) and lids from sysfs",
        command="ibstatus",
        parse=parse_ibstatus,
        detect=detect_ibstatus,
        summarize=summarize_ibstat,
    )
)
KIND_IB_COUNTERS = register(
    Kind(
        name="ib-counters",
        description="InfiniBand sysfs port counters, hw_counters, port attributes "
        "(grep -H . capture or a copied /sys/class/infiniband tree)",
        command="grep -H . /sys/class/infiniband/*/ports/*/counters/*",
        parse=parse_counters,
        detect=detect_counters,
        summarize=summarize_counters,
        streaming=True,
        from_directory=render_sysfs_tree,
    )
)
KIND_PERFQUERY = register(
    Kind(
        name="perfquery",
        description="perfquery: IB port counters per LID/port (plain, -x extended, -E/-D details)",
        command="perfquery -x",
        parse=parse_perfquery,
        detect=detect_perfquery,
        summarize=summarize_perfquery,
        streaming=True,
    )
)
KIND_IBNETDISCOVER = register(
    Kind(
        name="ibnetdiscover",
        description="ibnetdiscover -p: fabric port rows, negotiated width/speed, degraded/unlinked ports",
        command="ibnetdiscover -p",
        parse=parse_ibnetdiscover_ports,
        detect=detect_ibnetdiscover,
        summarize=summarize_ibnetdiscover,
        streaming=True,
    )
)
KIND_IBSWINFO = register(
    Kind(
        name="ibswinfo",
        description="ibswinfo: unmanaged Mellanox switch inventory, PSUs, temperature, fans, uptime",
        command="ibswinfo -d {lid}",
        parse=parse_ibswinfo,
        detect=detect_ibswinfo,
        summarize=summarize_ibswinfo,
    )
)
KINDS: tuple[Kind, ...] = (
    KIND_IBSTAT, KIND_IBSTATUS, KIND_IB_COUNTERS, KIND_PERFQUERY, KIND_IBNETDISCOVER, KIND_IBSWINFO,
)

REMOTE_IBSTAT = register_remote(RemoteProbe(
    name="ibstat", filename="ibstat.txt", command="ibstat", kind="ibstat", order=40, max_bytes=4 << 20,
))
#: The spec's ``grep -H . /sys/class/infiniband/*/ports/*/counters/*``, with the sysfs root
#: movable for nodes whose host /sys is mounted elsewhere.
REMOTE_IB_COUNTERS = register_remote(RemoteProbe(
    name="ib-counters", filename="ib-counters.txt",
    command='grep -H . "${SPIKEOPS_SYSFS:-/sys}"/class/infiniband/*/ports/*/counters/*',
    kind="ib-counters", order=50, max_bytes=8 << 20,
))
