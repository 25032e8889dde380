"""The ledger on PostgreSQL: a private Debian PostgreSQL (``spikeops.deployments.postgres``, as
the scale-out layout starts it), the ledger's own role and database, its password only in a
0600 passfile; two worker processes that migrate a fresh database and write incidents of one
lineage at the same time, each asking for automatic resumes: no lost update, and never more
resumes than the budget."""

from __future__ import annotations

import io
import json
import multiprocessing
import os
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest

from spikeops.deployments import postgres
from spikeops.sim import cluster as simcluster

pytestmark = pytest.mark.skipif(os.geteuid() != 0 and postgres.bin_dir() is None,
                                reason="needs PostgreSQL (or root to install it)")


@pytest.fixture(scope="module")
def ledger_db() -> Iterator[tuple[str, Path, str]]:
    """(URL without a password, its passfile, the password) of a fresh ledger database."""
    with simcluster.scratch("spikeops-ledger-pg-") as home:
        server = postgres.init(home / "postgres")
        try:
            postgres.start(server, home / "postgres.log")
            passfile = home / "ledger-pgpass"
            url = postgres.create_ledger(server, passfile)
            yield url, passfile, passfile.read_text().strip().rsplit(":", 1)[1]
        finally:
            postgres.stop(server.data, server.bin)


def _worker(url: str, passfile: str, name: str, count: int, results: Any) -> None:
    os.environ["PGPASSFILE"] = passfile
    from spikeops.ledger.store import Ledger, stamp

    granted = 0
    with Ledger(url) as ledger:  # both migrate the fresh database at once: one waits for the other
        for index in range(count):
            incident, job = f"inc-{name}-{index}", f"{name}{index}"
            ledger.apply({"incident": {"incident_id": incident, "cluster": "pg", "job_id": job, "lineage": "L",
                                       "opened": stamp(datetime.now(UTC)), "cause": "gpu_xid"},
                          "jobs": [{"cluster": "pg", "job_id": job, "lineage": "L"}]})
            granted += ledger.reserve_resume(cluster="pg", lineage="L", incident_id=incident, job_id=job, limit=4,
                                             window_s=3600).granted
    results.put(granted)


def test_two_workers_write_one_lineage_at_once_on_postgresql(ledger_db: tuple[str, Path, str],
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    url, passfile, password = ledger_db
    assert password not in url and oct(passfile.stat().st_mode & 0o777) == "0o600"
    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    workers = [context.Process(target=_worker, args=(url, str(passfile), name, 20, results)) for name in "ab"]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join(300)
        assert worker.exitcode == 0
    assert results.get(timeout=5) + results.get(timeout=5) == 4
    monkeypatch.setenv("PGPASSFILE", str(passfile))
    from spikeops.ledger.store import HEAD, Ledger

    with Ledger(url) as ledger:
        assert ledger.revision() == HEAD and ledger.lineage_count("pg", "L") == 40
        assert len(ledger.lineage_incidents("pg", "L")) == 40
        assert ledger.budget(cluster="pg", lineage="L", limit=4, window_s=3600).used == 4
    # the command line on it: the URL names no password, and none is printed
    from spikeops.cli import main as cli

    out, err = io.StringIO(), io.StringIO()
    monkeypatch.setenv("SPIKEOPS_LEDGER_URL", url)
    assert cli(["incidents", "list", "--json", "--since", "all"], out=out, err=err) == 0, err.getvalue()
    assert len(json.loads(out.getvalue())) == 40
    out = io.StringIO()
    assert cli(["ledger", "info"], out=out, err=err) == 0 and "postgresql+psycopg://spikeops_ledger@" in out.getvalue()
    # a wrong password: one line, masked
    monkeypatch.delenv("PGPASSFILE")
    bad = url.replace("spikeops_ledger@", f"spikeops_ledger:{password}x@")
    out, err = io.StringIO(), io.StringIO()
    monkeypatch.setenv("SPIKEOPS_LEDGER_URL", bad)
    assert cli(["ledger", "info"], out=out, err=err) == 2
    assert password not in err.getvalue() and "***" in err.getvalue() and err.getvalue().count("\n") == 1
