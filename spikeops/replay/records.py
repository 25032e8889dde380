"""``replay/RUN/replay.jsonl`` read without trusting it (spec: shared/spec/bundle.md).

A replay is written by the training job itself, several ranks appending to one file, and it
may be killed mid-write (a replay that hits the NaN it was asked to reproduce, a time budget
that runs out). So the reader keeps every whole record and turns the rest into gaps: a cut
last line, garbage, a record without its step or rank, and two different records for the
same step and rank (a replay appended to an old one). Only the comparison decides whether
what is left is enough to judge; the reader never does.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from spikeops.errors import InputError
from spikeops.probes.base import Gap, LineSource, clip, numbered_lines
from spikeops.probes.bundle_files import read_float
from spikeops.textio import ReadReport, iter_lines

__all__ = ["ReplayRecord", "ReplayRun", "parse_replay", "read_replay", "REPLAY_FILE"]

REPLAY_FILE = "replay.jsonl"


@dataclass(frozen=True)
class ReplayRecord:
    """One step of one rank in a replay."""

    step: int
    rank: int
    node: str | None
    loss: float | None
    grad_norm: float | None
    local_grad_digest: str | None
    reduced_grad_digest: str | None
    #: The batch fingerprint (``spikeops.train.fingerprint``), when the job wrote it: the
    #: proof that two replays fed a rank the same data (an extension of the spec's record).
    fingerprint: str | None
    line: int
    text: str

    def same_result(self, other: ReplayRecord) -> bool:
        """The same step computed the same way (line numbers aside)."""
        return _key_fields(self) == _key_fields(other)


def _key_fields(record: ReplayRecord) -> tuple[Any, ...]:
    loss = "nan" if record.loss is not None and math.isnan(record.loss) else record.loss
    norm = "nan" if record.grad_norm is not None and math.isnan(record.grad_norm) else record.grad_norm
    return (record.step, record.rank, record.node, loss, norm, record.local_grad_digest,
            record.reduced_grad_digest, record.fingerprint)


@dataclass
class ReplayRun:
    """A replay as read: its records by (step, rank), what could not be read, and why.

    ``file`` is the name evidence cites (bundle-relative, e.g. ``replay/same-nodes/replay.jsonl``).
    ``problem`` is set when the file could not be read at all (missing, binary, empty).
    ``conflicts`` are (step, rank) keys written twice with different values: neither is trusted.
    """

    name: str
    file: str
    records: dict[tuple[int, int], ReplayRecord] = field(default_factory=dict)
    gaps: list[Gap] = field(default_factory=list)
    conflicts: set[tuple[int, int]] = field(default_factory=set)
    problem: str | None = None
    lines: int = 0

    @property
    def steps(self) -> list[int]:
        return sorted({step for step, _ in self.records})

    @property
    def ranks(self) -> list[int]:
        return sorted({rank for _, rank in self.records})

    def at(self, step: int) -> dict[int, ReplayRecord]:
        """The records of one step, by rank."""
        return {rank: record for (s, rank), record in self.records.items() if s == step}

    def placement(self) -> dict[int, str]:
        """Rank -> node as this replay ran (the first record of each rank that names one)."""
        out: dict[int, str] = {}
        for (_, rank), record in sorted(self.records.items()):
            if record.node and rank not in out:
                out[rank] = record.node
        return out

    def describe_gaps(self, limit: int = 3) -> str:
        shown = "; ".join(f"line {g.line}: {g.reason}" if g.line else g.reason for g in self.gaps[:limit])
        more = len(self.gaps) - limit
        return shown + (f" (+{more} more)" if more > 0 else "")


def _int(value: Any) -> int | None:
    number = read_float(value)
    if number is None or not math.isfinite(number) or number != int(number):
        return None
    return int(number)


def _text(value: Any) -> str | None:
    return value if isinstance(value, str) and value else None


def _records(source: LineSource, run: ReplayRun) -> Iterator[ReplayRecord]:
    for number, line in numbered_lines(source):
        run.lines = number
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except (ValueError, RecursionError):
            run.gaps.append(Gap(f"not a JSON object (cut or garbage): {clip(line, 80)!r}", number))
            continue
        if not isinstance(obj, dict):
            run.gaps.append(Gap("not a JSON object", number))
            continue
        step, rank = _int(obj.get("step")), _int(obj.get("rank"))
        if step is None or rank is None:
            run.gaps.append(Gap("missing or non-integer step or rank", number))
            continue
        yield ReplayRecord(step=step, rank=rank, node=_text(obj.get("node")), loss=read_float(obj.get("loss")),
                           grad_norm=read_float(obj.get("grad_norm")),
                           local_grad_digest=_text(obj.get("local_grad_digest")),
                           reduced_grad_digest=_text(obj.get("reduced_grad_digest")),
                           fingerprint=_text(obj.get("fingerprint")), line=number, text=clip(line))


def parse_replay(source: LineSource, *, name: str = "replay", file: str | None = None) -> ReplayRun:
    """Pure: the records of a ``replay.jsonl`` text (or iterable of lines), gaps beside them."""
    run = ReplayRun(name=name, file=file or f"replay/{name}/{REPLAY_FILE}")
    for record in _records(source, run):
        key = (record.step, record.rank)
        if key in run.conflicts:
            continue
        known = run.records.get(key)
        if known is None:
            run.records[key] = record
        elif not known.same_result(record):
            run.gaps.append(Gap(f"step {record.step} rank {record.rank} written twice with different values "
                                f"(lines {known.line} and {record.line}); neither is used", record.line))
            run.conflicts.add(key)
            del run.records[key]
    return run


def read_replay(path: str | Path, *, name: str | None = None, file: str | None = None) -> ReplayRun:
    """The I/O edge: a replay file read into a ``ReplayRun``. Never raises for a bad file:
    a missing, binary or empty file is a ``problem`` (the comparison says inconclusive)."""
    target = Path(path)
    if target.is_dir() or (not target.exists() and not target.suffix):  # the run's folder
        target = target / REPLAY_FILE
    label = name or target.parent.name or "replay"
    cited = file or f"replay/{label}/{REPLAY_FILE}"
    report = ReadReport(path=str(target))
    try:
        run = parse_replay(iter_lines(target, report), name=label, file=cited)
    except InputError as exc:
        return ReplayRun(name=label, file=cited, problem=str(exc))
    except OSError as exc:
        return ReplayRun(name=label, file=cited, problem=f"{target}: unreadable ({exc.strerror or exc})")
    run.gaps.extend(report.gaps())
    if not run.records and run.problem is None:
        run.problem = f"{cited}: no replay record in it" + (f" ({run.describe_gaps()})" if run.gaps else "")
    return run
