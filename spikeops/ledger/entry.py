"""An incident's ledger entry, built from its bundle.

The bundle is the record; the entry is what the ledger indexes of it. Both the incident flow
(at the end of an incident) and ``spikeops ledger import DIR`` (rebuilding the ledger from
bundles) build it here, from the same files:

- ``incident.json``: the incident, the job, its nodes and GPUs, the alert's time;
- ``diagnosis.json``: the symptom, spike and onset steps, cause, culprits, and the actions the
  history rules add (``doubt_conviction``);
- ``actions.jsonl``: when the job was stopped, the approval, the drains, the resume (the new
  job, the checkpoint, the excluded nodes, the remediation's environment), a rollback's release;
- ``history.json``: which earlier incident this one recurs (``spikeops.diagnosis.history``);
- the metrics: the spike's wall-clock time and the step time;
- ``ledger.json``: what only the flow knew (the lineage, the paths the job trains in, when the
  diagnosis was made and when the resumed job was seen running, the budget), written by the
  flow; without it (an older bundle) the lineage comes from the ledger's jobs or is the job
  itself, and the resubmission's time stands for "resumed and running".

The entry (``ENTRY_FORMAT``) is plain JSON: the flow keeps it in ``ledger.json`` and, while
the ledger cannot be reached, in the incidents directory's spool (``spikeops.ledger.spool``).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Mapping
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from spikeops.history import HISTORY_FILE, parse_history, skipped_of
from spikeops.ledger.url import LedgerError

__all__ = ["ENTRY_FORMAT", "LEDGER_FILE", "DEFAULT_CLUSTER", "entry_from_bundle", "opening_entry", "read_json",
           "read_actions", "metrics_times", "job_gpus"]

ENTRY_FORMAT = "spikeops-ledger-entry/1"
#: The flow's ledger record in the bundle: ``{"context": {...}, "entry": {...}, "written": bool}``.
LEDGER_FILE = "ledger.json"
#: The cluster name of an incident run without one (a self-contained run: the tests, the demo).
DEFAULT_CLUSTER = "default"
_DONE = ("done", "nothing-to-do")


def read_json(path: Path) -> Any:
    """A JSON file's document, None when it is absent or unreadable (a gap, not a crash)."""
    try:
        return json.loads(path.read_text(encoding="utf-8", errors="replace"))
    except (OSError, ValueError):
        return None


def read_actions(bundle: Path) -> list[dict[str, Any]]:
    """``actions.jsonl``'s records in file order (bad lines skipped)."""
    path = bundle / "actions.jsonl"
    out = []
    try:
        lines = path.read_text(encoding="utf-8", errors="replace").splitlines()
    except OSError:
        return out
    for line in lines:
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict):
            out.append(record)
    return out


def metrics_times(bundle: Path) -> list[tuple[int, Any]]:
    """(step, UTC time or None) of every logged step of the bundle's metrics (empty when none
    can be read)."""
    from spikeops.bundle import open_bundle
    from spikeops.diagnosis.evidence import load_metrics

    try:
        metrics, _ = load_metrics(open_bundle(bundle))
    except Exception:  # noqa: BLE001 - no metrics is a gap in the cost, never a failed entry
        return []
    if metrics is None or not len(metrics.frame):
        return []
    import pandas as pd

    times = metrics.frame["time"]
    return [(int(step), None if pd.isna(moment) else moment.to_pydatetime(warn=False))
            for step, moment in zip(metrics.frame.index, times)]


def job_gpus(job: Mapping[str, Any]) -> int | None:
    """The job's GPUs: nodes × gpus_per_node, else the ranks it maps, else unknown."""
    nodes = job.get("nodes") or []
    per = job.get("gpus_per_node")
    if nodes and isinstance(per, int) and per > 0:
        return len(nodes) * per
    ranks = job.get("ranks")
    return len(ranks) if isinstance(ranks, dict) and ranks else None


def _stamp_of(value: Any) -> str | None:
    from spikeops.ledger.store import stamp
    from spikeops.timeparse import parse_any

    moment = value if isinstance(value, datetime) else (parse_any(value) if value else None)
    return stamp(moment) if isinstance(moment, datetime) else None


def _expand(folded: Any) -> list[str]:
    from spikeops.inventory import expand_nodes

    if isinstance(folded, list):
        return [str(n) for n in folded]
    if not folded:
        return []
    try:
        return expand_nodes(str(folded))
    except Exception:  # noqa: BLE001 - a node set that does not fold back is kept as written
        return [str(folded)]


def opening_entry(incident_doc: Mapping[str, Any], *, cluster: str, lineage: str, bundle: str | Path,
                  job_row: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """What the ledger learns when an incident opens: that it exists, for which job of which
    lineage, since when (the rest comes with ``entry_from_bundle`` at its end)."""
    job = incident_doc.get("job") or {}
    alert = incident_doc.get("alert") or {}
    incident = {"incident_id": incident_doc.get("incident_id"), "cluster": cluster, "job_id": str(job.get("id")),
                "lineage": lineage, "opened": _stamp_of(incident_doc.get("created")),
                "t_alert": _stamp_of(alert.get("received") or incident_doc.get("created")), "bundle": str(bundle),
                "gpus": job_gpus(job)}
    jobs = [{"cluster": cluster, "job_id": str(job.get("id")), "lineage": lineage, **dict(job_row or {})}]
    return {"format": ENTRY_FORMAT, "incident": incident, "jobs": jobs, "resume": None, "node_events": []}


def _recurrence_of(bundle: Path, job: Mapping[str, Any], diagnosis: Mapping[str, Any]) -> str | None:
    from spikeops.diagnosis.history import checkpoint_interval, find_recurrence

    try:
        text = (bundle / HISTORY_FILE).read_text(encoding="utf-8", errors="replace")
    except OSError:
        return None
    history, _ = parse_history(text)
    checkpoints = read_json(bundle / "checkpoints.json")
    steps = [c.get("step") for c in checkpoints if isinstance(c, dict)] if isinstance(checkpoints, list) else []
    resumed = job.get("resumed_from") if isinstance(job.get("resumed_from"), dict) else {}
    found = find_recurrence(history, str(job.get("id")), resumed.get("path"), diagnosis.get("spike_step"),
                            diagnosis.get("symptom"), checkpoint_interval(s for s in steps if isinstance(s, int)))
    return found.earlier.incident_id if found else None


def _conviction_evidence(bundle: Path, node: str, diagnosis: Mapping[str, Any]) -> Any:
    """What convicted ``node`` (``spikeops.lifecycle.faults``), from the diagnosis and the node's
    nvidia-smi in the bundle: the lifecycle reboots reset-class faults and re-checks the rest."""
    from spikeops.lifecycle.faults import conviction_evidence
    from spikeops.probes.nvidia_smi import parse_q

    report = None
    try:
        if "/" in node or node.startswith("."):
            raise ValueError(node)
        text = (bundle / "nodes" / node / "nvidia-smi-q.txt").read_text(encoding="utf-8", errors="replace")
        report = parse_q(text) if text.strip() else None
    except (OSError, ValueError):
        report = None
    return conviction_evidence(node, diagnosis, report)


def _first(actions: Iterable[Mapping[str, Any]], kind: str, outcomes: tuple[str, ...] = _DONE) -> dict[str, Any] | None:
    return next((dict(a) for a in actions if a.get("action") == kind and a.get("outcome") in outcomes), None)


def entry_from_bundle(bundle: str | Path, context: Mapping[str, Any] | None = None, *,
                      lineage_of: Callable[[str, str], str | None] | None = None) -> dict[str, Any]:
    """The ledger entry of the incident in ``bundle``. ``context``: what the flow knew
    (default: the bundle's ``ledger.json``); ``lineage_of(cluster, job)``: the lineage the
    ledger already knows for a job (``ledger import``). LedgerError when the bundle has no
    readable incident.json."""
    root = Path(bundle)
    incident_doc = read_json(root / "incident.json")
    if not isinstance(incident_doc, dict) or not incident_doc.get("incident_id"):
        raise LedgerError(f"{root}: no readable incident.json: not an incident bundle")
    if context is None:
        kept = read_json(root / LEDGER_FILE)
        context = (kept.get("context") if isinstance(kept, dict) else None) or {}
    job = incident_doc.get("job") if isinstance(incident_doc.get("job"), dict) else {}
    job_id = str(job.get("id"))
    cluster = str(context.get("cluster") or DEFAULT_CLUSTER)
    lineage = context.get("lineage") or (lineage_of(cluster, job_id) if lineage_of else None) or job_id
    diagnosis = read_json(root / "diagnosis.json")
    diagnosis = diagnosis if isinstance(diagnosis, dict) else {}
    actions = read_actions(root)
    primary = diagnosis.get("primary") or {}
    opening = opening_entry(incident_doc, cluster=cluster, lineage=lineage, bundle=root)
    incident = opening["incident"]
    incident.update({"symptom": diagnosis.get("symptom"), "cause": primary.get("cause"), "layer": primary.get("layer"),
                     "confidence": primary.get("confidence"),
                     "culprit_nodes": list(diagnosis.get("culprit_nodes") or []),
                     "spike_step": diagnosis.get("spike_step"), "onset_step": diagnosis.get("onset_step"),
                     "recurrence_of": _recurrence_of(root, job, diagnosis) if diagnosis else None,
                     "auto_resumes_in_window": context.get("auto_resumes_in_window"),
                     "outcome": context.get("outcome")})
    points = metrics_times(root)
    spike = diagnosis.get("spike_step")
    spike_time = next((moment for step, moment in points if step == spike), None) if spike is not None else None
    from spikeops.ledger.lost import step_seconds

    incident["step_seconds"] = step_seconds(points, spike)
    incident["t_spike"] = _stamp_of(spike_time)
    stop = _first(actions, "stop")
    incident["t_stopped"] = _stamp_of(stop.get("time")) if stop else None
    diagnosed = context.get("t_diagnosed")
    if diagnosed is None and (root / "diagnosis.json").is_file():
        diagnosed = datetime.fromtimestamp((root / "diagnosis.json").stat().st_mtime, UTC)
    incident["t_diagnosed"] = _stamp_of(diagnosed)
    approval = _first(actions, "approval", ("approved",))
    incident["t_approved"] = _stamp_of(approval.get("time")) if approval else None
    asked_yes = any(a.get("action") == "approval" and a.get("outcome") == "approved"
                    and (a.get("extra") or {}).get("asked") for a in actions)
    resume = _first(actions, "resume", ("done",)) or _first(actions, "resume", ("nothing-to-do",))
    new_job = ((resume or {}).get("extra") or {}).get("new_job")
    entry_resume = None
    jobs = opening["jobs"]
    if resume and new_job:
        extra = resume.get("extra") or {}
        checkpoint = extra.get("checkpoint")
        chosen = diagnosis.get("resume_from") or {}
        step = chosen.get("step") if chosen.get("path") == checkpoint else None
        plan = {"excluded": _expand(extra.get("exclude")), "env": dict(extra.get("env") or {})}
        plan["skipped"] = skipped_of(plan["env"])
        incident.update({"resumed_as": str(new_job), "resumed_from": {"step": step, "path": checkpoint}, "plan": plan,
                         "auto_resumed": not asked_yes})
        running = context.get("t_resumed_running") or resume.get("time")
        incident["t_resumed_running"] = _stamp_of(running)
        entry_resume = {"incident_id": incident["incident_id"], "cluster": cluster, "lineage": lineage,
                        "job_id": job_id, "new_job": str(new_job), "time": _stamp_of(resume.get("time")),
                        "auto": not asked_yes, "status": "done", "checkpoint_step": step, "checkpoint_path": checkpoint,
                        "plan": plan}
        jobs.append({"cluster": cluster, "job_id": str(new_job), "lineage": lineage, "parent_job": job_id,
                     "incident_id": incident["incident_id"], "checkpoint_step": step, "checkpoint_path": checkpoint,
                     "plan": plan, "checkpoint_root": context.get("checkpoint_root"),
                     "run_dir": context.get("run_dir")})
    elif context.get("reserved"):  # a reservation that was not spent: it no longer counts
        entry_resume = {"incident_id": incident["incident_id"], "cluster": cluster, "lineage": lineage,
                        "job_id": job_id, "time": _stamp_of(datetime.now(UTC)), "auto": True,
                        "status": "not-resumed"}
    if context.get("checkpoint_root") or context.get("run_dir"):
        jobs[0].update({k: context.get(k) for k in ("checkpoint_root", "run_dir") if context.get(k)})
    incident["held_for_person"] = bool(stop) and not (resume and new_job)
    events = []
    convicted_at = incident["t_diagnosed"] or incident["opened"]
    for node in incident["culprit_nodes"]:
        evidence = _conviction_evidence(root, node, diagnosis)
        events.append({"cluster": cluster, "node": node, "time": convicted_at, "kind": "convict",
                       "result": f"{primary.get('cause')} at confidence {primary.get('confidence')}",
                       "by": "spikeops diagnosis",
                       "detail": f"culprit of {incident['incident_id']}: {evidence.describe()}"
                                 + (f" (reset-class: {evidence.reset})" if evidence.reset else ""),
                       "incident_id": incident["incident_id"], "cause": primary.get("cause"),
                       "evidence": evidence.to_json()})
    for record in actions:
        kind = {"drain": "drain", "release": "release"}.get(str(record.get("action")))
        if kind and record.get("outcome") == "done":
            events.append({"cluster": cluster, "node": str(record.get("target")), "time": _stamp_of(record.get("time")),
                           "kind": kind, "result": "done", "by": "spikeops",
                           "detail": str(record.get("detail") or "")[:500], "incident_id": incident["incident_id"],
                           "cause": primary.get("cause")})
    for action in diagnosis.get("actions") or []:
        if action.get("kind") == "doubt_conviction":
            for node in action.get("nodes") or []:
                events.append({"cluster": cluster, "node": str(node), "time": convicted_at, "kind": "doubt",
                               "result": "conviction in doubt", "by": "spikeops diagnosis",
                               "detail": f"{incident['symptom']} recurred at step {incident['spike_step']} without "
                                         f"it ({incident['incident_id']}); convicted in {action.get('incident_id')}",
                               "incident_id": incident["incident_id"], "cause": action.get("cause")})
    return {"format": ENTRY_FORMAT, "incident": incident, "jobs": jobs, "resume": entry_resume, "node_events": events}
