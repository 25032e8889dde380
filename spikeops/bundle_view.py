"""What spikeops reads in a whole bundle, for ``spikeops parse BUNDLE`` and the demo.

Walks every file the bundle spec names, parses each with the kind its name fixes, and keeps
a short summary per file plus the list of evidence that is missing or unreadable, in the
spec's own wording (``nodes/gpu-009: unreachable``). Nothing here judges the evidence; that
is the diagnosis's job.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TextIO

from spikeops.bundle import ARCHIVES, Bundle, open_bundle
from spikeops.errors import BundleError, InputError
from spikeops.probes.base import clip
from spikeops.probes.bundle_files import summarize_incident
from spikeops.reading import Reading, read_evidence

__all__ = ["FileView", "NodeView", "BundleView", "describe_bundle", "print_bundle"]


@dataclass
class FileView:
    file: str
    kind: str
    summary: list[str]
    gaps: list[str]


@dataclass
class NodeView:
    node: str
    unreachable: bool
    probes: dict[str, str]
    files: list[FileView] = field(default_factory=list)
    baseline: list[FileView] = field(default_factory=list)


@dataclass
class BundleView:
    path: str
    incident: list[str]
    files: list[FileView]
    nodes: list[NodeView]
    missing: list[str]


def _view(reading: Reading, name: str) -> FileView:
    try:
        summary = reading.kind.summarize(reading.result)
    except Exception as exc:  # a summary bug must not hide the file
        summary = [f"(summary unavailable: {exc})"]
    gaps = [f"line {g.line}: {g.reason}" if g.line else g.reason for g in reading.gaps]
    return FileView(name, reading.kind.name, summary, gaps)


def _job_files(bundle: Bundle, missing: list[str]) -> list[FileView]:
    views = []
    metrics = bundle.metrics()
    if metrics is not None:
        views.append(_view(metrics, Path(metrics.path).name))
    else:
        missing.append("metrics.jsonl / train.log: no step metrics")
    for relative, kind in (
        ("ranks.jsonl", "ranks-jsonl"),
        ("batches.jsonl", "batches-jsonl"),
        ("reference/batches.jsonl", "batches-jsonl"),
        ("checkpoints.json", "checkpoints-json"),
    ):
        path = bundle.path / relative
        if not path.is_file():
            continue
        try:
            views.append(_view(read_evidence(path, kind), relative))
        except InputError as exc:
            missing.append(f"{relative}: {exc}")
    return views


def _stderr_hint(bundle: Bundle, node: str, probe: str) -> str:
    """The first line a failed probe printed on stderr: often the only trace of a lost GPU
    (``Unable to determine the device handle for GPU0000:5D:00.0: Unknown Error``)."""
    try:
        err = bundle.stderr_of(node, f"{probe}.txt")
    except BundleError:
        return ""
    first = next((line.strip() for line in (err or "").splitlines() if line.strip()), "")
    return f" ({clip(first, 160)})" if first else ""


def _node_view(bundle: Bundle, node: str, missing: list[str]) -> NodeView:
    probes = bundle.probes(node)
    view = NodeView(
        node=node,
        unreachable=probes.unreachable,
        probes={name: status.error or f"exit {status.exit}" for name, status in probes.probes.items()},
    )
    if probes.unreachable:
        missing.append(f"nodes/{node}: unreachable")
        return view
    missing.extend(f"nodes/{node}/probes.json: {gap.reason}" for gap in probes.gaps)
    for name, status in probes.probes.items():
        if status.error is not None:
            missing.append(f"nodes/{node}/{name}: {status.error}{_stderr_hint(bundle, node, name)}")
    for baseline, target in ((False, view.files), (True, view.baseline)):
        for path in bundle.probe_files(node, baseline=baseline):
            name = path.name if path.parent.name not in ARCHIVES else f"{path.parent.name}/{path.name}"
            relative = f"nodes/{node}/{'baseline/' if baseline else ''}{name}"
            try:
                reading = bundle.read_probe(node, name, baseline=baseline)
            except InputError as exc:
                missing.append(f"{relative}: {str(exc).split(': ', 1)[-1]}")
                continue
            target.append(_view(reading, name))
    return view


def describe_bundle(path: str | Path) -> BundleView:
    """Read every file of a bundle (BundleError if the bundle itself is unreadable)."""
    bundle = open_bundle(path)
    missing: list[str] = []
    files = _job_files(bundle, missing)
    nodes = [_node_view(bundle, node, missing) for node in bundle.nodes()]
    collected = {view.node for view in nodes}
    missing.extend(f"nodes/{node}: not collected" for node in bundle.incident.job.nodes if node not in collected)
    return BundleView(str(path), summarize_incident(bundle.incident), files, nodes, bundle.missing + missing)


def _write_file(view: FileView, out: TextIO, indent: str) -> None:
    out.write(f"{indent}{view.file} [{view.kind}]\n")
    for line in view.summary:
        out.write(f"{indent}  {line}\n")
    for gap in view.gaps[:5]:
        out.write(f"{indent}  not read: {gap}\n")
    if len(view.gaps) > 5:
        out.write(f"{indent}  not read: ... and {len(view.gaps) - 5} more\n")


def print_bundle(view: BundleView, out: TextIO) -> None:
    out.write(f"bundle {view.path}\n")
    for line in view.incident:
        out.write(f"  {line}\n")
    out.write("\njob files\n")
    for file_view in view.files:
        _write_file(file_view, out, "  ")
    for node in view.nodes:
        state = "UNREACHABLE" if node.unreachable else f"{len(node.files)} probe file(s)"
        out.write(f"\nnode {node.node}: {state}\n")
        for file_view in node.files:
            _write_file(file_view, out, "  ")
        if node.baseline:
            out.write("  baseline/\n")
            for file_view in node.baseline:
                _write_file(file_view, out, "    ")
    if view.missing:
        out.write("\nmissing or unreadable evidence\n")
        for item in view.missing:
            out.write(f"  - {item}\n")
