"""Per-node baselines and the seed's "healthy run" control, kept between incidents.

Counters (ECC, ethtool, InfiniBand) only mean something as growth: a node with 40
uncorrectable ECC errors since 2024 is not this incident's culprit unless the 40 are new.
So a scheduled refresh captures each healthy node's counter probes into a store, and the
incident flow copies them into the bundle's ``nodes/NODE/baseline/`` (``copy_baselines``),
where the diagnosis reads deltas (shared/spec/bundle.md).

The store (docs/baselines.md)::

    BASELINE_DIR/NODE/PROBE.txt      last good capture of each counter probe (+ PROBE.err)
    BASELINE_DIR/NODE/baseline.json  when each file was captured, from which inventory, and
                                     how the last refresh of the node went
    BASELINE_DIR/NODE/control.json   the last control run on the node (and a few before it)

Rules, because a baseline that lies hides exactly the fault it exists to reveal:
- a baseline is the healthy state: drained or down nodes are skipped;
- a probe that answered replaces its file (atomically); a probe that failed, or a node that
  did not answer, keeps the earlier file: a good baseline is never replaced with nothing;
- a file whose probe the node no longer has (an interface gone) is removed;
- ``copy_baselines`` never copies a capture taken after the incident window began (it
  would contain the fault and hide its growth), and never overwrites a bundle's own baseline.

The control run is the seed's "periodic short healthy run (pure compute, no communication
or data change)": an operator's command (argv, never a shell string) run on idle nodes over
SSH, each word quoted with ``shlex`` and bounded by ``timeout`` on the node. Its exit status,
duration and output tails are kept; a failure is a verdict, never an exception.
"""

from __future__ import annotations

import argparse
import fcntl
import json
import os
import select
import shlex
import shutil
import tempfile
import time
from collections.abc import Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, TextIO

from spikeops.bundle import BundleWriter, atomic_write
from spikeops.errors import InputError
from spikeops.inventory import Inventory, JobSettings, ProbeSettings, Target, expand_nodes, fold_nodes, load_inventory
from spikeops.timeparse import iso, parse_iso

__all__ = [
    "BASELINE_FILE",
    "CONTROL_FILE",
    "BASELINE_PROBES",
    "BASELINE_JOB",
    "CONTROL_VERDICTS",
    "NodeBaseline",
    "RefreshResult",
    "ControlResult",
    "NodeStates",
    "baseline_inventory",
    "refresh_baselines",
    "copy_baselines",
    "run_control",
    "remote_run",
    "control_command",
    "node_states",
    "read_baseline",
    "read_control",
    "add_baselines_parser",
    "run_baselines_cli",
]

BASELINE_FILE = "baseline.json"
CONTROL_FILE = "control.json"
BASELINE_FORMAT = "spikeops-baseline/1"
#: The registered remote probes whose output the diagnosis reads as deltas (or that say
#: what the counters belong to). Logs and versions are the job's, not the node's state.
BASELINE_PROBES = ("nvidia-smi-q", "nvml", "ethtool", "ibstat", "ib-counters")
#: The job id the collector is given for a baseline (no job's files are read).
BASELINE_JOB = "baseline"
CONTROL_VERDICTS = ("ok", "failed", "timeout", "unreachable")
#: Output kept from a control run, from the end (where a failing run says why).
TAIL_BYTES = 4096
#: Earlier control runs kept in control.json, newest first.
CONTROL_HISTORY = 10
#: Seconds between ``timeout`` sending TERM and KILL on the node, and the wait beyond that.
_KILL_AFTER = 5
_GRACE = 10.0


# ------------------------------------------------------------------------------ results


@dataclass
class NodeBaseline:
    """How one node's baseline fared in a refresh. ``status``: ``refreshed`` (every probe
    that answered is stored), ``partial`` (some probes failed and their earlier files were
    kept), ``kept`` (the node did not answer; its earlier baseline stays), ``missing`` (no
    baseline now and none before), ``skipped`` (drained or down)."""

    node: str
    status: str
    outcome: str | None = None
    detail: str | None = None
    stored: list[str] = field(default_factory=list)
    kept: list[str] = field(default_factory=list)
    captured: str | None = None

    def to_json(self) -> dict[str, Any]:
        return {"node": self.node, "status": self.status, "outcome": self.outcome, "detail": self.detail,
                "stored": self.stored, "kept": self.kept, "captured": self.captured}


@dataclass
class RefreshResult:
    baseline_dir: Path
    started: datetime
    seconds: float
    nodes: list[NodeBaseline]

    def by_status(self) -> dict[str, list[str]]:
        out: dict[str, list[str]] = {}
        for entry in self.nodes:
            out.setdefault(entry.status, []).append(entry.node)
        return out

    def summary_lines(self) -> list[str]:
        lines = [f"baselines of {len(self.nodes)} node(s) in {self.baseline_dir} ({self.seconds:.1f} s)"]
        for status, nodes in self.by_status().items():
            lines.append(f"  {status:10} {len(nodes):5}  {fold_nodes(nodes)}")
        for entry in self.nodes:
            if entry.status in ("partial", "kept", "missing") and entry.detail:
                lines.append(f"  {entry.node}: {entry.detail}")
        return lines

    def to_json(self) -> dict[str, Any]:
        return {"baseline_dir": str(self.baseline_dir), "started": iso(self.started),
                "seconds": round(self.seconds, 3),
                "summary": {status: fold_nodes(nodes) for status, nodes in self.by_status().items()},
                "nodes": [entry.to_json() for entry in self.nodes]}


@dataclass
class ControlResult:
    """One control run on one node; ``verdict`` is one of ``CONTROL_VERDICTS``."""

    node: str
    verdict: str
    argv: list[str]
    started: str | None
    exit: int | None
    seconds: float
    stdout_tail: str = ""
    stderr_tail: str = ""
    detail: str | None = None

    def to_json(self) -> dict[str, Any]:
        return {"node": self.node, "time": self.started, "argv": self.argv, "exit": self.exit,
                "seconds": round(self.seconds, 3), "verdict": self.verdict, "detail": self.detail,
                "stdout_tail": self.stdout_tail, "stderr_tail": self.stderr_tail}


@dataclass(frozen=True)
class NodeStates:
    """What the scheduler says: nodes out of service (drained, down) and idle nodes."""

    unavailable: list[str]
    idle: list[str]


# ------------------------------------------------------------------------------ the store


def _node_dir(root: Path, node: str) -> Path:
    if not node or node.startswith(".") or "/" in node or node in {".", ".."}:
        raise InputError(f"bad node name {node!r}")
    return root / node


def _read_json(path: Path) -> dict[str, Any]:
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return value if isinstance(value, dict) else {}


def _write_json(path: Path, document: dict[str, Any]) -> None:
    atomic_write(path, (json.dumps(document, indent=2, ensure_ascii=False) + "\n").encode())


def read_baseline(baseline_dir: str | Path, node: str) -> dict[str, Any]:
    """A node's baseline.json ({} when there is none or it is unreadable)."""
    return _read_json(_node_dir(Path(baseline_dir).expanduser(), node) / BASELINE_FILE)


def read_control(baseline_dir: str | Path, node: str) -> dict[str, Any]:
    """A node's control.json ({} when no control run was kept)."""
    return _read_json(_node_dir(Path(baseline_dir).expanduser(), node) / CONTROL_FILE)


class _Lock:
    """One refresh of a store at a time (a scheduled run and a person at the CLI)."""

    def __init__(self, root: Path) -> None:
        self.path = root / ".lock"
        self.handle: Any = None

    def __enter__(self) -> _Lock:
        self.handle = open(self.path, "a")  # noqa: SIM115
        try:
            fcntl.flock(self.handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self.handle.close()
            raise InputError(f"{self.path.parent}: another baseline refresh is running") from None
        return self

    def __exit__(self, *exc: object) -> None:
        fcntl.flock(self.handle, fcntl.LOCK_UN)
        self.handle.close()


# ------------------------------------------------------------------------------ refreshing


def baseline_inventory(inventory: Inventory) -> Inventory:
    """The inventory with only ``BASELINE_PROBES`` enabled and no job: a baseline is the
    node's state, not a job's logs (and a 32 MiB kernel log per node is no counter)."""
    from spikeops.probes import registry
    from spikeops.probes.base import remote_probes

    registry()
    probes = dict(inventory.probes)
    for probe in remote_probes():
        if probe.name not in BASELINE_PROBES:
            probes[probe.name] = replace(probes.get(probe.name) or ProbeSettings(), enabled=False)
    return replace(inventory, job=JobSettings(), probes=probes)


def _wanted(inventory: Inventory, nodes: str | Iterable[str] | None) -> list[str]:
    from spikeops.inventory import resolve_targets

    wanted = list(inventory.nodes) if nodes is None else expand_nodes(nodes)
    resolve_targets(inventory, wanted)  # strangers are refused before anything runs
    return wanted


def _store_node(root: Path, staging: Path, result: Any, inventory: Inventory, started: datetime) -> NodeBaseline:
    """Move what the node answered into the store, keep what failed, drop what is gone."""
    dest = _node_dir(root, result.node)
    record = _read_json(dest / BASELINE_FILE)
    previous: dict[str, Any] = dict(record.get("probes") or {})
    entry = NodeBaseline(result.node, "kept", result.outcome, result.detail)
    if result.probes:  # the node answered: it says which probes it has now
        source = staging / "nodes" / result.node / "baseline"
        dest.mkdir(parents=True, exist_ok=True)
        merged: dict[str, Any] = {}
        failed_files: set[str] = set()
        listing_failed = False
        for run in result.probes:
            if run.error is None and run.written and run.stdout_bytes > 0 and run.filename:
                os.replace(source / run.filename, dest / run.filename)
                err = Path(run.filename).stem + ".err"
                if (source / err).is_file():
                    os.replace(source / err, dest / err)
                else:
                    (dest / err).unlink(missing_ok=True)
                merged[run.filename] = {"probe": run.name, "captured": iso(run.started), "command": run.command,
                                        "seconds": run.seconds}
                entry.stored.append(run.filename)
            elif run.filename:
                failed_files.add(run.filename)
            else:
                listing_failed = True  # the interface listing: every ethtool file stays
        for name, info in previous.items():
            if name in merged:
                continue
            if name in failed_files or (listing_failed and name.startswith("ethtool-")):
                merged[name] = info
                entry.kept.append(name)
            else:
                (dest / name).unlink(missing_ok=True)
                (dest / (Path(name).stem + ".err")).unlink(missing_ok=True)
        problems = result.problems()
        entry.detail = "; ".join(problems) if problems else result.detail
        entry.status = "partial" if entry.kept else "refreshed" if merged else "missing"
    else:
        merged = previous
        entry.kept = sorted(previous)
        entry.status = "kept" if previous else "missing"
        entry.detail = result.detail or result.outcome
    captures = [info.get("captured") for info in merged.values() if info.get("captured")]
    entry.captured = max(captures) if captures else None
    if merged or dest.is_dir() or result.probes:
        dest.mkdir(parents=True, exist_ok=True)
        _write_json(dest / BASELINE_FILE, {
            "format": BASELINE_FORMAT, "node": result.node, "cluster": inventory.name,
            "inventory": str(inventory.path) if inventory.path else None, "captured": entry.captured,
            "probes": merged,
            "last_refresh": {"time": iso(started), "status": entry.status, "outcome": result.outcome,
                             "detail": entry.detail, "kept": entry.kept},
        })
    return entry


def refresh_baselines(
    inventory_path: str | Path,
    baseline_dir: str | Path,
    nodes: str | Iterable[str] | None = None,
    *,
    skip: Iterable[str] = (),
    fanout: int | None = None,
) -> RefreshResult:
    """Capture ``BASELINE_PROBES`` from ``nodes`` (default: the inventory's) minus ``skip``
    (the drained and down ones) into the store at ``baseline_dir`` (module doc for the rules)."""
    from spikeops.collect.collector import collect_nodes

    inventory = load_inventory(inventory_path)
    wanted = _wanted(inventory, nodes)
    skipped = set(skip)
    targets = [node for node in wanted if node not in skipped]
    root = Path(baseline_dir).expanduser()
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise InputError(f"{root}: cannot create ({exc.strerror or exc})") from None
    started = datetime.now(UTC)
    t0 = time.monotonic()
    entries: dict[str, NodeBaseline] = {node: NodeBaseline(node, "skipped", detail="drained or down")
                                        for node in wanted if node in skipped}
    with _Lock(root):
        # Collected beside the store (same file system), then renamed in file by file.
        staging = Path(tempfile.mkdtemp(prefix=".incoming-", dir=root))
        try:
            if targets:
                results = collect_nodes(baseline_inventory(inventory), BASELINE_JOB, staging, targets,
                                        baseline=True, fanout=fanout)
                for result in results:
                    try:
                        entries[result.node] = _store_node(root, staging, result, inventory, started)
                    except OSError as exc:  # a full disk for one node: the others are still stored
                        entries[result.node] = NodeBaseline(result.node, "kept", result.outcome,
                                                            f"could not store: {exc.strerror or exc}")
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    return RefreshResult(root, started, time.monotonic() - t0, [entries[node] for node in wanted])


# ------------------------------------------------------------------------------ into a bundle


def _window_start(bundle: Path) -> datetime | None:
    incident = _read_json(bundle / "incident.json")
    window = incident.get("window")
    start = window.get("start") if isinstance(window, dict) else None
    return parse_iso(start) if isinstance(start, str) else None


def copy_baselines(baseline_dir: str | Path, bundle: str | Path, nodes: Iterable[str], *,
                   before: datetime | None = None) -> list[str]:
    """Copy each node's stored probes into ``bundle/nodes/NODE/baseline/`` (with the store's
    baseline.json beside them, for the post-mortem). Returns one line per node: what was
    copied, or why nothing was. A bundle that already has a node's baseline keeps it; a
    capture taken at or after ``before`` (default: the incident's window start) is left out."""
    root = Path(baseline_dir).expanduser()
    target = Path(bundle)
    writer = BundleWriter(target)
    cutoff = before or _window_start(target)
    lines = []
    for node in nodes:
        record = _read_json(_node_dir(root, node) / BASELINE_FILE)
        probes = record.get("probes") or {}
        if not probes:
            lines.append(f"{node}: no stored baseline")
            continue
        if writer.existing_evidence(node, baseline=True):
            lines.append(f"{node}: the bundle already has a baseline (kept)")
            continue
        copied, late, times = [], [], []
        for name, info in sorted(probes.items()):
            source = root / node / name
            captured = parse_iso(str(info.get("captured") or ""))
            if cutoff is not None and (captured is None or captured >= cutoff):
                late.append(name)
                continue
            try:
                stdout = source.read_bytes()
                err = source.with_name(Path(name).stem + ".err")
                stderr = err.read_bytes() if err.is_file() else b""
            except OSError:
                continue
            writer.write_probe_output(node, name, stdout, stderr, baseline=True)
            copied.append(name)
            times.append(str(info.get("captured")))
        if copied:
            kept = {name: probes[name] for name in copied}
            _write_json(writer.node_folder(node, baseline=True) / BASELINE_FILE, {**record, "probes": kept})
            line = f"{node}: copied {len(copied)} file(s) captured {min(times)}"
            if late:
                line += f"; {len(late)} left out (captured after the window began)"
            lines.append(line)
        else:
            why = "captured after the window began" if late else "files missing from the store"
            lines.append(f"{node}: nothing copied ({why})")
    return lines


# ------------------------------------------------------------------------------ control runs


def control_command(argv: Sequence[str], timeout: float) -> str:
    """The remote command line: ``timeout`` on the node, every word quoted (no shell syntax
    in the operator's argv ever reaches a shell as syntax)."""
    if isinstance(argv, str) or not argv or not all(isinstance(part, str) and part for part in argv):
        raise InputError("the control command must be a non-empty list of non-empty strings (argv)")
    if any("\0" in part for part in argv):
        raise InputError("the control command contains a NUL byte")
    if not timeout or timeout <= 0:
        raise InputError(f"control timeout must be positive, not {timeout!r}")
    seconds = str(max(1, int(round(timeout))))
    return "exec " + shlex.join(["timeout", "-k", str(_KILL_AFTER), seconds, *argv])


def _keep_tail(buffer: bytearray, data: bytes, keep: int = TAIL_BYTES) -> None:
    buffer.extend(data)
    if len(buffer) > keep:
        del buffer[:-keep]


def _verdict(exit_code: int | None, seconds: float, timeout: float, late: bool) -> tuple[str, str | None]:
    if late:
        return "timeout", f"still running after {timeout:g} s (and the grace period); channel closed"
    if exit_code == 0:
        return "ok", None
    if exit_code == 124 or (exit_code == 137 and seconds >= timeout):
        return "timeout", f"killed by timeout after {timeout:g} s"
    if exit_code in (126, 127):
        return "failed", f"exit {exit_code}: command not found or not executable on the node"
    if exit_code is None:
        return "failed", "no exit status (killed by a signal, or the connection dropped)"
    return "failed", f"exit {exit_code}"


def remote_run(connector: Any, target: Target, argv: list[str], remote: str, timeout: float, *,
               keep: int = TAIL_BYTES) -> ControlResult:
    """Run ``remote`` (a command line already bounded by ``timeout`` on the node) over SSH and
    judge it; the last ``keep`` bytes of each stream are kept. Never raises for the node's
    sake: unreachable, a timeout or a failure is the result's verdict. The control run uses
    it, and so does node validation (``spikeops.lifecycle.validate``, with outputs to parse)."""
    from spikeops.collect.ssh import ConnectFailure

    started = datetime.now(UTC)
    t0 = time.monotonic()
    try:
        client = connector.connect(target)
    except ConnectFailure as failure:
        return ControlResult(target.node, "unreachable", argv, iso(started), None, time.monotonic() - t0,
                             detail=failure.detail)
    try:
        try:
            channel = client.get_transport().open_session(timeout=connector.connect_timeout)
            channel.exec_command(remote)
        except Exception as exc:  # paramiko's SSHException, ChannelException, EOFError, OSError
            return ControlResult(target.node, "unreachable", argv, iso(started), None, time.monotonic() - t0,
                                 detail=f"could not start the command over SSH ({type(exc).__name__}: {exc})")
        out, err = bytearray(), bytearray()
        deadline = t0 + timeout + _KILL_AFTER + _GRACE
        late = False
        while True:
            while channel.recv_ready():
                _keep_tail(out, channel.recv(1 << 16), keep)
            while channel.recv_stderr_ready():
                _keep_tail(err, channel.recv_stderr(1 << 16), keep)
            if channel.exit_status_ready() and not channel.recv_ready() and not channel.recv_stderr_ready():
                break
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                late = True
                break
            select.select([channel], [], [], min(1.0, remaining))
        exit_code = None if late else channel.recv_exit_status()
        channel.close()
    finally:
        client.close()
    exit_code = None if exit_code == -1 else exit_code
    seconds = time.monotonic() - t0
    verdict, detail = _verdict(exit_code, seconds, timeout, late)
    return ControlResult(target.node, verdict, argv, iso(started), exit_code, seconds,
                         out.decode("utf-8", "replace"), err.decode("utf-8", "replace"), detail)


def _keep_control(root: Path, result: ControlResult) -> None:
    path = _node_dir(root, result.node) / CONTROL_FILE
    earlier = _read_json(path)
    history = [{k: earlier.get(k) for k in ("time", "exit", "seconds", "verdict", "detail")}] if earlier else []
    history += list(earlier.get("previous") or [])
    _write_json(path, {**result.to_json(), "previous": history[:CONTROL_HISTORY]})


def run_control(
    inventory_path: str | Path,
    nodes: str | Iterable[str],
    argv: Sequence[str],
    timeout: float,
    baseline_dir: str | Path | None = None,
    *,
    fanout: int | None = None,
) -> list[ControlResult]:
    """Run the control command on each node in parallel over SSH; results in node order,
    kept in ``BASELINE_DIR/NODE/control.json`` when ``baseline_dir`` is given."""
    from spikeops.collect.ssh import Connector
    from spikeops.inventory import resolve_targets

    argv = list(argv)
    remote = control_command(argv, timeout)
    inventory = load_inventory(inventory_path)
    targets = resolve_targets(inventory, expand_nodes(nodes))
    if not targets:
        return []
    connector = Connector(inventory.ssh.connect_timeout)
    width = max(1, min(fanout or inventory.ssh.fanout, len(targets)))

    def one(target: Target) -> ControlResult:
        try:
            return remote_run(connector, target, argv, remote, timeout)
        except Exception as exc:  # a bug for one node must not lose the others
            return ControlResult(target.node, "failed", argv, iso(datetime.now(UTC)), None, 0.0,
                                 detail=f"spikeops error: {type(exc).__name__}: {exc}")

    try:
        with ThreadPoolExecutor(max_workers=width, thread_name_prefix="spikeops-control") as pool:
            results = list(pool.map(one, targets.values()))
    finally:
        connector.close()
    if baseline_dir is not None:
        root = Path(baseline_dir).expanduser()
        for result in results:
            _keep_control(root, result)
    return results


# ------------------------------------------------------------------------------ the scheduler


def node_states(scheduler_kind: str, state_dir: str | Path | None = None) -> NodeStates:
    """Out-of-service and idle nodes from the cluster's scheduler (read-only)."""
    from spikeops.schedulers import SlurmScheduler, open_scheduler

    scheduler = open_scheduler(scheduler_kind, log_path=None, state_dir=state_dir)
    states = scheduler.show_nodes()[0] if isinstance(scheduler, SlurmScheduler) else scheduler.nodes()
    unavailable = sorted(name for name, node in states.items() if node.drained or node.down)
    return NodeStates(unavailable, list(scheduler.idle_nodes()))


# ------------------------------------------------------------------------------ command line


def add_baselines_parser(commands: Any) -> argparse.ArgumentParser:
    """``spikeops baselines refresh|control|show`` on the CLI's subparsers."""
    parser = commands.add_parser(
        "baselines", help="refresh per-node baselines and run the healthy-run control",
        description="Keep each node's counter baseline (docs/baselines.md) for the clusters of "
                    "spikeops.toml that name a baseline_dir. refresh: capture the counter probes of the "
                    "nodes the scheduler has not drained; control: run the cluster's control_command on "
                    "idle nodes; show: the store. Exit status: 0 done, 1 a control run failed, 2 bad input.")
    actions = parser.add_subparsers(dest="action", metavar="ACTION", required=True)
    for name, text in (("refresh", "capture baselines now"), ("control", "run the control command on idle nodes"),
                       ("show", "each node's baseline and last control run")):
        action = actions.add_parser(name, help=text, description=text)
        action.add_argument("--config", help="spikeops.toml (default $SPIKEOPS_CONFIG or ./spikeops.toml)")
        action.add_argument("--cluster", help="the cluster of spikeops.toml (default: the only one)")
        action.add_argument("--nodes", help="a node set (default: the inventory's nodes)")
        action.add_argument("--json", action="store_true", help="print JSON")
    parser.set_defaults(handler=run_baselines_cli)
    return parser


def _cluster(config_path: str | None, name: str | None) -> Any:
    from spikeops.config import load_config

    config = load_config(config_path)
    if name is None:
        if len(config.clusters) != 1:
            raise InputError("name the cluster (--cluster): " + (", ".join(config.clusters) or "none configured"))
        name = next(iter(config.clusters))
    cluster = config.clusters.get(name)
    if cluster is None:
        raise InputError(f"cluster {name!r} is not configured")
    if not cluster.baseline_dir:
        raise InputError(f"cluster {name!r} has no baseline_dir in {config.path}")
    return cluster


def _show_row(baseline_dir: str, node: str) -> dict[str, Any]:
    record, control = read_baseline(baseline_dir, node), read_control(baseline_dir, node)
    return {"node": node, "captured": record.get("captured"), "refresh": (record.get("last_refresh") or {}).get("status"),
            "control": control.get("verdict"), "control_time": control.get("time")}


def run_baselines_cli(args: argparse.Namespace, out: TextIO, err: TextIO) -> int:
    """The handler of ``spikeops baselines``; returns the exit status."""
    cluster = _cluster(args.config, args.cluster)
    if args.action == "show":
        nodes = expand_nodes(args.nodes) if args.nodes else load_inventory(cluster.inventory).nodes
        rows = [_show_row(cluster.baseline_dir, node) for node in nodes]
        if args.json:
            out.write(json.dumps(rows, indent=2) + "\n")
            return 0
        for row in rows:
            out.write(f"{row['node']:20} baseline {row['captured'] or '-':28} {row['refresh'] or '-':10} "
                      f"control {row['control'] or '-'} {row['control_time'] or ''}\n")
        return 0
    states = node_states(cluster.scheduler, cluster.scheduler_state_dir)
    if args.action == "refresh":
        result = refresh_baselines(cluster.inventory, cluster.baseline_dir, args.nodes, skip=states.unavailable)
        out.write(json.dumps(result.to_json(), indent=2) + "\n" if args.json else "\n".join(result.summary_lines()) + "\n")
        return 0
    if not cluster.control_command:
        raise InputError(f"cluster {cluster.name!r} has no control_command")
    wanted = set(expand_nodes(args.nodes)) if args.nodes else set(load_inventory(cluster.inventory).nodes)
    idle = [node for node in states.idle if node in wanted]
    if not idle:
        err.write("no idle node to run the control on\n")
        return 0
    results = run_control(cluster.inventory, idle, cluster.control_command, cluster.control_timeout_s,
                          cluster.baseline_dir)
    if args.json:
        out.write(json.dumps([r.to_json() for r in results], indent=2) + "\n")
    else:
        for r in results:
            out.write(f"{r.node:20} {r.verdict:12} exit {r.exit} {r.seconds:.1f} s {r.detail or ''}\n")
    return 1 if any(r.verdict in ("failed", "timeout") for r in results) else 0
