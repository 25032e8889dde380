"""Alembic's environment for the ledger: run from ``spikeops.ledger.store.upgrade`` (and
``spikeops ledger upgrade``) with the engine's connection in ``config.attributes``; never
from an ``alembic.ini``, so the URL (which may hold a password) is never written to a file.

On PostgreSQL the migration holds an advisory lock, so workers that start together upgrade
one after the other (the second finds the schema current)."""

from alembic import context
from sqlalchemy import text

from spikeops.ledger.schema import metadata

#: pg_advisory_xact_lock key: "spikeops-ledger" folded into 63 bits.
_LOCK = 0x5B1E_0B5_1ED6E5

connection = context.config.attributes["connection"]
context.configure(connection=connection, target_metadata=metadata, render_as_batch=connection.dialect.name == "sqlite")
with context.begin_transaction():
    if connection.dialect.name == "postgresql":
        connection.execute(text("SELECT pg_advisory_xact_lock(:key)"), {"key": _LOCK})
    context.run_migrations()
