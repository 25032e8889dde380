"""Benchmark: `spikeops collect` against `pdsh -R ssh` and `clush`, same probes, same servers.

Starts the local cluster (infra/sim/cluster: real sshd per 16 nodes on loopback, node tools
answering from per-node files) at each size, then runs in one process of measurement:

- spikeops collect, the five probes of the issue (nvidia-smi -q, the kernel log, ethtool -S
  per interface, ibstat, the InfiniBand counters), fan-out 64 (and its default 128);
- pdsh -R ssh -f 64, once per probe (how an engineer runs it: five commands, five passes);
- pdsh -R ssh -f 64, once with the five commands joined (one connection per node, like
  spikeops; the outputs come back interleaved and must be split by hand);
- pdsh -R exec -f 64 running `ssh %h` itself, joined: the same ssh client without pdsh's ssh
  module, which here waits ~0.1 s per connection (strace: its threads sleep in turn);
- clush -f 64, the same two ways.

Wall time and peak RSS (the process tree's largest resident set, from wait4) per tool.
Run by hand: `python bench/bench_collect.py --nodes 64 256 --rss-nodes 1024`; the figures
go in the README. Nothing here is asserted; the tests check behaviour, this measures speed.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from spikeops.inventory import load_inventory
from spikeops.sim import cluster as simcluster

PROBES = [
    "nvidia-smi -q",
    "dmesg --time-format iso",
    'for i in $(ls "${SPIKEOPS_SYSFS:-/sys}/class/net"); do [ "$i" = lo ] || ethtool -S "$i"; done',
    "ibstat",
    'grep -H . "${SPIKEOPS_SYSFS:-/sys}"/class/infiniband/*/ports/*/counters/*',
]
CPU: list[float] = []
FIVE_ONLY = "".join(f"\n[probes.{name}]\nenabled = false\n" for name in ("nccl", "nccl-version", "train", "nvml"))


def _run(argv: list[str], env: dict[str, str] | None = None, stdout: Path | None = None) -> tuple[float, int, int]:
    """Wall seconds, peak RSS (KiB) of the largest process in the tree, exit status; the
    client's CPU seconds (its own and its waited-for children's, user + system) go into
    ``CPU`` under the command's first word."""
    out = open(stdout, "wb") if stdout else subprocess.DEVNULL  # noqa: SIM115
    t0 = time.perf_counter()
    process = subprocess.Popen(argv, stdout=out, stderr=subprocess.DEVNULL, env=env)
    _, status, usage = os.wait4(process.pid, 0)
    seconds = time.perf_counter() - t0
    CPU.append(usage.ru_utime + usage.ru_stime)
    if stdout:
        out.close()
    # ru_maxrss of wait4 is the child's own; its children's peaks come from RUSAGE_CHILDREN.
    return seconds, usage.ru_maxrss, os.waitstatus_to_exitcode(status)


def _spikeops(inventory: Path, job: str, out: Path, fanout: int) -> tuple[float, int, int]:
    shutil.rmtree(out, ignore_errors=True)
    exe = Path(sys.executable).with_name("spikeops")
    return _run([str(exe), "collect", "-i", str(inventory), "--job", job, "--out", str(out),
                 "--fanout", str(fanout)])


def _pdsh(cluster: simcluster.Cluster, nodes: list[str], command: str, fanout: int, out: Path) -> tuple[float, int, int]:
    env = dict(os.environ, PDSH_RCMD_TYPE="ssh", PDSH_SSH_ARGS=f"-F {cluster.ssh_config} -x -l%u %h")
    hosts = out.with_suffix(".hosts")
    hosts.write_text("\n".join(nodes) + "\n")
    return _run(["pdsh", "-R", "ssh", "-f", str(fanout), "-w", f"^{hosts}", command], env=env, stdout=out)


def _pdsh_exec(cluster: simcluster.Cluster, nodes: list[str], command: str, fanout: int,
               out: Path) -> tuple[float, int, int]:
    hosts = out.with_suffix(".hosts")
    hosts.write_text("\n".join(nodes) + "\n")
    return _run(["pdsh", "-R", "exec", "-f", str(fanout), "-w", f"^{hosts}", "ssh", "-F", str(cluster.ssh_config),
                 "%h", command], stdout=out)


def _clush(cluster: simcluster.Cluster, nodes: list[str], command: str, fanout: int, out: Path) -> tuple[float, int, int]:
    exe = Path(sys.executable).with_name("clush")
    hosts = out.with_suffix(".hosts")
    hosts.write_text("\n".join(nodes) + "\n")
    return _run([str(exe), "-f", str(fanout), "--hostfile", str(hosts), "-o", f"-F {cluster.ssh_config}",
                 "-l", cluster.user, command], stdout=out)


def _bench_size(size: int, fanout: int, rss_only: bool, work: Path) -> list[tuple[str, float, int, str]]:
    shm = Path("/dev/shm")
    base = Path(tempfile.mkdtemp(prefix="spikeops-bench-", dir=shm)) if shm.is_dir() else work
    try:
        return _measure(size, fanout, rss_only, work, base)
    finally:
        if base != work:
            shutil.rmtree(base, ignore_errors=True)


def _measure(size: int, fanout: int, rss_only: bool, work: Path, base: Path) -> list[tuple[str, float, int, str]]:
    rows: list[tuple[str, float, int, str]] = []
    port = simcluster.free_port(("127.0.16.11",))
    # The servers' files on tmpfs when there is one (cluster start-up is not what is measured);
    # every tool's output goes to the same disk directory.
    with simcluster.running(base / f"cluster-{size}", nodes=size, port=port, first_address="127.0.16.11") as cluster:
        inventory = work / f"inventory-{size}.toml"
        inventory.write_text(cluster.inventory.read_text() + FIVE_ONLY)
        nodes = load_inventory(inventory).nodes
        joined = " ; ".join(f"{{ {probe} ; }}" for probe in PROBES)
        for label, fan in ((f"spikeops collect (fanout {fanout})", fanout), ("spikeops collect (fanout 128)", 128)):
            CPU.clear()
            seconds, rss, code = _spikeops(inventory, cluster.job, work / f"bundle-{size}", fan)
            ok = sum(1 for p in (work / f"bundle-{size}" / "nodes").iterdir()
                     if (p / "nvidia-smi-q.txt").is_file())
            rows.append((label, seconds, rss, f"{sum(CPU):.1f} | exit {code}, {ok}/{size} nodes with evidence"))
            if rss_only:
                return rows
        for tool, runner in (("pdsh -R ssh", _pdsh), ("pdsh -R exec ssh", _pdsh_exec), ("clush", _clush)):
            total, peak, codes = 0.0, 0, []
            CPU.clear()
            if runner is _pdsh_exec:
                out = work / f"exec-{size}-joined.out"
                seconds, rss, code = runner(cluster, nodes, joined, fanout, out)
                rows.append((f"{tool} -f {fanout}, the five joined in one run", seconds, rss,
                             f"{sum(CPU):.1f} | exit {code}"))
                continue
            for index, probe in enumerate(PROBES):
                seconds, rss, code = runner(cluster, nodes, probe, fanout, work / f"{tool[:5]}-{size}-{index}.out")
                total, peak = total + seconds, max(peak, rss)
                codes.append(code)
            rows.append((f"{tool} -f {fanout}, one run per probe (5 runs)", total, peak, f"{sum(CPU):.1f} | exits {codes}"))
            CPU.clear()
            out = work / f"{tool[:5]}-{size}-joined.out"
            seconds, rss, code = runner(cluster, nodes, joined, fanout, out)
            hosts = len({line.split(":", 1)[0] for line in out.read_text(errors="replace").splitlines() if ":" in line})
            rows.append((f"{tool} -f {fanout}, the five joined in one run", seconds, rss,
                         f"{sum(CPU):.1f} | exit {code}, output from {hosts}/{size} nodes"))
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, nargs="+", default=[64, 256])
    parser.add_argument("--rss-nodes", type=int, nargs="*", default=[1024],
                        help="sizes at which only spikeops is run, for its peak RSS")
    parser.add_argument("--fanout", type=int, default=64)
    args = parser.parse_args()
    if not shutil.which("pdsh"):
        print("pdsh is not installed (apt-get install pdsh)", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix="spikeops-bench-collect-") as tmp:
        work = Path(tmp)
        print("| nodes | tool | wall s | peak RSS MiB | client CPU s | check |")
        print("| ---: | --- | ---: | ---: | ---: | --- |")
        for size, rss_only in [(n, False) for n in args.nodes] + [(n, True) for n in args.rss_nodes]:
            for label, seconds, rss, check in _bench_size(size, args.fanout, rss_only, work):
                print(f"| {size} | {label} | {seconds:.2f} | {rss / 1024:.0f} | {check} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
