"""The incident flow's memory across incidents: the ledger at each stage (docs/ledger.md).

- before preflight, ``find_lineage``: the job's lineage, and the paths a resumed job trains in
  (the checkpoint root it was resumed from and its lineage's run directory, whatever template
  the configuration uses: a ``{job}`` path names the new job's directory, which does not exist);
- ``IncidentMemory.opened``: the lineage's earlier incidents into ``BUNDLE/history.json`` (the
  diagnosis reads them there), the checkpoint a spikeops resume started the job from into
  incident.json when the job's own files do not say, and the incident recorded;
- ``diagnosed``: a checkpoint the history makes suspect (``poisoned_checkpoint``) gets a
  quarantine marker; a conviction the recurrence puts in doubt is said in the thread;
- ``gate``: the restart budget and the "never the same checkpoint with the same plan" rule
  over the approval policy's gate: past either, a person decides, whatever the policy, and
  Slack mentions the cluster's on-call;
- ``close``: the resumed job seen running, the incident's cost, its entry written (the bundle's
  ``ledger.json`` keeps it too) and a job left stopped said in one line.

An unreachable ledger never stops an incident: the flow goes on, says so in the thread, keeps
the entry in the incidents directory's spool (``spikeops.ledger.spool``) and writes it when
the ledger answers (the next incident, or ``spikeops ledger replay``). Without the ledger the
restart budget is unknown, so nothing is resumed without a person. A dry run reads the ledger
and writes nothing to it.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from prefect import task

from spikeops.config import IncidentSettings
from spikeops.history import history_document, plan_of
from spikeops.ledger.entry import DEFAULT_CLUSTER, LEDGER_FILE, entry_from_bundle, opening_entry
from spikeops.ledger.url import LedgerError, mask_url
from spikeops.response import Gate
from spikeops.tasks.scheduler import SchedulerRef

__all__ = ["Lineage", "find_lineage", "IncidentMemory", "RUNNING_WAIT_S"]

#: How long the flow waits to see the resumed job running (a busy cluster may queue it for
#: longer: then the downtime runs until the lineage's next incident, or now).
RUNNING_WAIT_S = 60.0
_RUNNING = ("RUNNING", "COMPLETING")


@dataclass
class Lineage:
    """What the ledger said of the job when the incident began."""

    cluster: str
    job_id: str
    lineage: str
    parent: str | None = None
    resumed_from: dict[str, Any] | None = None
    checkpoint_root: str | None = None
    run_dir: str | None = None
    history: list[dict[str, Any]] = field(default_factory=list)
    resumes: list[dict[str, Any]] = field(default_factory=list)
    #: None when the ledger answered; else why not (one line, URL masked).
    error: str | None = None
    url: str = ""

    @property
    def known(self) -> bool:
        return self.error is None


def _ledger_url() -> str:
    from spikeops.config import load_config
    from spikeops.ledger import ledger_url

    try:
        configured = load_config().ledger_url
    except Exception:  # noqa: BLE001 - a broken file failed the settings already; the default then
        configured = None
    return ledger_url(configured)


def _open(url: str) -> Any:
    from spikeops.ledger.store import Ledger

    return Ledger(url)


def _why(exc: BaseException, url: str) -> str:
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    text = mask_url(text)
    return text if isinstance(exc, LedgerError) else f"ledger {mask_url(url)}: {type(exc).__name__}: {text}"[:400]


@task(name="ledger-lineage", task_run_name="lineage of job {job_id}")
def read_lineage(cluster: str, job_id: str, incident_id: str | None, incidents_dir: str) -> Lineage:
    """The job's lineage from the ledger (spooled entries written first, so the history is
    whole). Never raises: an unreachable ledger is a ``Lineage`` with ``error``."""
    from spikeops.ledger.spool import replay

    url = _ledger_url()
    found = Lineage(cluster, job_id, job_id, url=mask_url(url))
    try:
        ledger = _open(url)
        try:
            replay(ledger, incidents_dir)
            row = ledger.job(cluster, job_id)
            if row is not None:
                found.lineage = row["lineage"]
                found.parent = row.get("parent_job")
                found.checkpoint_root, found.run_dir = row.get("checkpoint_root"), row.get("run_dir")
                if row.get("parent_job") and row.get("checkpoint_path"):
                    found.resumed_from = {"step": row.get("checkpoint_step"), "path": row["checkpoint_path"]}
            found.history = ledger.lineage_incidents(cluster, found.lineage, exclude=incident_id)
            found.resumes = ledger.resumes_of(cluster, found.lineage)
        finally:
            ledger.close()
    except Exception as exc:  # noqa: BLE001 - the incident goes on without it
        found.error = _why(exc, url)
    return found


def find_lineage(settings: IncidentSettings, overrides: dict[str, Any]) -> tuple[IncidentSettings, Lineage]:
    """The job's lineage, and the settings with the paths it trains in: a resumed job keeps
    the checkpoint root and run directory of the incident that resumed it; a ``{lineage}``
    template is filled with the lineage's first job. A path the run gives explicitly wins."""
    from spikeops.config import load_config, resolve_incident
    from spikeops.errors import InputError

    cluster = settings.cluster or DEFAULT_CLUSTER
    lineage = read_lineage(cluster, settings.job_id, settings.incident_id, settings.incidents_dir)
    given = {key for key in ("checkpoint_root", "run_dir") if (overrides or {}).get(key)}
    if lineage.lineage != settings.job_id and settings.cluster is not None:
        try:
            again = resolve_incident(load_config(), settings.job_id, settings.cluster, overrides or {},
                                     lineage=lineage.lineage)
            settings = replace(settings, **{k: getattr(again, k) for k in ("checkpoint_root", "run_dir")
                                            if k not in given})
        except InputError:
            pass
    if lineage.parent:  # resumed by spikeops: the paths its parent's incident used
        recorded = {k: getattr(lineage, k) for k in ("checkpoint_root", "run_dir")
                    if k not in given and getattr(lineage, k)}
        settings = replace(settings, **recorded)
    return settings, lineage


@task(name="ledger-write", task_run_name="ledger entry of {incident_id}")
def write_entry(entry: dict[str, Any], incident_id: str, incidents_dir: str) -> str | None:
    """Write an entry (and anything spooled before it); None when written, else why not
    (the entry then waits in the spool)."""
    from spikeops.ledger.spool import replay, spool_entry

    url = _ledger_url()
    try:
        ledger = _open(url)
        try:
            replay(ledger, incidents_dir)
            ledger.apply(entry)
        finally:
            ledger.close()
        return None
    except Exception as exc:  # noqa: BLE001 - kept for later, never lost
        spool_entry(incidents_dir, entry)
        return _why(exc, url)


@task(name="restart-budget", task_run_name="restart budget of lineage {lineage}")
def reserve_budget(cluster: str, lineage: str, incident_id: str, job_id: str, limit: int,
                   window_s: int) -> dict[str, Any]:
    """Reserve one automatic resume of the lineage, if the budget allows: ``{"granted",
    "used", "limit", "window_s", "spent", "text"}``, or ``{"error": why}``."""
    url = _ledger_url()
    try:
        ledger = _open(url)
        try:
            budget = ledger.reserve_resume(cluster=cluster, lineage=lineage, incident_id=incident_id, job_id=job_id,
                                           limit=limit, window_s=window_s)
        finally:
            ledger.close()
    except Exception as exc:  # noqa: BLE001
        return {"error": _why(exc, url)}
    return {"granted": budget.granted, "used": budget.used, "limit": budget.limit, "window_s": budget.window_s,
            "spent": budget.spent, "text": budget.describe()}


def _now() -> str:
    from spikeops.ledger.store import stamp

    return stamp(datetime.now(UTC))


class IncidentMemory:
    """The ledger's part in one incident; each method is one stage of the flow and never
    raises for the ledger's sake."""

    def __init__(self, settings: IncidentSettings, lineage: Lineage, incident: str, bundle: str, *,
                 notifier: Any = None, logger: Any = None, links: Any = None) -> None:
        self.settings, self.lineage, self.incident, self.bundle = settings, lineage, incident, Path(bundle)
        self.notifier, self.logger, self.links = notifier, logger, links
        self.cluster = lineage.cluster
        self.context: dict[str, Any] = {"cluster": self.cluster, "lineage": lineage.lineage,
                                        "checkpoint_root": settings.checkpoint_root, "run_dir": settings.run_dir}
        self.unreachable = lineage.error
        self.held: str | None = None
        self.budget: dict[str, Any] | None = None
        self.lost: dict[str, Any] | None = None
        self.resume_path: str | None = None

    # -- helpers ----------------------------------------------------------------------------
    def _say(self, key: str, text: str) -> None:
        if self.logger is not None:
            self.logger.info("ledger: %s", text)
        if self.notifier is not None:
            self.notifier.stage(key, text, links=self.links)

    def _mention(self) -> str:
        return f"{self.settings.oncall} " if self.settings.oncall else ""

    # -- open ---------------------------------------------------------------------------------
    def opened(self) -> None:
        """history.json, the resume point a spikeops resume gave the job, the incident recorded."""
        from spikeops.bundle import BundleWriter, atomic_write

        doc = json.loads((self.bundle / "incident.json").read_text())
        job = doc.setdefault("job", {})
        if self.lineage.resumed_from and not job.get("resumed_from"):
            job["resumed_from"] = dict(self.lineage.resumed_from)
            BundleWriter(self.bundle).write_incident(doc)
        if self.lineage.known:
            history = history_document(self.lineage.history)
            atomic_write(self.bundle / "history.json", (json.dumps(history, indent=1) + "\n").encode())
            self._node_history(list(job.get("nodes") or []))
            if history:
                self._say("history", f"Job {self.settings.job_id} is in lineage {self.lineage.lineage}: "
                          f"{len(history)} earlier incident(s) ({', '.join(h['incident_id'] for h in history[-5:])}) "
                          "are in history.json for the diagnosis")
        else:
            self._say("ledger", f"The ledger cannot be reached ({self.unreachable}): this incident goes on without "
                      "its lineage's history, nothing is resumed without a person (the restart budget is unknown), "
                      "and its ledger entry is written when the ledger answers")
        if self.settings.dry_run:
            return
        entry = opening_entry(doc, cluster=self.cluster, lineage=self.lineage.lineage, bundle=self.bundle,
                              job_row={k: self.context[k] for k in ("checkpoint_root", "run_dir") if self.context[k]})
        if self.lineage.known:
            why = write_entry(entry, self.incident, self.settings.incidents_dir)
            if why is not None:
                self.unreachable = why
                self._say("ledger", f"The ledger cannot be reached ({why}); the incident goes on, and its entry "
                          "is kept to be written when the ledger answers")

    def _node_history(self, nodes: list[str]) -> None:
        """``node_history.json``: the job's nodes' earlier convictions in every lineage (the
        diagnosis names a repeat offender; it never convicts on them). Left out when the ledger
        does not answer: the diagnosis then knows the lineage's own history only."""
        from spikeops.bundle import atomic_write
        from spikeops.history import NODE_HISTORY_FILE, node_history_document

        if not nodes:
            return
        try:
            ledger = _open(_ledger_url())
            try:
                events = [e for rows in ledger.cluster_node_events(self.cluster, nodes).values() for e in rows]
            finally:
                ledger.close()
        except Exception as exc:  # noqa: BLE001 - a gap in what the diagnosis knows, never a stop
            if self.logger is not None:
                self.logger.warning("ledger: the nodes' earlier convictions are unknown: %s", _why(exc, _ledger_url()))
            return
        document = node_history_document(events, exclude=self.incident)
        atomic_write(self.bundle / NODE_HISTORY_FILE, (json.dumps(document, indent=1) + "\n").encode())
        repeat = sorted({entry["node"] for entry in document})
        if repeat:
            self._say("node-history", f"Convicted before: {', '.join(repeat)} "
                      f"({len(document)} earlier conviction(s), `spikeops nodes history NODE`); the diagnosis names "
                      "them, and convicts only on this incident's evidence")

    # -- diagnosed ----------------------------------------------------------------------------
    def diagnosed(self, diagnosis: dict[str, Any]) -> None:
        """Quarantine a checkpoint the history makes suspect; say a conviction in doubt."""
        self.context["t_diagnosed"] = _now()
        for action in diagnosis.get("actions") or []:
            if action.get("kind") == "quarantine_checkpoint" and action.get("reason") == "poisoned":
                self._quarantine(action, diagnosis)
            if action.get("kind") == "doubt_conviction":
                from spikeops.inventory import fold_nodes

                nodes = list(action.get("nodes") or [])
                self._say("doubt", f"The conviction of {fold_nodes(nodes)} in {action.get('incident_id')} "
                          f"({action.get('cause')}) is in doubt: the {diagnosis.get('symptom')} recurred at step "
                          f"{diagnosis.get('spike_step')} without {'it' if len(nodes) == 1 else 'them'}. "
                          f"{'It stays' if len(nodes) == 1 else 'They stay'} drained; a person decides "
                          f"(`spikeops nodes history {nodes[0]}`)")

    def _quarantine(self, action: dict[str, Any], diagnosis: dict[str, Any]) -> None:
        from spikeops.checkpoints import find_checkpoints
        from spikeops.checkpoints.pick import quarantine
        from spikeops.errors import InputError
        from spikeops.schedulers import ActionLog, ActionResult

        path = Path(str(action.get("path") or ""))
        log = ActionLog(self.bundle / "actions.jsonl")
        try:
            candidate = next((c for c in find_checkpoints(path.parent) if c.path == path), None)
        except InputError:
            candidate = None
        if self.settings.dry_run or candidate is None:
            why = "dry run" if self.settings.dry_run else "not found here"
            log.append(ActionResult("quarantine", str(path), "dry-run" if self.settings.dry_run else "refused",
                                    f"poisoned checkpoint: {why}", incident=self.incident))
            return
        if candidate.quarantined:
            log.append(ActionResult("quarantine", str(path), "nothing-to-do", f"already {candidate.quarantined}",
                                    incident=self.incident))
            return
        reason = (f"poisoned: the {diagnosis.get('symptom')} recurred at step {diagnosis.get('spike_step')} after a "
                  f"resume from it ({self.incident})")
        how = quarantine(candidate, reason, "marker")
        log.append(ActionResult("quarantine", str(path), "done", f"{how}: {reason}", incident=self.incident))
        self._say("quarantine", f"Checkpoint {path} (step {action.get('step')}) quarantined ({how}): the run failed "
                  "again at the same point after resuming from it; it is never picked again until the marker is "
                  "removed")

    # -- decide -------------------------------------------------------------------------------
    def gate(self, gate: Gate, diagnosis: dict[str, Any], env: dict[str, str], *, stopped: bool,
             can_resume: bool) -> Gate:
        """The policy's gate, unless the resume it lets through without a person would exceed
        the restart budget, repeat an earlier resume's checkpoint and plan, or cannot be
        checked against the budget (the ledger is unreachable): then a person decides."""
        resume_from = diagnosis.get("resume_from") or {}
        automatic = can_resume and stopped and bool(resume_from.get("path")) and (
            (gate.action is None and not diagnosis.get("culprit_nodes"))
            or (gate.action == "isolate" and not gate.ask and gate.approved))
        if not automatic:
            self._read_budget()
            return gate
        if any(r.get("status") == "done" and r.get("job_id") == self.settings.job_id for r in self.lineage.resumes):
            self._read_budget()  # this job was resubmitted already: the resume finds it and does nothing
            return gate
        excluded = list(diagnosis.get("culprit_nodes") or []) if gate.action == "isolate" else []
        wanted = (resume_from.get("path"), plan_of(excluded, env))
        repeat = next((r for r in self.lineage.resumes if r.get("status") == "done"
                       and (r.get("checkpoint_path"), plan_of((r.get("plan") or {}).get("excluded") or [],
                                                              (r.get("plan") or {}).get("env") or {})) == wanted), None)
        self.resume_path = resume_from.get("path")
        if repeat is not None:
            return self._hold(gate, f"the lineage was already resumed from {resume_from.get('path')} with the same plan "
                                    f"({repeat.get('incident_id')}, as job {repeat.get('new_job')}); never twice")
        if self.unreachable is not None or self.settings.dry_run:
            if self.settings.dry_run:
                return gate
            return self._hold(gate, f"the restart budget cannot be checked (the ledger cannot be reached: "
                                    f"{self.unreachable})")
        budget = reserve_budget(self.cluster, self.lineage.lineage, self.incident, self.settings.job_id,
                                self.settings.max_auto_resumes, self.settings.recurrence_window_s)
        self.budget = budget
        if "error" in budget:
            self.unreachable = budget["error"]
            return self._hold(gate, f"the restart budget cannot be checked ({budget['error']})")
        self.context["auto_resumes_in_window"] = budget["used"]
        if not budget["granted"]:
            spent = ", ".join(f"{s['incident_id']}" for s in budget["spent"])
            return self._hold(gate, f"restart budget spent: {budget['text']} ({spent})")
        self.context["reserved"] = True
        return gate

    def _read_budget(self) -> None:
        if self.unreachable is not None:
            return
        try:
            ledger = _open(_ledger_url())
            try:
                budget = ledger.budget(cluster=self.cluster, lineage=self.lineage.lineage,
                                       limit=self.settings.max_auto_resumes, window_s=self.settings.recurrence_window_s,
                                       exclude=self.incident)
            finally:
                ledger.close()
        except Exception:  # noqa: BLE001 - only for the approval text
            return
        self.budget = {"granted": budget.granted, "used": budget.used, "limit": budget.limit,
                       "window_s": budget.window_s, "spent": budget.spent, "text": budget.describe()}
        self.context["auto_resumes_in_window"] = budget.used

    def _hold(self, gate: Gate, why: str) -> Gate:
        self.held = why
        action = gate.action or "resume"
        question = gate.question or f"resume from {self.resume_path}"
        self._say("budget", f"{self._mention()}{why[0].upper()}{why[1:]}: job {self.settings.job_id} "
                  "is not resumed without a person, whatever the approval policy")
        return Gate(action, ask=True, question=f"{question} ({why})")

    def approval_note(self) -> str:
        """The lineage's history and restart budget, for the approval page (Markdown)."""
        lines = ["", f"### Lineage {self.lineage.lineage} (cluster {self.cluster})", ""]
        if not self.lineage.known:
            return "\n".join(lines + [f"- the ledger cannot be reached ({self.unreachable}): history unknown"])
        if self.budget and "error" not in self.budget:
            lines.append(f"- **Restart budget**: {self.budget['text']}")
        if self.held:
            lines.append(f"- **Held for a person**: {self.held}")
        if not self.lineage.history:
            lines.append("- no earlier incident")
        for row in self.lineage.history[-10:]:
            resumed = row.get("resumed_from") or {}
            plan = row.get("plan") or {}
            lines.append(f"- {row.get('opened')} `{row.get('incident_id')}` job {row.get('job_id')}: "
                         f"{row.get('cause')} ({row.get('symptom')} at step {row.get('spike_step')})"
                         + (f"; resumed as {row.get('resumed_as')} from {resumed.get('path')}"
                            f" ({plan_of(plan.get('excluded') or [], plan.get('env') or {}).describe()})"
                            if row.get("resumed_as") else "; not resumed"))
        return "\n".join(lines)

    # -- close -------------------------------------------------------------------------------
    def close(self, outcome: dict[str, Any], *, stopped: bool) -> dict[str, Any] | None:
        """The resumed job seen running, the cost, the entry written (or spooled), and a job
        left stopped said in one line; appends the cost to ``outcome["summary"]``. Returns
        the ``lost`` object."""
        from spikeops.bundle import atomic_write
        from spikeops.ledger.lost import lost_time

        resumed = outcome.get("resumed") or {}
        new_job = (resumed.get("extra") or {}).get("new_job") if resumed.get("outcome") in ("done", "nothing-to-do") \
            else None
        if new_job:
            self.context["t_resumed_running"] = self._running_since(str(new_job))
        self.context["outcome"] = outcome.get("summary")
        self.context["held_reason"] = self.held
        try:
            entry = entry_from_bundle(self.bundle, self.context)
        except Exception as exc:  # noqa: BLE001 - the incident's end must not fail for its index
            self._say("ledger", f"No ledger entry: {type(exc).__name__}: {str(exc)[:200]}")
            return None
        self.lost = lost_time(entry["incident"])
        written = None if self.settings.dry_run else write_entry(entry, self.incident, self.settings.incidents_dir)
        atomic_write(self.bundle / LEDGER_FILE, (json.dumps(
            {"context": self.context, "entry": entry, "written": written is None and not self.settings.dry_run,
             "error": written}, indent=1, default=str) + "\n").encode())
        if written is not None:
            self._say("ledger", f"The ledger cannot be reached ({written}); this incident's entry is kept in "
                      f"{Path(self.settings.incidents_dir) / '.ledger-spool'} and written when it answers")
        outcome["summary"] = f"{outcome.get('summary')}; {self.cost()}"
        if stopped and not new_job:
            why = self.held or resumed.get("detail") or "not resumed"
            self._say("stopped", f"{self._mention()}Job {self.settings.job_id} is left STOPPED: {why}.")
        return self.lost

    def cost(self) -> str:
        lost = self.lost or {}
        if lost.get("gpu_hours") is None:
            return "GPU-hours lost: unknown (the job's GPU count is not known)"
        rolled = lost.get("steps_rolled_back")
        return (f"{lost['gpu_hours']:g} GPU-hours lost ({lost.get('gpus')} GPUs; "
                + (f"{rolled} steps rolled back at {lost.get('step_seconds')} s/step; " if rolled is not None else "")
                + f"{lost.get('downtime_s', 0) / 60:.1f} min down"
                + (", still counting" if lost.get("still_down") else "") + ")")

    def _running_since(self, job: str) -> str | None:
        """When the resumed job was first seen running (polled every second: Slurm's StartTime
        is the controller's local time, without a zone)."""
        if self.settings.dry_run:
            return None
        ref = SchedulerRef(self.settings.scheduler, self.settings.scheduler_state_dir)
        deadline = time.monotonic() + RUNNING_WAIT_S
        while True:
            try:
                info = ref.open(self.bundle, self.incident).show_job(job)
                info = info[0] if isinstance(info, tuple) else info
                state = str(getattr(info, "state", "") or "").split()[0] if getattr(info, "state", "") else ""
            except Exception:  # noqa: BLE001 - not known yet
                state = ""
            if state in _RUNNING:
                return _now()
            if time.monotonic() > deadline:
                return None
            time.sleep(1.0)
