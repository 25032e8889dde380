"""nvidia-smi in all five forms: -q text, -q -x XML, --query CSV, the default table, nvlink -s.

Every real fixture is read and its hand-checked values asserted; synthetic inputs cover the
forms the real fixtures lack (pre-Ampere ECC, XML, noheader CSV, inactive NVLinks).
"""

from __future__ import annotations

import re
from datetime import UTC, datetime
from typing import Any

import pytest
from hypothesis import given, settings, strategies as st

from spikeops.jsonable import to_jsonable
from spikeops.probes import nvidia_smi as smi
from spikeops.probes.base import Gap
from tests.conftest import real_text, synthetic_text

REAL = "nvidia-smi/"
SYN = "nvidia-smi/"


def q(name: str) -> smi.NvidiaSmiReport:
    return smi.parse_q(real_text(REAL + name))


# --------------------------------------------------------------------------- -q, real


def test_h100x8_535_all_gpus_and_header():
    report = q("h100x8-q-535.161.08_gpud.txt")
    assert report.timestamp == datetime(2024, 7, 31, 11, 22, 39, tzinfo=UTC)
    assert (report.driver_version, report.cuda_version, report.attached_gpus) == ("535.161.08", "12.2", 8)
    assert [gpu.bus_id for gpu in report.gpus] == [
        "00000000:19:00.0", "00000000:3B:00.0", "00000000:4C:00.0", "00000000:5D:00.0",
        "00000000:9B:00.0", "00000000:BB:00.0", "00000000:CB:00.0", "00000000:DB:00.0",
    ]
    assert [gpu.index for gpu in report.gpus] == list(range(8))
    assert [gpu.minor_number for gpu in report.gpus] == list(range(8))
    assert [gpu.pcie_replays for gpu in report.gpus] == [67, 63, 52, 43, 49, 53, 82, 67]
    assert [gpu.temperature_c for gpu in report.gpus] == [29, 29, 30, 30, 31, 32, 32, 31]
    assert report.gaps == []
    assert report.errors == []


def test_h100x8_535_first_gpu_fields():
    gpu = q("h100x8-q-535.161.08_gpud.txt").gpus[0]
    assert gpu.pci == "0000:19:00"  # what a kernel Xid line prints for this GPU
    assert gpu.product == "NVIDIA H100 80GB HBM3"
    assert gpu.serial == "1650124031592"
    assert gpu.uuid == "GPU-ee7954ec-da95-fd7a-ddfd-c6b32cc2f8aa"
    assert gpu.ecc_mode == "Enabled" and gpu.mig_mode == "Disabled"
    assert gpu.performance_state == "P0"
    # Hopper's split SRAM counters: both parts kept, and the sum.
    assert gpu.ecc_volatile is not None and gpu.ecc_aggregate is not None
    assert gpu.ecc_volatile.sram_uncorrectable_parity == 0
    assert gpu.ecc_volatile.sram_uncorrectable_secded == 0
    assert gpu.ecc_volatile.sram_uncorrectable == 0
    assert gpu.ecc_aggregate.sram_threshold_exceeded is False
    assert gpu.ecc_aggregate.sram_uncorrectable_sources == {
        "l2": 0, "sm": 0, "microcontroller": 0, "pcie": 0, "other": 0,
    }
    assert gpu.uncorrectable_ecc() == 0 and gpu.correctable_ecc() == 0
    # The idle node has the power brake engaged on every GPU (it is in the capture).
    assert gpu.clock_event_reasons["hw_slowdown"] is True
    assert gpu.clock_event_reasons["hw_power_brake_slowdown"] is True
    assert gpu.clock_event_reasons["hw_thermal_slowdown"] is False
    assert gpu.clock_event_reasons["gpu_idle"] is False
    assert gpu.power_throttling is True and gpu.thermal_throttling is False
    assert gpu.temperature_thresholds["tlimit"] == 56
    assert gpu.temperature_thresholds["shutdown_tlimit"] == -8  # a signed margin
    assert gpu.temperature_thresholds["slowdown_tlimit"] == -2
    assert gpu.temperature_thresholds["max_operating_tlimit"] == 0
    assert gpu.memory_temperature_c == 39
    assert gpu.power_draw_w == 67.74 and gpu.power_limit_w == 700.0
    assert gpu.retired_pages == smi.RetiredPages(line=gpu.retired_pages.line)  # all N/A -> None
    assert gpu.remapped_rows is not None
    assert (gpu.remapped_rows.correctable, gpu.remapped_rows.uncorrectable) == (0, 0)
    assert gpu.remapped_rows.pending is False and gpu.remapped_rows.failure is False
    assert gpu.remapped_rows.histogram["max"] == 2560
    assert gpu.processes == []
    assert gpu.line == 9


def test_h100x8_last_gpu_and_lookup_by_kernel_address():
    report = q("h100x8-q-535.161.08_gpud.txt")
    gpu = report.gpu_by_pci("PCI:0000:db:00")
    assert gpu is report.gpus[7]
    assert gpu.serial == "1650124007084" and gpu.uuid == "GPU-b0fe4996-1f7c-91f6-0ccd-08ae3b7e23c5"
    assert gpu.power_draw_w == 72.27
    assert report.gpu_by_pci("0000:01:00") is None


def test_a10_remapped_rows_uncorrectable_pending():
    report = q("a10-q-remapped-rows-uncorrectable4-pending_gpud.txt")
    assert report.timestamp == datetime(2024, 9, 25, 10, 40, 24, tzinfo=UTC)
    assert report.driver_version == "535.129.03"
    [gpu] = report.gpus
    assert gpu.bus_id == "00000000:07:00.0" and gpu.pci == "0000:07:00"
    assert gpu.product == "NVIDIA A10"
    rows = gpu.remapped_rows
    assert rows is not None
    assert (rows.correctable, rows.uncorrectable, rows.pending, rows.failure) == (0, 4, True, False)
    assert rows.histogram == {"max": 192, "high": 0, "partial": 0, "low": 0, "none": 0}
    # Ampere, unsplit SRAM counters, all zero: the ECC counters do not show the bad rows.
    assert gpu.ecc_volatile is not None and gpu.ecc_volatile.sram_uncorrectable == 0
    assert gpu.ecc_volatile.sram_uncorrectable_parity is None
    assert gpu.uncorrectable_ecc() == 0
    assert gpu.temperature_c == 33 and gpu.memory_temperature_c is None
    assert gpu.temperature_thresholds["shutdown"] == 101
    assert gpu.temperature_thresholds["slowdown"] == 98
    assert gpu.temperature_thresholds["max_operating"] == 91
    assert gpu.temperature_thresholds["tlimit"] is None
    assert gpu.power_draw_w == 43.89 and gpu.power_limit_w == 150.0
    assert gpu.performance_state == "P8" and gpu.fan_speed_pct == 0
    assert gpu.clock_event_reasons["gpu_idle"] is True
    assert gpu.thermal_throttling is False and gpu.power_throttling is False
    assert gpu.mig_mode is None  # N/A
    assert report.gaps == []
    summary = "\n".join(smi.summarize_report(report))
    assert "uncorrectable 4" in summary and "PENDING" in summary


def test_a100_excerpt_with_elisions():
    report = q("a100-sxm4-80gb-q-ecc-remap-pending_ml-engineering.txt")
    assert report.timestamp == datetime(2023, 6, 7, 19, 32, 16, tzinfo=UTC)
    assert (report.driver_version, report.cuda_version, report.attached_gpus) == ("510.73.08", "11.6", 8)
    [gpu] = report.gpus
    assert gpu.bus_id == "00000000:10:1C.0"
    assert gpu.pci == "0000:10:1c"  # the Xid 63 line of the same incident says PCI:0000:10:1c
    assert gpu.product == "NVIDIA A100-SXM4-80GB"
    assert gpu.uuid is None  # elided by the author, not invented
    for ecc in (gpu.ecc_volatile, gpu.ecc_aggregate):
        assert ecc is not None
        assert ecc.dram_correctable == 177
        assert ecc.dram_uncorrectable == 0 and ecc.sram_uncorrectable == 0
        assert ecc.correctable_total() == 177 and ecc.uncorrectable_total() == 0
    rows = gpu.remapped_rows
    assert rows is not None
    assert (rows.correctable, rows.uncorrectable, rows.pending, rows.failure) == (1, 0, True, False)
    assert rows.histogram["max"] == 639 and rows.histogram["high"] == 1
    assert gpu.retired_pages is not None and gpu.retired_pages.pending is None
    elided = [gap.line for gap in report.gaps if "elided in the source" in gap.reason]
    assert elided == [8, 35]
    assert any("1 of 8 attached" in gap.reason for gap in report.gaps)


def test_h100_590_under_load():
    report = q("h100-80gb-hbm3-q-load-590.48.01_nvidia-gpu-exporter.txt")
    assert report.timestamp == datetime(2026, 7, 14, 8, 12, 53, tzinfo=UTC)
    assert (report.driver_version, report.cuda_version) == ("590.48.01", "13.1")
    [gpu] = report.gpus
    assert gpu.bus_id == "00000000:00:09.0" and gpu.pci == "0000:00:09"
    assert gpu.power_draw_w == 629.45  # Average Power Draw (no plain Power Draw on 590)
    assert gpu.power_draw_instant_w == 588.39
    assert gpu.power_limit_w == 700.0
    assert gpu.temperature_c == 59 and gpu.memory_temperature_c == 55
    assert gpu.temperature_thresholds["tlimit"] == 26
    assert gpu.pcie_replays == 9
    assert gpu.utilization_gpu_pct == 100
    assert (gpu.memory_used_mib, gpu.memory_total_mib) == (19818, 81559)
    assert gpu.clock_event_counters_us == {
        "sw_power_cap": 0, "sync_boost": 0, "sw_thermal_slowdown": 0,
        "hw_thermal_slowdown": 0, "hw_power_brake_slowdown": 0,
    }
    assert gpu.ecc_flags == {
        "channel_repair_pending": False, "tpc_repair_pending": False, "unrepairable_memory": False,
    }
    assert [(p.pid, p.name, p.used_memory_mib, p.type) for p in gpu.processes] == [
        (11327, "/root/tools/memhog", 2566, "C"),
        (11328, "/root/tools/memhog", 1542, "C"),
        (11345, "./gpu_burn", 15690, "C"),
    ]
    assert gpu.processes[0].gpu_instance_id is None and gpu.processes[0].line == 254
    assert not any(gpu.clock_event_reasons.values())
    assert report.gaps == []
    assert smi.summarize_report(report) == ["driver 590.48.01, CUDA 13.1: 1 GPU(s) of 1 attached"]


def test_h200_idle():
    [gpu] = q("h200-q-idle-590.48.01_nvidia-gpu-exporter.txt").gpus
    assert gpu.product == "NVIDIA H200"
    assert gpu.bus_id == "00000000:83:00.0"
    assert gpu.temperature_c == 28 and gpu.temperature_thresholds["tlimit"] == 59
    assert gpu.power_draw_w == 77.67
    assert gpu.memory_total_mib == 143771
    assert gpu.remapped_rows is not None and gpu.remapped_rows.histogram["max"] == 3072
    assert gpu.clock_event_reasons["gpu_idle"] is True
    assert gpu.processes == []


def test_h100_mig_devices_and_na_remapped_rows():
    report = q("h100-mig-q-load-590.48.01_nvidia-gpu-exporter.txt")
    [gpu] = report.gpus
    assert gpu.mig_mode == "Enabled"
    assert gpu.remapped_rows is None  # "Remapped Rows : N/A" on MIG
    assert [m.index for m in gpu.mig_devices] == [0, 1, 2, 3]
    assert [m.gpu_instance_id for m in gpu.mig_devices] == [2, 3, 9, 10]
    assert [m.compute_instance_id for m in gpu.mig_devices] == [0, 0, 0, 0]
    assert [m.sram_uncorrectable for m in gpu.mig_devices] == [0, 0, 0, 0]
    assert [m.memory_total_mib for m in gpu.mig_devices] == [40448, 20096, 9984, 9984]
    assert gpu.mig_devices[0].memory_used_mib == 11091 and gpu.mig_devices[0].line == 20
    # The MIG devices' own ECC blocks must not be taken for the GPU's.
    assert gpu.ecc_volatile is not None and gpu.ecc_volatile.dram_uncorrectable == 0
    assert gpu.utilization_gpu_pct is None  # N/A under MIG
    assert [(p.pid, p.gpu_instance_id, p.compute_instance_id) for p in gpu.processes] == [
        (21180, 2, 0), (21181, 2, 0), (21198, 2, 0),
    ]
    assert gpu.power_draw_w == 432.21
    assert report.gaps == []


# --------------------------------------------------------------------------- -q, synthetic and edge cases


def test_v100_pre_ampere_single_double_bit():
    report = smi.parse_q(synthetic_text(SYN + "q-v100-470-single-double-bit.txt"))
    assert report.driver_version == "470.103.01" and len(report.gpus) == 2
    first, second = report.gpus
    assert first.ecc_mode == "Enabled"  # "Ecc Mode" on R4xx
    assert first.ecc_volatile is not None and first.ecc_aggregate is not None
    assert first.ecc_volatile.single_bit_total == 3
    assert first.ecc_volatile.single_bit["device_memory"] == 3
    assert first.ecc_volatile.single_bit["texture_memory"] is None
    assert first.ecc_aggregate.single_bit == {
        "device_memory": 12, "register_file": 1, "l1_cache": 0, "l2_cache": 0,
        "texture_memory": None, "texture_shared": None, "cbu": 0,
    }
    assert first.ecc_aggregate.single_bit_total == 13
    assert first.ecc_aggregate.dram_uncorrectable is None  # not printed, so not zero
    assert first.uncorrectable_ecc() == 0 and first.correctable_ecc() == 13
    assert first.retired_pages == smi.RetiredPages(2, 0, False, None, line=first.retired_pages.line)
    assert first.remapped_rows is None
    assert first.temperature_thresholds["shutdown"] == 90
    assert first.power_limit_w == 300.0  # Enforced Power Limit
    assert second.ecc_volatile is not None and second.ecc_volatile.double_bit_total == 2
    assert second.ecc_aggregate is not None and second.ecc_aggregate.double_bit["register_file"] == 1
    assert second.uncorrectable_ecc() == 3
    assert second.retired_pages is not None
    assert (second.retired_pages.single_bit, second.retired_pages.double_bit) == (5, 1)
    assert second.retired_pages.pending is True
    assert second.thermal_throttling is True and second.power_throttling is False
    assert second.temperature_c == 86 and second.power_draw_w == 298.51
    assert [(p.pid, p.name, p.used_memory_mib, p.gpu_instance_id) for p in second.processes] == [
        (41213, "python", 31189, None)
    ]
    summary = "\n".join(smi.summarize_report(report))
    assert "uncorrectable ECC aggregate 3" in summary and "SW Thermal Slowdown" in summary


def test_truncated_q_keeps_every_gpu_read_so_far():
    text = real_text(REAL + "h100x8-q-535.161.08_gpud.txt")
    lines = text.splitlines()
    cut = "\n".join(lines[:700])  # inside GPU 3 (00000000:5D:00.0), after its PCI block
    report = smi.parse_q(cut)
    assert [gpu.bus_id for gpu in report.gpus][-1] == "00000000:5D:00.0"
    assert len(report.gpus) == 4
    assert report.gpus[2].remapped_rows is not None  # a complete GPU stays complete
    assert report.gpus[3].pcie_replays == 43
    assert report.gpus[3].remapped_rows is None  # not reached, not invented
    assert any("4 of 8 attached" in gap.reason for gap in report.gaps)


def test_stray_line_at_column_zero_does_not_end_the_gpu():
    text = real_text(REAL + "a10-q-remapped-rows-uncorrectable4-pending_gpud.txt")
    lines = text.splitlines()
    at = lines.index("    Retired Pages")
    lines.insert(at, "kernel: nvidia-modeset: stray console line")
    report = smi.parse_q("\n".join(lines))
    [gpu] = report.gpus
    assert gpu.remapped_rows is not None and gpu.remapped_rows.uncorrectable == 4
    assert gpu.temperature_c == 33
    assert [gap.line for gap in report.gaps] == [at + 1]


def test_repeated_snapshots_keep_the_last():
    text = real_text(REAL + "a10-q-remapped-rows-uncorrectable4-pending_gpud.txt")
    later = text.replace("Uncorrectable Error               : 4", "Uncorrectable Error               : 5")
    report = smi.parse_q(text + later)
    [gpu] = report.gpus
    assert gpu.remapped_rows is not None and gpu.remapped_rows.uncorrectable == 5
    assert any("earlier snapshot" in gap.reason for gap in report.gaps)


def test_gpu_lost_message_is_evidence():
    text = (
        "Unable to determine the device handle for GPU 0000:3B:00.0: Unknown Error\n"
        + real_text(REAL + "a10-q-remapped-rows-uncorrectable4-pending_gpud.txt")
    )
    report = smi.parse_q(text)
    assert [(m.line, m.text) for m in report.errors] == [
        (1, "Unable to determine the device handle for GPU 0000:3B:00.0: Unknown Error")
    ]
    assert len(report.gpus) == 1
    assert "Unknown Error" in smi.summarize_report(report)[-1]


def test_empty_and_foreign_input_are_gaps():
    assert smi.parse_q("").gaps == [Gap("no nvidia-smi -q content found")]
    assert smi.parse_q("hello\nworld\n").gpus == []


# --------------------------------------------------------------------------- XML


def test_xml_h100_dram_uncorrectable_and_hw_thermal():
    report = smi.parse_xml(synthetic_text(SYN + "xml-h100-535-dram-uncorrectable-hw-thermal.xml"))
    assert report.gaps == []  # nvidia-smi's own DOCTYPE (external DTD name) is harmless
    assert report.timestamp == datetime(2024, 11, 28, 3, 14, 7, tzinfo=UTC)
    assert (report.driver_version, report.cuda_version, report.attached_gpus) == ("535.161.08", "12.2", 2)
    first, second = report.gpus
    assert first.bus_id == "00000000:19:00.0" and first.pci == "0000:19:00" and first.line == 8
    assert second.bus_id == "00000000:3B:00.0" and second.index == 1
    assert first.ecc_volatile is not None and first.ecc_aggregate is not None
    assert first.ecc_volatile.dram_uncorrectable == 2 and first.ecc_volatile.dram_correctable == 14
    assert first.ecc_aggregate.dram_correctable == 31 and first.ecc_aggregate.sram_correctable == 1
    assert first.ecc_volatile.sram_uncorrectable == 0  # parity + SEC-DED
    assert first.uncorrectable_ecc() == 2 and first.correctable_ecc() == 32
    assert first.clock_event_reasons["hw_thermal_slowdown"] is True
    assert first.clock_event_reasons["display_clock_setting"] is False
    assert first.thermal_throttling is True and first.power_throttling is False
    rows = first.remapped_rows
    assert rows is not None and (rows.uncorrectable, rows.pending) == (1, True)
    assert rows.histogram == {"max": 2559, "high": 1, "partial": 0, "low": 0, "none": 0}
    assert first.temperature_c == 91 and first.memory_temperature_c == 95
    assert first.temperature_thresholds["tlimit"] == -3
    assert first.temperature_thresholds["shutdown_tlimit"] == -8
    assert first.power_draw_w == 411.62 and first.power_limit_w == 700.0
    assert first.pcie_replays == 12 and first.serial == "1650224031107"
    assert [(p.pid, p.name, p.used_memory_mib) for p in first.processes] == [(208812, "/usr/bin/python3", 71360)]
    assert first.retired_pages is not None and first.retired_pages.pending is None
    assert second.uncorrectable_ecc() == 0 and second.thermal_throttling is False
    assert smi.summarize_report(report)[1].startswith("  GPU 0 00000000:19:00.0 NVIDIA H100 80GB HBM3: uncorrectable ECC volatile 2")


def test_xml_v100_old_ecc_form_and_retired_pages():
    report = smi.parse_xml(synthetic_text(SYN + "xml-v100-470-single-double-bit-retired.xml"))
    assert report.gaps == []
    [gpu] = report.gpus
    assert gpu.bus_id == "00000000:07:00.0" and gpu.product == "Tesla V100-SXM2-32GB"
    assert gpu.ecc_volatile is not None and gpu.ecc_aggregate is not None
    assert gpu.ecc_volatile.double_bit_total == 2 and gpu.ecc_volatile.single_bit_total == 0
    assert gpu.ecc_aggregate.double_bit["register_file"] == 1
    assert gpu.ecc_aggregate.double_bit["texture_shared"] is None  # <texture_shm>N/A
    assert gpu.ecc_aggregate.double_bit_total == 3 and gpu.ecc_aggregate.single_bit_total == 5
    assert gpu.uncorrectable_ecc() == 3
    assert gpu.retired_pages == smi.RetiredPages(5, 1, False, False, line=gpu.line)
    assert gpu.remapped_rows is None
    assert gpu.clock_event_reasons["hw_thermal_slowdown"] and gpu.clock_event_reasons["sw_thermal_slowdown"]
    assert gpu.temperature_thresholds == {
        "shutdown": 90, "slowdown": 87, "max_operating": 83, "target": None, "memory_max_operating": 85,
    }
    assert gpu.power_draw_w == 298.51 and gpu.power_limit_w == 300.0


def test_xml_truncated_keeps_the_complete_gpu():
    text = synthetic_text(SYN + "xml-h100-535-dram-uncorrectable-hw-thermal.xml")
    cut = text[: text.index("</gpu>") + len("</gpu>") + 200]
    report = smi.parse_xml(cut)
    assert report.gpus[0].uncorrectable_ecc() == 2
    assert report.gpus[0].thermal_throttling is True
    assert any("cut short or malformed" in gap.reason for gap in report.gaps)


def test_xml_entity_expansion_is_refused():
    bomb = (
        '<?xml version="1.0"?>\n<!DOCTYPE nvidia_smi_log [\n <!ENTITY a "aaaaaaaaaa">\n'
        ' <!ENTITY b "&a;&a;&a;&a;&a;&a;&a;&a;&a;&a;">\n <!ENTITY c "&b;&b;&b;&b;&b;&b;&b;&b;&b;&b;">\n]>\n'
        "<nvidia_smi_log>\n<driver_version>535.1</driver_version>\n<timestamp>&c;</timestamp>\n</nvidia_smi_log>\n"
    )
    report = smi.parse_xml(bomb)
    assert report.driver_version == "535.1"  # read before the entity reference
    assert report.timestamp is None
    assert any("refused" in gap.reason for gap in report.gaps)
    assert any("undefined entity" in gap.reason and gap.line == 9 for gap in report.gaps)


def test_xml_foreign_and_empty():
    assert smi.parse_xml("<html><body/></html>").gaps[0].reason.startswith("not nvidia-smi XML")
    assert smi.parse_xml("").gpus == []
    assert smi.parse_xml("not xml at all").gaps


# --------------------------------------------------------------------------- CSV


def test_query_gpu_csv_230_fields():
    result = smi.parse_query_csv(real_text(REAL + "h100-80gb-hbm3-query-gpu-csv-load_nvidia-gpu-exporter.txt"))
    assert result.query == "gpu" and result.gaps == []
    assert len(result.columns) == 212 and len(result.rows) == 1
    row = result.rows[0]
    assert row.line == 2
    assert row.timestamp == datetime(2026, 7, 14, 8, 12, 53, 353000, tzinfo=UTC)
    assert row.values["power.draw"] == 631.95 and result.units["power.draw"] == "W"
    assert row.values["memory.used"] == 19818 and result.units["memory.used"] == "MiB"
    assert row.values["serial"] == "0000000000000"  # an identifier, not the number 0
    assert row.values["driver_version"] == "590.48.01"
    assert row.values["fan.speed"] is None and row.values["hostname"] is None  # [N/A]
    assert row.values["clocks_event_reasons.active"] == "0x0000000000000000"
    assert row.values["clocks_event_reasons_counters.sw_power_cap"] == 0  # "0 us"
    [gpu] = result.gpus
    assert (gpu.index, gpu.bus_id, gpu.pci) == (0, "00000000:00:09.0", "0000:00:09")
    assert gpu.temperature_c == 59 and gpu.memory_temperature_c == 54
    assert gpu.temperature_thresholds == {"tlimit": 26}
    assert gpu.power_draw_w == 631.95 and gpu.power_draw_instant_w == 625.68
    assert gpu.power_limit_w == 700.0
    assert gpu.ecc_volatile is not None and gpu.ecc_aggregate is not None
    assert gpu.ecc_volatile.dram_uncorrectable == 0 and gpu.ecc_volatile.double_bit_total == 0
    assert gpu.ecc_volatile.single_bit["register_file"] is None
    assert gpu.ecc_aggregate.sram_threshold_exceeded is False
    assert gpu.ecc_aggregate.sram_uncorrectable_sources["microcontroller"] == 0  # .sram.mcu
    assert gpu.uncorrectable_ecc() == 0
    assert gpu.remapped_rows is not None and gpu.remapped_rows.pending is False
    assert gpu.remapped_rows.histogram["max"] == 2560
    assert gpu.retired_pages is not None and gpu.retired_pages.single_bit is None
    assert len(gpu.clock_event_reasons) == 9 and not any(gpu.clock_event_reasons.values())
    assert gpu.thermal_throttling is False
    assert gpu.mig_mode == "Disabled" and gpu.performance_state == "P0"


def test_query_retired_pages_csv():
    result = smi.parse_query_csv(real_text(REAL + "h100-80gb-hbm3-query-retired-pages-csv_nvidia-gpu-exporter.txt"))
    assert result.query == "retired-pages" and result.gaps == []
    assert [row.values["retired_pages.cause"] for row in result.rows] == ["Single Bit ECC", "Double Bit ECC"]
    assert all(row.values["retired_pages.address"] is None for row in result.rows)
    assert result.rows[0].values["gpu_bus_id"] == "00000000:00:09.0"
    assert result.gpus == []
    assert "retired pages listed: 0" in smi.summarize_csv(result)[-1]


def test_query_csv_old_names_mask_and_error_states():
    result = smi.parse_query_csv(synthetic_text(SYN + "query-gpu-nounits-throttle-v100.csv"))
    assert result.gaps == []
    ok, hot, lost = result.gpus
    assert ok.ecc_volatile is not None and ok.ecc_volatile.single_bit["device_memory"] == 3
    assert ok.retired_pages is not None and ok.retired_pages.single_bit == 2
    assert ok.clock_event_reasons["gpu_idle"] is True  # from the 0x1 mask
    assert hot.uncorrectable_ecc() == 3 and hot.ecc_volatile is not None
    assert hot.ecc_volatile.double_bit_total == 2
    assert (hot.retired_pages.single_bit, hot.retired_pages.double_bit) == (5, 1)  # type: ignore[union-attr]
    assert hot.clock_event_reasons["sw_thermal_slowdown"] is True  # named
    assert hot.clock_event_reasons["hw_thermal_slowdown"] is True  # 0x40 in the mask
    assert hot.thermal_throttling is True and hot.power_draw_w == 298.51
    assert lost.temperature_c is None
    assert result.rows[2].problems["temperature.gpu"] == "Unknown Error"
    assert any("[Unknown Error]" in line for line in smi.summarize_csv(result))


def test_query_remapped_rows_and_compute_apps():
    remapped = smi.parse_query_csv(synthetic_text(SYN + "query-remapped-rows.csv"))
    assert remapped.query == "remapped-rows"
    first, second = remapped.gpus
    assert first.bus_id == "00000000:19:00.0" and first.remapped_rows is not None
    assert (first.remapped_rows.uncorrectable, first.remapped_rows.pending) == (1, True)
    assert second.remapped_rows is not None and second.remapped_rows.pending is False
    apps = smi.parse_query_csv(synthetic_text(SYN + "query-compute-apps.csv"))
    assert apps.query == "compute-apps" and apps.gpus == []
    assert [(p.pid, p.gpu_bus_id, p.used_memory_mib) for p in apps.processes] == [
        (208812, "00000000:19:00.0", 71360), (208813, "00000000:3B:00.0", 71360),
    ]


def test_noheader_csv_keeps_rows_as_lists():
    result = smi.parse_query_csv(synthetic_text(SYN + "query-gpu-noheader.csv"))
    assert result.columns == [] and result.gpus == []
    assert [row.cells for row in result.rows] == [
        [0, "00000000:19:00.0", 41, 0, "No"],
        [1, "00000000:3B:00.0", 43, 4, "Yes"],
    ]
    assert result.rows[1].values == {}
    assert len(result.gaps) == 1 and "no header" in result.gaps[0].reason
    assert 0 < smi.detect_csv(synthetic_text(SYN + "query-gpu-noheader.csv")) < 0.5


def test_csv_short_row_is_a_gap_not_a_loss():
    text = "index, temperature.gpu, power.draw [W]\n0, 41, 70.5 W\n1, 44\n2, 45, 71.0 W\n"
    result = smi.parse_query_csv(text)
    assert [gpu.temperature_c for gpu in result.gpus] == [41, 44, 45]
    assert result.gpus[1].power_draw_w is None
    assert result.gaps == [Gap("2 values for 3 columns: matched by position", 3)]


# --------------------------------------------------------------------------- default table


def test_table_550_eight_idle_h100():
    table = smi.parse_table(real_text(REAL + "h100x8-default-table-550.90.07_gpud.txt"))
    assert table.gaps == []
    assert table.timestamp == datetime(2025, 1, 20, 10, 18, 26, tzinfo=UTC)
    assert (table.smi_version, table.driver_version, table.cuda_version) == ("550.90.07", "550.90.07", "12.4")
    assert [gpu.index for gpu in table.gpus] == list(range(8))
    assert [gpu.temperature_c for gpu in table.gpus] == [27, 24, 23, 23, 27, 22, 24, 23]
    assert [gpu.power_draw_w for gpu in table.gpus] == [72, 74, 70, 72, 73, 74, 73, 72]
    first = table.gpus[0]
    assert (first.name, first.bus_id, first.pci) == ("NVIDIA H100 80GB HBM3", "00000000:19:00.0", "0000:19:00")
    assert (first.persistence, first.display_active, first.volatile_uncorrected_ecc) == ("On", "Off", 0)
    assert (first.fan_pct, first.fan_error, first.performance_state) == (None, False, "P0")
    assert (first.power_cap_w, first.memory_used_mib, first.memory_total_mib) == (700, 1, 81559)
    assert (first.utilization_gpu_pct, first.compute_mode, first.mig_mode) == (0, "Default", "Disabled")
    assert first.line == 9
    assert table.gpus[7].bus_id == "00000000:DB:00.0"
    assert table.processes == []


def test_table_590_processes():
    table = smi.parse_table(real_text(REAL + "h100-80gb-hbm3-default-table-load_nvidia-gpu-exporter.txt"))
    assert table.gaps == [] and table.driver_version == "590.48.01" and table.cuda_version == "13.1"
    [gpu] = table.gpus
    assert (gpu.temperature_c, gpu.power_draw_w, gpu.power_cap_w) == (59, 629, 700)
    assert (gpu.memory_used_mib, gpu.utilization_gpu_pct) == (19818, 100)
    assert [(p.gpu_index, p.pid, p.type, p.name, p.used_memory_mib, p.line) for p in table.processes] == [
        (0, 11327, "C", "/root/tools/memhog", 2566, 19),
        (0, 11328, "C", "/root/tools/memhog", 1542, 20),
        (0, 11345, "C", "./gpu_burn", 15690, 21),
    ]


def test_table_525_geforce_fan_err():
    table = smi.parse_table(real_text(REAL + "geforce-default-table-fan-ERR_gpud.txt"))
    assert table.gaps == [] and table.timestamp is None
    assert (table.driver_version, table.cuda_version) == ("525.125.06", "12.0")
    [gpu] = table.gpus
    assert gpu.name == "NVIDIA GeForce ..." and gpu.name_truncated is True
    assert gpu.fan_error is True and gpu.fan_pct is None and gpu.err_columns == ["fan"]
    assert (gpu.temperature_c, gpu.performance_state, gpu.power_draw_w, gpu.power_cap_w) == (38, "P5", 49, 450)
    assert (gpu.memory_used_mib, gpu.memory_total_mib) == (2021, 23028)
    assert gpu.compute_mode == "E. Process" and gpu.mig_mode is None
    assert gpu.bus_id == "00000000:01:00.0" and gpu.volatile_uncorrected_ecc == 0
    assert "fan failure" in smi.summarize_table(table)[1]


def test_table_418_two_row_layout():
    table = smi.parse_table(synthetic_text(SYN + "table-v100-418-two-row-layout.txt"))
    assert table.gaps == [] and table.driver_version == "418.67"
    assert [gpu.volatile_uncorrected_ecc for gpu in table.gpus] == [0, 2, None]
    assert [gpu.temperature_c for gpu in table.gpus] == [34, 86, None]
    assert table.gpus[2].err_columns == ["temperature", "power"] and table.gpus[2].fan_error is False
    assert table.gpus[1].mig_mode is None
    assert [(p.gpu_index, p.pid, p.name, p.used_memory_mib) for p in table.processes] == [
        (1, 41213, "python", 31189), (2, 41214, "python", 31189),
    ]


def test_table_error_banner():
    table = smi.parse_table(
        "NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver. "
        "Make sure that the latest NVIDIA driver is installed and running.\n"
    )
    assert table.gpus == [] and len(table.errors) == 1 and table.errors[0].line == 1


# --------------------------------------------------------------------------- nvlink -s


def test_nvlink_a100_twelve_links():
    status = smi.parse_nvlink_status(real_text(REAL + "a100-sxm4-80gb-nvlink-status-p4de_awsome-distributed-training.txt"))
    assert status.gaps == []
    [gpu] = status.gpus
    assert (gpu.index, gpu.name, gpu.uuid) == (0, "NVIDIA A100-SXM4-80GB", "GPU-370ec676-e407-3115-836a-8ebcb3c4f62a")
    assert [link.link for link in gpu.links] == list(range(12))
    assert {link.speed_gbps for link in gpu.links} == {25.0}
    assert gpu.inactive_links() == [] and gpu.links[11].line == 13


def test_nvlink_h100_inactive_links():
    status = smi.parse_nvlink_status(synthetic_text(SYN + "nvlink-s-h100-two-inactive.txt"))
    assert status.gaps == [] and len(status.gpus) == 2
    assert status.gpus[0].inactive_links() == []
    assert status.gpus[1].inactive_links() == [4, 5]
    assert status.gpus[1].links[3].speed_gbps == 26.562
    assert "inactive links 4, 5" in smi.summarize_nvlink(status)[1]


def test_nvlink_error_counters_fit_the_same_shape():
    text = "GPU 0: NVIDIA A100-SXM4-40GB (UUID: GPU-1)\n\t Link 0: Replay Errors: 0\n\t Link 0: CRC Errors: 7\n"
    [gpu] = smi.parse_nvlink_status(text).gpus
    assert gpu.links[0].counters == {"replay_errors": 0, "crc_errors": 7}


# --------------------------------------------------------------------------- helpers, detection


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("00000000:19:00.0", ("00000000:19:00.0", "0000:19:00")),
        ("0000:3b:00.0", ("00000000:3B:00.0", "0000:3b:00")),
        ("PCI:0000:10:1c", ("00000000:10:1C.0", "0000:10:1c")),
        ("GPU-1234", None),
    ],
)
def test_normalise_bus_id(text: str, expected: tuple[str, str] | None):
    assert smi.normalise_bus_id(text) == expected


FORMS = {
    "h100x8-q-535.161.08_gpud.txt": "q",
    "a10-q-remapped-rows-uncorrectable4-pending_gpud.txt": "q",
    "a100-sxm4-80gb-q-ecc-remap-pending_ml-engineering.txt": "q",
    "h100-80gb-hbm3-q-load-590.48.01_nvidia-gpu-exporter.txt": "q",
    "h100-mig-q-load-590.48.01_nvidia-gpu-exporter.txt": "q",
    "h200-q-idle-590.48.01_nvidia-gpu-exporter.txt": "q",
    "h100-80gb-hbm3-query-gpu-csv-load_nvidia-gpu-exporter.txt": "csv",
    "h100-80gb-hbm3-query-retired-pages-csv_nvidia-gpu-exporter.txt": "csv",
    "h100x8-default-table-550.90.07_gpud.txt": "table",
    "h100-80gb-hbm3-default-table-load_nvidia-gpu-exporter.txt": "table",
    "geforce-default-table-fan-ERR_gpud.txt": "table",
    "a100-sxm4-80gb-nvlink-status-p4de_awsome-distributed-training.txt": "nvlink",
}
DETECTORS = {"q": smi.detect_q, "xml": smi.detect_xml, "csv": smi.detect_csv,
             "table": smi.detect_table, "nvlink": smi.detect_nvlink}


@pytest.mark.parametrize(("name", "form"), sorted(FORMS.items()))
def test_detectors_claim_only_their_own_form(name: str, form: str):
    text = real_text(REAL + name)
    scores = {key: detect(text) for key, detect in DETECTORS.items()}
    assert scores[form] >= 0.9
    assert all(score == 0 for key, score in scores.items() if key != form)


def test_xml_detector_and_kinds_registered():
    assert smi.detect_xml(synthetic_text(SYN + "xml-v100-470-single-double-bit-retired.xml")) >= 0.9
    assert smi.detect_q(synthetic_text(SYN + "xml-v100-470-single-double-bit-retired.xml")) == 0
    from spikeops.probes import kind_names

    assert {"nvidia-smi-q", "nvidia-smi-xml", "nvidia-smi-csv", "nvidia-smi-table", "nvidia-smi-nvlink"} <= set(
        kind_names()
    )


# --------------------------------------------------------------------------- never raise, never lose


def _without_lines(value: Any) -> Any:
    """A parse as JSON with line numbers dropped, to compare parses of shifted inputs."""
    if isinstance(value, dict):
        return {k: _without_lines(v) for k, v in value.items() if k != "line"}
    if isinstance(value, list):
        return [_without_lines(v) for v in value]
    return value


@given(st.text(max_size=3000))
def test_parse_q_never_raises(text: str):
    assert isinstance(smi.parse_q(text).gpus, list)
    assert isinstance(smi.parse_q(text.splitlines()).gaps, list)


@given(st.text(max_size=3000))
def test_parse_xml_never_raises(text: str):
    assert isinstance(smi.parse_xml(text).gpus, list)


@given(st.text(max_size=3000))
def test_parse_query_csv_never_raises(text: str):
    assert isinstance(smi.parse_query_csv(text).rows, list)


@given(st.text(max_size=3000))
def test_parse_table_never_raises(text: str):
    assert isinstance(smi.parse_table(text).gpus, list)


@given(st.text(max_size=3000))
def test_parse_nvlink_status_never_raises(text: str):
    assert isinstance(smi.parse_nvlink_status(text).gpus, list)


@given(st.text(alphabet=st.characters(blacklist_categories=("Cs",)), max_size=200))
def test_detectors_never_raise(text: str):
    for detect in DETECTORS.values():
        assert 0 <= detect(text) <= 1


# A stray line of the kind that lands in captured output (a console message, a prompt):
# starts at column 0, is not a header key, a GPU header, a banner or an elision.
_STRAY = st.text(alphabet="abcdefXYZ !?#$%0123456789", min_size=1, max_size=60).filter(
    lambda s: not s[0].isspace() and not s.startswith("GPU")
)
_A10 = real_text(REAL + "a10-q-remapped-rows-uncorrectable4-pending_gpud.txt")
_A10_CLEAN = _without_lines(to_jsonable(smi.parse_q(_A10).gpus))


@settings(max_examples=60)
@given(st.integers(min_value=0, max_value=len(_A10.splitlines())), _STRAY)
def test_q_keeps_good_lines_around_a_bad_one(at: int, stray: str):
    lines = _A10.splitlines()
    lines.insert(at, stray)
    report = smi.parse_q("\n".join(lines))
    assert _without_lines(to_jsonable(report.gpus)) == _A10_CLEAN
    assert all(gap.line == at + 1 for gap in report.gaps)


_TABLE = real_text(REAL + "h100x8-default-table-550.90.07_gpud.txt")
_TABLE_CLEAN = _without_lines(to_jsonable(smi.parse_table(_TABLE).gpus))


@settings(max_examples=60)
@given(st.integers(min_value=1, max_value=len(_TABLE.splitlines())), _STRAY)
def test_table_keeps_good_rows_around_a_bad_line(at: int, stray: str):
    lines = _TABLE.splitlines()
    lines.insert(at, stray)
    table = smi.parse_table("\n".join(lines))
    assert _without_lines(to_jsonable(table.gpus)) == _TABLE_CLEAN
    assert [gap.line for gap in table.gaps] == [at + 1]


_CSV = synthetic_text(SYN + "query-gpu-nounits-throttle-v100.csv")
_CSV_CLEAN = _without_lines(to_jsonable(smi.parse_query_csv(_CSV).gpus))


@settings(max_examples=60)
@given(st.integers(min_value=1, max_value=len(_CSV.splitlines())), _STRAY)
def test_csv_keeps_good_rows_around_a_bad_line(at: int, stray: str):
    lines = _CSV.splitlines()
    lines.insert(at, stray)
    result = smi.parse_query_csv("\n".join(lines))
    kept = [gpu for gpu in _without_lines(to_jsonable(result.gpus)) if gpu["bus_id"] is not None]
    assert kept == _CSV_CLEAN
    assert [gap.line for gap in result.gaps] == [at + 1]


_XML = synthetic_text(SYN + "xml-h100-535-dram-uncorrectable-hw-thermal.xml")


@settings(max_examples=60)
@given(st.integers(min_value=0, max_value=len(_XML)))
def test_xml_truncated_anywhere_keeps_what_was_read(cut: int):
    report = smi.parse_xml(_XML[:cut])
    first_gpu_end = _XML.index("</gpu>") + len("</gpu>")
    if cut >= first_gpu_end:
        assert report.gpus[0].uncorrectable_ecc() == 2
    if cut < len(_XML.rstrip()):
        assert report.gaps


def test_bounded_gaps_on_garbage():
    garbage = "\n".join(f"    ~~{i}~~ : x" for i in range(5000))
    report = smi.parse_q("GPU 00000000:19:00.0\n" + garbage)
    assert len(report.gaps) <= smi.MAX_GAPS + 2
    assert re.search(r"\d+ more unreadable parts", report.gaps[-1].reason)
