"""PyTorch flight recorder dumps: parsed from a real gloo job's own dumps, refused when hostile,
and judged (collective_hang, collective_mismatch) with the rank and node they name.

The dumps come from ``tests/gloo_job.py``: three real processes talking gloo on this CPU, the
flight recorder on (``TORCH_FR_BUFFER_SIZE``), dumped by torch's own API
(``_dump_fr_trace``: pickle; ``_dump_fr_trace_json``: JSON) when the job stops advancing. In
one job rank 2 never enters a collective (its data loader hangs), in another it broadcasts
where the others all-reduce, in a third nothing goes wrong.
"""

from __future__ import annotations

import copyreg
import io
import json
import os
import pickle
import shutil
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from spikeops import cli
from spikeops.bundle import BundleWriter
from spikeops.diagnosis import diagnose
from spikeops.probes.flight_recorder import SafeUnpickler, parse, rank_from_name, safe_loads
from spikeops.reading import read_evidence
from spikeops.timeparse import iso
from tests import gloo_job

NODES = ["n1", "n2", "n3"]


def _run(tmp: Path, mode: str, *, as_json: bool = False) -> dict[int, bytes]:
    prefix = tmp / "fr" / "trace_"
    prefix.parent.mkdir(parents=True)
    processes = gloo_job.spawn(mode, prefix, as_json=as_json, dump_after=1.5)
    try:
        if mode == "clean":
            for process in processes:
                assert process.wait(180) == 0, process.stderr.read().decode()[-2000:]
        paths = gloo_job.wait_for_dumps(prefix, 3, processes)
        return {rank: path.read_bytes() for rank, path in enumerate(paths)}
    finally:
        gloo_job.stop(processes)


@pytest.fixture(scope="module")
def hang(tmp_path_factory) -> dict[int, bytes]:
    """Rank 2 hangs in its data loader at step 4; pickle dumps (torch's default)."""
    return _run(tmp_path_factory.mktemp("hang"), "hang")


@pytest.fixture(scope="module")
def mismatch(tmp_path_factory) -> dict[int, bytes]:
    """Rank 2 broadcasts where ranks 0 and 1 all-reduce; JSON dumps."""
    return _run(tmp_path_factory.mktemp("mismatch"), "mismatch", as_json=True)


@pytest.fixture(scope="module")
def clean(tmp_path_factory) -> dict[int, bytes]:
    return _run(tmp_path_factory.mktemp("clean"), "clean")


# ---------------------------------------------------------------------------- parsing real dumps


def _seqs(dump) -> dict[int, object]:
    return {e.collective_seq_id: e for e in dump.entries}


def test_real_pickle_dumps_of_a_hang(hang: dict[int, bytes]) -> None:
    dumps = {rank: parse(data) for rank, data in hang.items()}
    for rank, dump in dumps.items():
        assert dump.format == "pickle" and dump.complete and not dump.gaps, (rank, dump.gaps)
        assert dump.version and dump.version.startswith("2.")
        assert {e.backend for e in dump.entries} == {"gloo"} and {e.op for e in dump.entries} == {"all_reduce"}
        assert dump.pg_config and list(dump.pg_config.values())[0].ranks == [0, 1, 2]
        assert any(f.filename.endswith("gloo_job.py") for e in dump.entries for f in e.frames)  # pickle has stacks
    # ranks 0 and 1 wait in the step-4 gradient all-reduce (2 all-reduces a step: seq 7)
    for rank in (0, 1):
        pending = [e for e in dumps[rank].entries if e.pending]
        assert [e.collective_seq_id for e in pending] == [7], rank
        assert pending[0].input_sizes == [[4096]] and pending[0].state == "scheduled"
    # rank 2 stopped in its data loader: its last collective (6) finished, 7 never issued
    assert max(_seqs(dumps[2])) == 6 and not any(e.pending for e in dumps[2].entries)


def test_real_json_dumps_of_a_mismatch(mismatch: dict[int, bytes]) -> None:
    dumps = {rank: parse(data) for rank, data in mismatch.items()}
    for dump in dumps.values():
        assert dump.format == "json" and dump.complete and not dump.gaps
        assert all(isinstance(s.last_enqueued, int) for s in dump.pg_status.values())  # torch writes them as strings
    assert _seqs(dumps[0])[7].op == _seqs(dumps[1])[7].op == "all_reduce"
    assert _seqs(dumps[2])[7].op == "broadcast"
    assert _seqs(dumps[2])[7].profiling_name == "gloo:broadcast"


def test_spikeops_parse_detects_both_formats_by_content(hang, mismatch, tmp_path: Path) -> None:
    for name, data in (("a", hang[0]), ("b.json", mismatch[2])):
        path = tmp_path / name
        path.write_bytes(data)
        reading = read_evidence(path)
        assert reading.kind.name == "flight-recorder" and reading.confidence == 1.0
        out, err = io.StringIO(), io.StringIO()
        assert cli.main(["parse", str(path)], out=out, err=err) == 0, err.getvalue()
        assert "flight recorder dump" in out.getvalue() and "pending" in out.getvalue()
        out = io.StringIO()
        assert cli.main(["parse", "--json", str(path)], out=out, err=err) == 0
        assert json.loads(out.getvalue())["result"]["entries"]
    out = io.StringIO()
    assert cli.main(["parse", "--list-kinds"], out=out, err=io.StringIO()) == 0
    assert {"flight-recorder", "ncclras", "py-spy"} <= {line.split()[0] for line in out.getvalue().splitlines()}


def test_rank_comes_from_the_name_torch_gives_the_file() -> None:
    assert rank_from_name("nccl_trace_rank_12") == 12
    assert rank_from_name("trace_0") == 0
    assert rank_from_name("trace_") is None


# ---------------------------------------------------------------------------- hostile input


class _System:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


class _Eval:
    def __reduce__(self):
        return (eval, ("__import__('os').system('true')",))


def test_a_crafted_pickle_cannot_run_code(tmp_path: Path, hang) -> None:
    marker = tmp_path / "pwned"
    attacks = {
        "os.system via __reduce__": pickle.dumps({"entries": [_System(marker)], "pg_config": {}}, protocol=2),
        "os.system, protocol 5": pickle.dumps(_System(marker), protocol=5),
        "builtins.eval": pickle.dumps({"version": "2.10", "entries": [_Eval()]}, protocol=2),
        "a class instance": pickle.dumps({"entries": [Path("/etc/passwd")]}, protocol=2),
        # the copyreg extension registry: EXT1 code 240, registered below as os.system
        "EXT1": b"\x80\x02\x82\xf0.",
        # a persistent id (PERSID)
        "PERSID": b"\x80\x02Pabc\n.",
        # the GLOBAL opcode (protocol 0 text inside a protocol-2 stream)
        "GLOBAL": b"\x80\x02cos\nsystem\n(S'touch " + str(marker).encode() + b"'\ntR.",
    }
    copyreg.add_extension("os", "system", 240)
    try:
        for what, data in attacks.items():
            dump = parse(data)
            assert not dump.complete and not dump.entries, what
            assert dump.gaps and "refused" in dump.gaps[0].reason, (what, dump.gaps)
            with pytest.raises(pickle.UnpicklingError):
                safe_loads(data)
    finally:
        copyreg.remove_extension("os", "system", 240)
    assert not marker.exists(), "a pickle ran code"
    assert isinstance(SafeUnpickler(io.BytesIO(hang[0])).load(), dict)  # the real dump needs no global at all


def test_a_crafted_file_is_refused_through_the_cli_too(tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    path = tmp_path / "trace_0"
    path.write_bytes(pickle.dumps({"entries": [_System(marker)], "pg_config": {"0": {}}}, protocol=2))
    out, err = io.StringIO(), io.StringIO()
    assert cli.main(["parse", str(path)], out=out, err=err) == 0
    assert "refused a global" in out.getvalue() and not marker.exists()


def test_truncated_and_corrupt_real_dumps_are_gaps(hang, mismatch) -> None:
    for data in (hang[0], mismatch[0]):
        step = max(1, len(data) // 60)
        for cut in range(1, len(data) - 1, step):
            dump = parse(data[:cut])
            assert not dump.complete and dump.gaps, cut
            assert any(word in dump.gaps[0].reason for word in ("truncated", "corrupt", "not a flight", "empty")), \
                (cut, dump.gaps)
    flipped = bytearray(hang[0])
    flipped[len(flipped) // 2] ^= 0xFF
    parse(bytes(flipped))  # whatever it says, it says it without raising


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=4096))
def test_fuzzed_bytes_never_raise(data: bytes) -> None:
    dump = parse(data)
    assert dump.complete or dump.gaps


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=2048))
def test_fuzzed_pickles_never_raise_nor_resolve(data: bytes) -> None:
    dump = parse(b"\x80\x02" + data)
    assert dump.complete or dump.gaps


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.data())
def test_real_dumps_with_fuzzed_bytes_never_raise(hang, data) -> None:
    raw = bytearray(hang[1])
    for _ in range(data.draw(st.integers(1, 8))):
        raw[data.draw(st.integers(0, len(raw) - 1))] = data.draw(st.integers(0, 255))
    parse(bytes(raw))


# ---------------------------------------------------------------------------- the diagnosis


def _bundle(root: Path, dumps: dict[int, bytes], *, everywhere: bool = False, started: datetime | None = None,
            ranks: bool = True, last_step_age: float = 1800.0) -> Path:
    """A bundle of a job stalled ``last_step_age`` seconds before the incident, its dumps in
    each rank's node folder (``everywhere``: in every node's, as a shared file system shows)."""
    now = datetime.now(UTC)
    writer = BundleWriter(root)
    job = {"id": "77", "scheduler": "local", "nodes": NODES, "gpus_per_node": 1,
           "started": iso(started or now - timedelta(hours=2))}
    if ranks:
        job["ranks"] = {str(r): node for r, node in enumerate(NODES)}
    writer.write_incident({"incident_id": "inc-fr", "created": iso(now), "alert": {"source": "test", "payload": {}},
                           "job": job, "window": {"start": iso(now - timedelta(hours=1)), "end": iso(now)}})
    last = now - timedelta(seconds=last_step_age)
    lines = [json.dumps({"step": s, "time": iso(last - timedelta(seconds=10 * (40 - s))), "loss": 2.5 - 0.01 * s})
             for s in range(1, 41)]
    (root / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    for rank, data in dumps.items():
        for node in (NODES if everywhere else [NODES[rank]]):
            target = root / "nodes" / node / "flight-recorder" / f"trace_{rank}"
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(data)
    return root


def test_a_hang_names_the_rank_that_never_joined_and_its_node(hang, tmp_path: Path) -> None:
    document = diagnose(_bundle(tmp_path / "b", hang)).to_json()
    assert document["symptom"] == "stalled" and document["spike_step"] == 40
    primary = document["primary"]
    assert primary["cause"] == "collective_hang" and primary["layer"] == "communication"
    assert document["culprit_nodes"] == []  # a rank stuck in its data loader is not a bad node
    assert document["culprit_ranks"] == [2]
    finding = document["findings"][0]
    assert finding["nodes"] == ["n3"] and finding["ranks"] == [2]
    assert "collective 7" in finding["summary"] and "gloo:all_reduce" in finding["summary"]
    assert "rank(s) 0-1 wait" in finding["summary"]
    cited = {line["file"] for line in finding["evidence"]}
    assert "nodes/n3/flight-recorder/trace_2" in cited and "nodes/n1/flight-recorder/trace_0" in cited
    kinds = [a["kind"] for a in document["actions"]]
    assert kinds[:2] == ["stop_job", "preserve_state"] and "check_ranks" in kinds


def test_a_shared_file_system_shows_every_dump_everywhere_and_it_is_read_once(hang, tmp_path: Path) -> None:
    document = diagnose(_bundle(tmp_path / "b", hang, everywhere=True)).to_json()
    finding = document["findings"][0]
    assert finding["cause"] == "collective_hang" and finding["ranks"] == [2] and finding["nodes"] == ["n3"]
    assert not any("second" in line for line in document["missing"])


def test_without_a_rank_map_the_node_that_held_the_only_dump_is_named(hang, tmp_path: Path) -> None:
    document = diagnose(_bundle(tmp_path / "b", hang, ranks=False)).to_json()
    assert document["findings"][0]["nodes"] == ["n3"]


def test_a_mismatch_names_the_odd_rank_and_asks_for_the_parallel_config(mismatch, tmp_path: Path) -> None:
    document = diagnose(_bundle(tmp_path / "b", mismatch)).to_json()
    primary = document["findings"][0]
    assert primary["cause"] == "collective_mismatch" and primary["ranks"] == [2] and primary["nodes"] == ["n3"]
    assert "broadcast" in primary["summary"] and "all_reduce" in primary["summary"]
    assert document["culprit_nodes"] == []
    assert not any(f["cause"] == "collective_hang" for f in document["findings"])  # the mismatch says it
    assert any(a["kind"] == "fix_parallel_config" for a in document["actions"])


def test_a_healthy_job_s_dumps_rule_both_out(clean, tmp_path: Path) -> None:
    document = diagnose(_bundle(tmp_path / "b", clean, last_step_age=5)).to_json()
    assert document["symptom"] == "none"
    assert not any(f["cause"].startswith("collective") for f in document["findings"])
    assert any("agree on every collective" in r["why"] for r in document["ruled_out"])


def test_another_run_s_dumps_are_set_aside(hang, tmp_path: Path) -> None:
    later = datetime.now(UTC) + timedelta(hours=1)  # the job started after these dumps were written
    document = diagnose(_bundle(tmp_path / "b", hang, started=later)).to_json()
    assert not any(f["cause"].startswith("collective") for f in document["findings"])
    assert any("another run's dump" in line for line in document["missing"])


def test_a_truncated_dump_is_a_gap_not_a_healthy_rank(hang, tmp_path: Path) -> None:
    cut = dict(hang)
    cut[2] = hang[2][: len(hang[2]) // 2]
    document = diagnose(_bundle(tmp_path / "b", cut)).to_json()
    assert any("trace_2" in line and "truncated" in line for line in document["missing"]), document["missing"]
    finding = document["findings"][0]
    # rank 2's dump was not read: it is not called healthy, and ranks 0-1 still wait for it
    assert finding["cause"] == "collective_hang" and finding["ranks"] == [2]
    assert "left no dump" in finding["summary"] and finding["confidence"] < 0.6


def test_hardware_evidence_on_the_named_node_convicts_it_with_the_hang_joined(hang, tmp_path: Path) -> None:
    root = _bundle(tmp_path / "b", hang)
    moment = datetime.now(UTC) - timedelta(seconds=1700)
    (root / "nodes" / "n3" / "kernel.log").write_text(
        f"{moment.strftime('%Y-%m-%dT%H:%M:%S,000000+00:00')} NVRM: Xid (PCI:0000:3b:00): 79, pid=4242, "
        "name=python, GPU has fallen off the bus.\n")
    document = diagnose(root).to_json()
    assert document["primary"]["cause"] == "gpu_xid" and document["culprit_nodes"] == ["n3"]
    xid = document["findings"][0]
    assert any("flight-recorder" in line["file"] for line in xid["evidence"])
    hang_finding = next(f for f in document["findings"] if f["cause"] == "collective_hang")
    assert hang_finding["confidence"] < xid["confidence"]


def test_a_stall_with_nothing_that_names_the_rank_is_inconclusive_and_asks_for_the_recorder(tmp_path: Path) -> None:
    from spikeops.remediation import resume_plan
    from spikeops.response import approval_gate

    document = diagnose(_bundle(tmp_path / "b", {})).to_json()
    assert document["symptom"] == "stalled" and document["primary"]["cause"] == "inconclusive"
    assert document["culprit_nodes"] == [] and document["resume_from"] is None  # no checkpoints.json here
    assert document["onset_step"] == 40
    kinds = [a["kind"] for a in document["actions"]]
    assert kinds[:2] == ["stop_job", "preserve_state"] and "collect_evidence" in kinds
    collect = next(a for a in document["actions"] if a["kind"] == "collect_evidence")
    assert any("flight recorder" in what for what in collect["what"])
    plan = resume_plan(document["actions"], document["findings"])
    assert plan.env["TORCH_FR_BUFFER_SIZE"] == "2000"  # the next hang names its rank
    assert any("flight-recorder/: no dump collected" in line for line in document["missing"])
    # a person decides the resume of a job nobody knows why it hung
    gate = approval_gate("auto-hardware", {**document, "resume_from": {"step": 30, "path": "/c/30"}}, stopped=True)
    assert gate.action == "resume" and gate.ask


def test_a_pipeline_send_met_by_a_receive_of_another_size_is_a_mismatch(tmp_path: Path) -> None:
    """Point-to-point ops: gloo does not record them, so these two dumps are built in NCCL's
    layout (``nccl:send 0->1``, ``nccl:recv 1<-0``, ``is_p2p``), as the rule's own unit test."""
    def entry(index: int, name: str, size: int, state: str = "completed") -> dict:
        return {"record_id": index, "pg_id": 1, "process_group": ["1", "pp"], "collective_seq_id": 0,
                "p2p_seq_id": index + 1, "op_id": index + 1, "profiling_name": name, "time_created_ns": 0,
                "input_sizes": [[size]], "input_dtypes": ["BFloat16"], "output_sizes": [[size]],
                "output_dtypes": ["BFloat16"], "state": state, "retired": state == "completed", "timeout_ms": 600000,
                "is_p2p": True}

    config = {"1": {"name": "1", "desc": "pp", "ranks": "[0, 1]"}}
    sender = {"version": "2.7", "pg_config": config, "pg_status": {}, "entries": [
        entry(0, "nccl:send 0->1", 4096), entry(1, "nccl:send 0->1", 8192, "started")]}
    receiver = {"version": "2.7", "pg_config": config, "pg_status": {}, "entries": [
        entry(0, "nccl:recv 1<-0", 4096), entry(1, "nccl:recv 1<-0", 4096, "started")]}
    dumps = {0: json.dumps(sender).encode(), 1: json.dumps(receiver).encode()}
    document = diagnose(_bundle(tmp_path / "b", dumps)).to_json()
    finding = next(f for f in document["findings"] if f["cause"] == "collective_mismatch")
    assert "send 0->1 of [[8192]] met a receive of [[4096]]" in finding["summary"]
    assert finding["ranks"] == [0, 1] and document["culprit_nodes"] == []


def test_a_job_state_probe_failing_alike_on_every_node_is_said_once(tmp_path: Path) -> None:
    """py-spy names each process by its pid, which differs on every node, and a process that
    ended while it looked says so first on some: the reason is still said once for all nodes,
    and it is the one that tells why (the permission), never a vanished process."""
    root = _bundle(tmp_path / "b", {})
    for index, node in enumerate(NODES):
        folder = root / "nodes" / node
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "probes.json").write_text(json.dumps({"stacks": {
            "command": "py-spy dump", "exit": 1, "started": iso(datetime.now(UTC)), "seconds": 0.5,
            "error": "command-failed"}}))
        vanished = f"pid {900 + index}: Error: Failed to get process executable name. Check that the process is running.\n"
        (folder / "stacks.err").write_text((vanished if index % 2 else "") +
                                           f"pid {4242 + 17 * index}: Permission Denied: try as root (exit 1)\n")
    missing = diagnose(root).to_json()["missing"]
    said = [line for line in missing if "stacks" in line]
    assert said == ["stacks on n[1-3]: command-failed (pid <pid>: Permission Denied: try as root (exit 1))"], missing
