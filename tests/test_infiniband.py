"""InfiniBand probe outputs: ibstat, ibstatus, sysfs counters, perfquery, ibnetdiscover, ibswinfo.

Values asserted here were read off the real fixtures by hand (shared/fixtures/real/infiniband)
or off the synthetic ones described in tests/fixtures/synthetic/infiniband/README.md.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from hypothesis import given, settings, strategies as st

import spikeops.probes as probes
from spikeops.probes import infiniband as ib
from tests.conftest import real, real_text, synthetic_text

IB = "infiniband/"
SYSFS = IB + "sysfs-class-infiniband-h100_gpud"

# One line of arbitrary text that cannot split into several lines.
one_line = st.text(
    alphabet=st.characters(blacklist_categories=("Cc", "Cs", "Zl", "Zp")), max_size=120
)


# ---------------------------------------------------------------------------- ibstat


def test_ibstat_ibpanic_keeps_every_ca_and_records_the_panic():
    stat = ib.parse_ibstat(real_text(IB + "ibstat-a100-hdr200-ibpanic-exit255_gpud.txt"))
    assert [ca.name for ca in stat.cas] == [f"mlx5_{i}" for i in range(8)]
    first = stat.cas[0]
    assert (first.ca_type, first.ports_count, first.firmware, first.hardware_version) == (
        "MT4124", 1, "20.41.1000", "0"
    )
    assert first.node_guid == "0x00155dfffe3411eb"
    assert first.system_guid == "0xb83fd203006e2704"
    port = first.ports[0]
    assert (port.ca, port.port, port.state, port.physical_state) == ("mlx5_0", 1, "Active", "LinkUp")
    assert port.rate_gbps == 200.0
    assert (port.base_lid, port.lmc, port.sm_lid) == (13247, 0, 1)
    assert port.capability_mask == "0xa651ec48"
    assert port.port_guid == "0x00155dfffd3411eb"
    assert port.link_layer == "InfiniBand"
    assert port.line == 8 and port.text == "Port 1:" and port.lines["state"] == 9
    assert stat.cas[7].ports[0].base_lid == 13305
    assert all(p.active for p in stat.ports()) and len(stat.ports()) == 8
    # ibstat died on mlx5_8: evidence and a gap, at the line it was printed
    assert len(stat.errors) == 1
    error = stat.errors[0]
    assert (error.line, error.device) == (137, "mlx5_8")
    assert error.text.startswith("ibpanic: [1400444] main: stat of IB device 'mlx5_8' failed")
    assert [gap.line for gap in stat.gaps] == [137]
    assert any("TOOL ERROR" in line and "mlx5_8" in line for line in ib.summarize_ibstat(stat))


def test_ibstat_cx7_ib_ports_active_ethernet_ports_down():
    stat = ib.parse_ibstat(real_text(IB + "ibstat-h100-cx7-ndr400-ib-plus-eth-ports-down_gpud.txt"))
    assert len(stat.cas) == 12 and stat.gaps == [] and stat.errors == []
    mlx5_0 = stat.ca("mlx5_0")
    assert mlx5_0 is not None
    assert (mlx5_0.ca_type, mlx5_0.firmware) == ("MT4129", "28.39.1002")
    assert mlx5_0.ports[0].rate_gbps == 400.0
    assert (mlx5_0.ports[0].base_lid, mlx5_0.ports[0].sm_lid) == (75, 334)
    mlx5_1 = stat.ca("mlx5_1")
    assert mlx5_1 is not None and mlx5_1.ca_type == "MT4125"
    assert (mlx5_1.ports[0].rate_gbps, mlx5_1.ports[0].link_layer) == (100.0, "Ethernet")
    down = [p for p in stat.ports() if not p.active]
    assert [p.ca for p in down] == ["mlx5_2", "mlx5_7", "mlx5_8"]
    for port in down:
        assert (port.state, port.physical_state, port.rate_gbps, port.link_layer) == (
            "Down", "Disabled", 40.0, "Ethernet"
        )
    assert down[0].lines["state"] == 77 and down[0].lines["physical_state"] == 78
    ib_ports = [p for p in stat.ports() if p.link_layer == "InfiniBand"]
    assert len(ib_ports) == 8 and all(p.active and p.rate_gbps == 400.0 for p in ib_ports)
    summary = ib.summarize_ibstat(stat)
    assert sum("NOT ACTIVE" in line for line in summary) == 3


def test_ibstat_port_polling():
    stat = ib.parse_ibstat(real_text(IB + "ibstat-h100-port-down-polling_gpud.txt"))
    assert len(stat.ports()) == 12
    polling = stat.ca("mlx5_11")
    assert polling is not None
    port = polling.ports[0]
    assert (port.state, port.physical_state, port.rate_gbps) == ("Down", "Polling", 40.0)
    assert port.port_guid == "0x0000000000000000"
    assert port.lines["physical_state"] == 61
    assert {p.ca for p in stat.ports() if not p.active} == {"mlx5_11", "mlx5_5"}
    assert any("NOT ACTIVE mlx5_11 port 1: Down/Polling" in line for line in ib.summarize_ibstat(stat))


def test_ibstat_roce_all_active_and_peer_groups_by_adapter_model():
    stat = ib.parse_ibstat(real_text(IB + "ibstat-h100-roce-ethernet-all-active_gpud.txt"))
    ports = stat.ports()
    assert len(ports) == 12 and all(p.active for p in ports)
    assert all(p.link_layer == "Ethernet" and p.base_lid == 0 and p.sm_lid == 0 for p in ports)
    assert sorted(p.rate_gbps or 0 for p in ports) == [100.0] * 4 + [400.0] * 8
    # 100 G MT4125 front-end NICs are not slow MT4129 GPU NICs...
    models = {ca.name or "": ca.ca_type or "" for ca in stat.cas}
    assert ib.ports_below_peers(ports, models) == []
    # ...which is exactly what a comparison blind to the model would claim
    assert len(ib.ports_below_peers(ports)) == 4
    assert not any("SLOW" in line for line in ib.summarize_ibstat(stat))


def test_ibstat_tab_indented_mixed_link_layers():
    stat = ib.parse_ibstat(real_text(IB + "ibstat-a100-mt4126-roce-200g-all-active_gpud.txt"))
    assert [ca.name for ca in stat.cas] == [f"mlx5_{i}" for i in range(9)]
    assert stat.ports()[0].link_layer == "Ethernet"
    assert stat.cas[0].firmware == "22.35.2302" and stat.cas[1].firmware == "28.37.1014"
    mlx5_1 = stat.cas[1].ports[0]
    assert (mlx5_1.base_lid, mlx5_1.sm_lid, mlx5_1.link_layer) == (1369, 83, "InfiniBand")
    last = stat.cas[8].ports[0]  # the file ends without a newline
    assert (last.base_lid, last.port_guid, last.link_layer) == (1396, "0x4c1037318e9cd20a", "InfiniBand")
    assert stat.gaps == []


def test_ibstat_single_port_form_and_truncation():
    text = "Port 1:\nState: Active\nPhysical state: LinkUp\nRate: 2.5\nLink layer: InfiniBand\n"
    stat = ib.parse_ibstat(text)
    port = stat.ports()[0]
    assert (port.ca, port.port, port.rate_gbps, port.active) == (None, 1, 2.5, True)
    cut = "CA 'mlx5_0'\n\tCA type: MT4123\n\tNumber of ports: 2\n\tPort 1:\n\t\tState: Initializing\n"
    stat = ib.parse_ibstat(cut)
    assert stat.ports()[0].state == "Initializing" and not stat.ports()[0].active
    assert any("2 ports, 1 printed" in gap.reason for gap in stat.gaps)


# ---------------------------------------------------------------------------- ibstatus


def test_ibstatus_hex_lids_kernel_words_normalised():
    stat = ib.parse_ibstatus(real_text(IB + "ibstatus-a100-hdr200-all-active_gpud.txt"))
    ports = stat.ports()
    assert [p.ca for p in ports] == [f"mlx5_{i}" for i in range(9)]
    first = ports[0]
    assert (first.state, first.physical_state) == ("Active", "LinkUp")
    assert (first.rate_gbps, first.rate_text, first.link_layer) == (200.0, "4X HDR", "InfiniBand")
    assert (first.base_lid, first.sm_lid) == (0x33BF, 1)
    assert first.extra["default gid"] == "fe80:0000:0000:0000:0015:5dff:fd34:11eb"
    assert first.line == 1 and first.lines["state"] == 5
    last = ports[8]
    assert (last.rate_gbps, last.rate_text, last.link_layer, last.base_lid) == (40.0, "4X QDR", "Ethernet", 0)
    assert last.extra["default gid"] == "unknown"
    assert all(p.active for p in ports) and stat.gaps == []


def test_ibstatus_and_ibstat_of_the_same_node_agree_on_lids():
    # Both gpud captures come from the same Azure A100 node: hex lids equal decimal ones.
    status = ib.parse_ibstatus(real_text(IB + "ibstatus-a100-hdr200-all-active_gpud.txt"))
    stat = ib.parse_ibstat(real_text(IB + "ibstat-a100-hdr200-ibpanic-exit255_gpud.txt"))
    lids = {p.ca: p.base_lid for p in stat.ports()}
    assert lids == {p.ca: p.base_lid for p in status.ports() if p.ca in lids}


def test_ibstatus_down_polling_and_slow_ports():
    stat = ib.parse_ibstatus(synthetic_text("infiniband/ibstatus-ports-down.txt"))
    by_ca = {p.ca: p for p in stat.ports()}
    assert (by_ca["mlx5_3"].state, by_ca["mlx5_3"].physical_state) == ("Down", "Polling")
    assert (by_ca["mlx5_3"].rate_gbps, by_ca["mlx5_3"].rate_text, by_ca["mlx5_3"].base_lid) == (10.0, "4X SDR", 0xFFFF)
    assert (by_ca["mlx5_4"].state, by_ca["mlx5_4"].physical_state) == ("Down", "Disabled")
    assert [p.ca for p in ib.ports_below_peers(stat.ports())] == ["mlx5_2"]  # 2X NDR among 4X NDR
    summary = "\n".join(ib.summarize_ibstat(stat))
    assert "NOT ACTIVE mlx5_3" in summary and "NOT ACTIVE mlx5_4" in summary
    assert "SLOW mlx5_2 port 1: 200 Gb/s" in summary


@pytest.mark.parametrize(
    "text, state",
    [("4: ACTIVE", "Active"), ("ACTIVE", "Active"), ("Active", "Active"), ("1: DOWN", "Down"),
     ("2: INIT", "Initializing"), ("3: ARMED", "Armed"), ("5: ACTIVE_DEFER", "ActiveDefer"),
     ("4", "Active"), ("???", None), ("Weird", "Weird")],
)
def test_normalise_state(text, state):
    assert ib.normalise_state(text) == state


@pytest.mark.parametrize(
    "text, phys",
    [("5: LinkUp", "LinkUp"), ("LinkUp", "LinkUp"), ("2: Polling", "Polling"),
     ("7: Phy Test", "PhyTest"), ("4: PortConfigurationTraining", "PortConfigurationTraining"),
     ("0: <unknown>", None), ("3", "Disabled")],
)
def test_normalise_phys_state(text, phys):
    assert ib.normalise_phys_state(text) == phys


def test_parse_rate_forms():
    assert ib.parse_rate("400 Gb/sec (4X NDR)") == (400.0, "4X NDR")
    assert ib.parse_rate("10 Gb/sec (4X)") == (10.0, "4X")  # older kernels: SDR has no word
    assert ib.parse_rate("2.5 Gb/sec (1X SDR)") == (2.5, "1X SDR")
    assert ib.parse_rate("200") == (200.0, None)
    assert ib.parse_rate("fast") == (None, None)


# ---------------------------------------------------------------------------- sysfs counters


@pytest.fixture(scope="module")
def sysfs() -> ib.IbCounters:
    text = ib.render_sysfs_tree(real(SYSFS))
    assert text is not None
    return ib.parse_counters(text)


def test_sysfs_tree_renders_as_a_grep_capture():
    text = ib.render_sysfs_tree(real(SYSFS))
    assert text is not None and text.endswith("\n")
    lines = text.splitlines()
    assert all(line.startswith("/sys/class/infiniband/") for line in lines)
    assert lines == sorted(lines)
    # values without a trailing newline are not glued to the next path
    assert "/sys/class/infiniband/mlx5_0/ports/1/counters/port_rcv_errors:14" in lines
    assert "/sys/class/infiniband/mlx5_0/ports/1/state:4: ACTIVE" in lines
    assert "/sys/class/infiniband/mlx5_0/fw_ver:28.41.1000" in lines


def test_sysfs_mlx5_0(sysfs):
    port = sysfs.port("mlx5_0", 1)
    assert port is not None
    assert port.counters["port_rcv_errors"] == 14
    assert port.counters["excessive_buffer_overrun_errors"] == 15
    assert port.counters["port_rcv_switch_relay_errors"] == 1
    assert port.counters["port_xmit_wait"] == 2489603687
    assert port.counters["port_rcv_data"] == 230539874932483  # exact, beyond 2**47
    assert port.counters["link_downed"] == 0 and port.counters["symbol_error"] == 0
    assert port.hw_counters["roce_adp_retrans"] == 3
    assert port.hw_counters["rx_write_requests"] == 3809045607
    assert port.hw_counters["out_of_buffer"] == 0
    assert (port.state, port.phys_state) == ("Active", "LinkUp")
    assert port.attributes["state"] == "4: ACTIVE" and port.attributes["rate"] == "400 Gb/sec (4X NDR)"
    assert (port.rate_gbps, port.rate_text, port.link_layer) == (400.0, "4X NDR", "InfiniBand")
    assert len(port.counters) == 21 and len(port.hw_counters) == 26
    assert sysfs.devices["mlx5_0"] == {"board_id": "MT_0000000838", "fw_ver": "28.41.1000", "hca_type": "MT4129"}


def test_sysfs_other_devices_and_the_bond(sysfs):
    assert [p.device for p in sysfs.ports] == [
        "mlx5_0", "mlx5_1", "mlx5_4", "mlx5_5", "mlx5_6", "mlx5_7", "mlx5_8", "mlx5_9", "mlx5_bond_0"
    ]
    mlx5_1 = sysfs.port("mlx5_1")
    assert mlx5_1 is not None
    assert mlx5_1.counters["link_downed"] == 255
    assert mlx5_1.counters["port_rcv_switch_relay_errors"] == 2
    assert mlx5_1.counters["port_rcv_data"] == 205128687774249
    mlx5_9 = sysfs.port("mlx5_9")
    assert mlx5_9 is not None and mlx5_9.counters["link_downed"] == 0 and mlx5_9.rate_gbps == 400.0
    bond = sysfs.port("mlx5_bond_0")
    assert bond is not None
    assert (bond.link_layer, bond.rate_gbps, bond.rate_text, bond.active) == ("Ethernet", 200.0, "2X NDR", True)
    assert sysfs.devices["mlx5_bond_0"]["hca_type"] == "MT41692"
    assert sysfs.devices["mlx5_bond_0"]["fw_ver"] == "32.38.3056"
    assert sysfs.gaps == []
    summary = "\n".join(ib.summarize_counters(sysfs))
    assert "link_downed non-zero on 1/9 ports (mlx5_1:1=255)" in summary
    assert "port_xmit_wait non-zero on 9/9 ports" in summary
    assert "SLOW" not in summary  # the 200 G bond is Ethernet, its own peer group


def test_render_one_device_dir_and_refusals(tmp_path):
    text = ib.render_sysfs_tree(real(SYSFS) / "mlx5_4")
    assert text is not None
    assert {p.device for p in ib.parse_counters(text).ports} == {"mlx5_4"}
    (tmp_path / "notes.txt").write_text("hello")
    (tmp_path / "sub").mkdir()
    assert ib.render_sysfs_tree(tmp_path) is None
    assert ib.render_sysfs_tree(tmp_path / "missing") is None
    assert ib.render_sysfs_tree(tmp_path / "notes.txt") is None


def test_render_caps_files_and_skips_what_is_not_a_file(tmp_path):
    counters = tmp_path / "mlx5_0" / "ports" / "1" / "counters"
    counters.mkdir(parents=True)
    (counters / "link_downed").write_text("2\n")
    (counters / "symbol_error").mkdir()  # not a file: skipped, as grep would
    (counters / "port_rcv_data").write_text("9" * 10_000)  # a runaway file is cut at 4 KiB
    text = ib.render_sysfs_tree(tmp_path)
    assert text is not None
    result = ib.parse_counters(text)
    port = result.port("mlx5_0")
    assert port is not None
    assert port.counters["link_downed"] == 2
    assert "symbol_error" not in port.counters
    assert port.counters["port_rcv_data"] == int("9" * 4096)


def test_kind_reads_the_directory_through_from_directory():
    kind = probes.get_kind("ib-counters")
    assert kind is not None and kind.from_directory is ib.render_sysfs_tree
    assert kind.command == "grep -H . /sys/class/infiniband/*/ports/*/counters/*"


def test_counters_baseline_and_later_capture_show_the_flap():
    before = ib.parse_counters(synthetic_text("infiniband/ib-counters-baseline.txt"))
    after = ib.parse_counters(synthetic_text("infiniband/ib-counters-later.txt"))
    assert before.gaps == [] and after.gaps == []
    assert [(p.device, p.port) for p in after.ports] == [("mlx5_0", 1), ("mlx5_1", 1)]
    old, new = before.port("mlx5_1"), after.port("mlx5_1")
    assert old is not None and new is not None
    assert (old.counters["link_downed"], new.counters["link_downed"]) == (0, 3)
    assert new.counters["link_error_recovery"] - old.counters["link_error_recovery"] == 7
    assert new.counters["symbol_error"] == 1184
    assert new.lines["counters/link_downed"] == 24  # the line a finding quotes
    steady_old, steady_new = before.port("mlx5_0"), after.port("mlx5_0")
    assert steady_old is not None and steady_new is not None
    assert {k for k in ib.ERROR_COUNTERS if steady_new.counters[k] != steady_old.counters[k]} == set()
    assert new.state is None  # counters alone say nothing about the port state
    summary = "\n".join(ib.summarize_counters(after))
    assert "link_downed non-zero on 1/2 ports (mlx5_1:1=3)" in summary


def test_counters_relative_paths_hw_counters_attributes_and_grep_errors():
    text = (
        "mlx5_2/ports/1/counters/link_downed:1\n"
        "mlx5_2/ports/1/hw_counters/out_of_buffer:12345\n"
        "grep: /sys/class/infiniband/mlx5_2/ports/1/counters/port_xmit_wait: Invalid argument\n"
        "mlx5_2/ports/1/state:1: DOWN\n"
        "mlx5_2/ports/1/phys_state:3: Disabled\n"
        "mlx5_2/ports/1/rate:40 Gb/sec (4X QDR)\n"
        "mlx5_2/ports/1/link_layer:Ethernet\n"
        "mlx5_2/ports/1/counters/symbol_error:N/A\n"
        "/sys/class/infiniband/mlx5_3/ports/2/hw_counters/local_ack_timeout_err:8\n"
    )
    result = ib.parse_counters(text)
    port = result.port("mlx5_2")
    assert port is not None
    assert port.counters == {"link_downed": 1}
    assert port.hw_counters == {"out_of_buffer": 12345}
    assert (port.state, port.phys_state, port.rate_gbps, port.link_layer) == ("Down", "Disabled", 40.0, "Ethernet")
    other = result.port("mlx5_3", 2)
    assert other is not None and other.value("local_ack_timeout_err") == 8
    assert sorted(gap.line for gap in result.gaps) == [3, 8]  # grep's complaint, the N/A count


# ---------------------------------------------------------------------------- perfquery


def test_perfquery_extended_two_ports():
    result = ib.parse_perfquery(real_text(IB + "perfquery-x-edr-switch-2ports_infiniband-exporter.txt"))
    assert [(b.title, b.lid, b.port, b.cap_mask) for b in result.blocks] == [
        ("Port extended", 1719, 1, "0x5300"), ("Port extended", 1719, 2, "0x5300")
    ]
    one, two = result.blocks
    assert one.counters["PortXmitData"] == 36298026860928
    assert one.counters["PortRcvData"] == 12279028775751
    assert one.counters["PortMulticastRcvPkts"] == 5584846741
    assert one.counters["PortXmitWait"] == 22730501
    assert two.counters["PortXmitWait"] == 36510964
    assert two.counters["PortRcvData"] == 39078804993378
    for block in (one, two):
        assert block.counters["CounterSelect"] == "0x0000"  # hex select masks stay strings
        assert block.counters["CounterSelect2"] == "0x00000000"
        for name in ("SymbolErrorCounter", "LinkDownedCounter", "PortRcvErrors", "PortXmitDiscards"):
            assert block.counters[name] == 0
        assert len(block.counters) == 25
    assert one.line == 1 and two.line == 27 and result.gaps == []
    summary = "\n".join(ib.summarize_perfquery(result))
    assert "congestion: PortXmitWait = 22,730,501" in summary and "errors:" not in summary


def test_perfquery_rcv_error_details():
    result = ib.parse_perfquery(real_text(IB + "perfquery-E-rcv-error-details_infiniband-exporter.txt"))
    (block,) = result.blocks
    assert (block.title, block.lid, block.port, block.cap_mask) == ("PortRcvErrorDetails", 1719, 1, None)
    assert block.counters["PortLocalPhysicalErrors"] == 0
    assert block.counters["PortLoopingErrors"] == 0
    assert len(block.counters) == 8 and result.gaps == []


def test_perfquery_plain_counters():
    result = ib.parse_perfquery(synthetic_text("infiniband/perfquery-plain.txt"))
    (block,) = result.blocks
    assert (block.title, block.lid, block.port, block.cap_mask) == ("Port", 75, 1, "0x5A00")
    assert block.counters["SymbolErrorCounter"] == 1184
    assert block.counters["LinkDownedCounter"] == 3
    assert block.counters["PortXmitData"] == 4294967295  # 32-bit counter, saturated
    assert block.counters["CounterSelect2"] == "0x00"
    summary = "\n".join(ib.summarize_perfquery(result))
    assert "errors: LinkDownedCounter = 3" in summary
    assert "errors: SymbolErrorCounter = 1,184" in summary


def test_perfquery_old_header_and_tool_errors():
    text = (
        "ibwarn: [4242] mad_rpc: _do_madrpc failed; dport (Lid 12)\n"
        "# Port counters: Lid 936 port 1\n"
        "PortSelect:......................1\n"
        "LinkDowned:......................4\n"
    )
    result = ib.parse_perfquery(text)
    assert result.blocks[0].counters == {"PortSelect": 1, "LinkDowned": 4}
    assert [gap.line for gap in result.gaps] == [1]


# ---------------------------------------------------------------------------- ibnetdiscover


def test_ibnetdiscover_real_rows():
    result = ib.parse_ibnetdiscover_ports(real_text(IB + "ibnetdiscover-p-edr-links_infiniband-exporter.txt"))
    assert len(result.links) == 9 and result.gaps == []
    first = result.links[0]
    assert (first.from_type, first.from_lid, first.from_port, first.from_guid) == ("CA", 134, 1, "0x7cfe9003003b4bde")
    assert (first.width, first.speed, first.rate_gbps) == ("4x", "EDR", 100.0)
    assert (first.to_type, first.to_lid, first.to_port, first.to_guid) == ("SW", 1719, 10, "0x7cfe9003009ce5b0")
    assert (first.from_name, first.to_name) == ("o0001 HCA-1", "ib-i1l1s01")
    assert first.line == 1 and not first.unlinked and not first.degraded
    isl = result.links[5]
    assert (isl.from_type, isl.to_type, isl.to_lid, isl.to_name) == ("SW", "SW", 1516, "ib-i1l2s01")
    unknown, sdr = result.links[7], result.links[8]
    assert (unknown.from_lid, unknown.from_port, unknown.width, unknown.speed) == (2052, 37, "4x", None)
    assert unknown.unlinked and unknown.from_name == "ib-i4l1s01" and unknown.to_guid is None
    # 4x SDR with nothing on the other end: an unused/split port's leftover speed, not a
    # degraded link (the infiniband_exporter treats it the same way)
    assert (sdr.from_lid, sdr.from_port, sdr.speed, sdr.rate_gbps) == (1781, 80, "SDR", 10.0)
    assert sdr.unlinked and not sdr.degraded
    assert result.degraded() == [] and len(result.unlinked()) == 2
    summary = ib.summarize_ibnetdiscover(result)
    assert "usual link 4x EDR" in summary[0] and "2 unlinked" in summary[0]


def test_ibnetdiscover_linked_port_below_its_peers_is_degraded():
    result = ib.parse_ibnetdiscover_ports(synthetic_text("infiniband/ibnetdiscover-p-width-degraded.txt"))
    degraded = result.degraded()
    assert [(l.from_type, l.from_lid, l.from_port, l.width) for l in degraded] == [
        ("CA", 203, 1, "1x"), ("SW", 11, 3, "1x")
    ]
    assert degraded[0].rate_gbps == 25.0 and degraded[0].line == 3
    assert [l.from_port for l in result.unlinked()] == [20]
    assert sum("DEGRADED" in line for line in ib.summarize_ibnetdiscover(result)) == 2


def test_ibnetdiscover_hdr100_hcas_are_compared_with_hca_links_only():
    rows = [
        f"CA  {100 + i:4d}  1 0x0000000000000{i:03d} 2x HDR - SW     7 {i:2d} 0x00000000000aa001 ( 'n{i} HCA-1' - 'leaf' )"
        for i in range(1, 4)
    ] + [
        f"SW     7 {40 + i:2d} 0x00000000000aa001 4x HDR - SW     8 {i:2d} 0x00000000000bb001 ( 'leaf' - 'spine' )"
        for i in range(1, 6)
    ]
    result = ib.parse_ibnetdiscover_ports("\n".join(rows))
    assert len(result.links) == 8 and result.degraded() == []


def test_ibnetdiscover_old_unquoted_unlinked_row():
    # infiniband_exporter fixture from an older ibnetdiscover: the node name is not quoted
    line = "SW   479 22 0x0002c9020040f161 4x QDR                                   Infiniscale-IV Mellanox Technologies"
    (link,) = ib.parse_ibnetdiscover_ports(line).links
    assert (link.from_lid, link.speed, link.unlinked) == (479, "QDR", True)
    assert link.from_name == "Infiniscale-IV Mellanox Technologies"


# ---------------------------------------------------------------------------- ibswinfo


def test_ibswinfo_quantum_switch():
    info = ib.parse_ibswinfo(real_text(IB + "ibswinfo-quantum-hdr-switch_infiniband-exporter.txt"))
    assert info.title == "Quantum Mellanox Technologies"
    assert info.fields["part number"] == "MQM8790-HS2F"
    assert info.fields["serial number"] == "MT2152T10239"
    assert info.fields["ports"] == "40"
    assert info.fields["firmware version"] == "27.2010.3118"
    assert info.fields["GUID"] == "0x08c0eb0300d9f672"
    assert info.uptime_s == 96 * 86400 + 1 * 3600 + 55 * 60 + 47
    assert info.psus == [
        {"index": 0, "status": "OK", "P/N": "MTEF-PSF-AC-C", "S/N": "MT2150T22468", "DC power": "OK",
         "fan status": "OK", "power (W)": "154", "power_w": 154},
        {"index": 1, "status": "OK", "P/N": "MTEF-PSF-AC-C", "S/N": "MT2150T22467", "DC power": "OK",
         "fan status": "OK", "power (W)": "134", "power_w": 134},
    ]
    assert (info.temperature_c, info.max_temperature_c) == (53, 58)
    assert info.fan_status == "OK"  # the switch's, not a PSU's "fan status"
    assert info.fans_rpm == {1: 6125, 2: 5251, 3: 6013, 4: 5335, 5: 6068, 6: 5423, 7: 5854, 8: 5467, 9: 5906}
    assert info.gaps == []
    summary = ib.summarize_ibswinfo(info)
    assert len(summary) == 1 and "MQM8790-HS2F" in summary[0]


def test_ibswinfo_errors_and_bad_values():
    text = (
        "PSU0 status        | ERROR\n"
        "     DC power      | ERROR\n"
        "fan status         | ERROR\n"
        "fan#1 (rpm)        | foo\n"
        "fan#2 (rpm)        | 0\n"
        "warn threshold (C) | 75/85 (low/high)\n"
    )
    info = ib.parse_ibswinfo(text)
    assert info.psus == [{"index": 0, "status": "ERROR", "DC power": "ERROR"}]
    assert info.fan_status == "ERROR" and info.fans_rpm == {2: 0}
    assert [gap.line for gap in info.gaps] == [4]
    assert info.fields["warn threshold (C)"] == "75/85 (low/high)"
    summary = "\n".join(ib.summarize_ibswinfo(info))
    assert "PSU0" in summary and "fan #2 stopped" in summary and "fan status: ERROR" in summary


def test_ibswinfo_output_category_form():
    text = (
        "uptime (sec)       : 8301347\n"
        "psu0.power (W)     : 154\n"
        "cur.temp (C)       : 53\n"
        "max.temp (C)       : 58\n"
        "fan#1.speed (rpm)  : 6125\n"
    )
    info = ib.parse_ibswinfo(text)
    assert info.uptime_s == 8301347 and info.temperature_c == 53 and info.max_temperature_c == 58
    assert info.fans_rpm == {1: 6125} and info.psus[0]["power_w"] == 154


# ---------------------------------------------------------------------------- detection


REAL_KINDS = {
    "ibnetdiscover-p-edr-links_infiniband-exporter.txt": "ibnetdiscover",
    "ibstat-a100-hdr200-ibpanic-exit255_gpud.txt": "ibstat",
    "ibstat-a100-mt4126-roce-200g-all-active_gpud.txt": "ibstat",
    "ibstat-h100-cx7-ndr400-ib-plus-eth-ports-down_gpud.txt": "ibstat",
    "ibstat-h100-port-down-polling_gpud.txt": "ibstat",
    "ibstat-h100-roce-ethernet-all-active_gpud.txt": "ibstat",
    "ibstatus-a100-hdr200-all-active_gpud.txt": "ibstatus",
    "ibswinfo-quantum-hdr-switch_infiniband-exporter.txt": "ibswinfo",
    "perfquery-E-rcv-error-details_infiniband-exporter.txt": "perfquery",
    "perfquery-x-edr-switch-2ports_infiniband-exporter.txt": "perfquery",
}


def test_every_real_fixture_is_covered():
    names = {p.name for p in real(IB.rstrip("/")).iterdir()}
    assert names == set(REAL_KINDS) | {Path(SYSFS).name}


@pytest.mark.parametrize("name, kind", sorted(REAL_KINDS.items()))
def test_detect_real_fixtures(name, kind):
    scored = probes.detect_kind(real_text(IB + name)[: 64 * 1024])
    assert scored and scored[0][1].name == kind and scored[0][0] >= 0.9
    assert all(other.name == kind or score < 0.5 for score, other in scored)


def test_detect_rendered_tree_and_synthetics():
    text = ib.render_sysfs_tree(real(SYSFS))
    assert text is not None
    assert probes.detect_kind(text)[0][1].name == "ib-counters"
    for name, kind in (
        ("ib-counters-later.txt", "ib-counters"),
        ("perfquery-plain.txt", "perfquery"),
        ("ibstatus-ports-down.txt", "ibstatus"),
        ("ibnetdiscover-p-width-degraded.txt", "ibnetdiscover"),
    ):
        assert probes.detect_kind(synthetic_text("infiniband/" + name))[0][1].name == kind


def test_detectors_decline_other_text():
    other = "NIC statistics:\n     rx_packets: 1\n" + "hello world\n"
    for detect in (ib.detect_ibstat, ib.detect_ibstatus, ib.detect_counters, ib.detect_perfquery,
                   ib.detect_ibnetdiscover, ib.detect_ibswinfo):
        assert detect(other) == 0.0
        assert detect("") == 0.0


def test_kinds_registered():
    names = {kind.name: kind.command for kind in ib.KINDS}
    assert names == {
        "ibstat": "ibstat",
        "ibstatus": "ibstatus",
        "ib-counters": "grep -H . /sys/class/infiniband/*/ports/*/counters/*",
        "perfquery": "perfquery -x",
        "ibnetdiscover": "ibnetdiscover -p",
        "ibswinfo": "ibswinfo -d {lid}",
    }
    assert set(names) <= set(probes.kind_names())


# ---------------------------------------------------------------------------- robustness

PARSERS = [
    ib.parse_ibstat, ib.parse_ibstatus, ib.parse_counters, ib.parse_perfquery,
    ib.parse_ibnetdiscover_ports, ib.parse_ibswinfo,
]


@pytest.mark.parametrize("parse", PARSERS, ids=lambda f: f.__name__)
@settings(max_examples=150, deadline=None)
@given(text=st.text(max_size=2000))
def test_parsers_never_raise(parse, text):
    result = parse(text)
    assert isinstance(result.gaps, list)
    parse(text.splitlines())  # an iterable of lines works as well


@pytest.mark.parametrize("parse", PARSERS, ids=lambda f: f.__name__)
def test_binary_empty_and_wrong_kind_become_gaps(parse):
    wrong = "perfquery-x-edr-switch-2ports_infiniband-exporter.txt"
    if parse is ib.parse_perfquery:
        wrong = "ibswinfo-quantum-hdr-switch_infiniband-exporter.txt"
    for text in ("\x00\x01\xff" * 50, "", real_text(IB + wrong)):
        assert parse(text).gaps


def _not_a_field(*names: str):
    """Junk that is itself a valid line for the fields under test would rightly change them."""
    pattern = re.compile(r"^\s*(?:" + "|".join(names) + r")", re.I)
    return lambda s: not pattern.match(s)


@settings(deadline=None)
@given(junk=one_line.filter(_not_a_field("CA", "Port", "State", "Physical state", "Rate", "ib", "error", "warning")))
def test_ibstat_keeps_the_good_lines_around_a_bad_one(junk):
    text = (
        "CA 'mlx5_0'\n\tCA type: MT4129\n\tPort 1:\n\t\tState: Active\n"
        f"{junk}\n"
        "\t\tPhysical state: LinkUp\n\t\tRate: 400\nCA 'mlx5_1'\n\tPort 1:\n\t\tState: Down\n"
    )
    stat = ib.parse_ibstat(text)
    first = stat.ca("mlx5_0")
    assert first is not None and first.ports[0].rate_gbps == 400.0 and first.ports[0].active
    second = stat.ca("mlx5_1")
    assert second is not None and second.ports[0].state == "Down"


@settings(deadline=None)
@given(junk=one_line.filter(_not_a_field("Infiniband device", "state", "rate")))
def test_ibstatus_keeps_the_good_lines_around_a_bad_one(junk):
    text = (
        "Infiniband device 'mlx5_0' port 1 status:\n\tstate:\t\t 4: ACTIVE\n"
        f"{junk}\n"
        "\trate:\t\t 200 Gb/sec (4X HDR)\n"
    )
    (port,) = ib.parse_ibstatus(text).ports()
    assert port.state == "Active" and port.rate_gbps == 200.0


@settings(deadline=None)
@given(junk=one_line.filter(lambda s: "/ports/" not in s))
def test_counters_keep_the_good_lines_around_a_bad_one(junk):
    text = (
        "/sys/class/infiniband/mlx5_0/ports/1/counters/link_downed:3\n"
        f"{junk}\n"
        "/sys/class/infiniband/mlx5_0/ports/1/counters/symbol_error:9\n"
    )
    port = ib.parse_counters(text).port("mlx5_0")
    assert port is not None and port.counters == {"link_downed": 3, "symbol_error": 9}


@settings(deadline=None)
@given(junk=one_line.filter(_not_a_field("#", "LinkDownedCounter", "PortXmitWait")))
def test_perfquery_keeps_the_good_lines_around_a_bad_one(junk):
    text = (
        "# Port extended counters: Lid 1 port 1 (CapMask: 0x5300)\nLinkDownedCounter:...............2\n"
        f"{junk}\n"
        "PortXmitWait:....................77\n"
    )
    (block,) = ib.parse_perfquery(text).blocks
    assert block.counters["LinkDownedCounter"] == 2 and block.counters["PortXmitWait"] == 77


@settings(deadline=None)
@given(junk=one_line)
def test_ibnetdiscover_keeps_the_good_lines_around_a_bad_one(junk):
    row = "CA   134  1 0x7cfe9003003b4bde 4x EDR - SW  1719 10 0x7cfe9003009ce5b0 ( 'a HCA-1' - 'sw' )"
    links = ib.parse_ibnetdiscover_ports(f"{row}\n{junk}\n{row}\n").links
    good = [link for link in links if link.from_guid == "0x7cfe9003003b4bde" and link.to_lid == 1719]
    assert [link.line for link in good] == [1, 3]


@settings(deadline=None)
@given(junk=one_line.filter(lambda s: "|" not in s and " : " not in s))
def test_ibswinfo_keeps_the_good_lines_around_a_bad_one(junk):
    text = f"part number        | MQM8790-HS2F\n{junk}\ntemperature (C)    | 53\n"
    info = ib.parse_ibswinfo(text)
    assert info.fields["part number"] == "MQM8790-HS2F" and info.temperature_c == 53
