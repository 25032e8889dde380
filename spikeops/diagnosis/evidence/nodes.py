"""One node's folder read into ``NodeFacts``: its probes, baselines (parsed only when a counter
can have grown), job output, flight recorder dumps, stacks and NCCL RAS."""

from __future__ import annotations

import gc
import re
import os
from collections.abc import Callable, Iterator
from concurrent.futures import ProcessPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any
from spikeops.bundle import Bundle
from spikeops.diagnosis.counters import IB_WATCHED, congestion_counter_high
from spikeops.errors import InputError, UnrecognisedInput
from spikeops.probes.bundle_files import (
    Incident,
    ProbeStatus,
    parse_probes,
)
from spikeops.probes.base import clip
from spikeops.reading import read_evidence
from spikeops.timeparse import year_for
from spikeops.diagnosis.evidence.metrics import (
    MetricsTable,
    load_metrics,
)
from spikeops.diagnosis.evidence.job_output import (
    JobOutput,
    read_job_output,
)

__all__ = ["NodeFacts", "MAX_FR_ENTRIES", "load_node", "incident_time"]


# ------------------------------------------------------------------------------ node facts


@dataclass
class NodeFacts:
    """What one node's folder says, parsed; None where a probe gave nothing readable."""

    name: str
    unreachable: bool = False
    probes: dict[str, ProbeStatus] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    stderr: dict[str, str] = field(default_factory=dict)
    kernel: Any = None
    smi: Any = None
    smi_file: str | None = None
    smi_base: Any = None
    smi_base_file: str | None = None
    ethtool: dict[str, Any] = field(default_factory=dict)
    ethtool_base: dict[str, Any] = field(default_factory=dict)
    ibstat: Any = None
    ib: Any = None
    ib_base: Any = None
    nccl: Any = None
    nccl_version: Any = None
    #: Probe files that have a baseline capture (parsed only when it could matter).
    baselines: set[str] = field(default_factory=set)
    #: The job's own output on this node (``train.log``), and the hardware errors its
    #: ``nccl.log`` lines carry (a watchdog that died of an ECC error).
    output: list[JobOutput] = field(default_factory=list)
    #: The job's flight recorder dumps found on this node, by file name (``flight-recorder/``).
    flight_recorder: dict[str, Any] = field(default_factory=dict)
    #: ``ncclras.txt``: NCCL RAS's job-wide view, as this node's client got it.
    ncclras: Any = None
    #: ``py-spy dump`` of the job's processes here, by file name (``stacks/PID.txt``).
    stacks: dict[str, Any] = field(default_factory=dict)
    #: Addresses the node is known by (the collector's, its ranks' NCCL bootstrap addresses):
    #: NCCL RAS names nodes by IP address.
    addresses: set[str] = field(default_factory=set)

    def file(self, name: str, *, baseline: bool = False) -> str:
        return f"nodes/{self.name}/{'baseline/' if baseline else ''}{name}"


_PROBE_FILES = {
    "kernel.log": ("kernel", "kernel-log"),
    "ibstat.txt": ("ibstat", "ibstat"),
    "ib-counters.txt": ("ib", "ib-counters"),
    "nccl.log": ("nccl", "nccl-log"),
    "nccl-version.txt": ("nccl_version", "nccl-version"),
    "ncclras.txt": ("ncclras", "ncclras"),
}
#: Probes of the job's live state (flight recorder, stacks, NCCL RAS): a node without the tool or
#: without a dump says the same as its neighbours, so their failures are said once per reason.
_JOB_STATE_PROBES = frozenset({"flight-recorder", "stacks", "ncclras"})
#: Entries of one flight recorder dump kept for the diagnosis: the newest, where a hang's
#: frontier is (a ring of 20,000 entries per rank on a 2,048-rank job is not kept whole).
MAX_FR_ENTRIES = 2000
_SMI_FILES = (("nvidia-smi-q.txt", "nvidia-smi-q"), ("nvidia-smi-q.xml", "nvidia-smi-xml"), ("nvml.json", "nvml-json"))


def _read(folder: Path, name: str, kind: str, facts: NodeFacts, *, baseline: bool = False,
          current: tuple[bytes, Any] | None = None) -> tuple[bytes, Any] | None:
    path = folder / name
    if not path.is_file():
        return None
    try:
        raw = path.read_bytes()
    except OSError as exc:
        facts.notes.append(f"{facts.file(name, baseline=baseline)}: unreadable ({exc.strerror})")
        return None
    if current is not None and current[0] == raw:
        return raw, current[1]  # byte-identical baseline: same values, nothing grew
    try:
        result = read_evidence(path, kind, confidence=False).result
    except InputError as exc:
        facts.notes.append(f"{facts.file(name, baseline=baseline)}: {str(exc).split(': ', 1)[-1]}")
        return None
    return raw, result


def _ethtool_could_have_grown(stats: Any) -> bool:
    """Growth can only exceed the congestion thresholds if the counter is that high now;
    below them the baseline cannot change the verdict, so it is not parsed."""
    return any(congestion_counter_high(name, value) for name, value in stats.counters.items())


def _ib_could_have_grown(counters: Any) -> bool:
    return any(port.counters.get(name, 0) or port.hw_counters.get(name, 0)
               for port in counters.ports for name in IB_WATCHED)


def _memory_trouble(report: Any) -> bool:
    """Any uncorrectable ECC, remapped row or retired page now: the baseline then matters."""
    for gpu in getattr(report, "gpus", []):
        rows, pages = gpu.remapped_rows, gpu.retired_pages
        if (gpu.uncorrectable_ecc() or 0) > 0:
            return True
        if rows is not None and ((rows.uncorrectable or 0) > 0 or rows.failure or rows.pending):
            return True
        if pages is not None and ((pages.double_bit or 0) > 0 or pages.pending):
            return True
    return False


def _kernel_with_year(folder: Path, facts: NodeFacts, reference: datetime | None) -> None:
    """A syslog-format kernel log carries no year: read it again in the year its first line
    falls in near the incident (the incident's, or the one before when that is the future),
    so its Xids are placed in the window instead of being "time unknown"."""
    if reference is None or facts.kernel is None or getattr(facts.kernel, "format", None) != "syslog":
        return
    from spikeops.probes import kernel_log

    path = folder / "kernel.log"
    try:
        with open(path, encoding="utf-8", errors="replace") as handle:
            lines = handle.read().splitlines()
    except OSError:
        return
    first = next((m for m in (_SYSLOG_DAY.match(line) for line in lines[:200]) if m), None)
    if first is None or first["mon"] not in _MONTHS:
        return
    year = year_for(_MONTHS.index(first["mon"]) + 1, int(first["day"]), reference)
    try:
        facts.kernel = kernel_log.parse(lines, year=year)
    except Exception as exc:  # noqa: BLE001 - the yearless reading stays
        facts.notes.append(f"{facts.file('kernel.log')}: not dated ({type(exc).__name__})")


#: A probe's complaint about a process that ended while it looked (py-spy of a short-lived
#: process): a race, not why the probe failed, so not the line that says why.
_VANISHED = re.compile(r"Check that the process is running|No such process|process .*(?:exited|has ended)", re.I)


def _telling_line(text: str) -> str:
    """The line of a probe's stderr that says why it failed: the first non-empty one that is
    not about a process gone meanwhile (else the first)."""
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return next((line for line in lines if not _VANISHED.search(line)), lines[0] if lines else "")


_SYSLOG_DAY = re.compile(r"^(?P<mon>[A-Z][a-z]{2}) +(?P<day>\d{1,2}) \d{2}:\d{2}:\d{2}")
_MONTHS = "Jan Feb Mar Apr May Jun Jul Aug Sep Oct Nov Dec".split()


def _read_folder(folder: Path, name: str, kind: str, facts: NodeFacts, into: dict[str, Any]) -> None:
    """Every file of a node's ``flight-recorder/`` or ``stacks/`` as ``kind``; what could
    not be read whole is a note (a truncated dump is a gap, never a healthy rank)."""
    directory = folder / name
    if not directory.is_dir():
        return
    for path in sorted(directory.iterdir(), key=lambda p: p.name)[:4096]:
        if not path.is_file() or path.name.startswith("."):
            continue
        where = facts.file(f"{name}/{path.name}")
        try:
            result = read_evidence(path, kind).result
        except (InputError, UnrecognisedInput) as exc:
            facts.notes.append(f"{where}: {str(exc).split(': ', 1)[-1]}")
            continue
        gaps = [gap.reason for gap in getattr(result, "gaps", [])]
        if kind == "flight-recorder" and not result.complete:
            facts.notes.append(f"{where}: not read ({'; '.join(gaps[:2]) or 'no dump in it'})")
        elif kind == "py-spy" and not result.processes:
            facts.notes.append(f"{where}: no stack in it ({'; '.join(gaps[:2])})")
        into[path.name] = result


def load_node(bundle_path: str, node: str, reference: datetime | None = None) -> NodeFacts:
    """Parse one node's folder (run in a worker process for large bundles); ``reference``,
    the incident's time, dates the yearless syslog lines it holds."""
    folder = Path(bundle_path) / "nodes" / node
    facts = NodeFacts(node)
    probes_path = folder / "probes.json"
    if probes_path.is_file():
        probes = parse_probes(probes_path.read_text(encoding="utf-8", errors="replace"))
        facts.probes = probes.probes
        facts.unreachable = probes.unreachable
        facts.notes.extend(f"nodes/{node}/probes.json: {gap.reason}" for gap in probes.gaps)
    if facts.unreachable:
        return facts
    for err in folder.glob("*.err"):
        try:
            first = _telling_line(err.read_text(errors="replace"))
        except OSError:
            first = ""
        if first:
            facts.stderr[err.stem] = clip(first, 300)
    for name, (attribute, kind) in _PROBE_FILES.items():
        got = _read(folder, name, kind, facts)
        if got is not None:
            setattr(facts, attribute, got[1])
            if attribute == "kernel":
                _kernel_with_year(folder, facts, reference)
            if attribute == "ib" and (folder / "baseline" / name).is_file():
                facts.baselines.add(name)
                if _ib_could_have_grown(got[1]):
                    base = _read(folder / "baseline", name, kind, facts, baseline=True, current=got)
                    facts.ib_base = base[1] if base else None
    for name, kind in _SMI_FILES:
        got = _read(folder, name, kind, facts)
        if got is None or not getattr(got[1], "gpus", None) and not getattr(got[1], "errors", None):
            continue
        facts.smi, facts.smi_file = got[1], name
        if _memory_trouble(got[1]):  # nothing uncorrectable now: nothing can have grown
            base = _read(folder / "baseline", name, kind, facts, baseline=True, current=got)
            if base is not None:
                facts.smi_base, facts.smi_base_file = base[1], name
        break
    train = folder / "train.log"
    if train.is_file():
        output = read_job_output(train, facts.file("train.log"), node, reference=reference)
        facts.output.append(output)
        facts.notes.extend(output.notes)
    nccl = folder / "nccl.log"
    if nccl.is_file() and facts.nccl is not None:
        output = read_job_output(nccl, facts.file("nccl.log"), node, nccl=False, reference=reference)
        if output.errors is not None and output.errors.events:
            facts.output.append(output)
    _read_folder(folder, "flight-recorder", "flight-recorder", facts, facts.flight_recorder)
    for dump in facts.flight_recorder.values():
        if len(dump.entries) > MAX_FR_ENTRIES:
            dump.entries = dump.entries[-MAX_FR_ENTRIES:]
    _read_folder(folder, "stacks", "py-spy", facts, facts.stacks)
    for path in sorted(folder.glob("ethtool-*.txt")):
        got = _read(folder, path.name, "ethtool", facts)
        if got is None:
            continue
        facts.ethtool[path.name] = got[1]
        if (folder / "baseline" / path.name).is_file():
            facts.baselines.add(path.name)
            if _ethtool_could_have_grown(got[1]):
                base = _read(folder / "baseline", path.name, "ethtool", facts, baseline=True, current=got)
                if base is not None:
                    facts.ethtool_base[path.name] = base[1]
    return facts


@contextmanager
def _gc_paused() -> Iterator[None]:
    """The cyclic garbage collector off while evidence is parsed: the parsers build tens of
    thousands of short-lived, acyclic objects per node (an 8-GPU ``nvidia-smi -q`` is a
    2,000-line tree), refcounting frees them, and the collections their allocations
    trigger were a quarter of the parse time in a flow process's large heap."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def _load_node_quietly(bundle: str, node: str, reference: datetime | None = None) -> NodeFacts:
    with _gc_paused():
        return load_node(bundle, node, reference)


def incident_time(incident: Incident) -> datetime | None:
    """When the incident happened, for dating yearless times: its creation, else its window's end."""
    return incident.created or (incident.window.end if incident.window is not None else None)


def _load_nodes_and_metrics(bundle: Bundle, workers: int | None,
                            early: Callable[[Bundle, MetricsTable | None], Any] | None = None
                            ) -> tuple[list[NodeFacts], MetricsTable | None, list[str], Any]:
    """Nodes in worker processes while this process reads the step metrics and then does
    ``early(bundle, metrics)`` (the diagnosis reads its per-rank and batch windows there): on
    a 256-node bundle each side takes seconds, and they need nothing from each other. Every
    parser is imported before the workers fork, so none of them imports its own."""
    names = bundle.nodes()
    reference = incident_time(bundle.incident)
    if workers is None:
        workers = min(os.cpu_count() or 1, 8) if len(names) >= 24 else 1
    if workers <= 1 or len(names) < 2:
        metrics, notes = load_metrics(bundle)
        nodes = [_load_node_quietly(str(bundle.path), name, reference) for name in names]
        return nodes, metrics, notes, early(bundle, metrics) if early is not None else None
    from spikeops.probes import registry

    registry()  # every parser module, in the workers by inheritance
    with ProcessPoolExecutor(max_workers=workers) as pool:
        chunk = max(1, len(names) // (workers * 4))
        pending = pool.map(_load_node_quietly, [str(bundle.path)] * len(names), names, [reference] * len(names),
                           chunksize=chunk)
        metrics, notes = load_metrics(bundle)
        done = early(bundle, metrics) if early is not None else None
        return list(pending), metrics, notes, done
