"""NCCL RAS (``ncclras``): the parser on output written from NCCL's own format strings
(tests/fixtures/synthetic/ncclras/README.md: no real capture exists here, these are marked as
such), and the diagnosis naming the nodes of dead and lagging ranks."""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta
from pathlib import Path

from hypothesis import given, settings, strategies as st

from spikeops.bundle import BundleWriter
from spikeops.diagnosis import diagnose
from spikeops.probes import detect_kind
from spikeops.probes.ncclras import parse
from spikeops.timeparse import iso
from tests.conftest import synthetic, synthetic_text

NODES = ["gpu-001", "gpu-002", "gpu-003", "gpu-004"]


def test_healthy_job() -> None:
    report = parse(synthetic_text("ncclras/ncclras-healthy-4x8.txt"))
    assert report.nccl_version == "2.26.2"
    assert (report.nodes, report.processes, report.gpus) == (4, 32, 32)
    assert [row[:2] for row in report.groups] == [(0, 1), (1, 4), (2, 8)]
    assert [row[4] for row in report.groups] == [32, 8, 4] and report.world_size() == 32
    assert {row[6] for row in report.groups} == {"RUNNING"} and {row[7] for row in report.groups} == {"OK"}
    assert report.healthy() and not report.comms and not report.gaps


def test_a_rank_behind_in_its_allreduce_count() -> None:
    report = parse(synthetic_text("ncclras/ncclras-rank-behind-allreduce.txt"))
    assert report.groups[0][7] == "MISMATCH" and not report.healthy()
    [comm] = report.comms
    assert (comm.label, comm.comm_hash, comm.kind) == ("0-0", "9c2a7e41b0d63f58", "MISMATCH")
    assert comm.op_counts == {"AllReduce": {1907: 31, 1906: 1}}
    [lagging] = comm.lagging()
    assert (lagging.rank, lagging.ops, lagging.gpu, lagging.pid, lagging.host) == (21, 1906, "5", 48211, "10.0.7.14")
    assert lagging.line == 28 and lagging.text.startswith("Rank 21 has launched up to operation 1906")


def test_a_dead_process_and_the_ranks_its_communicators_miss() -> None:
    report = parse(synthetic_text("ncclras/ncclras-dead-process.txt"))
    assert report.dead_count == 1
    [dead] = report.dead_processes
    assert (dead.pid, dead.host, dead.gpus) == (51877, "10.0.7.12", "2")
    assert [(c.label, c.kind, c.missing, [r.rank for r in c.ranks]) for c in report.comms] == [
        ("0-0", "INCOMPLETE", 1, [10]), ("1-2", "INCOMPLETE", 1, [2])]
    assert report.timeouts == 2 and not report.gaps


def test_no_job_on_the_node_is_said_not_guessed() -> None:
    report = parse(synthetic_text("ncclras/ncclras-no-job.txt"))
    assert report.client_error == "Failed to connect to the NCCL RAS service!"
    assert not report.groups and not report.healthy()
    assert any("could not query" in gap.reason for gap in report.gaps)


def test_detected_by_content() -> None:
    for path in sorted(synthetic("ncclras").glob("*.txt")):
        best = detect_kind(path.read_text())[0]
        assert best[1].name == "ncclras" and best[0] >= 0.8, path.name


@settings(max_examples=200, deadline=None)
@given(st.text(max_size=2000))
def test_never_raises_and_keeps_the_good_lines_around_a_bad_one(junk: str) -> None:
    text = synthetic_text("ncclras/ncclras-rank-behind-allreduce.txt")
    lines = text.splitlines()
    broken = "\n".join(lines[:20] + [junk.replace("\n", " ")[:200]] + lines[20:])
    report = parse(broken)
    assert report.nodes == 4
    assert any(r.rank == 21 for c in report.comms for r in c.lagging()) or "Rank" in junk or "#" in junk
    parse(junk)


def _bundle(root: Path, fixture: str, *, addresses: dict[str, str] | None = None) -> Path:
    now = datetime.now(UTC)
    writer = BundleWriter(root)
    writer.write_incident({"incident_id": "inc-ras", "created": iso(now), "alert": {"source": "t", "payload": {}},
                           "job": {"id": "88", "scheduler": "slurm", "nodes": NODES, "gpus_per_node": 8,
                                   "started": iso(now - timedelta(hours=3))},
                           "window": {"start": iso(now - timedelta(hours=1)), "end": iso(now)}})
    last = now - timedelta(minutes=40)
    rows = [{"step": s, "time": iso(last - timedelta(seconds=6 * (60 - s))), "loss": 2.0} for s in range(1, 61)]
    writer.write_jsonl("metrics.jsonl", rows)
    writer.write_probe_output(NODES[0], "ncclras.txt", (synthetic(f"ncclras/{fixture}")).read_bytes())
    if addresses:
        (root / "collection.json").write_text(json.dumps(
            {"nodes": [{"node": node, "address": address} for node, address in addresses.items()]}))
    return root


def test_the_rank_that_launched_fewer_operations_is_named_by_the_rank_map(tmp_path: Path) -> None:
    document = diagnose(_bundle(tmp_path / "b", "ncclras-rank-behind-allreduce.txt")).to_json()
    assert document["symptom"] == "stalled"
    primary = document["findings"][0]
    assert primary["cause"] == "collective_hang" and primary["ranks"] == [21]
    assert primary["nodes"] == ["gpu-003"]  # rank 21 of 32, 8 per node
    assert document["culprit_nodes"] == []
    assert primary["evidence"][0]["file"] == "nodes/gpu-001/ncclras.txt" and primary["evidence"][0]["line"] == 28


def test_a_dead_process_s_host_is_named_through_the_collector_s_addresses(tmp_path: Path) -> None:
    addresses = {"gpu-001": "10.0.7.11", "gpu-002": "10.0.7.12", "gpu-003": "10.0.7.13", "gpu-004": "10.0.7.14"}
    document = diagnose(_bundle(tmp_path / "b", "ncclras-dead-process.txt", addresses=addresses)).to_json()
    primary = document["findings"][0]
    assert primary["cause"] == "collective_hang" and primary["nodes"] == ["gpu-002"]
    assert "dead" in primary["summary"] and document["culprit_nodes"] == []
    # without the addresses the host stays a host, said as such, and no node is guessed
    unknown = diagnose(_bundle(tmp_path / "c", "ncclras-dead-process.txt")).to_json()["findings"][0]
    assert "10.0.7.12" in unknown["summary"] and "not matched to a node" in unknown["summary"]
    assert unknown["nodes"] == ["gpu-002"]  # rank 10 of the world communicator: 8 per node


def test_a_healthy_report_is_ruled_out(tmp_path: Path) -> None:
    document = diagnose(_bundle(tmp_path / "b", "ncclras-healthy-4x8.txt")).to_json()
    assert not any(f["cause"] == "collective_hang" for f in document["findings"])
    assert any("NCCL RAS" in r["why"] for r in document["ruled_out"])


def test_a_host_is_named_through_the_address_nccl_bootstrapped_on(tmp_path: Path) -> None:
    """No collection record: the node's own NCCL lines say which address it bootstrapped on."""
    root = _bundle(tmp_path / "b", "ncclras-dead-process.txt")
    writer = BundleWriter(root)
    for node, address in (("gpu-002", "10.0.7.12"), ("gpu-003", "10.0.7.13")):
        lines = (f"{node}:51877:51877 [2] NCCL INFO Bootstrap : Using ib0:{address}<0>\n"
                 f"{node}:51877:51877 [2] NCCL INFO NCCL version 2.26.2+cuda12.8\n")
        writer.write_probe_output(node, "nccl.log", lines.encode())
    primary = diagnose(root).to_json()["findings"][0]
    assert primary["cause"] == "collective_hang" and primary["nodes"] == ["gpu-002"]
    assert "not matched" not in primary["summary"]
