"""The ledger: spikeops' memory across incidents (shared/spec/ledger.md, docs/ledger.md).

Each bundle stays the full record of its own incident; the ledger is the index across them:
which job belongs to which lineage (a job spikeops resubmitted belongs to its parent's), what
each incident was, how it was resumed and what it cost, which nodes were convicted and
drained. The incident flow reads it to give a new incident its lineage's history
(``BUNDLE/history.json``), to find the paths a resumed job trains in, and to keep the restart
budget; ``spikeops incidents``, ``spikeops nodes history`` and the receiver's ``/metrics``
read it for people.

    url       which database (``[ledger] url``, ``$SPIKEOPS_LEDGER_URL``, SQLite by default); masking
    schema    the tables (SQLAlchemy Core); ``migrations/`` their Alembic revisions
    store     ``Ledger``: open and migrate, write entries, budgets, reads
    entry     an incident's ledger entry, built from its bundle (the flow and ``ledger import``)
    lost      lost time and GPU-hours of an incident; the lineage's view of one
    summary   incidents at a glance: per-cause counts, MTTR, GPU-hours, repeat lineages
    spool     entries kept in the incidents directory while the ledger cannot be reached
    metrics   the same as Prometheus metrics
    cli       ``spikeops incidents``, ``spikeops ledger``, ``spikeops nodes history``
"""

from spikeops.ledger.url import ENV_URL, LedgerError, default_url, ledger_url, mask_url

__all__ = ["LedgerError", "ENV_URL", "default_url", "ledger_url", "mask_url", "open_ledger"]


def open_ledger(url: str | None = None):  # noqa: ANN201 - Ledger, imported lazily (SQLAlchemy)
    """The ledger at ``url`` (default: ``ledger_url()``), migrated; LedgerError when it cannot be."""
    from spikeops.ledger.store import Ledger

    return Ledger(url)
