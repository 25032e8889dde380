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

import json
import os
import shutil
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from spikeops.collect import collect
from spikeops.collect.single import FrameError, FrameReader, probe_line, runner_script, start_line
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
    for applet in ("sh", "head", "cat", "wc", "rm", "sleep", "mktemp", "mkfifo", "timeout", "kill", "setsid",
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


def _read_frames(stream: bytes, chunk: int = 4096) -> tuple[dict[int, dict], bool]:
    reader = FrameReader()
    frames: dict[int, dict] = {}
    hello = False
    for offset in range(0, len(stream), chunk):
        for kind, value in reader.feed(stream[offset:offset + chunk]):
            if kind == "hello":
                hello = True
            elif kind == "probe":
                frames[value.index] = {"status": value.status, "state": value.state, "out": b"", "err": b""}
            elif kind in ("out", "err"):
                frames[value[0]][kind] += value[1]
    assert hello
    return frames, reader.ended


@pytest.mark.parametrize("shell", list(SHELLS))
def test_runner_frames_every_probe_on_any_posix_shell(shell: str, tmp_path: Path) -> None:
    argv, env = SHELLS[shell](tmp_path)
    binary = tmp_path / "binary.out"
    binary.write_bytes(BINARY_OUTPUT)
    lingerer = tmp_path / "lingerer.pid"
    probes = [
        _probe("echo", "echo hello"),
        _probe("missing", "no-such-tool-on-this-node --version"),
        _probe("binary", f"cat {binary}"),
        _probe("fails", "echo partial; echo 'it broke' >&2; exit 3"),
        _probe("flood", "yes flood", max_bytes=100_000),
        _probe("hang", "sleep 600", timeout=1),
        # prints, then leaves a detached child holding stdout open: never closes its output
        _probe("linger", f"echo 'partial answer'; setsid sh -c 'echo $$ >{lingerer}; exec sleep 30' &", timeout=1),
        _probe("stderr-flood", "yes complaint >&2", timeout=1),
    ]
    script = runner_script() + start_line([str(tmp_path)], quiet=1)
    script += b"".join(probe_line(index, probe) for index, probe in enumerate(probes)) + b"_f\n"
    env = dict(os.environ, **env) if env is not None else None
    t0 = time.monotonic()
    try:
        done = subprocess.run(argv, input=script, capture_output=True, timeout=60, env=env, check=False)
    finally:
        if lingerer.exists():
            os.kill(int(lingerer.read_text()), signal.SIGKILL)
    elapsed = time.monotonic() - t0
    assert done.returncode == 0, done.stderr
    frames, ended = _read_frames(done.stdout)
    assert ended and sorted(frames) == list(range(len(probes)))
    by_name = {probe.name: frames[index] for index, probe in enumerate(probes)}
    assert by_name["echo"] == {"status": 0, "state": "done", "out": b"hello\n", "err": b""}
    assert by_name["missing"]["status"] == 127 and by_name["missing"]["out"] == b""
    assert b"no-such-tool-on-this-node" in by_name["missing"]["err"]
    assert by_name["binary"]["out"] == BINARY_OUTPUT and by_name["binary"]["status"] == 0
    assert by_name["fails"] == {"status": 3, "state": "done", "out": b"partial\n", "err": b"it broke\n"}
    # the node keeps the cap plus one byte, rounded up to a 512-byte block, and no more
    assert 100_001 <= len(by_name["flood"]["out"]) <= 100_001 + 511
    assert by_name["flood"]["out"].startswith(b"flood\nflood\n")
    assert by_name["hang"]["status"] in (124, 143) and by_name["hang"]["state"] == "done"  # 143: busybox timeout
    assert by_name["linger"]["state"] == "stuck" and by_name["linger"]["out"] == b"partial answer\n"
    assert 65_536 <= len(by_name["stderr-flood"]["err"]) <= 66_048
    assert elapsed < 30  # a hang guard: the lingering child holds its pipe for 30 s
    assert not list(tmp_path.glob("spikeops.*")), "the spool directory was left behind"


def test_runner_reports_a_node_without_a_spool_directory(tmp_path: Path) -> None:
    script = runner_script() + start_line([str(tmp_path / "missing"), "/proc"]) + b"_f\n"
    done = subprocess.run(["sh", "-s"], input=script, capture_output=True, timeout=30, check=False)
    reader = FrameReader()
    events = list(reader.feed(done.stdout))
    assert events and events[0][0] == "fail" and "no writable spool directory" in events[0][1]


@given(st.lists(st.tuples(st.binary(max_size=300), st.binary(max_size=50), st.sampled_from(["done", "stuck"]),
                          st.one_of(st.none(), st.integers(0, 255))), max_size=6),
       st.lists(st.integers(1, 97), min_size=1, max_size=8), st.binary(max_size=40).filter(lambda b: b"S1" not in b),
       st.lists(st.integers(1, 3), min_size=1, max_size=4))
def test_frame_reader_reassembles_any_chunking(probes, cuts, banner, groups) -> None:
    """Whatever the channel's chunk sizes, and whether probes come one frame each or in
    batches, each probe's bytes come out whole; a login banner before the hello is skipped."""
    stream = banner + b"\nS1 hello 1\n"
    index, step = 0, 0
    while index < len(probes):
        group = list(enumerate(probes))[index:index + groups[step % len(groups)]]
        step += 1
        heads = [f"S1 x {i} {'-' if status is None else status} {state} {len(out)} {len(err)}\n".encode()
                 for i, (out, err, state, status) in group]
        bodies = [out + err for _, (out, err, _, _) in group]
        if len(group) == 1:
            stream += heads[0] + bodies[0]
        else:
            stream += f"S1 b {len(group)}\n".encode() + b"".join(heads) + b"".join(bodies)
        index += len(group)
    stream += b"S1 end\n"
    reader = FrameReader()
    got: dict[int, list] = {}
    offset, step = 0, 0
    while offset < len(stream):
        size = cuts[step % len(cuts)]
        step += 1
        for kind, value in reader.feed(stream[offset:offset + size]):
            if kind == "probe":
                got[value.index] = [b"", b"", value.state, value.status]
            elif kind in ("out", "err"):
                got[value[0]][0 if kind == "out" else 1] += value[1]
        offset += size
    assert reader.ended
    assert [tuple(got[index]) for index in range(len(probes))] == [tuple(probe) for probe in probes]


def test_frame_reader_refuses_what_is_not_a_frame() -> None:
    reader = FrameReader()
    with pytest.raises(FrameError):
        list(reader.feed(b"S1 hello 1\nWelcome to gpu-001!\n"))
    with pytest.raises(FrameError):
        list(FrameReader().feed(b"S1 hello 1\nS1 x 0 0 maybe 1 0\nx"))


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


def test_single_and_per_probe_sessions_write_the_same_bundle(faulty, both) -> None:
    single, per_probe, out = both
    assert {r.sessions for r in single.nodes} == {"single"}, [(r.node, r.outcome, r.detail) for r in single.nodes]
    assert {r.sessions for r in per_probe.nodes} == {"per-probe"}
    assert [(r.node, r.outcome) for r in single.nodes] == [(r.node, r.outcome) for r in per_probe.nodes]
    for node in faulty.nodes:
        one, other = out / "single" / "nodes" / node, out / "per-probe" / "nodes" / node
        names = sorted(p.name for p in one.iterdir())
        assert names == sorted(p.name for p in other.iterdir()), node
        for name in names:
            if name != "probes.json":
                assert (one / name).read_bytes() == (other / name).read_bytes(), (node, name)
        untimed = [{probe: {k: v for k, v in entry.items() if k not in ("started", "seconds")}
                    for probe, entry in _probes(folder).items()} for folder in (one, other)]
        assert untimed[0] == untimed[1], node
        assert list(_probes(one)) == list(_probes(other))  # the same order too
    record = json.loads((out / "single" / "collection.json").read_text())
    assert {n["sessions"] for n in record["nodes"]} == {"single"}


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
    assert statuses[linger] == {**statuses[linger], "error": "timeout", "exit": None}
    assert statuses[linger]["seconds"] < COMMAND_TIMEOUT + 5
    assert (out / "single" / "nodes" / linger / "nvidia-smi-q.txt").read_bytes() == b"partial answer\n"
    assert (out / "single" / "nodes" / binary / "nvidia-smi-q.txt").read_bytes() == BINARY_OUTPUT
    assert statuses[healthy]["error"] is None
    outcome = {r.node: r.outcome for r in single.nodes}
    assert outcome[hang] == outcome[linger] == "timeout" and outcome[healthy] == "ok"
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

    class Channel:  # the seam: what paramiko's Channel offers _drain
        closed = eof_received = False

        def __init__(self, data: list[bytes]) -> None:
            self.data = chunks(data)

        def recv_stderr_ready(self) -> bool:
            return False

        def recv_ready(self) -> bool:
            return bool(self.data)

        def recv(self, size: int) -> bytes:
            return self.data.popleft()

    channel = Channel([b"S1 hello 1\nS1 x 0 0 done 3 0\nabc", b"S1 x 1 0 done 2 0\nxyS1 garbage here\n"])
    session = _Session(channel, FrameReader(), chunks(), lambda probe: None, None, 8)
    events, closed, garbled = _drain(channel, session)
    assert [kind for kind, _ in events].count("probe-end") == 2 and closed
    assert garbled and "garbage" in garbled
