"""Opening an incident: its bundle, with a snapshot of the job's own files before they rotate."""

from __future__ import annotations

import json
import shutil
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from prefect import task

from spikeops.bundle import BundleWriter
from spikeops.timeparse import iso
from spikeops.tasks.scheduler import SchedulerRef

__all__ = ["open_incident", "WINDOW", "JOB_FILES"]

#: The incident window when the job's files do not give one.
WINDOW = timedelta(hours=1)
#: What ``spikeops.train`` writes in the run directory, copied as the incident opens.
JOB_FILES = ("metrics.jsonl", "ranks.jsonl", "batches.jsonl", "train.log")


@task(name="open-incident")
def open_incident(job_id: str, run_dir: str, incidents_dir: str, scheduler: SchedulerRef,
                  incident_id: str | None = None, alert: dict[str, Any] | None = None) -> tuple[str, str]:
    """The bundle: incident.json from the job's record, and a snapshot of the job's own
    files (they rotate). Reused as it is when the incident already exists."""
    stamp = datetime.now(UTC)
    incident = incident_id or f"inc-{stamp:%Y%m%dT%H%M%SZ}-{job_id}"
    bundle = Path(incidents_dir).expanduser() / incident
    if (bundle / "incident.json").is_file():
        return incident, str(bundle)
    info = scheduler.open(bundle, incident).show_job(job_id)
    info = info[0] if isinstance(info, tuple) else info
    run = Path(run_dir)
    bundle.mkdir(parents=True, exist_ok=True)
    for name in JOB_FILES:
        if (run / name).is_file():
            shutil.copy2(run / name, bundle / name)
    if (run / "reference" / "batches.jsonl").is_file():
        (bundle / "reference").mkdir(parents=True, exist_ok=True)
        shutil.copy2(run / "reference" / "batches.jsonl", bundle / "reference" / "batches.jsonl")
    # The job's own description (spikeops.train writes one: max_length, ranks, resume point)
    # wins over nothing; the scheduler's node list wins over it.
    source = run / "incident.json"
    known = json.loads(source.read_text()) if source.is_file() else {}
    job: dict[str, Any] = dict(known.get("job") or {})
    job.update({"id": job_id, "scheduler": scheduler.kind, "nodes": list(info.nodes)})
    window = known.get("window") or {"start": iso(stamp - WINDOW), "end": iso(stamp)}
    BundleWriter(bundle).write_incident({
        "incident_id": incident, "created": iso(stamp),
        "alert": alert or {"source": "prefect", "received": iso(stamp), "payload": {}},
        "job": job, "window": window,
    })
    return incident, str(bundle)
