"""One-line-per-alarm summaries of each form, for ``spikeops parse`` and the report."""

from __future__ import annotations


from spikeops.probes.nvidia_smi.model import (
    GpuStatus,
    NvidiaSmiReport,
    NvidiaSmiTable,
    NvlinkStatus,
    QueryCsv,
    SmiMessage,
    _REASON_LABELS,
    _SLOWDOWN_REASONS,
)

__all__ = ["summarize_report", "summarize_csv", "summarize_table", "summarize_nvlink"]


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
