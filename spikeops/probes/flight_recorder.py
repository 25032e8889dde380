"""PyTorch's flight recorder dumps: the last collectives each rank issued, as torch wrote them.

Each rank of a ``torch.distributed`` job keeps a ring of its recent collectives when
``TORCH_FR_BUFFER_SIZE`` (older: ``TORCH_NCCL_TRACE_BUFFER_SIZE``) is set. On a watchdog
timeout (NCCL, ``TORCH_NCCL_DUMP_ON_TIMEOUT``) or on demand
(``torch._C._distributed_c10d._dump_fr_trace`` / ``_dump_nccl_trace``, and their ``_json``
forms) the ring is written to ``TORCH_FR_DUMP_TEMP_FILE`` + the global rank (default
``/tmp/nccl_trace_rank_``). Two formats, both read here from the bytes as written:

- **pickle** (the default): a protocol-2 pickle of plain dicts, lists, tuples, strings and
  numbers, no class at all. It is untrusted input (a file on a sick node, or planted there),
  so it is read with an unpickler whose ``find_class`` refuses every global and which has no
  persistent loader: a crafted file that tries ``os.system`` (or anything else) through
  ``__reduce__`` is refused before any code runs, and reported as a gap;
- **JSON** (``_dump_fr_trace_json``): the same document, numbers as JSON numbers except
  ``pg_status``, whose values torch writes as strings; no ``frames``.

The document (version ``2.x``): ``version``, ``comm_lib_version``, ``pg_config`` (process
group name -> ``name``, ``desc``, ``ranks`` as the string ``"[0, 1, 2]"``), ``pg_status``
(group -> ``last_enqueued_collective``, ``last_started_collective``,
``last_completed_collective``) and ``entries``, oldest first, each with ``record_id``,
``pg_id``, ``process_group`` (name, desc), ``collective_seq_id``, ``p2p_seq_id``, ``op_id``,
``profiling_name`` (``nccl:all_reduce``, ``gloo:broadcast``, ``nccl:send 0->1``,
``nccl:recv 1<-0``), ``input_sizes``/``output_sizes``, dtypes, ``state`` (``scheduled``,
``started``, ``completed``), ``retired``, timestamps (``time_created_ns``, Unix nanoseconds)
and ``frames`` (the Python stack that issued it, pickle only). Values are kept as torch
wrote them; a field a version lacks is None.

What torch 2.13's gloo backend (CPU) does, as found in its code and by running it: gloo ranks
record every collective (``profiling_name`` ``gloo:...``), their ``state`` stays
``scheduled`` and ``retired`` turns true when the work completes; point-to-point sends and
receives are not recorded; and gloo has no watchdog that dumps on a timeout (it raises in the
caller instead), so a gloo job dumps through the on-demand API (``spikeops.train.
FlightRecorderDump`` calls it when the job stops making progress). Its ``pg_config`` is keyed
by the empty name while its entries name group ``"0"``, which torch's own analyzer
(``torch.distributed.flight_recorder``) trips over; the diagnosis matches groups by name and,
failing that, by the only group there is.

The rank of a dump is not inside it: torch puts it at the end of the file name (``trace_3``),
which ``rank_from_name`` reads for the bundle loader. ``parse`` itself looks only at content.
"""

from __future__ import annotations

import io
import json
import pickle
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from spikeops.probes.base import Gap, Kind, RemoteProbe, clip, register, register_remote

__all__ = [
    "Frame",
    "FrEntry",
    "PgConfig",
    "PgStatus",
    "FlightRecorderDump",
    "SafeUnpickler",
    "safe_loads",
    "parse",
    "detect",
    "detect_bytes",
    "summarize",
    "rank_from_name",
    "REMOTE",
    "KIND",
    "MAX_DUMP_BYTES",
    "DEFAULT_PREFIX",
]

#: A flight recorder dump of 20,000 entries with stacks is a few tens of MiB; more is not one.
MAX_DUMP_BYTES = 256 << 20
#: torch's default ``TORCH_FR_DUMP_TEMP_FILE`` (also ``TORCH_NCCL_DEBUG_INFO_TEMP_FILE``).
DEFAULT_PREFIX = "/tmp/nccl_trace_rank_"
#: Objects walked while turning an unpickled document into plain values: a pickle can share
#: one list many times over (memo references), so a small file can describe an exponential
#: tree; the walk stops at this budget instead of following it.
_WALK_BUDGET = 5_000_000
_MAX_DEPTH = 64
#: Frames kept per entry (the innermost first, as torch lists them).
MAX_FRAMES = 16


class _Refused(pickle.UnpicklingError):
    """A pickle asked for something a flight recorder dump never contains."""


class SafeUnpickler(pickle.Unpickler):
    """An unpickler for untrusted data: no global is ever resolved (no class, no function,
    no module), and no persistent id is loaded. Only the opcodes that build plain
    containers and scalars can succeed, so loading cannot run code."""

    def find_class(self, module: str, name: str) -> Any:  # noqa: D401 - pickle's hook
        raise _Refused(f"refused a global ({clip(str(module), 60)}.{clip(str(name), 60)}): "
                       "a flight recorder dump holds no classes or functions")

    def persistent_load(self, pid: Any) -> Any:
        raise _Refused("refused a persistent id: not a flight recorder dump")


def safe_loads(data: bytes) -> Any:
    """``pickle.loads`` for untrusted bytes (``SafeUnpickler``); raises UnpicklingError (or
    EOFError, ValueError...) on anything else, never runs code."""
    return SafeUnpickler(io.BytesIO(data)).load()


# --------------------------------------------------------------------------- the values


@dataclass(frozen=True)
class Frame:
    name: str
    filename: str
    line: int | None

    def text(self) -> str:
        return f"{self.name} ({self.filename}:{self.line})"


@dataclass
class FrEntry:
    """One collective (or p2p op) a rank issued, as recorded. ``index`` is its position in
    the dump's ``entries`` (what a finding cites: a dump has no lines)."""

    index: int
    record_id: int | None = None
    pg_id: int | None = None
    pg_name: str | None = None
    pg_desc: str | None = None
    collective_seq_id: int | None = None
    p2p_seq_id: int | None = None
    op_id: int | None = None
    profiling_name: str | None = None
    backend: str | None = None
    #: The operation without the backend: ``all_reduce``, ``broadcast``, ``send``, ``recv``.
    op: str | None = None
    #: For ``send``/``recv``: the group-local source and destination ranks in the name.
    src: int | None = None
    dst: int | None = None
    is_p2p: bool | None = None
    input_sizes: list[Any] | None = None
    output_sizes: list[Any] | None = None
    input_dtypes: list[Any] | None = None
    output_dtypes: list[Any] | None = None
    state: str | None = None
    retired: bool | None = None
    time_created_ns: int | None = None
    time_started_ns: int | None = None
    time_completed_ns: int | None = None
    timeout_ms: int | None = None
    duration_ms: float | None = None
    frames: list[Frame] = field(default_factory=list)

    @property
    def pending(self) -> bool:
        """Issued and not known to have finished: what a rank waits on in a hang. A retired
        entry or a ``completed`` state finished; gloo never leaves ``scheduled``, so only
        ``retired`` says its work is done."""
        if self.retired:
            return False
        return self.state not in ("completed",)

    def describe(self) -> str:
        sizes = f" {self.input_sizes}" if self.input_sizes is not None else ""
        seq = f"seq {self.collective_seq_id}" if not self.is_p2p else f"p2p seq {self.p2p_seq_id}"
        group = self.pg_desc or self.pg_name
        return (f"{seq} {self.profiling_name or '?'}{sizes} state {self.state or '?'}"
                f"{', retired' if self.retired else ''}" + (f" (group {group})" if group else ""))


@dataclass(frozen=True)
class PgConfig:
    name: str
    desc: str | None
    ranks: list[int] | None


@dataclass(frozen=True)
class PgStatus:
    last_enqueued: int | None
    last_started: int | None
    last_completed: int | None


@dataclass
class FlightRecorderDump:
    """One rank's dump. ``format`` is ``pickle`` or ``json`` (None when neither could be
    read); ``complete`` is False when the document could not be read whole (a truncated
    pickle, a cut JSON): what it holds then is only what could be read, or nothing."""

    format: str | None = None
    version: str | None = None
    comm_lib_version: str | None = None
    pg_config: dict[str, PgConfig] = field(default_factory=dict)
    pg_status: dict[str, PgStatus] = field(default_factory=dict)
    entries: list[FrEntry] = field(default_factory=list)
    complete: bool = False
    gaps: list[Gap] = field(default_factory=list)

    def newest_ns(self) -> int | None:
        times = [e.time_created_ns for e in self.entries if e.time_created_ns]
        return max(times) if times else None


# --------------------------------------------------------------------------- reading


class _TooBig(Exception):
    pass


def _plain(value: Any, budget: list[int], depth: int = 0) -> Any:
    """Plain JSON-like values (tuples become lists, bytes become text), within a budget."""
    budget[0] -= 1
    if budget[0] < 0 or depth > _MAX_DEPTH:
        raise _TooBig()
    if isinstance(value, dict):
        return {str(_plain(k, budget, depth + 1)): _plain(v, budget, depth + 1) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(v, budget, depth + 1) for v in value]
    if isinstance(value, bytes | bytearray):
        return bytes(value[:4096]).decode("utf-8", "replace")
    if isinstance(value, str | int | float | bool) or value is None:
        return value
    return str(value)[:200]


def _int(value: Any) -> int | None:
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, str) and re.fullmatch(r"\s*-?\d{1,30}\s*", value):
        return int(value)
    return None


def _float(value: Any) -> float | None:
    if isinstance(value, bool) or value is None:
        return None
    if isinstance(value, int | float):
        return float(value)
    try:
        return float(str(value))
    except ValueError:
        return None


def _text(value: Any) -> str | None:
    return None if value is None else clip(str(value), 200)


def _bool(value: Any) -> bool | None:
    return value if isinstance(value, bool) else None


_PROFILING = re.compile(r"^(?P<backend>[A-Za-z0-9_]+):(?P<op>[A-Za-z0-9_]+)(?: (?P<meta>.*))?$")
_SEND = re.compile(r"^(?P<src>-?\d+)->(?P<dst>-?\d+)$")
_RECV = re.compile(r"^(?P<dst>-?\d+)<-(?P<src>-?\d+)$")


def _ranks_list(value: Any) -> list[int] | None:
    """``"[0, 1, 2]"`` (how torch writes a group's ranks) or a real list."""
    if isinstance(value, list):
        ranks = [_int(v) for v in value]
        return [r for r in ranks if r is not None] if all(r is not None for r in ranks) else None
    if isinstance(value, str):
        numbers = re.findall(r"-?\d+", value)
        if re.fullmatch(r"\s*\[[\s\d,\-]*\]\s*", value):
            return [int(n) for n in numbers]
    return None


def _frames(value: Any) -> list[Frame]:
    frames = []
    for raw in (value if isinstance(value, list) else [])[:MAX_FRAMES]:
        if isinstance(raw, dict):
            frames.append(Frame(str(raw.get("name", "?"))[:200], str(raw.get("filename", "?"))[:300],
                                _int(raw.get("line"))))
    return frames


def _entry(index: int, raw: Mapping[str, Any]) -> FrEntry:
    group = raw.get("process_group")
    pg_name = pg_desc = None
    if isinstance(group, list) and group:
        pg_name = _text(group[0])
        pg_desc = _text(group[1]) if len(group) > 1 else None
    name = _text(raw.get("profiling_name"))
    backend = op = None
    src = dst = None
    if name:
        match = _PROFILING.match(name)
        if match:
            backend, op = match["backend"], match["op"]
            meta = match["meta"] or ""
            pair = _SEND.match(meta) if op == "send" else _RECV.match(meta) if op == "recv" else None
            if pair:
                src, dst = int(pair["src"]), int(pair["dst"])
    entry = FrEntry(
        index=index, record_id=_int(raw.get("record_id")), pg_id=_int(raw.get("pg_id")),
        pg_name=pg_name, pg_desc=pg_desc,
        collective_seq_id=_int(raw.get("collective_seq_id", raw.get("seq_id"))),
        p2p_seq_id=_int(raw.get("p2p_seq_id")), op_id=_int(raw.get("op_id")),
        profiling_name=name, backend=backend, op=op, src=src, dst=dst,
        is_p2p=_bool(raw.get("is_p2p")) if "is_p2p" in raw else (op in ("send", "recv") if op else None),
        input_sizes=raw.get("input_sizes") if isinstance(raw.get("input_sizes"), list) else None,
        output_sizes=raw.get("output_sizes") if isinstance(raw.get("output_sizes"), list) else None,
        input_dtypes=raw.get("input_dtypes") if isinstance(raw.get("input_dtypes"), list) else None,
        output_dtypes=raw.get("output_dtypes") if isinstance(raw.get("output_dtypes"), list) else None,
        state=_text(raw.get("state")), retired=_bool(raw.get("retired")),
        time_created_ns=_int(raw.get("time_created_ns")),
        time_started_ns=_int(raw.get("time_discovered_started_ns")) or None,
        time_completed_ns=_int(raw.get("time_discovered_completed_ns")) or None,
        timeout_ms=_int(raw.get("timeout_ms")), duration_ms=_float(raw.get("duration_ms")),
        frames=_frames(raw.get("frames")),
    )
    if entry.is_p2p is None and op is not None:
        entry.is_p2p = op in ("send", "recv")
    return entry


def _document(doc: Any, dump: FlightRecorderDump) -> None:
    if not isinstance(doc, dict):
        dump.gaps.append(Gap(f"not a flight recorder dump: the document is a {type(doc).__name__}, not a dict"))
        return
    if "entries" not in doc and "pg_config" not in doc:
        dump.gaps.append(Gap("not a flight recorder dump: no entries and no pg_config"))
        return
    dump.version = _text(doc.get("version"))
    dump.comm_lib_version = _text(doc.get("comm_lib_version")) or None
    config = doc.get("pg_config")
    if isinstance(config, dict):
        for key, value in config.items():
            if isinstance(value, dict):
                dump.pg_config[str(key)] = PgConfig(str(value.get("name", key)), _text(value.get("desc")),
                                                    _ranks_list(value.get("ranks")))
    status = doc.get("pg_status")
    if isinstance(status, dict):
        for key, value in status.items():
            if isinstance(value, dict):
                dump.pg_status[str(key)] = PgStatus(_int(value.get("last_enqueued_collective")),
                                                    _int(value.get("last_started_collective")),
                                                    _int(value.get("last_completed_collective")))
    entries = doc.get("entries")
    if entries is None:
        dump.gaps.append(Gap("the dump holds no entries"))
        return
    if not isinstance(entries, list):
        dump.gaps.append(Gap("entries is not a list"))
        return
    bad = 0
    for index, raw in enumerate(entries):
        if isinstance(raw, dict):
            dump.entries.append(_entry(index, raw))
        else:
            bad += 1
    if bad:
        dump.gaps.append(Gap(f"{bad} entr{'y' if bad == 1 else 'ies'} not a dict (skipped)"))


def _looks_pickle(data: bytes) -> bool:
    return len(data) >= 2 and data[0] == 0x80 and 2 <= data[1] <= 5


def parse(source: bytes | str) -> FlightRecorderDump:
    """A dump from its bytes (pickle or JSON, told apart by content). Never raises: a
    refused global, a truncated or corrupt file, the wrong kind of file is a gap, and the
    dump is then marked incomplete."""
    dump = FlightRecorderDump()
    data = source.encode("utf-8", "surrogateescape") if isinstance(source, str) else bytes(source)
    if not data.strip():
        dump.gaps.append(Gap("empty file: no flight recorder dump"))
        return dump
    if len(data) > MAX_DUMP_BYTES:
        dump.gaps.append(Gap(f"{len(data):,} bytes: larger than any flight recorder dump, not read"))
        return dump
    budget = [_WALK_BUDGET]
    if _looks_pickle(data):
        dump.format = "pickle"
        try:
            raw = safe_loads(data)
        except _Refused as exc:
            dump.gaps.append(Gap(str(exc)))
            return dump
        except EOFError:
            dump.gaps.append(Gap("truncated pickle: the file ends before the dump does (cut while written?)"))
            return dump
        except (pickle.UnpicklingError, ValueError, TypeError, KeyError, IndexError, AttributeError,
                OverflowError, MemoryError, RecursionError, UnicodeDecodeError) as exc:
            dump.gaps.append(Gap(f"corrupt pickle: {clip(f'{type(exc).__name__}: {exc}', 160)}"))
            return dump
    else:
        text = data.decode("utf-8", "replace").strip()
        if not text.startswith("{"):
            dump.gaps.append(Gap("neither a pickle nor a JSON object: not a flight recorder dump"))
            return dump
        dump.format = "json"
        try:
            raw = json.loads(text)
        except (ValueError, RecursionError) as exc:
            cut = isinstance(exc, json.JSONDecodeError) and exc.pos >= len(text) - 2
            dump.gaps.append(Gap(("truncated JSON: the file ends before the dump does" if cut else
                                  f"corrupt JSON: {clip(str(exc), 160)}")))
            return dump
    try:
        plain = _plain(raw, budget)
    except (_TooBig, RecursionError):
        dump.gaps.append(Gap("the document nests or shares more objects than any dump: not read"))
        return dump
    _document(plain, dump)
    dump.complete = not any(g.reason.startswith("not a flight recorder dump") for g in dump.gaps) \
        and (bool(dump.entries) or bool(dump.pg_config))
    return dump


_PICKLE_KEYS = (b"entries", b"pg_config", b"pg_status", b"profiling_name", b"collective_seq_id")


def detect_bytes(head: bytes) -> float:
    """A pickle whose head names the dump's keys; 0 for anything else (a JSON dump is text
    and is claimed by ``detect``)."""
    if not _looks_pickle(head):
        return 0.0
    found = sum(key in head for key in _PICKLE_KEYS)
    return 1.0 if found >= 2 else 0.4 if found == 1 else 0.0


def detect(sample: str) -> float:
    """A JSON dump: an object with ``entries`` and the recorder's own keys."""
    head = sample.lstrip()[:65536]
    if not head.startswith("{"):
        return 0.0
    keys = sum(f'"{key}"' in head for key in ("entries", "pg_config", "pg_status", "profiling_name",
                                               "collective_seq_id", "nccl_comm_state"))
    return 1.0 if keys >= 3 else 0.6 if keys == 2 else 0.0


def _span(ranks: list[int] | None) -> str:
    """``0-63`` for a contiguous group, the list otherwise (at most 16 shown)."""
    if not ranks:
        return "?"
    if ranks == list(range(ranks[0], ranks[0] + len(ranks))):
        return f"{ranks[0]}-{ranks[-1]}" if len(ranks) > 1 else str(ranks[0])
    return str(ranks[:16])[:-1] + (", ...]" if len(ranks) > 16 else "]")


def summarize(dump: FlightRecorderDump) -> list[str]:
    if dump.format is None or (not dump.entries and not dump.pg_config):
        return ["no flight recorder dump could be read"]
    groups = ", ".join(f"{key or '(unnamed)'}: ranks {_span(cfg.ranks)}" for key, cfg in list(dump.pg_config.items())[:4])
    lines = [f"flight recorder dump ({dump.format}, version {dump.version}): {len(dump.entries)} entries"
             + (f"; groups {groups}" if groups else "")]
    for key, status in list(dump.pg_status.items())[:4]:
        lines.append(f"  group {key or '(unnamed)'}: last enqueued {status.last_enqueued}, started "
                     f"{status.last_started}, completed {status.last_completed}")
    pending = [entry for entry in dump.entries if entry.pending]
    for entry in pending[:5]:
        lines.append(f"  pending: {entry.describe()}")
    if dump.entries and not pending:
        lines.append(f"  nothing pending; last: {dump.entries[-1].describe()}")
    return lines


_RANK_SUFFIX = re.compile(r"(\d+)(?:\.json|\.pkl|\.pickle)?$")


def rank_from_name(name: str) -> int | None:
    """The global rank torch appended to ``TORCH_FR_DUMP_TEMP_FILE`` (``trace_12`` -> 12)."""
    match = _RANK_SUFFIX.search(name)
    return int(match.group(1)) if match else None


KIND = register(Kind(
    name="flight-recorder",
    description="PyTorch flight recorder dump (pickle or JSON; pickle read without resolving any global)",
    command="TORCH_FR_BUFFER_SIZE=N; dumps at $TORCH_FR_DUMP_TEMP_FILE<rank>",
    parse=parse,
    detect=detect,
    summarize=summarize,
    binary=True,
    detect_bytes=detect_bytes,
    aliases=("fr-trace",),
))

#: The job's dumps from this node, as a tar archive the collector unpacks into
#: ``nodes/NODE/flight-recorder/`` (``spikeops.collect.plan`` writes the command: the dump
#: prefix from ``[job] flight_recorder`` or the job's own environment).
REMOTE = register_remote(RemoteProbe(
    name="flight-recorder", filename="flight-recorder.tar", command="{flight_recorder}",
    kind="flight-recorder", order=92, max_bytes=256 << 20, unpack="flight-recorder", baseline=False,
))
