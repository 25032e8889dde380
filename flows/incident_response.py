"""The incident flow: the seed's pipeline, one stage per call.

preflight -> open the incident -> classify the symptom and start collecting -> protect the run
-> gather the evidence -> diagnose -> replay the spike window (when it should) -> decide (the
approval gate) -> isolate and resume -> tell.

The stages are ``flows/incident_stages.py``, over one ``Incident``; the tasks they call live
in ``tasks/`` under their names; the decisions (the rapid-response matrix, the approval
policy, whether to resume) are pure functions in ``spikeops.response``. Every stage
is idempotent on its own terms, so a rerun of the same incident (same ``incident_id``)
continues rather than repeats. Nodes are drained only when the diagnosis convicts them and a
person approves (or the policy auto-approves a confident hardware fault); a job is resumed
only from a checkpoint that verified; ``dry_run`` runs everything read-only.
"""

# No `from __future__ import annotations` here: a served run receives the flow object pickled
# (deployments/warm_start.py), and string annotations would be resolved against the pickled
# function's globals, which hold only the names its code uses (not `Annotated`, not the types).

from dataclasses import replace
from pathlib import Path
from typing import Annotated, Any

from prefect import flow, get_run_logger
from pydantic import Field

from spikeops.config import CLUSTER_NAME, JOB_ID, IncidentSettings
from spikeops.flows import incident_stages as stages
from spikeops.flows.incident_params import DESCRIPTION, IncidentOverrides
from spikeops.tasks.concurrency import IncidentSlots
from spikeops.tasks.ledger import Lineage, find_lineage
from spikeops.tasks.notify import tell_failure
from spikeops.tasks.preflight import incident_settings, preflight
from spikeops.tasks.runinfo import current_run, incident_id_for, label_run

__all__ = ["IncidentOverrides", "incident_response", "STAGES"]

STAGES = ("protect", "collect", "diagnose", "isolate", "resume", "notify")


@flow(
    name="incident-response",
    description=DESCRIPTION,
    log_prints=True,
    on_failure=[tell_failure],
    on_crashed=[tell_failure],
)
def incident_response(
    job_id: Annotated[
        str, Field(title="Job id", pattern=JOB_ID.pattern, description="the scheduler's job id")
    ],
    cluster: Annotated[
        str | None,
        Field(
            title="Cluster",
            pattern=CLUSTER_NAME.pattern,
            description="one of the clusters of spikeops.toml",
        ),
    ] = None,
    overrides: Annotated[IncidentOverrides | None, Field(title="Overrides (optional)")] = None,
) -> dict[str, Any]:
    """One incident, end to end; returns what was found and done."""
    given = (overrides or IncidentOverrides()).model_dump()
    settings = incident_settings(job_id, cluster, given)
    if settings.incident_id is None:
        settings = replace(settings, incident_id=incident_id_for(job_id, current_run()))
    label_run(job_id, cluster=settings.cluster)
    # the lineage: a job spikeops resumed trains in its parent's checkpoint root and run directory
    settings, lineage = find_lineage(settings, given)
    bundle = Path(settings.incidents_dir).expanduser() / settings.incident_id
    preflight(settings, rerun=(bundle / "incident.json").is_file())
    with IncidentSlots(
        job_id,
        settings.max_concurrent,
        settings.approval_timeout_s + 3600,
        cluster=settings.cluster,
    ) as slots:
        return _respond(settings, slots, get_run_logger(), lineage)


def _respond(
    settings: IncidentSettings, slots: IncidentSlots, logger: Any, lineage: Lineage
) -> dict[str, Any]:
    incident = stages.open_stage(settings, slots, logger, lineage)
    stages.classify_and_collect(incident)
    stages.protect(incident)
    stages.gather(incident)
    stages.diagnose(incident)
    stages.replay(incident)
    stages.decide(incident)
    stages.isolate_and_resume_stage(incident)
    return stages.tell(incident)
