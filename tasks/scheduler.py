"""Which scheduler an incident acts through, as a value tasks can be handed and Prefect can
record (a task's inputs are persisted with its run; a live scheduler object is not)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["SchedulerRef"]


@dataclass(frozen=True)
class SchedulerRef:
    kind: str
    state_dir: str | None = None
    dry_run: bool = False

    def open(self, bundle: str | Path, incident: str) -> Any:
        """The scheduler, logging every action into the bundle's ``actions.jsonl``."""
        from spikeops.schedulers import open_scheduler

        return open_scheduler(self.kind, log_path=Path(bundle) / "actions.jsonl", dry_run=self.dry_run,
                              incident=incident, state_dir=self.state_dir)
