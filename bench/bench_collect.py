"""Benchmark: `spikeops collect` against `pdsh -R ssh` and `clush`, same probes, same servers.

Starts the local cluster (infra/sim/cluster: real sshd per 16 nodes on loopback, node tools
answering from per-node files) at each size, and measures every tool against the same
servers, under four node models (``--model``):

- ``cheap``: this machine's bare sshd (no PAM, a login shell without profile) and tools that
  answer at once: what the tests use, and cheaper than a compute node;
- ``real``: what a compute node's login costs (spikeops.sim.nodetools.REAL_LOGIN, justified
  in the README): 50 ms of PAM session stack per connection, 40 ms of login shell and profile
  per session, paid as waiting by each node, as on a cluster each node pays it on its own cores;
- ``real-cpu``: the same, the 40 ms of each session burnt as CPU by its shell. Every
  simulated node shares this machine's two cores, so this charges one node's sessions to all
  the others too: an upper bound of what sessions cost, where ``real`` is a lower one;
- ``real-tools``: ``real`` logins, and tools that take as long as on an 8-GPU node
  (spikeops.sim.nodetools.REAL_TOOL_TIMES, justified in the README: nvidia-smi -q a second,
  ethtool -S and ibstat tens of milliseconds), spent waiting as the real tools do. The joined
  command runs the probes one after another; spikeops runs a node's probes at once.

The five probes of the issue (nvidia-smi -q, the kernel log, ethtool -S per interface, ibstat,
the InfiniBand counters) are run by:

- spikeops collect, one session per node (the default) through paramiko and through
  OpenSSH's ssh (``[ssh] client = "openssh"``), and a session per probe, fan-out 64;
- pdsh -R ssh -f 64 with the five commands joined into one (one connection and one session
  per node; the outputs come back interleaved, with one exit status, no per-probe bound);
- pdsh -R exec -f 64 running `ssh %h` itself, joined (the same ssh client without pdsh's ssh
  module, which here waits ~0.1 s per connection: strace shows its threads sleeping in turn);
- clush -f 64, joined;
- with ``--per-probe-baselines``, pdsh and clush once per probe as well (five runs).

Wall time, client CPU (user + system of the tool and the children it waited for), node CPU
(everything the sshd servers ran for it, from a cpuacct cgroup, when run as root) and peak RSS
(the largest process of the tree, from GNU time), and each tool's wall time against
``pdsh -R ssh`` joined on the same model. Run by hand: `python bench/bench_collect.py --nodes
64 256 --model real real-tools [--rss-nodes 1024]`; the figures go in the README, a table per
node model. Nothing here is asserted; the tests check behaviour, this measures speed.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from spikeops.inventory import load_inventory
from spikeops.sim import cluster as simcluster
from spikeops.sim.cluster import NODE_MODELS
from spikeops.sim.nodetools import LoginCost, ToolTimes

PROBES = [
    "nvidia-smi -q",
    "dmesg --time-format iso",
    'for i in $(ls "${SPIKEOPS_SYSFS:-/sys}/class/net"); do [ "$i" = lo ] || ethtool -S "$i"; done',
    "ibstat",
    'grep -H . "${SPIKEOPS_SYSFS:-/sys}"/class/infiniband/*/ports/*/counters/*',
]
JOINED = " ; ".join(f"{{ {probe} ; }}" for probe in PROBES)
FIVE_ONLY = "".join(f"\n[probes.{name}]\nenabled = false\n" for name in ("nccl", "nccl-version", "train", "nvml",
                                                                                "flight-recorder", "stacks", "ncclras"))
#: spikeops' modes: (label, [ssh] settings).
MODES = {
    "single": ("spikeops collect, one session per node (paramiko)", 'sessions = "single"\n'),
    "openssh": ("spikeops collect, one session per node (openssh)", 'client = "openssh"\n'),
    "per-probe": ("spikeops collect, a session per probe (paramiko)", 'sessions = "per-probe"\n'),
}
#: What pdsh and clush get from the cluster's ssh_config beyond the strict defaults: the key
#: exchange (OpenSSH's default sntrup761 hybrid costs its client ~90 ms of CPU a connection
#: here). spikeops' ssh gets the same line; paramiko offers curve25519 first by itself.
KEX_CONFIG = "Host *\n    KexAlgorithms ^curve25519-sha256\n"

Row = tuple[str, float, float, int, str, float | None]  # label, wall s, client CPU s, peak RSS KiB, check, node CPU s
CPUACCT = Path("/sys/fs/cgroup/cpuacct")


class NodeCpu:
    """CPU time spent by every process the cluster's sshd listeners start (sessions, shells,
    probes, runners, whatever they leave behind), through a cgroup-v1 cpuacct group the
    listeners are moved into (their children are born in it). Needs root and cpuacct mounted;
    otherwise ``read`` returns None and the column says "-"."""

    def __init__(self, cluster: simcluster.Cluster) -> None:
        self.group: Path | None = None
        pids = json.loads((cluster.directory / "cluster.json").read_text())["pids"]
        try:
            group = CPUACCT / f"spikeops-bench-{os.getpid()}"
            group.mkdir()
            self.group = group
            for name, pid in pids.items():
                if name.startswith("sshd-"):
                    (group / "cgroup.procs").write_text(f"{pid}\n")
        except OSError:
            self.close()

    def read(self) -> float | None:
        if self.group is None:
            return None
        return int((self.group / "cpuacct.usage").read_text()) / 1e9

    def close(self) -> None:
        """After the cluster is down (a group with processes in it cannot be removed)."""
        if self.group is not None:
            try:
                self.group.rmdir()
            except OSError:
                pass
            self.group = None


def _measured(cpu: NodeCpu, run: Callable[[], tuple[str, float, float, int, str]]) -> Row:
    before = cpu.read()
    label, seconds, client, rss, check = run()
    time.sleep(0.3)  # what the nodes still do after the client returned (a runner cleaning up)
    after = cpu.read()
    return label, seconds, client, rss, check, None if before is None or after is None else after - before


TIME = shutil.which("time", path="/usr/bin:/bin")


def _run(argv: list[str], env: dict[str, str] | None = None, stdout: Path | None = None) -> tuple[float, float, int, int]:
    """Wall seconds, client CPU seconds, peak RSS (KiB) of the largest process in the tree,
    exit status.

    The RSS comes from GNU time (``/usr/bin/time -f %M``) around the command: a child forked
    straight from this process starts from this process's resident set, which Linux keeps
    as the child's peak across exec, so wait4 would report this benchmark's own size (150 MB
    once it has built a 256-node scenario) for every tool. time is small."""
    out = open(stdout, "wb") if stdout else subprocess.DEVNULL  # noqa: SIM115
    peak_file = Path(tempfile.mktemp(prefix="spikeops-bench-rss-"))
    command = [TIME, "-q", "-f", "%M", "-o", str(peak_file), *argv] if TIME else argv
    t0 = time.perf_counter()
    process = subprocess.Popen(command, stdout=out, stderr=subprocess.DEVNULL, env=env)
    _, status, usage = os.wait4(process.pid, 0)
    seconds = time.perf_counter() - t0
    if stdout:
        out.close()
    peak = usage.ru_maxrss
    if TIME:
        text = peak_file.read_text().strip().splitlines() if peak_file.exists() else []
        peak = int(text[-1]) if text and text[-1].isdigit() else 0
        peak_file.unlink(missing_ok=True)
    return seconds, usage.ru_utime + usage.ru_stime, peak, os.waitstatus_to_exitcode(status)


def _hosts(nodes: list[str], out: Path) -> Path:
    hosts = out.with_suffix(".hosts")
    hosts.write_text("\n".join(nodes) + "\n")
    return hosts


def _pdsh(cluster: simcluster.Cluster, nodes: list[str], command: str, fanout: int, out: Path):
    # -l: pdsh's %u is the local user otherwise (root here), whose login shell would read this
    # machine's root ~/.bashrc on every session instead of the nodes' login user's empty one
    env = dict(os.environ, PDSH_RCMD_TYPE="ssh", PDSH_SSH_ARGS=f"-F {cluster.ssh_config} -x -l%u %h")
    return _run(["pdsh", "-R", "ssh", "-l", cluster.user, "-f", str(fanout), "-w", f"^{_hosts(nodes, out)}", command],
                env=env, stdout=out)


def _pdsh_exec(cluster: simcluster.Cluster, nodes: list[str], command: str, fanout: int, out: Path):
    return _run(["pdsh", "-R", "exec", "-f", str(fanout), "-w", f"^{_hosts(nodes, out)}", "ssh", "-F",
                 str(cluster.ssh_config), "%h", command], stdout=out)


def _clush(cluster: simcluster.Cluster, nodes: list[str], command: str, fanout: int, out: Path):
    exe = Path(sys.executable).with_name("clush")
    return _run([str(exe), "-f", str(fanout), "--hostfile", str(_hosts(nodes, out)), "-o", f"-F {cluster.ssh_config}",
                 "-l", cluster.user, command], stdout=out)


def _nodes_answering(out: Path) -> int:
    """Nodes with at least one line in a pdsh/clush output ("node: line")."""
    return len({line.split(":", 1)[0] for line in out.read_text(errors="replace").splitlines() if ":" in line})


def _spikeops(cluster: simcluster.Cluster, size: int, work: Path, fanout: int,
              mode: str) -> tuple[str, float, float, int, str]:
    label, settings = MODES[mode]
    config = work / "ssh_config-kex"
    config.write_text(KEX_CONFIG)
    if mode == "openssh":
        settings += f'config = "{config}"\n'
    inventory = work / f"inventory-{size}-{mode}.toml"
    inventory.write_text(cluster.inventory.read_text().replace("fanout = 128\n", "fanout = 128\n" + settings)
                         + FIVE_ONLY)
    bundle = work / f"bundle-{size}-{mode}"
    shutil.rmtree(bundle, ignore_errors=True)
    exe = Path(sys.executable).with_name("spikeops")
    seconds, cpu, rss, code = _run([str(exe), "collect", "-i", str(inventory), "--job", cluster.job, "--out",
                                    str(bundle), "--fanout", str(fanout)])
    ok = sum(1 for p in (bundle / "nodes").iterdir() if (p / "nvidia-smi-q.txt").is_file()) if bundle.is_dir() else 0
    return label, seconds, cpu, rss, f"exit {code}, {ok}/{size} nodes with evidence"


BASELINE_KEYS = {"pdsh -R ssh": "pdsh", "pdsh -R exec ssh": "pdsh-exec", "clush": "clush"}


def _baselines(cluster: simcluster.Cluster, size: int, work: Path, fanout: int, per_probe: bool,
               node_cpu: NodeCpu, baselines: tuple[str, ...] = tuple(BASELINE_KEYS.values())) -> list[Row]:
    nodes = load_inventory(cluster.inventory).nodes
    rows: list[Row] = []
    tools: list[tuple[str, Callable]] = [(tool, runner) for tool, runner in
                                         (("pdsh -R ssh", _pdsh), ("pdsh -R exec ssh", _pdsh_exec), ("clush", _clush))
                                         if BASELINE_KEYS[tool] in baselines]
    for tool, runner in tools:
        out = work / f"{tool.replace(' ', '_')}-{size}-joined.out"

        def joined(tool: str = tool, runner: Callable = runner, out: Path = out) -> tuple[str, float, float, int, str]:
            seconds, cpu, rss, code = runner(cluster, nodes, JOINED, fanout, out)
            return (f"{tool} -f {fanout}, the five joined in one command", seconds, cpu, rss,
                    f"exit {code}, output from {_nodes_answering(out)}/{size} nodes")

        rows.append(_measured(node_cpu, joined))
        if per_probe and runner is not _pdsh_exec:

            def each(tool: str = tool, runner: Callable = runner) -> tuple[str, float, float, int, str]:
                total = cpu_total = 0.0
                peak, codes = 0, []
                for index, probe in enumerate(PROBES):
                    seconds, cpu, rss, code = runner(cluster, nodes, probe, fanout,
                                                     work / f"{tool.replace(' ', '_')}-{size}-{index}.out")
                    total, cpu_total, peak = total + seconds, cpu_total + cpu, max(peak, rss)
                    codes.append(code)
                return f"{tool} -f {fanout}, one run per probe (5 runs)", total, cpu_total, peak, f"exits {codes}"

            rows.append(_measured(node_cpu, each))
    return rows


def _median(rows: list[Row]) -> Row:
    """The run of median wall time among repeats (its CPU and RSS with it)."""
    ordered = sorted(rows, key=lambda row: row[1])
    return ordered[(len(ordered) - 1) // 2]


def _bench_size(size: int, models: list[str], fanout: int, per_probe: bool, work: Path,
                rss_only: bool = False, repeat: int = 1,
                baselines: tuple[str, ...] = tuple(BASELINE_KEYS.values())) -> list[tuple[str, Row]]:
    shm = Path("/dev/shm")
    # The servers' files on tmpfs when there is one (cluster start-up is not what is measured);
    # every tool's output goes to the same disk directory.
    base = Path(tempfile.mkdtemp(prefix="spikeops-bench-", dir=shm if shm.is_dir() else None))
    rows: list[tuple[str, Row]] = []
    node_cpu: NodeCpu | None = None
    try:
        port = simcluster.free_port(("127.0.16.11",))
        with simcluster.running(base / f"cluster-{size}", nodes=size, port=port, first_address="127.0.16.11") as cluster:
            node_cpu = NodeCpu(cluster)
            for model in models:
                simcluster.set_login(cluster.directory, *NODE_MODELS[model])
                if rss_only:
                    rows.append((model, _measured(node_cpu, lambda: _spikeops(cluster, size, work, fanout, "single"))))
                    continue
                # the tools take turns, `repeat` rounds, so a load that comes and goes on a
                # shared machine falls on all of them alike; each one's median run is kept
                rounds: list[list[Row]] = []
                for _ in range(repeat):
                    ours = [_measured(node_cpu, lambda mode=mode: _spikeops(cluster, size, work, fanout, mode))
                            for mode in MODES]
                    rounds.append(ours + _baselines(cluster, size, work, fanout, per_probe, node_cpu, baselines))
                rows.extend((model, _median([one[i] for one in rounds])) for i in range(len(rounds[0])))
    finally:
        if node_cpu is not None:
            node_cpu.close()
        shutil.rmtree(base, ignore_errors=True)
    return rows


def _describe(login: LoginCost, tools: ToolTimes) -> str:
    if login.free:
        text = "cheap (bare sshd)"
    else:
        how = "CPU" if login.session_cpu else "waiting"
        text = f"real logins ({login.connection_ms} ms/connection + {login.session_ms} ms/session of {how})"
    if not tools.free:
        text += (f", real tool times (nvidia-smi -q {tools.nvidia_smi_ms} ms, ethtool -S {tools.ethtool_ms} ms, "
                 f"ibstat {tools.ibstat_ms} ms)")
    return text


def _print_tables(results: list[tuple[int, str, Row]]) -> None:
    """One table per node model; each tool's wall time also as a multiple of pdsh -R ssh's."""
    for model in dict.fromkeys(model for _, model, _ in results):
        print(f"\nNode model `{model}`: {_describe(*NODE_MODELS[model])}\n")
        print("| nodes | tool | wall s | x pdsh -R ssh | client CPU s | node CPU s | peak RSS MiB | check |")
        print("| ---: | --- | ---: | ---: | ---: | ---: | ---: | --- |")
        for size in dict.fromkeys(size for size, m, _ in results if m == model):
            rows = [row for s, m, row in results if s == size and m == model]
            pdsh = next((row[1] for row in rows if row[0].startswith("pdsh -R ssh")), None)
            for label, seconds, cpu, rss, check, nodes in rows:
                ratio = f"{seconds / pdsh:.2f}" if pdsh else "-"
                shown = "-" if nodes is None else f"{nodes:.1f}"
                print(f"| {size} | {label} | {seconds:.2f} | {ratio} | {cpu:.1f} | {shown} | {rss / 1024:.0f} | {check} |",
                      flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, nargs="*", default=[64, 256], help="sizes to measure every tool at")
    parser.add_argument("--model", "--login", nargs="+", choices=list(NODE_MODELS), dest="models",
                        default=["real", "real-tools", "real-cpu", "cheap"],
                        help="node models to measure (default: real real-tools real-cpu cheap)")
    parser.add_argument("--rss-nodes", type=int, nargs="*", default=[],
                        help="sizes at which only spikeops (one session per node) is run, for its peak RSS")
    parser.add_argument("--fanout", type=int, default=64)
    parser.add_argument("--repeat", type=int, default=1,
                        help="rounds of every tool in turn; the median run of each is printed (default 1)")
    parser.add_argument("--baselines", nargs="+", choices=list(BASELINE_KEYS.values()),
                        default=list(BASELINE_KEYS.values()),
                        help="the other tools to run (default: pdsh pdsh-exec clush; clush takes minutes at 256 nodes)")
    parser.add_argument("--per-probe-baselines", action="store_true",
                        help="also run pdsh and clush once per probe (slow: five passes over the nodes)")
    args = parser.parse_args()
    # a stopped benchmark still stops its cluster (the finally blocks run on SystemExit)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    if not shutil.which("pdsh"):
        print("pdsh is not installed (apt-get install pdsh)", file=sys.stderr)
        return 2
    results: list[tuple[int, str, Row]] = []
    with tempfile.TemporaryDirectory(prefix="spikeops-bench-collect-") as tmp:
        work = Path(tmp)
        runs = [(size, False) for size in args.nodes] + [(size, True) for size in args.rss_nodes]
        for size, rss_only in runs:
            for model, row in _bench_size(size, args.models, args.fanout, args.per_probe_baselines, work, rss_only,
                                          max(1, args.repeat), tuple(args.baselines)):
                results.append((size, model, row))
                label, seconds, cpu, rss, check, nodes = row
                print(f"# {size} nodes, {model}: {label}: {seconds:.2f} s wall, {cpu:.1f} s client CPU, "
                      f"{'-' if nodes is None else f'{nodes:.1f}'} s node CPU ({check})", file=sys.stderr, flush=True)
    _print_tables(results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
