"""The production topology, runnable on one machine: ``infra/prefect/up DIR --config spikeops.toml``.

Starts, in DIR:
- Debian's PostgreSQL, a private cluster on a free loopback port (``spikeops.deployments.postgres``);
- a Prefect server on it (``PREFECT_API_DATABASE_CONNECTION_URL=postgresql+asyncpg://...``);
- one process work pool per cluster of the configuration and the flows deployed to each
  (``spikeops.deployments.pools``: ``incident-response/CLUSTER``, the cluster fixed);
- ``--workers N`` Prefect workers per pool, each with ``SPIKEOPS_CONFIG`` in its environment
  (the flow runs they start read the configuration there);
- spikeops' ledger in the same PostgreSQL: the database ``spikeops`` of a role of its own, whose
  password only ``DIR/ledger-pgpass`` holds; the workers get ``SPIKEOPS_LEDGER_URL`` (no
  password in it) and ``PGPASSFILE`` (a path), never the password itself;
and prints ``export PREFECT_API_URL=...`` (and the ledger's two variables) on stdout (progress goes to stderr, so
``eval "$(infra/prefect/up DIR --config spikeops.toml)"`` works). Then ``spikeops serve
--receiver-only`` routes each alert to its cluster's deployment. ``infra/prefect/down DIR``
stops all of it, by pid, and nothing else; ``python -m spikeops.deployments.topology status DIR``
says what runs.

The workers get the environment of the ``up`` that started them (SLACK_BOT_TOKEN, SSH agent,
SLURM_CONF...) and never the database's password, which only the server holds. In
production each piece sits on its own machine (``infra/production.md``); here they are
processes side by side, which is what the tests and ``bench/bench_scaleout.py`` run.

Layout of DIR (written by ``up``)::

    topology.json    what runs: ports, pids, pools, deployments (no secret)
    pgpass           the database password, mode 0600, libpq's format
    ledger-pgpass    the ledger role's password, the same way
    postgres/data    PostgreSQL's files (the postgres user's, when run as root)
    prefect-home/    PREFECT_HOME of the server and the workers
    log/             postgres.log  prefect-server.log  worker-CLUSTER-N.log
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from spikeops.deployments import postgres
from spikeops.config import check_config, load_config
from spikeops.errors import InputError, SpikeopsError
from spikeops.sim.processes import pid_alive, proc_read, scan, stop

__all__ = ["Topology", "TopologyError", "up", "down", "status", "deploy", "main", "FORMAT", "MARKER"]

FORMAT = "spikeops-prefect-topology/1"
#: Every process started for DIR carries ``MARKER=DIR`` in its environment: ``down`` finds them by it.
MARKER = "SPIKEOPS_TOPOLOGY"
_ENTRIES = ("topology.json", "pgpass", "ledger-pgpass", "postgres", "prefect-home", "log")
#: The server's database settings. Prefect's defaults (a 5 s connect timeout, a pool of 5 that
#: opens and closes overflow connections in every burst) gave 500s when a burst of incidents
#: met a loaded 2-core machine: a new PostgreSQL connection (a forked backend, SCRAM) took
#: over 5 s. A larger pool keeps connections open; the timeouts allow for a busy machine.
SERVER_DATABASE = {"PREFECT_SERVER_DATABASE_CONNECTION_TIMEOUT": "30", "PREFECT_SERVER_DATABASE_TIMEOUT": "30",
                   "PREFECT_SERVER_DATABASE_SQLALCHEMY_POOL_SIZE": "20",
                   "PREFECT_SERVER_DATABASE_SQLALCHEMY_MAX_OVERFLOW": "20"}
BIN = Path(sys.executable).parent


class TopologyError(SpikeopsError):
    """The layout cannot be started, found or stopped; one line says why."""


@dataclass
class Topology:
    """What ``up`` started, as ``DIR/topology.json`` holds it."""

    directory: str
    config: str
    api_url: str
    ui_url: str | None
    postgres_port: int
    postgres_data: str
    server_pid: int | None = None
    workers: dict[str, int] = field(default_factory=dict)  # worker name -> pid
    pools: dict[str, list[str]] = field(default_factory=dict)  # pool -> its deployments
    started: str = ""
    format: str = FORMAT
    #: The ledger's URL (no password: ``ledger_passfile`` holds it).
    ledger_url: str | None = None
    ledger_passfile: str | None = None


def _say(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def _load(root: Path) -> Topology | None:
    try:
        document = json.loads((root / "topology.json").read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(document, dict) or document.get("format") != FORMAT:
        return None
    return Topology(**{k: v for k, v in document.items() if k in Topology.__dataclass_fields__})


def _save(root: Path, topology: Topology) -> None:
    target = root / "topology.json"
    target.write_text(json.dumps(asdict(topology), indent=2) + "\n")


def _marked(root: Path) -> Any:
    needle = f"{MARKER}={root}".encode()

    def match(pid: int) -> bool:
        return needle in proc_read(pid, "environ").split(b"\0")

    return match


def _processes(root: Path) -> set[int]:
    """Every live process started for DIR (and their children), never this one."""
    return scan(_marked(root))


def _wait_http(url: str, seconds: float, process: subprocess.Popen[bytes], log: Path) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if process.poll() is not None:
            tail = log.read_text(errors="replace").strip().splitlines()[-1:] if log.is_file() else []
            raise TopologyError(f"{process.args[1] if isinstance(process.args, list) else process.args} exited "
                                f"{process.returncode}: {tail[0] if tail else 'no message'} (log: {log})")
        try:
            with urllib.request.urlopen(url, timeout=3):
                return
        except (urllib.error.URLError, OSError):
            time.sleep(0.5)
    raise TopologyError(f"{url} did not answer within {seconds:.0f} s (log: {log})")


def _post_json(url: str, body: Mapping[str, Any]) -> Any:
    request = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=10) as answer:
        return json.loads(answer.read())


def _online_workers(api: str, pool: str) -> set[str]:
    try:
        workers = _post_json(f"{api}/work_pools/{pool}/workers/filter", {})
    except (urllib.error.URLError, OSError, ValueError):
        return set()
    return {w["name"] for w in workers if w.get("status") == "ONLINE"}


def deploy(config_path: str | Path, api_url: str) -> dict[str, list[str]]:
    """Pools and deployments of every cluster on the Prefect server at ``api_url``."""
    from prefect.settings import PREFECT_API_URL, temporary_settings

    from spikeops.deployments.pools import deploy as deploy_pools

    with temporary_settings(updates={PREFECT_API_URL: api_url}):
        return deploy_pools(load_config(config_path))


def _check_directory(root: Path) -> None:
    if _processes(root):
        raise TopologyError(f"{root}: a topology runs there (infra/prefect/down {root} first)")
    if root.is_dir() and any(root.iterdir()):
        foreign = sorted(p.name for p in root.iterdir() if p.name not in _ENTRIES)
        if foreign or _load(root) is None:
            raise TopologyError(f"{root} is not empty and holds no stopped topology "
                                f"({', '.join(foreign[:3]) or 'no topology.json'}): choose another directory")
        _say(f"replacing the stopped topology in {root}")
        if (root / "postgres").exists():
            postgres.remove(root / "postgres")
        for name in _ENTRIES:
            target = root / name
            if target.is_dir():
                shutil.rmtree(target)
            elif target.exists():
                target.unlink()


def up(directory: str | Path, config_path: str | Path, *, workers: int = 1, ui: bool = True,
       port: int | None = None, poll_s: float = 2.0, ready_timeout: float = 180.0, limit: int | None = None,
       env: Mapping[str, str] | None = None, warm: bool = True) -> Topology:
    """Start the whole layout in ``directory`` for the clusters of ``config_path``; on any
    failure, what was started is stopped again. ``limit``: flow runs one worker runs at once
    (None: Prefect's default, no limit). ``env``: the workers' environment (default this
    process's), to which SPIKEOPS_CONFIG, PREFECT_API_URL and the marker are added. ``warm``:
    the workers are ``spikeops worker`` (runs of our flows forked warm); False: Prefect's own
    ``prefect worker start --type process`` (every run a new interpreter), the baseline."""
    if not 1 <= workers <= 32:
        raise InputError(f"--workers must be from 1 to 32, not {workers}")
    config_file = Path(config_path).expanduser().resolve()
    config = load_config(config_file)  # InputError: one line naming the key
    if not config.clusters:
        raise InputError(f"{config_file}: no [clusters.NAME] configured: nothing to deploy")
    problems = check_config(config)
    if problems:
        raise InputError(f"{config_file}: {problems[0]}")
    root = Path(directory).expanduser().resolve()
    _check_directory(root)
    root.mkdir(parents=True, exist_ok=True)
    (root / "log").mkdir(exist_ok=True)
    (root / "prefect-home").mkdir(exist_ok=True)
    marker = {MARKER: str(root)}
    try:
        return _start(root, config_file, config, marker, workers=workers, ui=ui, port=port, poll_s=poll_s,
                      ready_timeout=ready_timeout, limit=limit, env=env, warm=warm)
    except BaseException:
        try:
            down(root, quiet=True)
        except SpikeopsError as exc:
            _say(f"could not stop everything again: {exc}")
        raise


def _start(root: Path, config_file: Path, config: Any, marker: dict[str, str], *, workers: int, ui: bool,
           port: int | None, poll_s: float, ready_timeout: float, limit: int | None, warm: bool,
           env: Mapping[str, str] | None) -> Topology:
    t0 = time.monotonic()
    server_db = postgres.init(root / "postgres")
    postgres.start(server_db, root / "log" / "postgres.log", marker)
    _say(f"[{time.monotonic() - t0:5.1f}s] postgres: {server_db.display_url} (data in {server_db.data})")
    ledger_url = postgres.create_ledger(server_db, root / "ledger-pgpass")
    _say(f"[{time.monotonic() - t0:5.1f}s] ledger: {ledger_url} (its password in {root / 'ledger-pgpass'})")
    port = port or postgres.free_port()
    api = f"http://127.0.0.1:{port}/api"
    topology = Topology(directory=str(root), config=str(config_file), api_url=api,
                        ui_url=f"http://127.0.0.1:{port}" if ui else None, postgres_port=server_db.port,
                        postgres_data=str(server_db.data), ledger_url=ledger_url,
                        ledger_passfile=str(root / "ledger-pgpass"))
    _save(root, topology)
    base = {k: v for k, v in (env if env is not None else os.environ).items()
            if not k.startswith(("PREFECT_API_DATABASE", "PREFECT_SERVER_DATABASE"))}
    base.update(marker)
    base["PREFECT_HOME"] = str(root / "prefect-home")
    server_env = {**base, "PREFECT_API_DATABASE_CONNECTION_URL": server_db.url, **SERVER_DATABASE,
                  "PREFECT_SERVER_ANALYTICS_ENABLED": "false", "PREFECT_UI_ENABLED": "true" if ui else "false"}
    server_env.pop("PREFECT_API_URL", None)
    server_log = root / "log" / "prefect-server.log"
    with open(server_log, "ab") as log:
        server = subprocess.Popen([str(BIN / "prefect"), "server", "start", "--host", "127.0.0.1", "--port",
                                   str(port)], env=server_env, stdout=log, stderr=subprocess.STDOUT,
                                  stdin=subprocess.DEVNULL, start_new_session=True)
    topology.server_pid = server.pid
    _save(root, topology)
    _wait_http(f"{api}/health", ready_timeout, server, server_log)
    _say(f"[{time.monotonic() - t0:5.1f}s] prefect server: {topology.ui_url or api} on PostgreSQL")
    topology.pools = deploy(config_file, api)
    _save(root, topology)
    for pool, names in topology.pools.items():
        _say(f"[{time.monotonic() - t0:5.1f}s] work pool {pool}: {', '.join(names)}")
    worker_env = {**base, "PREFECT_API_URL": api, "SPIKEOPS_CONFIG": str(config_file),
                  "PREFECT_WORKER_QUERY_SECONDS": f"{poll_s:g}", "PREFECT_WORKER_PREFETCH_SECONDS": "5",
                  "SPIKEOPS_LEDGER_URL": ledger_url, "PGPASSFILE": str(root / "ledger-pgpass")}
    for pool in topology.pools:
        for index in range(1, workers + 1):
            name = f"{pool.removeprefix('spikeops-')}-{index}"
            worker_log = root / "log" / f"worker-{name}.log"
            with open(worker_log, "ab") as log:
                argv = ([str(BIN / "spikeops"), "worker", "--pool", pool, "--name", name] if warm else
                        [str(BIN / "prefect"), "worker", "start", "--pool", pool, "--type", "process", "--name", name])
                process = subprocess.Popen(argv + (["--limit", str(limit)] if limit else []), env=worker_env,
                                           stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                           start_new_session=True)
            topology.workers[name] = process.pid
    _save(root, topology)
    deadline = time.monotonic() + ready_timeout
    for pool in topology.pools:
        wanted = {name for name in topology.workers if f"spikeops-{name.rsplit('-', 1)[0]}" == pool}
        while not wanted <= _online_workers(api, pool):
            dead = [name for name, pid in topology.workers.items() if not pid_alive(pid)]
            if dead:
                tail = (root / "log" / f"worker-{dead[0]}.log").read_text(errors="replace").strip().splitlines()
                raise TopologyError(f"worker {dead[0]} exited: {tail[-1] if tail else 'no message'}")
            if time.monotonic() > deadline:
                raise TopologyError(f"workers of {pool} not online within {ready_timeout:.0f} s (log/worker-*.log)")
            time.sleep(0.5)
    topology.started = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    _save(root, topology)
    _say(f"[{time.monotonic() - t0:5.1f}s] {len(topology.workers)} worker(s) online: "
         + ", ".join(sorted(topology.workers)))
    return topology


def down(directory: str | Path, *, quiet: bool = False) -> int:
    """Stop the workers (and their flow runs), the server and PostgreSQL of DIR, by pid and
    by the marker in their environment, and nothing else; files stay. Idempotent; returns
    how many processes were stopped."""
    root = Path(directory).expanduser().resolve()
    topology = _load(root)
    count = 0
    if topology is not None:  # the workers first: they would only retry against a stopping server
        for pid in topology.workers.values():
            count += stop(lambda pid=pid: scan(lambda _p: False, [pid]), f"worker {pid}", grace=10, timeout=30)
        if topology.server_pid:
            count += stop(lambda: scan(lambda _p: False, [topology.server_pid]), "the Prefect server",
                          grace=10, timeout=30)
    data = Path(topology.postgres_data) if topology else root / "postgres" / "data"
    try:
        if postgres.stop(data):
            count += 1
    except postgres.PostgresError as exc:
        if not quiet:
            _say(f"{exc}; stopping its processes by pid instead")
    count += stop(lambda: _processes(root), f"the topology in {root}", grace=5, timeout=30)
    return count


def status(directory: str | Path) -> dict[str, Any]:
    """What runs in DIR: each piece alive or not."""
    root = Path(directory).expanduser().resolve()
    topology = _load(root)
    if topology is None:
        raise TopologyError(f"{root}: no topology.json (infra/prefect/up {root} --config FILE)")
    return {
        "directory": str(root), "api_url": topology.api_url, "ui_url": topology.ui_url,
        "postgres": {"port": topology.postgres_port, "running": postgres.running(Path(topology.postgres_data))},
        "server": {"pid": topology.server_pid, "running": bool(topology.server_pid and pid_alive(topology.server_pid))},
        "workers": {name: pid_alive(pid) for name, pid in topology.workers.items()},
        "pools": topology.pools, "processes": len(_processes(root)), "ledger": topology.ledger_url,
    }


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="infra/prefect/up", description="The scale-out layout on this machine: PostgreSQL, a Prefect server on "
        "it, one process work pool per cluster of spikeops.toml with its workers, the flows deployed to each "
        "(incident-response/CLUSTER). Then: spikeops serve --receiver-only.")
    actions = parser.add_subparsers(dest="action", required=True, metavar="up|down|status|deploy")
    started = actions.add_parser("up", help="start everything in DIR; prints export PREFECT_API_URL=...")
    started.add_argument("directory", metavar="DIR", help="where everything lives (empty, or a stopped topology)")
    started.add_argument("--config", required=True, help="spikeops.toml (its clusters become work pools)")
    started.add_argument("--workers", type=int, default=1, help="workers per pool (default 1)")
    started.add_argument("--port", type=int, default=None, help="the Prefect server's port (default: a free one)")
    started.add_argument("--no-ui", action="store_true", help="the API without the UI")
    started.add_argument("--limit", type=int, default=None,
                         help="flow runs one worker runs at once (default: no limit, Prefect's)")
    started.add_argument("--poll", type=float, default=2.0,
                         help="seconds between a worker's polls for new runs (default 2; Prefect's is 10)")
    started.add_argument("--cold-workers", action="store_true",
                         help="Prefect's own process workers (each run a new interpreter) instead of spikeops worker")
    stopped = actions.add_parser("down", help="stop everything started in DIR")
    stopped.add_argument("directory", metavar="DIR")
    shown = actions.add_parser("status", help="what runs in DIR")
    shown.add_argument("directory", metavar="DIR")
    deployed = actions.add_parser("deploy", help="(re)create the pools and deployments on PREFECT_API_URL")
    deployed.add_argument("--config", required=True, help="spikeops.toml")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        if args.action == "up":
            topology = up(args.directory, args.config, workers=args.workers, ui=not args.no_ui, port=args.port,
                          poll_s=args.poll, limit=args.limit, warm=not args.cold_workers)
            _say(f"stop it all with: infra/prefect/down {topology.directory}")
            _say("route alerts with: spikeops serve --receiver-only --config " + topology.config)
            print(f"export PREFECT_API_URL={topology.api_url}", flush=True)
            if topology.ledger_url:  # the receiver's /metrics and `spikeops incidents` read the same ledger
                print(f"export SPIKEOPS_LEDGER_URL={topology.ledger_url}", flush=True)
                print(f"export PGPASSFILE={topology.ledger_passfile}", flush=True)
        elif args.action == "down":
            count = down(args.directory)
            _say(f"stopped {count} process(es) of {Path(args.directory).resolve()}")
        elif args.action == "status":
            print(json.dumps(status(args.directory), indent=2))
        else:
            from prefect.settings import PREFECT_API_URL

            api = PREFECT_API_URL.value()
            if not api:
                raise InputError("PREFECT_API_URL is not set: which Prefect server?")
            for pool, names in deploy(args.config, api).items():
                print(f"{pool}: {', '.join(names)}")
    except (SpikeopsError, ValueError) as exc:
        print(f"infra/prefect/{args.action}: {str(exc).splitlines()[0] if str(exc) else type(exc).__name__}",
              file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
