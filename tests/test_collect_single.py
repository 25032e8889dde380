"""One SSH session per node: the POSIX-sh runner and its framing, then the collector in both
session modes against real OpenSSH servers (spikeops.sim.cluster).

The runner is run by each shell a node may have (dash, busybox with nothing but its applets,
bash in POSIX mode) and its stream is read by the collector's own parser. Then a cluster of
faulty nodes (hang, flood, binary output, a child that keeps stdout open, no GPU, no IB)
is collected once per mode: the bundles must be the same file for file and byte
for byte (probes.json entries up to their timing). A node whose SSH connection dies mid-run
keeps what it had sent; a node that cannot spool falls back to a session per probe.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import select
import shutil
import signal
import subprocess
import tarfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from spikeops.collect import collect
from spikeops.collect.single import FrameError, FrameReader, give_up_line, probe_line, runner_script, start_line
from spikeops.collect.plan import PlannedProbe, remote_command
from spikeops.errors import InputError
from spikeops.inventory import load_inventory, parse_inventory
from spikeops.sim import cluster as simcluster
from spikeops.sim.nodetools import BINARY_OUTPUT, REAL_LOGIN

#: Short, but far from what any healthy probe takes on a loaded 2-core machine ("slow", a 3 s
#: tool, is left to test_collect.py, whose timeout leaves it room).
COMMAND_TIMEOUT = 4
CAP = 1 << 20
FAULTS = {"#1": "hang", "#2": "flood", "#3": "nogpu", "#4": "noib", "#6": "binary", "#7": "linger"}


# ------------------------------------------------------------------------------- the runner alone


def _busybox_path(tmp_path: Path) -> Path:
    """A PATH directory holding nothing but busybox applets (a minimal node or container)."""
    busybox = shutil.which("busybox")
    if busybox is None:
        pytest.fail("busybox missing: apt-get install busybox (Makefile APT_PACKAGES)")
    folder = tmp_path / "busybox-bin"
    folder.mkdir()
    for applet in ("sh", "head", "tail", "cat", "rm", "sleep", "mkdir", "mkfifo", "tar", "timeout", "setsid",
                   "printf", "echo", "yes", "tr"):
        (folder / applet).symlink_to(busybox)
    return folder


SHELLS = {
    "dash": lambda tmp: (["/bin/sh", "-s"], None) if os.path.realpath("/bin/sh").endswith("dash")
    else (["dash", "-s"], None),
    "busybox": lambda tmp: ([str(_busybox_path(tmp) / "sh"), "-s"], {"PATH": str(tmp / "busybox-bin")}),
    "bash --posix": lambda tmp: (["bash", "--posix", "-s"], None),
}


def _probe(name: str, command: str, timeout: float = 5, max_bytes: int = 1 << 20, keep: str = "head") -> PlannedProbe:
    return PlannedProbe(name, f"{name}.txt", "x", command, remote_command(command, timeout, max_bytes, keep),
                        timeout, max_bytes, keep)


class _Frames:
    """What a runner's stream says, probe by probe (the collector's own parser reads it)."""

    def __init__(self) -> None:
        self.reader = FrameReader()
        self.hello = False
        self.probes: dict[int, dict] = {}

    def feed(self, data: bytes) -> None:
        for kind, value in self.reader.feed(data):
            if kind == "hello":
                self.hello = True
            elif kind == "probe":
                self.probes[value.index] = {"status": value.status, "state": value.state, "out": b"", "err": b""}
            elif kind in ("out", "err"):
                self.probes[value[0]][kind] += value[1]


def _converse(argv: list[str], env: dict | None, probes: list[PlannedProbe], spool: Path,
              give_up: dict[int, float] | None = None, limit: float = 60) -> tuple[_Frames, float]:
    """Run the runner as the collector does: the script and every probe on stdin, `_g` for
    the probes of ``give_up`` (index: seconds after the start) still unreported by then,
    read until the end frame, then close stdin (which ends the runner)."""
    script = runner_script() + start_line([str(spool)])
    script += b"".join(probe_line(index, probe) for index, probe in enumerate(probes)) + b"_f\n"
    process = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    assert process.stdin is not None and process.stdout is not None
    process.stdin.write(script)
    process.stdin.flush()
    os.set_blocking(process.stdout.fileno(), False)
    frames = _Frames()
    pending = dict(give_up or {})
    t0 = time.monotonic()
    try:
        while not frames.reader.ended:
            elapsed = time.monotonic() - t0
            assert elapsed < limit, "the runner did not end"
            due = [index for index, after in pending.items() if elapsed >= after and index not in frames.probes]
            if due:
                process.stdin.write(give_up_line(due))
                process.stdin.flush()
                for index in due:
                    pending.pop(index)
            ready, _, _ = select.select([process.stdout], [], [], 0.1)
            if ready:
                data = process.stdout.read()
                assert data, f"the runner's output ended early: {process.stderr.read()!r}"
                frames.feed(data)
    finally:
        process.stdin.close()
        process.wait(timeout=30)
    return frames, time.monotonic() - t0


@pytest.mark.parametrize("shell", list(SHELLS))
def test_runner_frames_every_probe_on_any_posix_shell(shell: str, tmp_path: Path) -> None:
    argv, env = SHELLS[shell](tmp_path)
    binary = tmp_path / "binary.out"
    binary.write_bytes(BINARY_OUTPUT)
    lingerer, unkillable = tmp_path / "lingerer.pid", tmp_path / "unkillable.pid"
    probes = [
        _probe("echo", "echo hello"),
        _probe("missing", "no-such-tool-on-this-node --version"),
        _probe("binary", f"cat {binary}"),
        _probe("fails", "echo partial; echo 'it broke' >&2; exit 3"),
        _probe("flood", "yes flood", max_bytes=100_000),
        _probe("hang", "sleep 600", timeout=1),
        # prints, exits, and leaves a detached child holding stdout open
        _probe("linger", f"echo 'partial answer'; setsid sh -c 'echo $$ >{lingerer}; exec sleep 30' &", timeout=1),
        _probe("stderr-flood", "yes complaint >&2", timeout=1),
        # outlives its timeout (as a process in uninterruptible sleep would): given up on
        PlannedProbe("unkillable", "unkillable.txt", "x", "unkillable",
                     f"exec sh -c 'echo $$ >{unkillable}; echo before; exec sleep 30'", 1, 1 << 20, "head"),
        _probe("tail", "yes | head -c 300000", max_bytes=1000, keep="tail"),
    ]
    env = dict(os.environ, **env) if env is not None else None
    spool = tmp_path / "spool"
    spool.mkdir()
    try:
        frames, elapsed = _converse(argv, env, probes, spool, give_up={8: 2.5})
    finally:
        for pid_file in (lingerer, unkillable):
            if pid_file.exists():
                with contextlib.suppress(ProcessLookupError, ValueError):
                    os.kill(int(pid_file.read_text()), signal.SIGKILL)
    assert frames.hello and sorted(frames.probes) == list(range(len(probes)))
    by_name = {probe.name: frames.probes[index] for index, probe in enumerate(probes)}
    assert by_name["echo"] == {"status": 0, "state": "done", "out": b"hello\n", "err": b""}
    assert by_name["missing"]["status"] == 127 and by_name["missing"]["out"] == b""
    assert b"no-such-tool-on-this-node" in by_name["missing"]["err"]
    assert by_name["binary"]["out"] == BINARY_OUTPUT and by_name["binary"]["status"] == 0
    assert by_name["fails"] == {"status": 3, "state": "done", "out": b"partial\n", "err": b"it broke\n"}
    # the node keeps the cap plus one byte, rounded up to a 512-byte block, and no more: the
    # flood meets its file-size limit
    assert len(by_name["flood"]["out"]) == 100_352 and by_name["flood"]["out"].startswith(b"flood\nflood\n")
    assert by_name["flood"]["status"] not in (0, None)
    assert by_name["hang"]["status"] in (124, 143) and by_name["hang"]["state"] == "done"  # 143: busybox timeout
    # the probe itself ended: its answer is complete, whatever its child still holds
    assert by_name["linger"] == {"status": 0, "state": "done", "out": b"partial answer\n", "err": b""}
    # stderr shares the limit (here the 1 MiB cap's): the collector keeps its first 64 KiB
    assert len(by_name["stderr-flood"]["err"]) == (1 << 20) + 512
    assert by_name["stderr-flood"]["err"].startswith(b"complaint\n")
    assert by_name["unkillable"] == {"status": None, "state": "stuck", "out": b"before\n", "err": b""}
    assert by_name["tail"]["out"] == b"y\n" * 500 and by_name["tail"]["status"] == 0
    assert elapsed < 20  # a hang guard: the lingering children hold their files for 30 s
    deadline = time.monotonic() + 10
    while list(spool.iterdir()) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not list(spool.iterdir()), "the spool directory was left behind"


def test_runner_reports_a_node_without_a_spool_directory(tmp_path: Path) -> None:
    script = runner_script() + start_line([str(tmp_path / "missing"), "/proc"]) + b"_f\n"
    done = subprocess.run(["sh", "-s"], input=script, capture_output=True, timeout=30, check=False)
    reader = FrameReader()
    events = list(reader.feed(done.stdout))
    assert events and events[0][0] == "fail" and "no writable spool directory" in events[0][1]


def test_runner_reports_a_node_without_tar(tmp_path: Path) -> None:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for tool in ("mkdir", "mkfifo", "rm", "timeout"):
        (bin_dir / tool).symlink_to(shutil.which(tool))
    script = runner_script() + start_line([str(tmp_path)]) + b"_f\n"
    done = subprocess.run(["/bin/sh", "-s"], input=script, capture_output=True, timeout=30, check=False,
                          env={"PATH": str(bin_dir)})
    events = list(FrameReader().feed(done.stdout))
    assert events == [("fail", "no tar on the node")]


def _tar(members: list[tuple[str, bytes]], pad_to: int = 512) -> bytes:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w", format=tarfile.GNU_FORMAT) as archive:
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            archive.addfile(info, io.BytesIO(data))
    raw = buffer.getvalue().rstrip(b"\0")
    raw += b"\0" * (-len(raw) % 512) + b"\0" * 1024
    return raw + b"\0" * (-len(raw) % pad_to)


@given(st.lists(st.tuples(st.binary(max_size=1500), st.binary(max_size=600), st.sampled_from(["done", "stuck"]),
                          st.one_of(st.none(), st.integers(0, 255))), max_size=6),
       st.lists(st.integers(1, 700), min_size=1, max_size=8), st.binary(max_size=40).filter(lambda b: b"S2" not in b),
       st.lists(st.integers(1, 3), min_size=1, max_size=4), st.sampled_from([512, 10240]))
def test_frame_reader_reassembles_any_chunking(probes, cuts, banner, groups, pad_to) -> None:
    """Whatever the session's chunk sizes, the group sizes, and the padding tar adds after an
    archive (GNU tar's records, busybox's none), each probe's bytes come out whole; a login
    banner before the hello is skipped."""
    stream = banner + b"\nS2 hello 2\n"
    index, step = 0, 0
    while index < len(probes):
        group = list(enumerate(probes))[index:index + groups[step % len(groups)]]
        step += 1
        members = [(f"{kind}{i}", data) for i, (out, err, _, _) in group
                   for kind, data in (("o", out), ("e", err)) if data]
        stream += f"S2 t {len(group)} {len(members)}\n".encode()
        stream += b"".join(f"{i} {'-' if status is None else status} {state}\n".encode()
                           for i, (_, _, state, status) in group)
        if members:
            stream += _tar(members, pad_to)
        index += len(group)
    stream += b"S2 end\n"
    reader = FrameReader()
    got: dict[int, list] = {}
    ended: list[int] = []
    offset, step = 0, 0
    while offset < len(stream):
        size = cuts[step % len(cuts)]
        step += 1
        for kind, value in reader.feed(stream[offset:offset + size]):
            if kind == "probe":
                got[value.index] = [b"", b"", value.state, value.status]
            elif kind in ("out", "err"):
                got[value[0]][0 if kind == "out" else 1] += value[1]
            elif kind == "probe-end":
                ended.append(value)
        offset += size
    assert reader.ended
    assert [tuple(got[index]) for index in range(len(probes))] == [tuple(probe) for probe in probes]
    assert sorted(ended) == list(range(len(probes)))


def test_frame_reader_refuses_what_is_not_a_frame() -> None:
    with pytest.raises(FrameError):
        list(FrameReader().feed(b"S2 hello 2\nWelcome to gpu-001!\n"))
    with pytest.raises(FrameError):
        list(FrameReader().feed(b"S2 hello 2\nS2 t 1 0\n0 0 maybe\n"))
    bad = bytearray(_tar([("o0", b"abc")]))
    bad[0] ^= 1  # the checksum no longer holds
    with pytest.raises(FrameError, match="checksum"):
        list(FrameReader().feed(b"S2 hello 2\nS2 t 1 1\n0 0 done\n" + bytes(bad)))
    with pytest.raises(FrameError, match="unexpected file"):  # a file of a probe not in the group
        list(FrameReader().feed(b"S2 hello 2\nS2 t 1 1\n0 0 done\n" + _tar([("o7", b"abc")])))


def test_inventory_sessions_setting() -> None:
    base = '[cluster]\nnodes = "gpu-[1-2]"\n[ssh]\n'
    assert parse_inventory(base).ssh.sessions == "single"
    assert parse_inventory(base + 'sessions = "per-probe"\n').ssh.sessions == "per-probe"
    with pytest.raises(InputError, match="sessions must be one of"):
        parse_inventory(base + 'sessions = "one"\n')
    assert parse_inventory(base + 'spool_dir = "/scratch/spool"\n').ssh.spool_dir == "/scratch/spool"
    with pytest.raises(InputError, match="spool_dir must be an absolute path"):
        parse_inventory(base + 'spool_dir = "relative"\n')


# ------------------------------------------------------------------------------- over SSH


def _inventory(cluster: simcluster.Cluster, name: str, **ssh: str) -> Path:
    text = cluster.inventory.read_text()
    text = text.replace("command_timeout = 10", f"command_timeout = {COMMAND_TIMEOUT}")
    settings = "".join(f"{key} = {json.dumps(value)}\n" for key, value in ssh.items())
    text = text.replace("fanout = 128\n", "fanout = 128\n" + settings)
    text += f"\n[probes.nvidia-smi-q]\nmax_bytes = {CAP}\n"
    path = cluster.directory / name
    path.write_text(text)
    return path


@pytest.fixture(scope="module")
def faulty() -> Iterator[simcluster.Cluster]:
    port = simcluster.free_port(("127.0.20.11",))
    with simcluster.scratch() as root, simcluster.running(root / "c", nodes=9, port=port, first_address="127.0.20.11",
                                                          faults=FAULTS) as cluster:
        yield cluster


@pytest.fixture(scope="module")
def both(faulty: simcluster.Cluster, tmp_path_factory: pytest.TempPathFactory):
    out = tmp_path_factory.mktemp("bundles")
    single = collect(load_inventory(_inventory(faulty, "single.toml")), faulty.job, out / "single")
    per_probe = collect(load_inventory(_inventory(faulty, "per-probe.toml", sessions="per-probe")), faulty.job,
                        out / "per-probe")
    return single, per_probe, out


def _node(cluster: simcluster.Cluster, fault: str) -> str:
    return next(node for node, kind in cluster.faults.items() if kind == fault)


def _probes(folder: Path) -> dict:
    return json.loads((folder / "probes.json").read_text())


def _same_files(one: Path, other: Path, skip: tuple[Path, ...] = ()) -> list[dict]:
    """Assert two node folders hold the same files, byte for byte (probes.json and ``skip``
    aside); return both probes.json without their timings."""
    names = sorted(p.name for p in one.iterdir() if p not in skip)
    assert names == sorted(p.name for p in other.iterdir()), one.name
    for name in names:
        if name != "probes.json":
            assert (one / name).read_bytes() == (other / name).read_bytes(), (one.name, name)
    return [{probe: {k: v for k, v in entry.items() if k not in ("started", "seconds")}
             for probe, entry in _probes(folder).items()} for folder in (one, other)]


def test_single_and_per_probe_sessions_write_the_same_bundle(faulty, both) -> None:
    """Byte for byte, but for the two documented differences (docs/inventory.md, "Sessions"):
    a probe that exits while a child it left behind holds its output open (``linger``) has
    ended for the runner, which sees the probe's own exit, and is still running for a session
    per probe, whose channel stays open until the collector gives up on it; and a probe that
    is a shell script stopped at its cap (``flood``: a pipeline in the fake nvidia-smi) has its
    shell say so on its stderr, where a session per probe closes the pipe it writes to, which
    no shell reports."""
    single, per_probe, out = both
    linger, flood = _node(faulty, "linger"), _node(faulty, "flood")
    note = out / "single" / "nodes" / flood / "nvidia-smi-q.err"
    assert note.read_text().strip() == "File size limit exceeded"
    assert {r.sessions for r in single.nodes} == {"single"}, [(r.node, r.outcome, r.detail) for r in single.nodes]
    assert {r.sessions for r in per_probe.nodes} == {"per-probe"}
    outcomes = [{r.node: r.outcome for r in result.nodes} for result in (single, per_probe)]
    assert outcomes[0].pop(linger) == "ok" and outcomes[1].pop(linger) == "timeout"
    assert outcomes[0] == outcomes[1]
    for node in faulty.nodes:
        one, other = out / "single" / "nodes" / node, out / "per-probe" / "nodes" / node
        untimed = _same_files(one, other, skip=(note,))
        if node == linger:
            assert untimed[0].pop("nvidia-smi-q") == {"command": "nvidia-smi -q", "exit": 0, "error": None}
            assert untimed[1].pop("nvidia-smi-q") == {"command": "nvidia-smi -q", "exit": None, "error": "timeout"}
        assert untimed[0] == untimed[1], node
        assert list(_probes(one)) == list(_probes(other))  # the same order too
    record = json.loads((out / "single" / "collection.json").read_text())
    assert {n["sessions"] for n in record["nodes"]} == {"single"}


def test_the_openssh_client_writes_the_same_bundle_as_paramiko(faulty, both, tmp_path: Path) -> None:
    """The runner through an ``ssh`` process: the same files, byte for byte, and the same
    probes.json, for every fault of the cluster."""
    _, _, out = both
    result = collect(load_inventory(_inventory(faulty, "openssh.toml", client="openssh")), faulty.job,
                     tmp_path / "openssh")
    assert {(r.sessions, r.client) for r in result.nodes} == {("single", "openssh")}
    for node in faulty.nodes:
        untimed = _same_files(out / "single" / "nodes" / node, tmp_path / "openssh" / "nodes" / node)
        assert untimed[0] == untimed[1], node


def test_single_session_keeps_each_probes_bounds_and_the_others_output(faulty, both) -> None:
    single, _, out = both
    healthy = next(n for n in faulty.nodes if n not in faulty.faults)
    source = faulty.scenario_bundle / "nodes"
    hang, flood, linger, binary = (_node(faulty, kind) for kind in ("hang", "flood", "linger", "binary"))
    for node in (hang, flood, linger, healthy):
        folder = out / "single" / "nodes" / node
        for name in ("kernel.log", "ibstat.txt", "nccl.log"):
            assert (folder / name).read_bytes() == (source / node / name).read_bytes(), (node, name)
        for ethtool in (source / node).glob("ethtool-*.txt"):
            assert (folder / ethtool.name).read_bytes() == ethtool.read_bytes()
    statuses = {node: _probes(out / "single" / "nodes" / node)["nvidia-smi-q"] for node in faulty.nodes}
    assert statuses[hang]["error"] == "timeout" and statuses[hang]["exit"] == 124
    assert statuses[hang]["seconds"] < COMMAND_TIMEOUT + 5
    assert statuses[flood] == {**statuses[flood], "error": "output-truncated", "exit": None}
    assert (out / "single" / "nodes" / flood / "nvidia-smi-q.txt").stat().st_size == CAP
    # the lingering child does not hold the probe: its answer and exit status, at once
    assert statuses[linger] == {**statuses[linger], "error": None, "exit": 0}
    assert statuses[linger]["seconds"] < COMMAND_TIMEOUT
    assert (out / "single" / "nodes" / linger / "nvidia-smi-q.txt").read_bytes() == b"partial answer\n"
    assert (out / "single" / "nodes" / binary / "nvidia-smi-q.txt").read_bytes() == BINARY_OUTPUT
    assert statuses[healthy]["error"] is None
    outcome = {r.node: r.outcome for r in single.nodes}
    assert outcome[hang] == "timeout" and outcome[healthy] == outcome[linger] == "ok"
    # the hung node held the collection only as long as its own probe's bound
    assert max(r.seconds for r in single.nodes) < COMMAND_TIMEOUT + 5 + 3


def test_a_node_that_cannot_spool_falls_back_to_a_session_per_probe(faulty, tmp_path: Path) -> None:
    healthy = [n for n in faulty.nodes if n not in faulty.faults][:1]
    path = _inventory(faulty, "nospool.toml", spool_dir="/nonexistent/spikeops-spool")
    result = collect(load_inventory(path), faulty.job, tmp_path / "b", nodes=healthy)
    (node,) = result.nodes
    assert node.outcome == "ok" and node.sessions.startswith("per-probe (fallback: the node cannot run the runner")
    got = tmp_path / "b" / "nodes" / node.node / "nvidia-smi-q.txt"
    assert got.read_bytes() == (faulty.scenario_bundle / "nodes" / node.node / "nvidia-smi-q.txt").read_bytes()


@pytest.mark.parametrize("sessions", ["single", "per-probe"])
def test_the_interface_listing_is_bounded_by_command_timeout(sessions: str, tmp_path: Path) -> None:
    """The listing the per-interface probes are planned from is a probe like the others: a node
    slow to list its interfaces (here `ls` takes 11 s, as a node did under load) is waited for up
    to the inventory's command_timeout, not a fixed 10 s, and its ethtool counters are read."""
    port = simcluster.free_port(("127.0.20.41",))
    with simcluster.running(tmp_path / "c", nodes=1, port=port, first_address="127.0.20.41") as cluster:
        (node,) = cluster.nodes
        shim = cluster.directory / "nodes" / node / "bin" / "ls"
        shim.parent.mkdir(parents=True, exist_ok=True)
        shim.write_text('#!/bin/sh\nsleep 11\nexec /bin/ls "$@"\n')
        shim.chmod(0o755)
        path = cluster.directory / "slow-ls.toml"
        path.write_text(cluster.inventory.read_text().replace("command_timeout = 10", "command_timeout = 20")
                        .replace("fanout = 128\n", f"fanout = 128\nsessions = {json.dumps(sessions)}\n"))
        result = collect(load_inventory(path), cluster.job, tmp_path / "b", nodes=[node])
        (got,) = result.nodes
        assert got.outcome == "ok", got.detail
        expected = sorted(p.name for p in (cluster.scenario_bundle / "nodes" / node).glob("ethtool-*.txt"))
        assert expected and sorted(p.name for p in (tmp_path / "b" / "nodes" / node).glob("ethtool-*.txt")) == expected


@pytest.mark.parametrize("sessions", ["single", "per-probe"])
def test_a_node_whose_sshd_dies_mid_run_keeps_what_it_sent(sessions: str, tmp_path: Path) -> None:
    port = simcluster.free_port(("127.0.21.11",))
    with simcluster.scratch() as root, simcluster.running(root / "c", nodes=3, port=port,
                                                          first_address="127.0.21.11", faults={"#0": "dies"}) as cluster:
        result = collect(load_inventory(_inventory(cluster, "dies.toml", sessions=sessions)), cluster.job,
                         tmp_path / "b")
        shutil.copytree(cluster.scenario_bundle, tmp_path / "scenario")
    dead = _node(cluster, "dies")
    outcome = {r.node: r for r in result.nodes}
    assert outcome[dead].outcome == "unreachable" and "kept" in outcome[dead].detail
    assert {r.outcome for node, r in outcome.items() if node != dead} == {"ok"}
    folder, source = tmp_path / "b" / "nodes" / dead, tmp_path / "scenario" / "nodes" / dead
    statuses = _probes(folder)
    assert statuses["nvidia-smi-q"]["error"] == "command-failed" and statuses["nvidia-smi-q"]["exit"] is None
    assert not (folder / "nvidia-smi-q.txt").exists()
    # what finished before the connection died is kept, byte for byte
    for name in ("kernel.log", "ibstat.txt"):
        assert (folder / name).read_bytes() == (source / name).read_bytes(), name
    assert statuses["kernel"]["error"] is None
    if sessions == "single":
        assert "SSH session ended" in (folder / "nvidia-smi-q.err").read_text()


def test_login_cost_models_wait_or_burn_cpu() -> None:
    from spikeops.sim.nodetools import CHEAP_LOGIN, REAL_LOGIN_CPU, login_cost_block

    assert login_cost_block(CHEAP_LOGIN) == ""
    waiting, burning = login_cost_block(REAL_LOGIN), login_cost_block(REAL_LOGIN_CPU)
    assert "sleep 0.040" in waiting and "while" not in waiting.split("mkdir")[-1]
    assert "sleep 0.040" not in burning and "while [ \"$i\" -lt" in burning
    assert "sleep 0.050" in waiting and "sleep 0.050" in burning  # the connection's part waits in both


def test_real_tool_times_make_the_fake_tools_wait(tmp_path: Path) -> None:
    """The benchmark's `real-tools` node model: nvidia-smi -q waits its second (then answers
    the node's file as before); other calls and the default model do not wait."""
    from spikeops.sim.nodetools import NO_TOOL_TIMES, REAL_TOOL_TIMES, write_tools

    node = tmp_path / "node"
    node.mkdir()
    (node / "nvidia-smi-q.txt").write_text("==============NVSMI LOG==============\n")
    env = dict(os.environ, SPIKEOPS_SIM_NODE=str(node), SPIKEOPS_SIM_NAME="gpu-001")
    for tools, waits in ((REAL_TOOL_TIMES, True), (NO_TOOL_TIMES, False)):
        write_tools(tmp_path / "root", tools=tools)
        smi = tmp_path / "root" / "bin" / "nvidia-smi"
        assert ("sleep 1.000" in smi.read_text()) is waits
        assert ("sleep 0.030" in (tmp_path / "root" / "bin" / "ethtool").read_text()) is waits
        t0 = time.monotonic()
        done = subprocess.run([str(smi), "-q"], capture_output=True, env=env, timeout=30, check=True)
        if waits:
            assert time.monotonic() - t0 >= REAL_TOOL_TIMES.nvidia_smi_ms / 1000
        assert done.stdout == (node / "nvidia-smi-q.txt").read_bytes()


def test_real_login_cost_is_paid_once_per_connection_and_once_per_session(tmp_path: Path) -> None:
    """The benchmark's node model: the first session of a connection marks it (and waits for
    the PAM stack); later sessions of the same connection do not mark it again."""
    import paramiko

    port = simcluster.free_port(("127.0.22.11",))
    with simcluster.scratch() as root, simcluster.running(root / "c", nodes=2, port=port,
                                                          first_address="127.0.22.11", login=REAL_LOGIN) as cluster:
        marks = cluster.directory / "run" / "conn"
        shell = (cluster.directory / "bin" / "node-shell").read_text()
        assert f"sleep {REAL_LOGIN.session_ms / 1000:.3f}" in shell
        for connection in range(2):
            client = paramiko.SSHClient()
            client.load_host_keys(str(cluster.known_hosts))
            client.connect(cluster.addresses[cluster.nodes[0]], port=cluster.port, username=cluster.user,
                           key_filename=str(cluster.identity_file), look_for_keys=False, allow_agent=False)
            try:
                for _ in range(3):
                    _, stdout, _ = client.exec_command("echo hi", timeout=20)
                    assert stdout.read() == b"hi\n"
            finally:
                client.close()
            assert len(list(marks.iterdir())) == connection + 1


def test_frames_before_garbage_are_kept() -> None:
    """A stream that turns to garbage mid-way (a runner of another version, something writing
    into the session) still yields every frame before the garbage, then says what went wrong."""
    from collections import deque as chunks

    from spikeops.collect.single import _drain, _Session

    class Conduit:  # the seam: what run_single needs of a session
        def __init__(self, data: list[bytes]) -> None:
            self.data = chunks(data)

        def receive(self) -> tuple[list[bytes], bytes, bool]:
            out, self.data = list(self.data), chunks()
            return out, b"", False

    conduit = Conduit([b"S2 hello 2\nS2 t 1 1\n0 0 done\n" + _tar([("o0", b"abc")]),
                       b"S2 t 1 0\n1 0 done\nS2 garbage here\n"])
    session = _Session(conduit, FrameReader(), chunks(), lambda probe: None, None, 8)
    events, closed, garbled = _drain(session)
    assert [kind for kind, _ in events].count("probe-end") == 2 and closed
    assert ("out", (0, b"abc")) in events
    assert garbled and "garbage" in garbled
