"""A local Slurm cluster of real daemons, for the scheduler actions' tests and the demo.

spikeops drains nodes, signals and requeues jobs and reads ``scontrol``/``sinfo``; a fake
``scontrol`` would only repeat our own reading of Slurm's documentation back to us, so the
tests and the demo run against Debian's real ``slurmctld`` and ``slurmd`` (22.05) instead.
``up(D, nodes=N)`` gives D its own ``munged`` (own key and socket), writes ``D/slurm.conf``,
starts ``slurmctld`` and one ``slurmd -N NODE`` per node, all on localhost, each node on its
own port, and waits until ``sinfo`` shows every node idle (0.1 s for 4 nodes, 0.4 s for 64). Batch jobs
really run: ``sbatch -N 2`` starts a ``slurmstepd`` and the script on two "nodes" that are
all this machine, and ``srun`` steps work between them. ``up(D, names=[...])`` names the
nodes instead (a simulated incident's ``gpu-017``, ``c04-n10``..., so that the job, the
drain and the SSH collection all speak of the same nodes).

Layout of D (all written by ``up``)::

    cluster.json  slurm.conf
    munge/   munge.key (0400), munge.socket.2, munged.seed
    state/   slurmctld's StateSaveLocation
    spool/<node>/   each slurmd's spool (job scripts)
    run/     munged.pid  slurmctld.pid  slurmd-<node>.pid
    log/     munged.log  slurmctld.log  slurmd-<node>.log

Clients need only ``SLURM_CONF=D/slurm.conf`` (``SlurmCluster.env``): the munge socket is
named in slurm.conf (``AuthInfo``). Nothing outside D is written (but for a link to D's spool
in the temp directory while the cluster runs, when D is too deep for a job step's socket
path) and no port is fixed
(``up`` takes a block of free ports below Linux's ephemeral range), so clusters in
different directories run side by side (tests in parallel with a demo).

``up`` needs root (``SlurmUser=root``; jobs run as root). ``up`` on a directory whose
cluster is running fails (ClusterError: run ``down`` first); on a stopped cluster's
directory it replaces the cluster, jobs and state included (its own entries only); on any
other non-empty directory it fails. ``down`` stops, by pid, every process started for D
and leaves the files for inspection. Command line: ``python -m spikeops.sim.slurmcluster
up|down|status`` (``infra/slurm/up`` and ``infra/slurm/down`` wrap it). The core of
spikeops never imports this. External programs are overridable (``SPIKEOPS_MUNGED``,
``SPIKEOPS_SLURMCTLD``, ``SPIKEOPS_SLURMD``, ``SPIKEOPS_SINFO``), as NHC does.

**Reboots** (``up(D, reboot=True)``): slurm.conf names ``D/bin/reboot-node`` as
``RebootProgram``, so ``scontrol reboot [ASAP] [nextstate=...] NODES`` goes through Slurm's real
path: slurmctld marks the node ``REBOOT_REQUESTED``, then ``REBOOT_ISSUED`` once it is idle, and
sends the node's slurmd the request; that slurmd runs the program. A reboot completes, for
slurmctld, only when the node's slurmd registers again with a boot time after the request
(``node_mgr.c``); slurmd computes its boot time from ``sysinfo()``'s uptime. So the program
(``REBOOT_PROGRAM``) finds the slurmd that ran it (its ``-N NODE``), appends ``NODE TIME`` to
``D/log/reboots.log``, runs ``D/reboot-hook NODE`` when that file is executable (what a test
does to the node's "hardware" while it is down: clear a fault, or not), and then, detached,
stops that slurmd and starts it again with the same arguments inside a new time namespace
whose boot clock starts at zero (``unshare --time --boottime -UPTIME``): the kernel then
reports an uptime of a second to the new slurmd, as after a real boot, with no test-only
switch in slurmd (Slurm's own ``slurmd -b`` would do the same for the test suite).
``ResumeTimeout`` stays Slurm's default (60 s): a node that does not come back is DOWN.

Slurm 22.05 behaviours the callers meet (not choices of this module): a node set to
``State=RESUME`` shows ``idle*`` (not responding) for a fraction of a second until
slurmctld has pinged it; ``scontrol requeue`` holds the job PENDING with
``Reason=BeginTime`` for 120 s (``scontrol update JobId=J StartTime=now`` releases it).
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from ClusterShell.NodeSet import NodeSet

from spikeops.sim import localcluster
from spikeops.sim.processes import ClusterError, pid_alive, proc_read, read_pid, scan, start_daemons, stop
from spikeops.sim.sshd import check_free, listening

__all__ = [
    "SlurmCluster",
    "ClusterError",
    "FORMAT",
    "CLUSTER_NAME",
    "PARTITION",
    "up",
    "down",
    "load",
    "running",
    "status",
    "slurm_conf",
    "spool_directory",
    "missing",
    "node_names",
    "check_names",
    "free_ports",
    "find_processes",
    "REBOOT_PROGRAM",
    "write_reboot_program",
    "reboots",
    "main",
]

#: ``cluster.json``'s format tag.
FORMAT = "spikeops-sim-slurm/1"
CLUSTER_NAME = "spikeops-sim"
PARTITION = "debug"
#: Where the daemons listen (slurm.conf's ``SlurmctldHost`` and every ``NodeHostname``).
HOST = "127.0.0.1"

# A unix socket path must fit sockaddr_un.sun_path (108 bytes with its NUL).
_MAX_SOCKET = 107
_PREFIX = re.compile(r"^[A-Za-z][A-Za-z0-9-]*$")
# An explicit node name: what slurm.conf, hostlists and file names take without quoting.
_NAME = re.compile(r"^[A-Za-z][A-Za-z0-9._-]{0,62}$")
# What up writes in D (and may replace when the cluster there is stopped).
_ENTRIES = ("cluster.json", "slurm.conf", "munge", "state", "spool", "run", "log", "bin", "reboot-hook")
#: Slurm's RebootProgram for ``up(reboot=True)`` (module docstring, "Reboots"); @PYTHON@ and
#: @ROOT@ are filled in. It runs as root under slurmd (``system()``), so it is small and
#: touches nothing outside D but the slurmd that ran it.
REBOOT_PROGRAM = """#!@PYTHON@ -I
# spikeops sim: Slurm's RebootProgram (spikeops.sim.slurmcluster, "Reboots"). The node is the
# -N of the slurmd that runs this; the reboot: D/reboot-hook NODE, then that slurmd stopped and
# started again in a time namespace whose boot clock starts at zero.
import os, signal, subprocess, sys, time

ROOT = @ROOT@


def ancestors():
    pid = os.getppid()
    while pid > 1:
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as handle:
                argv = [part.decode() for part in handle.read().split(b"\\0") if part]
            with open(f"/proc/{pid}/stat") as handle:
                stat = handle.read()
        except OSError:
            return
        yield pid, argv
        pid = int(stat[stat.rfind(")") + 2:].split()[1])


found = next(((pid, argv) for pid, argv in ancestors()
              if argv and os.path.basename(argv[0]) == "slurmd" and "-N" in argv[:-1]), None)
if found is None:
    sys.exit("reboot-node: not run by a slurmd -N NODE")
slurmd, argv = found
node = argv[argv.index("-N") + 1]
with open(f"{ROOT}/log/reboots.log", "a") as log:
    log.write(f"{node} {time.time():.3f}\\n")
hook = f"{ROOT}/reboot-hook"
if os.access(hook, os.X_OK):
    subprocess.run([hook, node], timeout=120, check=False, stdin=subprocess.DEVNULL)
if os.fork():
    sys.exit(0)  # slurmd's system() returns; the node goes down after
os.setsid()
if os.fork():
    os._exit(0)
out = os.open(f"{ROOT}/log/reboot-{node}.log", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
os.dup2(out, 1)
os.dup2(out, 2)
os.kill(slurmd, signal.SIGTERM)
deadline = time.monotonic() + 30
while os.path.exists(f"/proc/{slurmd}") and time.monotonic() < deadline:
    time.sleep(0.1)
if os.path.exists(f"/proc/{slurmd}"):
    os.kill(slurmd, signal.SIGKILL)
    time.sleep(0.5)
time.sleep(1.0)  # down for a moment: the new boot time is after the request
with open("/proc/uptime") as handle:
    uptime = int(float(handle.read().split()[0]))
os.execvp("unshare", ["unshare", "--time", f"--boottime=-{uptime}", *argv])
"""
# Programs whose command line naming D makes them D's daemons (slurmctld's helper
# slurmscriptd renames itself and is found as its child).
_DAEMONS = (b"munged", b"slurmctld", b"slurmd")
# The binaries, overridable like NHC's SLURM_SCONTROL.
_BINARIES = {
    "munged": ("SPIKEOPS_MUNGED", "/usr/sbin/munged", "munge"),
    "slurmctld": ("SPIKEOPS_SLURMCTLD", "/usr/sbin/slurmctld", "slurmctld"),
    "slurmd": ("SPIKEOPS_SLURMD", "/usr/sbin/slurmd", "slurmd"),
    "sinfo": ("SPIKEOPS_SINFO", "sinfo", "slurm-client"),
}
# Lines every slurmd of Debian's build logs at start (no PMIx library): not a reason.
_NOISE = ("pmix",)


@dataclass
class SlurmCluster:
    """A started local Slurm cluster, as ``up`` wrote it to cluster.json."""

    directory: Path
    conf: Path
    nodes: list[str]
    partition: str
    env: dict[str, str]
    ctld_port: int


# ---------------------------------------------------------------------------- helpers


def node_names(count: int, prefix: str = "node") -> list[str]:
    """``prefix`` + a number from 1, zero-padded to 3 digits or more (``node001``...)."""
    if count < 1:
        raise ValueError("a cluster has at least 1 node")
    if not _PREFIX.match(prefix):
        raise ValueError(f"node prefix {prefix!r}: a letter, then letters, digits or '-'")
    width = max(3, len(str(count)))
    return [f"{prefix}{i:0{width}d}" for i in range(1, count + 1)]


def check_names(names: Sequence[str]) -> list[str]:
    """Explicit node names as a list, or ValueError: at least one, no repeats, each a letter
    then letters, digits or ``._-`` (a ``[`` or ``,`` would read as a hostlist in Slurm)."""
    if isinstance(names, str):
        raise ValueError("names: a list of node names, not one string")
    listed = list(names)
    if not listed:
        raise ValueError("a cluster has at least 1 node")
    for name in listed:
        if not isinstance(name, str) or not _NAME.match(name):
            raise ValueError(f"node name {name!r}: a letter, then letters, digits or '._-' (at most 63)")
    repeated = sorted({name for name in listed if listed.count(name) > 1})
    if repeated:
        raise ValueError(f"node names repeated: {', '.join(repeated)}")
    return listed


def free_ports(count: int, low: int = 20000, high: int = 32000) -> int:
    """The first of ``count`` consecutive ports nothing listens on at 127.0.0.1, below
    Linux's ephemeral range (so an outgoing connection cannot take one before the daemons
    bind). The search starts at a point drawn from the pid and the clock, so clusters
    started at the same moment seldom try the same block."""
    if not 1 <= count < high - low:
        raise ValueError(f"{count} ports do not fit in {low}-{high}")
    span = high - low - count + 1
    start = (os.getpid() * 7919 + int(time.time() * 1000)) % span
    for offset in range(span):
        base = low + (start + offset) % span
        try:
            for port in range(base, base + count):
                check_free([HOST], port)
        except ClusterError:
            continue
        return base
    raise ClusterError(f"no {count} consecutive free ports in {low}-{high} on {HOST}")


def _binary(name: str) -> str:
    variable, default, package = _BINARIES[name]
    path = os.environ.get(variable, default)
    found = path if os.path.isabs(path) else shutil.which(path)
    if not found or not os.access(found, os.X_OK):
        raise ClusterError(f"{path} not found: install {package} (apt-get install {package})")
    return found


def missing() -> str | None:
    """Why ``up`` cannot run here (a daemon not installed, not root), or None when it can:
    what a caller that would fall back to something else asks first."""
    for name in _BINARIES:
        try:
            _binary(name)
        except ClusterError as exc:
            return str(exc)
    if os.geteuid() != 0:
        return "the local Slurm cluster runs as root (SlurmUser=root; jobs run as root)"
    return None


def spool_directory(root: Path, nodes: Sequence[str]) -> Path:
    """Where slurm.conf puts the slurmd spools: ``root/spool``, unless a job step's socket
    there (``SPOOL/NODE/NODE_JOB.STEP``) could outgrow sun_path; then a short, stable alias
    in the temp directory that links to it (slurmstepd would die with "Unix socket name
    exceeded maximum length" and the job would never start)."""
    spool = root / "spool"
    longest = max((len(node) for node in nodes), default=1)
    if len(str(spool)) + 2 * longest + len("//_9999999.4294967291") <= _MAX_SOCKET:
        return spool
    alias = _spool_alias(root)
    if alias.is_symlink():
        alias.unlink()
    elif alias.exists():
        raise ClusterError(f"{alias} exists and is not the spool link of {root}")
    alias.symlink_to(spool, target_is_directory=True)
    return alias


def _spool_alias(root: Path) -> Path:
    import hashlib
    import tempfile

    return Path(tempfile.gettempdir()) / f"spikeops-slurm-{hashlib.sha256(str(root).encode()).hexdigest()[:12]}"


def slurm_conf(root: Path, nodes: Sequence[str], *, ctld_port: int, node_ports: Sequence[int], cpus: int,
               spool: Path | None = None, reboot_program: Path | None = None) -> str:
    """The ``slurm.conf`` of the cluster in ``root``.

    Everything a daemon writes is under ``root`` (state, spools, pid files, logs), the munge
    socket is ``root``'s own, and every daemon binds 127.0.0.1 only (``NoInAddrAny``): that is
    what lets several clusters share the machine. ``config_overrides`` lets N nodes of
    ``cpus`` CPUs share a machine that has fewer; ``proctrack/linuxproc`` and ``task/none``
    need no cgroup; no accounting (no slurmdbd). ``MinJobAge=600`` keeps a finished job
    visible to ``scontrol show job``; ``KillWait=2`` makes a cancel or requeue take seconds;
    ``batch_sched_delay=0`` starts a submitted job at once rather than up to 3 s later.
    ``reboot_program``: Slurm's ``RebootProgram`` (module docstring, "Reboots").
    """
    if len(node_ports) != len(nodes):
        raise ValueError("one port per node")
    lines = [
        f"# spikeops local Slurm cluster: SLURM_CONF={root}/slurm.conf sinfo",
        f"ClusterName={CLUSTER_NAME}",
        "SlurmctldHost=localhost",
        f"SlurmctldPort={ctld_port}",
        "SlurmUser=root",
        "SlurmdUser=root",
        "AuthType=auth/munge",
        f"AuthInfo=socket={root}/munge/munge.socket.2",
        "CredType=cred/munge",
        f"StateSaveLocation={root}/state",
        f"SlurmdSpoolDir={spool or root / 'spool'}/%n",
        f"SlurmctldPidFile={root}/run/slurmctld.pid",
        f"SlurmdPidFile={root}/run/slurmd-%n.pid",
        f"SlurmctldLogFile={root}/log/slurmctld.log",
        f"SlurmdLogFile={root}/log/slurmd-%n.log",
        "ProctrackType=proctrack/linuxproc",
        "TaskPlugin=task/none",
        "SlurmdParameters=config_overrides",
        "CommunicationParameters=NoInAddrAny,NoCtldInAddrAny",
        "SelectType=select/cons_tres",
        "SelectTypeParameters=CR_Core",
        "AccountingStorageType=accounting_storage/none",
        "JobAcctGatherType=jobacct_gather/none",
        "JobCompType=jobcomp/none",
        "MpiDefault=none",
        "MailProg=/bin/true",
        "ReturnToService=2",
        "JobRequeue=1",
        "KillWait=2",
        "MinJobAge=600",
        "SchedulerType=sched/backfill",
        "SchedulerParameters=batch_sched_delay=0",
        "SlurmctldTimeout=10",
        "SlurmdTimeout=10",
        "InactiveLimit=0",
        *([f"RebootProgram={reboot_program}"] if reboot_program is not None else []),
        *(f"NodeName={node} NodeHostname=localhost Port={port} CPUs={cpus} State=UNKNOWN"
          for node, port in zip(nodes, node_ports, strict=True)),
        f"PartitionName={PARTITION} Nodes=ALL Default=YES MaxTime=INFINITE State=UP",
    ]
    return "\n".join(lines) + "\n"


def _check_directory(root: Path) -> None:
    # Paths are written unquoted into slurm.conf and munged's arguments.
    if len(str(root / "munge" / "munge.socket.2")) > _MAX_SOCKET:
        limit = _MAX_SOCKET - len("/munge/munge.socket.2")
        raise ClusterError(f"{root}: too long for munge's socket path (at most {limit} characters)")
    localcluster.prepare(root, _ENTRIES, lambda r: bool(find_processes(r)), what="a Slurm cluster",
                         written_into="slurm.conf", down_command="infra/slurm/down")


def _pid_files(root: Path) -> list[Path]:
    run = root / "run"
    return sorted(run.glob("*.pid")) if run.is_dir() else []


def find_processes(root: Path) -> set[int]:
    """Every live process started for the cluster at ``root`` (a resolved path): its
    daemons and its jobs (``_daemons``, ``_jobs``), and all their descendants.

    A shell that merely exported ``SLURM_CONF`` or ``cd``-ed into D is not one of them.
    """
    return _daemons(root) | _jobs(root)


def _daemons(root: Path) -> set[int]:
    """munged, slurmctld and slurmd whose command line names ``root/slurm.conf`` or
    ``root/munge/`` (and the pids of ``root/run/*.pid`` that do), and their descendants
    (slurmctld's helper renames itself ``slurmscriptd``)."""
    prefix = os.fsencode(str(root)) + b"/"
    conf, munge = prefix + b"slurm.conf", prefix + b"munge/"

    def match(pid: int) -> bool:
        cmdline = proc_read(pid, "cmdline")
        program = os.path.basename(cmdline.split(b"\0", 1)[0])
        return program in _DAEMONS and (conf in cmdline or munge in cmdline)

    seeds = [pid for pid in map(read_pid, _pid_files(root)) if pid is not None and prefix in proc_read(pid, "cmdline")]
    return scan(match, seeds)


def _jobs(root: Path) -> set[int]:
    """Every ``slurmstepd`` whose working directory is under ``root`` (slurmd starts them in
    its log directory, and they overwrite their command line and environment with their
    title, so nothing else names D); every job process, whose environment has
    ``SLURM_CONF=root/slurm.conf`` and a ``SLURM_JOB_ID`` (even one that left its step's
    tree); and their descendants."""
    inside = str(root) + "/"
    job_conf = b"\0SLURM_CONF=" + os.fsencode(inside) + b"slurm.conf\0"

    def match(pid: int) -> bool:
        if proc_read(pid, "comm").startswith(b"slurmstepd"):
            try:
                return os.readlink(f"/proc/{pid}/cwd").startswith(inside)
            except OSError:
                return False
        environ = b"\0" + proc_read(pid, "environ")
        return job_conf in environ and b"\0SLURM_JOB_ID=" in environ

    return scan(match)


def _tail(path: Path, count: int = 6) -> str:
    """The last lines of a log (noise left out), joined for a one-line error."""
    try:
        lines = path.read_text(encoding="utf-8", errors="replace").splitlines()
    except OSError:
        return f"(no {path.name})"
    kept = [line[:240] for line in lines if line.strip() and not any(word in line for word in _NOISE)]
    return f"{path}: " + (" | ".join(kept[-count:]) if kept else "(empty)")


def _node_states(cluster: SlurmCluster, sinfo: str) -> dict[str, str] | None:
    """{node: sinfo's short state} (``idle``, ``idle*``, ``alloc``, ``drain``...), None
    while slurmctld does not answer."""
    try:
        proc = subprocess.run([sinfo, "-h", "-N", "-o", "%N %t"], capture_output=True, text=True, timeout=10,
                              check=False, env={**_clean_environ(), **cluster.env})
    except (OSError, subprocess.TimeoutExpired):
        return None
    if proc.returncode != 0:
        return None
    states = {}
    for line in proc.stdout.splitlines():
        node, _, state = line.partition(" ")
        if node:
            states[node] = state.strip()
    return states


def _clean_environ() -> dict[str, str]:
    """This process's environment without SLURM_* (a caller inside a Slurm job, or with
    another cluster's SLURM_CONF exported, must not leak into this cluster's daemons)."""
    return {key: value for key, value in os.environ.items() if not key.startswith("SLURM_")}


def _wait(ready: Callable[[], bool], check: Callable[[], None], timeout: float, what: str, log: Path) -> None:
    """Poll ``ready`` until true; ``check`` raises as soon as a daemon has died; on timeout
    a ClusterError says what did not happen and ends with the log's last lines."""
    deadline = time.monotonic() + timeout
    while not ready():
        check()
        if time.monotonic() > deadline:
            raise ClusterError(f"{what} after {timeout:.0f} s; {_tail(log)}")
        time.sleep(0.02)


def _save(cluster: SlurmCluster, extra: Mapping[str, Any]) -> None:
    localcluster.save(cluster.directory, FORMAT, cluster, extra)


# ---------------------------------------------------------------------------- starting


def _start(cluster: SlurmCluster, timeout: float) -> dict[str, int]:
    """munged, then slurmctld, then every slurmd; the pids once every node is idle."""
    root = cluster.directory
    run, log = root / "run", root / "log"
    env = {**_clean_environ(), **cluster.env}
    socket_path = root / "munge" / "munge.socket.2"
    pid_files = {"munged": run / "munged.pid", "slurmctld": run / "slurmctld.pid",
                 **{f"slurmd-{node}": run / f"slurmd-{node}.pid" for node in cluster.nodes}}
    logs = {name: log / f"{name}.log" for name in pid_files}

    def check() -> None:
        for name, path in pid_files.items():
            pid = read_pid(path)
            if pid is not None and not pid_alive(pid):
                raise ClusterError(f"{name} (pid {pid}) exited; {_tail(logs[name])}")

    # --force: munged refuses a socket that other users cannot reach (pytest's and mkdtemp's
    # directories are 0700); every client here is root, so that is no reason to stop.
    start_daemons({"munged": [_binary("munged"), "--force", f"--socket={socket_path}",
                              f"--key-file={root}/munge/munge.key", f"--pid-file={pid_files['munged']}",
                              f"--log-file={logs['munged']}", f"--seed-file={root}/munge/munged.seed"]},
                  logs, env=env, cwd=root)
    _wait(socket_path.exists, check, timeout, f"munged made no socket {socket_path}", logs["munged"])
    start_daemons({"slurmctld": [_binary("slurmctld"), "-f", str(cluster.conf)]}, logs, env=env, cwd=root)
    # slurmd's that start before slurmctld listens register a second later: wait first.
    _wait(lambda: HOST in listening(cluster.ctld_port), check, timeout,
          f"slurmctld not listening on {HOST}:{cluster.ctld_port}", logs["slurmctld"])
    slurmd = _binary("slurmd")
    start_daemons({f"slurmd-{node}": [slurmd, "-N", node, "-f", str(cluster.conf)] for node in cluster.nodes},
                  logs, env=env, cwd=root)
    sinfo = _binary("sinfo")
    states: dict[str, str] = {}

    def all_idle() -> bool:
        nonlocal states
        states = _node_states(cluster, sinfo) or {}
        return all(states.get(node) == "idle" for node in cluster.nodes)

    try:
        _wait(all_idle, check, timeout, "nodes not idle", logs["slurmctld"])
    except ClusterError as exc:
        late = [node for node in cluster.nodes if states.get(node) != "idle"]
        shown = ", ".join(f"{node}={states.get(node, '?')}" for node in late[:8])
        raise ClusterError(f"{len(late)} node(s) not idle ({shown}); {exc}; {_tail(logs[f'slurmd-{late[0]}'])}"
                           ) from None
    pids = {}
    for name, path in pid_files.items():
        _wait(lambda path=path: read_pid(path) is not None, check, timeout, f"{name} wrote no pid file {path}",
              logs[name])
        pids[name] = read_pid(path)
    return pids


# ---------------------------------------------------------------------------- API


def write_reboot_program(root: Path) -> Path:
    """``D/bin/reboot-node``: the RebootProgram (``REBOOT_PROGRAM``), run by this interpreter."""
    import json

    path = root / "bin" / "reboot-node"
    path.parent.mkdir(exist_ok=True)
    path.write_text(REBOOT_PROGRAM.replace("@PYTHON@", sys.executable).replace("@ROOT@", json.dumps(str(root))),
                    encoding="utf-8")
    path.chmod(0o755)
    return path


def reboots(directory: str | Path) -> list[tuple[str, float]]:
    """(node, time) of every reboot the RebootProgram began, oldest first."""
    path = Path(directory) / "log" / "reboots.log"
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except OSError:
        return []
    out = []
    for line in lines:
        node, _, when = line.partition(" ")
        try:
            out.append((node, float(when)))
        except ValueError:
            continue
    return out


def up(directory: str | Path, *, nodes: int | None = None, prefix: str = "node", cpus: int = 2,
       port: int | None = None, ready_timeout: float = 30.0, names: Sequence[str] | None = None,
       reboot: bool = False) -> SlurmCluster:
    """Start munged, slurmctld and ``nodes`` slurmd in ``directory``; return once every node
    is idle in ``sinfo`` (at most ``ready_timeout`` seconds, else ClusterError with the end
    of the log that says why). Nodes are ``prefix`` + 001.. (``nodes`` of them, default 4),
    or exactly ``names`` when given (``check_names``; ``prefix`` is then unused, and
    ``nodes``, if given too, must be their count). ``port`` is slurmctld's and the nodes take
    the ports after it; None takes a free block. ``reboot``: ``scontrol reboot`` works
    (module docstring, "Reboots"; ``D/reboot-hook NODE`` is the test's say in it). On any
    failure, what was started is stopped again.
    """
    if names is None:
        names = node_names(4 if nodes is None else nodes, prefix)
    else:
        names = check_names(names)
        if nodes is not None and nodes != len(names):
            raise ValueError(f"nodes={nodes} but {len(names)} names given")
    nodes = len(names)
    if cpus < 1:
        raise ValueError("a node has at least 1 CPU")
    if port is not None and not 1 <= port <= 65535 - nodes:
        raise ValueError(f"port {port}: slurmctld's port and {nodes} after it must be TCP ports")
    why_not = missing()
    if why_not is not None:
        raise ClusterError(why_not)
    root = Path(directory).resolve()
    _check_directory(root)
    if port is None:
        port = free_ports(nodes + 1)
    else:
        for candidate in range(port, port + nodes + 1):
            check_free([HOST], candidate)
    node_ports = list(range(port + 1, port + 1 + nodes))
    cluster = SlurmCluster(directory=root, conf=root / "slurm.conf", nodes=names, partition=PARTITION,
                           env={"SLURM_CONF": str(root / "slurm.conf")}, ctld_port=port)
    umask = os.umask(0o022)
    try:
        root.mkdir(parents=True, exist_ok=True)
        # A stub first: a failed up leaves a directory the next up may replace.
        localcluster.save(root, FORMAT, {"state": "starting"})
        for name in ("munge", "state", "spool", "run", "log"):
            (root / name).mkdir(mode=0o755)
        for node in names:
            (root / "spool" / node).mkdir()
        key = root / "munge" / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o400)
        program = write_reboot_program(root) if reboot else None
        cluster.conf.write_text(slurm_conf(root, names, ctld_port=port, node_ports=node_ports, cpus=cpus,
                                           spool=spool_directory(root, names), reboot_program=program),
                                encoding="utf-8")
        extra: dict[str, Any] = {"node_ports": dict(zip(names, node_ports, strict=True)), "cpus": cpus, "pids": {}}
        _save(cluster, extra)  # before any process starts: down finds a half-started cluster
        try:
            pids = _start(cluster, ready_timeout)
        except BaseException:
            down(root)
            raise
        extra.update(pids=pids, started=datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ"))
        _save(cluster, extra)
        return cluster
    finally:
        os.umask(umask)


def load(directory: str | Path) -> SlurmCluster:
    """The SlurmCluster that ``up`` wrote to ``D/cluster.json`` (running or not)."""
    return localcluster.load(directory, FORMAT, SlurmCluster, ("directory", "conf"), what="local Slurm cluster")


def down(directory: str | Path) -> None:
    """Stop every process started for D (``find_processes``), by pid; idempotent.

    Jobs go first and at once, with SIGKILL, as when a node loses power: slurmstepd
    blocks SIGTERM (a job outlives its slurmd by design) and ``srun`` answers SIGTERM by
    waiting for its steps, so a polite stop would cost the full grace every time. Then the
    daemons: SIGTERM (slurmctld saves its state), SIGKILL for what is left after 3 s. Files
    stay for inspection; a later ``up`` on D replaces them.
    """
    root = Path(directory).resolve()
    for pid in _jobs(root):
        try:
            os.kill(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    stop(lambda: find_processes(root), str(root))
    alias = _spool_alias(root)
    if alias.is_symlink() and os.readlink(alias) == str(root / "spool"):
        alias.unlink()  # no daemon needs it now; ``up`` makes it again


def running(directory: str | Path, **kwargs: Any) -> AbstractContextManager[SlurmCluster]:
    """``with running(D, ...) as cluster:`` ``up`` ... ``down``, with ``down`` even when the body raises."""
    return localcluster.session(up, down, directory, kwargs)


def status(directory: str | Path) -> dict[str, Any]:
    """What is running for D: each recorded daemon (alive or not), each node's state in
    ``sinfo`` (empty when slurmctld does not answer) and how many other processes of D run
    (slurmctld's slurmscriptd, step daemons, jobs); ``running`` is True when every daemon
    lives and every node responds."""
    cluster = load(directory)
    processes = localcluster.recorded_processes(cluster.directory)
    alive = bool(processes) and all(p["alive"] for p in processes.values())
    states = (_node_states(cluster, _binary("sinfo")) or {}) if alive else {}
    responding = all(node in states and not states[node].endswith(("*", "down", "unk")) for node in cluster.nodes)
    return {
        "directory": str(cluster.directory),
        "conf": str(cluster.conf),
        "nodes": str(NodeSet.fromlist(cluster.nodes)),
        "node_count": len(cluster.nodes),
        "partition": cluster.partition,
        "ctld_port": cluster.ctld_port,
        "processes": processes,
        "states": states,
        "running": alive and responding,
        "others": len(find_processes(cluster.directory)) - sum(1 for p in processes.values() if p["alive"]),
    }


# ---------------------------------------------------------------------------- command line


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m spikeops.sim.slurmcluster",
        description="A local Slurm cluster of real daemons (munged, slurmctld, one slurmd per node) on localhost.",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    start = sub.add_parser("up", help="start the cluster and wait until every node is idle",
                           description="Start munged, slurmctld and one slurmd per node in DIR.")
    start.add_argument("--dir", required=True, type=Path, help="cluster directory (new, empty, or a stopped cluster)")
    start.add_argument("--nodes", type=int, default=4, help="number of nodes (default 4)")
    start.add_argument("--prefix", default="node", help="node name prefix (default node: node001...)")
    start.add_argument("--cpus", type=int, default=2, help="CPUs per node (default 2)")
    start.add_argument("--port", type=int, default=None,
                       help="slurmctld's port; the nodes take the ports after it (default: a free block)")
    stop_cmd = sub.add_parser("down", help="stop every process of the cluster, jobs included (idempotent)")
    stop_cmd.add_argument("--dir", required=True, type=Path)
    show = sub.add_parser("status", help="what is running; exit 0 when every daemon lives and every node responds")
    show.add_argument("--dir", required=True, type=Path)
    show.add_argument("--json", action="store_true", help="print the status as JSON")
    return parser


def _print_up(cluster: SlurmCluster, seconds: float) -> None:
    print(f"up: {len(cluster.nodes)} nodes {NodeSet.fromlist(cluster.nodes)} in partition {cluster.partition}, "
          f"slurmctld on localhost:{cluster.ctld_port} ({seconds:.1f} s)")
    print(f"use: export SLURM_CONF={cluster.conf}; sinfo; sbatch -N 2 --wrap 'sleep 60'")
    print(f"stop: infra/slurm/down --dir {cluster.directory}")


def _print_status(state: Mapping[str, Any]) -> None:
    alive = sum(1 for p in state["processes"].values() if p["alive"])
    by_state: dict[str, list[str]] = {}
    for node, node_state in state["states"].items():
        by_state.setdefault(node_state, []).append(node)
    shown = ", ".join(f"{NodeSet.fromlist(nodes)} {name}" for name, nodes in sorted(by_state.items())) or "no answer"
    print(f"{'running' if state['running'] else 'NOT running'}: {state['directory']} {state['node_count']} nodes; "
          f"{alive}/{len(state['processes'])} daemons alive; sinfo: {shown}; "
          f"{state['others']} other process(es) (slurmscriptd, steps, jobs)")


def main(argv: Sequence[str] | None = None) -> int:
    """Exit 0 on success; 1 for ``status`` of a cluster not fully up; 2 with a one-line reason."""
    args = _parser().parse_args(argv)
    return localcluster.command_line(
        "spikeops.sim.slurmcluster", args,
        start=lambda: up(args.dir, nodes=args.nodes, prefix=args.prefix, cpus=args.cpus, port=args.port),
        down=down, status=status, show_up=_print_up, show_status=_print_status)


if __name__ == "__main__":
    sys.exit(main())
