"""py-spy stacks: the parser on real ``py-spy dump`` output of live processes, and the stacks
probe finding a job's processes on a node and dumping them (or saying why it could not)."""

from __future__ import annotations

import io
import os
import subprocess
import sys
import tarfile
import textwrap
import uuid
from pathlib import Path

import pytest
from hypothesis import given, settings, strategies as st

from spikeops.collect.plan import plan_probes
from spikeops.inventory import parse_inventory
from spikeops.probes import detect_kind
from spikeops.probes.pyspy import parse
from spikeops.sim.nodetools import real_pyspy

PYSPY = real_pyspy()
PROGRAM = textwrap.dedent("""
    import threading, time

    def read_shard():
        while True:
            time.sleep(0.2)

    def heartbeat():
        while True:
            time.sleep(0.3)

    threading.Thread(target=heartbeat, name="heartbeat", daemon=True).start()
    print("ready", flush=True)
    read_shard()
""")


@pytest.fixture
def job(tmp_path: Path):
    """Processes of one job (by their environment, as a scheduler starts them): a Python rank
    on node n1, a Python rank on n2, and a program of the job that is not Python."""
    job_id = f"spy{uuid.uuid4().hex[:8]}"
    script = tmp_path / "rank.py"
    script.write_text(PROGRAM)
    started = []
    for node in ("n1", "n2"):
        env = {**os.environ, "SPIKEOPS_LOCAL_JOB": job_id, "SPIKEOPS_NODE": node}
        process = subprocess.Popen([sys.executable, str(script)], env=env, stdout=subprocess.PIPE, text=True)
        assert process.stdout.readline().strip() == "ready"
        started.append(process)
    started.append(subprocess.Popen(["sleep", "120"], env={**os.environ, "SPIKEOPS_LOCAL_JOB": job_id,
                                                             "SPIKEOPS_NODE": "n1"}))
    try:
        yield job_id, started
    finally:
        for process in started:
            process.kill()
            process.wait(10)


def _attach_works(pid: int) -> bool:
    if PYSPY is None:
        return False
    done = subprocess.run([PYSPY, "dump", "--pid", str(pid)], capture_output=True, timeout=30)
    return done.returncode == 0


def _stacks_probe(job_id: str, node: str, path: str) -> subprocess.CompletedProcess:
    inventory = parse_inventory("[cluster]\nnodes = 'n[1-2]'\n")
    probe = next(p for p in plan_probes(inventory, job_id, node) if p.name == "stacks")
    env = {"PATH": path, "HOME": os.environ.get("HOME", "/")}
    return subprocess.run(["sh", "-c", probe.remote.removeprefix("exec ")], capture_output=True, env=env, timeout=60)


def test_real_dump_of_a_live_process_parses(job) -> None:
    _, processes = job
    pid = processes[0].pid
    if not _attach_works(pid):
        pytest.fail("py-spy is in the test extras and attaches here (root, no Yama): it must work")
    text = subprocess.run([PYSPY, "dump", "--pid", str(pid)], capture_output=True, text=True, timeout=30).stdout
    dump = parse(text)
    assert not dump.gaps, dump.gaps
    [process] = dump.processes
    assert process.pid == pid and "rank.py" in process.command and process.python.startswith("v3.")
    assert {t.name for t in process.threads} == {"MainThread", "heartbeat"}
    where = process.waits_in()
    assert where.function == "read_shard" and where.file.endswith("rank.py") and where.line == 6
    assert not process.in_collective()
    assert detect_kind(text)[0][1].name == "py-spy"


def test_the_stacks_probe_dumps_this_node_s_python_processes_of_the_job(job) -> None:
    job_id, processes = job
    tools = str(Path(PYSPY).parent) if PYSPY else ""
    done = _stacks_probe(job_id, "n1", f"{tools}:/usr/bin:/bin")
    if PYSPY is None or not _attach_works(processes[0].pid):
        # where attaching is refused (ptrace) or py-spy is missing, that is the probe's answer
        assert done.returncode != 0 and done.stderr
        return
    assert done.returncode == 0, done.stderr.decode()
    archive = tarfile.open(fileobj=io.BytesIO(done.stdout))
    names = sorted(m.name.removeprefix("./") for m in archive.getmembers())
    # n1's Python rank only: n2's rank is another node's, `sleep` is not Python (skipped quietly)
    assert names == [f"{processes[0].pid}.txt"], names
    text = archive.extractfile(archive.getmembers()[0]).read().decode()
    assert parse(text).processes[0].waits_in().function == "read_shard"
    assert done.stderr == b""


def test_without_py_spy_the_probe_says_so(job) -> None:
    job_id, _ = job
    done = _stacks_probe(job_id, "n1", "/usr/bin:/bin")
    assert done.returncode == 127 and b"py-spy: not installed" in done.stderr


def test_a_node_without_the_job_says_so(job) -> None:
    tools = str(Path(PYSPY).parent) if PYSPY else "/nonexistent"
    done = _stacks_probe("nosuchjob", "n1", f"{tools}:/usr/bin:/bin")
    assert done.returncode != 0 and (b"no process of job nosuchjob" in done.stderr or PYSPY is None)


def test_a_refused_attach_is_the_probe_s_gap(job, tmp_path: Path) -> None:
    """A py-spy that cannot attach (what ptrace_scope or another user's process gives): the
    probe reports the pid and the reason, and keeps no empty stack."""
    job_id, processes = job
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "py-spy").write_text("#!/bin/sh\necho 'Error: Permission Denied: Try running again with elevated "
                                 "permissions' >&2\nexit 1\n")
    (fake / "py-spy").chmod(0o755)
    done = _stacks_probe(job_id, "n1", f"{fake}:/usr/bin:/bin")
    assert done.returncode == 1 and not done.stdout
    said = done.stderr.decode()
    assert f"pid {processes[0].pid}: Error: Permission Denied" in said and "no Python stack taken" in said


@settings(max_examples=200, deadline=None)
@given(st.text(max_size=3000))
def test_never_raises(text: str) -> None:
    parse(text)


def test_locals_are_not_kept() -> None:
    text = ("Process 1: python x.py\nPython v3.11.7 (/usr/bin/python3)\n\nThread 1 (idle): \"MainThread\"\n"
            "    main (x.py:3)\n        Arguments:\n            token: \"xoxb-secret\"\n")
    dump = parse(text)
    assert [f.function for f in dump.processes[0].threads[0].frames] == ["main"]
    assert "xoxb" not in repr(dump)
