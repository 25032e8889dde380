"""ethtool -S across drivers: totals and per-queue counters kept apart."""

from __future__ import annotations

from hypothesis import given, strategies as st

from spikeops.probes import ethtool
from tests.conftest import real_text


def test_i40e_totals_and_dotted_queues():
    stats = ethtool.parse(real_text("ethtool/intel-i40e-style-crc-errors_showmax.txt"))
    assert stats.counters["rx_errors"] == 442
    assert stats.counters["rx_dropped"] == 363
    assert stats.counters["rx_crc_errors"] == 223
    assert stats.counters["port.rx_crc_errors"] == 223
    assert stats.queues["tx0"]["packets"] == 17736631688
    assert stats.queues["rx0"]["bytes"] == 16776006536185
    assert "tx-0.packets" not in stats.counters
    assert stats.gaps == []


def test_bnxt_ring_counters_are_queues():
    stats = ethtool.parse(real_text("ethtool/bnxt_en-10g-per-queue-format_showmax.txt"))
    assert stats.queues["ring0"]["rx_ucast_packets"] == 19121609
    assert stats.queues["ring0"]["rx_l4_csum_errors"] == 190
    assert not any(name.startswith("[") for name in stats.counters)
    assert stats.queue_total("rx_l4_csum_errors") >= 190


def test_mlx5_pause_and_discards_are_port_counters():
    stats = ethtool.parse(real_text("ethtool/mlx5-cx-xdp-kernel-5.15-rx-discards-pause_netdev-ml.txt"))
    assert stats.counters["rx_out_of_buffer"] == 990473555
    assert stats.counters["rx_discards_phy"] == 58591428329
    assert stats.counters["tx_pause_ctrl_phy"] == 5745055
    assert stats.counters["rx_prio0_discards"] == 58591314012  # per priority, not a queue
    assert stats.queues["rx0"]["packets"] == 70812690
    assert stats.queues["ch0"]["events"] == 55
    assert stats.gaps == []  # the mail's header lines are not counters


def test_detect_prefers_header():
    assert ethtool.detect("NIC statistics:\n     rx_packets: 1\n") > 0.9
    assert ethtool.detect("hello world") == 0.0


def test_error_output_is_a_gap():
    stats = ethtool.parse("Cannot get stats information: Operation not supported\n")
    assert stats.counters == {}
    assert any("Operation not supported" in gap.reason for gap in stats.gaps)


@given(st.text(max_size=2000))
def test_never_raises(text):
    result = ethtool.parse(text)
    assert isinstance(result.counters, dict)


def test_to_number_refuses_absurd_digit_runs():
    from spikeops.probes.base import to_number

    assert to_number("9" * 5000) is None
    assert to_number("1,234") == 1234
    assert to_number("N/A") is None
    assert to_number("-2.5") == -2.5
