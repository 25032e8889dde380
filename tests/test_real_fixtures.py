"""Every real fixture under shared/fixtures/real is read by `spikeops parse` as its true kind.

The expected kind of each file is written here by hand (tests may know file names; the
product never does). A fixture added later without an expectation fails the suite, so no
real evidence goes untested. Each full parse is pinned in tests/golden/real/ so any change
in what spikeops reads shows up as a reviewable diff (`pytest --update-golden`).
"""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest

from spikeops.cli import main
from spikeops.jsonable import to_jsonable
from spikeops.reading import read_evidence
from tests.conftest import REAL

SYSFS_TREES = {"infiniband/sysfs-class-infiniband-h100_gpud": "ib-counters"}

EXPECTED_BY_PREFIX = {
    "dcgm/": "dcgmi-diag",
    "ethtool/": "ethtool",
    "nccl/": "nccl-log",
    "training-logs/": "training-log",
    "xid/": "kernel-log",
    "infiniband/ibstat-": "ibstat",
    "infiniband/ibstatus-": "ibstatus",
    "infiniband/perfquery-": "perfquery",
    "infiniband/ibnetdiscover-": "ibnetdiscover",
    "infiniband/ibswinfo-": "ibswinfo",
    "slurm/scontrol-show-node-": "scontrol-show-node",
    "slurm/sinfo-R-": "sinfo-reasons",
    "nvidia-smi/a100-sxm4-80gb-nvlink-status": "nvidia-smi-nvlink",
    "nvidia-smi/geforce-default-table": "nvidia-smi-table",
    "nvidia-smi/h100-80gb-hbm3-default-table": "nvidia-smi-table",
    "nvidia-smi/h100x8-default-table": "nvidia-smi-table",
    "nvidia-smi/h100-80gb-hbm3-query-": "nvidia-smi-csv",
    "nvidia-smi/": "nvidia-smi-q",  # the remaining nvidia-smi files are `nvidia-smi -q`
}


def _inputs() -> list[str]:
    found = []
    for path in sorted(REAL.rglob("*")):
        relative = path.relative_to(REAL).as_posix()
        if relative == "SOURCES.md":
            continue
        if any(relative == tree or relative.startswith(tree + "/") for tree in SYSFS_TREES):
            if relative in SYSFS_TREES:
                found.append(relative)
            continue
        if path.is_file():
            found.append(relative)
    return found


def expected_kind(relative: str) -> str:
    if relative in SYSFS_TREES:
        return SYSFS_TREES[relative]
    for prefix, kind in EXPECTED_BY_PREFIX.items():
        if relative.startswith(prefix):
            return kind
    raise AssertionError(f"no expected kind for real fixture {relative}: add one to this test")


INPUTS = _inputs()


def test_every_fixture_has_an_expectation():
    assert len(INPUTS) >= 57
    for relative in INPUTS:
        expected_kind(relative)


@pytest.mark.parametrize("relative", INPUTS)
def test_detected_kind_and_golden_parse(relative, golden):
    reading = read_evidence(REAL / relative)
    assert reading.kind.name == expected_kind(relative)
    summary = reading.kind.summarize(reading.result)
    assert summary and all(isinstance(line, str) for line in summary)
    golden(
        "real/" + relative,
        {
            "kind": reading.kind.name,
            "result": to_jsonable(reading.result),
            "gaps": [{"line": g.line, "reason": g.reason} for g in reading.gaps],
        },
    )


@pytest.mark.parametrize("relative", INPUTS)
def test_spikeops_parse_succeeds(relative):
    out, err = io.StringIO(), io.StringIO()
    assert main(["parse", "--json", str(REAL / relative)], out=out, err=err) == 0, err.getvalue()
    document = json.loads(out.getvalue())
    assert document["kind"] == expected_kind(relative)
    assert Path(document["path"]).name == Path(relative).name
