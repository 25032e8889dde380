"""The nearest good checkpoint: newest first, strictly before the onset, verified.

A checkpoint at or after the onset step may already hold the poisoned weights; one without
a manifest cannot be shown to be whole; one that fails verification is corrupt. Each is
skipped with its reason, and the first that passes is the resume point. Corrupt ones can be
quarantined: a marker file beside the data (default) or a rename that the job's loader will
not match (``iter_0001000`` -> ``iter_0001000.quarantined``). Nothing is ever deleted; both
are undone by removing the marker or renaming back.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from spikeops.checkpoints.manifest import (
    MANIFEST_NAME,
    QUARANTINE_MARKER,
    ManifestError,
    locate,
    read_manifest,
    step_from_name,
)
from spikeops.checkpoints.verify import VerifyReport, verify
from spikeops.errors import InputError
from spikeops.timeparse import iso

__all__ = ["Candidate", "PickResult", "find_checkpoints", "pick", "quarantine", "QUARANTINE_MODES",
           "QUARANTINED_SUFFIX", "bundle_entries"]

QUARANTINE_MODES = ("marker", "rename")
QUARANTINED_SUFFIX = ".quarantined"


@dataclass
class Candidate:
    path: Path
    step: int | None
    has_manifest: bool
    quarantined: str | None = None  # why, when it was quarantined before
    time: str | None = None


@dataclass
class PickResult:
    root: Path
    before: int
    chosen: Candidate | None = None
    report: VerifyReport | None = None
    skipped: list[tuple[Candidate, str]] = field(default_factory=list)
    quarantined: list[tuple[Candidate, str]] = field(default_factory=list)
    reports: dict[str, VerifyReport] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {
            "root": str(self.root), "before": self.before,
            "chosen": None if self.chosen is None else {
                "path": str(self.chosen.path), "step": self.chosen.step,
                "verify": self.report.to_json() if self.report else None},
            "skipped": [{"path": str(c.path), "step": c.step, "reason": why} for c, why in self.skipped],
            "quarantined": [{"path": str(c.path), "step": c.step, "how": how} for c, how in self.quarantined],
        }


def _marker(path: Path) -> Path:
    return path / QUARANTINE_MARKER if path.is_dir() else path.parent / f"{path.name}.{QUARANTINE_MARKER}"


def _quarantine_reason(path: Path) -> str | None:
    if path.name.endswith(QUARANTINED_SUFFIX):
        return "renamed as quarantined"
    marker = _marker(path)
    if marker.is_file():
        try:
            return "quarantined: " + str(json.loads(marker.read_text()).get("reason", "no reason recorded"))
        except (OSError, ValueError, AttributeError):
            return "quarantined (marker unreadable)"
    return None


def _mtime(path: Path) -> str | None:
    try:
        return iso(datetime.fromtimestamp(path.stat().st_mtime, UTC))
    except OSError:
        return None


def find_checkpoints(root: str | Path) -> list[Candidate]:
    """Checkpoints directly under ``root``: directories with a manifest or a step in their
    name, and single files with a sidecar manifest. Newest step first (unknown steps last)."""
    base = Path(root)
    try:
        entries = sorted(base.iterdir())
    except FileNotFoundError:
        raise InputError(f"{base}: no such directory") from None
    except NotADirectoryError:
        raise InputError(f"{base}: not a directory") from None
    except OSError as exc:
        raise InputError(f"{base}: cannot list ({exc.strerror or exc})") from None
    found: list[Candidate] = []
    for entry in entries:
        if entry.name.startswith(".") or entry.name.endswith(MANIFEST_NAME) or entry.name.endswith(QUARANTINE_MARKER):
            continue
        try:
            is_dir, is_file = entry.is_dir() and not entry.is_symlink(), entry.is_file()
        except OSError:
            continue
        sidecar = entry.parent / f"{entry.name}.{MANIFEST_NAME}"
        if is_dir:
            has_manifest = (entry / MANIFEST_NAME).is_file()
        elif is_file:
            has_manifest = sidecar.is_file()
        else:
            continue
        step = step_from_name(entry.name.removesuffix(QUARANTINED_SUFFIX))
        if has_manifest:
            try:
                manifest_step = read_manifest(locate(entry)).step
                step = manifest_step if manifest_step is not None else step
            except (ManifestError, InputError):
                pass
        if step is None and not has_manifest:
            continue
        found.append(Candidate(entry, step, has_manifest, _quarantine_reason(entry), _mtime(entry)))
    return sorted(found, key=lambda c: (c.step is None, -(c.step or 0), c.path.name))


def quarantine(candidate: Candidate, reason: str, mode: str = "marker") -> str:
    """Mark a corrupt checkpoint so it is not picked again (and, with ``rename``, not loaded)."""
    if mode not in QUARANTINE_MODES:
        raise InputError(f"unknown quarantine mode {mode!r} (known: {', '.join(QUARANTINE_MODES)})")
    record = {"reason": reason, "when": iso(datetime.now(UTC)), "by": "spikeops checkpoint pick"}
    marker = _marker(candidate.path)
    marker.write_text(json.dumps(record, indent=1) + "\n")
    if mode == "rename":
        target = candidate.path.with_name(candidate.path.name + QUARANTINED_SUFFIX)
        if target.exists():
            raise InputError(f"{target}: already exists; not renaming {candidate.path}")
        os.rename(candidate.path, target)
        if not candidate.path.is_dir() and marker.exists():
            marker.rename(_marker(target))
        candidate.path = target
        return f"renamed to {target.name}"
    return f"marked with {marker.name}"


def pick(root: str | Path, before: int, *, quarantine_mode: str | None = None, workers: int | None = None,
         progress: Callable[[int], None] | None = None,
         on_candidate: Callable[[Candidate], None] | None = None) -> PickResult:
    """The newest checkpoint under ``root`` with step < ``before`` that verifies."""
    result = PickResult(Path(root), before)
    for candidate in find_checkpoints(root):
        if candidate.step is None:
            result.skipped.append((candidate, "step unknown (not in its manifest or name)"))
            continue
        if candidate.step >= before:
            result.skipped.append((candidate, f"step {candidate.step} is not before {before}"))
            continue
        if candidate.quarantined:
            result.skipped.append((candidate, candidate.quarantined))
            continue
        if not candidate.has_manifest:
            result.skipped.append((candidate, "no manifest: cannot be verified"))
            continue
        if result.chosen is not None:
            continue  # older than the choice: not needed, not read
        if on_candidate is not None:
            on_candidate(candidate)
        try:
            report = verify(candidate.path, workers=workers, progress=progress)
        except InputError as exc:
            result.skipped.append((candidate, str(exc)))
            continue
        result.reports[str(candidate.path)] = report
        if report.ok:
            result.chosen, result.report = candidate, report
            continue
        why = report.summary()
        result.skipped.append((candidate, f"corrupt: {why}"))
        if quarantine_mode:
            result.quarantined.append((candidate, quarantine(candidate, why, quarantine_mode)))
    return result


def bundle_entries(result: PickResult) -> list[dict[str, Any]]:
    """The bundle's ``checkpoints.json`` from a pick: every checkpoint seen, with its integrity
    status (true, false with the problem, or null when it was not checked)."""
    entries = []
    seen = [result.chosen] if result.chosen else []
    seen += [candidate for candidate, _ in result.skipped]
    for candidate in sorted(seen, key=lambda c: (c.step is None, -(c.step or 0))):
        report = result.reports.get(str(candidate.path))
        reason = next((why for c, why in result.skipped if c is candidate), None)
        verified: bool | None = report.ok if report is not None else (
            False if reason and (reason.startswith("corrupt") or reason.startswith("quarantined")
                                 or "manifest" in reason.lower() and "no manifest" not in reason) else None)
        manifest = locate(candidate.path).manifest_path if candidate.has_manifest else None
        entries.append({
            "step": candidate.step, "path": str(candidate.path), "time": candidate.time,
            "manifest": str(manifest) if manifest else None, "verified": verified,
            "problem": None if verified else (report.summary() if report is not None else reason),
        })
    return entries
