"""Bundle I/O against shared/spec/bundle.md: what is written reads back, and damage is reported."""

from __future__ import annotations

import json
import math
from datetime import UTC, datetime

import pytest

from spikeops.bundle import BundleWriter, open_bundle, probe_kind_for
from spikeops.errors import BundleError
from spikeops.probes.bundle_files import (
    ProbeStatus,
    parse_batches,
    parse_checkpoints,
    parse_incident,
    parse_probes,
    parse_ranks,
    read_float,
)
from tests.conftest import ROOT

EXAMPLE = ROOT / "examples" / "bundle-xid79"

INCIDENT = {
    "incident_id": "inc-1",
    "created": "2026-11-29T18:03:12Z",
    "alert": {"source": "alertmanager", "received": "2026-11-29T18:03:10Z", "payload": {}},
    "job": {"id": 4412, "scheduler": "slurm", "name": "llm", "nodes": ["gpu-001", "gpu-002"],
            "gpus_per_node": 8, "ranks": {"0": "gpu-001", "9": "gpu-002"},
            "max_length": 4096, "started": "2026-11-29T09:00:00Z",
            "resumed_from": {"step": 12000, "path": "/ckpt/step-12000"}},
    "window": {"start": "2026-11-29T17:55:00Z", "end": "2026-11-29T18:03:12Z"},
}


def test_probe_file_names_follow_the_spec():
    assert probe_kind_for("nvidia-smi-q.txt") == "nvidia-smi-q"
    assert probe_kind_for("nvidia-smi-q.xml") == "nvidia-smi-xml"
    assert probe_kind_for("ethtool-ib0.txt") == "ethtool"
    assert probe_kind_for("ethtool-enp1s0f0.txt") == "ethtool"
    assert probe_kind_for("kernel.log") == "kernel-log"
    assert probe_kind_for("notes.txt") is None


def test_incident_round_trip(tmp_path):
    writer = BundleWriter(tmp_path)
    writer.write_incident(INCIDENT)
    raw = json.loads((tmp_path / "incident.json").read_text())
    assert raw["format"] == "spikeops-bundle/1"
    bundle = open_bundle(tmp_path)
    incident = bundle.incident
    assert incident.incident_id == "inc-1"
    assert incident.job.id == "4412"
    assert incident.job.nodes == ["gpu-001", "gpu-002"]
    assert incident.job.resumed_from.step == 12000
    assert incident.window.start == datetime(2026, 11, 29, 17, 55, tzinfo=UTC)
    assert incident.window.contains(datetime(2026, 11, 29, 18, 0, tzinfo=UTC)) is True
    assert incident.window.contains(datetime(2026, 11, 22, tzinfo=UTC)) is False
    assert incident.window.contains(None) is None
    assert bundle.missing == []


def test_rank_to_node_rule():
    job = parse_incident(json.dumps(INCIDENT)).job
    assert job.node_of_rank(0) == "gpu-001"  # explicit map
    assert job.node_of_rank(9) == "gpu-002"
    implicit = parse_incident(json.dumps({**INCIDENT, "job": {**INCIDENT["job"], "ranks": {}}})).job
    assert implicit.node_of_rank(7) == "gpu-001"
    assert implicit.node_of_rank(8) == "gpu-002"
    assert implicit.node_of_rank(16) is None  # beyond the job
    assert implicit.ranks_on("gpu-002") == list(range(8, 16))


def test_open_refuses_what_is_not_a_bundle(tmp_path):
    with pytest.raises(BundleError, match="no incident.json"):
        open_bundle(tmp_path)
    with pytest.raises(BundleError, match="no such bundle"):
        open_bundle(tmp_path / "absent")
    (tmp_path / "incident.json").write_text("{not json")
    with pytest.raises(BundleError, match="not valid JSON"):
        open_bundle(tmp_path)
    (tmp_path / "incident.json").write_text(json.dumps({**INCIDENT, "format": "spikeops-bundle/2"}))
    with pytest.raises(BundleError, match="unsupported bundle format"):
        open_bundle(tmp_path)


def test_probe_outputs_are_stored_verbatim_with_stderr(tmp_path):
    writer = BundleWriter(tmp_path)
    raw = b"NIC statistics:\n     rx_packets: 5\r\n\xff odd byte\n"
    writer.write_probe_output("gpu-001", "ethtool-ib0.txt", raw, b"warning: x\n")
    assert (tmp_path / "nodes/gpu-001/ethtool-ib0.txt").read_bytes() == raw
    assert (tmp_path / "nodes/gpu-001/ethtool-ib0.err").read_bytes() == b"warning: x\n"
    writer.write_probe_output("gpu-001", "ethtool-ib0.txt", raw)  # idempotent; stale .err goes
    assert not (tmp_path / "nodes/gpu-001/ethtool-ib0.err").exists()


def test_writer_refuses_unsafe_names_and_unknown_errors(tmp_path):
    writer = BundleWriter(tmp_path)
    with pytest.raises(BundleError):
        writer.write_probe_output("../etc", "kernel.log", b"x")
    with pytest.raises(BundleError):
        writer.write_probe_output("gpu-001", "passwd", b"x")
    with pytest.raises(BundleError):
        writer.write_probes_json("gpu-001", [ProbeStatus("kernel", "dmesg", 1, None, 1.0, "exploded")])
    with pytest.raises(BundleError):
        writer.write_text("../outside.txt", "x")


def test_unreachable_node_has_only_probes_json(tmp_path):
    writer = BundleWriter(tmp_path)
    writer.write_incident(INCIDENT)
    writer.write_probe_output("gpu-002", "kernel.log", b"old\n")
    writer.write_unreachable("gpu-002", {"kernel": "dmesg --time-format iso", "ibstat": "ibstat"}, 10.0)
    assert [p.name for p in (tmp_path / "nodes/gpu-002").iterdir()] == ["probes.json"]
    probes = open_bundle(tmp_path).probes("gpu-002")
    assert probes.unreachable
    assert {p.error for p in probes.probes.values()} == {"unreachable"}


def test_metrics_jsonl_keeps_nan_through_a_round_trip(tmp_path):
    writer = BundleWriter(tmp_path)
    writer.write_incident(INCIDENT)
    writer.write_jsonl("metrics.jsonl", [{"step": 1, "loss": 2.0}, {"step": 2, "loss": math.nan}])
    assert "NaN" in (tmp_path / "metrics.jsonl").read_text()
    with pytest.raises(BundleError):
        writer.write_jsonl("other.jsonl", [])


def test_read_float_accepts_both_nonfinite_spellings():
    assert math.isnan(read_float("nan"))
    assert read_float("-inf") == -math.inf
    assert read_float("Infinity") == math.inf
    assert math.isnan(read_float(float("nan")))
    assert read_float("abc") is None
    assert read_float(True) is None


def test_probes_json_parse_and_bad_values():
    probes = parse_probes(json.dumps({
        "nvidia-smi-q": {"command": "nvidia-smi -q", "exit": 0, "started": "2026-11-29T18:03:30Z",
                         "seconds": 0.41, "error": None},
        "kernel": {"command": "dmesg --time-format iso", "exit": None, "seconds": 10.0, "error": "timeout"},
        "weird": {"command": "x", "exit": 0, "seconds": 1, "error": "exploded"},
    }))
    assert probes.probes["nvidia-smi-q"].ok
    assert probes.probes["kernel"].error == "timeout"
    assert not probes.unreachable
    assert any("exploded" in gap.reason for gap in probes.gaps)


def test_ranks_and_batches_skip_bad_lines_and_keep_the_rest():
    ranks = parse_ranks('{"step": 5, "rank": 17, "loss": NaN, "mem_allocated_gb": 61.2}\n'
                        'garbage\n{"rank": 3}\n{"step": 6, "rank": 1, "loss": "inf"}\n')
    assert [(r.step, r.rank) for r in ranks.records] == [(5, 17), (6, 1)]
    assert math.isnan(ranks.records[0].loss) and ranks.records[1].loss == math.inf
    assert [gap.line for gap in ranks.gaps] == [2, 3]
    batches = parse_batches('{"step": 12345, "rank": 17, "fingerprint": "9f2c", "num_samples": 8, '
                            '"max_tokens": 912044, "min_tokens": 12, "num_empty": 0, '
                            '"sample_ids": ["shard-0042:1881"], "source": "s3://corpus/shard-0042"}\n')
    record = batches.records[0]
    assert (record.max_tokens, record.num_empty, record.sample_ids, record.line) == (912044, 0, ["shard-0042:1881"], 1)


def test_checkpoints_json():
    result = parse_checkpoints(json.dumps([
        {"step": 12000, "path": "/ckpt/step-12000", "time": "2026-11-29T16:40:00Z",
         "manifest": "/ckpt/step-12000/MANIFEST.json", "verified": True, "problem": None},
        {"step": 11000, "path": "/ckpt/step-11000", "verified": False, "problem": "model.pt: digest mismatch"},
        {"step": 10000, "path": "/ckpt/step-10000", "verified": None},
    ]))
    assert [c.verified for c in result.checkpoints] == [True, False, None]
    assert result.checkpoints[1].problem == "model.pt: digest mismatch"
    assert parse_checkpoints("{}").gaps


def test_example_bundle_reads_with_expected_gaps():
    bundle = open_bundle(EXAMPLE)
    assert bundle.incident.job.name == "llm-70b"
    assert bundle.nodes() == ["gpu-001", "gpu-002", "gpu-003", "gpu-004"]
    assert bundle.probes("gpu-004").unreachable
    assert bundle.probes("gpu-003").probes["nvidia-smi-q"].error == "command-failed"
    assert bundle.stderr_of("gpu-003", "nvidia-smi-q.txt").startswith("Unable to determine")
    assert len(bundle.batches().records) == 4 * 32
    assert [c.step for c in bundle.checkpoints().checkpoints] == [11500, 12000]
