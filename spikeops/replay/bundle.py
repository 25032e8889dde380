"""The replay gate's verdict for an incident bundle: its ``replay/same-nodes`` and
``replay/other-nodes`` runs against the original run's metrics and rank placement. Shared by
the diagnosis (which turns it into a finding) and the flow (which tells the thread)."""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from spikeops.replay.plan import RUN_OTHER, RUN_SAME
from spikeops.replay.records import REPLAY_FILE, read_replay
from spikeops.replay.verdict import ReplayVerdict, compare_replays

__all__ = ["rank_map", "original_losses", "bundle_verdict", "has_replays"]


def rank_map(incident: Mapping[str, Any]) -> dict[int, str]:
    """rank -> node of the original run: ``job.ranks`` when the job said, else rank r on
    ``nodes[r // gpus_per_node]`` (the bundle spec's rule)."""
    job = incident.get("job") or {}
    given = {}
    for rank, node in (job.get("ranks") or {}).items():
        if str(rank).isdigit() and node:
            given[int(rank)] = str(node)
    if given:
        return given
    nodes = [str(n) for n in job.get("nodes") or []]
    try:
        per = max(1, int(job.get("gpus_per_node") or 1))
    except (TypeError, ValueError):
        per = 1
    return {r: nodes[r // per] for r in range(len(nodes) * per)}


def original_losses(path: Path) -> dict[int, Any]:
    """step -> loss from a ``metrics.jsonl`` (malformed lines skipped; a re-logged step's last
    value wins)."""
    losses: dict[int, Any] = {}
    try:
        with path.open("rb") as handle:
            for raw in handle:
                try:
                    record = json.loads(raw)
                    losses[int(record["step"])] = record.get("loss")
                except (ValueError, KeyError, TypeError):
                    continue
    except OSError:
        pass
    return losses


def has_replays(bundle: str | Path) -> bool:
    root = Path(bundle) / "replay"
    return any((root / run / REPLAY_FILE).is_file() for run in (RUN_SAME, RUN_OTHER))


def bundle_verdict(bundle: str | Path, spike_step: int | None) -> ReplayVerdict | None:
    """The verdict of the bundle's two replays, or None when it holds none."""
    root = Path(bundle)
    if not has_replays(root):
        return None
    try:
        incident = json.loads((root / "incident.json").read_text())
    except (OSError, ValueError):
        incident = {}
    runs = [read_replay(root / "replay" / run / REPLAY_FILE, name=run, file=f"replay/{run}/{REPLAY_FILE}")
            for run in (RUN_SAME, RUN_OTHER)]
    return compare_replays(original_losses(root / "metrics.jsonl"), rank_map(incident), runs[0], runs[1], spike_step)
