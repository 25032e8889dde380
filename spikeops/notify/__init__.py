"""Telling people: Slack threads (``slack``), their Block Kit (``messages``), the incident
plot (``plot``) and report (``report``), and ``notify_bundle`` that does all of it for a
diagnosed bundle (``spikeops notify``)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from spikeops.notify.slack import Delivery, SlackNotifier

__all__ = ["SlackNotifier", "Delivery", "notify_bundle", "NotifyResult"]


@dataclass
class NotifyResult:
    deliveries: list[Delivery] = field(default_factory=list)
    report: Path | None = None
    html: Path | None = None
    plot: Path | None = None

    @property
    def delivered(self) -> bool:
        return all(d.posted for d in self.deliveries)


def notify_bundle(bundle: str | Path, *, channel: str | None = None, links: Mapping[str, str] | None = None,
                  outcome: str | None = None, notifier: SlackNotifier | None = None,
                  diagnosis: Mapping[str, Any] | None = None) -> NotifyResult:
    """Post the bundle's diagnosis (diagnosing it first when it has none), with the plot, and
    write report.md/report.html. Never raises for Slack's sake: see ``NotifyResult``."""
    import json

    from spikeops.bundle import open_bundle
    from spikeops.notify.plot import metrics_frame, plot_incident
    from spikeops.notify.report import write_report

    opened = open_bundle(bundle)
    root = Path(bundle)
    if diagnosis is None:
        path = root / "diagnosis.json"
        if path.is_file():
            diagnosis = json.loads(path.read_text())
        else:
            from spikeops.diagnosis import diagnose

            diagnosis = diagnose(root).to_json()
    incident = opened.incident.raw
    frame = metrics_frame(opened)
    png = plot_incident(frame, diagnosis) if frame is not None and len(frame) else None
    result = NotifyResult()
    result.report, result.html = write_report(root, diagnosis, incident, plot_png=png)
    result.plot = root / "plot.png" if png else None
    slack = notifier or SlackNotifier(root, channel=channel)
    result.deliveries.append(slack.open(incident, symptom=diagnosis.get("symptom"),
                                        spike_step=diagnosis.get("spike_step"), links=links))
    result.deliveries.append(slack.diagnosis(diagnosis, incident, links=links))
    if png:
        result.deliveries.append(slack.upload("plot", png, "plot.png", "Training curves around the spike"))
    primary = (diagnosis.get("primary") or {}).get("cause", "undiagnosed")
    result.deliveries.append(slack.finish(diagnosis, incident, outcome=outcome or f"diagnosed: {primary}",
                                          links=links))
    return result
