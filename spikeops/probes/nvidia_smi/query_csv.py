"""``nvidia-smi --query-{gpu,retired-pages,remapped-rows,compute-apps}=... --format=csv``."""

from __future__ import annotations

import csv
import re

from spikeops.probes.base import (
    LineSource,
    clip,
    numbered_lines,
)
from spikeops.probes.nvidia_smi.model import (
    _head,
    CLOCK_REASON_BITS,
    CsvRow,
    EccCounts,
    GpuProcess,
    GpuStatus,
    QueryCsv,
    RemappedRows,
    RetiredPages,
    Scalar,
    SmiMessage,
    _Gaps,
    _NOT_A_VALUE,
    _SMI_ERROR,
    _SRAM_SOURCE_ALIASES,
    _count,
    _finish_ecc,
    _flag,
    _float,
    _measure,
    _reason_key,
    _set_bit_part,
    _set_bus,
    _set_ecc_field,
    _smi_time,
    _text,
    normalise_bus_id,
)

__all__ = ["parse_query_csv", "detect_csv"]


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
