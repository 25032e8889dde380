"""The whole bundle: nodes in worker processes while this one reads the metrics, then the
checkpoints and the lineage's history; everything unreadable a line in ``missing``."""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any
from spikeops.bundle import Bundle, open_bundle
from spikeops.history import HISTORY_FILE, NODE_HISTORY_FILE, PastConviction, PastIncident, parse_history, parse_node_history
from spikeops.probes.bundle_files import (
    Checkpoint,
    Incident,
    parse_checkpoints,
)
from spikeops.probes.slurm import fold_nodes
from spikeops.diagnosis.evidence.metrics import (
    MetricsTable,
)
from spikeops.diagnosis.evidence.job_output import (
    JobOutput,
    read_job_output,
)
from spikeops.diagnosis.evidence.nodes import (
    NodeFacts,
    _JOB_STATE_PROBES,
    incident_time,
    _load_nodes_and_metrics,
)

__all__ = ["BundleFacts", "read_checkpoints", "with_fresh_checkpoints", "load_bundle", "read_node_history", "read_history"]


@dataclass
class BundleFacts:
    bundle: Bundle
    incident: Incident
    metrics: MetricsTable | None
    nodes: list[NodeFacts]
    checkpoints: list[Checkpoint] | None
    missing: list[str]
    #: What the job printed, read for errors: the bundle's ``train.log`` and the nodes' logs.
    output: list[JobOutput] = field(default_factory=list)
    #: Windows of the bundle's files already read (``context._window``), shared with the copy
    #: ``with_fresh_checkpoints`` makes: the files do not change between the two diagnoses.
    memo: dict[Any, Any] = field(default_factory=dict, repr=False, compare=False)
    #: The lineage's earlier incidents (``history.json``; ``spikeops.history``), oldest first.
    history: list[PastIncident] = field(default_factory=list)
    #: The job's nodes' earlier convictions in every lineage (``node_history.json``).
    node_history: list[PastConviction] = field(default_factory=list)

    @property
    def path(self) -> Path:
        return self.bundle.path

    def node(self, name: str) -> NodeFacts | None:
        return next((n for n in self.nodes if n.name == name), None)


def read_checkpoints(path: Path) -> tuple[list[Checkpoint] | None, list[str]]:
    """The bundle's ``checkpoints.json`` and what could not be read of it."""
    path_ckpt = path / "checkpoints.json"
    if not path_ckpt.is_file():
        return None, ["checkpoints.json: absent (no checkpoint to resume from is known)"]
    parsed = parse_checkpoints(path_ckpt.read_text(encoding="utf-8", errors="replace"))
    return parsed.checkpoints, [f"checkpoints.json: {gap.reason}" for gap in parsed.gaps]


def with_fresh_checkpoints(facts: BundleFacts) -> BundleFacts:
    """``facts`` with ``checkpoints.json`` read again (the checkpoints were verified after the
    first diagnosis named the onset); the nodes' evidence, the costly part, is not re-read."""
    checkpoints, gaps = read_checkpoints(facts.path)
    old = [i for i, m in enumerate(facts.missing) if m.startswith("checkpoints.json: ")]
    at = old[0] if old else len(facts.missing)  # where load_bundle put them, so the order is the same
    kept = [m for m in facts.missing if not m.startswith("checkpoints.json: ")]
    return replace(facts, checkpoints=checkpoints, missing=kept[:at] + gaps + kept[at:])


_IPV4 = re.compile(r"(?<![\d.])\d{1,3}(?:\.\d{1,3}){3}(?![\d.])")
#: NCCL's ``ib0:fe80::1%ib0<0>``: after the interface's colon, up to the port's ``<``.
_IPV6 = re.compile(r"^[^:]*:\[?([0-9a-fA-F]*(?::[0-9a-fA-F]*){2,7})(?:%[\w.-]+)?\]?<")
#: Process ids differ on every node: a reason said once for many nodes names none of them.
_PID = re.compile(r"\bpid \d+\b", re.I)


def _addresses(path: Path, nodes: list[NodeFacts]) -> None:
    """What each node is known by besides its name: the address the collector reached it
    at (``collection.json``) and the addresses its ranks bootstrapped NCCL on (``nccl.log``:
    ``Bootstrap : Using ib0:10.0.0.4<0>``), so NCCL RAS's "node 10.0.0.4" can be named."""
    by_name = {facts.name: facts for facts in nodes}
    try:
        record = json.loads((path / "collection.json").read_text(encoding="utf-8"))
        for entry in record.get("nodes") or []:
            facts = by_name.get(str(entry.get("node")))
            if facts is not None and isinstance(entry.get("address"), str):
                facts.addresses.add(entry["address"])
    except (OSError, ValueError, AttributeError, TypeError):
        pass
    for facts in nodes:
        for process in (facts.nccl.processes.values() if facts.nccl is not None else ()):
            text = process.bootstrap or ""
            facts.addresses.update(_IPV4.findall(text))
            six = _IPV6.match(text)
            if six:
                facts.addresses.add(six.group(1))


def load_bundle(path: str | Path, *, workers: int | None = None,
                early: Callable[[Any, MetricsTable | None], dict[Any, Any]] | None = None) -> BundleFacts:
    """Open and read a bundle (BundleError if it cannot be opened at all). ``early(bundle,
    metrics)``, run while the nodes are parsed, returns windows already read: the facts'
    ``memo`` starts with them."""
    bundle = open_bundle(path)
    missing = list(bundle.missing)
    grouped: dict[tuple[str, str], list[str]] = {}
    nodes, metrics, metric_notes, memo = _load_nodes_and_metrics(bundle, workers, early)
    missing.extend(metric_notes)
    for facts in nodes:
        if facts.unreachable:
            missing.append(f"nodes/{facts.name}: unreachable")
            continue
        if not facts.probes:
            missing.append(f"nodes/{facts.name}/probes.json: absent")
        for name, status in facts.probes.items():
            if status.error is not None:
                hint = facts.stderr.get(name)
                if name in _JOB_STATE_PROBES:  # the same on most nodes: said once per reason
                    reason = f"{status.error}" + (f" ({_PID.sub('pid <pid>', hint.replace(facts.name, '<node>'))})"
                                                  if hint else "")
                    grouped.setdefault((name, reason), []).append(facts.name)
                    continue
                missing.append(f"nodes/{facts.name}/{name}: {status.error}" + (f" ({hint})" if hint else ""))
        missing.extend(facts.notes)
    for (name, reason), where in sorted(grouped.items()):
        missing.append(f"{name} on {fold_nodes(where)}: {reason}" if len(where) > 1
                       else f"nodes/{where[0]}/{name}: {reason}")
    collected = {facts.name for facts in nodes}
    missing.extend(f"nodes/{node}: not collected" for node in bundle.incident.job.nodes if node not in collected)
    _addresses(bundle.path, nodes)
    checkpoints, gaps = read_checkpoints(bundle.path)
    missing.extend(gaps)
    output: list[JobOutput] = []
    train = bundle.path / "train.log"
    if train.is_file():
        output.append(read_job_output(train, "train.log", None, reference=incident_time(bundle.incident)))
        missing.extend(output[-1].notes)
    output.extend(item for facts in nodes for item in facts.output)
    history, gaps = read_history(bundle.path)
    missing.extend(gaps)
    convictions, gaps = read_node_history(bundle.path)
    missing.extend(gaps)
    return BundleFacts(bundle, bundle.incident, metrics, nodes, checkpoints, missing, output, history=history,
                       node_history=convictions, memo=dict(memo or {}))


def _read_list_file(path: Path, name: str, parse: Any, unknown: str) -> tuple[list[Any], list[str]]:
    """A bundle's list file read with ``parse`` (absent: empty), and what could not be read."""
    target = path / name
    if not target.is_file():
        return [], []
    try:
        text = target.read_text(encoding="utf-8", errors="replace")
    except OSError as exc:
        return [], [f"{name}: unreadable ({exc.strerror or exc}); {unknown}"]
    return parse(text)


def read_node_history(path: Path) -> tuple[list[PastConviction], list[str]]:
    """The bundle's ``node_history.json`` (absent: none known) and what could not be read of it."""
    return _read_list_file(path, NODE_HISTORY_FILE, parse_node_history, "the nodes' earlier convictions are unknown")


def read_history(path: Path) -> tuple[list[PastIncident], list[str]]:
    """The bundle's ``history.json`` (absent: no earlier incident known) and what could not be
    read of it."""
    return _read_list_file(path, HISTORY_FILE, parse_history, "the lineage's earlier incidents are unknown")
