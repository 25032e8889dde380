"""nvml.json: the NVML probe's document and its parse into the nvidia-smi GPU model.

No GPU (and no libnvidia-ml) exists on the CI machine, so ``collect`` is exercised twice:
for real, where NVML is absent (the document must say so instead of raising), and through a
stand-in NVML module that returns what nvml.h documents, to check the mapping of counters,
bit masks and "not supported" answers.
"""

from __future__ import annotations

import json
from types import SimpleNamespace

from hypothesis import given, settings, strategies as st

from spikeops.probes import nvml
from spikeops.reading import read_evidence
from tests.conftest import synthetic


class NotSupported(Exception):
    def __str__(self) -> str:
        return "Not Supported"


def fake_nvml(uncorrectable_dram: int = 0) -> SimpleNamespace:
    constants = dict(
        NVML_MEMORY_LOCATION_DRAM=8, NVML_MEMORY_LOCATION_SRAM=9,
        NVML_MEMORY_ERROR_TYPE_CORRECTED=0, NVML_MEMORY_ERROR_TYPE_UNCORRECTED=1,
        NVML_VOLATILE_ECC=0, NVML_AGGREGATE_ECC=1,
        NVML_PAGE_RETIREMENT_CAUSE_MULTIPLE_SINGLE_BIT_ECC_ERRORS=0,
        NVML_PAGE_RETIREMENT_CAUSE_DOUBLE_BIT_ECC_ERROR=1, NVML_TEMPERATURE_GPU=0,
    )

    def counter(handle, error_type, counter_type, location):
        if location == 8 and error_type == 1:
            return uncorrectable_dram
        return 0

    def retired(handle, cause):
        raise NotSupported()  # Hopper: page retirement replaced by row remapping

    return SimpleNamespace(
        **constants,
        nvmlInit=lambda: None, nvmlShutdown=lambda: None,
        nvmlSystemGetDriverVersion=lambda: "550.90.07", nvmlSystemGetCudaDriverVersion=lambda: 12040,
        nvmlDeviceGetCount=lambda: 2, nvmlDeviceGetHandleByIndex=lambda i: f"h{i}",
        nvmlDeviceGetName=lambda h: "NVIDIA H100 80GB HBM3",
        nvmlDeviceGetUUID=lambda h: f"GPU-{h}",
        nvmlDeviceGetPciInfo=lambda h: SimpleNamespace(busId=b"00000000:19:00.0" if h == "h0" else b"00000000:3B:00.0"),
        nvmlDeviceGetMemoryErrorCounter=counter,
        nvmlDeviceGetTotalEccErrors=lambda h, t, c: uncorrectable_dram if t == 1 else 0,
        nvmlDeviceGetRetiredPages=retired,
        nvmlDeviceGetRetiredPagesPendingStatus=lambda h: 0,
        nvmlDeviceGetRemappedRows=lambda h: (0, 2, 1, 0) if h == "h1" else (0, 0, 0, 0),
        nvmlDeviceGetTemperature=lambda h, sensor: 61,
        nvmlDeviceGetPowerUsage=lambda h: 612_450,
        nvmlDeviceGetEnforcedPowerLimit=lambda h: 700_000,
        nvmlDeviceGetCurrentClocksEventReasons=lambda h: 0x40 | 0x8 if h == "h1" else 0x0,
    )


def test_collect_without_nvml_reports_instead_of_raising():
    document = nvml.collect()
    assert document["format"] == "spikeops-nvml/1"
    assert document["gpus"] == []
    assert "NVML" in document["error"] or "nvml" in document["error"]


def test_collect_maps_counters_masks_and_unsupported_fields():
    document = nvml.collect(fake_nvml(uncorrectable_dram=3))
    assert document["driver_version"] == "550.90.07"
    first, second = document["gpus"]
    assert first["bus_id"] == "00000000:19:00.0"
    assert first["ecc"]["volatile"]["dram_uncorrectable"] == 3
    assert first["retired_pages"]["single_bit"] is None  # not supported, not zero
    assert first["errors"]["retired_pages.single_bit"] == "Not Supported"
    assert first["power_draw_w"] == 612.45
    assert second["remapped_rows"] == {"correctable": 0, "uncorrectable": 2, "pending": True, "failure": False}
    assert second["clock_event_reasons"]["hw_thermal_slowdown"] is True
    assert second["clock_event_reasons"]["hw_slowdown"] is True
    assert second["clock_event_reasons"]["sw_power_cap"] is False


def test_parse_round_trips_collect_into_the_gpu_model():
    report = nvml.parse(json.dumps(nvml.collect(fake_nvml(uncorrectable_dram=3))))
    assert report.driver_version == "550.90.07"
    assert [gpu.pci for gpu in report.gpus] == ["0000:19:00", "0000:3b:00"]
    assert report.gpus[0].uncorrectable_ecc() == 3
    assert report.gpus[1].remapped_rows.pending is True
    assert report.gpus[1].thermal_throttling is True
    assert report.gpu_by_pci("PCI:0000:3b:00") is report.gpus[1]


def test_synthetic_document_is_detected_and_read():
    reading = read_evidence(synthetic("nvml/nvml-h100x2-ecc.json"))
    assert reading.kind.name == "nvml-json"
    gpu = reading.result.gpus[1]
    assert gpu.ecc_aggregate.dram_uncorrectable == 1
    assert gpu.temperature_c == 84.0
    assert reading.gaps == []


def test_failed_nvml_is_an_error_message_not_a_gap():
    report = nvml.parse(json.dumps(nvml.collect()))
    assert report.gpus == []
    assert report.errors and "NVML" in report.errors[0].text


@settings(deadline=None)
@given(st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=5),
                    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=5),
                    max_leaves=30))
def test_parse_never_raises_on_any_json(value):
    document = {"format": "spikeops-nvml/1", "gpus": [value, {"ecc": value, "remapped_rows": value}]}
    nvml.parse(json.dumps(document))


class NvmlTimeout(Exception):
    pass


def _with_events(base: SimpleNamespace, xids: list[tuple[str, int]]) -> SimpleNamespace:
    """NVML's event API: one event per wait, then NVML_ERROR_TIMEOUT."""
    queue = list(xids)
    registered: list[str] = []

    def wait(event_set, timeout_ms):
        if not queue:
            raise NvmlTimeout()
        handle, code = queue.pop(0)
        return SimpleNamespace(device=handle, eventData=code)

    base.nvmlEventTypeXidCriticalError = 8
    base.NVMLError_Timeout = NvmlTimeout
    base.nvmlEventSetCreate = lambda: "set"
    base.nvmlDeviceRegisterEvents = lambda handle, kind, event_set: registered.append(handle)
    base.nvmlEventSetWait_v2 = wait
    base.nvmlEventSetFree = lambda event_set: None
    base.nvmlDeviceGetIndex = lambda handle: int(handle[1:])
    base.registered = registered
    return base


def test_xid_events_nvml_delivers_while_listening_are_recorded():
    fake = _with_events(fake_nvml(), [("h1", 79), ("h0", 48)])
    document = nvml.collect(fake, xid_wait=0.5)
    assert fake.registered == ["h0", "h1"]
    assert [(e["gpu"], e["xid"]) for e in document["xid_events"]] == [(1, 79), (0, 48)]
    assert "xid_events" not in document["errors"]
    # not listening is the default: NVML keeps no history, so nothing is claimed
    assert nvml.collect(_with_events(fake_nvml(), [("h0", 79)]))["xid_events"] == []


def test_node_report_prints_a_document_the_parser_reads(capsys):
    from spikeops.cli import main

    assert main(["node-report"]) == 0
    text = capsys.readouterr().out
    report = nvml.parse(text)
    assert json.loads(text)["format"] == "spikeops-nvml/1"
    assert report.errors  # no NVML on this machine: the document says so, which is evidence
