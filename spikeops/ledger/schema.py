"""The ledger's tables (SQLAlchemy Core), one module, both dialects.

- ``incidents``: one row per incident (the index entry of its bundle): what happened, to which
  job of which lineage, what was done, when each stage happened, and the GPUs it held;
- ``jobs``: every job spikeops has seen, with its lineage (the lineage's first job id), the
  job it was resubmitted from, by which incident, from which checkpoint, with which plan, and
  the checkpoint root and run directory it trains in (a resumed job keeps its parent's);
- ``lineages``: one row per lineage, the row a writer locks to decide the restart budget, and
  a count of its incidents (incremented in place: no lost update);
- ``resumes``: each resume spikeops made or reserved (an automatic one is reserved before it is
  made, inside the lineage's lock, so two workers cannot both spend the last one);
- ``node_events``: a node's record: convictions (``convict``), doubts about one (``doubt``),
  and its lifecycle (``drain``, ``reboot``, ``validate``, ``release``, ``force-release``,
  ``replace``: the kinds of shared/spec/ledger.md; ``spikeops.lifecycle`` writes them). An
  incident's own entry keys its events by ``incident_id`` (idempotent); lifecycle events, many
  of one kind per incident, name theirs in ``for_incident``; ``evidence`` is what an event
  rests on (JSON: a conviction's Xids and reset class, a validation's checks).

Times are ISO 8601 UTC strings with a ``Z`` and whole seconds (``spikeops.ledger.store.stamp``),
so they sort and compare as text in SQLite and PostgreSQL alike. The migrations in
``migrations/versions`` create exactly these tables; a change here is a new revision there.
"""

from __future__ import annotations

from sqlalchemy import (JSON, BigInteger, Boolean, Column, Float, Index, Integer, MetaData, String, Table, Text,
                        UniqueConstraint)

__all__ = ["metadata", "incidents", "jobs", "lineages", "resumes", "node_events", "TIME", "ID"]

metadata = MetaData()
#: An ISO 8601 UTC time, whole seconds: ``2026-11-29T18:03:12Z``.
TIME = String(32)
#: A job, incident, lineage or node name.
ID = String(128)

incidents = Table(
    "incidents", metadata,
    Column("incident_id", ID, primary_key=True),
    Column("cluster", String(64), nullable=False),
    Column("job_id", ID, nullable=False),
    Column("lineage", ID, nullable=False),
    Column("opened", TIME),
    Column("symptom", String(32)),
    Column("cause", String(64)),
    Column("layer", String(32)),
    Column("confidence", Float),
    Column("culprit_nodes", JSON),
    Column("spike_step", BigInteger),
    Column("onset_step", BigInteger),
    Column("recurrence_of", ID),
    Column("resumed_as", ID),
    Column("resumed_from", JSON),
    Column("plan", JSON),
    Column("auto_resumed", Boolean),
    Column("auto_resumes_in_window", Integer),
    Column("held_for_person", Boolean),
    Column("outcome", Text),
    Column("bundle", Text),
    Column("gpus", Integer),
    Column("step_seconds", Float),
    Column("t_spike", TIME),
    Column("t_alert", TIME),
    Column("t_stopped", TIME),
    Column("t_diagnosed", TIME),
    Column("t_approved", TIME),
    Column("t_resumed_running", TIME),
    Column("updated", TIME),
    Index("ix_incidents_lineage", "cluster", "lineage"),
    Index("ix_incidents_opened", "opened"),
)

jobs = Table(
    "jobs", metadata,
    Column("cluster", String(64), primary_key=True),
    Column("job_id", ID, primary_key=True),
    Column("lineage", ID, nullable=False),
    Column("parent_job", ID),
    Column("incident_id", ID),
    Column("checkpoint_step", BigInteger),
    Column("checkpoint_path", Text),
    Column("plan", JSON),
    Column("checkpoint_root", Text),
    Column("run_dir", Text),
    Column("recorded", TIME),
    Index("ix_jobs_lineage", "cluster", "lineage"),
)

lineages = Table(
    "lineages", metadata,
    Column("cluster", String(64), primary_key=True),
    Column("lineage", ID, primary_key=True),
    Column("first_seen", TIME),
    Column("incidents", Integer, nullable=False, server_default="0"),
    Column("updated", TIME),
)

resumes = Table(
    "resumes", metadata,
    Column("incident_id", ID, primary_key=True),
    Column("cluster", String(64), nullable=False),
    Column("lineage", ID, nullable=False),
    Column("job_id", ID, nullable=False),
    Column("new_job", ID),
    Column("time", TIME, nullable=False),
    Column("auto", Boolean, nullable=False),
    Column("status", String(16), nullable=False),
    Column("checkpoint_step", BigInteger),
    Column("checkpoint_path", Text),
    Column("plan", JSON),
    Index("ix_resumes_lineage", "cluster", "lineage", "time"),
)

node_events = Table(
    "node_events", metadata,
    Column("id", Integer, primary_key=True, autoincrement=True),
    Column("cluster", String(64), nullable=False),
    Column("node", ID, nullable=False),
    Column("time", TIME, nullable=False),
    Column("kind", String(32), nullable=False),
    Column("result", Text),
    Column("by", String(200)),
    Column("detail", Text),
    Column("incident_id", ID),
    Column("cause", String(64)),
    Column("for_incident", ID),
    Column("evidence", JSON),
    UniqueConstraint("incident_id", "node", "kind", name="uq_node_events_incident"),
    Index("ix_node_events_node", "cluster", "node", "time"),
)
