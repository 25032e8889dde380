"""The local Slurm cluster (spikeops.sim.slurmcluster), against Debian's real daemons.

One module cluster of 4 nodes serves the job tests; the tests of ``down`` and of failures
start their own, beside it (which is also the test that two clusters run at once). Every
client call has a subprocess timeout and every wait a deadline, so a broken daemon fails a
test instead of hanging the suite. A job starts about a second after ``sbatch`` (slurmctld
schedules once a second), the first about 3 s after slurmctld started.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from ClusterShell.NodeSet import NodeSet

from spikeops.sim import slurmcluster
from spikeops.sim.processes import pid_alive
from spikeops.sim.slurmcluster import (
    ClusterError,
    SlurmCluster,
    check_names,
    down,
    find_processes,
    load,
    node_names,
    running,
    slurm_conf,
    up,
)
from tests.conftest import ROOT

CLIENT_TIMEOUT = 15
WAIT = 20.0
DAEMONS = ("/usr/sbin/munged", "/usr/sbin/slurmctld", "/usr/sbin/slurmd", "/usr/bin/sbatch")


def _require_slurm() -> None:
    missing = [path for path in DAEMONS if not os.access(path, os.X_OK)]
    if missing:
        pytest.fail(f"{', '.join(missing)} missing: the Slurm cluster tests need Debian's Slurm and munge "
                    f"(apt-get install slurmctld slurmd slurm-client munge)")
    if os.geteuid() != 0:
        pytest.fail("the Slurm cluster tests run as root (SlurmUser=root)")


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    _require_slurm()
    with running(tmp_path_factory.mktemp("slurm"), nodes=4) as cluster:
        yield cluster


def run(cluster: SlurmCluster, *argv: str) -> subprocess.CompletedProcess[str]:
    env = {key: value for key, value in os.environ.items() if not key.startswith("SLURM_")}
    return subprocess.run(list(argv), env={**env, **cluster.env}, capture_output=True, text=True,
                          timeout=CLIENT_TIMEOUT, check=False)


def ok(cluster: SlurmCluster, *argv: str) -> str:
    proc = run(cluster, *argv)
    assert proc.returncode == 0, f"{' '.join(argv)} exited {proc.returncode}: {proc.stderr.strip()}"
    return proc.stdout


def wait_for(what: str, probe: Callable[[], object], timeout: float = WAIT) -> object:
    """Poll ``probe`` until it returns something true; fail with its last answer."""
    deadline = time.monotonic() + timeout
    while True:
        answer = probe()
        if answer:
            return answer
        if time.monotonic() > deadline:
            pytest.fail(f"{what}: not after {timeout:.0f} s (last: {answer!r})")
        time.sleep(0.05)


def submit(cluster: SlurmCluster, *args: str) -> str:
    return ok(cluster, "sbatch", "--parsable", *args).strip().split(";")[0]


def job(cluster: SlurmCluster, job_id: str) -> dict[str, str]:
    """``scontrol show job -o``'s fields (values without spaces are enough here)."""
    fields = {}
    for word in ok(cluster, "scontrol", "show", "job", "-o", job_id).split():
        key, sep, value = word.partition("=")
        if sep:
            fields[key] = value
    return fields


def wait_state(cluster: SlurmCluster, job_id: str, state: str) -> dict[str, str]:
    last: dict[str, str] = {}

    def reached() -> bool:
        last.update(job(cluster, job_id))
        return last.get("JobState") == state

    wait_for(f"job {job_id} {state} (now {last.get('JobState')})", reached)
    return last


def node_state(cluster: SlurmCluster, node: str) -> str:
    return ok(cluster, "sinfo", "-h", "-N", "-n", node, "-o", "%t").strip()


def script(path: Path, body: str) -> Path:
    path.write_text("#!/bin/bash\n" + body, encoding="utf-8")
    path.chmod(0o755)
    return path


# ---------------------------------------------------------------------------- no daemons


def test_node_names_and_conf():
    assert node_names(3) == ["node001", "node002", "node003"]
    assert node_names(1000, "gpu-")[-1] == "gpu-1000"
    with pytest.raises(ValueError, match="prefix"):
        node_names(2, "1x")
    text = slurm_conf(Path("/d"), ["n001", "n002"], ctld_port=20000, node_ports=[20001, 20002], cpus=4)
    assert "SlurmctldPort=20000\n" in text
    assert "NodeName=n002 NodeHostname=localhost Port=20002 CPUs=4 State=UNKNOWN\n" in text
    assert "AuthInfo=socket=/d/munge/munge.socket.2\n" in text
    assert "PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP\n" in text


def test_explicit_node_names_are_checked_before_anything_starts(tmp_path):
    assert check_names(["gpu-017", "c04-n10"]) == ["gpu-017", "c04-n10"]
    for bad, message in ((["gpu[017-018]"], "node name"), (["gpu-1,gpu-2"], "node name"),
                         (["gpu-1", "gpu-1"], "repeated"), ([], "at least 1"), ("gpu-017", "not one string")):
        with pytest.raises(ValueError, match=message):
            check_names(bad)
    with pytest.raises(ValueError, match="nodes=3 but 2 names"):
        up(tmp_path / "c", nodes=3, names=["gpu-017", "c04-n10"])
    assert not (tmp_path / "c").exists()


def test_up_refuses_a_foreign_directory_and_a_taken_port(tmp_path):
    _require_slurm()
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("not a cluster\n")
    with pytest.raises(ClusterError, match="not empty"):
        up(tmp_path / "mine")
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        with pytest.raises(ClusterError, match="not free"):
            up(tmp_path / "new", nodes=1, port=taken.getsockname()[1])
    assert not (tmp_path / "new").exists()
    with pytest.raises(ClusterError, match="too long for munge's socket"):
        up(tmp_path / ("x" * 100))


def test_a_node_that_never_registers_fails_up_with_its_log_and_leaves_nothing(tmp_path, monkeypatch):
    _require_slurm()
    fake = script(tmp_path / "slurmd", "exit 0\n")  # "starts", and no node ever registers
    monkeypatch.setenv("SPIKEOPS_SLURMD", str(fake))
    directory = tmp_path / "c"
    with pytest.raises(ClusterError, match=r"2 node\(s\) not idle \(node001=unk, node002=unk\).*slurmctld.log"):
        up(directory, nodes=2, ready_timeout=1.5)
    assert not find_processes(directory)


# ---------------------------------------------------------------------------- the module cluster


def test_every_node_is_idle_in_the_debug_partition(slurm):
    lines = ok(slurm, "sinfo", "-h", "-N", "-o", "%N %P %t").splitlines()
    assert sorted(lines) == [f"{node} debug* idle" for node in slurm.nodes]
    assert load(slurm.directory) == slurm
    assert slurm.env == {"SLURM_CONF": str(slurm.directory / "slurm.conf")}


def test_a_two_node_batch_job_runs_on_two_nodes_and_writes_its_output(slurm, tmp_path):
    body = ('echo "batch on $SLURMD_NODENAME of $SLURM_JOB_NODELIST"\n'
            'srun sh -c \'echo "step on $SLURMD_NODENAME"\'\n'
            "sleep 30\n")
    job_id = submit(slurm, "-N", "2", "-o", f"{tmp_path}/%j.out", "--chdir", str(tmp_path),
                    str(script(tmp_path / "two.sh", body)))
    fields = wait_state(slurm, job_id, "RUNNING")
    nodes = NodeSet(fields["NodeList"])
    assert len(nodes) == 2 and set(nodes) <= set(slurm.nodes)
    output = tmp_path / f"{job_id}.out"
    wait_for("both steps' output", lambda: output.is_file() and output.read_text().count("step on") == 2)
    text = output.read_text()
    assert f"batch on {nodes[0]} of {fields['NodeList']}" in text
    assert {f"step on {node}" for node in nodes} <= set(text.splitlines())
    ok(slurm, "scancel", job_id)
    wait_state(slurm, job_id, "CANCELLED")


def test_drain_shows_the_reason_and_resume_brings_the_node_back(slurm):
    ok(slurm, "scontrol", "update", "NodeName=node003", "State=DRAIN", "Reason=spikeops: test drain")
    assert node_state(slurm, "node003") == "drain"
    reasons = ok(slurm, "sinfo", "-R").splitlines()
    assert any(line.startswith("spikeops: test drain") and line.endswith("node003") for line in reasons), reasons
    ok(slurm, "scontrol", "update", "NodeName=node003", "State=RESUME")
    # RESUME shows idle* until slurmctld has pinged the node again.
    wait_for("node003 idle", lambda: node_state(slurm, "node003") == "idle")
    assert "node003" not in ok(slurm, "sinfo", "-h", "-R")


def test_usr1_reaches_the_batch_script_and_scancel_ends_it(slurm, tmp_path):
    body = (f"trap 'echo usr1 >> {tmp_path}/usr1' USR1\n"
            f"touch {tmp_path}/ready\n"
            "for i in $(seq 600); do sleep 0.1; done\n")
    job_id = submit(slurm, "-o", "/dev/null", str(script(tmp_path / "trap.sh", body)))
    wait_for("the script's trap set", (tmp_path / "ready").is_file)
    # slurmd may not have registered the batch step the instant the script runs: a signal
    # sent in that gap is lost (seen once in a full-suite run), so send until it lands.
    for _ in range(10):
        ok(slurm, "scancel", "--signal=USR1", "--batch", job_id)
        deadline = time.monotonic() + 1.0
        while time.monotonic() < deadline and not (tmp_path / "usr1").is_file():
            time.sleep(0.05)
        if (tmp_path / "usr1").is_file():
            break
    wait_for("the trap's file", (tmp_path / "usr1").is_file)
    assert job(slurm, job_id)["JobState"] == "RUNNING"  # trapped, not killed
    ok(slurm, "scancel", job_id)
    wait_state(slurm, job_id, "CANCELLED")


def test_requeue_kills_a_running_batch_job_and_runs_it_again(slurm, tmp_path):
    pids = tmp_path / "pids"
    job_id = submit(slurm, "--requeue", "-o", "/dev/null", "--wrap", f"echo $$ >> {pids}; exec sleep 60")
    wait_state(slurm, job_id, "RUNNING")
    wait_for("the first run's pid", lambda: pids.is_file() and pids.read_text().strip())
    first = int(pids.read_text().split()[0])
    ok(slurm, "scontrol", "requeue", job_id)
    fields = wait_state(slurm, job_id, "PENDING")
    assert fields["Restarts"] == "1"
    wait_for("the first run gone", lambda: not pid_alive(first))
    # Slurm holds a requeued job for 120 s (Reason=BeginTime); release it now.
    ok(slurm, "scontrol", "update", f"JobId={job_id}", "StartTime=now")
    wait_state(slurm, job_id, "RUNNING")
    wait_for("the second run's pid", lambda: len(pids.read_text().split()) == 2)
    ok(slurm, "scancel", job_id)
    wait_state(slurm, job_id, "CANCELLED")


def test_a_cluster_of_named_nodes(tmp_path):
    """A simulated incident's node names (not consecutive, not one prefix) are the nodes."""
    _require_slurm()
    names = ["gpu-017", "c04-n10", "spare-001"]
    with running(tmp_path / "named", names=names) as named:
        assert named.nodes == load(named.directory).nodes == names
        assert sorted(ok(named, "sinfo", "-h", "-N", "-o", "%N %t").splitlines()) == sorted(f"{n} idle" for n in names)
        job_id = submit(named, "-w", "gpu-017,c04-n10", "-N", "2", "-o", "/dev/null", "--wrap", "sleep 30")
        assert NodeSet(wait_state(named, job_id, "RUNNING")["NodeList"]) == NodeSet("gpu-017,c04-n10")


def test_a_cluster_in_a_deep_directory_still_runs_jobs(tmp_path):
    """slurmstepd's socket lives in the spool (SPOOL/NODE/NODE_JOB.STEP): under a long
    directory (pytest's own temp paths are) it would outgrow sun_path and no job would start,
    so the spool is reached through a short link instead."""
    _require_slurm()
    deep = tmp_path / "slurm"
    names = ["a-long-node-name-0001", "a-long-node-name-0002"]
    assert len(str(deep / "spool")) + 2 * len(names[0]) + len("//_1.4294967291") > 107  # too deep without the link
    with running(deep, names=names) as cluster:
        spool = next(line for line in cluster.conf.read_text().splitlines() if line.startswith("SlurmdSpoolDir="))
        assert len(spool) < len(f"SlurmdSpoolDir={deep}/spool/%n")
        job_id = submit(cluster, "-N", "2", "-o", "/dev/null", "--wrap", "sleep 30")
        assert len(NodeSet(wait_state(cluster, job_id, "RUNNING")["NodeList"])) == 2
        link = Path(spool.split("=", 1)[1].removesuffix("/%n"))
        assert link.is_symlink()
    assert not link.exists() and not link.is_symlink()  # down took the link away


def test_up_on_a_running_directory_fails_and_leaves_it_running(slurm):
    with pytest.raises(ClusterError, match="already running"):
        up(slurm.directory)
    assert slurmcluster.status(slurm.directory)["running"]


def test_down_ends_daemons_and_jobs_only_of_its_directory_and_is_idempotent(slurm, tmp_path):
    directory = tmp_path / "other"
    pids = tmp_path / "pids"
    with running(directory, nodes=2) as other:
        assert other.ctld_port != slurm.ctld_port
        job_id = submit(other, "-N", "2", "-o", "/dev/null", "--wrap",
                        f"srun sh -c 'echo $$ >> {pids}; exec sleep 60'")
        wait_state(other, job_id, "RUNNING")
        wait_for("both tasks", lambda: pids.is_file() and len(pids.read_text().split()) == 2)
        ours = find_processes(other.directory)
        # Not started for D: a shell that exported its SLURM_CONF and works inside it.
        bystander = subprocess.Popen(["sleep", "60"], cwd=directory, env={**os.environ, **other.env})
        try:
            started = time.monotonic()
            down(directory)
            took = time.monotonic() - started
            assert pid_alive(bystander.pid)
        finally:
            bystander.kill()
            bystander.wait()
    assert took < 2.0
    assert not find_processes(other.directory)
    assert not any(pid_alive(pid) for pid in ours)
    assert not any(pid_alive(int(pid)) for pid in pids.read_text().split())
    down(directory)  # idempotent
    assert slurmcluster.status(slurm.directory)["running"]  # the other cluster never noticed
    with running(directory, nodes=1) as again:  # a stopped cluster's directory is replaced
        assert load(directory).nodes == again.nodes == ["node001"]
        assert not (directory / "log" / "slurmd-node002.log").exists()


def test_command_line_and_wrappers(slurm, tmp_path):
    env = {key: value for key, value in os.environ.items() if not key.startswith("SLURM_")}
    status = subprocess.run([sys.executable, "-m", "spikeops.sim.slurmcluster", "status", "--dir",
                             str(slurm.directory)], capture_output=True, text=True, timeout=30, check=False,
                            cwd=ROOT, env=env)
    assert status.returncode == 0, status.stderr
    assert status.stdout.startswith(f"running: {slurm.directory} 4 nodes; 6/6 daemons alive; sinfo: node[001-004] idle")
    directory = tmp_path / "cli"
    started = subprocess.run([str(ROOT / "infra" / "slurm" / "up"), "--dir", str(directory), "--nodes", "2"],
                             capture_output=True, text=True, timeout=60, check=False, env=env)
    try:
        assert started.returncode == 0, started.stderr
        assert started.stdout.startswith("up: 2 nodes node[001-002] in partition debug, slurmctld on localhost:")
        again = subprocess.run([str(ROOT / "infra" / "slurm" / "up"), "--dir", str(directory)],
                               capture_output=True, text=True, timeout=60, check=False, env=env)
        assert again.returncode == 2 and "already running" in again.stderr
    finally:
        stopped = subprocess.run([str(ROOT / "infra" / "slurm" / "down"), "--dir", str(directory)],
                                 capture_output=True, text=True, timeout=60, check=False, env=env)
    assert stopped.returncode == 0, stopped.stderr
    assert not find_processes(directory.resolve())
    assert slurmcluster.main(["status", "--dir", str(directory)]) == 1
