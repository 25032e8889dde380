"""``dcgmi diag -r N``: NVIDIA DCGM diagnostics, as the table dcgmi prints (or ``-j`` JSON).

A DCGM diag run is the one on-node test that exercises the GPU hardware itself (memory,
PCIe, stress), so a ``Fail`` here is strong evidence for a hardware layer cause of a spike.

The table is a fixed stencil (``dcgmi/Diag.cpp``): a name cell, a result cell, and section
rows (``|-----  Deployment  ---...``). Quirks handled here, all seen in real captures:

- Long messages (``Warning``/``Error``/``Info`` rows) are cut into fixed-size slices, **mid-word**,
  one slice per row, the continuation rows having an empty name cell. The slice width is one less
  than the result cell (``| `` + slice + pad + `` |``), so it is derived from the table's ``|``
  positions and the slices are concatenated exactly, then runs of spaces collapsed.
- Per-GPU results: ``Pass - All``, ``Fail - GPU: 0``, ``Pass - GPUs: 1, 2, 3``, ``Warn - GPUs: ...``,
  ``Skip - All``; Deployment tests print a bare ``Pass``/``Fail``/``Skip``. A value longer than the
  cell is cut by dcgmi with ``...`` (a 16-GPU list), so the last id before ``...`` is not trusted.
- Excerpts: a table may start mid-way (no header, no section: ``section=None``), its last row may
  lack the closing ``|``, and a message row may stand alone in a section (the test it belonged to
  was cut away): it becomes a test named by its label, with one ``Error``/``Warn``/``Info`` result.
- Shell prompts and ``Successfully ran diagnostic for group.`` around the table are ignored;
  ``Error: ...`` lines (the diag did not run) become gaps.

``dcgmi diag -j`` prints the same results as JSON
(``{"DCGM GPU Diagnostic": {"test_categories": [...]}}``, ``"DCGM Diagnostic"`` in newer builds);
both are read into the same dataclasses.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any, Literal

from spikeops.probes.base import Gap, Kind, LineSource, clip, numbered_lines, register

__all__ = [
    "DcgmDiag",
    "DcgmTest",
    "DcgmResult",
    "DcgmMessage",
    "ALL_GPUS",
    "STATUSES",
    "parse_diag",
    "parse",
    "detect",
    "summarize",
    "KIND",
]

#: What dcgmi prints as a result, plus the kinds of standalone message rows.
STATUSES = ("Pass", "Fail", "Skip", "Warn", "Error", "Info")
#: Key used by ``failed_gpus`` when a test failed on "All" GPUs but the GPU count is unknown.
ALL_GPUS = -1

#: Row labels that carry a message rather than a test; the status a standalone one stands for.
_MESSAGE_LABELS = {"Warning": "Warn", "Error": "Error", "Info": "Info"}
#: Worst first: what a test "is" when its GPUs disagree.
_SEVERITY = {"Error": 0, "Fail": 1, "Warn": 2, "Skip": 3, "Pass": 4, "Info": 5}


@dataclass
class DcgmResult:
    """One result cell: a status and the GPUs it covers (``"all"`` for ``- All`` or a bare status)."""

    status: str
    gpus: list[int] | Literal["all"]
    text: str
    line: int | None = None
    #: dcgmi cut the cell with ``...``: the GPU list may be incomplete.
    truncated: bool = False


@dataclass
class DcgmMessage:
    """A ``Warning``/``Error``/``Info`` row, its wrapped slices joined back into one text."""

    kind: str
    text: str
    line: int
    #: GPU indices the message names (``GPU 0 ...``); empty when it names none.
    gpus: list[int] = field(default_factory=list)


@dataclass
class DcgmTest:
    """One test row (``GPU Memory``, ``PCIe``, ``Denylist``) with its results and messages."""

    section: str | None
    name: str
    results: list[DcgmResult] = field(default_factory=list)
    messages: list[str] = field(default_factory=list)
    line: int = 0
    text: str = ""
    message_details: list[DcgmMessage] = field(default_factory=list)

    @property
    def status(self) -> str | None:
        """The worst status among the results (a test that failed on one GPU failed)."""
        if not self.results:
            return None
        return min((r.status for r in self.results), key=lambda s: _SEVERITY.get(s, 9))

    @property
    def standalone(self) -> bool:
        """True for a message row with no test above it (an excerpt that cut the test away)."""
        return self.name in _MESSAGE_LABELS


@dataclass
class DcgmDiag:
    """A whole ``dcgmi diag`` run: versions, device ids, tests in print order, and gaps."""

    dcgm_version: str | None = None
    driver_version: str | None = None
    gpu_device_ids: list[str] = field(default_factory=list)
    tests: list[DcgmTest] = field(default_factory=list)
    gaps: list[Gap] = field(default_factory=list)
    #: Every Metadata row as printed (``EUD Test Version`` and others not named above).
    metadata: dict[str, str] = field(default_factory=dict)
    #: ``"table"`` or ``"json"``: which dcgmi output form was read.
    form: str = "table"
    #: Section headers in print order, also those with no test under them (an empty Stress
    #: section means the run level did not include stress tests, not that they passed).
    sections: list[str] = field(default_factory=list)

    def gpu_indices(self) -> list[int]:
        """GPU indices the run covered: one per device id, else every id a result names.

        dcgmi numbers GPUs 0..n-1 in the order of ``GPU Device IDs Detected`` when run on the
        default group, which is how the collector runs it.
        """
        if self.gpu_device_ids:
            return list(range(len(self.gpu_device_ids)))
        seen: set[int] = set()
        for test in self.tests:
            for result in test.results:
                if result.gpus != "all":
                    seen.update(result.gpus)
        return sorted(seen)

    def failed_gpus(self) -> dict[int, list[str]]:
        """GPU index -> names of the tests that failed on it and the messages about it.

        ``Fail`` and ``Error`` count; ``Warn`` does not (dcgmi itself passes the run on a
        warning). A failure on ``All`` GPUs is spread over every known GPU, or filed under
        ``ALL_GPUS`` when the GPU count is unknown.
        """
        known = self.gpu_indices()
        failed: dict[int, list[str]] = {}
        for test in self.tests:
            failing = [r for r in test.results if r.status in ("Fail", "Error")]
            if not failing:
                continue
            gpus: set[int] = set()
            for result in failing:
                if result.gpus == "all":
                    gpus.update(known or [ALL_GPUS])
                else:
                    gpus.update(result.gpus)
            for gpu in sorted(gpus):
                entries = failed.setdefault(gpu, [])
                if not test.standalone and test.name not in entries:
                    entries.append(test.name)
                for message in test.message_details:
                    if message.kind == "Info":
                        continue
                    if message.gpus and gpu not in message.gpus and gpu != ALL_GPUS:
                        continue
                    if message.text not in entries:
                        entries.append(message.text)
        return failed


# --------------------------------------------------------------------------- table form

_BORDER = re.compile(r"^\+[-=+]+\+\s*$")
_SECTION = re.compile(r"^[|+]-+\s+(?P<name>[A-Za-z][A-Za-z /]*?)\s+-+\+-+[|+]\s*$")
_RESULT = re.compile(
    r"^(?P<status>Pass|Fail|Skip|Warn)(?:\s*-\s*(?:(?P<all>All)|GPUs?\s*:\s*(?P<ids>[\d,\s.]*)))?\s*(?P<cut>\.\.\.)?$"
)
_GPU_MENTION = re.compile(r"\bGPU\s*(\d{1,4})\b")
_ERROR_LINE = re.compile(r"^\s*Error\b.*", re.I)
_METADATA = {
    "DCGM Version": "dcgm_version",
    "Driver Version Detected": "driver_version",
    "GPU Device IDs Detected": "gpu_device_ids",
}
#: What dcgmi prints for a value it could not get (``HelperDisplayValue``).
_BLANK_VALUES = {"", "Not Specified", "Not Found", "Not Supported", "Insf. Permission", "Unknown"}


@dataclass
class _Geometry:
    """Where a table's ``|`` bars stand: the name/result separator and the right edge."""

    sep: int
    right: int | None

    @property
    def chunk(self) -> int | None:
        """Width of one wrapped message slice: the result cell less ``' '`` and ``'  '``."""
        if self.right is None:
            return None
        width = self.right - self.sep - 4
        return width if width > 0 else None


@dataclass
class _Row:
    number: int
    raw: str
    name: str
    value: str
    chunk: str
    closed: bool


def _geometry_of(line: str, bar_chars: str = "|") -> _Geometry | None:
    """Column positions from a border or section row (``bar_chars="|+"``) or a data row
    (``"|"`` only: a message may contain ``+``), whichever the excerpt starts with."""
    bars = [i for i, c in enumerate(line) if c in bar_chars]
    if len(bars) >= 3 and bars[0] == 0:
        return _Geometry(sep=bars[1], right=bars[-1])
    if len(bars) == 2 and bars[0] == 0 and line.startswith("|"):
        return _Geometry(sep=bars[1], right=None)  # a cut row: right edge unknown
    return None


def _split_row(number: int, line: str, geometry: _Geometry) -> _Row | None:
    """A data row's name, value and message slice, by the table's positions when they fit."""
    sep, right = geometry.sep, geometry.right
    if len(line) <= sep or line[sep] != "|":
        own = _geometry_of(line)
        if own is None:
            return None
        sep, right = own.sep, own.right
    closed = right is not None and len(line) > right and line[right] == "|"
    if not closed:
        right = None
    name = line[1:sep].strip()
    value = (line[sep + 1 : right] if right is not None else line[sep + 1 :]).strip()
    chunk_width = geometry.chunk if geometry.sep == sep else None
    start = sep + 2
    if chunk_width is not None:
        chunk = line[start : start + chunk_width]
    elif right is not None:
        chunk = line[start : right - 1]
    else:
        chunk = line[start:]
    return _Row(number=number, raw=line, name=name, value=value, chunk=chunk, closed=closed)


def _gpu_ids(text: str) -> list[int]:
    return sorted({int(n) for n in _GPU_MENTION.findall(text)})


def _parse_result(value: str, line: int) -> DcgmResult | None:
    """``Pass - GPUs: 1, 2`` -> status and GPUs; None when the cell is not a result."""
    match = _RESULT.match(value.strip())
    if not match:
        return None
    ids_text = match["ids"]
    truncated = bool(match["cut"]) or (ids_text is not None and "..." in ids_text)
    if ids_text is not None:
        visible = ids_text.split("...")[0]
        parts = [p.strip() for p in visible.split(",")]
        if truncated and parts:
            parts = parts[:-1]  # the id right before '...' may itself be cut
        gpus: list[int] | Literal["all"] = [int(p) for p in parts if p.isdigit()]
    else:
        gpus = "all"
    return DcgmResult(status=match["status"], gpus=gpus, text=value.strip(), line=line, truncated=truncated)


def _collapse(text: str) -> str:
    return " ".join(text.split())


class _TableReader:
    """Walks the table rows once, keeping the open test and the open message."""

    def __init__(self, diag: DcgmDiag) -> None:
        self.diag = diag
        self.geometry: _Geometry | None = None
        self.section: str | None = None
        self.test: DcgmTest | None = None
        self.message: tuple[str, int, list[str]] | None = None  # kind, line, slices

    def close_message(self) -> None:
        if self.message is None:
            return
        kind, line, slices = self.message
        self.message = None
        text = _collapse("".join(slices))
        if not text:
            return
        detail = DcgmMessage(kind=kind, text=text, line=line, gpus=_gpu_ids(text))
        if self.test is None:
            self.test = DcgmTest(section=self.section, name=kind, line=line, text=text)
            self.diag.tests.append(self.test)
        if self.test.standalone and not any(m.kind == kind for m in self.test.message_details):
            gpus: list[int] | Literal["all"] = detail.gpus or "all"
            self.test.results.append(DcgmResult(_MESSAGE_LABELS[kind], gpus, text, line))
        self.test.messages.append(text)
        self.test.message_details.append(detail)

    def boundary(self, section: str | None) -> None:
        """A border or section row ends the open message and the open test."""
        self.close_message()
        self.test = None
        self.section = section
        if section is not None and section not in self.diag.sections:
            self.diag.sections.append(section)

    def row(self, row: _Row) -> None:
        if not row.closed:
            self.diag.gaps.append(Gap("table row ends without its closing '|' (output cut?)", row.number))
        if row.name == "Diagnostic" and row.value == "Result":
            return  # the header row
        if self.section == "Metadata":
            self.metadata(row)
        elif row.name in _MESSAGE_LABELS:
            self.close_message()
            self.message = (row.name, row.number, [row.chunk])
        elif row.name:
            self.close_message()
            self.new_test(row)
        else:
            self.continuation(row)

    def metadata(self, row: _Row) -> None:
        if not row.name:
            return
        self.diag.metadata[row.name] = row.value
        attribute = _METADATA.get(row.name)
        value = None if row.value in _BLANK_VALUES else row.value
        if attribute == "gpu_device_ids":
            self.diag.gpu_device_ids = [v.strip() for v in (value or "").split(",") if v.strip()]
        elif attribute is not None:
            setattr(self.diag, attribute, value)

    def new_test(self, row: _Row) -> None:
        self.test = DcgmTest(section=self.section, name=row.name, line=row.number, text=clip(row.raw))
        self.diag.tests.append(self.test)
        self.add_result(row)

    def add_result(self, row: _Row) -> None:
        assert self.test is not None
        result = _parse_result(row.value, row.number)
        if result is None:
            self.diag.gaps.append(Gap(f"unrecognised result {row.value[:60]!r} for {self.test.name!r}", row.number))
            return
        if result.truncated:
            self.diag.gaps.append(Gap("GPU list cut by dcgmi ('...'): some GPUs unlisted", row.number))
        self.test.results.append(result)

    def continuation(self, row: _Row) -> None:
        """An empty-name row: the next slice of a message, or a test's next result."""
        if self.message is not None:
            self.message[2].append(row.chunk)
        elif self.test is not None and not self.test.standalone:
            self.add_result(row)
        elif row.value:
            self.diag.gaps.append(Gap(f"row with no test above it: {row.value[:60]!r}", row.number))

    def finish(self) -> None:
        self.close_message()


def _parse_table(lines: Iterable[tuple[int, str]], diag: DcgmDiag) -> None:
    reader = _TableReader(diag)
    saw_table = False
    for number, raw in lines:
        line = raw.rstrip()
        if not line.startswith(("|", "+")):
            if line.strip():  # prose between tables ends whatever row was open
                reader.boundary(reader.section)
            if _ERROR_LINE.match(line):
                diag.gaps.append(Gap(clip(line), number))
            continue
        saw_table = True
        section = _SECTION.match(line)
        if section or _BORDER.match(line):
            reader.geometry = _geometry_of(line, "|+") or reader.geometry
            reader.boundary(section["name"].strip() if section else reader.section)
            continue
        if reader.geometry is None or reader.geometry.right is None:
            reader.geometry = _geometry_of(line) or reader.geometry
        if reader.geometry is None:
            diag.gaps.append(Gap(f"table row without column bars: {line[:60]!r}", number))
            continue
        row = _split_row(number, line, reader.geometry)
        if row is None:
            diag.gaps.append(Gap(f"table row does not fit the table's columns: {line[:60]!r}", number))
            continue
        reader.row(row)
    reader.finish()
    if not saw_table:
        diag.gaps.append(Gap("no dcgmi diag table found"))


# --------------------------------------------------------------------------- JSON form


def _as_text(value: object) -> str | None:
    if isinstance(value, str):
        return value
    if isinstance(value, int | float) and not isinstance(value, bool):
        return str(value)
    return None


def _json_messages(value: object) -> Iterator[str]:
    """``warnings`` is a string, a list of strings, or a list of ``{"warning": ...}`` objects."""
    if isinstance(value, str):
        if value.strip():
            yield _collapse(value)
    elif isinstance(value, list):
        for item in value:
            yield from _json_messages(item)
    elif isinstance(value, dict):
        for key in ("warning", "warnings", "message", "error", "msg"):
            if key in value:
                yield from _json_messages(value[key])
                return


def _json_gpus(result: dict[str, Any]) -> list[int] | Literal["all"]:
    for key in ("gpu_id", "gpu_ids", "entity_id"):
        text = _as_text(result.get(key))
        if text is not None:
            ids = [int(p) for p in re.findall(r"\d+", text)]
            return ids or "all"
    return "all"


def _line_of(needle: str, lines: list[tuple[int, str]], start: int) -> tuple[int, int]:
    """Line number of the next line containing ``needle`` (and the index to search on from)."""
    for index in range(start, len(lines)):
        if needle in lines[index][1]:
            return lines[index][0], index + 1
    return (lines[start][0] if start < len(lines) else 0), start


def _json_test(section: str | None, entry: dict[str, Any], line: int, text: str) -> DcgmTest:
    test = DcgmTest(section=section, name=_as_text(entry.get("name")) or "?", line=line, text=clip(text))
    results = entry.get("results")
    for result in results if isinstance(results, list) else []:
        if not isinstance(result, dict):
            continue
        status = (_as_text(result.get("status")) or "").strip()
        short = status.split(" - ")[0].strip()
        gpus = _json_gpus(result)
        if status.endswith("- All"):
            gpus = "all"
        test.results.append(DcgmResult(short or "?", gpus, status, line))
        # dcgmi prints Deployment problems as "Error" rows and per-GPU test problems as "Warning".
        problem = "Error" if section == "Deployment" else "Warning"
        for kind, key in ((problem, "warnings"), (problem, "warning"), ("Info", "info")):
            for message in _json_messages(result.get(key)):
                mentioned = _gpu_ids(message) or ([] if gpus == "all" else list(gpus))
                test.messages.append(message)
                test.message_details.append(DcgmMessage(kind, message, line, mentioned))
    return test


def _parse_json(text: str, lines: list[tuple[int, str]], diag: DcgmDiag) -> None:
    diag.form = "json"
    start = text.find("{")
    try:
        root = json.loads(text[start:])
    except (ValueError, RecursionError) as exc:
        diag.gaps.append(Gap(f"dcgmi diag JSON unreadable: {str(exc)[:80]}"))
        return
    if not isinstance(root, dict):
        diag.gaps.append(Gap("dcgmi diag JSON is not an object"))
        return
    body = root.get("DCGM GPU Diagnostic", root.get("DCGM Diagnostic"))
    body = body if isinstance(body, dict) else {}
    metadata = root.get("metadata") if isinstance(root.get("metadata"), dict) else {}
    for scope in (root, body, metadata):
        diag.dcgm_version = diag.dcgm_version or _as_text(scope.get("version")) or _as_text(scope.get("DCGM Version"))
        diag.driver_version = diag.driver_version or _as_text(scope.get("Driver Version Detected"))
        ids = scope.get("GPU Device IDs")
        if isinstance(ids, list) and not diag.gpu_device_ids:
            diag.gpu_device_ids = [t for t in (_as_text(i) for i in ids) if t]
    error = _as_text(body.get("runtime_error"))
    if error:
        diag.gaps.append(Gap(f"dcgmi diag did not run: {clip(error, 200)}"))
    categories = body.get("test_categories")
    if not isinstance(categories, list):
        if not error:
            diag.gaps.append(Gap("dcgmi diag JSON has no test_categories"))
        return
    cursor = 0
    for category in categories:
        if not isinstance(category, dict):
            continue
        section = _as_text(category.get("category"))
        if section and section not in diag.sections:
            diag.sections.append(section)
        tests = category.get("tests")
        for entry in tests if isinstance(tests, list) else []:
            if not isinstance(entry, dict):
                continue
            name = _as_text(entry.get("name")) or "?"
            line, cursor = _line_of(f'"{name}"', lines, cursor)
            raw = next((t for n, t in lines if n == line), "")
            diag.tests.append(_json_test(section, entry, line, raw))


# --------------------------------------------------------------------------- entry points


def parse_diag(source: LineSource) -> DcgmDiag:
    """Read ``dcgmi diag`` output (table or ``-j`` JSON); never raises, gaps say what was skipped."""
    lines = list(numbered_lines(source))
    diag = DcgmDiag()
    first = next((line.strip() for _, line in lines if line.strip() and not _is_prompt(line)), "")
    if first.startswith("{"):
        _parse_json("\n".join(line for _, line in lines), lines, diag)
    else:
        _parse_table(lines, diag)
    return diag


#: The registry's generic name for the entry point.
parse = parse_diag


def _is_prompt(line: str) -> bool:
    return bool(re.search(r"[$#]\s*dcgmi\b", line))


_DETECT_STRONG = re.compile(
    r"^Successfully ran diagnostic for group\.|^\| Diagnostic +\| Result +\||^[|+]-----  (?:Metadata|Deployment|Integration|Hardware|Stress|Performance)  -",
    re.M,
)
_DETECT_ROW = re.compile(
    r"^\| [A-Za-z][\w /.-]{0,40}? +\| (?:(?:Pass|Fail|Skip|Warn) - (?:All|GPUs?: [\d, ]+)|GPU \d+ \S)", re.M
)


def detect(sample: str) -> float:
    if re.search(r'"DCGM (?:GPU )?Diagnostic"\s*:', sample) and "test_categories" in sample:
        return 0.95
    if _DETECT_STRONG.search(sample):
        return 0.95
    if re.search(r"^\| (?:Warning|Error|Info) +\| GPU \d+ ", sample, re.M) or _DETECT_ROW.search(sample):
        return 0.8
    return 0.0


def _counts(tests: list[DcgmTest]) -> str:
    tally: dict[str, int] = {}
    for test in tests:
        status = test.status or "no result"
        tally[status] = tally.get(status, 0) + 1
    order = sorted(tally, key=lambda s: _SEVERITY.get(s, 9))
    return ", ".join(f"{tally[s]} {s.lower()}" for s in order)


def summarize(diag: DcgmDiag) -> list[str]:
    ids = sorted(set(diag.gpu_device_ids))
    lines = [
        f"dcgmi diag ({diag.form}): DCGM {diag.dcgm_version or '?'}, driver {diag.driver_version or '?'}, "
        f"{len(diag.gpu_device_ids) or '?'} GPUs" + (f" (device id {', '.join(ids)})" if ids else "")
    ]
    sections: dict[str, list[DcgmTest]] = {name: [] for name in diag.sections if name != "Metadata"}
    for test in diag.tests:
        sections.setdefault(test.section or "(no section)", []).append(test)
    for section, tests in sections.items():
        lines.append(f"  {section}: {_counts(tests) if tests else 'no tests run'}")
    for test in diag.tests:
        bad = [r for r in test.results if r.status in ("Fail", "Error", "Warn")]
        for result in bad:
            where = "all GPUs" if result.gpus == "all" else "GPU " + ", ".join(map(str, result.gpus))
            label = f"{test.section}/{test.name}" if test.section else test.name
            lines.append(f"  {result.status.upper()} {label}: {where} (line {result.line})")
        for message in test.message_details:
            if message.kind in ("Warning", "Error"):
                lines.append(f"    {message.kind}: {clip(message.text, 300)}")
    failed = diag.failed_gpus()
    if failed:
        lines.append("  failed GPUs: " + ", ".join("all" if g == ALL_GPUS else str(g) for g in sorted(failed)))
    return lines


KIND = register(
    Kind(
        name="dcgmi-diag",
        description="dcgmi diag -r N: DCGM diagnostics table (or -j JSON), per-test per-GPU results",
        command="dcgmi diag -r 2",
        parse=parse_diag,
        detect=detect,
        summarize=summarize,
    )
)
