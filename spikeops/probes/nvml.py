"""``nvml.json``: a node-side NVML reading, and its parser (format ``spikeops-nvml/1``).

Where spikeops is installed on the nodes, reading NVML directly (nvidia-ml-py) gives the same
health facts as ``nvidia-smi -q`` without depending on how a given driver release words its
text. The probe (``collect``) and the parser (``parse``) live side by side: ``collect`` runs
on the node (``python3 -m spikeops.probes.nvml``) and prints the document; the bundle stores
it as ``nodes/NODE/nvml.json``; ``parse`` reads it into the very ``NvidiaSmiReport`` that the
nvidia-smi parsers produce, so the diagnosis has one GPU model whatever the source.

The document format is defined in docs/bundle.md (a backward-compatible extension of the
bundle spec, which names the file but not its content). A field NVML does not support on a
GPU is null, and the reason is kept in the GPU's ``errors`` map: "not supported" is not 0.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

from spikeops.probes.base import RemoteProbe, Gap, Kind, LineSource, join_text, register, register_remote
from spikeops.probes.nvidia_smi import (
    CLOCK_REASON_BITS,
    EccCounts,
    GpuStatus,
    NvidiaSmiReport,
    RemappedRows,
    RetiredPages,
    SmiMessage,
    normalise_bus_id,
    summarize_report,
)
from spikeops.timeparse import iso, parse_any

__all__ = [
    "REMOTE","NVML_FORMAT", "collect", "parse", "detect", "KIND"]

NVML_FORMAT = "spikeops-nvml/1"

# ----------------------------------------------------------------------------- probe (I/O)


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _reader(errors: dict[str, str]) -> Callable[..., Any]:
    """Call an NVML getter; on NVMLError record why under ``name`` and return None."""

    def read(name: str, getter: Callable[..., Any], *args: Any) -> Any:
        try:
            return getter(*args)
        except Exception as exc:  # pynvml raises a subclass per NVML return code
            errors[name] = str(exc) or type(exc).__name__
            return None

    return read


def _ecc(nvml: Any, handle: Any, counter: int, read: Callable[..., Any], scope: str) -> dict[str, int | None]:
    counts: dict[str, int | None] = {}
    for location, key in ((nvml.NVML_MEMORY_LOCATION_DRAM, "dram"), (nvml.NVML_MEMORY_LOCATION_SRAM, "sram")):
        for error_type, suffix in (
            (nvml.NVML_MEMORY_ERROR_TYPE_CORRECTED, "correctable"),
            (nvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, "uncorrectable"),
        ):
            counts[f"{key}_{suffix}"] = read(
                f"ecc.{scope}.{key}_{suffix}", nvml.nvmlDeviceGetMemoryErrorCounter, handle, error_type, counter, location
            )
    for error_type, key in (
        (nvml.NVML_MEMORY_ERROR_TYPE_CORRECTED, "total_correctable"),
        (nvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, "total_uncorrectable"),
    ):
        counts[key] = read(f"ecc.{scope}.{key}", nvml.nvmlDeviceGetTotalEccErrors, handle, error_type, counter)
    return counts


def _gpu(nvml: Any, index: int) -> dict[str, Any]:
    errors: dict[str, str] = {}
    read = _reader(errors)
    handle = read("handle", nvml.nvmlDeviceGetHandleByIndex, index)
    if handle is None:
        return {"index": index, "errors": errors}
    pci = read("pci", nvml.nvmlDeviceGetPciInfo, handle)
    single = read("retired_pages.single_bit", nvml.nvmlDeviceGetRetiredPages, handle,
                  nvml.NVML_PAGE_RETIREMENT_CAUSE_MULTIPLE_SINGLE_BIT_ECC_ERRORS)
    double = read("retired_pages.double_bit", nvml.nvmlDeviceGetRetiredPages, handle,
                  nvml.NVML_PAGE_RETIREMENT_CAUSE_DOUBLE_BIT_ECC_ERROR)
    pending = read("retired_pages.pending", nvml.nvmlDeviceGetRetiredPagesPendingStatus, handle)
    remap = read("remapped_rows", nvml.nvmlDeviceGetRemappedRows, handle)
    power_mw = read("power_draw", nvml.nvmlDeviceGetPowerUsage, handle)
    limit_mw = read("power_limit", nvml.nvmlDeviceGetEnforcedPowerLimit, handle)
    reasons_getter = getattr(nvml, "nvmlDeviceGetCurrentClocksEventReasons", None) or getattr(
        nvml, "nvmlDeviceGetCurrentClocksThrottleReasons"
    )
    reasons = read("clock_event_reasons", reasons_getter, handle)
    return {
        "index": index,
        "name": _text(read("name", nvml.nvmlDeviceGetName, handle) or "") or None,
        "uuid": _text(read("uuid", nvml.nvmlDeviceGetUUID, handle) or "") or None,
        "bus_id": _text(pci.busId) if pci is not None else None,
        "ecc": {
            "volatile": _ecc(nvml, handle, nvml.NVML_VOLATILE_ECC, read, "volatile"),
            "aggregate": _ecc(nvml, handle, nvml.NVML_AGGREGATE_ECC, read, "aggregate"),
        },
        "retired_pages": {
            "single_bit": len(single) if single is not None else None,
            "double_bit": len(double) if double is not None else None,
            "pending": bool(pending) if pending is not None else None,
        },
        "remapped_rows": None if remap is None else {
            "correctable": int(remap[0]), "uncorrectable": int(remap[1]),
            "pending": bool(remap[2]), "failure": bool(remap[3]),
        },
        "temperature_c": read("temperature", nvml.nvmlDeviceGetTemperature, handle, nvml.NVML_TEMPERATURE_GPU),
        "power_draw_w": power_mw / 1000.0 if power_mw is not None else None,
        "power_limit_w": limit_mw / 1000.0 if limit_mw is not None else None,
        "clock_event_reasons": None if reasons is None else {
            name: bool(int(reasons) & bit) for name, bit in CLOCK_REASON_BITS.items()
        },
        "errors": errors,
    }


#: Xid events kept from one listening window; a GPU storming Xids must not flood the document.
MAX_XID_EVENTS = 1000


def _xid_events(nvml: Any, count: int, wait_s: float, errors: dict[str, str]) -> list[dict[str, Any]]:
    """Xid events NVML delivers while we listen. NVML keeps no history (the kernel log
    does), so this only sees what happens during ``wait_s`` seconds; 0 skips it."""
    if wait_s <= 0 or not count:
        return []
    import time

    try:
        event_set = nvml.nvmlEventSetCreate()
    except Exception as exc:
        errors["xid_events"] = str(exc)
        return []
    events: list[dict[str, Any]] = []
    try:
        for index in range(count):
            try:
                handle = nvml.nvmlDeviceGetHandleByIndex(index)
                nvml.nvmlDeviceRegisterEvents(handle, nvml.nvmlEventTypeXidCriticalError, event_set)
            except Exception as exc:
                errors[f"xid_events.gpu{index}"] = str(exc)
        timeout_error = getattr(nvml, "NVMLError_Timeout", None)
        deadline = time.monotonic() + wait_s
        while len(events) < MAX_XID_EVENTS:
            left_ms = int((deadline - time.monotonic()) * 1000)
            if left_ms <= 0:
                break
            try:
                data = nvml.nvmlEventSetWait_v2(event_set, left_ms)
            except Exception as exc:
                if timeout_error is None or not isinstance(exc, timeout_error):
                    errors["xid_events"] = str(exc)
                break
            try:
                gpu = int(nvml.nvmlDeviceGetIndex(data.device))
            except Exception:
                gpu = None
            events.append({"gpu": gpu, "xid": int(data.eventData), "time": iso(datetime.now(UTC))})
    finally:
        try:
            nvml.nvmlEventSetFree(event_set)
        except Exception:
            pass
    return events


def collect(nvml: Any | None = None, *, xid_wait: float = 0.0) -> dict[str, Any]:
    """Read every GPU through NVML. Never raises: a node without a driver (or with a GPU
    that fell off the bus) yields a document whose ``error`` says so, which is evidence.
    ``xid_wait`` listens that many seconds for Xid events (``xid_events``)."""
    document: dict[str, Any] = {
        "format": NVML_FORMAT, "collected": iso(datetime.now(UTC)),
        "driver_version": None, "cuda_driver_version": None, "gpus": [], "xid_events": [], "error": None,
    }
    try:
        if nvml is None:
            import pynvml as nvml  # nvidia-ml-py
        nvml.nvmlInit()
    except Exception as exc:
        document["error"] = f"{type(exc).__name__}: {exc}"
        return document
    try:
        errors = document.setdefault("errors", {})
        read = _reader(errors)
        document["driver_version"] = _text(read("driver_version", nvml.nvmlSystemGetDriverVersion) or "") or None
        document["cuda_driver_version"] = read("cuda_driver_version", nvml.nvmlSystemGetCudaDriverVersion)
        count = read("device_count", nvml.nvmlDeviceGetCount)
        document["gpus"] = [_gpu(nvml, index) for index in range(count or 0)]
        document["xid_events"] = _xid_events(nvml, count or 0, xid_wait, errors)
    finally:
        try:
            nvml.nvmlShutdown()
        except Exception:
            pass
    return document


# ----------------------------------------------------------------------------- parser (pure)


def _int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _num(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value)


def _flag(value: Any) -> bool | None:
    return value if isinstance(value, bool) else None


def _ecc_counts(raw: Any) -> EccCounts | None:
    if not isinstance(raw, dict):
        return None
    return EccCounts(
        sram_correctable=_int(raw.get("sram_correctable")),
        sram_uncorrectable=_int(raw.get("sram_uncorrectable")),
        dram_correctable=_int(raw.get("dram_correctable")),
        dram_uncorrectable=_int(raw.get("dram_uncorrectable")),
        # NVML's totals are the pre-Ampere single/double-bit totals' equivalent.
        single_bit_total=_int(raw.get("total_correctable")),
        double_bit_total=_int(raw.get("total_uncorrectable")),
    )


def _gpu_status(raw: dict[str, Any], position: int, gaps: list[Gap]) -> GpuStatus:
    gpu = GpuStatus(index=_int(raw.get("index")) if _int(raw.get("index")) is not None else position)
    ids = normalise_bus_id(raw.get("bus_id")) if isinstance(raw.get("bus_id"), str) else None
    if ids:
        gpu.bus_id, gpu.pci = ids
    gpu.product = raw.get("name") if isinstance(raw.get("name"), str) else None
    gpu.uuid = raw.get("uuid") if isinstance(raw.get("uuid"), str) else None
    ecc = raw.get("ecc") if isinstance(raw.get("ecc"), dict) else {}
    gpu.ecc_volatile = _ecc_counts(ecc.get("volatile"))
    gpu.ecc_aggregate = _ecc_counts(ecc.get("aggregate"))
    pages = raw.get("retired_pages")
    if isinstance(pages, dict):
        gpu.retired_pages = RetiredPages(
            single_bit=_int(pages.get("single_bit")), double_bit=_int(pages.get("double_bit")),
            pending_retirement=_flag(pages.get("pending")),
        )
    remap = raw.get("remapped_rows")
    if isinstance(remap, dict):
        gpu.remapped_rows = RemappedRows(
            correctable=_int(remap.get("correctable")), uncorrectable=_int(remap.get("uncorrectable")),
            pending=_flag(remap.get("pending")), failure=_flag(remap.get("failure")),
        )
    gpu.temperature_c = _num(raw.get("temperature_c"))
    gpu.power_draw_w = _num(raw.get("power_draw_w"))
    gpu.power_limit_w = _num(raw.get("power_limit_w"))
    reasons = raw.get("clock_event_reasons")
    if isinstance(reasons, dict):
        gpu.clock_event_reasons = {str(k): v for k, v in reasons.items() if isinstance(v, bool)}
    errors = raw.get("errors")
    if isinstance(errors, dict) and "handle" in errors:
        gaps.append(Gap(f"GPU {gpu.index}: NVML could not open it ({errors['handle']})"))
    return gpu


def parse(source: LineSource) -> NvidiaSmiReport:
    """Read an ``nvml.json`` document into the nvidia-smi GPU model."""
    report = NvidiaSmiReport()
    try:
        raw = json.loads(join_text(source))
    except (json.JSONDecodeError, RecursionError) as exc:
        report.gaps.append(Gap(f"nvml.json is not valid JSON: {exc}"))
        return report
    if not isinstance(raw, dict):
        report.gaps.append(Gap("nvml.json is not a JSON object"))
        return report
    if raw.get("format") != NVML_FORMAT:
        report.gaps.append(Gap(f"unexpected format {raw.get('format')!r} (expected {NVML_FORMAT})"))
    report.timestamp = parse_any(raw.get("collected"))
    report.driver_version = raw.get("driver_version") if isinstance(raw.get("driver_version"), str) else None
    if isinstance(raw.get("error"), str):
        # NVML itself failed on the node: the nvidia-smi equivalent of "Failed to initialize NVML".
        report.errors.append(SmiMessage(raw["error"]))
    gpus = raw.get("gpus") if isinstance(raw.get("gpus"), list) else []
    report.gpus = [_gpu_status(g, i, report.gaps) for i, g in enumerate(gpus) if isinstance(g, dict)]
    report.attached_gpus = len(report.gpus)
    return report


def detect(sample: str) -> float:
    return 0.95 if f'"{NVML_FORMAT}"' in sample[:2000] else 0.0


KIND = register(
    Kind(
        name="nvml-json",
        description="nvml.json: a node-side NVML reading (format spikeops-nvml/1, docs/bundle.md)",
        command="python3 -m spikeops.probes.nvml",
        parse=parse,
        detect=detect,
        summarize=summarize_report,
    )
)


if __name__ == "__main__":  # the probe as run on a node
    json.dump(collect(), sys.stdout, indent=2)
    sys.stdout.write("\n")

#: Only where spikeops is installed on the node; elsewhere the text probes serve.
REMOTE = register_remote(RemoteProbe(
    name="nvml", filename="nvml.json",
    command=("command -v spikeops >/dev/null 2>&1 || { echo 'spikeops: not installed on this node' >&2; "
             "exit 127; }; spikeops node-report"),
    kind="nvml-json", order=90, max_bytes=8 << 20,
))
