"""The ledger as Prometheus metrics: what ``spikeops incidents report`` says, on the receiver's
``/metrics`` (``spikeops serve``), for dashboards and alerts across clusters.

| metric | type | labels | what |
| --- | --- | --- | --- |
| ``spikeops_ledger_up`` | gauge | | 1 when the ledger answered this scrape |
| ``spikeops_incidents_total`` | counter | cluster, cause | incidents recorded |
| ``spikeops_incident_recurrences_total`` | counter | cluster, cause | incidents that repeat an earlier one after its resume |
| ``spikeops_gpu_hours_lost_total`` | counter | cluster, cause | GPU-hours lost (rolled-back compute plus downtime; grows while a job is down) |
| ``spikeops_incident_downtime_seconds_total`` | counter | cluster, cause | spike to the resumed job running |
| ``spikeops_time_to_resume_seconds`` | summary | cluster | alert to the resumed job running, per resumed incident (MTTR = sum / count) |
| ``spikeops_resumes_total`` | counter | cluster, how | resumes made (``how``: ``auto`` or ``approved``) |
| ``spikeops_jobs_waiting_for_person`` | gauge | cluster | lineages whose last incident left the job stopped |
| ``spikeops_repeat_lineage_incidents`` | gauge | cluster, lineage | incidents of each lineage with two or more in the last ``REPEAT_WINDOW_S`` |

``infra/monitoring/spikeops-ledger-rules.yml`` records MTTR, GPU-hours and incidents per
cluster and alerts on a job waiting for a person and on a repeating lineage. A scrape reads
the ledger at most every ``cache_s`` seconds; a ledger that does not answer is
``spikeops_ledger_up 0`` and nothing else (an unknown count is not a zero).
"""

from __future__ import annotations

import threading
import time
from collections import defaultdict
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from typing import Any

from spikeops.ledger.summary import repair_seconds, views

__all__ = ["LedgerCollector", "exposition", "REPEAT_WINDOW_S"]

#: A lineage repeats when it had two incidents or more within this window.
REPEAT_WINDOW_S = 30 * 86400


class LedgerCollector:
    """A prometheus_client collector over the ledger at ``url`` (default: the configured one)."""

    def __init__(self, url: str | None = None, *, cache_s: float = 15.0) -> None:
        self.url = url
        self.cache_s = cache_s
        self._lock = threading.Lock()
        self._cached: tuple[float, list[Any]] | None = None
        self._ledger: Any = None

    def _read(self) -> list[dict[str, Any]] | None:
        from spikeops.ledger.store import Ledger

        try:
            if self._ledger is None:
                self._ledger = Ledger(self.url)
            return views(self._ledger.incidents())
        except Exception:  # noqa: BLE001 - a scrape reports the ledger down, never a 500
            if self._ledger is not None:
                self._ledger.close()
            self._ledger = None
            return None

    def _families(self) -> list[Any]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, SummaryMetricFamily

        items = self._read()
        up = GaugeMetricFamily("spikeops_ledger_up", "1 when the ledger answered this scrape")
        up.add_metric([], 0.0 if items is None else 1.0)
        if items is None:
            return [up]
        by = defaultdict(lambda: {"incidents": 0, "recurrences": 0, "gpu_hours": 0.0, "downtime": 0.0})
        repair: dict[str, list[float]] = defaultdict(list)
        resumes: dict[tuple[str, str], int] = defaultdict(int)
        last: dict[tuple[str, str], dict[str, Any]] = {}
        recent: dict[tuple[str, str], int] = defaultdict(int)
        since = (datetime.now(UTC) - timedelta(seconds=REPEAT_WINDOW_S)).strftime("%Y-%m-%dT%H:%M:%SZ")
        clusters = set()
        for view in items:
            cluster, cause = str(view["cluster"]), str(view.get("cause") or "undiagnosed")
            clusters.add(cluster)
            group = by[(cluster, cause)]
            group["incidents"] += 1
            group["recurrences"] += int(bool(view.get("recurrence_of")))
            group["gpu_hours"] += float(view["lost"].get("gpu_hours") or 0.0)
            group["downtime"] += float(view["lost"].get("downtime_s") or 0.0)
            seconds = repair_seconds(view)
            if seconds is not None:
                repair[cluster].append(seconds)
            if view.get("resumed_as"):
                resumes[(cluster, "auto" if view.get("auto_resumed", True) else "approved")] += 1
            key = (cluster, str(view["lineage"]))
            if key not in last:  # views are newest first
                last[key] = view
            if str(view.get("opened") or "") >= since:
                recent[key] += 1
        families = [up]
        specs = (("spikeops_incidents", "incidents recorded in the ledger", "incidents"),
                 ("spikeops_incident_recurrences", "incidents that repeat an earlier one after its resume",
                  "recurrences"),
                 ("spikeops_gpu_hours_lost", "GPU-hours lost: rolled-back compute plus downtime", "gpu_hours"),
                 ("spikeops_incident_downtime_seconds", "seconds from the spike to the resumed job running",
                  "downtime"))
        for name, text, field in specs:
            family = CounterMetricFamily(name, text, labels=["cluster", "cause"])
            for (cluster, cause), group in sorted(by.items()):
                family.add_metric([cluster, cause], group[field])
            families.append(family)
        summary = SummaryMetricFamily("spikeops_time_to_resume_seconds",
                                      "seconds from the alert to the resumed job running", labels=["cluster"])
        for cluster in sorted(clusters):
            values = repair.get(cluster, [])
            summary.add_metric([cluster], count_value=len(values), sum_value=sum(values))
        families.append(summary)
        made = CounterMetricFamily("spikeops_resumes", "resumes spikeops made", labels=["cluster", "how"])
        for (cluster, how), count in sorted(resumes.items()):
            made.add_metric([cluster, how], count)
        families.append(made)
        waiting = GaugeMetricFamily("spikeops_jobs_waiting_for_person",
                                    "lineages whose last incident left the job stopped", labels=["cluster"])
        for cluster in sorted(clusters):
            waiting.add_metric([cluster], sum(1 for (c, _), view in last.items()
                                              if c == cluster and view.get("held_for_person")))
        families.append(waiting)
        repeat = GaugeMetricFamily("spikeops_repeat_lineage_incidents",
                                   "incidents of each lineage with two or more in the last 30 days",
                                   labels=["cluster", "lineage"])
        for (cluster, lineage), count in sorted(recent.items()):
            if count >= 2:
                repeat.add_metric([cluster, lineage], count)
        families.append(repeat)
        return families

    def collect(self) -> Iterator[Any]:
        with self._lock:
            now = time.monotonic()
            if self._cached is None or now - self._cached[0] >= self.cache_s:
                self._cached = (now, self._families())
            families = self._cached[1]
        yield from families


def exposition(collector: LedgerCollector) -> tuple[bytes, str]:
    """The Prometheus text exposition of ``collector`` and its content type."""
    from prometheus_client import CollectorRegistry, generate_latest
    from prometheus_client.exposition import CONTENT_TYPE_LATEST

    registry = CollectorRegistry(auto_describe=False)
    registry.register(collector)
    return generate_latest(registry), CONTENT_TYPE_LATEST
