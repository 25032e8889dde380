"""Collecting a job's evidence from every node into an incident bundle.

The fan-out is a bounded thread pool (``[ssh] fanout``), one SSH connection per node, and
every wait in it has a bound: connect, banner and auth by ``connect_timeout``, each probe by
its own timeout, the node by the sum of its probe waves. A node that fails in any way is
recorded as data in its ``probes.json`` and in the summary; it never fails the collection
or delays the other nodes' evidence beyond those bounds.

On each connection the probes run in one SSH session (``spikeops.collect.single``, the
default) or in a session each (``spikeops.collect.runner``, ``[ssh] sessions = "per-probe"``);
a node that cannot run the single-session runner falls back to a session per probe. Both
write the same files; collection.json says which way each node went.

``collect_nodes`` is the unit the Prefect shard tasks call with a slice of the nodes; the
``collect`` entry point adds what a whole run needs (the bundle's incident.json, the
refusal to overwrite evidence, the record of the collection).
"""

from __future__ import annotations

import json
import math
import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from spikeops.bundle import BundleWriter, atomic_write
from spikeops.collect import openssh
from spikeops.collect.plan import PlannedProbe, check_job_id, plan_interfaces, plan_probes
from spikeops.collect.runner import ProbeRun, run_probes
from spikeops.collect.single import SINGLE_GRACE, run_single
from spikeops.collect.ssh import ConnectFailure, Connector
from spikeops.errors import InputError
from spikeops.inventory import Inventory, Target, fold_nodes, resolve_targets
from spikeops.probes.bundle_files import ProbeStatus
from spikeops.timeparse import iso

__all__ = [
    "NodeResult",
    "CollectResult",
    "collect",
    "collect_nodes",
    "prepare_bundle",
    "record_collection",
    "shard_nodes",
    "OUTCOMES",
    "COLLECTION_FILE",
]

#: Summary buckets, in the order the summary prints them.
OUTCOMES = ("ok", "timeout", "unreachable", "refused")
OUTCOME_LABELS = {"ok": "ok", "timeout": "timed out", "unreachable": "unreachable", "refused": "refused"}
#: A record of the collection itself, beside the evidence (docs/bundle.md).
COLLECTION_FILE = "collection.json"
#: How far back the window of an incident created by ``collect`` reaches.
DEFAULT_WINDOW = timedelta(minutes=30)


@dataclass
class NodeResult:
    node: str
    outcome: str
    detail: str | None
    seconds: float
    probes: list[ProbeRun] = field(default_factory=list)
    address: str | None = None
    #: "single", "per-probe", or "per-probe (fallback: why)"; None when never connected.
    sessions: str | None = None
    #: The SSH client: "paramiko", or "openssh" (``[ssh] client``).
    client: str | None = None

    def problems(self) -> list[str]:
        """One phrase per probe that did not simply succeed."""
        out = []
        for run in self.probes:
            if run.error is None:
                continue
            if run.missing_tool:
                out.append(f"{run.name}: not installed")
            elif run.error == "timeout":
                out.append(f"{run.name}: timed out after {run.seconds or 0:.0f} s")
            elif run.error == "output-truncated":
                out.append(f"{run.name}: output cut at {run.stdout_bytes / 1048576:.0f} MiB")
            else:
                first = run.stderr.decode("utf-8", "replace").strip().splitlines()[:1]
                how = "no output" if run.exit == 0 else f"exit {run.exit}" if run.exit is not None else "failed"
                out.append(f"{run.name}: {how}" + (f" ({first[0][:140]})" if first else ""))
        return out

    def to_json(self) -> dict[str, Any]:
        return {
            "node": self.node, "address": self.address, "outcome": self.outcome, "detail": self.detail,
            "seconds": round(self.seconds, 3), "sessions": self.sessions, "client": self.client,
            "probes": {run.name: {"exit": run.exit, "error": run.error, "seconds": run.seconds,
                                  "bytes": run.stdout_bytes} for run in self.probes},
        }


@dataclass
class CollectResult:
    bundle: Path
    job: str
    baseline: bool
    seconds: float
    nodes: list[NodeResult]

    def buckets(self) -> dict[str, list[str]]:
        out: dict[str, list[str]] = {outcome: [] for outcome in OUTCOMES}
        for result in self.nodes:
            out.setdefault(result.outcome, []).append(result.node)
        return out

    def summary_lines(self) -> list[str]:
        """Folded node sets per outcome, then the per-probe problems grouped the same way."""
        lines = [f"collected {len(self.nodes)} node(s) of job {self.job} in {self.seconds:.1f} s "
                 f"into {self.bundle}" + (" (baseline)" if self.baseline else "")]
        for outcome, nodes in self.buckets().items():
            if nodes:
                lines.append(f"  {OUTCOME_LABELS.get(outcome, outcome):12} {len(nodes):5}  {fold_nodes(nodes)}")
        connect: dict[str, list[str]] = {}
        probe_problems: dict[str, list[str]] = {}
        for result in self.nodes:
            if result.outcome != "ok" and result.detail and not result.probes:
                connect.setdefault(result.detail, []).append(result.node)
            for problem in result.problems():
                # "grep: /logs/4412/gpu-007/*.out: No such file" is the same on every node
                probe_problems.setdefault(problem.replace(result.node, "<node>"), []).append(result.node)
        for detail, nodes in sorted(connect.items()):
            lines.append(f"  {fold_nodes(nodes)}: {detail}")
        for problem, nodes in sorted(probe_problems.items()):
            lines.append(f"  {fold_nodes(nodes)}: {problem}")
        return lines

    def to_json(self) -> dict[str, Any]:
        return {
            "bundle": str(self.bundle), "job": self.job, "baseline": self.baseline,
            "seconds": round(self.seconds, 3),
            "summary": {outcome: fold_nodes(nodes) for outcome, nodes in self.buckets().items()},
            "nodes": [result.to_json() for result in self.nodes],
        }


# ------------------------------------------------------------------------------- one node


def _write_stderr(writer: BundleWriter, node: str, run: ProbeRun, baseline: bool) -> None:
    if not run.stderr:
        return
    stem = Path(run.filename).stem if run.filename else run.name
    atomic_write(writer.node_folder(node, baseline=baseline) / f"{stem}.err", run.stderr)


def _statuses(runs: Iterable[ProbeRun]) -> list[ProbeStatus]:
    return [ProbeStatus(run.name, run.command, run.exit, run.started, run.seconds, run.error) for run in runs]


def _node_budget(inventory: Inventory, probes: list[PlannedProbe]) -> float:
    """The most a reachable node may take: its probes in waves of ``sessions_per_node``,
    each bounded by its own timeout, plus the interface listing and its ethtool wave (and a
    runner that never says hello before the fall back to a session per probe)."""
    longest = max((probe.timeout for probe in probes), default=inventory.ssh.command_timeout)
    waves = math.ceil((len(probes) + 1) / inventory.ssh.sessions_per_node) + 1
    return waves * (longest + SINGLE_GRACE) + 3 * inventory.ssh.connect_timeout


def _plan_order(runs: list[ProbeRun], probes: list[PlannedProbe]) -> list[ProbeRun]:
    """Runs in the order the probes were planned (the per-interface ones after, by name),
    whatever order they finished in, so probes.json reads the same from one collection (and
    one session mode) to the next."""
    rank = {probe.name: index for index, probe in enumerate(probes)}
    return sorted(runs, key=lambda run: (rank.get(run.name, len(rank)), "" if run.name in rank else run.name))


def _common(inventory: Inventory, deadline: float) -> dict[str, Any]:
    ssh = inventory.ssh
    return dict(sessions=ssh.sessions_per_node, expand_interfaces=lambda names: plan_interfaces(inventory, names),
                node_deadline=deadline, discovery_timeout=ssh.command_timeout)


def _per_probe(inventory: Inventory, transport: Any, probes: list[PlannedProbe],
               open_sink: Callable[[PlannedProbe], Any], deadline: float) -> tuple[list[ProbeRun], str | None]:
    runs = run_probes(transport, probes, open_sink, channel_timeout=inventory.ssh.connect_timeout,
                      **_common(inventory, deadline))
    return runs, None if transport.is_active() else "the SSH connection was lost"


def _run_paramiko(inventory: Inventory, target: Target, probes: list[PlannedProbe],
                  open_sink: Callable[[PlannedProbe], Any], deadline: float, connector: Connector,
                  live: dict[str, Any], clear: Callable[[], None]) -> tuple[list[ProbeRun], str, str | None]:
    """The probes' runs over paramiko, the session mode used, and why the connection was lost
    (if it was); ConnectFailure when the node was not reached."""
    ssh = inventory.ssh
    client = connector.connect(target)
    live[target.node] = client
    try:
        clear()
        transport = client.get_transport()
        mode = ssh.sessions
        if mode == "single":
            single = run_single(transport, probes, open_sink, spool=[ssh.spool_dir] if ssh.spool_dir else None,
                                channel_timeout=ssh.connect_timeout, **_common(inventory, deadline))
            if single.fallback is None:
                return single.runs, mode, single.lost
            mode = f"per-probe (fallback: {single.fallback})"
        runs, lost = _per_probe(inventory, transport, probes, open_sink, deadline)
        return runs, mode, lost
    finally:
        live.pop(target.node, None)
        client.close()


def _run_openssh(inventory: Inventory, target: Target, probes: list[PlannedProbe],
                 open_sink: Callable[[PlannedProbe], Any], deadline: float, connector: Connector,
                 live: dict[str, Any], clear: Callable[[], None]) -> tuple[list[ProbeRun], str, str | None]:
    """The same through an OpenSSH client process; a node that cannot run the runner is
    collected with a session per probe over paramiko."""
    ssh = inventory.ssh
    clear()
    try:
        single = openssh.run_node(target, probes, open_sink, connect_timeout=ssh.connect_timeout,
                                  spool=[ssh.spool_dir] if ssh.spool_dir else None, config=ssh.config,
                                  started=lambda conduit: live.__setitem__(target.node, conduit),
                                  **_common(inventory, deadline))
    finally:
        live.pop(target.node, None)
    if single.fallback is None:
        return single.runs, "single", single.lost
    client = connector.connect(target)
    live[target.node] = client
    try:
        runs, lost = _per_probe(inventory, client.get_transport(), probes, open_sink, deadline)
        return runs, f"per-probe (fallback: {single.fallback})", lost
    finally:
        live.pop(target.node, None)
        client.close()


def _unpack(writer: BundleWriter, node: str, runs: list[ProbeRun], probes: list[PlannedProbe],
            baseline: bool) -> None:
    """Probes that print a tar archive (flight recorder dumps, stacks): unpacked into their
    folder; an archive that could not be read to its end keeps the files before the cut,
    and says why in the probe's stderr (and ``output-truncated`` when nothing else was)."""
    archives = {probe.name: probe for probe in probes if probe.unpack}
    for run in runs:
        probe = archives.get(run.name)
        if probe is None or not run.written:
            continue
        written, problem = writer.unpack_probe_archive(node, probe.filename, baseline=baseline)
        if problem is not None:
            note = f"spikeops: {problem}".encode()
            run.stderr = run.stderr + (b"\n" if run.stderr and not run.stderr.endswith(b"\n") else b"") + note
            if run.error is None and "cut" in problem:
                run.error = "output-truncated"
        if not written and run.error is None:
            run.error = "command-failed"


def _collect_node(inventory: Inventory, job: str, target: Target, writer: BundleWriter,
                  connector: Connector, baseline: bool, live: dict[str, Any]) -> NodeResult:
    t0 = time.monotonic()
    probes = plan_probes(inventory, job, target.node, baseline=baseline)
    expected = {probe.name: probe.command for probe in probes}
    run = _run_openssh if inventory.ssh.client == "openssh" else _run_paramiko
    try:
        runs, mode, lost = run(
            inventory, target, probes, lambda probe: writer.probe_sink(target.node, probe.filename, baseline=baseline),
            t0 + _node_budget(inventory, probes), connector, live,
            lambda: writer.clear_node(target.node, baseline=baseline))
    except ConnectFailure as failure:
        writer.write_unreachable(target.node, expected, round(time.monotonic() - t0, 3),
                                 error=failure.error, baseline=baseline)
        return NodeResult(target.node, failure.outcome, failure.detail, time.monotonic() - t0,
                          address=target.hostname, client=inventory.ssh.client)
    runs = _plan_order(runs, probes)
    _unpack(writer, target.node, runs, probes, baseline)
    for run_ in runs:
        _write_stderr(writer, target.node, run_, baseline)
    writer.write_probes_json(target.node, _statuses(runs), baseline=baseline)
    timed_out = [run_.name for run_ in runs if run_.error == "timeout"]
    if lost is not None:
        kept = sum(1 for run_ in runs if run_.written)
        outcome, detail = "unreachable", f"{lost}: kept {kept} of {len(runs)} probe outputs"
    elif timed_out:
        outcome, detail = "timeout", f"timed out: {', '.join(timed_out)}"
    else:
        outcome, detail = "ok", None
    return NodeResult(target.node, outcome, detail, time.monotonic() - t0, runs, address=target.hostname,
                      sessions=mode, client=inventory.ssh.client)


# ------------------------------------------------------------------------------- many nodes


def collect_nodes(
    inventory: Inventory,
    job: str,
    bundle: str | Path,
    nodes: Iterable[str] | None = None,
    *,
    baseline: bool = False,
    fanout: int | None = None,
    progress: Callable[[int, int, NodeResult], None] | None = None,
) -> list[NodeResult]:
    """Collect ``nodes`` (default: all of the inventory) into ``bundle`` with at most
    ``fanout`` connections at once; results in the order of ``nodes``."""
    check_job_id(job)
    targets = resolve_targets(inventory, nodes)
    writer = BundleWriter(bundle)
    connector = Connector(inventory.ssh.connect_timeout)
    live: dict[str, Any] = {}
    results: dict[str, NodeResult] = {}
    workers = max(1, min(fanout or inventory.ssh.fanout, len(targets) or 1))
    budget = _node_budget(inventory, plan_probes(inventory, job, next(iter(targets), "node"), baseline=baseline)) + 5
    deadline = time.monotonic() + budget * math.ceil(len(targets) / workers) + 10
    pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="spikeops-collect")
    lock = threading.Lock()
    # Every worker thread starts before any of them works: a thread's start() waits until the
    # new thread has run, and once the first ones are in their SSH handshakes (Python code,
    # under the GIL) each further start waited its turn; the 64th node of 64 began ~3 s late.
    go = threading.Event()

    def gated(target: Target) -> NodeResult:
        go.wait()
        return _collect_node(inventory, job, target, writer, connector, baseline, live)

    try:
        try:
            futures: dict[Future[NodeResult], str] = {pool.submit(gated, target): node
                                                       for node, target in targets.items()}
        finally:
            go.set()
        remaining = set(futures)
        while remaining:
            done, remaining = wait(remaining, timeout=max(0.0, deadline - time.monotonic()),
                                   return_when=FIRST_COMPLETED)
            if not done:
                break
            for future in done:
                node = futures[future]
                try:
                    result = future.result()
                except Exception as exc:  # a bug for one node must not lose the others
                    result = NodeResult(node, "unreachable", f"collector error: {type(exc).__name__}: {exc}", 0.0)
                with lock:
                    results[node] = result
                if progress is not None:
                    progress(len(results), len(targets), result)
        for future in remaining:  # past every bound: abandon, record, and close what is open
            node = futures[future]
            future.cancel()
            client = live.pop(node, None)
            if client is not None:
                client.close()
            results[node] = NodeResult(node, "timeout", "collection deadline passed", budget)
    finally:
        pool.shutdown(wait=False, cancel_futures=True)
        connector.close()
    return [results[node] for node in targets]


def _incident(inventory: Inventory, job: str, nodes: list[str], now: datetime) -> dict[str, Any]:
    stamp = now.strftime("%Y%m%dT%H%M%SZ")
    document: dict[str, Any] = {
        "incident_id": f"inc-{stamp}-{job}",
        "created": iso(now),
        "alert": {"source": "spikeops collect", "received": iso(now), "payload": {}},
        "job": {"id": job, "scheduler": inventory.scheduler or "slurm", "name": None, "nodes": nodes,
                "ranks": {}, "resumed_from": None},
        "window": {"start": iso(now - DEFAULT_WINDOW), "end": iso(now)},
    }
    if inventory.gpus_per_node:
        document["job"]["gpus_per_node"] = inventory.gpus_per_node
    return document


def prepare_bundle(
    inventory: Inventory,
    job: str,
    out: str | Path,
    nodes: Iterable[str] | None = None,
    *,
    baseline: bool = False,
    replace: bool = False,
) -> tuple[Path, list[str], datetime]:
    """Check a collection can start and make the bundle ready for it: the nodes are the
    inventory's, the job id is safe, and the bundle (created when missing, with an
    incident.json when it has none) holds no evidence for these nodes unless ``replace``:
    a second collection after the node rebooted must not silently erase the first.
    Returns the bundle path, the nodes and the start time."""
    check_job_id(job)
    wanted = list(inventory.nodes if nodes is None else nodes)
    if not wanted:
        raise InputError("no nodes to collect from")
    resolve_targets(inventory, wanted)  # strangers are refused before anything is written
    root = Path(out)
    if root.exists() and not root.is_dir():
        raise InputError(f"{root}: exists and is not a directory")
    writer = BundleWriter(root)
    if not replace:
        occupied = [node for node in wanted if writer.existing_evidence(node, baseline=baseline)]
        if occupied:
            what = "baseline evidence" if baseline else "evidence"
            raise InputError(f"{root} already holds {what} for {fold_nodes(occupied)} (use --replace to collect again)")
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise InputError(f"{root}: cannot create ({exc.strerror or exc})") from None
    started = datetime.now(UTC)
    if not (root / "incident.json").is_file():
        writer.write_incident(_incident(inventory, job, wanted, started))
    return root, wanted, started


def record_collection(result: CollectResult, inventory: Inventory, started: datetime) -> Path:
    """Write collection.json (baseline-collection.json): the record of the run as a whole."""
    record = result.to_json()
    record.update({"started": iso(started), "inventory": str(inventory.path) if inventory.path else None,
                   "cluster": inventory.name})
    name = f"baseline-{COLLECTION_FILE}" if result.baseline else COLLECTION_FILE
    target = result.bundle / name
    atomic_write(target, (json.dumps(record, indent=2) + "\n").encode())
    return target


def shard_nodes(nodes: list[str], size: int) -> list[list[str]]:
    """Consecutive slices of at most ``size`` nodes (neighbours share racks and switches, so
    a slow rack slows one shard, not all of them)."""
    size = max(1, size)
    return [nodes[i:i + size] for i in range(0, len(nodes), size)]


def collect(
    inventory: Inventory,
    job: str,
    out: str | Path,
    *,
    nodes: Iterable[str] | None = None,
    baseline: bool = False,
    replace: bool = False,
    fanout: int | None = None,
    progress: Callable[[int, int, NodeResult], None] | None = None,
) -> CollectResult:
    """Collect the job's evidence into the bundle at ``out`` (see ``prepare_bundle``)."""
    root, wanted, started = prepare_bundle(inventory, job, out, nodes, baseline=baseline, replace=replace)
    t0 = time.monotonic()
    results = collect_nodes(inventory, job, root, wanted, baseline=baseline, fanout=fanout, progress=progress)
    result = CollectResult(root, job, baseline, time.monotonic() - t0, results)
    record_collection(result, inventory, started)
    return result
