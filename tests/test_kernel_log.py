"""Kernel logs in every form a node hands over: Xids, SXids and lost GPUs, with their times."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest
from hypothesis import given, settings, strategies as st

from spikeops.probes import get_kind, kernel_log
from spikeops.probes.kernel_log import normalize_pci, parse
from spikeops.textio import iter_lines
from tests.conftest import REAL, real_text, synthetic, synthetic_text


def utc(*args: int) -> datetime:
    return datetime(*args, tzinfo=UTC)


# ------------------------------------------------------------------------ real fixtures


def test_xid13_burst_keeps_every_line_with_pid_and_microseconds():
    log = parse(real_text("xid/xid13-sm-warp-oob-then-xid43_gpud.txt"))
    assert log.format == "dmesg-iso" and log.lines == 26 and log.gaps == []
    assert [e.code for e in log.xids].count(13) == 24
    assert [e.line for e in log.xids] == list(range(1, 27))
    assert {e.pci for e in log.xids} == {"0000:38:00"}
    first = log.xids[0]
    assert first.time == utc(2025, 1, 21, 2, 21, 33, 498559)
    assert first.pid is None and first.process is None  # pid='<unknown>', name=<unknown>
    assert first.message == "Graphics SM Warp Exception on (GPC 8, TPC 5, SM 0): Out Of Range Address"
    assert first.info.category == "application"
    xid43 = [e for e in log.xids if e.code == 43]
    assert [(e.line, e.pid, e.process) for e in xid43] == [
        (16, 2815167, "pt_main_thread"), (26, 2823801, "pt_main_thread")]
    assert xid43[0].time == utc(2025, 1, 21, 2, 21, 33, 502278)
    assert xid43[1].time == utc(2025, 1, 21, 2, 44, 0, 566421)
    assert xid43[1].message == "Ch 00000008"
    assert xid43[0].text.startswith("kern  :warn  : 2025-01-21T02:21:33,502278+00:00 NVRM: Xid")
    assert log.gpu_lost == [] and log.sxids == []


def test_xid119_gsp_timeouts_and_reset_required_dmesg_ctime():
    log = parse(real_text("xid/xid119-gsp-rpc-timeout-xe9680_gpud.txt"))
    assert log.format == "dmesg-ctime" and log.gaps == []
    assert [(e.line, e.code, e.pid, e.process) for e in log.xids] == [
        (3, 119, 2024380, "nvidia-smi"),
        (38, 119, 2024380, "nvidia-smi"),
        (40, 119, 2024380, "nvidia-smi"),
        (42, 119, 1263500, "cache_mgr_main"),
        (43, 119, 1240590, "gpud"),
    ]
    assert [e.time for e in log.xids] == [
        utc(2025, 2, 23, 16, 24, 18), utc(2025, 2, 23, 16, 24, 24), utc(2025, 2, 23, 16, 24, 30),
        utc(2025, 2, 23, 16, 27, 12), utc(2025, 2, 23, 16, 30, 13)]
    assert log.xids[0].pci == "0000:9b:00"
    assert log.xids[0].message.startswith("Timeout after 6s of waiting for RPC response from GPU4 GSP!")
    assert log.xids[0].info.implicates_gpu
    [lost] = log.gpu_lost
    assert (lost.line, lost.reason, lost.pci, lost.time) == (
        41, "reset_required", "0000:9b:00", utc(2025, 2, 23, 16, 24, 36))


def test_quoted_ctime_xid13_then_xid109():
    log = parse(real_text("xid/xid13-illegal-instr-then-xid109-ctx-switch-timeout_gpud.txt"))
    assert log.format == "dmesg-ctime" and log.gaps == []
    assert [(e.line, e.code) for e in log.xids] == [(2, 13), (3, 13), (4, 13), (5, 109)]
    assert all(e.pid is None and e.process is None for e in log.xids[:3])
    last = log.xids[-1]
    assert (last.pid, last.process, last.pci) == (1797828, "pt_main_thread", "0000:cb:00")
    assert last.time == utc(2024, 8, 30, 11, 43, 14)
    assert last.message == "Ch 00000008, errorString CTX SWITCH TIMEOUT, Info 0x58005"
    assert log.xids[0].text.startswith("> [Fri Aug 30 11:43:09 2024]")  # cites the line as written
    assert log.gpu_lost == []


def test_bare_xid63_line_without_timestamp():
    log = parse(real_text("xid/xid63-row-remapper-a100_ml-engineering.txt"))
    assert log.format == "bare" and log.gaps == []
    [xid] = log.xids
    assert (xid.code, xid.pci, xid.pid, xid.process) == (63, "0000:10:1c", 1896, None)
    assert xid.message == "Row Remapper: New row marked for remapping, reset gpu to activate."
    assert xid.time is None and xid.uptime_s is None
    assert xid.info.memory_related and not xid.info.implicates_gpu
    assert log.unknown_time_xids() == [xid]
    assert log.xids_between(utc(2000, 1, 1), utc(2100, 1, 1)) == []


def test_quoted_plain_dmesg_xid79_and_nvswitch_sxids():
    log = parse(real_text("xid/xid79-fallen-off-bus-with-nvswitch-sxid20034_gpud.txt"))
    assert log.format == "dmesg" and not log.boot_time_known and log.gaps == []
    [xid] = log.xids
    assert (xid.line, xid.code, xid.pci, xid.time, xid.uptime_s) == (5, 79, "0000:91:00", None, 6781741.548779)
    assert xid.message == "GPU has fallen off the bus."
    [lost] = log.gpu_lost
    assert (lost.line, lost.reason, lost.pci) == (7, "fallen_off_bus", "0000:91:00")
    assert [(e.line, e.switch, e.pci, e.severity, e.link) for e in log.sxids] == [
        (11, "nvidia-nvswitch1", "0000:06:00", "Fatal", 48),
        (13, "nvidia-nvswitch0", "0000:05:00", "Fatal", 63),
        (15, "nvidia-nvswitch2", "0000:07:00", None, None),
        (17, "nvidia-nvswitch0", "0000:05:00", None, None),
        (19, "nvidia-nvswitch2", "0000:07:00", "Fatal", 37),
        (21, "nvidia-nvswitch0", "0000:05:00", "Fatal", 62),
        (23, "nvidia-nvswitch2", "0000:07:00", None, None),
        (25, "nvidia-nvswitch0", "0000:05:00", None, None),
    ]
    assert {e.code for e in log.sxids} == {20034}
    assert log.sxids[0].message == "Link 48 LTSSM Fault Up"
    assert log.sxids[2].message == "Severity 1 Engine instance 60 Sub-engine instance 00"
    assert log.sxids[0].info.fatal and log.sxids[0].uptime_s == 6781753.400584


def test_plain_dmesg_on_the_wall_clock_with_a_boot_time():
    text = real_text("xid/xid79-fallen-off-bus-with-nvswitch-sxid20034_gpud.txt")
    log = parse(text, boot_time=datetime(2025, 1, 1))  # naive: UTC per the spec
    assert log.boot_time_known
    # 6781741.548779 s = 78 days 11:49:01.548779
    assert log.xids[0].time == utc(2025, 3, 20, 11, 49, 1, 548779)
    assert log.xids_between(utc(2025, 3, 20, 11), utc(2025, 3, 20, 12)) == log.xids
    assert log.unknown_time_xids() == []


def test_crash_dump_continuation_lines_are_joined():
    log = parse(real_text("xid/xid79-h100-fallen-off-bus-crash-dump_nolebase.txt"))
    assert log.format == "dmesg" and log.gaps == []
    [xid] = log.xids
    assert (xid.line, xid.code, xid.pci, xid.uptime_s) == (3, 79, "0000:5d:00", 4254.19786)
    assert [(e.line, e.reason, e.pci) for e in log.gpu_lost] == [
        (4, "fallen_off_bus", "0000:5d:00"),
        (6, "crash_dump", "0000:5d:00"),  # the address comes from the driver's lines just before
    ]
    assert "nvidia-bug-report.sh" in log.gpu_lost[1].text
    assert "kernel module is unloaded" in log.gpu_lost[1].text


def test_fallen_off_bus_wrapped_over_three_lines_and_probe_failure():
    log = parse(real_text("xid/h100-fallen-off-bus-not-responding-probe-failed-dmesg_nolebase.txt"))
    assert log.format == "dmesg" and log.xids == [] and log.gaps == []
    assert [(e.line, e.reason, e.pci, e.uptime_s) for e in log.gpu_lost] == [
        (1, "fallen_off_bus", "0000:5d:00", 14387.209961),
        (4, "probe_failed", "0000:5d:00", 14387.210134),
    ]
    assert "not responding to commands" in log.gpu_lost[0].text


def test_syslog_pieces_with_one_stamp_are_one_record():
    text = real_text("xid/h100-fallen-off-bus-not-responding-syslog-with-nvswitch-probe_nolebase.txt")
    log = parse(text)
    assert log.format == "syslog" and log.gaps == []
    assert [(e.line, e.reason, e.pci, e.time) for e in log.gpu_lost] == [
        (3, "fallen_off_bus", "0000:5d:00", None),  # no year: time unknown
        (6, "probe_failed", "0000:5d:00", None),
    ]
    assert log.gpu_lost[0].uptime_s == 17257.355375
    dated = parse(text, year=2024)
    assert dated.gpu_lost[0].time == utc(2024, 1, 3, 7, 39, 45)


# ------------------------------------------------------------------- synthetic fixtures


def test_journalctl_short_iso_precise():
    log = parse(synthetic_text("kernel-log/journalctl-k-short-iso-precise.txt"))
    assert log.format == "journal" and log.gaps == []  # the "-- Boot --" marker is not a gap
    assert [(e.line, e.code, e.pid, e.process) for e in log.xids] == [
        (6, 48, 48211, "python3"), (7, 63, 48211, "python3"), (8, 94, 48211, "python3")]
    assert log.xids[0].time == utc(2026, 11, 29, 18, 1, 2, 123471)
    assert [(e.line, e.reason, e.pci) for e in log.gpu_lost] == [(9, "crash_dump", "0000:9b:00")]
    assert [(e.line, e.code, e.severity, e.link) for e in log.sxids] == [
        (12, 12028, "Non-fatal", 33), (13, 12028, None, None)]


def test_dmesg_iso_without_decode_prefix_and_mig_xid():
    log = parse(synthetic_text("kernel-log/dmesg-time-format-iso.txt"))
    assert log.format == "dmesg-iso" and log.gaps == []
    assert [(e.line, e.code) for e in log.xids] == [(3, 31), (4, 43), (6, 94)]
    mig = log.xids[2]
    assert (mig.pci, mig.gpu_instance, mig.compute_instance) == ("0000:86:00", 2, 0)
    assert mig.time == utc(2026, 11, 29, 18, 2, 11, 321)
    assert [(e.line, e.reason, e.pci) for e in log.gpu_lost] == [
        (7, "fallen_off_bus", "0000:af:00"), (10, "probe_failed", "0000:af:00")]


def test_plain_dmesg_with_boot_time():
    log = parse(synthetic_text("kernel-log/dmesg-plain-boot-time.txt"), boot_time=utc(2026, 11, 29, 12))
    assert [(e.line, e.code, e.time) for e in log.xids] == [
        (7, 79, utc(2026, 11, 29, 18, 1, 2, 123501)),
        (10, 74, utc(2026, 11, 29, 18, 1, 10, 1))]
    assert log.xids[0].uptime_s == 21662.123501
    assert log.xids_between(utc(2026, 11, 29, 18, 1), utc(2026, 11, 29, 18, 1, 5)) == [log.xids[0]]
    assert log.gpu_lost[0].time == utc(2026, 11, 29, 18, 1, 2, 123530)


def test_latin1_garbage_between_xids_keeps_the_xids():
    lines = iter_lines(synthetic("kernel-log/latin1-garbage-between-xids.txt"))
    log = parse(lines)
    assert [(e.line, e.code) for e in log.xids] == [(1, 13), (3, 43), (5, 79)]
    assert log.xids[2].time == utc(2026, 11, 29, 18, 5, 40)
    assert any(g.line == 4 and "unreadable Xid" in g.reason for g in log.gaps)
    assert any("no kernel timestamp" in g.reason for g in log.gaps)


def test_truncated_last_line_keeps_what_was_printed():
    log = parse(synthetic_text("kernel-log/truncated-last-line.txt"))
    assert [(e.line, e.code) for e in log.xids] == [(2, 13), (3, 43), (4, 43)]
    cut = log.xids[-1]
    assert (cut.pid, cut.process) == (2823801, None)  # name=pt_mai is not trusted
    assert cut.time == utc(2025, 1, 21, 2, 44, 0, 566421)
    assert [g.line for g in log.gaps] == [4]


# ------------------------------------------------------------------------- inline cases


def test_journal_zone_forms_are_converted_to_utc():
    log = parse(
        "2026-11-29T20:01:02.000001+0200 n1 kernel: NVRM: Xid (PCI:0000:01:00): 79, pid=0, GPU has fallen off the bus.\n"
        "2026-11-29T13:01:03-05:00 n1 kernel: NVRM: Xid (PCI:0000:01:00): 45, pid=9, name=python, Ch 00000001\n"
    )
    assert [e.time for e in log.xids] == [utc(2026, 11, 29, 18, 1, 2, 1), utc(2026, 11, 29, 18, 1, 3)]
    assert log.xids[0].pid == 0 and log.xids[0].message == "GPU has fallen off the bus."


def test_only_kernel_lines_of_a_syslog_count():
    log = parse(
        "Nov 29 18:01:02 n1 gpud[311]: found NVRM: Xid (PCI:0000:01:00): 79, GPU has fallen off the bus.\n"
        "Nov 29 18:01:03 n1 kernel: [ 99.000001] NVRM: Xid (PCI:0000:02:00): 48, pid=7, name=a, DBE\n",
        year=2026,
    )
    assert [(e.line, e.pci, e.uptime_s) for e in log.xids] == [(2, "0000:02:00", 99.000001)]
    assert log.xids[0].time == utc(2026, 11, 29, 18, 1, 3)


def test_syslog_year_turns_over_in_january():
    log = parse(
        "Dec 31 23:59:59 n1 kernel: NVRM: Xid (PCI:0000:01:00): 79, GPU has fallen off the bus.\n"
        "Jan  1 00:00:01 n1 kernel: NVRM: Xid (PCI:0000:01:00): 79, GPU has fallen off the bus.\n",
        year=2025,
    )
    assert [e.time for e in log.xids] == [utc(2025, 12, 31, 23, 59, 59), utc(2026, 1, 1, 0, 0, 1)]


def test_oldest_xid_form_and_decoded_ctime_and_caller_id():
    log = parse(
        "NVRM: Xid (0000:03:00): 79, GPU has fallen off the bus.\n"
        "kern  :err   : [Mon Mar  3 07:39:44 2025] NVRM: Xid (PCI:0000:04:00): 62, pid=5, name=x, halt\n"
        "[  123.456789][    T1] NVRM: Xid (PCI:0000:05:00): 95, pid=6, name=y, Uncontained\n"
    )
    assert [(e.pci, e.code) for e in log.xids] == [("0000:03:00", 79), ("0000:04:00", 62), ("0000:05:00", 95)]
    assert log.xids[0].pid is None and log.xids[0].message == "GPU has fallen off the bus."
    assert log.xids[1].time == utc(2025, 3, 3, 7, 39, 44)
    assert log.xids[2].uptime_s == 123.456789
    assert log.format in ("dmesg-ctime", "dmesg", "bare")


def test_impossible_timestamp_is_a_gap_not_a_guess():
    log = parse("2025-13-45T00:00:00,000000+00:00 NVRM: Xid (PCI:0000:01:00): 79, GPU has fallen off the bus.\n")
    assert log.xids[0].code == 79 and log.xids[0].time is None
    assert [g.line for g in log.gaps] == [1] and "could not be read" in log.gaps[0].reason


def test_indented_paste_and_newer_kernel_probe_message():
    log = parse(
        "    [ 10.000001] NVRM: GPU 0000:3b:00.0: RmInitAdapter failed! (0x22:0x56:667)\n"
        "    [ 10.000002] nvidia 0000:3b:00.0: probe with driver nvidia failed with error -1\n"
        "    [ 10.000003] mlx5_core 0000:0c:00.0: probe with driver mlx5_core failed with error -22\n"
    )
    assert [(e.line, e.reason, e.pci) for e in log.gpu_lost] == [
        (1, "init_failed", "0000:3b:00"), (2, "probe_failed", "0000:3b:00")]
    assert log.gaps == []


def test_summary_says_when_a_year_places_syslog_on_the_clock():
    text = real_text("xid/h100-fallen-off-bus-not-responding-syslog-with-nvswitch-probe_nolebase.txt")
    assert "times unknown (syslog has no year)" in kernel_log.summarize(parse(text))[0]
    assert kernel_log.summarize(parse(text, year=2024))[0].endswith("times wall-clock")


def test_event_cap_counts_the_dropped(monkeypatch):
    monkeypatch.setattr(kernel_log, "MAX_EVENTS", 5)
    lines = (f"[{i}.000000] NVRM: Xid (PCI:0000:01:00): 13, pid=1, name=a, x" for i in range(1, 13))
    log = parse(lines)
    assert len(log.xids) == 5
    [gap] = log.gaps
    assert "7 more Xid" in gap.reason and gap.line == 6


def test_streams_a_one_shot_iterator():
    source = iter(real_text("xid/xid13-sm-warp-oob-then-xid43_gpud.txt").splitlines())
    assert len(parse(source).xids) == 26
    assert next(source, None) is None


def test_normalize_pci_matches_nvidia_smi_bus_ids():
    assert normalize_pci("00000000:9B:00.0") == "0000:9b:00"
    assert normalize_pci("PCI:0000:10:1c") == "0000:10:1c"
    assert normalize_pci("0000:5d:00.0") == "0000:5d:00"
    assert normalize_pci("10de:2330") is None
    assert normalize_pci("16:24:18") is None


def test_xids_between_accepts_naive_bounds():
    log = parse(real_text("xid/xid13-sm-warp-oob-then-xid43_gpud.txt"))
    inside = log.xids_between(datetime(2025, 1, 21, 2, 40), datetime(2025, 1, 21, 2, 50))
    assert len(inside) == 10 and all(e.time.minute == 44 for e in inside)


# -------------------------------------------------------------- detection and summary

XID_FIXTURES = sorted(p.name for p in (REAL / "xid").iterdir())
OTHER_FIXTURES = sorted(
    str(p.relative_to(REAL)) for p in REAL.glob("*/*") if p.is_file() and p.parent.name != "xid"
)


@pytest.mark.parametrize("name", XID_FIXTURES)
def test_detects_every_real_kernel_log(name):
    assert kernel_log.detect(real_text(f"xid/{name}")) >= 0.9


@pytest.mark.parametrize("relative", OTHER_FIXTURES)
def test_does_not_claim_other_kinds(relative):
    assert kernel_log.detect(real_text(relative)) < 0.5


def test_detects_synthetic_forms_and_rejects_lookalikes():
    for name in ("journalctl-k-short-iso-precise.txt", "dmesg-time-format-iso.txt", "dmesg-plain-boot-time.txt",
                 "truncated-last-line.txt"):
        assert kernel_log.detect(synthetic_text(f"kernel-log/{name}")) >= 0.8, name
    assert kernel_log.detect("gpu-003:1234:1234 [0] NCCL INFO NET/IB : Using [0]mlx5_0:1/IB\n" * 5) == 0.0
    assert kernel_log.detect("[2024-05-01 10:00:00,123] [INFO] [logging.py:96] step=5 loss=2.31\n" * 5) == 0.0
    assert kernel_log.detect("") == 0.0


def test_registered_kind():
    kind = get_kind("kernel-log")
    assert kind is kernel_log.KIND and kind.streaming
    assert kind.command == "dmesg --time-format iso"


def test_summary_names_codes_classes_and_clock():
    lines = kernel_log.summarize(parse(real_text("xid/xid13-sm-warp-oob-then-xid43_gpud.txt")))
    assert lines[0] == "kernel log: 26 lines, format dmesg-iso, times wall-clock"
    assert "0000:38:00" in lines[1] and "2025-01-21T02:21:33.498559Z" in lines[1]
    assert "  Xid 13 Graphics Engine Exception [application]: 24" in lines
    lines = kernel_log.summarize(parse(real_text("xid/xid79-fallen-off-bus-with-nvswitch-sxid20034_gpud.txt")))
    assert "times unknown" in lines[0]
    assert any("Xid 79 GPU has fallen off the bus [hardware, implicates the GPU]: 1" in line for line in lines)
    assert any(line.startswith("  SXid 20034 LTSSM Fault Up [fatal]: 8 line(s), 4 marked Fatal") for line in lines)
    assert any(line.startswith("GPU lost: fallen_off_bus on 0000:91:00") for line in lines)
    assert kernel_log.summarize(parse(""))[-1] == "no Xid, SXid or lost-GPU messages"


# ---------------------------------------------------------------------------- fuzzing

GOOD_1 = "2025-01-21T02:21:33,498559+00:00 NVRM: Xid (PCI:0000:38:00): 13, pid=1, name=a, Graphics Exception"
GOOD_2 = "[Sun Feb 23 16:24:18 2025] NVRM: Xid (PCI:0000:9b:00): 79, pid='<unknown>', name=<unknown>, GPU has fallen off the bus."


@settings(max_examples=300, deadline=None)
@given(st.text(max_size=3000))
def test_never_raises(text):
    log = parse(text)
    assert isinstance(log.gaps, list)
    assert isinstance(kernel_log.summarize(log), list)
    assert 0.0 <= kernel_log.detect(text) <= 1.0


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.text(max_size=200), max_size=5),
    st.one_of(st.none(), st.integers(min_value=1, max_value=9999)),
    st.one_of(st.none(), st.datetimes(timezones=st.just(UTC))),
)
def test_good_lines_survive_any_neighbour(bad, year, boot_time):
    lines = [GOOD_1, *bad, GOOD_2]
    log = parse(lines, year=year, boot_time=boot_time)
    kept = {(e.line, e.code) for e in log.xids}
    assert (1, 13) in kept
    assert (len(lines), 79) in kept
    assert log.xids[-1].time == utc(2025, 2, 23, 16, 24, 18)
