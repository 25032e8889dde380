"""Incidents at a glance: what ``spikeops incidents report`` prints and ``/metrics`` exports.

Pure functions over the ledger's incident rows:
- ``views``: each row in ledger.md's shape, its lost time bounded by the next incident of its
  lineage (``spikeops.ledger.lost``);
- ``summarize``: per cause and per cluster the incidents, the GPU-hours lost and the MTTR
  (mean seconds from the alert to the resumed job running, over the incidents resumed), the
  repeat lineages (two incidents or more), the jobs left waiting for a person.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Mapping
from datetime import datetime
from typing import Any

from spikeops.ledger.lost import incident_view
from spikeops.timeparse import parse_any

__all__ = ["views", "summarize", "repair_seconds"]


def views(rows: Iterable[Mapping[str, Any]], *, now: datetime | None = None,
          lineage_rows: Iterable[Mapping[str, Any]] | None = None) -> list[dict[str, Any]]:
    """The rows as ledger.md's objects, newest first. ``lineage_rows``: every incident of the
    same lineages (default: ``rows``), for the bound on each one's downtime."""
    rows = list(rows)
    known = list(lineage_rows) if lineage_rows is not None else rows
    by_lineage: dict[tuple[str, str], list[str]] = defaultdict(list)
    for row in known:
        by_lineage[(row.get("cluster"), row.get("lineage"))].append(str(row.get("opened") or ""))
    out = []
    for row in rows:
        later = sorted(t for t in by_lineage[(row.get("cluster"), row.get("lineage"))] if t > str(row.get("opened") or ""))
        out.append(incident_view(row, now=now, next_opened=later[0] if later else None))
    return sorted(out, key=lambda v: (str(v.get("opened") or ""), str(v.get("incident_id"))), reverse=True)


def repair_seconds(view: Mapping[str, Any]) -> float | None:
    """Alert to the resumed job running, in seconds (None when it was not resumed)."""
    times = view.get("times") or {}
    start, end = parse_any(times.get("alert")), parse_any(times.get("resumed_running"))
    if not isinstance(start, datetime) or not isinstance(end, datetime):
        return None
    return max(0.0, (end - start).total_seconds())


def _group(items: list[Mapping[str, Any]]) -> dict[str, Any]:
    hours = [v["lost"]["gpu_hours"] for v in items if (v.get("lost") or {}).get("gpu_hours") is not None]
    repairs = [r for r in (repair_seconds(v) for v in items) if r is not None]
    return {"incidents": len(items), "gpu_hours": round(sum(hours), 3),
            "mttr_s": round(sum(repairs) / len(repairs), 1) if repairs else None,
            "resumed": sum(1 for v in items if v.get("resumed_as")),
            "recurrences": sum(1 for v in items if v.get("recurrence_of")),
            "held_for_person": sum(1 for v in items if v.get("held_for_person"))}


def summarize(items: Iterable[Mapping[str, Any]]) -> dict[str, Any]:
    """The report of ``views``' objects: totals, per cause, per cluster, repeat lineages."""
    items = list(items)
    by_cause: dict[str, list[Mapping[str, Any]]] = defaultdict(list)
    by_cluster: dict[str, list[Mapping[str, Any]]] = defaultdict(list)
    lineages: dict[tuple[str, str], list[Mapping[str, Any]]] = defaultdict(list)
    for view in items:
        by_cause[str(view.get("cause") or "undiagnosed")].append(view)
        by_cluster[str(view.get("cluster"))].append(view)
        lineages[(str(view.get("cluster")), str(view.get("lineage")))].append(view)
    repeat = []
    for (cluster, lineage), members in lineages.items():
        if len(members) < 2:
            continue
        members = sorted(members, key=lambda v: str(v.get("opened") or ""))
        repeat.append({"cluster": cluster, "lineage": lineage, "incidents": len(members),
                       "jobs": list(dict.fromkeys(str(v.get("job_id")) for v in members)),
                       "causes": list(dict.fromkeys(str(v.get("cause")) for v in members)),
                       "recurrences": sum(1 for v in members if v.get("recurrence_of")),
                       "gpu_hours": _group(members)["gpu_hours"],
                       "held_for_person": bool(members[-1].get("held_for_person")),
                       "last_opened": members[-1].get("opened")})
    return {
        "total": _group(items),
        "by_cause": [{"cause": cause, **_group(members)} for cause, members in
                     sorted(by_cause.items(), key=lambda kv: (-len(kv[1]), kv[0]))],
        "by_cluster": [{"cluster": cluster, **_group(members)} for cluster, members in sorted(by_cluster.items())],
        "repeat_lineages": sorted(repeat, key=lambda r: (-r["incidents"], r["cluster"], r["lineage"])),
    }
