"""Several clusters with several diverging jobs each, for the scale-out tests and benchmark.

Each job is its own simulated incident: a small cluster of real sshd servers on loopback
(``spikeops.sim.cluster``) whose nodes answer from the job's scenario (a seed of its own, so
another culprit), with its checkpoints laid out and its metrics as the run directory. The jobs
of one spikeops cluster share what a real cluster shares: one inventory (the nodes of all
its jobs; each node's address, port, key and known_hosts come from a per-host OpenSSH client
config, as at a site whose ``~/.ssh/config`` knows every node) and one local scheduler
(every job's nodes plus a spare per job). Job ids are the scheduler's own, so two clusters
may well both have a job "1" (as two Slurm clusters do).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from ClusterShell.NodeSet import NodeSet

from spikeops.schedulers import LocalScheduler
from spikeops.sim import cluster as simcluster
from spikeops.sim.build import expected_of, plan_incident
from spikeops.sim.trainjob import lay_checkpoints

__all__ = ["SimJob", "World", "world", "dask_cluster", "JOB_ARGV"]

#: The "training job" the scheduler runs: it only has to live until it is stopped.
JOB_ARGV = [sys.executable, "-c", "import time; time.sleep(900)"]


@dataclass
class SimJob:
    cluster: str
    job: str
    sim: simcluster.Cluster
    culprits: list[str]


@dataclass
class World:
    work: Path
    config: Path
    jobs: list[SimJob]
    schedulers: dict[str, LocalScheduler] = field(default_factory=dict)

    def of(self, cluster: str) -> list[SimJob]:
        return [job for job in self.jobs if job.cluster == cluster]


def _seeds(scenario: str, count: int, nodes: int, start: int) -> list[tuple[int, list[str], list[str]]]:
    """``count`` seeds whose incidents have pairwise disjoint node names (one inventory holds
    them all): (seed, node names, culprit nodes)."""
    chosen: list[tuple[int, list[str], list[str]]] = []
    taken: set[str] = set()
    seed = start
    while len(chosen) < count:
        plan = plan_incident(scenario, seed=seed, nodes=nodes, distractors=False)
        expected = expected_of(plan)
        names = [node.name for node in plan.nodes]
        if not taken & set(names):
            chosen.append((seed, names, list(expected.culprit_nodes)))
            taken |= set(names)
        seed += 1
    return chosen


def _ssh_config(path: Path, sims: list[simcluster.Cluster]) -> None:
    lines = ["# every node of this cluster's jobs: address, port, key, host keys (tests/scaleout.py)", ""]
    for sim in sims:
        for node in sim.nodes:
            lines += [f"Host {node}", f"    HostName {sim.addresses[node]}", f"    Port {sim.port}",
                      f"    User {sim.user}", f"    IdentityFile {sim.identity_file}",
                      f"    UserKnownHostsFile {sim.known_hosts}", ""]
    path.write_text("\n".join(lines))


def _inventory(path: Path, name: str, nodes: list[str], ssh_config: Path, jobs_dir: Path) -> None:
    files = f"{jobs_dir}/{{job}}/{{node}}"
    path.write_text(
        f'[cluster]\nname = "{name}"\nnodes = "{NodeSet.fromlist(nodes)}"\ngpus_per_node = 8\n\n'
        f'[ssh]\nconfig = "{ssh_config}"\nconnect_timeout = 5\ncommand_timeout = 10\nfanout = 128\n\n'
        f'[job]\nnccl_log = "{files}/*.out"\ntrain_log = "{files}/train.out"\n'
        f'nccl_version = "cat {files}/nccl-version.txt"\n')


@contextmanager
def world(work: Path, layout: Mapping[str, int], *, nodes: int = 3, first_octets: tuple[int, int] = (0, 200),
          scenario: str = "gpu_xid", seed: int = 5, extra_config: str = "",
          max_concurrent: int = 4) -> Iterator[World]:
    """``layout``: cluster name -> how many jobs. Each job's sim cluster gets ``nodes`` nodes
    on 127.A.B+k.11 and up (``first_octets`` = (A, B)), one sshd, its own port. Yields the
    World; stops every job, sshd and scheduler process on the way out."""
    work.mkdir(parents=True, exist_ok=True)
    total = sum(layout.values())
    seeds = iter(_seeds(scenario, total, nodes, seed))
    stack = ExitStack()
    config_lines = [f'[incidents]\ndir = "{work}/incidents"\nmax_concurrent = {max_concurrent}\n']
    jobs: list[SimJob] = []
    schedulers: dict[str, LocalScheduler] = {}
    index = 0
    try:
        for name, count in layout.items():
            base = work / name
            sims, culprits = [], []
            for _ in range(count):
                job_seed, _names, job_culprits = next(seeds)
                first = f"127.{first_octets[0]}.{first_octets[1] + index}.11"
                port = simcluster.free_port((first,))
                sims.append(stack.enter_context(simcluster.running(
                    base / "sims" / f"{index}", nodes=nodes, port=port, first_address=first, scenario=scenario,
                    seed=job_seed)))
                culprits.append(job_culprits)
                index += 1
            scheduler = LocalScheduler(base / "sched")
            scheduler.add_nodes([n for sim in sims for n in sim.nodes] + [f"spare-{name}-{k}" for k in range(count)])
            schedulers[name] = scheduler
            ssh_config, jobs_dir = base / "ssh_config", base / "jobs"
            _ssh_config(ssh_config, sims)
            for sim, job_culprits in zip(sims, culprits, strict=True):
                job = scheduler.submit(JOB_ARGV, sim.nodes)
                for node in sim.nodes:  # the job's own log files, where the inventory says they are
                    (jobs_dir / job).mkdir(parents=True, exist_ok=True)
                    os.symlink(sim.directory / "jobs" / sim.job / node, jobs_dir / job / node)
                (base / "runs").mkdir(exist_ok=True)
                os.symlink(sim.scenario_bundle, base / "runs" / job)
                lay_checkpoints(base / "ckpt" / job, sim.scenario_bundle)
                jobs.append(SimJob(name, job, sim, job_culprits))
            _inventory(base / "inventory.toml", name, [n for sim in sims for n in sim.nodes], ssh_config, jobs_dir)
            for folder in (base, jobs_dir):  # the nodes' login user reads the job files through here
                os.chmod(folder, 0o755)
            config_lines.append(
                f'[clusters.{name}]\ninventory = "{base}/inventory.toml"\nrun_dir = "{base}/runs/{{job}}"\n'
                f'checkpoint_root = "{base}/ckpt/{{job}}"\nscheduler = "local"\n'
                f'scheduler_state_dir = "{base}/sched"\napproval = "auto-hardware"\nobserve_timeout_s = 2\n'
                f'slack_channel = "#incidents"\n{extra_config}')
        config = work / "spikeops.toml"
        config.write_text("\n".join(config_lines))
        time.sleep(0.2)
        yield World(work, config, jobs, schedulers)
    finally:
        for scheduler in schedulers.values():
            for other in scheduler.jobs():
                if other.state == "RUNNING":
                    scheduler.stop(other.job_id, grace=0.5)
        stack.close()


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextmanager
def dask_cluster(work: Path, workers: int = 2, threads: int = 2,
                 env: Mapping[str, str] | None = None) -> Iterator[str]:
    """A real ``distributed`` scheduler and ``workers`` worker processes on loopback, as
    ``dask scheduler`` / ``dask worker`` start them on real machines, running this checkout's
    code; yields the scheduler's address once every worker has joined. Stopped (by pid) on
    the way out."""
    from distributed import Client

    work.mkdir(parents=True, exist_ok=True)
    dask = str(Path(sys.executable).parent / "dask")
    port = _free_port()
    address = f"tcp://127.0.0.1:{port}"
    environment = dict(env if env is not None else os.environ)
    # The workers unpickle the shard task by reference: this checkout's tasks and spikeops,
    # as the flow uses, not whichever copy the virtualenv's editable install points at.
    root = str(Path(__file__).resolve().parents[1])
    environment["PYTHONPATH"] = os.pathsep.join([root, *filter(None, [environment.get("PYTHONPATH")])])
    processes: list[subprocess.Popen[bytes]] = []
    logs = open(work / "dask.log", "ab")  # noqa: SIM115 - closed below
    try:
        processes.append(subprocess.Popen([dask, "scheduler", "--host", "127.0.0.1", "--port", str(port),
                                           "--no-dashboard", "--no-show"], env=environment, stdout=logs,
                                          stderr=subprocess.STDOUT, start_new_session=True))
        for index in range(workers):
            processes.append(subprocess.Popen(
                [dask, "worker", address, "--host", "127.0.0.1", "--nthreads", str(threads), "--no-nanny",
                 "--no-dashboard", "--name", f"w{index}", "--local-directory", str(work / f"w{index}")],
                env=environment, stdout=logs, stderr=subprocess.STDOUT, start_new_session=True))
        with Client(address, timeout="60s") as client:
            client.wait_for_workers(workers, timeout=120)
        yield address
    finally:
        for process in reversed(processes):
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGTERM)
        for process in processes:
            try:
                process.wait(15)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait(5)
        logs.close()
