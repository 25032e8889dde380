"""The ledger's database: open (and migrate) it, write incident entries, read lineages,
budgets, nodes and incidents back.

Writes are transactions. An entry (``spikeops.ledger.entry``) is applied whole or not at all,
idempotently: the incident and the resume are upserted by incident id (a value the entry
does not know never erases one the ledger has), the jobs by (cluster, job), a node event by
(incident, node, kind). A lineage's incident count is incremented in place, only when the
incident is new, so concurrent writers lose no update. The restart budget is decided under
the lineage's row lock (``SELECT ... FOR UPDATE`` on PostgreSQL; SQLite's writer lock, taken
with ``BEGIN IMMEDIATE`` and waited for up to ``busy_timeout``): the reservation of an
automatic resume and the count it is checked against are one transaction.

Every failure is a ``LedgerError`` whose message masks the URL's password.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from importlib import resources
from pathlib import Path
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection, Engine

from spikeops.ledger import schema
from spikeops.ledger.url import LedgerError, ledger_url, mask_url

__all__ = ["Ledger", "Budget", "stamp", "parse_stamp", "SQLITE_BUSY_S", "CONNECT_TIMEOUT_S", "HEAD"]

#: How long a SQLite writer waits for another's lock before giving up.
SQLITE_BUSY_S = 30
#: How long a PostgreSQL connection may take (an unreachable ledger must not hold an incident up).
CONNECT_TIMEOUT_S = 5
#: The newest migration this code knows.
HEAD = "0002"
#: Resume states that spend the budget.
_SPENDING = ("reserved", "done")
_upgraded: set[str] = set()
_upgrade_lock = threading.Lock()


def stamp(moment: datetime | None = None) -> str:
    """A ledger time: ISO 8601 UTC, whole seconds, ``Z`` (sorts as text)."""
    moment = (moment or datetime.now(UTC)).astimezone(UTC)
    return moment.strftime("%Y-%m-%dT%H:%M:%SZ")


def parse_stamp(text: str | None) -> datetime | None:
    from spikeops.timeparse import parse_any

    return parse_any(text) if text else None


@dataclass
class Budget:
    """The restart budget of one lineage: whether an automatic resume may be made now."""

    granted: bool
    used: int
    limit: int
    window_s: int
    #: The automatic resumes in the window (incident, time, checkpoint path, new job).
    spent: list[dict[str, Any]] = field(default_factory=list)

    def describe(self) -> str:
        hours = self.window_s / 3600
        window = f"{hours:g} h" if hours >= 1 else f"{self.window_s // 60} min"
        return f"{self.used} of {self.limit} automatic resumes of this lineage in {window}"


def _engine(url: str) -> Engine:
    if url.startswith("sqlite"):
        path = url.split(":///", 1)[1] if ":///" in url else ""
        if path and path != ":memory:":
            Path(path).parent.mkdir(parents=True, exist_ok=True)
        engine = sa.create_engine(url, connect_args={"timeout": SQLITE_BUSY_S}, poolclass=sa.pool.NullPool)

        @sa.event.listens_for(engine, "connect")
        def _pragmas(dbapi: Any, _record: Any) -> None:
            dbapi.isolation_level = None  # SQLAlchemy emits BEGIN below, not the driver
            cursor = dbapi.cursor()
            cursor.execute("PRAGMA journal_mode=WAL")  # readers do not wait for the writer
            cursor.execute(f"PRAGMA busy_timeout={SQLITE_BUSY_S * 1000}")
            cursor.execute("PRAGMA foreign_keys=ON")
            cursor.close()

        @sa.event.listens_for(engine, "begin")
        def _begin(conn: Connection) -> None:
            conn.exec_driver_sql("BEGIN IMMEDIATE")  # the writer lock at once: no upgrade deadlock

        return engine
    return sa.create_engine(url, connect_args={"connect_timeout": CONNECT_TIMEOUT_S}, pool_pre_ping=True,
                            pool_size=2, max_overflow=4)


def _first_line(exc: BaseException) -> str:
    text = str(getattr(exc, "orig", None) or exc).strip().splitlines()
    return (text[0] if text else type(exc).__name__)[:300]


class Ledger:
    """The ledger at ``url`` (default: ``spikeops.ledger.url.ledger_url()``), migrated to the
    newest schema on first use in this process."""

    def __init__(self, url: str | None = None, *, upgrade: bool = True) -> None:
        self.url = ledger_url(url)
        self.display_url = mask_url(self.url)
        try:
            self.engine = _engine(self.url)
        except ModuleNotFoundError as exc:
            raise LedgerError(f"ledger {self.display_url}: the driver is not installed ({exc.name}; for PostgreSQL: "
                              "pip install 'spikeops[postgres]')") from None
        except Exception as exc:  # noqa: BLE001 - a bad URL or an unwritable path is one line, masked
            raise LedgerError(f"ledger {self.display_url}: cannot open: {mask_url(_first_line(exc))}") from None
        if upgrade:
            self.upgrade()

    # -- plumbing -------------------------------------------------------------------------
    @contextmanager
    def _tx(self, what: str) -> Iterator[Connection]:
        try:
            with self.engine.begin() as conn:
                yield conn
        except LedgerError:
            raise
        except sa.exc.SQLAlchemyError as exc:
            raise LedgerError(f"ledger {self.display_url}: cannot {what}: {mask_url(_first_line(exc))}") from None
        except OSError as exc:
            raise LedgerError(f"ledger {self.display_url}: cannot {what}: {exc.strerror or exc}") from None

    def close(self) -> None:
        self.engine.dispose()

    def __enter__(self) -> Ledger:
        return self

    def __exit__(self, *_: Any) -> None:
        self.close()

    def upgrade(self) -> str:
        """Run the migrations up to ``HEAD`` (once per process and URL); the revision now."""
        with _upgrade_lock:
            if self.url in _upgraded:
                return HEAD
            from alembic import command
            from alembic.config import Config

            config = Config()
            config.set_main_option("script_location", str(resources.files("spikeops.ledger") / "migrations"))
            for attempt in range(3):
                try:
                    with self.engine.begin() as conn:
                        config.attributes["connection"] = conn
                        command.upgrade(config, "head")
                    break
                except sa.exc.OperationalError as exc:  # another process created it meanwhile, or unreachable
                    if attempt == 2 or "already exists" not in str(exc):
                        raise LedgerError(f"ledger {self.display_url}: cannot open: {mask_url(_first_line(exc))}") \
                            from None
                    time.sleep(0.5)
                except sa.exc.SQLAlchemyError as exc:
                    raise LedgerError(f"ledger {self.display_url}: cannot open: {mask_url(_first_line(exc))}") from None
            _upgraded.add(self.url)
        return self.revision()

    def revision(self) -> str | None:
        with self._tx("read its schema revision") as conn:
            row = conn.execute(sa.text("SELECT version_num FROM alembic_version")).first()
        return row[0] if row else None

    # -- writing ------------------------------------------------------------------------------
    def apply(self, entry: Mapping[str, Any]) -> bool:
        """Write one incident entry (``spikeops.ledger.entry``) in one transaction; True when the
        incident was new to the ledger."""
        incident = dict(entry.get("incident") or {})
        if not incident.get("incident_id") or not incident.get("job_id"):
            raise LedgerError("a ledger entry needs incident.incident_id and incident.job_id")
        now = stamp()
        with self._tx(f"record incident {incident['incident_id']}") as conn:
            cluster, lineage = incident["cluster"], incident["lineage"]
            self._lineage_row(conn, cluster, lineage, incident.get("opened") or now)
            for job in entry.get("jobs") or []:
                _upsert(conn, schema.jobs, {**job, "recorded": job.get("recorded") or now}, ("cluster", "job_id"))
            new = _insert_new(conn, schema.incidents, {**incident, "updated": now}, ("incident_id",))
            if not new:
                _upsert(conn, schema.incidents, {**incident, "updated": now}, ("incident_id",))
            else:
                conn.execute(schema.lineages.update()
                             .where(schema.lineages.c.cluster == cluster, schema.lineages.c.lineage == lineage)
                             .values(incidents=schema.lineages.c.incidents + 1, updated=now))
            resume = entry.get("resume")
            if resume:
                _upsert(conn, schema.resumes, dict(resume), ("incident_id",))
            for event in entry.get("node_events") or []:
                if event.get("incident_id"):
                    _insert_new(conn, schema.node_events, dict(event), ("incident_id", "node", "kind"))
                else:
                    conn.execute(schema.node_events.insert().values(**event))
        return new

    def node_event(self, event: Mapping[str, Any]) -> None:
        """Append one event to a node's record (a lifecycle step: ``spikeops.lifecycle``). Its
        incident goes in ``for_incident``: many lifecycle events of one kind share an incident,
        and ``incident_id`` is the key of the incident's own entry."""
        values = {k: v for k, v in event.items() if k in schema.node_events.c and k not in ("id", "incident_id")}
        for required in ("cluster", "node", "kind"):
            if not values.get(required):
                raise LedgerError(f"a node event needs {required}")
        values.setdefault("time", stamp())
        with self._tx(f"record {values['kind']} of node {values['node']}") as conn:
            conn.execute(schema.node_events.insert().values(**values))

    def _lineage_row(self, conn: Connection, cluster: str, lineage: str, first_seen: str) -> None:
        _insert_new(conn, schema.lineages, {"cluster": cluster, "lineage": lineage, "first_seen": first_seen,
                                            "incidents": 0, "updated": first_seen}, ("cluster", "lineage"))

    def reserve_resume(self, *, cluster: str, lineage: str, incident_id: str, job_id: str, limit: int,
                       window_s: int, now: datetime | None = None) -> Budget:
        """Spend one automatic resume of ``lineage`` for ``incident_id`` if fewer than ``limit``
        were spent in the last ``window_s`` seconds, atomically (a rerun of the same incident
        finds its own reservation). Not granted: nothing is reserved."""
        moment = now or datetime.now(UTC)
        since = stamp(moment - timedelta(seconds=window_s))
        table = schema.resumes
        with self._tx(f"decide the restart budget of lineage {lineage}") as conn:
            self._lineage_row(conn, cluster, lineage, stamp(moment))
            locked = sa.select(schema.lineages.c.lineage).where(schema.lineages.c.cluster == cluster,
                                                                schema.lineages.c.lineage == lineage)
            if conn.dialect.name == "postgresql":
                locked = locked.with_for_update()
            conn.execute(locked).first()
            own = conn.execute(sa.select(table).where(table.c.incident_id == incident_id)).mappings().first()
            spent = _spent(conn.execute(sa.select(table).where(
                table.c.cluster == cluster, table.c.lineage == lineage, table.c.auto.is_(True),
                table.c.status.in_(_SPENDING), table.c.time >= since, table.c.incident_id != incident_id)
                .order_by(table.c.time)).mappings().all())
            if own is not None and own["status"] in _SPENDING and own["auto"]:
                return Budget(True, len(spent) + 1, limit, window_s, spent)
            if len(spent) >= limit:
                return Budget(False, len(spent), limit, window_s, spent)
            values = {"incident_id": incident_id, "cluster": cluster, "lineage": lineage, "job_id": job_id,
                      "time": stamp(moment), "auto": True, "status": "reserved"}
            _upsert(conn, table, values, ("incident_id",))
            return Budget(True, len(spent) + 1, limit, window_s, spent)

    def budget(self, *, cluster: str, lineage: str, limit: int, window_s: int,
               now: datetime | None = None, exclude: str | None = None) -> Budget:
        """The budget as it stands (nothing reserved)."""
        since = stamp((now or datetime.now(UTC)) - timedelta(seconds=window_s))
        table = schema.resumes
        with self._tx(f"read the restart budget of lineage {lineage}") as conn:
            spent = _spent(conn.execute(sa.select(table).where(
                table.c.cluster == cluster, table.c.lineage == lineage, table.c.auto.is_(True),
                table.c.status.in_(_SPENDING), table.c.time >= since,
                table.c.incident_id != (exclude or "")).order_by(table.c.time)).mappings().all())
        return Budget(len(spent) < limit, len(spent), limit, window_s, spent)

    # -- reading --------------------------------------------------------------------------------
    def job(self, cluster: str, job_id: str) -> dict[str, Any] | None:
        with self._tx(f"read job {job_id}") as conn:
            row = conn.execute(sa.select(schema.jobs).where(schema.jobs.c.cluster == cluster,
                                                           schema.jobs.c.job_id == job_id)).mappings().first()
        return dict(row) if row else None

    def lineage_incidents(self, cluster: str, lineage: str, *, exclude: str | None = None) -> list[dict[str, Any]]:
        """The lineage's incidents, oldest first (``exclude``: the one being handled)."""
        table = schema.incidents
        with self._tx(f"read lineage {lineage}") as conn:
            rows = conn.execute(sa.select(table).where(table.c.cluster == cluster, table.c.lineage == lineage,
                                                       table.c.incident_id != (exclude or ""))
                                .order_by(table.c.opened, table.c.incident_id)).mappings().all()
        return [dict(row) for row in rows]

    def resumes_of(self, cluster: str, lineage: str) -> list[dict[str, Any]]:
        table = schema.resumes
        with self._tx(f"read the resumes of lineage {lineage}") as conn:
            rows = conn.execute(sa.select(table).where(table.c.cluster == cluster, table.c.lineage == lineage)
                                .order_by(table.c.time)).mappings().all()
        return [dict(row) for row in rows]

    def lineage_count(self, cluster: str, lineage: str) -> int:
        with self._tx(f"read lineage {lineage}") as conn:
            value = conn.execute(sa.select(schema.lineages.c.incidents).where(
                schema.lineages.c.cluster == cluster, schema.lineages.c.lineage == lineage)).scalar()
        return int(value or 0)

    def incidents(self, *, since: str | None = None, cluster: str | None = None) -> list[dict[str, Any]]:
        """Incidents opened at or after ``since`` (a ledger time), newest first."""
        table = schema.incidents
        query = sa.select(table)
        if since:
            query = query.where(table.c.opened >= since)
        if cluster:
            query = query.where(table.c.cluster == cluster)
        with self._tx("list incidents") as conn:
            rows = conn.execute(query.order_by(table.c.opened.desc(), table.c.incident_id.desc())).mappings().all()
        return [dict(row) for row in rows]

    def incident(self, incident_id: str) -> dict[str, Any] | None:
        with self._tx(f"read incident {incident_id}") as conn:
            row = conn.execute(sa.select(schema.incidents).where(
                schema.incidents.c.incident_id == incident_id)).mappings().first()
        return dict(row) if row else None

    def node_events(self, node: str, cluster: str | None = None) -> list[dict[str, Any]]:
        table = schema.node_events
        query = sa.select(table).where(table.c.node == node)
        if cluster:
            query = query.where(table.c.cluster == cluster)
        with self._tx(f"read node {node}") as conn:
            rows = conn.execute(query.order_by(table.c.time, table.c.id)).mappings().all()
        return [dict(row) for row in rows]

    def cluster_node_events(self, cluster: str, nodes: Iterable[str] | None = None) -> dict[str, list[dict[str, Any]]]:
        """Every event of the cluster's nodes (or of ``nodes``), by node, oldest first."""
        table = schema.node_events
        query = sa.select(table).where(table.c.cluster == cluster)
        wanted = list(nodes) if nodes is not None else None
        if wanted is not None:
            query = query.where(table.c.node.in_(wanted))
        with self._tx(f"read the nodes of {cluster}") as conn:
            rows = conn.execute(query.order_by(table.c.node, table.c.time, table.c.id)).mappings().all()
        out: dict[str, list[dict[str, Any]]] = {node: [] for node in wanted or []}
        for row in rows:
            out.setdefault(row["node"], []).append(dict(row))
        return out

    def counts(self) -> dict[str, int]:
        out = {}
        with self._tx("count its rows") as conn:
            for table in (schema.incidents, schema.jobs, schema.lineages, schema.resumes, schema.node_events):
                out[table.name] = int(conn.execute(sa.select(sa.func.count()).select_from(table)).scalar() or 0)
        return out


def _spent(rows: Iterable[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """The automatic resumes these rows spent: each reservation, and each new job once (two
    incidents of one job that found it already resubmitted made one resume, not two)."""
    out, seen = [], set()
    for row in rows:
        if row["status"] == "done" and row["new_job"] is not None:
            if row["new_job"] in seen:
                continue
            seen.add(row["new_job"])
        out.append({"incident_id": row["incident_id"], "time": row["time"], "checkpoint": row["checkpoint_path"],
                    "new_job": row["new_job"], "status": row["status"]})
    return out


def _insert(conn: Connection, table: sa.Table) -> Any:
    if conn.dialect.name == "postgresql":
        from sqlalchemy.dialects.postgresql import insert
    else:
        from sqlalchemy.dialects.sqlite import insert
    return insert(table)


def _columns(table: sa.Table, values: Mapping[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in values.items() if k in table.c}


def _insert_new(conn: Connection, table: sa.Table, values: Mapping[str, Any], keys: Iterable[str]) -> bool:
    """INSERT ... ON CONFLICT DO NOTHING; True when the row was new."""
    statement = _insert(conn, table).values(**_columns(table, values)).on_conflict_do_nothing(index_elements=list(keys))
    return bool(conn.execute(statement).rowcount)


def _upsert(conn: Connection, table: sa.Table, values: Mapping[str, Any], keys: Iterable[str]) -> None:
    """INSERT, or UPDATE the row with every value given that is not None (a value the writer
    does not know never erases one the ledger has)."""
    keys = list(keys)
    row = _columns(table, values)
    statement = _insert(conn, table).values(**row)
    updates = {name: sa.func.coalesce(statement.excluded[name], table.c[name]) for name in row if name not in keys}
    statement = statement.on_conflict_do_update(index_elements=keys, set_=updates) if updates else \
        statement.on_conflict_do_nothing(index_elements=keys)
    conn.execute(statement)
