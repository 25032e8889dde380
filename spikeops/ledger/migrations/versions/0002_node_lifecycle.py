"""Node lifecycle events (issue 26): each event's incident and its evidence.

A node's lifecycle after a drain has many events of one kind per incident (a validation that
fails, then one that passes; a reboot asked, then its end), so they cannot be keyed by
``incident_id``, whose unique constraint keeps an incident's own entry idempotent. They name
their incident in ``for_incident`` instead, and carry what they rest on in ``evidence``
(JSON: a conviction's Xids and whether a reset clears them, a validation's per-check results).

Revision ID: 0002
Revises: 0001
Create Date: 2026-12-02
"""

import sqlalchemy as sa
from alembic import op

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("node_events") as batch:
        batch.add_column(sa.Column("for_incident", sa.String(128)))
        batch.add_column(sa.Column("evidence", sa.JSON))


def downgrade() -> None:
    with op.batch_alter_table("node_events") as batch:
        batch.drop_column("evidence")
        batch.drop_column("for_incident")
