"""Entries the ledger could not take yet, kept until it can.

An unreachable ledger never stops an incident (a database restart must not leave a NaN'd job
unhandled). The flow then keeps the incident's entry in ``INCIDENTS_DIR/.ledger-spool/
INCIDENT.json`` (and says so in the thread); the next incident flow, ``spikeops ledger import``
and ``spikeops ledger replay`` write the spooled entries when the ledger answers again, and
remove each one written. Writing an entry twice changes nothing (``Ledger.apply`` is
idempotent), so a replay that dies halfway is simply run again.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from spikeops.ledger.url import LedgerError

__all__ = ["SPOOL_DIR", "spool_entry", "pending", "replay", "Replayed"]

SPOOL_DIR = ".ledger-spool"
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}$")


def spool_entry(incidents_dir: str | Path, entry: dict[str, Any]) -> Path:
    """Keep ``entry`` for a later write (atomically: a reader never sees half of it)."""
    incident = str((entry.get("incident") or {}).get("incident_id") or "")
    if not _NAME.match(incident):
        raise ValueError(f"cannot spool an entry for incident {incident!r}")
    folder = Path(incidents_dir).expanduser() / SPOOL_DIR
    folder.mkdir(parents=True, exist_ok=True)
    target = folder / f"{incident}.json"
    temporary = folder / f".{incident}.json.tmp"
    temporary.write_text(json.dumps(entry, indent=1, default=str) + "\n")
    os.replace(temporary, target)
    return target


def pending(incidents_dir: str | Path) -> list[Path]:
    folder = Path(incidents_dir).expanduser() / SPOOL_DIR
    return sorted(folder.glob("*.json")) if folder.is_dir() else []


@dataclass
class Replayed:
    written: list[str] = field(default_factory=list)
    failed: list[str] = field(default_factory=list)  # "FILE: why"


def replay(ledger: Any, incidents_dir: str | Path) -> Replayed:
    """Write every spooled entry into ``ledger``; a written one's file is removed. A file that
    is not an entry is reported, never deleted. LedgerError (the ledger is unreachable again)
    stops the replay: what is left stays for the next one."""
    done = Replayed()
    for path in pending(incidents_dir):
        try:
            entry = json.loads(path.read_text())
        except (OSError, ValueError) as exc:
            done.failed.append(f"{path.name}: unreadable ({exc})")
            continue
        if not isinstance(entry, dict) or not isinstance(entry.get("incident"), dict):
            done.failed.append(f"{path.name}: not a ledger entry")
            continue
        try:
            ledger.apply(entry)
        except LedgerError as exc:
            if "needs incident" in str(exc):
                done.failed.append(f"{path.name}: {exc}")
                continue
            raise
        path.unlink(missing_ok=True)
        done.written.append(str(entry["incident"].get("incident_id")))
    return done
