"""A local Prometheus and Alertmanager (Debian's), wired to a spikeops receiver: the real
monitoring chain for the tests, the demo and the benchmarks.

The alerting rules spikeops ships (``infra/monitoring/prometheus-rules.yml``) are only proven
when the real rule engine evaluates them on scraped metrics and the real Alertmanager groups,
repeats and resolves what they fire. ``up(D, receiver=URL)`` starts both in D:

- Prometheus scrapes the training jobs listed in ``D/targets/*.json`` (file service discovery:
  ``add_target`` adds one while it runs), evaluates the shipped rules at the given intervals,
  and sends what fires to the Alertmanager beside it;
- Alertmanager routes with ``infra/monitoring/alertmanager-local.yml`` (its webhook URL set to
  ``receiver``, its group wait, group interval and repeat interval as given), without its HA
  cluster port (``--cluster.listen-address=``), so instances side by side never gossip.

Both listen on 127.0.0.1 only, on free ports. Layout of D (all written by ``up``)::

    cluster.json  prometheus.yml  rules.yml  alertmanager.yml  targets/*.json
    data/prometheus/  data/alertmanager/  run/*.pid  log/prometheus.log  log/alertmanager.log

``down(D)`` stops, by pid, every process started for D (those whose command line names D's
config files) and leaves the files. Command line: ``python -m spikeops.sim.monitoring
up|down|status`` (``infra/monitoring/up`` and ``down`` wrap it and install the packages when
missing). Binaries are overridable (``SPIKEOPS_PROMETHEUS``, ``SPIKEOPS_ALERTMANAGER``).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from spikeops.sim import localcluster
from spikeops.sim.processes import ClusterError, pid_alive, proc_read, read_pid, scan, stop
from spikeops.sim.slurmcluster import free_ports

__all__ = ["Monitoring", "ClusterError", "FORMAT", "RULES", "ALERTMANAGER_LOCAL", "PACKAGES", "up", "down",
           "load", "running", "status", "missing", "add_target", "alerts", "main"]

FORMAT = "spikeops-sim-monitoring/1"
HOST = "127.0.0.1"
_INFRA = Path(__file__).resolve().parents[2] / "infra" / "monitoring"
#: The shipped rules and the local Alertmanager configuration (a checkout's infra/monitoring).
RULES = _INFRA / "prometheus-rules.yml"
ALERTMANAGER_LOCAL = _INFRA / "alertmanager-local.yml"
#: The Debian packages (``infra/apt-ensure.sh`` installs them; the Makefile lists them).
PACKAGES = ("prometheus", "prometheus-alertmanager")
_BINARIES = {
    "prometheus": ("SPIKEOPS_PROMETHEUS", "/usr/bin/prometheus", "prometheus"),
    "alertmanager": ("SPIKEOPS_ALERTMANAGER", "/usr/bin/prometheus-alertmanager", "prometheus-alertmanager"),
}
_ENTRIES = ("cluster.json", "prometheus.yml", "rules.yml", "alertmanager.yml", "targets", "data", "run", "log")
_DURATION = re.compile(r"^\d+(ms|s|m|h)$")


@dataclass
class Monitoring:
    """A started local monitoring chain, as ``up`` wrote it to cluster.json."""

    directory: Path
    prometheus_url: str
    alertmanager_url: str
    receiver: str
    scrape_interval: str
    evaluation_interval: str


def _binary(name: str) -> str:
    variable, default, package = _BINARIES[name]
    path = os.environ.get(variable, default)
    found = path if os.path.isabs(path) else shutil.which(path)
    if not found or not os.access(found, os.X_OK):
        raise ClusterError(f"{path} not found: install {package} (apt-get install {' '.join(PACKAGES)}, "
                           "or infra/monitoring/up, which does)")
    return found


def missing() -> str | None:
    """Why ``up`` cannot run here (a binary not installed), or None when it can."""
    for name in _BINARIES:
        try:
            _binary(name)
        except ClusterError as exc:
            return str(exc)
    return None


def _seconds(duration: str) -> float:
    number, unit = re.match(r"^(\d+)(ms|s|m|h)$", duration).groups()  # type: ignore[union-attr]
    return int(number) * {"ms": 0.001, "s": 1, "m": 60, "h": 3600}[unit]


def _check_duration(name: str, value: str) -> str:
    if not _DURATION.match(value):
        raise ValueError(f"{name} {value!r}: a duration such as 1s, 15s, 2m")
    return value


def prometheus_config(root: Path, alertmanager_port: int, *, scrape_interval: str,
                      evaluation_interval: str) -> dict[str, Any]:
    """Prometheus's configuration (written as JSON, which YAML reads)."""
    timeout = scrape_interval if _seconds(scrape_interval) < 10 else "10s"
    return {
        "global": {"scrape_interval": scrape_interval, "evaluation_interval": evaluation_interval,
                   "scrape_timeout": timeout},
        "rule_files": [str(root / "rules.yml")],
        "alerting": {"alertmanagers": [{"static_configs": [{"targets": [f"{HOST}:{alertmanager_port}"]}]}]},
        "scrape_configs": [{"job_name": "training", "file_sd_configs": [
            {"files": [str(root / "targets" / "*.json")], "refresh_interval": "1s"}]}],
    }


def alertmanager_config(receiver: str, *, source: Path = ALERTMANAGER_LOCAL, group_wait: str | None = None,
                        group_interval: str | None = None, repeat_interval: str | None = None) -> dict[str, Any]:
    """``source`` with the spikeops receiver's webhook URL and, when given, its timings."""
    import yaml

    document = yaml.safe_load(source.read_text())
    found = False
    for route in document["route"].get("routes", []):
        if route.get("receiver") == "spikeops":
            for key, value in (("group_wait", group_wait), ("group_interval", group_interval),
                               ("repeat_interval", repeat_interval)):
                if value is not None:
                    route[key] = _check_duration(key, value)
    for entry in document["receivers"]:
        if entry["name"] == "spikeops":
            for hook in entry.get("webhook_configs", []):
                hook["url"] = receiver
                found = True
    if not found:
        raise ClusterError(f"{source}: no webhook of a receiver named spikeops")
    return document


def add_target(directory: str | Path, address: str, labels: Mapping[str, str] | None = None) -> Path:
    """Have Prometheus scrape ``address`` (HOST:PORT of a job's exporter) from now on; the
    file written (remove it to stop scraping). Prometheus sees it within a second."""
    if not re.match(r"^[A-Za-z0-9.\[\]:-]+:\d+$", address):
        raise ValueError(f"target {address!r}: HOST:PORT")
    folder = Path(directory).resolve() / "targets"
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / (re.sub(r"[^A-Za-z0-9]", "_", address) + ".json")
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps([{"targets": [address], "labels": dict(labels or {})}]))
    os.replace(tmp, path)
    return path


def _find_processes(root: Path) -> set[int]:
    marks = [os.fsencode(f"--config.file={root / name}") for name in ("prometheus.yml", "alertmanager.yml")]

    def match(pid: int) -> bool:
        cmdline = proc_read(pid, "cmdline")
        return any(mark in cmdline for mark in marks)

    seeds = [pid for pid in (read_pid(p) for p in sorted((root / "run").glob("*.pid")) if (root / "run").is_dir())
             if pid is not None and any(mark in proc_read(pid, "cmdline") for mark in marks)]
    return scan(match, seeds)


def _ready(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/-/ready", timeout=2) as answer:
            return answer.status == 200
    except (urllib.error.URLError, OSError):
        return False


def _tail(path: Path) -> str:
    try:
        lines = [line for line in path.read_text(errors="replace").splitlines() if line.strip()]
    except OSError:
        return f"(no {path.name})"
    return " | ".join(line[:200] for line in lines[-3:]) or f"({path.name} is empty)"


def up(directory: str | Path, *, receiver: str, targets: Sequence[str] = (), scrape_interval: str = "1s",
       evaluation_interval: str = "1s", group_wait: str | None = None, group_interval: str | None = None,
       repeat_interval: str | None = None, rules: Path = RULES, ready_timeout: float = 60.0) -> Monitoring:
    """Start Prometheus and Alertmanager in ``directory``; return once both answer
    ``/-/ready``. ``receiver`` is the spikeops receiver's Alertmanager URL
    (``http://127.0.0.1:8787/alerts/alertmanager``); ``targets`` are exporters to scrape
    (``add_target`` adds more later). On any failure, what was started is stopped again."""
    if not re.match(r"^https?://", receiver):
        raise ValueError(f"receiver {receiver!r}: an http(s) URL")
    _check_duration("scrape_interval", scrape_interval)
    _check_duration("evaluation_interval", evaluation_interval)
    why_not = missing()
    if why_not is not None:
        raise ClusterError(why_not)
    root = Path(directory).resolve()
    localcluster.prepare(root, _ENTRIES, lambda r: bool(_find_processes(r)), what="a monitoring chain",
                         written_into="prometheus.yml", down_command="infra/monitoring/down")
    base = free_ports(2)
    prometheus_port, alertmanager_port = base, base + 1
    record = Monitoring(directory=root, prometheus_url=f"http://{HOST}:{prometheus_port}",
                        alertmanager_url=f"http://{HOST}:{alertmanager_port}", receiver=receiver,
                        scrape_interval=scrape_interval, evaluation_interval=evaluation_interval)
    root.mkdir(parents=True, exist_ok=True)
    localcluster.save(root, FORMAT, {"state": "starting"})
    for name in ("targets", "data/prometheus", "data/alertmanager", "run", "log"):
        (root / name).mkdir(parents=True, exist_ok=True)
    shutil.copyfile(rules, root / "rules.yml")
    (root / "prometheus.yml").write_text(json.dumps(prometheus_config(
        root, alertmanager_port, scrape_interval=scrape_interval, evaluation_interval=evaluation_interval), indent=1))
    (root / "alertmanager.yml").write_text(json.dumps(alertmanager_config(
        receiver, group_wait=group_wait, group_interval=group_interval, repeat_interval=repeat_interval), indent=1))
    for target in targets:
        add_target(root, target)
    localcluster.save(root, FORMAT, record, {"pids": {}})
    commands = {
        "alertmanager": [_binary("alertmanager"), f"--config.file={root / 'alertmanager.yml'}",
                         f"--storage.path={root / 'data' / 'alertmanager'}",
                         f"--web.listen-address={HOST}:{alertmanager_port}", "--cluster.listen-address="],
        "prometheus": [_binary("prometheus"), f"--config.file={root / 'prometheus.yml'}",
                       f"--storage.tsdb.path={root / 'data' / 'prometheus'}",
                       f"--web.listen-address={HOST}:{prometheus_port}", "--storage.tsdb.retention.time=1d",
                       # resend a firing alert to Alertmanager every evaluation, not every minute
                       f"--rules.alert.resend-delay={evaluation_interval}"],
    }
    pids: dict[str, int] = {}
    try:
        for name, argv in commands.items():
            with open(root / "log" / f"{name}.log", "ab") as log:
                process = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                           start_new_session=True, cwd=root)
            pids[name] = process.pid
            (root / "run" / f"{name}.pid").write_text(f"{process.pid}\n")
        urls = {"alertmanager": record.alertmanager_url, "prometheus": record.prometheus_url}
        deadline = time.monotonic() + ready_timeout
        for name, url in urls.items():
            while not _ready(url):
                if not pid_alive(pids[name]):
                    raise ClusterError(f"{name} exited: {_tail(root / 'log' / f'{name}.log')}")
                if time.monotonic() > deadline:
                    raise ClusterError(f"{name} not ready at {url} after {ready_timeout:.0f} s: "
                                       f"{_tail(root / 'log' / f'{name}.log')}")
                time.sleep(0.05)
    except BaseException:
        down(root)
        raise
    localcluster.save(root, FORMAT, record, {"pids": pids,
                                             "started": datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")})
    return record


def load(directory: str | Path) -> Monitoring:
    return localcluster.load(directory, FORMAT, Monitoring, ("directory",), what="local monitoring chain")


def down(directory: str | Path) -> None:
    """Stop every process started for D, by pid (idempotent); the files stay."""
    root = Path(directory).resolve()
    stop(lambda: _find_processes(root), str(root))


def running(directory: str | Path, **kwargs: Any) -> AbstractContextManager[Monitoring]:
    """``with running(D, receiver=URL) as chain:`` ``up`` ... ``down``, even when the body raises."""
    return localcluster.session(up, down, directory, kwargs)


def alerts(chain: Monitoring) -> list[dict[str, Any]]:
    """The alerts Prometheus holds now (pending and firing), from its API."""
    with urllib.request.urlopen(f"{chain.prometheus_url}/api/v1/alerts", timeout=10) as answer:
        return json.loads(answer.read())["data"]["alerts"]


def status(directory: str | Path) -> dict[str, Any]:
    chain = load(directory)
    processes = localcluster.recorded_processes(chain.directory)
    ready = {"prometheus": _ready(chain.prometheus_url), "alertmanager": _ready(chain.alertmanager_url)}
    targets = sorted(p.name for p in (chain.directory / "targets").glob("*.json"))
    return {"directory": str(chain.directory), "prometheus": chain.prometheus_url,
            "alertmanager": chain.alertmanager_url, "receiver": chain.receiver, "targets": targets,
            "processes": processes, "ready": ready,
            "running": bool(processes) and all(p["alive"] for p in processes.values()) and all(ready.values())}


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m spikeops.sim.monitoring",
                                     description="A local Prometheus and Alertmanager wired to a spikeops receiver.")
    sub = parser.add_subparsers(dest="command", required=True)
    start = sub.add_parser("up", help="start Prometheus and Alertmanager and wait until both are ready")
    start.add_argument("--dir", required=True, type=Path, help="directory (new, empty, or a stopped chain's)")
    start.add_argument("--receiver", default="http://127.0.0.1:8787/alerts/alertmanager",
                       help="the spikeops receiver's Alertmanager URL (default: spikeops serve's default)")
    start.add_argument("--target", action="append", default=[], metavar="HOST:PORT",
                       help="a job's exporter to scrape (repeatable; more later with the target command)")
    start.add_argument("--scrape-interval", default="1s", help="default 1s (production: 15s)")
    start.add_argument("--evaluation-interval", default="1s", help="default 1s (production: 15s)")
    start.add_argument("--group-wait", help="Alertmanager's group_wait (default: alertmanager-local.yml's)")
    start.add_argument("--group-interval", help="Alertmanager's group_interval")
    start.add_argument("--repeat-interval", help="Alertmanager's repeat_interval")
    target = sub.add_parser("target", help="scrape one more exporter")
    target.add_argument("--dir", required=True, type=Path)
    target.add_argument("address", metavar="HOST:PORT")
    stop_cmd = sub.add_parser("down", help="stop Prometheus and Alertmanager (idempotent)")
    stop_cmd.add_argument("--dir", required=True, type=Path)
    show = sub.add_parser("status", help="what is running; exit 0 when both are up and ready")
    show.add_argument("--dir", required=True, type=Path)
    show.add_argument("--json", action="store_true")
    return parser


def _print_up(chain: Monitoring, seconds: float) -> None:
    print(f"up: Prometheus at {chain.prometheus_url} (scrape {chain.scrape_interval}, evaluation "
          f"{chain.evaluation_interval}), Alertmanager at {chain.alertmanager_url} -> {chain.receiver} ({seconds:.1f} s)")
    print(f"scrape a job: python -m spikeops.sim.monitoring target --dir {chain.directory} HOST:PORT")
    print(f"stop: infra/monitoring/down --dir {chain.directory}")


def _print_status(state: Mapping[str, Any]) -> None:
    print(f"{'running' if state['running'] else 'NOT running'}: {state['directory']}; Prometheus "
          f"{state['prometheus']} ({'ready' if state['ready']['prometheus'] else 'not ready'}), Alertmanager "
          f"{state['alertmanager']} ({'ready' if state['ready']['alertmanager'] else 'not ready'}); "
          f"{len(state['targets'])} target(s); alerts to {state['receiver']}")


def main(argv: Sequence[str] | None = None) -> int:
    """Exit 0 on success; 1 for ``status`` of a chain not fully up; 2 with a one-line reason."""
    args = _parser().parse_args(argv)
    if args.command == "target":
        try:
            print(f"scraping {args.address}: {add_target(args.dir, args.address)}")
        except (ValueError, OSError) as exc:
            sys.stderr.write(f"spikeops.sim.monitoring: {exc}\n")
            return 2
        return 0
    return localcluster.command_line(
        "spikeops.sim.monitoring", args,
        start=lambda: up(args.dir, receiver=args.receiver, targets=args.target, scrape_interval=args.scrape_interval,
                         evaluation_interval=args.evaluation_interval, group_wait=args.group_wait,
                         group_interval=args.group_interval, repeat_interval=args.repeat_interval),
        down=down, status=status, show_up=_print_up, show_status=_print_status)


if __name__ == "__main__":
    sys.exit(main())
