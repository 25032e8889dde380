"""Which database the ledger is, and how its URL may be shown.

shared/spec/ledger.md: an SQLAlchemy URL, from ``[ledger] url`` in spikeops.toml, else
``SPIKEOPS_LEDGER_URL``, else ``sqlite:///$XDG_STATE_HOME/spikeops/ledger.db``
(``~/.local/state/spikeops/ledger.db``), which every command and flow of one host then shares.

A URL may hold a password. It is masked (``***``) in every message, log line and exception
spikeops makes: ``mask_url`` is the only form that leaves this package. ``postgresql://`` (and
``postgres://``) mean psycopg 3 (``pip install 'spikeops[postgres]'``), which reads libpq's
``PGPASSFILE``, so a URL need not hold the password at all (the scale-out layout gives none).
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from pathlib import Path

from spikeops.errors import SpikeopsError

__all__ = ["LedgerError", "ENV_URL", "default_url", "ledger_url", "mask_url", "normalise_url"]

ENV_URL = "SPIKEOPS_LEDGER_URL"
_PASSWORD = re.compile(r"(?P<head>://[^/?#@:]*:)(?P<secret>[^@/?#]*)(?P<at>@)")
_QUERY_SECRET = re.compile(r"(?i)(?P<head>[?&](?:password|passwd|sslpassword)=)[^&#]*")


class LedgerError(SpikeopsError):
    """The ledger cannot be opened, migrated, read or written. One line, its URL masked."""


def mask_url(url: str) -> str:
    """The URL with any password (in the authority or the query) replaced by ``***``."""
    masked = _PASSWORD.sub(lambda m: m.group("head") + "***" + m.group("at"), url)
    return _QUERY_SECRET.sub(lambda m: m.group("head") + "***", masked)


def default_url(environ: Mapping[str, str] | None = None) -> str:
    """``sqlite:///$XDG_STATE_HOME/spikeops/ledger.db`` (``~/.local/state`` without it)."""
    env = os.environ if environ is None else environ
    base = env.get("XDG_STATE_HOME") or os.path.join(os.path.expanduser("~"), ".local", "state")
    return f"sqlite:///{Path(base) / 'spikeops' / 'ledger.db'}"


def ledger_url(configured: str | None = None, environ: Mapping[str, str] | None = None) -> str:
    """The ledger's URL: the configuration's ``[ledger] url``, else ``$SPIKEOPS_LEDGER_URL``,
    else the default SQLite file."""
    env = os.environ if environ is None else environ
    return normalise_url(configured or env.get(ENV_URL) or default_url(env))


def normalise_url(url: str) -> str:
    """``postgresql://`` and ``postgres://`` as psycopg 3's dialect; ``~`` expanded in a SQLite
    path. LedgerError for what is not a database URL spikeops can use."""
    text = url.strip()
    scheme, sep, rest = text.partition("://")
    if not sep or not scheme:
        raise LedgerError(f"ledger URL {mask_url(text)!r}: not an SQLAlchemy URL (sqlite:///PATH, postgresql://...)")
    if scheme in ("postgresql", "postgres"):
        return f"postgresql+psycopg://{rest}"
    if scheme == "sqlite" and rest.startswith("/~"):
        return f"sqlite:///{os.path.expanduser(rest[1:])}"
    if scheme.split("+")[0] not in ("sqlite", "postgresql"):
        raise LedgerError(f"ledger URL {mask_url(text)!r}: only SQLite and PostgreSQL are supported")
    return text
