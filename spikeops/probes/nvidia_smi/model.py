"""The GPU model every ``nvidia-smi`` form is read into (``GpuStatus``, ``EccCounts``, ...),
and the value readers and name normalisation the five parsers share."""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import datetime

from spikeops.probes.base import (
    Gap,
    to_number,
)
from spikeops.timeparse import parse_ctime, parse_iso

__all__ = ["EccCounts", "RetiredPages", "RemappedRows", "MigDevice", "GpuProcess", "SmiMessage", "GpuStatus", "NvidiaSmiReport", "CsvRow", "QueryCsv", "TableGpu", "NvidiaSmiTable", "NvlinkLink", "NvlinkGpu", "NvlinkStatus", "normalise_bus_id", "MAX_GAPS", "CLOCK_REASON_BITS"]


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


def _head(sample: str) -> str:
    """What the detectors look at: the first 64 KiB."""
    return sample[: 64 * 1024]


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


#: The longest line read as a table or nvlink row; longer is a gap, not a row.
_MAX_ROW = 1000
