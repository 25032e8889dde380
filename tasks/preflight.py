"""Before anything is touched: the incident's settings resolved from the run's fields and
``spikeops.toml``, and checked against the world (the inventory reads, the run and checkpoint
directories exist, the scheduler knows the job). A typo in a path is found here, with one line,
before the job is stopped."""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path
from typing import Any

from prefect import task

from spikeops.config import IncidentSettings, load_config, resolve_incident
from spikeops.errors import InputError, SpikeopsError
from spikeops.tasks.scheduler import SchedulerRef

__all__ = ["PreflightError", "incident_settings", "preflight"]


class PreflightError(SpikeopsError):
    """The incident cannot start; nothing was touched. One line, for a person."""


def incident_settings(job_id: str, cluster: str | None, overrides: dict[str, Any] | None) -> IncidentSettings:
    """The run's fields over its cluster's configuration over the defaults."""
    try:
        return resolve_incident(load_config(), job_id, cluster, overrides or {})
    except InputError as exc:
        raise PreflightError(f"cannot start the incident: {exc}") from None


@task(name="preflight", task_run_name="preflight job {settings.job_id}")
def preflight(settings: IncidentSettings, *, rerun: bool = False) -> dict[str, Any]:
    """Every problem at once, as one line; on a rerun of an existing incident the job may be
    long gone from the scheduler, so it is not asked for again."""
    from spikeops.inventory import load_inventory
    from spikeops.schedulers import SchedulerError, open_scheduler

    problems = []
    try:
        load_inventory(settings.inventory)
    except (InputError, OSError) as exc:
        problems.append(f"inventory {settings.inventory}: {str(exc).splitlines()[0][:200]}")
    for key in ("run_dir", "checkpoint_root", "baseline_dir"):
        value = getattr(settings, key)
        if value and not Path(value).expanduser().is_dir():
            problems.append(f"{key} {value}: no such directory")
    if not rerun:
        try:
            scheduler = SchedulerRef(settings.scheduler, settings.scheduler_state_dir, settings.dry_run)
            open_scheduler(scheduler.kind, log_path=None, state_dir=scheduler.state_dir).show_job(settings.job_id)
        except (SchedulerError, InputError, OSError) as exc:
            problems.append(f"{settings.scheduler} scheduler: {str(exc).splitlines()[0][:200]}")
    if problems:
        raise PreflightError("preflight refused the incident (nothing was touched): " + "; ".join(problems))
    return asdict(settings)
