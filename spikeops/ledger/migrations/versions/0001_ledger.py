"""The ledger's first schema: incidents, jobs, lineages, resumes, node events.

Revision ID: 0001
Revises:
Create Date: 2026-12-02
"""

import sqlalchemy as sa
from alembic import op

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None

TIME = sa.String(32)
ID = sa.String(128)


def upgrade() -> None:
    op.create_table(
        "incidents",
        sa.Column("incident_id", ID, primary_key=True),
        sa.Column("cluster", sa.String(64), nullable=False),
        sa.Column("job_id", ID, nullable=False),
        sa.Column("lineage", ID, nullable=False),
        sa.Column("opened", TIME),
        sa.Column("symptom", sa.String(32)),
        sa.Column("cause", sa.String(64)),
        sa.Column("layer", sa.String(32)),
        sa.Column("confidence", sa.Float),
        sa.Column("culprit_nodes", sa.JSON),
        sa.Column("spike_step", sa.BigInteger),
        sa.Column("onset_step", sa.BigInteger),
        sa.Column("recurrence_of", ID),
        sa.Column("resumed_as", ID),
        sa.Column("resumed_from", sa.JSON),
        sa.Column("plan", sa.JSON),
        sa.Column("auto_resumed", sa.Boolean),
        sa.Column("auto_resumes_in_window", sa.Integer),
        sa.Column("held_for_person", sa.Boolean),
        sa.Column("outcome", sa.Text),
        sa.Column("bundle", sa.Text),
        sa.Column("gpus", sa.Integer),
        sa.Column("step_seconds", sa.Float),
        sa.Column("t_spike", TIME),
        sa.Column("t_alert", TIME),
        sa.Column("t_stopped", TIME),
        sa.Column("t_diagnosed", TIME),
        sa.Column("t_approved", TIME),
        sa.Column("t_resumed_running", TIME),
        sa.Column("updated", TIME),
    )
    op.create_index("ix_incidents_lineage", "incidents", ["cluster", "lineage"])
    op.create_index("ix_incidents_opened", "incidents", ["opened"])
    op.create_table(
        "jobs",
        sa.Column("cluster", sa.String(64), primary_key=True),
        sa.Column("job_id", ID, primary_key=True),
        sa.Column("lineage", ID, nullable=False),
        sa.Column("parent_job", ID),
        sa.Column("incident_id", ID),
        sa.Column("checkpoint_step", sa.BigInteger),
        sa.Column("checkpoint_path", sa.Text),
        sa.Column("plan", sa.JSON),
        sa.Column("checkpoint_root", sa.Text),
        sa.Column("run_dir", sa.Text),
        sa.Column("recorded", TIME),
    )
    op.create_index("ix_jobs_lineage", "jobs", ["cluster", "lineage"])
    op.create_table(
        "lineages",
        sa.Column("cluster", sa.String(64), primary_key=True),
        sa.Column("lineage", ID, primary_key=True),
        sa.Column("first_seen", TIME),
        sa.Column("incidents", sa.Integer, nullable=False, server_default="0"),
        sa.Column("updated", TIME),
    )
    op.create_table(
        "resumes",
        sa.Column("incident_id", ID, primary_key=True),
        sa.Column("cluster", sa.String(64), nullable=False),
        sa.Column("lineage", ID, nullable=False),
        sa.Column("job_id", ID, nullable=False),
        sa.Column("new_job", ID),
        sa.Column("time", TIME, nullable=False),
        sa.Column("auto", sa.Boolean, nullable=False),
        sa.Column("status", sa.String(16), nullable=False),
        sa.Column("checkpoint_step", sa.BigInteger),
        sa.Column("checkpoint_path", sa.Text),
        sa.Column("plan", sa.JSON),
    )
    op.create_index("ix_resumes_lineage", "resumes", ["cluster", "lineage", "time"])
    op.create_table(
        "node_events",
        sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
        sa.Column("cluster", sa.String(64), nullable=False),
        sa.Column("node", ID, nullable=False),
        sa.Column("time", TIME, nullable=False),
        sa.Column("kind", sa.String(32), nullable=False),
        sa.Column("result", sa.Text),
        sa.Column("by", sa.String(200)),
        sa.Column("detail", sa.Text),
        sa.Column("incident_id", ID),
        sa.Column("cause", sa.String(64)),
        sa.UniqueConstraint("incident_id", "node", "kind", name="uq_node_events_incident"),
    )
    op.create_index("ix_node_events_node", "node_events", ["cluster", "node", "time"])


def downgrade() -> None:
    for index, table in (("ix_node_events_node", "node_events"), ("ix_resumes_lineage", "resumes"),
                         ("ix_jobs_lineage", "jobs"), ("ix_incidents_opened", "incidents"),
                         ("ix_incidents_lineage", "incidents")):
        op.drop_index(index, table_name=table)
    for table in ("node_events", "resumes", "lineages", "jobs", "incidents"):
        op.drop_table(table)
