"""The incident bundle's own files (spec: shared/spec/bundle.md, format 1), parsed purely.

``incident.json``, ``probes.json``, ``ranks.jsonl``, ``batches.jsonl`` and
``checkpoints.json`` are written by spikeops or by the training job's instrumentation, but
they reach the diagnosis through the same hostile path as tool output (a job killed while
writing, a hand-edited file), so they get the same treatment: a bad line is a gap, the rest
is kept. ``spikeops.bundle`` does the file I/O on top of these functions.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from spikeops.probes.base import Gap, Kind, LineSource, clip, join_text, numbered_lines, register
from spikeops.timeparse import iso, parse_any

__all__ = [
    "BUNDLE_FORMAT",
    "PROBE_ERRORS",
    "CheckpointRef",
    "Job",
    "Window",
    "Incident",
    "ProbeStatus",
    "ProbesFile",
    "RankRecord",
    "BatchRecord",
    "Checkpoint",
    "JsonlRecords",
    "CheckpointList",
    "parse_incident",
    "parse_probes",
    "parse_ranks",
    "parse_batches",
    "parse_checkpoints",
    "read_float",
    "summarize_incident",
]

BUNDLE_FORMAT = "spikeops-bundle/1"
#: The only values ``probes.json`` may carry in ``error`` (null aside).
PROBE_ERRORS = frozenset(
    {"timeout", "unreachable", "auth", "host-key", "command-failed", "output-truncated"}
)
_NONFINITE = {"nan": math.nan, "inf": math.inf, "+inf": math.inf, "-inf": -math.inf,
              "infinity": math.inf, "-infinity": -math.inf}


def read_float(value: Any) -> float | None:
    """A metric value: numbers, bare NaN/Infinity (json reads them) or "nan"/"inf" strings."""
    if value is None or isinstance(value, bool):
        return None
    if isinstance(value, int | float):
        return float(value)
    if isinstance(value, str):
        text = value.strip().lower()
        if text in _NONFINITE:
            return _NONFINITE[text]
        try:
            return float(text)
        except ValueError:
            return None
    return None


def _read_int(value: Any) -> int | None:
    number = read_float(value)
    if number is None or not math.isfinite(number) or number != int(number):
        return None
    return int(number)


def _loads(text: str) -> Any:
    # Python's json accepts NaN/Infinity/-Infinity, which the spec allows in metrics files.
    return json.loads(text)


def _document(source: LineSource, expected: type, what: str, gaps: list[Gap]) -> Any:
    """A whole JSON document of the expected type, or None with the reason in ``gaps``."""
    try:
        raw = _loads(join_text(source))
    except (json.JSONDecodeError, RecursionError) as exc:
        gaps.append(Gap(f"{what} is not valid JSON: {exc}"))
        return None
    if not isinstance(raw, expected):
        gaps.append(Gap(f"{what} is not a JSON {'object' if expected is dict else 'list'}"))
        return None
    return raw


# --- incident.json ----------------------------------------------------------------------


@dataclass
class CheckpointRef:
    step: int | None
    path: str | None


@dataclass
class Job:
    id: str | None = None
    scheduler: str | None = None
    name: str | None = None
    nodes: list[str] = field(default_factory=list)
    gpus_per_node: int | None = None
    ranks: dict[int, str] = field(default_factory=dict)
    max_length: int | None = None
    started: datetime | None = None
    resumed_from: CheckpointRef | None = None

    def node_of_rank(self, rank: int) -> str | None:
        """The spec's rule: ``ranks`` when given, else rank r runs on nodes[r // gpus_per_node]."""
        if rank in self.ranks:
            return self.ranks[rank]
        if self.gpus_per_node and self.gpus_per_node > 0 and rank >= 0:
            index = rank // self.gpus_per_node
            if index < len(self.nodes):
                return self.nodes[index]
        return None

    def ranks_on(self, node: str) -> list[int]:
        """Ranks known to run on ``node`` (explicit map first, else the gpus_per_node rule)."""
        if self.ranks:
            return sorted(rank for rank, host in self.ranks.items() if host == node)
        if self.gpus_per_node and node in self.nodes:
            start = self.nodes.index(node) * self.gpus_per_node
            return list(range(start, start + self.gpus_per_node))
        return []


@dataclass
class Window:
    start: datetime | None
    end: datetime | None

    def contains(self, moment: datetime | None) -> bool | None:
        """None when either the moment or the window is unknown: "time unknown" evidence."""
        if moment is None or self.start is None or self.end is None:
            return None
        return self.start <= moment <= self.end


@dataclass
class Incident:
    format: str | None
    incident_id: str | None
    created: datetime | None
    alert: dict[str, Any]
    job: Job
    window: Window | None
    raw: dict[str, Any] = field(default_factory=dict)
    gaps: list[Gap] = field(default_factory=list)


def _parse_job(raw: Any, gaps: list[Gap]) -> Job:
    if not isinstance(raw, dict):
        gaps.append(Gap("incident.json has no job object"))
        return Job()
    nodes_raw = raw.get("nodes") or []
    nodes = [str(node) for node in nodes_raw] if isinstance(nodes_raw, list) else []
    if not isinstance(nodes_raw, list):
        gaps.append(Gap("job.nodes is not a list"))
    ranks: dict[int, str] = {}
    ranks_raw = raw.get("ranks") or {}
    if isinstance(ranks_raw, dict):
        for key, host in ranks_raw.items():
            rank = _read_int(key)
            if rank is None:
                gaps.append(Gap(f"job.ranks key {key!r} is not a rank number"))
                continue
            ranks[rank] = str(host)
    resumed = raw.get("resumed_from")
    resumed_from = None
    if isinstance(resumed, dict):
        resumed_from = CheckpointRef(_read_int(resumed.get("step")), resumed.get("path"))
    job_id = raw.get("id")
    return Job(
        id=None if job_id is None else str(job_id),
        scheduler=raw.get("scheduler"),
        name=raw.get("name"),
        nodes=nodes,
        gpus_per_node=_read_int(raw.get("gpus_per_node")),
        ranks=ranks,
        max_length=_read_int(raw.get("max_length")),
        started=parse_any(raw.get("started")),
        resumed_from=resumed_from,
    )


def parse_incident(source: LineSource) -> Incident:
    """incident.json; a missing or foreign ``format`` is a gap the bundle reader acts on."""
    gaps: list[Gap] = []
    raw = _document(source, dict, "incident.json", gaps)
    if raw is None:
        return Incident(None, None, None, {}, Job(), None, {}, gaps)
    window_raw = raw.get("window")
    window = None
    if isinstance(window_raw, dict):
        window = Window(parse_any(window_raw.get("start")), parse_any(window_raw.get("end")))
        if window.start is None or window.end is None:
            gaps.append(Gap("window start/end missing or not a time"))
    alert = raw.get("alert") if isinstance(raw.get("alert"), dict) else {}
    incident_id = raw.get("incident_id")
    return Incident(
        format=raw.get("format"),
        incident_id=None if incident_id is None else str(incident_id),
        created=parse_any(raw.get("created")),
        alert=alert,
        job=_parse_job(raw.get("job"), gaps),
        window=window,
        raw=raw,
        gaps=gaps,
    )


# --- probes.json ------------------------------------------------------------------------


@dataclass
class ProbeStatus:
    name: str
    command: str | None
    exit: int | None
    started: datetime | None
    seconds: float | None
    error: str | None

    @property
    def ok(self) -> bool:
        return self.error is None and (self.exit in (0, None))


@dataclass
class ProbesFile:
    probes: dict[str, ProbeStatus] = field(default_factory=dict)
    gaps: list[Gap] = field(default_factory=list)

    @property
    def unreachable(self) -> bool:
        """The spec's marker of a node that could not be reached at all."""
        return bool(self.probes) and all(p.error == "unreachable" for p in self.probes.values())


def parse_probes(source: LineSource) -> ProbesFile:
    result = ProbesFile()
    raw = _document(source, dict, "probes.json", result.gaps)
    if raw is None:
        return result
    for name, entry in raw.items():
        if not isinstance(entry, dict):
            result.gaps.append(Gap(f"probe {name!r}: entry is not an object"))
            continue
        error = entry.get("error")
        if error is not None and error not in PROBE_ERRORS:
            result.gaps.append(Gap(f"probe {name!r}: unknown error value {error!r}"))
        seconds = read_float(entry.get("seconds"))
        result.probes[str(name)] = ProbeStatus(
            name=str(name),
            command=entry.get("command"),
            exit=_read_int(entry.get("exit")),
            started=parse_any(entry.get("started")),
            seconds=seconds,
            error=None if error is None else str(error),
        )
    return result


# --- ranks.jsonl, batches.jsonl ---------------------------------------------------------


@dataclass
class RankRecord:
    step: int
    rank: int
    loss: float | None
    grad_norm: float | None
    mem_allocated_gb: float | None
    line: int
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass
class BatchRecord:
    step: int
    rank: int | None
    fingerprint: str | None
    num_samples: int | None
    max_tokens: int | None
    min_tokens: int | None
    num_empty: int | None
    sample_ids: list[str]
    source: str | None
    line: int
    text: str


@dataclass
class JsonlRecords:
    records: list[Any] = field(default_factory=list)
    gaps: list[Gap] = field(default_factory=list)
    lines: int = 0


def _jsonl_objects(source: LineSource, result: JsonlRecords, required: tuple[str, ...]):
    for number, line in numbered_lines(source):
        result.lines = number
        if not line.strip():
            continue
        try:
            obj = _loads(line)
        except (json.JSONDecodeError, RecursionError):
            result.gaps.append(Gap(f"not a JSON object: {clip(line, 80)!r}", number))
            continue
        if not isinstance(obj, dict):
            result.gaps.append(Gap("not a JSON object", number))
            continue
        missing = [key for key in required if _read_int(obj.get(key)) is None]
        if missing:
            result.gaps.append(Gap(f"missing or non-integer {', '.join(missing)}", number))
            continue
        yield number, line, obj


def parse_ranks(source: LineSource) -> JsonlRecords:
    result = JsonlRecords()
    known = {"step", "rank", "loss", "grad_norm", "mem_allocated_gb"}
    for number, _line, obj in _jsonl_objects(source, result, ("step", "rank")):
        result.records.append(
            RankRecord(
                step=_read_int(obj["step"]) or 0,
                rank=_read_int(obj["rank"]) or 0,
                loss=read_float(obj.get("loss")),
                grad_norm=read_float(obj.get("grad_norm")),
                mem_allocated_gb=read_float(obj.get("mem_allocated_gb")),
                line=number,
                extra={k: v for k, v in obj.items() if k not in known},
            )
        )
    return result


def parse_batches(source: LineSource) -> JsonlRecords:
    result = JsonlRecords()
    for number, line, obj in _jsonl_objects(source, result, ("step",)):
        ids = obj.get("sample_ids")
        fingerprint = obj.get("fingerprint")
        result.records.append(
            BatchRecord(
                step=_read_int(obj["step"]) or 0,
                rank=_read_int(obj.get("rank")),
                fingerprint=None if fingerprint is None else str(fingerprint),
                num_samples=_read_int(obj.get("num_samples")),
                max_tokens=_read_int(obj.get("max_tokens")),
                min_tokens=_read_int(obj.get("min_tokens")),
                num_empty=_read_int(obj.get("num_empty")),
                sample_ids=[str(i) for i in ids] if isinstance(ids, list) else [],
                source=obj.get("source"),
                line=number,
                text=clip(line),
            )
        )
    return result


# --- checkpoints.json -------------------------------------------------------------------


@dataclass
class Checkpoint:
    step: int | None
    path: str | None
    time: datetime | None
    manifest: str | None
    verified: bool | None
    problem: str | None


@dataclass
class CheckpointList:
    checkpoints: list[Checkpoint] = field(default_factory=list)
    gaps: list[Gap] = field(default_factory=list)


def parse_checkpoints(source: LineSource) -> CheckpointList:
    result = CheckpointList()
    raw = _document(source, list, "checkpoints.json", result.gaps)
    if raw is None:
        return result
    for index, entry in enumerate(raw):
        if not isinstance(entry, dict):
            result.gaps.append(Gap(f"checkpoint #{index} is not an object"))
            continue
        verified = entry.get("verified")
        result.checkpoints.append(
            Checkpoint(
                step=_read_int(entry.get("step")),
                path=entry.get("path"),
                time=parse_any(entry.get("time")),
                manifest=entry.get("manifest"),
                verified=verified if isinstance(verified, bool) else None,
                problem=entry.get("problem"),
            )
        )
    return result


# --- registry ---------------------------------------------------------------------------


def _json_head(sample: str) -> Any:
    try:
        return json.loads(sample)
    except (json.JSONDecodeError, RecursionError):
        return None


def _detect_incident(sample: str) -> float:
    return 0.95 if '"spikeops-bundle/' in sample[:4096] or ('"incident_id"' in sample and '"job"' in sample) else 0.0


def _detect_probes(sample: str) -> float:
    head = _json_head(sample)
    if isinstance(head, dict) and head and all(
        isinstance(v, dict) and "command" in v and "error" in v for v in head.values()
    ):
        return 0.9
    return 0.0


def _first_objects(sample: str, limit: int = 20) -> list[dict[str, Any]]:
    objects = []
    for line in sample.splitlines()[:limit]:
        head = _json_head(line)
        if isinstance(head, dict):
            objects.append(head)
    return objects


def _detect_ranks(sample: str) -> float:
    objects = _first_objects(sample)
    if objects and all("rank" in o and "step" in o for o in objects) and not any("fingerprint" in o for o in objects):
        return 0.85
    return 0.0


def _detect_batches(sample: str) -> float:
    objects = _first_objects(sample)
    if objects and all("step" in o for o in objects) and any(
        k in o for o in objects for k in ("fingerprint", "max_tokens", "sample_ids", "num_empty")
    ):
        return 0.9
    return 0.0


def _detect_checkpoints(sample: str) -> float:
    head = _json_head(sample)
    if isinstance(head, list) and head and all(isinstance(e, dict) and "verified" in e for e in head):
        return 0.9
    return 0.0


def summarize_incident(incident: Incident) -> list[str]:
    job = incident.job
    lines = [
        f"incident {incident.incident_id} ({incident.format}), created {iso(incident.created)}",
        f"job {job.id} {job.name or ''} on {job.scheduler}: {len(job.nodes)} node(s), "
        f"{job.gpus_per_node} GPU(s) per node",
    ]
    if incident.window:
        lines.append(f"window {iso(incident.window.start)} .. {iso(incident.window.end)}")
    if job.resumed_from:
        lines.append(f"resumed from step {job.resumed_from.step} ({job.resumed_from.path})")
    return lines


def _summarize_probes(result: ProbesFile) -> list[str]:
    lines = [f"{len(result.probes)} probe(s)" + (" - node UNREACHABLE" if result.unreachable else "")]
    for status in result.probes.values():
        state = status.error or f"exit {status.exit}"
        lines.append(f"  {status.name}: {state} ({status.command})")
    return lines


def _summarize_ranks(result: JsonlRecords) -> list[str]:
    records = result.records
    if not records:
        return ["no rank records"]
    steps = sorted({r.step for r in records})
    ranks = sorted({r.rank for r in records})
    return [f"{len(records)} rank record(s): steps {steps[0]}..{steps[-1]}, {len(ranks)} rank(s)"]


def _summarize_batches(result: JsonlRecords) -> list[str]:
    records = result.records
    if not records:
        return ["no batch records"]
    longest = max(records, key=lambda r: r.max_tokens or 0)
    empty = [r for r in records if r.num_empty]
    lines = [f"{len(records)} batch descriptor(s), steps {min(r.step for r in records)}..{max(r.step for r in records)}"]
    lines.append(f"  longest sample: {longest.max_tokens} tokens at step {longest.step} rank {longest.rank}")
    if empty:
        lines.append(f"  {len(empty)} batch(es) with empty samples, first at step {empty[0].step}")
    return lines


def _summarize_checkpoints(result: CheckpointList) -> list[str]:
    lines = [f"{len(result.checkpoints)} checkpoint(s)"]
    for ckpt in result.checkpoints:
        state = {True: "verified", False: f"CORRUPT: {ckpt.problem}", None: "not checked"}[ckpt.verified]
        lines.append(f"  step {ckpt.step}: {ckpt.path} ({state})")
    return lines


register(Kind("incident-json", "a bundle's incident.json", None, parse_incident, _detect_incident, summarize_incident))
register(Kind("probes-json", "a bundle node's probes.json", None, parse_probes, _detect_probes, _summarize_probes))
register(Kind("ranks-jsonl", "a bundle's ranks.jsonl (per-step, per-rank values)", None, parse_ranks,
              _detect_ranks, _summarize_ranks, streaming=True))
register(Kind("batches-jsonl", "a bundle's batches.jsonl (per-step batch descriptors)", None, parse_batches,
              _detect_batches, _summarize_batches, streaming=True))
register(Kind("checkpoints-json", "a bundle's checkpoints.json", None, parse_checkpoints,
              _detect_checkpoints, _summarize_checkpoints))
