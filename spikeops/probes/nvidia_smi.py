"""``nvidia-smi`` in its five printed forms: ``-q`` text, ``-q -x`` XML, ``--query-*`` CSV,
the default table, and ``nvlink -s``.

A loss spike that a bad GPU caused leaves its trace here: uncorrectable ECC counts, a row
remap pending a reset, retired pages, a GPU slowed by heat or by the power brake, a fan
sensor reading ``ERR!``, an NVLink gone ``<inactive>``. Collectors capture whichever form
their node script ran, so all forms land in one vocabulary: ``parse_q``, ``parse_xml`` and
``parse_query_csv`` all give ``GpuStatus`` records with the same normalised field names, and
the diagnosis never needs to know which form a node produced.

Quirks handled on purpose (each seen in real output or in NVIDIA's own format history):

- ECC counters changed shape across generations. Pre-Ampere drivers print ``Single Bit`` /
  ``Double Bit`` sections split by memory (``Device Memory``, ``Register File``, ...,
  ``Total``); Ampere prints ``SRAM``/``DRAM`` ``Correctable``/``Uncorrectable``; Hopper
  drivers split ``SRAM Uncorrectable`` into ``Parity`` and ``SEC-DED``. ``EccCounts`` keeps
  every part and answers ``uncorrectable_total()`` the same way for all of them.
- ``Clocks Throttle Reasons`` was renamed ``Clocks Event Reasons`` (R535); ``Idle`` in the
  text is ``gpu_idle`` in the CSV. Reason names are normalised to the CSV's snake_case keys.
- ``T.Limit`` temperatures are margins to a limit, so ``-8 C`` is a real, signed value.
- On MIG, ``Remapped Rows`` prints ``N/A`` (None, not zero) and each ``MIG Device`` carries
  its own ``SRAM Uncorrectable``.
- The bus id is printed ``00000000:19:00.0`` by nvidia-smi but the kernel names the same GPU
  ``PCI:0000:19:00`` in Xid lines; ``normalise_bus_id`` gives both forms.
- People paste excerpts with ``[...]`` elisions, and files get cut: what is missing becomes
  a gap, never the GPU around it.
- XML may carry a DOCTYPE. nvidia-smi's own (an external DTD name) is harmless and ignored;
  an internal subset with ENTITY declarations is refused unexpanded (a billion-laughs file
  must not cost a node's memory).
"""

from __future__ import annotations

import csv
import re
import xml.etree.ElementTree as ET
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from datetime import datetime

from spikeops.probes.base import (
    RemoteProbe,
    register_remote,
    Gap,
    Kind,
    LineSource,
    clip,
    join_text,
    numbered_lines,
    register,
    to_number,
)
from spikeops.timeparse import parse_ctime, parse_iso

__all__ = [
    "REMOTE",
    "CLOCK_REASON_BITS",
    "EccCounts",
    "RetiredPages",
    "RemappedRows",
    "MigDevice",
    "GpuProcess",
    "SmiMessage",
    "GpuStatus",
    "NvidiaSmiReport",
    "CsvRow",
    "QueryCsv",
    "TableGpu",
    "NvidiaSmiTable",
    "NvlinkLink",
    "NvlinkGpu",
    "NvlinkStatus",
    "normalise_bus_id",
    "parse_q",
    "parse_xml",
    "parse_query_csv",
    "parse_table",
    "parse_nvlink_status",
    "detect_q",
    "detect_xml",
    "detect_csv",
    "detect_table",
    "detect_nvlink",
    "summarize_report",
    "summarize_csv",
    "summarize_table",
    "summarize_nvlink",
    "MAX_GAPS",
    "KIND_Q",
    "KIND_XML",
    "KIND_CSV",
    "KIND_TABLE",
    "KIND_NVLINK",
]

#: Gaps kept per parse; a garbage file must not turn into a million Gap objects.
MAX_GAPS = 1000

Scalar = str | int | float | None


# --------------------------------------------------------------------------- result types


@dataclass
class EccCounts:
    """One ECC counter set (volatile = since the last driver load/reset, aggregate = the
    GPU's lifetime, kept in the InfoROM), in whichever generation's shape it was printed.

    Fields a GPU did not print stay None (never 0): an A100 has no ``single_bit_total`` and
    a V100 has no ``dram_uncorrectable``.
    """

    sram_correctable: int | None = None
    #: ``SRAM Uncorrectable``, or the sum of its ``Parity`` and ``SEC-DED`` parts.
    sram_uncorrectable: int | None = None
    sram_uncorrectable_parity: int | None = None
    sram_uncorrectable_secded: int | None = None
    dram_correctable: int | None = None
    dram_uncorrectable: int | None = None
    sram_threshold_exceeded: bool | None = None
    #: Pre-Ampere ``Single Bit`` parts by snake_case name (``device_memory``, ``l1_cache``...).
    single_bit: dict[str, int | None] = field(default_factory=dict)
    double_bit: dict[str, int | None] = field(default_factory=dict)
    single_bit_total: int | None = None
    double_bit_total: int | None = None
    #: Hopper's ``Aggregate Uncorrectable SRAM Sources`` (``l2``, ``sm``, ``microcontroller``...).
    sram_uncorrectable_sources: dict[str, int | None] = field(default_factory=dict)

    def uncorrectable_total(self) -> int | None:
        """Uncorrectable (double-bit) errors however they were printed.

        When a form prints both the SRAM/DRAM split and the old total (the CSV does), the
        larger reading wins: undercounting an uncorrectable error is the costly mistake.
        """
        return _combine(
            [self.sram_uncorrectable, self.dram_uncorrectable],
            self.double_bit_total,
            self.double_bit,
        )

    def correctable_total(self) -> int | None:
        """Correctable (single-bit) errors however they were printed; see ``uncorrectable_total``."""
        return _combine(
            [self.sram_correctable, self.dram_correctable], self.single_bit_total, self.single_bit
        )


def _combine(split: list[int | None], total: int | None, parts: dict[str, int | None]) -> int | None:
    readings: list[int] = []
    known = [value for value in split if value is not None]
    if known:
        readings.append(sum(known))
    if total is not None:
        readings.append(total)
    elif any(value is not None for value in parts.values()):
        readings.append(sum(value for value in parts.values() if value is not None))
    return max(readings) if readings else None


@dataclass
class RetiredPages:
    """Pre-Ampere dynamic page retirement: pages taken out of service after ECC errors.
    On Ampere and later every value prints ``N/A`` (row remapping replaced it)."""

    single_bit: int | None = None
    double_bit: int | None = None
    #: ``Pending Page Blacklist`` (text) / ``pending_blacklist`` (XML): retirement waits for
    #: a reboot or driver reload.
    pending_blacklist: bool | None = None
    #: ``pending_retirement`` (XML, CSV ``retired_pages.pending``).
    pending_retirement: bool | None = None
    line: int | None = None

    @property
    def pending(self) -> bool | None:
        """True when any pending flag is set; None when none was printed."""
        flags = [flag for flag in (self.pending_blacklist, self.pending_retirement) if flag is not None]
        return any(flags) if flags else None


@dataclass
class RemappedRows:
    """Ampere+ row remapping: HBM rows replaced by spares after errors. ``pending`` means the
    GPU must be reset before the remap takes effect; ``failure`` means the spares ran out."""

    correctable: int | None = None
    uncorrectable: int | None = None
    pending: bool | None = None
    failure: bool | None = None
    #: ``Bank Remap Availability Histogram``: ``max``/``high``/``partial``/``low``/``none`` banks.
    histogram: dict[str, int | None] = field(default_factory=dict)
    line: int | None = None


@dataclass
class MigDevice:
    """One MIG instance as ``nvidia-smi -q`` lists it under its parent GPU."""

    index: int | None = None
    gpu_instance_id: int | None = None
    compute_instance_id: int | None = None
    #: The instance's own volatile ``SRAM Uncorrectable`` count.
    sram_uncorrectable: int | None = None
    memory_used_mib: int | None = None
    memory_total_mib: int | None = None
    line: int | None = None


@dataclass
class GpuProcess:
    """A process holding GPU memory; ``gpu_index`` is set where the form names the GPU by
    index (the table), otherwise the process belongs to the GpuStatus it is listed under."""

    pid: int | None = None
    name: str | None = None
    used_memory_mib: int | None = None
    type: str | None = None
    gpu_instance_id: int | None = None
    compute_instance_id: int | None = None
    gpu_index: int | None = None
    gpu_bus_id: str | None = None
    line: int | None = None


@dataclass
class SmiMessage:
    """nvidia-smi reporting its own failure (``Failed to initialize NVML``, ``Unable to
    determine the device handle for GPU ...: Unknown Error``, ``GPU is lost``): a GPU that
    fell off the bus often shows up only this way, so these are evidence, not noise."""

    text: str
    line: int | None = None


@dataclass
class GpuStatus:
    """One GPU's health as nvidia-smi reported it, the same fields from -q, XML and CSV."""

    #: Position in the output (nvidia-smi lists GPUs in index order), or the CSV ``index``.
    index: int | None = None
    #: As nvidia-smi prints it: ``00000000:19:00.0`` (upper-case hex, 8-digit domain).
    bus_id: str | None = None
    #: As the kernel prints it in Xid lines: ``0000:19:00`` (lower-case, no function).
    pci: str | None = None
    product: str | None = None
    uuid: str | None = None
    serial: str | None = None
    minor_number: int | None = None
    ecc_mode: str | None = None
    ecc_volatile: EccCounts | None = None
    ecc_aggregate: EccCounts | None = None
    #: Yes/No ECC flags printed beside the counters (``channel_repair_pending``,
    #: ``tpc_repair_pending``, ``unrepairable_memory``).
    ecc_flags: dict[str, bool | None] = field(default_factory=dict)
    retired_pages: RetiredPages | None = None
    remapped_rows: RemappedRows | None = None
    #: Reason (CSV snake_case: ``gpu_idle``, ``sw_power_cap``, ``hw_slowdown``,
    #: ``hw_thermal_slowdown``, ``hw_power_brake_slowdown``, ``sw_thermal_slowdown``,
    #: ``sync_boost``, ``applications_clocks_setting``, ``display_clock_setting``) -> Active.
    clock_event_reasons: dict[str, bool | None] = field(default_factory=dict)
    #: Microseconds spent in each reason since driver load (R550+), same keys.
    clock_event_counters_us: dict[str, int | None] = field(default_factory=dict)
    temperature_c: int | float | None = None
    memory_temperature_c: int | float | None = None
    #: ``shutdown``, ``slowdown``, ``max_operating``, ``target``, ``memory_max_operating``;
    #: on T.Limit GPUs ``tlimit`` (current headroom) and ``*_tlimit`` (signed margins).
    temperature_thresholds: dict[str, int | float | None] = field(default_factory=dict)
    #: ``Power Draw``, else ``Average Power Draw``, else ``Instantaneous Power Draw``.
    power_draw_w: float | None = None
    power_draw_instant_w: float | None = None
    #: The limit in force (``Current``/``Enforced Power Limit``).
    power_limit_w: float | None = None
    performance_state: str | None = None
    pcie_replays: int | None = None
    fan_speed_pct: int | float | None = None
    memory_used_mib: int | None = None
    memory_total_mib: int | None = None
    utilization_gpu_pct: int | float | None = None
    mig_mode: str | None = None
    mig_devices: list[MigDevice] = field(default_factory=list)
    processes: list[GpuProcess] = field(default_factory=list)
    line: int | None = None

    @property
    def thermal_throttling(self) -> bool | None:
        """Clocks cut for temperature (HW or SW thermal slowdown); None when not reported."""
        return _any_reason(self.clock_event_reasons, ("hw_thermal_slowdown", "sw_thermal_slowdown"))

    @property
    def power_throttling(self) -> bool | None:
        """Clocks cut for power (software power cap or the hardware power brake)."""
        return _any_reason(self.clock_event_reasons, ("sw_power_cap", "hw_power_brake_slowdown"))

    def uncorrectable_ecc(self) -> int | None:
        """The larger of the volatile and aggregate uncorrectable totals."""
        return _max_known(
            ecc.uncorrectable_total() for ecc in (self.ecc_volatile, self.ecc_aggregate) if ecc
        )

    def correctable_ecc(self) -> int | None:
        return _max_known(
            ecc.correctable_total() for ecc in (self.ecc_volatile, self.ecc_aggregate) if ecc
        )


def _any_reason(reasons: dict[str, bool | None], names: tuple[str, ...]) -> bool | None:
    known = [reasons[name] for name in names if reasons.get(name) is not None]
    return any(known) if known else None


def _max_known(values: Iterable[int | None]) -> int | None:
    known = [value for value in values if value is not None]
    return max(known) if known else None


@dataclass
class NvidiaSmiReport:
    """``nvidia-smi -q`` (text) or ``nvidia-smi -q -x`` (XML), read into one shape."""

    timestamp: datetime | None = None
    driver_version: str | None = None
    cuda_version: str | None = None
    attached_gpus: int | None = None
    gpus: list[GpuStatus] = field(default_factory=list)
    errors: list[SmiMessage] = field(default_factory=list)
    gaps: list[Gap] = field(default_factory=list)

    def gpu_by_pci(self, address: str) -> GpuStatus | None:
        """The GPU at a bus address in any spelling (``0000:19:00``, ``00000000:19:00.0``)."""
        wanted = normalise_bus_id(address)
        if wanted is None:
            return None
        return next((gpu for gpu in self.gpus if gpu.pci == wanted[1]), None)


@dataclass
class CsvRow:
    """One data line of a ``--query-*`` CSV. ``cells`` are positional (always kept);
    ``values`` are keyed by field name without unit (empty when there was no header)."""

    line: int
    cells: list[Scalar] = field(default_factory=list)
    values: dict[str, Scalar] = field(default_factory=dict)
    timestamp: datetime | None = None
    #: Fields that printed a failure state in brackets (``[GPU is lost]``, ``[Unknown Error]``).
    problems: dict[str, str] = field(default_factory=dict)


@dataclass
class QueryCsv:
    """``nvidia-smi --query-{gpu,retired-pages,remapped-rows,compute-apps}=... --format=csv``."""

    #: ``gpu``, ``retired-pages``, ``remapped-rows``, ``compute-apps`` or ``unknown``.
    query: str = "unknown"
    columns: list[str] = field(default_factory=list)
    units: dict[str, str] = field(default_factory=dict)
    rows: list[CsvRow] = field(default_factory=list)
    #: One normalised GpuStatus per row, for per-GPU queries (``gpu``, ``remapped-rows``).
    gpus: list[GpuStatus] = field(default_factory=list)
    processes: list[GpuProcess] = field(default_factory=list)
    errors: list[SmiMessage] = field(default_factory=list)
    gaps: list[Gap] = field(default_factory=list)


@dataclass
class TableGpu:
    """One GPU block of the default ``nvidia-smi`` table."""

    index: int
    name: str
    #: The table cuts long names to ``NVIDIA GeForce ...``; match on bus_id instead.
    name_truncated: bool = False
    bus_id: str | None = None
    pci: str | None = None
    persistence: str | None = None
    display_active: str | None = None
    volatile_uncorrected_ecc: int | None = None
    fan_pct: int | float | None = None
    #: The fan column printed ``ERR!``: the fan or its tachometer failed.
    fan_error: bool = False
    temperature_c: int | float | None = None
    performance_state: str | None = None
    power_draw_w: float | None = None
    power_cap_w: float | None = None
    memory_used_mib: int | None = None
    memory_total_mib: int | None = None
    utilization_gpu_pct: int | float | None = None
    compute_mode: str | None = None
    mig_mode: str | None = None
    #: Every column that printed ``ERR!`` (``fan``, ``temperature``, ``power``...).
    err_columns: list[str] = field(default_factory=list)
    line: int = 0


@dataclass
class NvidiaSmiTable:
    """The default ``nvidia-smi`` output (both the <=525 and the 530+ layouts)."""

    timestamp: datetime | None = None
    smi_version: str | None = None
    driver_version: str | None = None
    cuda_version: str | None = None
    gpus: list[TableGpu] = field(default_factory=list)
    processes: list[GpuProcess] = field(default_factory=list)
    errors: list[SmiMessage] = field(default_factory=list)
    gaps: list[Gap] = field(default_factory=list)


@dataclass
class NvlinkLink:
    """One NVLink: its speed, ``<inactive>``, or (``nvlink -e``) its error counters."""

    link: int
    speed_gbps: float | None = None
    active: bool | None = None
    counters: dict[str, int | None] = field(default_factory=dict)
    raw: str = ""
    line: int = 0


@dataclass
class NvlinkGpu:
    index: int
    name: str | None = None
    uuid: str | None = None
    links: list[NvlinkLink] = field(default_factory=list)
    line: int = 0

    def inactive_links(self) -> list[int]:
        return [link.link for link in self.links if link.active is False]


@dataclass
class NvlinkStatus:
    """``nvidia-smi nvlink -s`` (``--status``); ``nvlink -e`` counters fit the same shape."""

    gpus: list[NvlinkGpu] = field(default_factory=list)
    errors: list[SmiMessage] = field(default_factory=list)
    gaps: list[Gap] = field(default_factory=list)


# --------------------------------------------------------------------------- small helpers


class _Gaps:
    """Collects gaps up to ``MAX_GAPS`` and counts the rest, so garbage costs bounded memory."""

    def __init__(self, into: list[Gap]) -> None:
        self.into = into
        self.dropped = 0

    def add(self, reason: str, line: int | None = None) -> None:
        if len(self.into) < MAX_GAPS:
            self.into.append(Gap(reason, line))
        else:
            self.dropped += 1

    def close(self) -> None:
        if self.dropped:
            self.into.append(Gap(f"{self.dropped} more unreadable parts not listed"))
            self.dropped = 0


_MAX_NUMBER_TEXT = 64

_NOT_A_VALUE = {"", "n/a", "[n/a]", "na", "not supported", "[not supported]", "unknown"}

#: Messages nvidia-smi prints about itself when it cannot talk to the driver or a GPU.
_SMI_ERROR = re.compile(
    r"^\s*(?:Failed to initialize NVML|NVIDIA-SMI has failed|Unable to determine the device handle"
    r"|No devices were found|Unable to (?:query|get|retrieve)|Unable to determine|GPU is lost"
    r"|NVML: |Error: |Driver/library version mismatch)",
    re.I,
)

_ELISION = re.compile(r"^\s*(?:\[\s*(?:\.\.\.+|…)\s*\]|\.\.\.+|…)\s*$")

_MEASURE = re.compile(
    r"^(?P<number>[+-]?(?:\d[\d,]*(?:\.\d*)?|\.\d+))\s*"
    r"(?:MiB|GiB|KiB|MB|GB|KB|KB/s|MB/s|GB/s|W|mW|%|C|F|MHz|GHz|us|ms|s|mV|V|x|bank\(s\)|RPM)?$"
)


def _text(value: str | None) -> str | None:
    """A printed string value; ``N/A`` and friends are None (never a fake value)."""
    if value is None:
        return None
    value = value.strip()
    return None if value.lower() in _NOT_A_VALUE else value


def _measure(value: str | None) -> int | float | None:
    """A number with or without its unit (``629.45 W``, ``59C``, ``2560 bank(s)``, ``-8 C``).

    Over-long digit runs are refused before ``int()`` sees them: Python will not convert a
    decimal string past 4300 digits and a garbage line must not raise."""
    if value is None:
        return None
    value = value.strip()
    if len(value) > _MAX_NUMBER_TEXT:
        return None
    number = to_number(value)
    if number is not None:
        return number
    match = _MEASURE.match(value)
    return to_number(match["number"]) if match else None


def _count(value: str | None) -> int | None:
    """A counter: an integer, or None (a counter printed as ``1.5`` is not a counter)."""
    number = _measure(value)
    if isinstance(number, float):
        return int(number) if number.is_integer() else None
    return number


def _float(value: str | None) -> float | None:
    number = _measure(value)
    return None if number is None else float(number)


def _flag(value: str | None) -> bool | None:
    """Yes/No, Active/Not Active, Enabled/Disabled, True/False, 1/0 (``--query-remapped-rows``
    prints 0/1 where ``--query-gpu`` prints No/Yes); anything else is None."""
    if value is None:
        return None
    word = " ".join(value.strip().lower().split())
    if word in ("yes", "active", "enabled", "true", "on", "1"):
        return True
    if word in ("no", "not active", "disabled", "false", "off", "0"):
        return False
    return None


def _snake(name: str) -> str:
    return re.sub(r"[^a-z0-9]+", "_", name.lower()).strip("_")


def _norm(key: str) -> str:
    low = key.lower()
    # the common case, one call per line of a 2,000-line report: printable (no tab, no other
    # whitespace than spaces), single-spaced and trimmed, so split and join would not change it
    if low.isprintable() and "  " not in low and low[:1] != " " and low[-1:] != " ":
        return low
    return " ".join(low.split())


_BUS_ID = re.compile(
    r"^(?:PCI:)?(?:(?P<domain>[0-9A-Fa-f]{1,8}):)?(?P<bus>[0-9A-Fa-f]{1,2}):"
    r"(?P<device>[0-9A-Fa-f]{1,2})(?:\.(?P<function>[0-7]))?$"
)


def normalise_bus_id(text: str | None) -> tuple[str, str] | None:
    """``(bus_id, pci)`` for any spelling of a PCI address, or None when it is not one.

    ``bus_id`` is nvidia-smi's ``00000000:19:00.0`` and ``pci`` the kernel's ``0000:19:00``
    (what Xid lines print), so evidence from the two tools can be joined on ``pci``.
    """
    if text is None:
        return None
    match = _BUS_ID.match(text.strip())
    if not match:
        return None
    domain = int(match["domain"] or "0", 16)
    bus, device = int(match["bus"], 16), int(match["device"], 16)
    function = int(match["function"] or "0")
    return f"{domain:08X}:{bus:02X}:{device:02X}.{function}", f"{domain:04x}:{bus:02x}:{device:02x}"


def _set_bus(gpu: GpuStatus, text: str | None) -> None:
    ids = normalise_bus_id(text)
    if ids:
        gpu.bus_id, gpu.pci = ids


def _smi_time(text: str | None) -> datetime | None:
    """nvidia-smi's ``Wed Jun  7 19:32:16 2023`` (-q, XML, table) or the CSV's
    ``2026/07/14 08:12:53.353`` (node-local and zone-less: UTC per the bundle spec)."""
    if not text:
        return None
    text = text.strip()
    return parse_ctime(text) or parse_iso(text.replace("/", "-"))


def _finish_ecc(ecc: EccCounts) -> EccCounts:
    """Hopper splits SRAM uncorrectable in two; keep both parts and give the sum too."""
    if ecc.sram_uncorrectable is None:
        parts = [p for p in (ecc.sram_uncorrectable_parity, ecc.sram_uncorrectable_secded) if p is not None]
        if parts:
            ecc.sram_uncorrectable = sum(parts)
    return ecc


_ECC_SPLIT_FIELDS = {
    "sram_correctable",
    "sram_uncorrectable",
    "sram_uncorrectable_parity",
    "sram_uncorrectable_secded",
    "dram_correctable",
    "dram_uncorrectable",
}
_ECC_PART_ALIASES = {"texture_shm": "texture_shared"}
_SRAM_SOURCE_ALIASES = {"mcu": "microcontroller"}


def _set_ecc_field(ecc: EccCounts, name: str, value: str | None) -> bool:
    """Set one normalised ECC field; False when the name is not an ECC counter."""
    if name in _ECC_SPLIT_FIELDS:
        setattr(ecc, name, _count(value))
        return True
    if name == "sram_threshold_exceeded":
        ecc.sram_threshold_exceeded = _flag(value)
        return True
    return False


def _set_bit_part(ecc: EccCounts, single: bool, name: str, value: str | None) -> None:
    name = _ECC_PART_ALIASES.get(name, name)
    if name == "total":
        if single:
            ecc.single_bit_total = _count(value)
        else:
            ecc.double_bit_total = _count(value)
    else:
        (ecc.single_bit if single else ecc.double_bit)[name] = _count(value)


_REASON_ALIASES = {
    "idle": "gpu_idle",
    "display_clocks_setting": "display_clock_setting",
    "sw_power_capping": "sw_power_cap",
    "hw_power_braking": "hw_power_brake_slowdown",
    "hw_power_brake": "hw_power_brake_slowdown",
}


def _reason_key(name: str) -> str:
    """One name per clock event reason across text, XML and CSV spellings."""
    key = _snake(name)
    key = re.sub(r"^clocks?_(?:event|throttle)_reasons?(?:_counters?)?_", "", key)
    return _REASON_ALIASES.get(key, key)


#: NVML's clocks event reason bits (nvml.h ``nvmlClocksEventReason*``), for the CSV's
#: ``clocks_event_reasons.active`` mask and the NVML probe.
CLOCK_REASON_BITS = {
    "gpu_idle": 0x1,
    "applications_clocks_setting": 0x2,
    "sw_power_cap": 0x4,
    "hw_slowdown": 0x8,
    "sync_boost": 0x10,
    "sw_thermal_slowdown": 0x20,
    "hw_thermal_slowdown": 0x40,
    "hw_power_brake_slowdown": 0x80,
    "display_clock_setting": 0x100,
}

_REASON_LABELS = {
    "gpu_idle": "Idle",
    "applications_clocks_setting": "Applications Clocks Setting",
    "sw_power_cap": "SW Power Cap",
    "hw_slowdown": "HW Slowdown",
    "hw_thermal_slowdown": "HW Thermal Slowdown",
    "hw_power_brake_slowdown": "HW Power Brake Slowdown",
    "sw_thermal_slowdown": "SW Thermal Slowdown",
    "sync_boost": "Sync Boost",
    "display_clock_setting": "Display Clock Setting",
}
#: Reasons that mean the job is being slowed by the hardware's condition, not by policy.
_SLOWDOWN_REASONS = (
    "hw_slowdown",
    "hw_thermal_slowdown",
    "hw_power_brake_slowdown",
    "sw_thermal_slowdown",
    "sw_power_cap",
)


def _temp_key(label: str) -> str:
    """``GPU Shutdown T.Limit Temp`` -> ``shutdown_tlimit``; ``GPU T.Limit Temp`` -> ``tlimit``."""
    text = _norm(label).replace("t.limit", "tlimit")
    text = re.sub(r"^gpu\s+", "", text)
    text = re.sub(r"\s+(?:temp|temperature)$", "", text)
    return _snake(text)


# --------------------------------------------------------------------------- -q text


@dataclass(slots=True)
class _Node:
    """A line of ``-q`` text and the lines indented under it."""

    key: str
    value: str | None
    line: int
    indent: int
    children: list[_Node] = field(default_factory=list)
    #: The normalised key, computed once: lookups by name are the parser's hot loop.
    name: str = field(init=False)

    def __post_init__(self) -> None:
        self.name = _norm(self.key)

    def child(self, *names: str) -> _Node | None:
        for node in self.children:
            if node.name in names:
                return node
        return None

    def all(self, *names: str) -> Iterator[_Node]:
        return (node for node in self.children if node.name in names)

    def get(self, *path: str) -> str | None:
        node: _Node | None = self
        for name in path:
            node = node.child(name) if node else None
        return node.value if node else None

    def walk(self) -> Iterator[_Node]:
        stack = list(reversed(self.children))
        while stack:
            node = stack.pop()
            yield node
            stack.extend(reversed(node.children))


_GPU_HEADER = re.compile(r"^GPU\s+(?P<bus>[0-9A-Fa-f]{4,8}:[0-9A-Fa-f]{2}:[0-9A-Fa-f]{2}\.[0-7])\s*$")
_BANNER = re.compile(r"^=+\s*NVSMI LOG\s*=+\s*$")
_KEY_OK = re.compile(r"^[A-Za-z0-9][A-Za-z0-9 ._\-/()+#,&'%]*$")
_HEADER_KEYS = {"timestamp", "driver version", "cuda version", "attached gpus"}


def _split_line(line: str) -> tuple[int, str, str | None]:
    """(indent, key, value or None) of one ``-q`` line; keys never contain a colon."""
    expanded = line.expandtabs(8) if "\t" in line else line
    body = expanded.lstrip(" ")
    indent = len(expanded) - len(body)
    key, sep, value = body.partition(":")
    return indent, key.strip(), (value.strip() if sep else None)


class _QReader:
    """Builds one indentation tree per ``GPU <bus id>`` section, line by line.

    Top-level lines never own indented lines: an author's ``[...]`` or a stray line at
    column 0 in the middle of a GPU section becomes a gap, and the section goes on.
    """

    def __init__(self) -> None:
        self.report = NvidiaSmiReport()
        self.gaps = _Gaps(self.report.gaps)
        self.sections: list[_Node] = []
        self.stack: list[_Node] = []
        self.snapshot_start = 1
        self.last: _Node | None = None

    def new_snapshot(self, number: int) -> None:
        """``nvidia-smi -q -l N`` repeats the whole log; the latest snapshot is the state."""
        kept_errors = self.report.errors
        self.report.gaps.append(
            Gap(
                f"earlier snapshot (lines {self.snapshot_start}-{number - 1}) replaced by a later one",
                number,
            )
        )
        gaps = self.report.gaps
        self.report = NvidiaSmiReport(gaps=gaps, errors=kept_errors)
        self.gaps.into = gaps
        self.sections, self.stack, self.snapshot_start = [], [], number

    def top_level(self, number: int, line: str) -> None:
        stripped = line.strip()
        if _BANNER.match(stripped):
            if self.sections:
                self.new_snapshot(number)
            return
        header = _GPU_HEADER.match(stripped)
        if header:
            node = _Node(header["bus"], None, number, 0)
            self.sections.append(node)
            self.stack = [node]
            self.last = node
            return
        if _SMI_ERROR.match(stripped):
            self.report.errors.append(SmiMessage(clip(stripped), number))
            return
        _indent, key, value = _split_line(line)
        name = _norm(key)
        if value is not None and name in _HEADER_KEYS:
            if name == "timestamp" and self.sections:
                self.new_snapshot(number)
            self.header(name, value, number)
            return
        if _ELISION.match(stripped):
            self.gaps.add("elided in the source ([...]): the lines left out are not known", number)
            return
        if self.sections:
            self.gaps.add(f"unexpected line outside the GPU's fields: {clip(stripped, 80)!r}", number)
        # Before the first GPU: top-level keys and sections we do not model (vGPU
        # capability, HIC info) are skipped together with their indented lines.

    def header(self, name: str, value: str, number: int) -> None:
        if name == "timestamp":
            self.report.timestamp = _smi_time(value)
            if self.report.timestamp is None and _text(value):
                self.gaps.add(f"timestamp not understood: {clip(value, 60)!r}", number)
        elif name == "driver version":
            self.report.driver_version = _text(value)
        elif name == "cuda version":
            self.report.cuda_version = _text(value)
        elif name == "attached gpus":
            self.report.attached_gpus = _count(value)

    def indented(self, number: int, line: str) -> None:
        if not self.stack:
            return  # part of a top-level section before the first GPU
        stripped = line.strip()
        if stripped[0] in "[.…" and _ELISION.match(stripped):
            self.gaps.add("elided in the source ([...]): the lines left out are not known", number)
            return
        indent, key, value = _split_line(line)
        if not _KEY_OK.match(key):
            if _SMI_ERROR.match(stripped):
                self.report.errors.append(SmiMessage(clip(stripped), number))
            else:
                self.gaps.add(f"not an nvidia-smi -q line: {clip(stripped, 80)!r}", number)
            return
        if value is None and indent % 2:
            # A section header at an odd indent cannot be placed; adopting the lines
            # under it would hide them from the section they belong to.
            self.gaps.add(f"misindented section header: {clip(stripped, 80)!r}", number)
            return
        while len(self.stack) > 1 and self.stack[-1].indent >= indent:
            self.stack.pop()
        node = _Node(key, value, number, indent)
        self.stack[-1].children.append(node)
        self.stack.append(node)
        self.last = node

    def feed(self, lines: Iterable[tuple[int, str]]) -> None:
        for number, line in lines:
            if not line.strip():
                continue
            if line[0] in " \t":
                self.indented(number, line)
            else:
                self.top_level(number, line)

    def finish(self) -> NvidiaSmiReport:
        report = self.report
        for index, section in enumerate(self.sections):
            report.gpus.append(_gpu_from_node(section, index, self.gaps))
        last = self.last
        if last is not None and last.value is None and not last.children and last.indent > 0:
            self.gaps.add(f"output ends at a section header {last.key!r} (cut short?)", last.line)
        if report.attached_gpus is not None and report.gpus and len(report.gpus) < report.attached_gpus:
            self.gaps.add(
                f"{len(report.gpus)} of {report.attached_gpus} attached GPUs in the output "
                "(cut short, elided, or queried with -i)"
            )
        if not report.gpus and report.driver_version is None and not report.errors:
            self.gaps.add("no nvidia-smi -q content found")
        self.gaps.close()
        return report


def parse_q(source: LineSource) -> NvidiaSmiReport:
    """Read ``nvidia-smi -q`` (any ``-d`` selection, any driver since the R4xx era)."""
    reader = _QReader()
    reader.feed(numbered_lines(source))
    return reader.finish()


def _gpu_from_node(section: _Node, index: int, gaps: _Gaps) -> GpuStatus:
    gpu = GpuStatus(index=index, line=section.line)
    _set_bus(gpu, section.key)
    gpu.product = _text(section.get("product name"))
    gpu.uuid = _text(section.get("gpu uuid"))
    gpu.serial = _text(section.get("serial number"))
    gpu.minor_number = _count(section.get("minor number"))
    gpu.performance_state = _text(section.get("performance state"))
    gpu.fan_speed_pct = _measure(section.get("fan speed"))
    gpu.ecc_mode = _text(section.get("ecc mode", "current"))
    gpu.mig_mode = _text(section.get("mig mode", "current"))
    gpu.pcie_replays = _count(section.get("pci", "replays since reset"))
    gpu.memory_used_mib = _count(section.get("fb memory usage", "used"))
    gpu.memory_total_mib = _count(section.get("fb memory usage", "total"))
    gpu.utilization_gpu_pct = _measure(section.get("utilization", "gpu"))
    ecc = section.child("ecc errors")
    if ecc is not None:
        _ecc_from_node(gpu, ecc)
    retired = section.child("retired pages")
    if retired is not None:
        gpu.retired_pages = _retired_from_node(retired)
    remapped = section.child("remapped rows")
    if remapped is not None:
        gpu.remapped_rows = _remapped_from_node(remapped)
    reasons = section.child("clocks event reasons", "clocks throttle reasons")
    if reasons is not None:
        gpu.clock_event_reasons = {
            _reason_key(node.key): _flag(node.value) for node in reasons.walk() if node.value is not None
        }
    counters = section.child("clocks event reasons counters", "clocks throttle reasons counters")
    if counters is not None:
        gpu.clock_event_counters_us = {
            _reason_key(node.key): _count(node.value) for node in counters.walk() if node.value is not None
        }
    temperature = section.child("temperature")
    if temperature is not None:
        _temperature_from_node(gpu, temperature)
    power = section.child("gpu power readings", "power readings")
    if power is not None:
        _power_from_pairs(gpu, ((node.name, node.value) for node in power.children))
    gpu.mig_devices = [_mig_from_node(node) for node in _mig_nodes(section)]
    processes = section.child("processes")
    if processes is not None:
        gpu.processes = _processes_from_node(processes, gaps)
    return gpu


def _ecc_from_node(gpu: GpuStatus, node: _Node) -> None:
    for part in node.children:
        if part.name in ("volatile", "aggregate"):
            counts = _ecc_counts_from_node(part)
            if part.name == "volatile":
                gpu.ecc_volatile = counts
            else:
                gpu.ecc_aggregate = counts
        elif part.name == "aggregate uncorrectable sram sources":
            target = gpu.ecc_aggregate or EccCounts()
            gpu.ecc_aggregate = target
            for source in part.children:
                key = _snake(re.sub(r"(?i)^sram\s+", "", source.key))
                target.sram_uncorrectable_sources[_SRAM_SOURCE_ALIASES.get(key, key)] = _count(source.value)
        elif part.value is not None and _flag(part.value) is not None:
            gpu.ecc_flags[_snake(part.key)] = _flag(part.value)


_ECC_TEXT_KEYS = {
    "sram correctable": "sram_correctable",
    "sram uncorrectable": "sram_uncorrectable",
    "sram uncorrectable parity": "sram_uncorrectable_parity",
    "sram uncorrectable sec-ded": "sram_uncorrectable_secded",
    "dram correctable": "dram_correctable",
    "dram uncorrectable": "dram_uncorrectable",
    "sram threshold exceeded": "sram_threshold_exceeded",
}


def _ecc_counts_from_node(node: _Node) -> EccCounts:
    ecc = EccCounts()
    for item in node.children:
        if item.name in ("single bit", "double bit"):
            for part in item.children:
                _set_bit_part(ecc, item.name == "single bit", _snake(part.key), part.value)
        elif item.name in _ECC_TEXT_KEYS:
            _set_ecc_field(ecc, _ECC_TEXT_KEYS[item.name], item.value)
    return _finish_ecc(ecc)


def _retired_from_node(node: _Node) -> RetiredPages:
    pages = RetiredPages(line=node.line)
    for item in node.children:
        if item.name.startswith("single bit"):
            pages.single_bit = _count(item.value)
        elif item.name.startswith("double bit"):
            pages.double_bit = _count(item.value)
        elif item.name.startswith("pending"):
            if "retirement" in item.name:
                pages.pending_retirement = _flag(item.value)
            else:
                pages.pending_blacklist = _flag(item.value)
    return pages


def _remapped_from_node(node: _Node) -> RemappedRows | None:
    if node.value is not None and not node.children:
        return None  # ``Remapped Rows : N/A`` (MIG, pre-Ampere)
    rows = RemappedRows(line=node.line)
    for item in node.children:
        if item.name.startswith("correctable"):
            rows.correctable = _count(item.value)
        elif item.name.startswith("uncorrectable"):
            rows.uncorrectable = _count(item.value)
        elif item.name == "pending":
            rows.pending = _flag(item.value)
        elif item.name.startswith("remapping failure"):
            rows.failure = _flag(item.value)
        elif item.name.startswith("bank remap availability"):
            rows.histogram = {_snake(bank.key): _count(bank.value) for bank in item.children}
    return rows


def _temperature_from_node(gpu: GpuStatus, node: _Node) -> None:
    for item in node.children:
        if item.value is None:
            continue
        key = _temp_key(item.key)
        if key == "current":
            gpu.temperature_c = _measure(item.value)
        elif key == "memory_current":
            gpu.memory_temperature_c = _measure(item.value)
        else:
            gpu.temperature_thresholds[key] = _measure(item.value)


def _power_from_pairs(gpu: GpuStatus, pairs: Iterable[tuple[str, str | None]]) -> None:
    """Power readings under any of their names (text label or XML tag, normalised)."""
    readings: dict[str, float | None] = {}
    for name, value in pairs:
        readings[_snake(name)] = _float(value)

    def first(*names: str) -> float | None:
        return next((readings[n] for n in names if readings.get(n) is not None), None)

    gpu.power_draw_w = first(
        "power_draw", "average_power_draw", "instantaneous_power_draw", "instant_power_draw"
    )
    gpu.power_draw_instant_w = first("instantaneous_power_draw", "instant_power_draw")
    gpu.power_limit_w = first("current_power_limit", "enforced_power_limit", "power_limit")


def _mig_nodes(section: _Node) -> Iterator[_Node]:
    for node in section.children:
        if node.name == "mig device":
            yield node
        elif node.name == "mig devices":
            yield from node.all("mig device")


def _mig_from_node(node: _Node) -> MigDevice:
    memory = node.child("shared fb memory usage", "fb memory usage")
    return MigDevice(
        index=_count(node.get("index")),
        gpu_instance_id=_count(node.get("gpu instance id")),
        compute_instance_id=_count(node.get("compute instance id")),
        sram_uncorrectable=_count(node.get("ecc errors", "volatile", "sram uncorrectable")),
        memory_used_mib=_count(memory.get("used")) if memory else None,
        memory_total_mib=_count(memory.get("total")) if memory else None,
        line=node.line,
    )


def _processes_from_node(node: _Node, gaps: _Gaps) -> list[GpuProcess]:
    """R510+ prints ``GPU instance ID`` and ``Compute instance ID`` as siblings *before*
    each ``Process ID`` (whose own fields are indented under it); older drivers print
    ``Process ID`` alone. Both come out as one GpuProcess per ``Process ID``."""
    processes: list[GpuProcess] = []
    pending: dict[str, int | None] = {}
    for item in node.children:
        if item.name == "gpu instance id":
            pending["gi"] = _count(item.value)
        elif item.name == "compute instance id":
            pending["ci"] = _count(item.value)
        elif item.name == "process id":
            process = GpuProcess(
                pid=_count(item.value),
                gpu_instance_id=pending.get("gi"),
                compute_instance_id=pending.get("ci"),
                line=item.line,
            )
            process.type = _text(item.get("type"))
            process.name = _text(item.get("name"))
            process.used_memory_mib = _count(item.get("used gpu memory"))
            if process.pid is None:
                gaps.add(f"process without a readable pid: {item.value!r}", item.line)
            processes.append(process)
            pending = {}
    return processes


# --------------------------------------------------------------------------- -q -x XML


_DOCTYPE = re.compile(r"<!DOCTYPE\b")
_PLAIN_DOCTYPE = re.compile(
    r"<!DOCTYPE\s+[\w.:-]+(?:\s+(?:SYSTEM|PUBLIC)(?:\s+(?:\"[^\"]*\"|'[^']*'))+)?\s*>"
)


def _blank(text: str) -> str:
    """Keep the newlines of removed text so error positions still point at the right line."""
    return "\n" * text.count("\n")


def _neutralise_doctype(text: str, gaps: _Gaps) -> str:
    """Drop the DOCTYPE before parsing. nvidia-smi's own names an external DTD that is never
    fetched; one with an internal subset may declare entities, which are refused, not
    expanded (their references then fail to parse and become a gap)."""
    match = _DOCTYPE.search(text)
    if match is None:
        if "<!ENTITY" in text:
            line = text[: text.find("<!ENTITY")].count("\n") + 1
            gaps.add("ENTITY declaration outside a DOCTYPE: refused", line)
        return text
    start = match.start()
    line = text[:start].count("\n") + 1
    plain = _PLAIN_DOCTYPE.match(text, start)
    if plain:
        end = plain.end()
    else:
        gaps.add("DOCTYPE with an internal subset (entity declarations) refused, not expanded", line)
        closing = re.compile(r"\]\s*>").search(text, start)
        end = closing.end() if closing else len(text)
    return text[:start] + _blank(text[start:end]) + text[end:]


def _xml_root(text: str, gaps: _Gaps) -> ET.Element | None:
    """Parse as far as the text allows: a truncated or broken document keeps every element
    opened before the break (the partial tree), and the break becomes a gap."""
    parser = ET.XMLPullParser(events=("start",))
    root: ET.Element | None = None

    def drain() -> None:
        nonlocal root
        for _event, element in parser.read_events():
            if root is None:
                root = element

    try:
        parser.feed(text)
        drain()
        parser.close()
        drain()
    except ET.ParseError as exc:
        position = getattr(exc, "position", None)
        line = position[0] if position else None
        gaps.add(f"XML cut short or malformed: {clip(str(exc), 120)}", line)
    except (ValueError, UnicodeError) as exc:  # pragma: no cover - defensive
        gaps.add(f"XML could not be read: {clip(str(exc), 120)}")
    return root


def _tag_lines(text: str, tag: str) -> list[int]:
    """Line numbers of each ``<tag`` opening, in document order (ElementTree keeps none)."""
    lines: list[int] = []
    line, position = 1, 0
    for match in re.finditer(rf"<{tag}[\s>/]", text):
        line += text.count("\n", position, match.start())
        position = match.start()
        lines.append(line)
    return lines


def _x(element: ET.Element | None, *path: str) -> str | None:
    """Text of a descendant by tag path; None when missing (a truncated element counts)."""
    node = element
    for tag in path:
        node = node.find(tag) if node is not None else None
    if node is None or node.text is None:
        return None
    return node.text.strip()


def parse_xml(source: LineSource) -> NvidiaSmiReport:
    """Read ``nvidia-smi -q -x`` (nvsmi_device_v10+ DTDs; old and new ECC/throttle names)."""
    text = join_text(source)
    report = NvidiaSmiReport()
    gaps = _Gaps(report.gaps)
    safe = text.encode("utf-8", "replace").decode("utf-8")
    if safe != text:
        gaps.add("characters that are not valid Unicode were replaced")
    root = _xml_root(_neutralise_doctype(safe, gaps), gaps)
    if root is None:
        gaps.add("no XML document found")
        gaps.close()
        return report
    if root.tag != "nvidia_smi_log":
        gaps.add(f"not nvidia-smi XML: root element <{clip(str(root.tag), 60)}>")
        gaps.close()
        return report
    report.timestamp = _smi_time(_x(root, "timestamp"))
    report.driver_version = _text(_x(root, "driver_version"))
    report.cuda_version = _text(_x(root, "cuda_version"))
    report.attached_gpus = _count(_x(root, "attached_gpus"))
    gpu_lines = _tag_lines(text, "gpu")
    mig_lines = iter(_tag_lines(text, "mig_device"))
    process_lines = iter(_tag_lines(text, "process_info"))
    for index, element in enumerate(root.findall("gpu")):
        line = gpu_lines[index] if index < len(gpu_lines) else None
        report.gpus.append(_gpu_from_xml(element, index, line, mig_lines, process_lines))
    if report.attached_gpus is not None and len(report.gpus) < report.attached_gpus:
        gaps.add(f"{len(report.gpus)} of {report.attached_gpus} attached GPUs in the output")
    gaps.close()
    return report


def _gpu_from_xml(
    element: ET.Element,
    index: int,
    line: int | None,
    mig_lines: Iterator[int],
    process_lines: Iterator[int],
) -> GpuStatus:
    gpu = GpuStatus(index=index, line=line)
    _set_bus(gpu, element.get("id") or _x(element, "pci", "pci_bus_id"))
    gpu.product = _text(_x(element, "product_name"))
    gpu.uuid = _text(_x(element, "uuid"))
    gpu.serial = _text(_x(element, "serial"))
    gpu.minor_number = _count(_x(element, "minor_number"))
    gpu.performance_state = _text(_x(element, "performance_state"))
    gpu.fan_speed_pct = _measure(_x(element, "fan_speed"))
    gpu.ecc_mode = _text(_x(element, "ecc_mode", "current_ecc"))
    gpu.mig_mode = _text(_x(element, "mig_mode", "current_mig"))
    gpu.pcie_replays = _count(_x(element, "pci", "replay_counter"))
    gpu.memory_used_mib = _count(_x(element, "fb_memory_usage", "used"))
    gpu.memory_total_mib = _count(_x(element, "fb_memory_usage", "total"))
    gpu.utilization_gpu_pct = _measure(_x(element, "utilization", "gpu_util"))
    ecc = element.find("ecc_errors")
    if ecc is not None:
        _ecc_from_xml(gpu, ecc)
    retired = element.find("retired_pages")
    if retired is not None:
        gpu.retired_pages = RetiredPages(
            single_bit=_count(_x(retired, "multiple_single_bit_retirement", "retired_count")),
            double_bit=_count(_x(retired, "double_bit_retirement", "retired_count")),
            pending_blacklist=_flag(_x(retired, "pending_blacklist")),
            pending_retirement=_flag(_x(retired, "pending_retirement")),
            line=line,
        )
    remapped = element.find("remapped_rows")
    if remapped is not None and len(remapped):
        gpu.remapped_rows = RemappedRows(
            correctable=_count(_x(remapped, "remapped_row_corr")),
            uncorrectable=_count(_x(remapped, "remapped_row_unc")),
            pending=_flag(_x(remapped, "remapped_row_pending")),
            failure=_flag(_x(remapped, "remapped_row_failure")),
            histogram={
                re.sub(r"^row_remapper_histogram_", "", bank.tag): _count(bank.text)
                for bank in remapped.findall("row_remapper_histogram/*")
            },
            line=line,
        )
    for child in element:
        tag = str(child.tag)
        if re.fullmatch(r"clocks?_(?:event|throttle)_reasons?", tag):
            gpu.clock_event_reasons = {_reason_key(str(r.tag)): _flag(r.text) for r in child}
        elif re.fullmatch(r"clocks?_(?:event|throttle)_reasons?_counters?", tag):
            gpu.clock_event_counters_us = {_reason_key(str(r.tag)): _count(r.text) for r in child}
    temperature = element.find("temperature")
    if temperature is not None:
        for item in temperature:
            key = _XML_TEMPERATURE.get(str(item.tag), str(item.tag))
            if key == "current":
                gpu.temperature_c = _measure(item.text)
            elif key == "memory_current":
                gpu.memory_temperature_c = _measure(item.text)
            else:
                gpu.temperature_thresholds[key] = _measure(item.text)
    power = element.find("gpu_power_readings")
    if power is None:
        power = element.find("power_readings")
    if power is not None:
        _power_from_pairs(gpu, ((str(item.tag), item.text) for item in power))
    for mig in element.findall("mig_devices/mig_device"):
        gpu.mig_devices.append(_mig_from_xml(mig, next(mig_lines, None)))
    for info in element.findall("processes/process_info"):
        gpu.processes.append(
            GpuProcess(
                pid=_count(_x(info, "pid")),
                name=_text(_x(info, "process_name")),
                used_memory_mib=_count(_x(info, "used_memory")),
                type=_text(_x(info, "type")),
                gpu_instance_id=_count(_x(info, "gpu_instance_id")),
                compute_instance_id=_count(_x(info, "compute_instance_id")),
                line=next(process_lines, None),
            )
        )
    return gpu


_XML_TEMPERATURE = {
    "gpu_temp": "current",
    "memory_temp": "memory_current",
    "gpu_temp_tlimit": "tlimit",
    "gpu_temp_max_threshold": "shutdown",
    "gpu_temp_slow_threshold": "slowdown",
    "gpu_temp_max_gpu_threshold": "max_operating",
    "gpu_temp_max_mem_threshold": "memory_max_operating",
    "gpu_target_temperature": "target",
    "gpu_temp_max_tlimit_threshold": "shutdown_tlimit",
    "gpu_temp_slow_tlimit_threshold": "slowdown_tlimit",
    "gpu_temp_max_gpu_tlimit_threshold": "max_operating_tlimit",
    "gpu_temp_max_mem_tlimit_threshold": "memory_max_operating_tlimit",
}


def _ecc_from_xml(gpu: GpuStatus, element: ET.Element) -> None:
    for part in element:
        tag = str(part.tag)
        if tag in ("volatile", "aggregate"):
            ecc = EccCounts()
            for item in part:
                name = str(item.tag)
                if name in ("single_bit", "double_bit"):
                    for bit in item:
                        _set_bit_part(ecc, name == "single_bit", str(bit.tag), bit.text)
                else:
                    _set_ecc_field(ecc, name, item.text)
            _finish_ecc(ecc)
            if tag == "volatile":
                gpu.ecc_volatile = ecc
            else:
                gpu.ecc_aggregate = ecc
        elif tag == "aggregate_uncorrectable_sram_sources":
            target = gpu.ecc_aggregate or EccCounts()
            gpu.ecc_aggregate = target
            for source in part:
                key = re.sub(r"^sram_", "", str(source.tag))
                target.sram_uncorrectable_sources[_SRAM_SOURCE_ALIASES.get(key, key)] = _count(source.text)
        elif not len(part) and _flag(part.text) is not None:
            gpu.ecc_flags[tag] = _flag(part.text)


def _mig_from_xml(element: ET.Element, line: int | None) -> MigDevice:
    sram = next((item.text for item in element.iter("sram_uncorrectable")), None)
    memory = element.find("fb_memory_usage")
    if memory is None:
        memory = element.find("shared_fb_memory_usage")
    return MigDevice(
        index=_count(_x(element, "index")),
        gpu_instance_id=_count(_x(element, "gpu_instance_id")),
        compute_instance_id=_count(_x(element, "compute_instance_id")),
        sram_uncorrectable=_count(sram),
        memory_used_mib=_count(_x(memory, "used")) if memory is not None else None,
        memory_total_mib=_count(_x(memory, "total")) if memory is not None else None,
        line=line,
    )


# --------------------------------------------------------------------------- --query CSV


_FIELD_NAME = re.compile(r"^(?P<name>[a-z_][A-Za-z0-9_.]*)(?:\s*\[(?P<unit>[^\]]*)\])?$")
_BARE_FIELDS = {
    "timestamp", "name", "index", "count", "serial", "uuid", "pstate", "pid",
    "process_name", "driver_version", "vbios_version", "compute_mode", "hostname",
}
_PROBLEM_STATE = re.compile(r"error|lost|reset|timeout|unknown", re.I)


def _header_cells(cells: list[str]) -> list[tuple[str, str | None]] | None:
    """The (name, unit) columns if this line is a ``--format=csv`` header, else None."""
    parsed: list[tuple[str, str | None]] = []
    for cell in cells:
        match = _FIELD_NAME.match(cell.strip())
        if not match:
            return None
        parsed.append((match["name"], match["unit"]))
    if not parsed:
        return None
    if any("." in name or "_" in name or unit or name in _BARE_FIELDS for name, unit in parsed):
        return parsed
    return None


#: Fields that are names, not quantities: a serial ``0000000000000`` must stay a string.
_IDENTIFIER_FIELD = re.compile(
    r"(?:^|[._])(?:serial|serial_number|uuid|name|bus_id|version|hostname|address|guid)$|^(?:pci|inforom)\.|"
    r"^timestamp$|\.timestamp$"
)


def _csv_value(text: str, name: str | None = None) -> tuple[Scalar, str | None]:
    """(value, problem): numbers read with their unit stripped, ``[N/A]`` and the other
    bracketed non-values as None; a bracketed failure state is also returned as a problem.
    Identifiers (serials, versions, bus ids) and zero-padded or hex values stay text."""
    text = text.strip()
    if text.startswith("[") and text.endswith("]"):
        inner = text[1:-1].strip()
        return None, (inner if _PROBLEM_STATE.search(inner) else None)
    if text.lower() in _NOT_A_VALUE:
        return None, None
    if (name and _IDENTIFIER_FIELD.search(name)) or re.match(r"^0(?:[xX]|\d)", text):
        return text, None
    number = _measure(text)
    return (text if number is None else number), None


def _query_kind(columns: list[str]) -> str:
    names = set(columns)
    if any(name.startswith("retired_pages.") for name in names) and (
        "retired_pages.address" in names or "retired_pages.cause" in names
    ):
        return "retired-pages"
    if "pid" in names or "process_name" in names or "used_gpu_memory" in names or "used_memory" in names:
        return "compute-apps"
    if names and all(n.startswith(("gpu_", "remapped_rows.", "timestamp")) for n in names):
        if any(n.startswith("remapped_rows.") for n in names):
            return "remapped-rows"
    return "gpu"


def parse_query_csv(source: LineSource) -> QueryCsv:
    """Read any ``nvidia-smi --query-*=... --format=csv[,noheader][,nounits]`` output."""
    result = QueryCsv()
    gaps = _Gaps(result.gaps)
    header: list[tuple[str, str | None]] | None = None
    warned_noheader = False
    for number, line in numbered_lines(source):
        if not line.strip():
            continue
        if _SMI_ERROR.match(line):
            result.errors.append(SmiMessage(clip(line), number))
            continue
        try:
            cells = next(csv.reader([line], skipinitialspace=True))
        except (csv.Error, StopIteration):
            gaps.add(f"not a CSV line: {clip(line, 80)!r}", number)
            continue
        columns = _header_cells(cells)
        if columns is not None:
            if header is not None and [c for c, _u in columns] != result.columns:
                gaps.add("a second, different header: later rows use it", number)
            header = columns
            result.columns = [name for name, _unit in columns]
            result.units = {name: unit for name, unit in columns if unit}
            result.query = _query_kind(result.columns)
            continue
        row = CsvRow(line=number)
        for position, cell in enumerate(cells):
            name = header[position][0] if header is not None and position < len(header) else None
            value, problem = _csv_value(cell, name)
            row.cells.append(value)
            if name and problem:
                row.problems[name] = problem
        if header is None:
            if not warned_noheader:
                gaps.add(
                    "no header line (--format=csv,noheader): columns unknown, rows kept as lists", number
                )
                warned_noheader = True
        else:
            if len(cells) != len(header):
                gaps.add(f"{len(cells)} values for {len(header)} columns: matched by position", number)
            row.values = {name: value for (name, _unit), value in zip(header, row.cells)}
            stamp = row.values.get("timestamp")
            row.timestamp = _smi_time(stamp) if isinstance(stamp, str) else None
        result.rows.append(row)
    for row in result.rows:
        if not row.values:
            continue
        if result.query in ("gpu", "remapped-rows"):
            result.gpus.append(_gpu_from_csv(row))
        elif result.query == "compute-apps":
            result.processes.append(_process_from_csv(row))
    if not result.rows and not result.columns and not result.errors:
        gaps.add("no nvidia-smi CSV content found")
    gaps.close()
    return result


def _raw(value: Scalar) -> str | None:
    """CSV values back to text for the shared normalisers (which read text)."""
    return None if value is None else str(value)


_CSV_ECC = re.compile(
    r"^ecc\.errors\.(?P<kind>corrected|uncorrected)\.(?P<scope>volatile|aggregate)\.(?P<part>[a-z0-9_]+)"
    r"(?:\.(?P<sub>[A-Za-z0-9_]+))?$"
)


def _gpu_from_csv(row: CsvRow) -> GpuStatus:
    """The -q vocabulary from ``--query-gpu`` field names, for whichever fields were asked."""
    values = row.values
    gpu = GpuStatus(line=row.line)

    def get(*names: str) -> str | None:
        return next((_raw(values[n]) for n in names if values.get(n) is not None), None)

    gpu.index = _count(get("index"))
    _set_bus(gpu, get("pci.bus_id", "gpu_bus_id"))
    gpu.product = _text(get("name", "gpu_name"))
    gpu.uuid = _text(get("uuid", "gpu_uuid"))
    gpu.serial = _text(get("serial", "gpu_serial"))
    gpu.ecc_mode = _text(get("ecc.mode.current"))
    gpu.mig_mode = _text(get("mig.mode.current"))
    gpu.performance_state = _text(get("pstate"))
    gpu.temperature_c = _measure(get("temperature.gpu"))
    gpu.memory_temperature_c = _measure(get("temperature.memory"))
    if "temperature.gpu.tlimit" in values:
        gpu.temperature_thresholds["tlimit"] = _measure(get("temperature.gpu.tlimit"))
    gpu.power_draw_w = _float(get("power.draw", "power.draw.average", "power.draw.instant"))
    gpu.power_draw_instant_w = _float(get("power.draw.instant"))
    gpu.power_limit_w = _float(get("enforced.power.limit", "power.limit"))
    gpu.fan_speed_pct = _measure(get("fan.speed"))
    gpu.memory_used_mib = _count(get("memory.used"))
    gpu.memory_total_mib = _count(get("memory.total"))
    gpu.utilization_gpu_pct = _measure(get("utilization.gpu"))
    gpu.pcie_replays = _count(get("pcie.replay_counter"))
    volatile, aggregate = EccCounts(), EccCounts()
    seen_ecc = False
    retired, remapped = RetiredPages(line=row.line), RemappedRows(line=row.line)
    seen_retired = seen_remapped = False
    for name, value in values.items():
        text = _raw(value)
        ecc_match = _CSV_ECC.match(name)
        if ecc_match:
            seen_ecc = True
            _csv_ecc_field(volatile if ecc_match["scope"] == "volatile" else aggregate, ecc_match, text)
        elif name.startswith("retired_pages."):
            seen_retired = True
            key = name.removeprefix("retired_pages.")
            if key in ("single_bit_ecc.count", "sbe"):
                retired.single_bit = _count(text)
            elif key in ("double_bit.count", "dbe"):
                retired.double_bit = _count(text)
            elif key == "pending":
                retired.pending_retirement = _flag(text)
        elif name.startswith("remapped_rows."):
            seen_remapped = True
            key = name.removeprefix("remapped_rows.")
            if key == "correctable":
                remapped.correctable = _count(text)
            elif key == "uncorrectable":
                remapped.uncorrectable = _count(text)
            elif key == "pending":
                remapped.pending = _flag(text)
            elif key == "failure":
                remapped.failure = _flag(text)
            elif key.startswith("histogram."):
                remapped.histogram[key.removeprefix("histogram.")] = _count(text)
        elif re.match(r"^clocks?_(?:event|throttle)_reasons?_counters?\.", name):
            gpu.clock_event_counters_us[_reason_key(name.split(".", 1)[1])] = _count(text)
        elif re.match(r"^clocks?_(?:event|throttle)_reasons?\.", name):
            key = _reason_key(name.split(".", 1)[1])
            if key not in ("supported", "active"):
                gpu.clock_event_reasons[key] = _flag(text)
    _reasons_from_mask(gpu, get("clocks_event_reasons.active", "clocks_throttle_reasons.active"))
    if seen_ecc:
        gpu.ecc_volatile, gpu.ecc_aggregate = _finish_ecc(volatile), _finish_ecc(aggregate)
    if seen_retired:
        gpu.retired_pages = retired
    if seen_remapped:
        gpu.remapped_rows = remapped
    return gpu


def _csv_ecc_field(ecc: EccCounts, match: re.Match[str], value: str | None) -> None:
    corrected = match["kind"] == "corrected"
    part, sub = match["part"], match["sub"]
    if part in ("sram", "dram") and sub is None:
        _set_ecc_field(ecc, f"{part}_{'correctable' if corrected else 'uncorrectable'}", value)
    elif part == "sram" and sub in ("parity", "secded"):
        _set_ecc_field(ecc, f"sram_uncorrectable_{sub}", value)
    elif part == "sram" and sub == "thresholdExceeded":
        ecc.sram_threshold_exceeded = _flag(value)
    elif part == "sram" and sub is not None:
        ecc.sram_uncorrectable_sources[_SRAM_SOURCE_ALIASES.get(sub, sub)] = _count(value)
    elif sub is None:
        _set_bit_part(ecc, corrected, part, value)


def _reasons_from_mask(gpu: GpuStatus, mask: str | None) -> None:
    """Fill reasons the CSV did not name from the ``.active`` bitmask (NVML's bit values)."""
    if mask is None:
        return
    try:
        bits = int(mask, 16) if mask.lower().startswith("0x") else int(mask)
    except ValueError:
        return
    for name, bit in CLOCK_REASON_BITS.items():
        gpu.clock_event_reasons.setdefault(name, bool(bits & bit))


def _process_from_csv(row: CsvRow) -> GpuProcess:
    values = row.values

    def get(*names: str) -> str | None:
        return next((_raw(values[n]) for n in names if values.get(n) is not None), None)

    ids = normalise_bus_id(get("gpu_bus_id"))
    return GpuProcess(
        pid=_count(get("pid")),
        name=_text(get("process_name", "name")),
        used_memory_mib=_count(get("used_gpu_memory", "used_memory")),
        gpu_bus_id=ids[0] if ids else None,
        line=row.line,
    )


# --------------------------------------------------------------------------- default table


_TABLE_VERSIONS = re.compile(
    r"NVIDIA-SMI\s+(?P<smi>\S+)|Driver Version:\s*(?P<driver>\S+)|CUDA Version:\s*(?P<cuda>\S+)"
)
_GPU_CELL = re.compile(r"^\s*(?P<index>\d{1,4})\s+(?P<name>.+?)\s+(?P<persistence>\S+)\s*$")
_BUS_CELL = re.compile(
    r"^\s*(?P<bus>[0-9A-Fa-f]{4,8}:[0-9A-Fa-f]{2}:[0-9A-Fa-f]{2}\.[0-7])\s+(?P<disp>\S+)\s*$"
)
#: Values are separated from the slash by spaces (``72W /  700W``); ``N/A`` has its own slash.
_STATS_CELL = re.compile(
    r"^\s*(?P<fan>\S+)\s+(?P<temp>\S+)\s+(?P<perf>\S+)\s+(?P<power>\S+)\s+/\s+(?P<cap>\S+)\s*$"
)
_PAIR_CELL = re.compile(r"^\s*(?P<left>\S+)\s+/\s+(?P<right>\S+)\s*$")
_PROCESS_ROW = re.compile(
    r"^\s*(?P<gpu>\d{1,4})\s+(?:(?P<gi>\S+)\s+(?P<ci>\S+)\s+)?(?P<pid>\d{1,10})\s+(?P<type>[A-Z+]+)\s+"
    r"(?P<name>.*?)\s+(?P<memory>\S+)\s*$"
)


#: Rows of the table and nvlink lines are under 100 characters; a longer "row" is garbage,
#: and refusing it keeps the row patterns linear-time on hostile input.
_MAX_ROW = 1000


def _cells(line: str) -> list[str]:
    """The cells of a ``| a | b | c |`` row."""
    body = line.strip()
    if body.startswith("|"):
        body = body[1:]
    if body.endswith("|"):
        body = body[:-1]
    return body.split("|")


class _TableReader:
    """Walks the table's sections: the GPU grid (two or three rows per GPU, closed by a
    ``+---`` rule), the MIG devices grid (skipped), and the processes grid."""

    def __init__(self) -> None:
        self.table = NvidiaSmiTable()
        self.gaps = _Gaps(self.table.gaps)
        self.section = "preamble"
        self.header_seen = False
        self.current: TableGpu | None = None
        self.row_in_block = 0
        self.processes_have_gi = False

    def feed(self, number: int, line: str) -> None:
        stripped = line.strip()
        if not stripped:
            return
        if len(stripped) > _MAX_ROW:
            self.gaps.add(f"line of {len(stripped)} characters is not an nvidia-smi table row", number)
            return
        if stripped.startswith("+") and set(stripped) <= set("+-= "):
            self.close_block()
            return
        if not stripped.startswith("|"):
            self.outside(number, stripped)
            return
        if "=" in stripped and set(stripped) <= set("|=+ "):
            self.section = {"gpu-header": "gpus", "process-header": "processes", "mig-header": "mig"}.get(
                self.section, self.section
            )
            self.close_block()
            return
        if "-" in stripped and set(stripped) <= set("|-+ "):
            self.close_block()
            return
        self.row(number, stripped)

    def outside(self, number: int, stripped: str) -> None:
        moment = _smi_time(stripped)
        if moment is not None:
            self.table.timestamp = moment
        elif _SMI_ERROR.match(stripped):
            self.table.errors.append(SmiMessage(clip(stripped), number))
        else:
            self.gaps.add(f"not part of the nvidia-smi table: {clip(stripped, 80)!r}", number)

    def close_block(self) -> None:
        self.current = None
        self.row_in_block = 0

    def row(self, number: int, stripped: str) -> None:
        if "NVIDIA-SMI" in stripped or "Driver Version:" in stripped:
            for match in _TABLE_VERSIONS.finditer(stripped):
                if match["smi"]:
                    self.table.smi_version = match["smi"]
                if match["driver"]:
                    self.table.driver_version = _text(match["driver"])
                if match["cuda"]:
                    self.table.cuda_version = _text(match["cuda"])
            return
        if "Bus-Id" in stripped or "Persistence-M" in stripped:
            self.section = "gpu-header"
            return
        if "Processes:" in stripped:
            self.section = "process-header"
            return
        if "MIG devices:" in stripped:
            self.section = "mig-header"
            return
        if self.section == "process-header":
            if re.search(r"\bGI\b", stripped):
                self.processes_have_gi = True
            return
        if self.section in ("gpu-header", "mig-header", "mig", "preamble"):
            return  # column titles, MIG grid rows: not modelled
        if self.section == "gpus":
            self.gpu_row(number, _cells(stripped))
        elif self.section == "processes":
            self.process_row(number, stripped)

    def gpu_row(self, number: int, cells: list[str]) -> None:
        if len(cells) < 3:
            self.gaps.add(f"GPU row with {len(cells)} cells", number)
            return
        first = _GPU_CELL.match(cells[0])
        if self.current is None or (first and self.row_in_block != 1):
            if not first:
                self.gaps.add(f"GPU row not understood: {clip('|'.join(cells), 80)!r}", number)
                return
            name = first["name"].strip()
            gpu = TableGpu(
                index=int(first["index"]),
                name=name,
                name_truncated=name.endswith("..."),
                persistence=_text(first["persistence"]),
                line=number,
            )
            bus = _BUS_CELL.match(cells[1])
            if bus:
                ids = normalise_bus_id(bus["bus"])
                if ids:
                    gpu.bus_id, gpu.pci = ids
                gpu.display_active = _text(bus["disp"])
            else:
                self.gaps.add(f"bus id cell not understood: {clip(cells[1], 60)!r}", number)
            gpu.volatile_uncorrected_ecc = _count(cells[2])
            self.table.gpus.append(gpu)
            self.current, self.row_in_block = gpu, 1
            return
        current = self.current
        if self.row_in_block == 1:
            self.stats_row(number, current, cells)
        elif self.row_in_block == 2:
            current.mig_mode = _text(cells[2])
        self.row_in_block += 1

    def stats_row(self, number: int, gpu: TableGpu, cells: list[str]) -> None:
        """``| N/A   27C    P0   72W / 700W |  1MiB / 81559MiB |  0%  Default |``."""
        match = _STATS_CELL.match(cells[0])
        if not match:
            self.gaps.add(f"GPU stats row not understood: {clip(cells[0], 60)!r}", number)
            return
        fan, temp, perf, power, cap = match.group("fan", "temp", "perf", "power", "cap")
        for column, value in (("fan", fan), ("temperature", temp), ("performance_state", perf),
                              ("power", power), ("power_cap", cap)):
            if value.upper() == "ERR!":
                gpu.err_columns.append(column)
        gpu.fan_error = "fan" in gpu.err_columns
        gpu.fan_pct = _measure(fan)
        gpu.temperature_c = _measure(temp)
        gpu.performance_state = _text(perf) if perf.upper() != "ERR!" else None
        gpu.power_draw_w = _float(power)
        gpu.power_cap_w = _float(cap)
        memory = _PAIR_CELL.match(cells[1])
        if memory:
            gpu.memory_used_mib = _count(memory["left"])
            gpu.memory_total_mib = _count(memory["right"])
        util = re.match(r"^\s*(?P<util>\S+)\s+(?P<mode>.+?)\s*$", cells[2])
        if util:
            gpu.utilization_gpu_pct = _measure(util["util"])
            gpu.compute_mode = _text(util["mode"])
            if util["util"].upper() == "ERR!":
                gpu.err_columns.append("utilization")

    def process_row(self, number: int, stripped: str) -> None:
        body = "|".join(_cells(stripped))
        if "No running processes found" in body:
            return
        match = _PROCESS_ROW.match(body)
        if not match or (self.processes_have_gi and match["gi"] is None):
            self.gaps.add(f"process row not understood: {clip(body, 80)!r}", number)
            return
        self.table.processes.append(
            GpuProcess(
                pid=int(match["pid"]),
                name=_text(match["name"]),
                used_memory_mib=_count(match["memory"]),
                type=match["type"],
                gpu_instance_id=_count(match["gi"]),
                compute_instance_id=_count(match["ci"]),
                gpu_index=int(match["gpu"]),
                line=number,
            )
        )


def parse_table(source: LineSource) -> NvidiaSmiTable:
    """Read the default ``nvidia-smi`` table: per-GPU rows and the processes grid."""
    reader = _TableReader()
    for number, line in numbered_lines(source):
        reader.feed(number, line)
    if not reader.table.gpus and reader.table.driver_version is None and not reader.table.errors:
        reader.gaps.add("no nvidia-smi table found")
    reader.gaps.close()
    return reader.table


# --------------------------------------------------------------------------- nvlink -s


_NVLINK_GPU = re.compile(r"^GPU\s+(?P<index>\d{1,4}):\s*(?P<name>.*?)\s*(?:\(UUID:\s*(?P<uuid>[^)]*)\))?\s*$")
_NVLINK_LINK = re.compile(r"^\s*Link\s+(?P<link>\d{1,4})\s*:\s*(?P<rest>.*?)\s*$")
_LINK_SPEED = re.compile(r"^(?P<speed>\d{1,9}(?:\.\d{1,9})?)\s*GB/s$", re.I)
_LINK_COUNTER = re.compile(r"^(?P<name>[A-Za-z][A-Za-z0-9 _-]*?)\s*:\s*(?P<value>\S+)$")


def parse_nvlink_status(source: LineSource) -> NvlinkStatus:
    """Read ``nvidia-smi nvlink -s``: per GPU, each link's speed or ``<inactive>``."""
    status = NvlinkStatus()
    gaps = _Gaps(status.gaps)
    current: NvlinkGpu | None = None
    for number, line in numbered_lines(source):
        stripped = line.strip()
        if not stripped:
            continue
        if len(stripped) > _MAX_ROW:
            gaps.add(f"line of {len(stripped)} characters is not an nvlink status line", number)
            continue
        header = _NVLINK_GPU.match(stripped)
        if header and not line[0].isspace():
            current = NvlinkGpu(
                index=int(header["index"]),
                name=_text(header["name"]),
                uuid=_text(header["uuid"]),
                line=number,
            )
            status.gpus.append(current)
            continue
        link = _NVLINK_LINK.match(line)
        if link and current is not None:
            _add_link(current, int(link["link"]), link["rest"], stripped, number, gaps)
            continue
        if _SMI_ERROR.match(stripped):
            status.errors.append(SmiMessage(clip(stripped), number))
        else:
            gaps.add(f"not an nvlink status line: {clip(stripped, 80)!r}", number)
    if not status.gpus and not status.errors:
        gaps.add("no nvidia-smi nvlink output found")
    gaps.close()
    return status


def _add_link(gpu: NvlinkGpu, index: int, rest: str, raw: str, number: int, gaps: _Gaps) -> None:
    speed = _LINK_SPEED.match(rest)
    if speed:
        gpu.links.append(NvlinkLink(index, float(speed["speed"]), True, raw=clip(raw), line=number))
        return
    if rest.strip("<> ").lower() == "inactive":
        gpu.links.append(NvlinkLink(index, None, False, raw=clip(raw), line=number))
        return
    counter = _LINK_COUNTER.match(rest)
    if counter:  # ``nvlink -e``: several counter lines per link
        existing = next((link for link in gpu.links if link.link == index), None)
        if existing is None:
            existing = NvlinkLink(index, raw=clip(raw), line=number)
            gpu.links.append(existing)
        existing.counters[_snake(counter["name"])] = _count(counter["value"])
        return
    gaps.add(f"link state not understood: {clip(raw, 80)!r}", number)


# --------------------------------------------------------------------------- detection


def _head(sample: str) -> str:
    return sample[: 64 * 1024]


def detect_q(sample: str) -> float:
    """The ``NVSMI LOG`` banner; without it (an excerpt) a ``GPU 00000000:..`` section line
    together with ``Driver Version`` or indented ``Product Name``."""
    head = _head(sample)
    if re.search(r"^=+NVSMI LOG=+\s*$", head, re.M):
        return 0.95
    section = re.search(r"^GPU [0-9A-Fa-f]{4,8}:[0-9A-Fa-f]{2}:[0-9A-Fa-f]{2}\.[0-7]\s*$", head, re.M)
    driver = re.search(r"^Driver Version\s+: \S", head, re.M)
    fields = re.search(
        r"^ {4}(?:Product Name|ECC Errors|Retired Pages|Remapped Rows|Temperature)\b", head, re.M
    )
    if section and (driver or fields):
        return 0.9
    if driver and re.search(r"^Attached GPUs\s+: \d", head, re.M):
        return 0.7
    return 0.0


def detect_xml(sample: str) -> float:
    head = _head(sample)
    if "<nvidia_smi_log" in head:
        return 0.95
    if "<?xml" in head and re.search(r"<gpu id=\"[0-9A-Fa-f:.]+\"", head):
        return 0.6
    return 0.0


_CSV_MARKERS = re.compile(
    r"\b(?:pci\.bus_id|gpu_bus_id|gpu_uuid|ecc\.errors\.|retired_pages\.|remapped_rows\.|"
    r"clocks_(?:event|throttle)_reasons\.|temperature\.gpu|utilization\.gpu|memory\.used|power\.draw|"
    r"used_gpu_memory)"
)


_GPU_ID_CELL = re.compile(r"^(?:[0-9A-Fa-f]{8}:[0-9A-Fa-f]{2}:[0-9A-Fa-f]{2}\.[0-7]|GPU-[0-9a-fA-F-]{36})$")


def detect_csv(sample: str) -> float:
    """A header naming nvidia-smi fields is certain; headerless rows of equal width with a
    bus id or GPU UUID in them are only a guess (other tools print those too)."""
    lines = [line for line in _head(sample).splitlines()[:20] if line.strip()]
    if not lines:
        return 0.0
    cells = [cell.strip() for cell in lines[0].split(",")]
    if _header_cells(cells) is not None and _CSV_MARKERS.search(lines[0]):
        return 0.9
    widths = {len(line.split(", ")) for line in lines}
    if len(widths) == 1 and widths.pop() >= 2 and all(
        any(_GPU_ID_CELL.match(cell.strip()) for cell in line.split(",")) for line in lines
    ):
        return 0.3
    return 0.0


def detect_table(sample: str) -> float:
    head = _head(sample)
    if re.search(r"^\|\s*NVIDIA-SMI \S+\s+Driver Version:", head, re.M):
        return 0.95
    if re.search(r"^\|\s*GPU\s+Name\s+.*Persistence-M", head, re.M):
        return 0.9
    if re.search(r"^\|\s*Processes:", head, re.M) and re.search(r"^\|=+\|", head, re.M):
        return 0.6
    return 0.0


def detect_nvlink(sample: str) -> float:
    head = _head(sample)
    if re.search(r"^GPU \d{1,4}: [^\n]{0,200}\(UUID: [^)\n]{0,80}\)[ \t]*$", head, re.M) and re.search(
        r"^\s+Link \d+: ", head, re.M
    ):
        return 0.9
    return 0.0


# --------------------------------------------------------------------------- summaries


def _gpu_label(index: int | None, bus_id: str | None, product: str | None) -> str:
    parts = [f"GPU {index if index is not None else '?'}"]
    if bus_id:
        parts.append(bus_id)
    if product:
        parts.append(product)
    return " ".join(parts)


def _ecc_alarms(gpu: GpuStatus) -> list[str]:
    alarms: list[str] = []
    for scope, ecc in (("volatile", gpu.ecc_volatile), ("aggregate", gpu.ecc_aggregate)):
        if ecc is None:
            continue
        bad = ecc.uncorrectable_total()
        if bad:
            parts = [
                f"{label} {value}"
                for label, value in (("DRAM", ecc.dram_uncorrectable), ("SRAM", ecc.sram_uncorrectable),
                                     ("double-bit", ecc.double_bit_total))
                if value
            ]
            alarms.append(f"uncorrectable ECC {scope} {bad}" + (f" ({', '.join(parts)})" if parts else ""))
        good = ecc.correctable_total()
        if good:
            alarms.append(f"correctable ECC {scope} {good}")
        if ecc.sram_threshold_exceeded:
            alarms.append(f"SRAM error threshold exceeded ({scope})")
    return alarms


def _gpu_alarms(gpu: GpuStatus) -> list[str]:
    """The few facts about one GPU a person on call would act on."""
    alarms = _ecc_alarms(gpu)
    alarms += [f"{name.replace('_', ' ')}: yes" for name, value in gpu.ecc_flags.items() if value]
    pages = gpu.retired_pages
    if pages and (pages.single_bit or pages.double_bit or pages.pending):
        alarms.append(
            f"retired pages single-bit {pages.single_bit}, double-bit {pages.double_bit}, "
            f"pending {pages.pending}"
        )
    rows = gpu.remapped_rows
    if rows and (rows.uncorrectable or rows.correctable or rows.pending or rows.failure):
        alarms.append(
            f"remapped rows correctable {rows.correctable}, uncorrectable {rows.uncorrectable}"
            + (", PENDING (reset needed)" if rows.pending else "")
            + (", REMAPPING FAILED" if rows.failure else "")
        )
    active = [
        _REASON_LABELS.get(name, name)
        for name in _SLOWDOWN_REASONS
        if gpu.clock_event_reasons.get(name)
    ]
    if active:
        alarms.append("clocks slowed: " + ", ".join(active))
    for mig in gpu.mig_devices:
        if mig.sram_uncorrectable:
            alarms.append(f"MIG device {mig.index} SRAM uncorrectable {mig.sram_uncorrectable}")
    return alarms


def _messages(errors: list[SmiMessage]) -> list[str]:
    return [f"  nvidia-smi error (line {message.line}): {message.text}" for message in errors]


def summarize_report(report: NvidiaSmiReport) -> list[str]:
    """Driver, GPU count, and per GPU anything alarming (for -q text and XML alike)."""
    attached = f" of {report.attached_gpus} attached" if report.attached_gpus is not None else ""
    lines = [
        f"driver {report.driver_version or '?'}, CUDA {report.cuda_version or '?'}: "
        f"{len(report.gpus)} GPU(s){attached}"
    ]
    for gpu in report.gpus:
        alarms = _gpu_alarms(gpu)
        if alarms:
            lines.append(f"  {_gpu_label(gpu.index, gpu.bus_id, gpu.product)}: " + "; ".join(alarms))
    return lines + _messages(report.errors)


def summarize_csv(result: QueryCsv) -> list[str]:
    lines = [f"--query {result.query}: {len(result.columns)} fields, {len(result.rows)} row(s)"]
    for gpu in result.gpus:
        alarms = _gpu_alarms(gpu)
        if alarms:
            lines.append(f"  {_gpu_label(gpu.index, gpu.bus_id, gpu.product)}: " + "; ".join(alarms))
    if result.query == "retired-pages":
        retired = [row for row in result.rows if row.values.get("retired_pages.address") is not None]
        lines.append(f"  retired pages listed: {len(retired)}")
    for row in result.rows:
        by_state: dict[str, list[str]] = {}
        for name, state in sorted(row.problems.items()):
            by_state.setdefault(state, []).append(name)
        for state, names in by_state.items():
            shown = ", ".join(names[:4]) + (f" and {len(names) - 4} more" if len(names) > 4 else "")
            lines.append(f"  line {row.line}: [{state}] in {shown}")
    return lines + _messages(result.errors)


def summarize_table(table: NvidiaSmiTable) -> list[str]:
    lines = [
        f"driver {table.driver_version or '?'}, CUDA {table.cuda_version or '?'}: "
        f"{len(table.gpus)} GPU(s), {len(table.processes)} process(es)"
    ]
    for gpu in table.gpus:
        alarms: list[str] = []
        if gpu.volatile_uncorrected_ecc:
            alarms.append(f"volatile uncorrected ECC {gpu.volatile_uncorrected_ecc}")
        if gpu.err_columns:
            fan = " (fan failure)" if gpu.fan_error else ""
            alarms.append("ERR! in " + ", ".join(gpu.err_columns) + fan)
        if alarms:
            lines.append(f"  {_gpu_label(gpu.index, gpu.bus_id, gpu.name)}: " + "; ".join(alarms))
    return lines + _messages(table.errors)


def summarize_nvlink(status: NvlinkStatus) -> list[str]:
    links = sum(len(gpu.links) for gpu in status.gpus)
    lines = [f"{len(status.gpus)} GPU(s), {links} NVLink(s)"]
    for gpu in status.gpus:
        label = _gpu_label(gpu.index, None, gpu.name)
        inactive = gpu.inactive_links()
        if inactive:
            lines.append(f"  {label}: inactive links {', '.join(map(str, inactive))}")
        speeds = sorted({link.speed_gbps for link in gpu.links if link.speed_gbps is not None})
        if len(speeds) > 1:
            lines.append(f"  {label}: links at different speeds {speeds} GB/s")
        errors = {
            f"link {link.link} {name}": value
            for link in gpu.links
            for name, value in link.counters.items()
            if value
        }
        if errors:
            lines.append(f"  {label}: " + ", ".join(f"{k} {v}" for k, v in errors.items()))
    return lines + _messages(status.errors)


# --------------------------------------------------------------------------- registration


KIND_Q = register(
    Kind(
        name="nvidia-smi-q",
        description="nvidia-smi -q: per-GPU ECC, retired pages, remapped rows, clock event reasons, "
        "temperatures, power",
        command="nvidia-smi -q",
        parse=parse_q,
        detect=detect_q,
        summarize=summarize_report,
    )
)
KIND_XML = register(
    Kind(
        name="nvidia-smi-xml",
        description="nvidia-smi -q -x: the -q report as XML (entity declarations refused)",
        command="nvidia-smi -q -x",
        parse=parse_xml,
        detect=detect_xml,
        summarize=summarize_report,
    )
)
KIND_CSV = register(
    Kind(
        name="nvidia-smi-csv",
        description="nvidia-smi --query-{gpu,retired-pages,remapped-rows,compute-apps}=... --format=csv",
        command="nvidia-smi --query-gpu=index,pci.bus_id,uuid,name,temperature.gpu,power.draw,"
        "ecc.errors.uncorrected.volatile.total,ecc.errors.uncorrected.aggregate.total,"
        "retired_pages.pending,remapped_rows.pending,clocks_throttle_reasons.active --format=csv",
        parse=parse_query_csv,
        detect=detect_csv,
        summarize=summarize_csv,
    )
)
KIND_TABLE = register(
    Kind(
        name="nvidia-smi-table",
        description="nvidia-smi (default table): per-GPU temp, power, memory, util, volatile ECC, fan ERR!",
        command="nvidia-smi",
        parse=parse_table,
        detect=detect_table,
        summarize=summarize_table,
    )
)
KIND_NVLINK = register(
    Kind(
        name="nvidia-smi-nvlink",
        description="nvidia-smi nvlink -s: per-GPU NVLink speeds, inactive links",
        command="nvidia-smi nvlink -s",
        parse=parse_nvlink_status,
        detect=detect_nvlink,
        summarize=summarize_nvlink,
    )
)

#: Collected on every node. ``-q`` rather than ``-q -x``: the text form is what people read
#: in the post-mortem, and the parser reads it as fully as the XML.
REMOTE = register_remote(RemoteProbe(
    name="nvidia-smi-q", filename="nvidia-smi-q.txt", command="nvidia-smi -q",
    kind="nvidia-smi-q", order=10,
))
