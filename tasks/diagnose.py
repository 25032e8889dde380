"""Diagnosing the bundle: the four layers, then the verified checkpoint before the onset."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from prefect import task
from prefect.artifacts import create_table_artifact

from spikeops.tasks.checkpoints import pick_checkpoint

__all__ = ["diagnose_bundle", "diagnose_incident", "findings_table", "summary_line"]


@task(name="diagnose")
def diagnose_bundle(bundle: str, checkpoint_root: str | None = None, quarantine: str | None = None) -> dict[str, Any]:
    """``spikeops diagnose``: the diagnosis object, also written to the bundle. With
    ``checkpoint_root``, once the onset is known the checkpoints under it are verified (the
    pick task) and the diagnosis made again with them, without reading the nodes again."""
    from spikeops.bundle import atomic_write
    from spikeops.diagnosis import diagnose

    def verify_before(onset: int) -> None:
        pick_checkpoint(checkpoint_root, onset, bundle=bundle, quarantine=quarantine)

    document = diagnose(bundle, verify_before=verify_before if checkpoint_root else None).to_json()
    atomic_write(Path(bundle) / "diagnosis.json", (json.dumps(document, indent=2, default=str) + "\n").encode())
    return document


def diagnose_incident(bundle: str, checkpoint_root: str | None, *, dry_run: bool, artifact_key: str) -> dict[str, Any]:
    """The diagnosis with its resume point: the checkpoints under ``checkpoint_root`` before the
    onset are verified. A checkpoint that fails its checksums gets a marker (never deleted, never
    renamed here), so neither this resume nor a person's picks it by mistake. The findings
    become a table artifact."""
    diagnosis = diagnose_bundle(bundle, checkpoint_root, None if dry_run else "marker")
    create_table_artifact(key=artifact_key, table=findings_table(diagnosis))
    return diagnosis


def findings_table(diagnosis: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per finding for the Prefect UI."""
    return [{"cause": f["cause"], "layer": f["layer"], "confidence": f["confidence"],
             "nodes": ",".join(f.get("nodes") or []), "summary": f.get("summary", "")[:200]}
            for f in diagnosis.get("findings") or []] or [{"cause": "none"}]


def summary_line(diagnosis: dict[str, Any]) -> str:
    """The diagnosis in one line for the flow run's log."""
    from spikeops.inventory import fold_nodes

    primary = diagnosis.get("primary") or {}
    resume = diagnosis.get("resume_from") or {}
    return (f"{primary.get('cause')} ({primary.get('layer')}, confidence {primary.get('confidence')}); symptom "
            f"{diagnosis.get('symptom')} at step {diagnosis.get('spike_step')}, onset {diagnosis.get('onset_step')}; "
            f"culprits {fold_nodes(diagnosis.get('culprit_nodes') or []) or 'none'}; resume from "
            f"{resume.get('path') or 'nothing verified before the onset'}; {len(diagnosis.get('findings') or [])} "
            f"finding(s), missing: {'; '.join(diagnosis.get('missing') or []) or 'nothing'}")
