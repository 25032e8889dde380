"""A real hung (or misaligned) gloo job, its flight recorder dumps and stacks collected over the
local cluster's SSH, and the diagnosis that names its rank and node.

The job is ``examples/train_tiny.py`` on three nodes of a real sshd cluster, started by the
local scheduler, one process per node (``--spawn``, as srun starts them, so each names its
node in its environment); its flight recorder is on and dumped by the job itself when it stops
advancing (gloo has no watchdog that dumps).

The cluster logs its SSH sessions in as an unprivileged user (``spikeops-sim``) while the job
runs as root, as a collector account without rights on the job would: over SSH the dumps are
found where the inventory says (``[job] flight_recorder``), and py-spy's attach to the job's
processes is refused, which the bundle records as the stacks probe's gap. The same stacks
script, run on the node with the rights a collector should have (root here), takes the real
stacks, and the diagnosis says where the stuck rank is. The archive unpacking is also checked
on hostile archives.
"""

from __future__ import annotations

import io
import json
import shutil
import subprocess
import sys
import tarfile
import time
from dataclasses import replace
from pathlib import Path

import pytest

from spikeops.bundle import unpack_archive
from spikeops.collect.collector import collect
from spikeops.collect.plan import plan_probes
from spikeops.diagnosis import diagnose
from spikeops.inventory import load_inventory
from spikeops.probes.flight_recorder import parse as parse_dump
from spikeops.schedulers import LocalScheduler
from spikeops.sim import cluster as simcluster
from spikeops.sim.nodetools import real_pyspy
from tests.conftest import ROOT

FIRST = "127.0.27.11"
TRAIN = ROOT / "examples" / "train_tiny.py"


def _tar(members: list[tuple[tarfile.TarInfo, bytes]]) -> bytes:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w", format=tarfile.GNU_FORMAT) as archive:
        for info, data in members:
            info.size = len(data)
            archive.addfile(info, io.BytesIO(data) if info.isreg() else None)
    return buffer.getvalue()


def test_unpacking_keeps_plain_files_only_and_what_came_before_a_cut(tmp_path: Path) -> None:
    def member(name: str, kind: bytes = tarfile.REGTYPE, link: str = "") -> tarfile.TarInfo:
        info = tarfile.TarInfo(name)
        info.type, info.linkname = kind, link
        return info

    archive = tmp_path / "a.tar"
    archive.write_bytes(_tar([
        (member("./trace_0"), b"zero"), (member("../escape"), b"x"), (member("/etc/evil"), b"x"),
        (member("sub/trace_9"), b"x"), (member("link", tarfile.SYMTYPE, "/etc/passwd"), b""),
        (member("dev", tarfile.CHRTYPE), b""), (member("./trace_1"), b"one"), (member("./trace_1"), b"again"),
    ]))
    written, problem = unpack_archive(archive, tmp_path / "out")
    assert written == ["trace_0", "trace_1"]
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["trace_0", "trace_1"]
    assert (tmp_path / "out" / "trace_1").read_bytes() == b"one"
    assert problem and "not plain files were skipped" in problem
    assert not (tmp_path / "escape").exists() and not (tmp_path / "out" / "link").exists()
    # cut inside the second file: the first is kept, the cut is said
    data = _tar([(member("./a"), b"A" * 700), (member("./b"), b"B" * 5000)])
    cut = tmp_path / "cut.tar"
    cut.write_bytes(data[:512 + 1024 + 512 + 1000])
    written, problem = unpack_archive(cut, tmp_path / "cutout")
    assert written == ["a"] and problem and "cut" in problem
    garbage = tmp_path / "garbage.tar"
    garbage.write_bytes(b"\x00\x01not a tar" * 100)
    written, problem = unpack_archive(garbage, tmp_path / "g")
    assert written == [] and problem


@pytest.fixture(params=["hang", "mismatch"])
def hung_job(request: pytest.FixtureRequest, tmp_path: Path):
    port = simcluster.free_port((FIRST,))
    # not pytest's tmp_path: the login user must reach the dumps (see simcluster.scratch)
    with simcluster.scratch() as root, simcluster.running(root / "c", nodes=3, port=port, first_address=FIRST,
                                                           scenario="false_alarm", seed=3) as cluster:
        scheduler = LocalScheduler(tmp_path / "sched")
        scheduler.add_nodes(cluster.nodes)
        run = tmp_path / "run"
        fault = (["--inject-hang", cluster.nodes[2], "--hang-at", "24"] if request.param == "hang"
                 else ["--inject-mismatch", cluster.nodes[2], "--mismatch-at", "24", "--fr-json"])
        prefix = root / "fr" / "nccl_trace_rank_"
        prefix.parent.mkdir(mode=0o755)
        with cluster.inventory.open("a") as inventory:  # [job] is the inventory's last table
            inventory.write(f'flight_recorder = "{prefix}"\n'
                            "pids = \"pgrep -f -- 'train_tiny.py.*--distributed'\"\n")
        argv = [sys.executable, str(TRAIN), "--out", str(run), "--launch", "--spawn", "--steps", "40",
                "--ckpt-every", "5", "--fr-dump-after", "2", "--collective-timeout", "900", *fault]
        job = scheduler.submit(argv, cluster.nodes, env={"TORCH_FR_BUFFER_SIZE": "2000",
                                                          "TORCH_FR_DUMP_TEMP_FILE": str(prefix)})
        try:
            deadline = time.monotonic() + 240
            while time.monotonic() < deadline and not all(Path(f"{prefix}{r}").is_file() for r in range(3)):
                assert scheduler.show_job(job).state == "RUNNING", (run / "train.log")
                time.sleep(0.5)
            assert all(Path(f"{prefix}{r}").is_file() for r in range(3)), "the job never dumped its recorder"
            yield request.param, cluster, job, run, tmp_path
        finally:
            scheduler.stop(job, grace=0.5)


def root_of(cluster) -> Path:
    return cluster.directory.parent


def test_a_hung_job_s_dumps_and_stacks_are_collected_and_name_its_rank(hung_job) -> None:
    mode, cluster, job, run, tmp_path = hung_job
    bundle = tmp_path / "bundle"
    inventory = load_inventory(cluster.inventory)
    result = collect(inventory, job, bundle)
    assert [r.outcome for r in result.nodes] == ["ok"] * 3, result.summary_lines()
    for node in cluster.nodes:
        folder = bundle / "nodes" / node
        probes = json.loads((folder / "probes.json").read_text())
        assert probes["flight-recorder"]["error"] is None, probes
        assert str(root_of(cluster) / "fr") in probes["flight-recorder"]["command"]
        # one host: every node sees all three dumps (as on a shared file system)
        assert sorted(p.name for p in (folder / "flight-recorder").iterdir()) == [
            f"nccl_trace_rank_{r}" for r in range(3)]
        assert not (folder / "flight-recorder.tar").exists()
        dump = parse_dump((folder / "flight-recorder" / "nccl_trace_rank_0").read_bytes())
        assert dump.complete and dump.format == ("pickle" if mode == "hang" else "json")
        # the login user may not attach to root's processes: the gap, said per process
        assert probes["stacks"]["error"] == "command-failed" and not (folder / "stacks").exists()
        said = (folder / "stacks.err").read_text()
        assert "Permission Denied" in said and "no Python stack taken" in said
        assert probes["ncclras"]["exit"] == 127  # no NCCL here: a recorded gap, not an error of the node
    # the incident, as the flow opens it: the job's own files and description, the window now
    for name in ("metrics.jsonl", "ranks.jsonl", "batches.jsonl"):
        if (run / name).is_file():
            shutil.copy(run / name, bundle / name)
    incident = json.loads((bundle / "incident.json").read_text())
    incident["job"].update(json.loads((run / "incident.json").read_text())["job"])
    incident["job"]["nodes"] = cluster.nodes
    # a watcher with a short stall rule raised it (tiny steps: seconds are many step times)
    incident["alert"]["payload"] = {"alertname": "TrainingStalled", "labels": {"stall_factor": "3", "stall_min_s": "5"}}
    last = json.loads((run / "metrics.jsonl").read_text().splitlines()[-1])
    assert last["step"] == 20  # the job flushes every 20 steps: what a hung job leaves on disk
    time.sleep(max(0.0, last["time"] + 8 - time.time()))
    incident["window"]["end"] = incident["created"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    (bundle / "incident.json").write_text(json.dumps(incident))
    document = diagnose(bundle).to_json()
    assert document["symptom"] == "stalled", document["missing"]
    # the launcher places ranks in the scheduler's (folded) node order: the faulty node's rank
    faulty = [int(r) for r, node in incident["job"]["ranks"].items() if node == cluster.nodes[2]]
    primary = document["findings"][0]
    assert document["culprit_nodes"] == []
    assert any(line.startswith("stacks on ") and "Permission Denied" in line for line in document["missing"]), document["missing"]
    if mode == "hang":
        assert primary["cause"] == "collective_hang" and primary["ranks"] == faulty
        assert primary["nodes"] == [cluster.nodes[2]] and "gloo:all_reduce" in primary["summary"]
    else:
        assert primary["cause"] == "collective_mismatch" and primary["ranks"] == faulty
        assert primary["nodes"] == [cluster.nodes[2]] and "broadcast" in primary["summary"]
    # the stacks script with the rights it needs (root, as the job): real stacks, each node's own
    plain = load_inventory(cluster.inventory).job
    for node in cluster.nodes:
        probe = next(p for p in plan_probes(replace(inventory, job=replace(plain, pids=None)), job, node)
                     if p.name == "stacks")
        done = subprocess.run(["sh", "-c", probe.remote.removeprefix("exec ")], capture_output=True, timeout=120,
                              env={"PATH": f"{Path(real_pyspy()).parent}:/usr/bin:/bin"})
        assert done.returncode == 0, done.stderr.decode()
        folder = bundle / "nodes" / node / "stacks"
        folder.mkdir()
        (folder / "stacks.tar").write_bytes(done.stdout)
        assert unpack_archive(folder / "stacks.tar", folder)[0]
        (folder / "stacks.tar").unlink()
    texts = {node: "\n".join(p.read_text() for p in (bundle / "nodes" / node / "stacks").iterdir())
             for node in cluster.nodes}
    if mode == "hang":
        assert "wait_for_shard (train_tiny.py:" in texts[cluster.nodes[2]]  # where the missing rank is
    else:
        assert "broadcast (torch/distributed/distributed_c10d.py:" in texts[cluster.nodes[2]]
    assert "all_reduce (torch/distributed/distributed_c10d.py:" in texts[cluster.nodes[0]]
    assert "wait_for_shard" not in texts[cluster.nodes[0]]
    primary = diagnose(bundle).to_json()["findings"][0]
    if mode == "hang":
        assert "is in wait_for_shard (train_tiny.py:" in primary["summary"]
