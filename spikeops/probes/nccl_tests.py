"""nccl-tests (``all_reduce_perf`` and its siblings): what a bandwidth and correctness run printed.

A node that comes back from a drain is run against a healthy peer before it serves a job
again (``spikeops.lifecycle``): the AllReduce is the operation a training job lives on, and
nccl-tests checks every element it reduces (``#wrong``) besides timing it. The printed form is
fixed by nccl-tests' ``PRINT`` formats (``src/common.cu``, later ``src/util.cu``):

- a header: ``# nccl-tests version 2.13.9 nccl-headers=... nccl-library=...`` and
  ``# Collective test starting: all_reduce_perf`` (2.13 and later), then ``# nThread 1 nGpus 8
  minBytes 8 maxBytes ... step: 2(factor) warmup iters: 5 iters: 20 agg iters: 1 validation: 1
  graph: 0``;
- ``# Using devices`` and one line per rank: ``#  Rank  0 Group  0 Pid 1234 on gpu-001 device
  0 [0000:19:00] NVIDIA H100 80GB HBM3`` (older: ``#   Rank  0 Pid ... device  0 [0x19] ...``);
- the table: ``size count type redop root`` then, out-of-place and in-place, ``time algbw busbw
  #wrong`` (``N/A`` when validation is off); newer versions may add per-iteration columns;
- the footer: ``# Out of bounds values : 0 OK`` (``N FAILED``), ``# Avg bus bandwidth : 70.74``
  (``OK``/``FAILED`` against ``NCCL_TESTS_MIN_BW``), ``# Collective test concluded: ...``;
- failures: ``HOST: Test NCCL failure common.cu:958 'unhandled system error / ...'``,
  ``HOST: Test CUDA failure ...``, `` .. HOST pid N: Test failure common.cu:1161``.

Old versions print the footer without the ``#``. The parser never raises: what it cannot read
is a gap, and a run cut short (no footer) is reported as such, never as clean.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from spikeops.probes.base import Gap, Kind, LineSource, clip, numbered_lines, register, to_number

__all__ = ["NcclTestRank", "NcclTestRow", "NcclTestRun", "parse", "detect", "summarize", "KIND"]


@dataclass(frozen=True)
class NcclTestRank:
    rank: int
    host: str
    device: int
    bus: str | None
    name: str
    line: int


@dataclass(frozen=True)
class NcclTestRow:
    """One size: its out-of-place and in-place time (us), bandwidths (GB/s) and wrong elements
    (None when validation was off, ``N/A``)."""

    size: int
    count: int
    type: str
    redop: str
    time_us: float | None
    algbw: float | None
    busbw: float | None
    wrong: int | None
    time_us_inplace: float | None
    algbw_inplace: float | None
    busbw_inplace: float | None
    wrong_inplace: int | None
    line: int


@dataclass
class NcclTestRun:
    version: str | None = None
    test: str | None = None
    gpus_per_process: int | None = None
    validation: bool | None = None
    ranks: list[NcclTestRank] = field(default_factory=list)
    rows: list[NcclTestRow] = field(default_factory=list)
    #: ``# Out of bounds values : N OK|FAILED``; None when the run never printed it.
    out_of_bounds: int | None = None
    avg_busbw: float | None = None
    #: ``OK``/``FAILED`` printed after the average (``NCCL_TESTS_MIN_BW``), else None.
    busbw_verdict: str | None = None
    #: ``Test NCCL failure`` / ``Test CUDA failure`` / ``Test failure`` lines, as printed.
    failures: list[tuple[int, str]] = field(default_factory=list)
    concluded: bool = False
    gaps: list[Gap] = field(default_factory=list)

    @property
    def hosts(self) -> list[str]:
        return sorted({rank.host for rank in self.ranks})

    @property
    def complete(self) -> bool:
        """The run reached its footer (a run cut short proves nothing)."""
        return self.out_of_bounds is not None

    def wrong_rows(self) -> list[NcclTestRow]:
        return [row for row in self.rows if (row.wrong or 0) > 0 or (row.wrong_inplace or 0) > 0]

    def peak_busbw(self) -> float | None:
        values = [v for row in self.rows for v in (row.busbw, row.busbw_inplace) if v is not None]
        return max(values) if values else None


_VERSION = re.compile(r"^#\s*nccl-tests version (?P<version>\S+)")
_STARTING = re.compile(r"^#\s*Collective test starting:\s*(?P<test>\S+)")
_PARAMS = re.compile(r"^#\s*nThread\s+\d+\s+nGpus\s+(?P<gpus>\d+).*?validation:\s*(?P<validation>\d+)")
_RANK = re.compile(r"^#\s+Rank\s+(?P<rank>\d+)(?:\s+Group\s+\d+)?\s+Pid\s+\d+\s+on\s+(?P<host>\S+)\s+device\s+"
                   r"(?P<device>\d+)\s+\[(?P<bus>[^\]]*)\]\s*(?P<name>.*?)\s*$")
_ROW = re.compile(r"^\s*(?P<size>\d+)\s+(?P<count>\d+)\s+(?P<type>[a-z0-9_]+)\s+(?P<redop>\S+)\s+(?P<root>-?\d+)"
                  r"\s+(?P<rest>.+?)\s*$")
_OOB = re.compile(r"^#?\s*Out of bounds values\s*:\s*(?P<n>\d+)\s*(?P<word>OK|FAILED)?")
_AVG = re.compile(r"^#?\s*Avg bus bandwidth\s*:\s*(?P<bw>\S+)\s*(?P<word>OK|FAILED)?")
_FAILURE = re.compile(r"Test (?:NCCL |CUDA |)failure\b")
_CONCLUDED = re.compile(r"^#\s*Collective test concluded")


def _measure(cells: list[str]) -> tuple[float | None, float | None, float | None, int | None]:
    time, algbw, busbw, wrong = (cells + [None, None, None, None])[:4]  # type: ignore[list-item]
    wrong_value = None if wrong in (None, "N/A") else to_number(wrong)
    return (to_number(time), to_number(algbw), to_number(busbw),
            int(wrong_value) if isinstance(wrong_value, (int, float)) else None)


def _row(number: int, match: re.Match[str]) -> NcclTestRow | None:
    cells = match["rest"].split()
    if len(cells) < 4:
        return None
    # per-iteration builds print eight cells per half; the classic table four
    half = 8 if len(cells) >= 16 else 4
    out = _measure(cells[:4])
    inplace = _measure(cells[half:half + 4]) if len(cells) >= half + 4 else (None, None, None, None)
    if out[2] is None and out[1] is None:
        return None
    return NcclTestRow(int(match["size"]), int(match["count"]), match["type"], match["redop"], *out, *inplace,
                       line=number)


def parse(source: LineSource) -> NcclTestRun:
    """Read nccl-tests output; never raises."""
    run = NcclTestRun()
    for number, line in numbered_lines(source):
        text = line.strip()
        if not text:
            continue
        if match := _VERSION.match(text):
            run.version = match["version"]
        elif match := _STARTING.match(text):
            run.test = match["test"]
        elif match := _PARAMS.match(text):
            run.gpus_per_process = int(match["gpus"])
            run.validation = match["validation"] != "0"
        elif match := _RANK.match(line):
            run.ranks.append(NcclTestRank(int(match["rank"]), match["host"], int(match["device"]),
                                          match["bus"] or None, match["name"], number))
        elif match := _OOB.match(text):
            run.out_of_bounds = int(match["n"])
        elif match := _AVG.match(text):
            value = to_number(match["bw"])
            run.avg_busbw = float(value) if value is not None else None
            run.busbw_verdict = match["word"]
        elif _CONCLUDED.match(text):
            run.concluded = True
        elif _FAILURE.search(text):
            run.failures.append((number, clip(text)))
        elif text.startswith("#"):
            continue
        elif match := _ROW.match(line):
            row = _row(number, match)
            if row is None:
                run.gaps.append(Gap(f"line {number}: a table row without its measurements", number))
            else:
                run.rows.append(row)
        elif len(run.gaps) < 50:
            run.gaps.append(Gap(f"line {number}: not nccl-tests output: {clip(text, 80)}", number))
    if not run.complete and not run.failures:
        run.gaps.append(Gap("no 'Out of bounds values' line: the run was cut short or never ran"))
    return run


def detect(sample: str) -> float:
    if re.search(r"^#\s*Out of bounds values\s*:", sample, re.M) or re.search(r"^#\s*nccl-tests version", sample, re.M):
        return 0.95
    if re.search(r"^#\s+size\s+count\s+type\s+redop", sample, re.M) or re.search(r"^#\s*Collective test starting",
                                                                                   sample, re.M):
        return 0.9
    if re.search(r"^#\s*nThread \d+ nGpus \d+ minBytes", sample, re.M):
        return 0.85
    return 0.0


def summarize(run: NcclTestRun) -> list[str]:
    head = (f"nccl-tests {run.version or '?'} {run.test or ''}".rstrip() + f": {len(run.ranks)} rank(s) on "
            f"{', '.join(run.hosts) or '?'}, {len(run.rows)} size(s)")
    lines = [head]
    if run.complete:
        lines.append(f"  out of bounds values: {run.out_of_bounds}; avg bus bandwidth {run.avg_busbw} GB/s"
                     + (f" ({run.busbw_verdict})" if run.busbw_verdict else "")
                     + (f"; peak {run.peak_busbw()} GB/s" if run.peak_busbw() is not None else ""))
    else:
        lines.append("  the run did not finish (no 'Out of bounds values' line)")
    for row in run.wrong_rows()[:5]:
        lines.append(f"  WRONG at {row.size} B: {row.wrong} out-of-place, {row.wrong_inplace} in-place (line {row.line})")
    for number, text in run.failures[:5]:
        lines.append(f"  FAILURE line {number}: {text}")
    return lines


KIND = register(
    Kind(
        name="nccl-tests",
        description="nccl-tests (all_reduce_perf...): per-size bandwidth, wrong elements, out-of-bounds verdict",
        command="all_reduce_perf -b 8M -e 1G -f 2 -g 8",
        parse=parse,
        detect=detect,
        summarize=summarize,
    )
)
