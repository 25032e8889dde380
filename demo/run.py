"""``spikeops demo``: the whole pipeline on one machine, in under a minute.

A newcomer should see spikeops do its whole job on a realistic cluster without configuring
anything, so the demo builds one and tears it down:

1. a simulated incident of the chosen cause (``spikeops.sim``) becomes a cluster of real sshd
   "nodes" on loopback addresses, each answering the probes with that node's evidence;
2. the scheduler is the real Slurm when its daemons are installed (``spikeops.sim.slurmcluster``),
   else the local-process scheduler; a training job (``spikeops.sim.trainjob``) runs on the
   nodes and writes its metrics step by step, diverging as the scenario says;
3. the watcher (``spikeops.watch``) follows the job's metrics.jsonl and fires the incident flow
   on the anomaly; when it sees none (a false alarm), an alert fires anyway, as a noisy
   Alertmanager rule would, and the flow must conclude that nothing is wrong. With
   ``monitoring="prometheus"`` (``--monitoring prometheus``) the real chain replaces the watcher:
   the job serves its metrics (``spikeops.train.PrometheusExporter``), Debian's Prometheus
   scrapes them every second and evaluates ``infra/monitoring/prometheus-rules.yml``, and
   Debian's Alertmanager posts what fires to the real receiver (``deployments/receiver.py``),
   whose starter hands the alert to the demo; when no rule fires within seconds of the job's
   last step (a spike shorter than the rule's ``for``, a log-only job), the alert fires anyway;
4. the incident flow runs against an ephemeral Prefect server whose database lives in the demo
   directory. Each Slack message it would post (the outbox: the demo has no token) is printed
   as it is written; an approval request is answered by the demo, as a person would in the UI;
5. the diagnosis, what was done and where the files are, then everything is stopped (unless
   ``keep``). The files stay for reading.
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

from spikeops.demo.prefect_server import (PrefectServer, drain_prefect, free_port, preload,
                                           quiet_prefect_environment)

__all__ = ["DemoOptions", "DemoResult", "SCENARIOS", "run_demo", "stop_demo", "default_seed"]

#: Every cause of the diagnosis spec is a scenario; one line each for ``--list``.
SCENARIOS: dict[str, str] = {
    "gpu_xid": "an Xid 79 (GPU fell off the bus) on one node; the loss goes NaN (the default)",
    "gpu_ecc": "uncorrectable ECC errors grow on one GPU, with a memory Xid",
    "ib_link_flap": "an InfiniBand port flaps on one node (link_downed grows)",
    "thermal_throttle": "a GPU throttles for temperature: slow, not divergent",
    "nccl_error": "NCCL watchdog timeouts and IB completion errors; every rank jumps together",
    "network_congestion": "pause frames and discards rise on the NICs during the spike",
    "nccl_version_mismatch": "one node runs a different NCCL version than the rest of the job",
    "collective_hang": "one rank never enters a collective: the job hangs; its flight recorder names the rank",
    "collective_mismatch": "one node's ranks issue another collective than the rest: a hang, a software fault",
    "overlong_sample": "a sample far beyond max_length in the spike step's batch",
    "corrupted_sample": "empty samples in the spike step's batch",
    "rng_not_restored": "after a resume the data order differs (RNG not restored); the loss creeps up",
    "rank_data_misalignment": "one rank's loss departs from its peers, with no hardware fault",
    "grad_explosion": "the grad norm climbs for steps before the loss spikes",
    "lr_too_high": "the loss jumps at the LR peak and does not recover",
    "loss_scale_collapse": "the fp16 loss scale falls by orders of magnitude",
    "corrupted_checkpoint": "the run resumed from a checkpoint that fails its checksums",
    "false_alarm": "an alert fires but the metrics show nothing anomalous",
    # the replay gate, on a real training job (examples/train_tiny.py, one process per node)
    "sdc_persistent": "a GPU silently corrupts its matmuls from one step on; the replay gate convicts its node",
    "sdc_transient": "a GPU flips one bit once; the replay gate finds nothing that comes back (transient)",
    "replay_data": "an overlong sample, no faulty GPU; the replay gate reproduces it everywhere and acquits the GPUs",
}
#: Scenarios played by a real training job whose spike the replay gate re-executes.
REPLAY_SCENARIOS = ("sdc_persistent", "sdc_transient", "replay_data")
#: The real job's size: 3 processes (one per node), 24 steps, a checkpoint every 10, the fault at 23.
_REAL_NODES, _REAL_STEPS, _REAL_FAULT = 3, 24, 23

#: The demo's loopback range; ports are picked free, so two demos can run side by side.
FIRST_ADDRESS = "127.0.60.11"


#: Seeds whose story is the one ``SCENARIOS`` tells at the default 8 nodes (gpu_xid: an Xid 79
#: with a NaN; other seeds give an Xid 74 or 120 and a spike). Others use 3.
_SEEDS = {"gpu_xid": 10}


def default_seed(scenario: str) -> int:
    """A fixed seed per scenario, so ``spikeops demo`` tells the same story every time."""
    return _SEEDS.get(scenario, 3)


@dataclass
class DemoOptions:
    scenario: str = "gpu_xid"
    nodes: int = 8
    seed: int | None = None
    keep: bool = False
    directory: Path | None = None
    scheduler: str = "auto"  # auto | slurm | local
    rate: float = 60.0
    approval: str = "auto-hardware"
    monitoring: str = "watcher"  # watcher | prometheus


@dataclass
class DemoResult:
    directory: Path
    scheduler: str
    fired_by: str = ""
    anomaly: dict[str, Any] | None = None
    diagnosis: dict[str, Any] = field(default_factory=dict)
    outcome: dict[str, Any] = field(default_factory=dict)
    resumed: dict[str, Any] | None = None
    seconds: float = 0.0
    paths: dict[str, str] = field(default_factory=dict)


class _Printer:
    def __init__(self, out: TextIO) -> None:
        self.out, self.start, self.lock = out, time.monotonic(), threading.Lock()

    def __call__(self, text: str) -> None:
        with self.lock:
            self.out.write(f"[{time.monotonic() - self.start:5.1f}s] {text}\n")
            self.out.flush()


def _follow_outbox(path: Path, say: Callable[[str], None], stop: threading.Event) -> None:
    """Print each Slack message the flow writes, as it is written."""
    offset = 0
    while True:
        finished = stop.is_set()
        if path.is_file():
            with path.open("rb") as handle:
                handle.seek(offset)
                chunk = handle.read()
            complete = chunk.rfind(b"\n") + 1
            offset += complete
            for line in chunk[:complete].splitlines():
                try:
                    record = json.loads(line)
                except ValueError:
                    continue
                method = str(record.get("method") or "")
                how = " (edits the first message)" if method == "chat.update" else \
                    " (file)" if method.startswith("files") else ""
                text = " ".join(str(record.get("text") or record.get("title") or "").split())
                say(f"slack{how}: {text[:200]}{'...' if len(text) > 200 else ''}")
        if finished:
            return
        stop.wait(0.2)


def _approver(say: Callable[[str], None], stop: threading.Event) -> None:
    """Answer the flow's approval page as a person would, once it pauses."""
    from prefect import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterState, FlowRunFilterStateType
    from prefect.flow_runs import resume_flow_run

    answered: set[str] = set()
    while not stop.wait(0.5):
        try:
            with get_client(sync_client=True) as client:
                paused = client.read_flow_runs(flow_run_filter=FlowRunFilter(
                    state=FlowRunFilterState(type=FlowRunFilterStateType(any_=["PAUSED"]))))
            for run in paused:
                if str(run.id) in answered:
                    continue
                say("approval: the flow waits for a person; the demo approves as 'demo-operator'")
                time.sleep(1.0)  # long enough to be seen in the UI
                resume_flow_run(run.id, run_input={"approve": True, "approver": "demo-operator",
                                                   "note": "approved by spikeops demo"})
                answered.add(str(run.id))
        except Exception:  # the API may be busy; the next poll retries
            continue


def _watch(metrics: Path, last_step: int, say: Callable[[str], None], found: list[Any],
           stop: threading.Event, timeout: float, short: bool = False, story_end: float | None = None) -> None:
    from spikeops.watch.detect import Detector, WatchConfig
    from spikeops.watch.sources import follow_log, follow_metrics

    # a 24-step job has no warmup to wait out: judge from its tenth step
    detector = Detector(WatchConfig(warmup_steps=10, min_history=10) if short else WatchConfig())
    follow = follow_metrics if metrics.name.endswith(".jsonl") else follow_log
    for record in follow(metrics, from_start=True, stop=stop.is_set, timeout=timeout, poll_s=0.1):
        anomaly = detector.feed(record)
        if anomaly is not None:
            found.append(anomaly)
            return
        if detector.last_step is not None and detector.last_step >= last_step:
            # the replayed job stops logging here: the silence the watcher would see until the
            # scenario's alert (its steps carry the scenario's own times) is a stall or not
            stalled = detector.tick(story_end) if story_end is not None else None
            if stalled is not None:
                found.append(stalled)
            return


#: The monitoring modes of ``--monitoring``.
MONITORING = ("watcher", "prometheus")
#: With Prometheus: how long after the job's last write the demo waits for a rule to fire.
_QUIET_S = 10.0


class _AlertInbox:
    """The real receiver (``spikeops.deployments.receiver.create_app``, under uvicorn on loopback) whose
    starter hands each firing alert of the demo's job to the demo, which runs the flow itself
    (its printer and approver follow it there); an alert for another job is refused (400)."""

    def __init__(self, stack: ExitStack) -> None:
        import queue

        import uvicorn

        from spikeops.deployments.receiver import ReceiverConfig, create_app

        self.job: str | None = None
        self.alerts: queue.Queue[Any] = queue.Queue()
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}/alerts/alertmanager"
        app = create_app(self._start, ReceiverConfig(token=None, hmac_key=None))
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="error"))
        thread = threading.Thread(target=self.server.run, name="demo-receiver", daemon=True)
        thread.start()
        stack.callback(self._stop, thread)
        deadline = time.monotonic() + 30
        while not self.server.started:
            if not thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"the demo's receiver did not start on 127.0.0.1:{self.port}")
            time.sleep(0.02)

    def _start(self, alert: Any, key: str) -> str:
        from spikeops.errors import InputError

        if alert.job != self.job:
            raise InputError(f"job {alert.job} is not the demo's job {self.job}")
        self.alerts.put(alert)
        return f"demo:{key}"

    def _stop(self, thread: threading.Thread) -> None:
        self.server.should_exit = True
        thread.join(5)


def _start_monitoring(directory: Path, inbox: _AlertInbox, exporter: str, stack: ExitStack,
                      say: Callable[[str], None], keep: bool) -> None:
    from spikeops.sim import monitoring

    chain = monitoring.up(directory / "monitoring", receiver=inbox.url, targets=[exporter])
    if not keep:
        stack.callback(monitoring.down, directory / "monitoring")
    say(f"prometheus: {chain.prometheus_url} scrapes the job's exporter at {exporter} every "
        f"{chain.scrape_interval} and evaluates infra/monitoring/prometheus-rules.yml every {chain.evaluation_interval}"
        f" (NaN, spike, loss-scale collapse, throughput drop)")
    say(f"alertmanager: {chain.alertmanager_url} routes them to the receiver at {inbox.url}")


def _await_alert(inbox: _AlertInbox, followed: Path, say: Callable[[str], None], found: list[Any],
                 stop: threading.Event, timeout: float) -> None:
    """The first alert the receiver hands over; none once the job has written nothing for
    ``_QUIET_S`` seconds (its replay is over) or after ``timeout``."""
    import queue

    deadline = time.monotonic() + timeout
    size, quiet_since = -1, time.monotonic()
    while time.monotonic() < deadline and not stop.is_set():
        try:
            alert = inbox.alerts.get(timeout=0.2)
        except queue.Empty:
            alert = None
        if alert is not None:
            say(f"alertmanager -> receiver: {alert.name} firing for job {alert.job} (since {alert.starts_at})")
            found.append(alert)
            return
        now_size = followed.stat().st_size if followed.is_file() else -1
        if now_size != size:
            size, quiet_since = now_size, time.monotonic()
        elif size >= 0 and time.monotonic() - quiet_since > _QUIET_S:
            return


def _story_end(scenario: Path) -> float | None:
    """When the scenario's alert fired (its incident's window end), in its own clock."""
    from spikeops.timeparse import parse_any

    window = json.loads((scenario / "incident.json").read_text()).get("window") or {}
    moment = parse_any(window.get("end"))
    return moment.timestamp() if moment is not None else None


def _last_step(scenario: Path) -> int:
    """The last step the job will log: the watcher stops there."""
    from spikeops.probes.training_log import parse, parse_metrics_jsonl

    metrics = scenario / "metrics.jsonl"
    log = parse_metrics_jsonl(metrics.read_text(errors="replace")) if metrics.is_file() else \
        parse((scenario / "train.log").read_text(errors="replace"))
    return max((r.step for r in log.records if r.step is not None), default=-1)


def _slurm_available() -> bool:
    from spikeops.sim import slurmcluster

    return slurmcluster.missing() is None


def run_demo(options: DemoOptions, out: TextIO = sys.stdout) -> DemoResult:
    from spikeops.sim import CAUSES
    from spikeops.sim import cluster as simcluster
    from spikeops.sim.trainjob import lay_checkpoints, seed_baselines

    from spikeops.errors import InputError

    if options.scenario not in CAUSES and options.scenario not in REPLAY_SCENARIOS:
        raise InputError(f"unknown scenario {options.scenario!r}; `spikeops demo --list` shows them")
    if not 2 <= options.nodes <= 64:
        raise InputError("--nodes: between 2 and 64")
    if options.monitoring not in MONITORING:
        raise InputError(f"--monitoring: one of {', '.join(MONITORING)}")
    if options.monitoring == "prometheus":
        from spikeops.sim import monitoring

        why_not = monitoring.missing()
        if why_not is not None:
            raise InputError(f"--monitoring prometheus: {why_not}")
    say = _Printer(out)
    directory = Path(options.directory or tempfile.mkdtemp(prefix="spikeops-demo-")).resolve()
    directory.mkdir(parents=True, exist_ok=True)
    seed = options.seed if options.seed is not None else default_seed(options.scenario)
    use_slurm = options.scheduler == "slurm" or (options.scheduler == "auto" and _slurm_available())
    result = DemoResult(directory=directory, scheduler="slurm" if use_slurm else "local")
    say(f"spikeops demo: scenario {options.scenario} ({SCENARIOS.get(options.scenario, '')}), "
        f"{_REAL_NODES if options.scenario in REPLAY_SCENARIOS else options.nodes} nodes, in {directory}")
    quiet_prefect_environment(directory)
    prefect_server = PrefectServer(directory / "prefect" / "demo.db")
    # The flow's modules (Prefect's engine, the diagnosis, pandas) load while the cluster starts,
    # not after the anomaly: seconds of imports off the incident's own time.
    threading.Thread(target=preload, name="demo-preload", daemon=True).start()
    stop = threading.Event()
    with ExitStack() as stack:
        stack.callback(prefect_server.stop)
        port = simcluster.free_port((FIRST_ADDRESS,))
        real = options.scenario in REPLAY_SCENARIOS
        nodes = _REAL_NODES if real else options.nodes
        # a real job's nodes show healthy hardware: what convicts or acquits them is the replay
        cluster = simcluster.up(directory / "cluster", nodes=nodes, scenario="false_alarm" if real else
                                options.scenario, seed=seed, port=port, first_address=FIRST_ADDRESS)
        if not options.keep:
            stack.callback(simcluster.down, directory / "cluster")
        say(f"cluster: {len(cluster.nodes)} nodes, each a real sshd on loopback "
            f"({FIRST_ADDRESS} and up, port {port}), strict host keys")
        scenario = cluster.scenario_bundle
        run_dir = directory / "run"
        if real:
            job_argv, checkpoint_root, last_step = _real_job(options.scenario, cluster.nodes, run_dir, say)
        else:
            checkpoint_root = directory / "ckpt"
            checkpoints = lay_checkpoints(checkpoint_root, scenario)
            say(f"checkpoints: {len(checkpoints)} with manifests under {checkpoint_root}")
            seeded = seed_baselines(directory / "baselines", scenario)
            say(f"baselines: {len(seeded)} nodes' counters from before the incident, in {directory / 'baselines'} "
                "(what the scheduled refresh keeps)")
            job_argv = [sys.executable, "-m", "spikeops.sim.trainjob", "--scenario", str(scenario), "--run-dir",
                        str(run_dir), "--checkpoint-root", str(checkpoint_root), "--rate", str(options.rate)]
            last_step = _last_step(scenario)
        inbox = None
        if options.monitoring == "prometheus":
            inbox = _AlertInbox(stack)
            exporter = f"127.0.0.1:{free_port()}"
            job_argv += ["--metrics-addr", exporter, "--cluster", "demo"]
        scheduler, job, scheduler_params = _start_job(options, directory, cluster.nodes, job_argv, stack, say,
                                                      use_slurm, spares=len(cluster.nodes) if real else 1)
        if not options.keep:  # also when the demo fails half-way: no job outlives it
            stack.callback(_stop_jobs, scheduler, use_slurm)
        if not real:
            _link_job_logs(directory / "cluster", scenario, job)
        found: list[Any] = []
        followed = run_dir / ("metrics.jsonl" if real or (scenario / "metrics.jsonl").is_file() else "train.log")
        if inbox is not None:
            inbox.job = job
            watcher = threading.Thread(target=_await_alert, args=(inbox, followed, say, found, stop, 120.0),
                                       name="demo-alerts", daemon=True)
            _start_monitoring(directory, inbox, exporter, stack, say, options.keep)
        else:
            watcher = threading.Thread(target=_watch, args=(followed, last_step, say, found, stop, 300.0, real,
                                                            None if real else _story_end(scenario)),
                                       name="demo-watch", daemon=True)
            say(f"watcher: following {followed} (NaN, robust-z spikes of loss and grad norm, "
                "loss-scale collapse, throughput drop, a stalled step counter)")
        watcher.start()
        api = prefect_server.ready()
        say(f"prefect: ephemeral server at {api} (database in {directory / 'prefect'}"
            + (", from the cached migrated one)" if prefect_server.templated else ")"))
        watcher.join()
        if found and inbox is not None:
            alert = found[0]
            result.fired_by = "prometheus"
            result.anomaly = {"kind": alert.name, "step": None, "detail": f"{alert.name} firing for job {alert.job} "
                              f"since {alert.starts_at}", "labels": alert.labels}
            say(f"prometheus: {alert.name} -> starting the incident flow")
        elif found:
            anomaly = found[0]
            result.fired_by = "watcher"
            result.anomaly = {"kind": anomaly.kind, "step": anomaly.step, "detail": anomaly.detail}
            say(f"watcher: {anomaly.kind} at step {anomaly.step}: {anomaly.detail} -> starting the incident flow")
        elif inbox is not None:
            result.fired_by = "alert"
            say(f"prometheus: no rule fired within {_QUIET_S:.0f} s of the job's last step (a spike shorter than "
                "the rule's `for`, a job that logs only text); the scenario's alert fires anyway -> starting the "
                "incident flow")
        else:
            result.fired_by = "alert"
            say("watcher: no NaN, spike, loss-scale collapse or throughput drop in the metrics; the scenario's "
                "alert fires anyway, as an Alertmanager rule would -> starting the incident flow")
        if real:  # the replays start from the job's checkpoints: let it finish writing them
            _wait_job(scheduler, job, use_slurm, 300.0)
        result.outcome = _run_flow(options, directory, cluster, job, run_dir, scheduler_params, result, say, api,
                                   stack, checkpoint_root=checkpoint_root, replay=real)
        drain_prefect()  # while its server is up: at exit they would wait on a server already gone
        result.diagnosis = json.loads((Path(result.outcome["bundle"]) / "diagnosis.json").read_text())
        result.resumed = None if real else _resumed_run(run_dir, result.outcome)
        _summarise(result, say)
        if options.keep:
            say(f"--keep: the cluster and jobs stay up; stop them with: spikeops demo --stop {directory}")
    stop.set()
    result.seconds = time.monotonic() - say.start
    if not options.keep:
        say(f"stopped everything (cluster, scheduler, jobs, Prefect server) in {result.seconds:.1f} s total; "
            f"the files stay in {directory}")
    return result


def _job_environment(extra: dict[str, str] | None = None) -> dict[str, str]:
    """What the demo's training job is submitted with: a user's plain environment, not the
    demo's (a SLACK_BOT_TOKEN or Prefect setting of the shell that runs the demo must not
    reach the job, nor come back with its resume)."""
    from spikeops.schedulers.jobenv import command_env

    return {**command_env(os.environ), **(extra or {})}


def _real_job(scenario: str, nodes: list[str], run_dir: Path, say: Callable[[str], None]
              ) -> tuple[list[str], Path, int]:
    """A real PyTorch job (examples/train_tiny.py, gloo on CPU, one process per node) with the
    scenario's fault; its checkpoints (with manifests) are its own."""
    example = Path(__file__).resolve().parents[1] / "examples" / "train_tiny.py"
    if not example.is_file():  # an installed spikeops: the example job lives in the repository
        raise RuntimeError(f"the {scenario} scenario runs examples/train_tiny.py from a spikeops checkout; "
                           "this installation has none (the other scenarios need no checkout)")
    bad = nodes[1]
    fault = {"sdc_persistent": ["--inject-flip", bad, "--flip-from", str(_REAL_FAULT)],
             "sdc_transient": ["--inject-flip", bad, "--flip-from", str(_REAL_FAULT), "--flip-once"],
             "replay_data": ["--inject-overlong", str(_REAL_FAULT), "--inject-rank", "1"]}[scenario]
    argv = [sys.executable, str(example), "--out", str(run_dir), "--launch", "--steps", str(_REAL_STEPS),
            "--ckpt-every", "10", *fault]
    what = {"sdc_persistent": f"{bad}'s GPU flips a bit in its matmuls from step {_REAL_FAULT} on",
            "sdc_transient": f"{bad}'s GPU flips one bit at step {_REAL_FAULT}, once",
            "replay_data": f"rank 1 gets a sample 50x max_length long at step {_REAL_FAULT}"}[scenario]
    say(f"job: examples/train_tiny.py, {len(nodes)} processes (one per node, gloo), {_REAL_STEPS} steps, "
        f"checkpoints every 10 under {run_dir / 'ckpt'}; the fault: {what}")
    return argv, run_dir / "ckpt", _REAL_STEPS


def _wait_job(scheduler: Any, job: str, use_slurm: bool, seconds: float) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        info = scheduler.show_job(job)
        state = (info[0] if isinstance(info, tuple) else info).state.split()[0]
        if state not in ("RUNNING", "PENDING", "CONFIGURING", "COMPLETING"):
            return
        time.sleep(0.5)


def _start_job(options: DemoOptions, directory: Path, nodes: list[str], argv: list[str], stack: ExitStack,
               say: Callable[[str], None], use_slurm: bool, spares: int = 1) -> tuple[Any, str, dict[str, Any]]:
    if use_slurm:
        from spikeops.schedulers import SlurmScheduler
        from spikeops.schedulers.base import LocalRunner
        from spikeops.sim import slurmcluster

        names = list(nodes) + [f"spare-{i:03d}" for i in range(1, spares + 1)]
        slurm = slurmcluster.up(directory / "slurm", names=names)
        if not options.keep:
            stack.callback(slurmcluster.down, directory / "slurm")
        os.environ.update(slurm.env)
        scheduler = SlurmScheduler(LocalRunner())
        script = directory / "job.sh"
        # a job that starts its own processes per node learns its nodes from Slurm
        script.write_text("#!/bin/sh\nexport SPIKEOPS_JOB_NODES=\"${SPIKEOPS_JOB_NODES:-$SLURM_JOB_NODELIST}\"\n"
                          "exec " + shlex.join(argv) + "\n")
        import subprocess

        submitted = subprocess.run(["sbatch", "--parsable", "-N", str(len(nodes)), "-w", ",".join(nodes),
                                    "--job-name=demo-train", f"--chdir={directory}",
                                    f"--output={directory / 'slurm-%j.out'}", str(script)],
                                   capture_output=True, text=True, env=_job_environment(slurm.env), timeout=30)
        if submitted.returncode != 0:
            raise RuntimeError(f"sbatch: {submitted.stderr.strip()}")
        job = submitted.stdout.strip().split(";")[0]
        say(f"scheduler: real Slurm (slurmctld + {len(names)} slurmd); training job {job} on "
            f"{len(nodes)} nodes, {spares} spare(s)")
        return scheduler, job, {"scheduler": "slurm"}
    from spikeops.schedulers import LocalScheduler

    scheduler = LocalScheduler(directory / "sched")
    scheduler.add_nodes(list(nodes) + [f"spare-{i:03d}" for i in range(1, spares + 1)])
    job = scheduler.submit(argv, nodes, cwd=str(directory), environment=_job_environment())
    say(f"scheduler: local processes (Slurm is not installed here); training job {job} on {len(nodes)} nodes, "
        f"{spares} spare(s)")
    return scheduler, job, {"scheduler": "local", "scheduler_state_dir": str(directory / "sched")}


def _link_job_logs(cluster_dir: Path, scenario: Path, job: str) -> None:
    """The nodes keep the scenario's job logs (NCCL, training) under its own job id; the
    demo's job has another id, so its log directory on the nodes is a link to them."""
    original = str(json.loads((scenario / "incident.json").read_text())["job"]["id"])
    target = cluster_dir / "jobs" / job
    if original != job and (cluster_dir / "jobs" / original).is_dir() and not target.exists():
        target.symlink_to(cluster_dir / "jobs" / original, target_is_directory=True)


def _run_flow(options: DemoOptions, directory: Path, cluster: Any, job: str, run_dir: Path,
              scheduler_params: dict[str, Any], result: DemoResult, say: Callable[[str], None], api: str,
              stack: ExitStack, *, checkpoint_root: Path, replay: bool = False) -> dict[str, Any]:
    from prefect.settings import PREFECT_API_URL, temporary_settings

    from spikeops.flows.incident_response import IncidentOverrides, incident_response

    incident = f"inc-demo-{options.scenario.replace('_', '-')}"
    overrides = IncidentOverrides(
        inventory=str(cluster.inventory), run_dir=str(run_dir),
        checkpoint_root=str(checkpoint_root), incidents_dir=str(directory / "incidents"), incident_id=incident,
        baseline_dir=None if replay else str(directory / "baselines"), approval=options.approval,
        approval_timeout_s=120, replay="auto" if replay else "never", replay_steps=100, replay_timeout_s=300,
        observe_steps=50, observe_timeout_s=3,
        alert={"source": "spikeops-watch" if result.fired_by == "watcher" else "alertmanager",
               "received": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
               "payload": {"scenario": options.scenario, **(result.anomaly or {})}},
        **scheduler_params,
    )
    bundle = directory / "incidents" / incident
    stop = threading.Event()
    printer = threading.Thread(target=_follow_outbox, args=(bundle / "outbox.jsonl", say, stop), daemon=True)
    approver_stop = threading.Event()
    with temporary_settings(updates={PREFECT_API_URL: api}):
        approver = threading.Thread(target=_approver, args=(say, approver_stop), daemon=True)
        printer.start()
        approver.start()
        try:
            outcome = incident_response(job, overrides=overrides)
        finally:
            approver_stop.set()
            stop.set()
            printer.join(5)
    return outcome


def _resumed_run(run_dir: Path, outcome: dict[str, Any]) -> dict[str, Any] | None:
    if (outcome.get("resumed") or {}).get("outcome") != "done":
        return None
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        try:
            return json.loads((run_dir / "resumed.json").read_text())
        except (OSError, ValueError):
            time.sleep(0.1)
    return None


def _summarise(result: DemoResult, say: Callable[[str], None]) -> None:
    from spikeops.inventory import fold_nodes

    diagnosis, outcome = result.diagnosis, result.outcome
    primary = diagnosis.get("primary") or {}
    say(f"DIAGNOSIS: {primary.get('cause')} ({primary.get('layer')} layer, confidence {primary.get('confidence')}); "
        f"symptom {diagnosis.get('symptom')}, spike step {diagnosis.get('spike_step')}, "
        f"onset step {diagnosis.get('onset_step')}")
    culprits = diagnosis.get("culprit_nodes") or []
    say(f"  culprit nodes: {fold_nodes(culprits) if culprits else 'none'}")
    for finding in (diagnosis.get("findings") or [])[:1]:
        say(f"  why: {finding.get('summary')}")
        for evidence in (finding.get("evidence") or [])[:3]:
            where = evidence.get("file") + ("" if evidence.get("line") is None else f":{evidence['line']}")
            say(f"    {where}: {str(evidence.get('text'))[:120]}")
    for ruled in (diagnosis.get("ruled_out") or [])[:2]:
        say(f"  ruled out ({ruled.get('layer')}): {ruled.get('why')}")
    acted = [a for a in outcome.get("actions") or [] if a.get("outcome") in ("done", "dry-run")]
    say("DONE: " + ("; ".join(f"{a['action']} {a['target']}: {a.get('detail') or a['outcome']}" for a in acted)
                    if acted else "nothing changed on the cluster"))
    say(f"  outcome: {outcome.get('summary')}")
    if result.resumed:
        say(f"  resumed run: from {result.resumed.get('checkpoint')} on {result.resumed.get('nodes')}; "
            f"remediation: {result.resumed.get('remediation')}")
    bundle = Path(outcome["bundle"])
    result.paths = {name: str(bundle / name) for name in ("report.md", "report.html", "plot.png", "outbox.jsonl",
                                                          "diagnosis.json") if (bundle / name).exists()}
    say(f"FILES: bundle {bundle}")
    for name, path in result.paths.items():
        say(f"  {name:<14} {path}")


def _stop_jobs(scheduler: Any, use_slurm: bool) -> None:
    """Every job the demo's scheduler still runs (the resumed one included)."""
    if use_slurm:
        return  # slurmcluster.down stops slurmd, and with it every job step
    for job in scheduler.jobs():
        if job.state == "RUNNING":
            scheduler.stop(job.job_id, grace=0.5)


def stop_demo(directory: str | Path) -> list[str]:
    """Stop what a ``--keep`` demo left running in ``directory``; what was stopped."""
    from spikeops.schedulers import LocalScheduler
    from spikeops.sim import cluster as simcluster

    from spikeops.errors import InputError

    root = Path(directory)
    if not (root / "cluster").is_dir():
        raise InputError(f"{root}: not a spikeops demo directory")
    stopped = []
    if (root / "sched").is_dir():
        scheduler = LocalScheduler(root / "sched")
        for job in scheduler.jobs():
            if job.state == "RUNNING":
                scheduler.stop(job.job_id, grace=0.5)
                stopped.append(f"job {job.job_id}")
    if (root / "monitoring" / "cluster.json").is_file():
        from spikeops.sim import monitoring

        monitoring.down(root / "monitoring")
        stopped.append("monitoring")
    if (root / "slurm").is_dir():
        from spikeops.sim import slurmcluster

        slurmcluster.down(root / "slurm")
        stopped.append("slurm")
    simcluster.down(root / "cluster")
    stopped.append("cluster")
    return stopped
