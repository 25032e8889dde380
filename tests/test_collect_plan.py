"""What the collector sends to a node: exact commands, quoting, overrides, interfaces."""

from __future__ import annotations

import shlex

import pytest

from spikeops.collect.plan import check_job_id, physical_interfaces, plan_interfaces, plan_probes, remote_command
from spikeops.errors import InputError
from spikeops.inventory import parse_inventory

BASE = "[cluster]\nnodes = 'gpu-[001-004]'\n[ssh]\ncommand_timeout = 20\n"


def _names(planned) -> list[str]:
    return [probe.name for probe in planned]


def test_default_probe_set_is_the_bundle_specs() -> None:
    planned = plan_probes(parse_inventory(BASE), "4412", "gpu-001")
    assert _names(planned) == ["nvidia-smi-q", "kernel", "ibstat", "ib-counters", "nccl-version", "nvml",
                               "flight-recorder", "stacks", "ncclras"]
    # a baseline at job start has no hang to record: no flight recorder, stacks or RAS
    baseline = plan_probes(parse_inventory(BASE), "4412", "gpu-001", baseline=True)
    assert _names(baseline) == ["nvidia-smi-q", "kernel", "ibstat", "ib-counters", "nccl-version", "nvml"]
    by_name = {probe.name: probe for probe in planned}
    assert by_name["nvidia-smi-q"].command == "nvidia-smi -q"
    assert by_name["nvidia-smi-q"].filename == "nvidia-smi-q.txt"
    assert by_name["kernel"].command.startswith("dmesg --time-format iso")
    assert by_name["ib-counters"].command.startswith("grep -H . ")
    assert all(probe.timeout == 20.0 for probe in planned)


def test_remote_command_is_bounded_on_the_node_and_runs_the_recorded_command() -> None:
    assert shlex.split(remote_command("nvidia-smi -q", 12.4, 1000, "head")) == [
        "exec", "timeout", "-k", "2", "12", "nvidia-smi", "-q"]
    words = shlex.split(remote_command("dmesg || journalctl -k", 30, 1000, "head"))
    assert words[:7] == ["exec", "timeout", "-k", "2", "30", "sh", "-c"]
    assert words[-1] == "dmesg || journalctl -k"
    tail = shlex.split(remote_command("cat big.log", 5, 4096, "tail"))
    assert tail[-1] == "cat big.log | tail -c 4096"


def test_job_and_node_are_quoted_into_log_templates() -> None:
    text = BASE + "[job]\nnccl_log = '/shared/logs/{job}/{node}-*.out'\ntrain_log = '/shared/logs/{job}/train.log'\n"
    planned = {p.name: p for p in plan_probes(parse_inventory(text), "4412_3", "gpu-002")}
    assert planned["nccl"].command.endswith("/shared/logs/4412_3/gpu-002-*.out")
    assert planned["nccl"].keep == "tail" and "| tail -c" in planned["nccl"].remote
    assert planned["train"].command == "cat /shared/logs/4412_3/train.log"
    for bad in ("4412; rm -rf /", "$(reboot)", "", "a b", "../x"):
        with pytest.raises(InputError):
            check_job_id(bad)


def test_overrides_disable_replace_and_bound() -> None:
    text = BASE + (
        "[job]\nnccl_version = 'cat /opt/nccl/VERSION'\n"
        "[probes.nvml]\nenabled = false\n"
        "[probes.kernel]\ncommand = 'journalctl -k -o short-iso-precise'\ntimeout = 5\nmax_bytes = 1000\n"
    )
    planned = {p.name: p for p in plan_probes(parse_inventory(text), "1", "gpu-001")}
    assert "nvml" not in planned
    assert planned["kernel"].command == "journalctl -k -o short-iso-precise"
    assert planned["kernel"].timeout == 5.0 and planned["kernel"].max_bytes == 1000
    assert planned["nccl-version"].command == "cat /opt/nccl/VERSION"


def test_interfaces_from_the_node_are_filtered_and_quoted() -> None:
    listing = ["lo", "eth0", "ib0", "docker0", "veth12ab", "ens10np0", "bad name", "$(reboot)", "eth0", ""]
    assert physical_interfaces(listing) == ["eth0", "ib0", "ens10np0"]
    planned = plan_interfaces(parse_inventory(BASE), ["eth0", "ib0", "`x`"])
    assert [(p.name, p.filename, p.command) for p in planned] == [
        ("ethtool-eth0", "ethtool-eth0.txt", "ethtool -S eth0"),
        ("ethtool-ib0", "ethtool-ib0.txt", "ethtool -S ib0"),
    ]
    off = parse_inventory(BASE + "[probes.ethtool]\nenabled = false\n")
    assert plan_interfaces(off, ["eth0"]) == []
