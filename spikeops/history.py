"""``history.json``: a job lineage's earlier incidents, as the bundle carries them.

The flow writes it from the ledger when it opens an incident (shared/spec/bundle.md); the
diagnosis reads it and nothing else of the ledger, so a diagnosis stays a function of its
bundle and a post-mortem can re-run it years later. The file reaches the diagnosis through
the same hostile path as any other bundle file (hand-edited, truncated), so a bad entry is a
gap with its index, and the good ones are kept.

An entry::

    {"incident_id": "inc-…", "job_id": "4412", "opened": "…", "symptom": "instant_nan",
     "spike_step": 12345, "onset_step": 12336, "cause": "gpu_xid", "culprit_nodes": ["gpu-002"],
     "resumed_as": "4413", "resumed_from": {"step": 12000, "path": "/ckpt/step-12000"},
     "plan": {"excluded": ["gpu-002"], "env": {"SPIKEOPS_SKIP_STEPS": "12345"}}}

``plan.skipped`` (``{"steps": [...], "ranks": [...]}``, the batches the resumed job was told
to skip) is an extension (docs/ledger.md); it is derived from ``plan.env`` when absent.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

__all__ = ["HISTORY_FILE", "PastIncident", "Plan", "parse_history", "history_document", "plan_of",
           "skipped_of", "NODE_HISTORY_FILE", "PastConviction", "parse_node_history", "node_history_document"]

HISTORY_FILE = "history.json"
#: The job's nodes' earlier convictions, in every lineage (docs/bundle.md): the ledger's node
#: records as the bundle carries them, so the diagnosis names a repeat offender and stays a
#: function of its bundle.
NODE_HISTORY_FILE = "node_history.json"
#: The remediation variables that name skipped batches (``spikeops.remediation``).
_SKIP_STEPS = "SPIKEOPS_SKIP_STEPS"
_SKIP_RANKS = "SPIKEOPS_SKIP_RANKS"


def _ints(text: Any) -> list[int]:
    if isinstance(text, list):
        parts: Iterable[Any] = text
    else:
        parts = str(text or "").split(":")
    out = set()
    for part in parts:
        try:
            out.add(int(str(part).strip()))
        except ValueError:
            continue
    return sorted(out)


def skipped_of(env: Mapping[str, str]) -> dict[str, list[int]]:
    """The batches a resume plan's environment tells the job to skip (empty: none; no ranks:
    every rank's)."""
    steps = _ints(env.get(_SKIP_STEPS, ""))
    return {"steps": steps, "ranks": _ints(env.get(_SKIP_RANKS, "")) if steps else []}


@dataclass(frozen=True)
class Plan:
    """What a resume changed: the nodes it kept the job off, the environment it gave it, the
    batches that environment skips."""

    excluded: tuple[str, ...] = ()
    env: tuple[tuple[str, str], ...] = ()
    skip_steps: tuple[int, ...] = ()
    skip_ranks: tuple[int, ...] = ()

    def describe(self) -> str:
        parts = []
        if self.excluded:
            parts.append(f"excluded {', '.join(self.excluded)}")
        if self.skip_steps:
            ranks = f" (ranks {', '.join(str(r) for r in self.skip_ranks)})" if self.skip_ranks else " (every rank)"
            parts.append(f"skipped the batches of step(s) {_steps_text(self.skip_steps)}{ranks}")
        others = [f"{k}={v}" for k, v in self.env if k not in (_SKIP_STEPS, _SKIP_RANKS)]
        if others:
            parts.append("env " + " ".join(others))
        return "; ".join(parts) or "nothing (a plain resume)"


def _steps_text(steps: Iterable[int]) -> str:
    """``12000-12010, 12345``: runs of consecutive steps folded."""
    ordered = sorted(set(steps))
    runs: list[tuple[int, int]] = []
    for step in ordered:
        if runs and step == runs[-1][1] + 1:
            runs[-1] = (runs[-1][0], step)
        else:
            runs.append((step, step))
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


def plan_of(excluded: Iterable[str], env: Mapping[str, str]) -> Plan:
    skipped = skipped_of(env)
    return Plan(tuple(sorted(set(excluded))), tuple(sorted((str(k), str(v)) for k, v in env.items())),
                tuple(skipped["steps"]), tuple(skipped["ranks"]))


@dataclass(frozen=True)
class PastIncident:
    """One earlier incident of the lineage, as history.json gives it (``index``: its place in
    the file, cited by the findings that rest on it)."""

    index: int
    incident_id: str
    job_id: str | None
    opened: str | None
    symptom: str | None
    spike_step: int | None
    onset_step: int | None
    cause: str | None
    culprit_nodes: tuple[str, ...] = ()
    resumed_as: str | None = None
    resumed_step: int | None = None
    resumed_path: str | None = None
    plan: Plan = field(default_factory=Plan)

    @property
    def resumed(self) -> bool:
        return self.resumed_path is not None or self.resumed_step is not None

    def line(self) -> str:
        """The entry in one line, for a finding's evidence."""
        where = f"resumed as job {self.resumed_as} from step {self.resumed_step} ({self.resumed_path})" \
            if self.resumed else "not resumed"
        return (f"#{self.index}: {self.incident_id}, job {self.job_id}, {self.symptom} at step {self.spike_step}, "
                f"cause {self.cause}, culprits {', '.join(self.culprit_nodes) or 'none'}; {where}; plan: "
                f"{self.plan.describe()}")


def _int(value: Any) -> int | None:
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, str) and value.strip().lstrip("-").isdigit():
        return int(value)
    return None


def _str(value: Any) -> str | None:
    return str(value) if isinstance(value, str | int) and not isinstance(value, bool) and str(value) else None


def _entry(index: int, raw: Any) -> PastIncident:
    if not isinstance(raw, dict):
        raise ValueError("not an object")
    incident = _str(raw.get("incident_id"))
    if incident is None:
        raise ValueError("no incident_id")
    resumed = raw.get("resumed_from") if isinstance(raw.get("resumed_from"), dict) else {}
    plan = raw.get("plan") if isinstance(raw.get("plan"), dict) else {}
    env = plan.get("env") if isinstance(plan.get("env"), dict) else {}
    env = {str(k): str(v) for k, v in env.items() if isinstance(v, str | int | float) and not isinstance(v, bool)}
    excluded = [str(n) for n in plan.get("excluded") or [] if isinstance(n, str)]
    built = plan_of(excluded, env)
    skipped = plan.get("skipped") if isinstance(plan.get("skipped"), dict) else None
    if skipped is not None and not built.skip_steps:
        built = Plan(built.excluded, built.env, tuple(_ints(skipped.get("steps") or [])),
                     tuple(_ints(skipped.get("ranks") or [])))
    culprits = raw.get("culprit_nodes") if isinstance(raw.get("culprit_nodes"), list) else []
    return PastIncident(
        index=index, incident_id=incident, job_id=_str(raw.get("job_id")), opened=_str(raw.get("opened")),
        symptom=_str(raw.get("symptom")), spike_step=_int(raw.get("spike_step")), onset_step=_int(raw.get("onset_step")),
        cause=_str(raw.get("cause")), culprit_nodes=tuple(str(n) for n in culprits if isinstance(n, str)),
        resumed_as=_str(raw.get("resumed_as")), resumed_step=_int(resumed.get("step")),
        resumed_path=_str(resumed.get("path")), plan=built)


def _json_list(text: str, name: str, unknown: str) -> tuple[list[Any], list[str]]:
    """A file's JSON list, or nothing and one line saying why."""
    try:
        document = json.loads(text)
    except ValueError as exc:
        return [], [f"{name}: not JSON ({str(exc)[:120]}); {unknown}"]
    if not isinstance(document, list):
        return [], [f"{name}: not a list; {unknown}"]
    return document, []


def parse_history(text: str) -> tuple[list[PastIncident], list[str]]:
    """The entries of a history.json, oldest first, and what could not be read (one line each)."""
    document, gaps = _json_list(text, HISTORY_FILE, "the lineage's earlier incidents are unknown")
    entries: list[PastIncident] = []
    for index, raw in enumerate(document):
        try:
            entries.append(_entry(index, raw))
        except ValueError as exc:
            gaps.append(f"history.json: entry #{index} unreadable ({exc})")
    return entries, gaps


def history_document(incidents: Iterable[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """The list history.json holds, in the spec's shape, from the ledger's incident entries
    (oldest first)."""
    out = []
    for entry in sorted(incidents, key=lambda e: str(e.get("opened") or "")):
        plan = entry.get("plan") or None
        out.append({
            "incident_id": entry.get("incident_id"), "job_id": entry.get("job_id"), "opened": entry.get("opened"),
            "symptom": entry.get("symptom"), "spike_step": entry.get("spike_step"),
            "onset_step": entry.get("onset_step"), "cause": entry.get("cause"),
            "culprit_nodes": list(entry.get("culprit_nodes") or []), "resumed_as": entry.get("resumed_as"),
            "resumed_from": entry.get("resumed_from"),
            "plan": None if plan is None else {"excluded": list(plan.get("excluded") or []),
                                               "env": dict(plan.get("env") or {}),
                                               "skipped": skipped_of(plan.get("env") or {})},
        })
    return out


@dataclass(frozen=True)
class PastConviction:
    """One earlier conviction of one of the job's nodes (``node_history.json``)."""

    index: int
    node: str
    incident_id: str
    cause: str | None
    time: str | None
    in_doubt: bool = False

    def describe(self) -> str:
        return f"{self.incident_id} ({self.cause}{', in doubt' if self.in_doubt else ''})"


def parse_node_history(text: str) -> tuple[list[PastConviction], list[str]]:
    """The entries of a node_history.json, oldest first, and what could not be read."""
    document, gaps = _json_list(text, NODE_HISTORY_FILE, "the nodes' earlier convictions are unknown")
    entries: list[PastConviction] = []
    for index, raw in enumerate(document):
        if not isinstance(raw, dict) or _str(raw.get("node")) is None or _str(raw.get("incident_id")) is None:
            gaps.append(f"{NODE_HISTORY_FILE}: entry #{index} unreadable (needs node and incident_id)")
            continue
        entries.append(PastConviction(index, str(raw["node"]), str(raw["incident_id"]), _str(raw.get("cause")),
                                      _str(raw.get("time")), raw.get("in_doubt") is True))
    return entries, gaps


def node_history_document(events: Iterable[Mapping[str, Any]], *, exclude: str | None = None) -> list[dict[str, Any]]:
    """node_history.json's list from the ledger's node events (``convict`` and ``doubt``),
    oldest first; ``exclude``: the incident being handled."""
    events = list(events)
    doubted = {(e.get("node"), str(d)) for e in events if e.get("kind") == "doubt"
               for d in [e.get("detail") or ""]}
    out = []
    for event in sorted((e for e in events if e.get("kind") == "convict"), key=lambda e: str(e.get("time") or "")):
        incident = event.get("incident_id")
        if not incident or incident == exclude:
            continue
        in_doubt = any(node == event.get("node") and str(incident) in detail for node, detail in doubted)
        out.append({"node": event.get("node"), "incident_id": incident, "cause": event.get("cause"),
                    "time": event.get("time"), "in_doubt": in_doubt})
    return out
