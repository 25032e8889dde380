"""Acting on the scheduler: stop, preserve, isolate, release, resume.

``policy`` holds the safety rules (pure); ``base`` the command runners, results and the
audit log; ``slurm`` and ``local`` the two schedulers. ``open_scheduler`` picks one.
"""

from __future__ import annotations

import os
from pathlib import Path

from spikeops.errors import InputError
from spikeops.schedulers.base import ActionLog, ActionResult, LocalRunner, SchedulerError
from spikeops.schedulers.local import LocalScheduler
from spikeops.schedulers.slurm import SlurmConfig, SlurmScheduler

__all__ = ["ActionLog", "ActionResult", "SchedulerError", "SlurmScheduler", "SlurmConfig", "LocalScheduler",
           "open_scheduler"]


def open_scheduler(kind: str, *, log_path: str | Path | None, dry_run: bool = False, incident: str | None = None,
                   state_dir: str | Path | None = None, config: SlurmConfig | None = None):
    """``slurm`` (commands on this machine, ``SLURM_CONF`` honoured) or ``local`` (a state
    directory: ``state_dir`` or ``$SPIKEOPS_LOCAL_SCHEDULER``)."""
    log = ActionLog(log_path)
    if kind == "slurm":
        return SlurmScheduler(LocalRunner(), config, log, dry_run=dry_run, incident=incident)
    if kind == "local":
        directory = state_dir or os.environ.get("SPIKEOPS_LOCAL_SCHEDULER")
        if not directory:
            raise InputError("the local scheduler needs --state-dir (or $SPIKEOPS_LOCAL_SCHEDULER)")
        return LocalScheduler(directory, log, dry_run=dry_run, incident=incident)
    raise InputError(f"unknown scheduler {kind!r} (known: slurm, local)")
