"""The node lifecycle of one cluster, on a schedule (docs/lifecycle.md).

survey (the record brought up to date) -> for each node spikeops drained, its next step
(``spikeops.lifecycle.plan``): mark a repeat offender for replacement, reboot a reset-class
fault into its drain, validate a node whose wait is over, release one that passed -> one
question to a person for whatever the policy wants asked (``reboot = "ask"``, ``release =
"ask"``, the default) -> what was approved is done. Every step is recorded in the ledger and
said on Slack with its evidence. Scheduled per cluster by ``spikeops serve`` and in each
cluster's work pool; a person runs it from the UI for one node (``nodes``).

Each node is held by one run at a time (a global concurrency limit per node, kept through
the question's wait), so a scheduled run that comes while another waits for a person leaves
that node alone instead of asking twice.
"""

# No `from __future__ import annotations` here: a served run receives the flow object pickled
# (deployments/warm_start.py), and string annotations would be resolved against the pickled
# function's globals, which hold only the names its code uses.

from typing import Annotated, Any

from prefect import flow, get_run_logger
from prefect.artifacts import create_table_artifact
from pydantic import Field

from spikeops.config import CLUSTER_NAME, load_config
from spikeops.inventory import expand_nodes, fold_nodes
from spikeops.lifecycle.service import choose_cluster
from spikeops.tasks.lifecycle import (
    ask_lifecycle,
    lifecycle_reboot,
    lifecycle_release,
    lifecycle_replace,
    lifecycle_decline,
    lifecycle_survey,
    lifecycle_tell,
    lifecycle_validate,
    node_slots,
)
from spikeops.tasks.runinfo import run_url

__all__ = ["node_lifecycle", "FLOW_NAME"]

FLOW_NAME = "node-lifecycle"
DESCRIPTION = """Bring the nodes spikeops drained back only when they have proven healthy: reboot reset-class
faults into the drain, validate each node whose wait is over (nvidia-smi against the drain-time capture,
dcgmi diag, the healthy-run control, an AllReduce with a healthy peer, the evidence that convicted it),
release the ones that passed (with a person's approval unless the cluster says release = "auto"), and mark
repeat offenders for replacement. Give a node set to handle only those nodes."""
_ACTING = ("replace", "reboot", "validate", "release")


def _key(cluster: str) -> str:
    import re

    return f"lifecycle-{re.sub(r'[^a-z0-9-]+', '-', cluster.lower())}"[:100]


@flow(name=FLOW_NAME, description=DESCRIPTION, log_prints=True)
def node_lifecycle(
    cluster: Annotated[str | None, Field(title="Cluster", pattern=CLUSTER_NAME.pattern,
                                         description="one of the clusters of spikeops.toml (default: the only one)")]
    = None,
    nodes: Annotated[str | None, Field(title="Nodes", description="only these nodes (a node set, gpu-[001-004]); "
                                                                  "default: every node spikeops drained")] = None,
    config: Annotated[str | None, Field(description="spikeops.toml (default: $SPIKEOPS_CONFIG)")] = None,
    approval_timeout_s: Annotated[int | None, Field(ge=1, le=7 * 86400, description="how long a person has to "
                                                    "answer (default: the cluster's approval_timeout_s, or 1 h)")]
    = None,
) -> dict[str, Any]:
    """One pass of the lifecycle over the cluster's drained nodes; what each node went through."""
    logger = get_run_logger()
    settings = load_config(config)
    chosen = choose_cluster(settings, cluster)
    name = chosen.name
    wanted = expand_nodes(nodes) if nodes else None
    surveyed = lifecycle_survey(config, name, wanted)
    for line in surveyed["changes"]:
        logger.info("%s", line)
    report: dict[str, Any] = {view["node"]: {"before": view["lifecycle"], "step": view["next"]}
                              for view in surveyed["nodes"]}
    acting = [v["node"] for v in surveyed["nodes"] if v["next"]["action"] in _ACTING]
    for view in surveyed["nodes"]:
        logger.info("%s: %s, next %s (%s)", view["node"], view["lifecycle"] or "no record", view["next"]["action"],
                    view["next"]["why"])
    asks: dict[str, str] = {}
    why_asked: dict[str, str] = {}
    with node_slots(name, acting) as (held, busy):
        for node in busy:
            report[node]["outcome"] = "busy: another lifecycle run is working on it (or waiting for a person)"
        steps = {v["node"]: v["next"] for v in surveyed["nodes"] if v["node"] in held}
        for node, step in steps.items():
            if step["action"] == "replace":
                report[node]["outcome"] = lifecycle_replace(config, name, node, step["why"])
            elif step["action"] == "reboot" and not step["ask"]:
                report[node]["outcome"] = lifecycle_reboot(config, name, [node])[0]
            elif step["action"] == "validate":
                result = lifecycle_validate(config, name, node)
                report[node]["outcome"] = report[node]["validated"] = {k: v for k, v in result.items()
                                                                      if k != "validation"}
                if result["outcome"] == "passed":
                    step = lifecycle_survey(config, name, [node])["nodes"][0]["next"]
                    report[node]["step"] = step
            if step["action"] == "release" and not step["ask"]:
                report[node]["outcome"] = lifecycle_release(config, name, [node])[0]
            elif step["action"] in ("reboot", "release") and step["ask"]:
                asks[node] = step["action"]
                why_asked[node] = step["why"]
        if asks:
            timeout = approval_timeout_s or chosen.approval_timeout_s or 3600
            link = run_url()
            for node, what in asks.items():
                lifecycle_tell(config, name, node, f"ask-{what}",
                               f"{node} ({name}) waits for approval to {what}: {why_asked[node]}. Answer on the flow "
                               f"run's Resume page{f' ({link})' if link else ''} within {timeout // 60} min; silence "
                               "is a no")
            description = ("## Node lifecycle: approval needed\n\n" + "\n".join(
                f"- **{what} {node}**: {why_asked[node]}" for node, what in asks.items())
                + "\n\nApprove all, or name the nodes to approve (a node set). A release puts the node back in "
                  "service; a reboot restarts it into its drain. Silence is a no.")
            approved, approver, why = ask_lifecycle(asks, timeout_s=timeout, description=description, logger=logger)
            logger.info("approval: %s", why)
            reboots = [n for n in approved if asks[n] == "reboot"]
            releases = [n for n in approved if asks[n] == "release"]
            for outcome in lifecycle_reboot(config, name, reboots, approved_by=approver) if reboots else []:
                report[outcome["node"]]["outcome"] = outcome
            for outcome in lifecycle_release(config, name, releases, approved_by=approver) if releases else []:
                report[outcome["node"]]["outcome"] = outcome
            for node in asks:
                if node not in approved:
                    report[node]["outcome"] = {"action": asks[node], "outcome": "not approved", "detail": why}
                    if approver is not None:  # a person's no is kept; silence asks again next time
                        lifecycle_decline(config, name, node, asks[node], approver, why)
                    lifecycle_tell(config, name, node, f"not-{asks[node]}",
                                   f"{node} ({name}): {asks[node]} not done ({why}); it stays drained"
                                   + ("" if approver is None else "; the no is recorded and not asked again"))
    rows = [{"node": node, "before": entry["before"] or "-", "next": entry["step"]["action"],
             "why": entry["step"]["why"][:160],
             "outcome": (entry.get("outcome") or {}).get("outcome", "-") if isinstance(entry.get("outcome"), dict)
             else str(entry.get("outcome") or "-")}
            for node, entry in report.items()]
    if rows:
        create_table_artifact(key=_key(name), table=rows,
                              description=f"node lifecycle of {name}: {fold_nodes(list(report))}")
    return {"cluster": name, "nodes": report, "asked": asks}
