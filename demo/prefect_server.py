"""The demo's own Prefect API server, started as cheaply as this machine allows.

Prefect's server start was most of ``spikeops demo``'s time (bench/README.md): its import in the
demo's process, the migrations of a new database, and the senders left to drain at exit. Each
is dealt with here, apart from the demo's story in ``run.py``.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

__all__ = ["ApiProcess", "PrefectServer", "drain_prefect", "preload", "quiet_prefect_environment", "template_path",
           "free_port"]


def free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def quiet_prefect_environment(directory: Path) -> None:
    """The ephemeral Prefect server keeps its database in the demo directory, never in the
    user's profile, and says nothing the demo does not print itself; so does the ledger."""
    home = directory / "prefect"
    home.mkdir(parents=True, exist_ok=True)
    os.environ.update({
        "PREFECT_HOME": str(home),
        "PREFECT_SERVER_DATABASE_CONNECTION_URL": f"sqlite+aiosqlite:///{home / 'demo.db'}",
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        "PREFECT_UI_ENABLED": "false",
        "PREFECT_LOGGING_LEVEL": "ERROR",
        "PREFECT_LOGGING_TO_API_ENABLED": "false",
        # the demo's incidents go to a ledger of its own, never the user's (docs/ledger.md)
        "SPIKEOPS_LEDGER_URL": f"sqlite:///{directory / 'ledger.db'}",
    })
    os.environ.pop("PREFECT_API_URL", None)  # never the user's server: the demo brings its own
    os.environ.pop("SLACK_BOT_TOKEN", None)  # the demo posts to the outbox, never to a real workspace


class ApiProcess:
    """Prefect's API as ``SubprocessASGIServer`` runs it (uvicorn on its app factory, the UI
    off, marked ephemeral), started without importing ``prefect.server`` in this process:
    that import alone was 3-4 s of the demo's CPU, spent while the cluster and the server
    itself were starting on the same two cores."""

    def __init__(self) -> None:
        import importlib.util

        spec = importlib.util.find_spec("prefect")
        self.site = Path(spec.origin).resolve().parents[1] if spec and spec.origin else None
        self.port = free_port()
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def api_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/api"

    def start(self, timeout: float) -> None:
        import urllib.error
        import urllib.request

        if self.site is None:
            raise RuntimeError("prefect is not installed")
        env = {**os.environ, "PREFECT_UI_ENABLED": "0", "PREFECT__SERVER_EPHEMERAL": "1", "PREFECT__SERVER_FINAL": "1"}
        self.process = subprocess.Popen(
            [sys.executable, "-m", "uvicorn", "--app-dir", str(self.site), "--factory",
             "prefect.server.api.server:create_app", "--host", "127.0.0.1", "--port", str(self.port),
             "--log-level", "error", "--lifespan", "on"],
            env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                tail = (self.process.stderr.read() if self.process.stderr else b"").decode(errors="replace")
                raise RuntimeError(f"exited {self.process.returncode}: {tail.strip().splitlines()[-1:] or ''}")
            try:
                with urllib.request.urlopen(f"{self.api_url}/health", timeout=2) as answer:
                    if answer.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(0.1)
        raise RuntimeError(f"no answer within {timeout:.0f} s")

    def stop(self) -> None:
        process, self.process = self.process, None
        if process is None or process.poll() is not None:
            return
        process.terminate()
        try:
            process.wait(5)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


class PrefectServer:
    """An ephemeral Prefect API server, started in a thread while the cluster comes up.

    A new Prefect database is migrated at the server's start: 5-7 s of the demo on this 2-core
    machine. So the first demo keeps a copy of its freshly migrated, still empty database in
    the user's cache (``template_path``: one per Prefect version, written with SQLite's backup
    API while nothing else writes), and later demos start from that copy, which Prefect then
    only checks. A copy that does not serve is dropped and the server started from nothing."""

    def __init__(self, database: Path | None = None) -> None:
        self.server: Any = None
        self.error: BaseException | None = None
        self.database = database
        self.templated = False
        self.thread = threading.Thread(target=self._start, name="demo-prefect", daemon=True)
        self.thread.start()

    def _start(self) -> None:
        try:
            template = template_path()
            if self.database is not None and template.is_file():
                if usable_template(template):
                    shutil.copyfile(template, self.database)
                    self.templated = True
                else:
                    template.unlink(missing_ok=True)
            server = ApiProcess()
            try:
                server.start(timeout=90)
            except Exception:
                server.stop()
                if not self.templated:
                    raise
                self.database.unlink(missing_ok=True)  # type: ignore[union-attr]  # a stale or broken copy
                template.unlink(missing_ok=True)
                self.templated = False
                server = ApiProcess()
                server.start(timeout=90)
            self.server = server
            if self.database is not None and not self.templated:
                save_template(self.database, template)
        except BaseException as exc:  # reported by ready()
            self.error = exc

    def ready(self) -> str:
        self.thread.join()
        if self.error is not None or self.server is None:
            raise RuntimeError(f"the Prefect server did not start: {self.error}")
        return self.server.api_url

    def stop(self) -> None:
        self.thread.join()
        if self.server is not None:
            self.server.stop()


def drain_prefect() -> None:
    """Prefect's background senders (events, run logs) emptied now. Left to the interpreter's
    exit, they waited 1.5-2 s on connections to the demo's server, stopped by then."""
    with contextlib.suppress(Exception):
        from prefect.events.worker import EventsWorker

        EventsWorker.drain_all(timeout=5)
    with contextlib.suppress(Exception):
        from prefect.logging.handlers import APILogWorker

        APILogWorker.drain_all(timeout=5)


def preload() -> None:
    """What the incident flow would otherwise do first, done while the cluster and the server
    start: its modules imported (Prefect's engine, the diagnosis, pandas), matplotlib loaded for
    the plot, and the demo's own ledger created and migrated (Alembic: a second on its own)."""
    with contextlib.suppress(Exception):
        import importlib

        for module in ("spikeops.flows.incident_response", "spikeops.diagnosis.engine", "spikeops.notify.plot",
                       "matplotlib.pyplot"):
            importlib.import_module(module)
    with contextlib.suppress(Exception):
        from spikeops.ledger.store import Ledger

        Ledger(os.environ.get("SPIKEOPS_LEDGER_URL"))  # migrated once per process: the flow's finds it done


def template_path() -> Path:
    """Where the migrated, empty demo database of this Prefect version is kept (the version
    from the package's metadata: importing Prefect to ask would cost a second)."""
    from importlib.metadata import version

    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "spikeops"
    return cache / f"prefect-demo-{version('prefect')}.db"


def usable_template(template: Path) -> bool:
    """A SQLite database that Prefect's migrations have stamped (a quick look, not a check of
    every page: the server's own start is that check)."""
    import sqlite3

    try:
        with contextlib.closing(sqlite3.connect(f"file:{template}?mode=ro", uri=True)) as db:
            return db.execute("select count(*) from alembic_version").fetchone()[0] == 1
    except sqlite3.Error:
        return False


def save_template(database: Path, template: Path) -> None:
    """A consistent copy of ``database`` (its WAL included) at ``template``, written whole or
    not at all; a cache that cannot be written only costs the next demo the migrations."""
    import sqlite3

    partial = template.with_suffix(f".{os.getpid()}.tmp")
    try:
        template.parent.mkdir(parents=True, exist_ok=True)
        source, copy = sqlite3.connect(database), sqlite3.connect(partial)
        try:
            source.backup(copy)
        finally:
            source.close()
            copy.close()
        os.replace(partial, template)
    except (OSError, sqlite3.Error):
        with contextlib.suppress(OSError):
            partial.unlink(missing_ok=True)
