"""Where ``spikeops watch`` reads a job's metrics: the I/O edge, yielding metric records.

Every source yields plain dicts in the ``metrics.jsonl`` shape (shared/spec/bundle.md) for
``Detector.feed``, and ends when ``stop()`` returns true, when ``timeout`` seconds have
passed, or (``once``) when it has read what is there now.

- ``follow_metrics(path)``: a ``metrics.jsonl`` with ``tail -f`` semantics: a partial last
  line waits for its newline (the writer is mid-line); a file truncated in place
  (``copytruncate``) or replaced (rotation: the path now names another inode) is read again
  from its start; a line that is not a JSON object is skipped and counted; a file that does
  not exist yet is waited for. ``from_start`` replays what the file already holds, otherwise
  only lines written from now on count (a line being written when we start is dropped).
- ``follow_log(path)``: the job's own log, any format ``spikeops.probes.training_log`` reads
  (Megatron, DeepSpeed, HF Trainer, generic ``step ... loss`` lines), one line at a time.
- ``poll_prometheus(url, queries)``: instant queries (``GET /api/v1/query``) for each field,
  every ``poll_s`` seconds; urllib only. A query must return one series (or a scalar): two
  series means the query does not pick one job, which is an error, not a guess. Without a
  ``step`` query, polls are numbered and a poll that returns exactly the previous values
  (nothing new scraped) is skipped. The first poll failing is an InputError (a wrong URL or
  query); later failures (Prometheus restarting) are counted and the next poll tries again.

``once`` means "read what is there now and end": a file is then read from its start, whatever
``from_start`` says, and Prometheus is polled once. ``idle=True`` also yields ``None`` each time
a poll finds nothing new (the watcher then asks whether the job has stalled). ``SourceStats`` counts what each source
read, skipped and re-opened.
"""

from __future__ import annotations

import json
import math
import os
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from spikeops.errors import InputError
from spikeops.probes.training_log import LineReader, StepRecord
from spikeops.timeparse import from_unix, iso
from spikeops.watch.detect import WatchConfig

__all__ = ["SourceStats", "follow_lines", "follow_metrics", "follow_log", "poll_prometheus", "step_dict",
           "open_source", "MAX_LINE", "FILE_POLL_S", "PROMETHEUS_TOKEN_ENV"]

#: A "line" longer than this without a newline is not a metrics line; it is dropped (counted)
#: rather than buffered without bound.
MAX_LINE = 1 << 20
_CHUNK = 1 << 20
#: How often a followed file is looked at when it has nothing new (cheap: one read, one stat).
FILE_POLL_S = 0.25
#: The environment variable holding a Bearer token for Prometheus (never read from a file).
PROMETHEUS_TOKEN_ENV = "SPIKEOPS_PROMETHEUS_TOKEN"

Stop = Callable[[], bool]


@dataclass
class SourceStats:
    lines: int = 0
    records: int = 0
    bad_lines: int = 0
    #: Times the file was read again from its start (truncated or replaced).
    reopened: int = 0
    polls: int = 0
    errors: int = 0
    last_error: str | None = None


class _Clock:
    """When to end: ``stop()`` or the deadline; ``wait`` sleeps in short slices so a stop
    request is seen within 0.1 s."""

    def __init__(self, stop: Stop | None, timeout: float | None) -> None:
        self.stop = stop
        self.deadline = None if timeout is None else time.monotonic() + timeout

    def done(self) -> bool:
        if self.stop is not None and self.stop():
            return True
        return self.deadline is not None and time.monotonic() >= self.deadline

    def wait(self, seconds: float) -> bool:
        """Sleep up to ``seconds``; False when it is time to end."""
        end = time.monotonic() + seconds
        while True:
            if self.done():
                return False
            left = end - time.monotonic()
            if left <= 0:
                return True
            time.sleep(min(0.1, left))


def _identity(path: Path) -> tuple[tuple[int, int] | None, int]:
    """((device, inode), size) of the file the path names now; (None, 0) when there is none."""
    try:
        info = path.stat()
    except OSError:
        return None, 0
    return (info.st_dev, info.st_ino), info.st_size


def _open(path: Path) -> Any:
    try:
        if path.is_dir():
            raise InputError(f"{path}: is a directory, not a file")
        return path.open("rb")
    except PermissionError:
        raise InputError(f"{path}: permission denied") from None
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise InputError(f"{path}: cannot be read ({exc.strerror or exc})") from None


def follow_lines(path: str | Path, *, from_start: bool = False, once: bool = False, stop: Stop | None = None,
                 timeout: float | None = None, poll_s: float = FILE_POLL_S,
                 stats: SourceStats | None = None) -> Iterator[str | None]:
    """Complete lines of a growing file (newline removed), and None whenever a poll found
    nothing new (so a consumer can flush what it holds). See the module docstring.

    The file is opened (and its end taken as "now") when this is called, not when the first
    line is asked for, so lines written in between are not lost; errors are raised here too."""
    return _Tail(Path(path).expanduser(), from_start, once, _Clock(stop, timeout), poll_s,
                 stats if stats is not None else SourceStats()).lines()


class _Tail:
    def __init__(self, target: Path, from_start: bool, once: bool, clock: _Clock, poll_s: float,
                 stats: SourceStats) -> None:
        self.target, self.once, self.clock, self.poll_s, self.stats = target, once, clock, poll_s, stats
        self.handle = _open(target)
        if self.handle is None and once:
            raise InputError(f"{target}: no such file")
        self.buffer = b""
        self.skip_fragment = False
        if self.handle is not None and not (from_start or once):
            size = self.handle.seek(0, os.SEEK_END)
            if size:
                self.handle.seek(size - 1)
                self.skip_fragment = self.handle.read(1) != b"\n"
        self.identity = _identity(target)[0] if self.handle is not None else None

    def lines(self) -> Iterator[str | None]:
        try:
            yield from self._lines()
        finally:
            if self.handle is not None:
                self.handle.close()

    def _lines(self) -> Iterator[str | None]:
        stats, clock = self.stats, self.clock
        drained = False
        while True:
            if self.handle is None:
                self.handle = _open(self.target)
                if self.handle is None:
                    if not clock.wait(self.poll_s):
                        return
                    continue
                self.identity = _identity(self.target)[0]
            data = self.handle.read(_CHUNK)
            if data:
                *complete, self.buffer = (self.buffer + data).split(b"\n")
                if self.skip_fragment and complete:
                    complete, self.skip_fragment = complete[1:], False
                for raw in complete:
                    stats.lines += 1
                    yield raw.decode("utf-8", errors="replace").rstrip("\r")
                if len(self.buffer) > MAX_LINE:
                    stats.bad_lines += 1
                    self.buffer, self.skip_fragment = b"", True
                if clock.done():
                    return
                continue
            # At the end of what is there: the last line, if unterminated, waits for its newline.
            if self.once:
                if self.buffer.strip() and not self.skip_fragment:
                    stats.lines += 1
                    yield self.buffer.decode("utf-8", errors="replace").rstrip("\r")
                return
            now, size = _identity(self.target)
            if now != self.identity:
                # Replaced (rotation): read the old file to its end once more, then the new
                # one from its start.
                if not drained:
                    drained = True
                    continue
                self.handle.close()
                self.handle, self.buffer, self.skip_fragment, drained = None, b"", False, False
                stats.reopened += 1
                continue
            if size < self.handle.tell():
                # Truncated in place (copytruncate): the file starts over.
                self.handle.seek(0)
                self.buffer, self.skip_fragment = b"", False
                stats.reopened += 1
                continue
            yield None
            if not clock.wait(self.poll_s):
                return


def follow_metrics(path: str | Path, *, from_start: bool = False, once: bool = False, stop: Stop | None = None,
                   timeout: float | None = None, poll_s: float = FILE_POLL_S,
                   stats: SourceStats | None = None, idle: bool = False) -> Iterator[dict[str, Any] | None]:
    """Records of a ``metrics.jsonl`` as they are written (NaN/Infinity tokens are read by
    ``json``; ``"nan"`` strings are left for the detector, which reads both)."""
    stats = stats if stats is not None else SourceStats()
    lines = follow_lines(path, from_start=from_start, once=once, stop=stop, timeout=timeout, poll_s=poll_s,
                         stats=stats)
    return _json_records(lines, stats, idle)


def _json_records(lines: Iterator[str | None], stats: SourceStats, idle: bool = False) -> Iterator[dict[str, Any] | None]:
    for line in lines:
        if line is None and idle:
            yield None
            continue
        if line is None or not line.strip():
            continue
        try:
            record = json.loads(line)
        except (ValueError, RecursionError):
            stats.bad_lines += 1
            continue
        if not isinstance(record, dict):
            stats.bad_lines += 1
            continue
        stats.records += 1
        yield record


def step_dict(record: StepRecord) -> dict[str, Any]:
    """A training-log step as a metrics record. ``nan`` only when the job itself counted a
    NaN iteration (a non-finite loss is in ``loss``; a non-finite grad norm may be an fp16
    overflow, which the detector tells apart). Without a printed throughput, Megatron's
    time per iteration gives iterations per second (only its changes matter)."""
    out: dict[str, Any] = {"step": record.step}
    if record.time is not None:
        out["time"] = iso(record.time)
    for name in ("loss", "lr", "grad_norm", "loss_scale", "tokens", "throughput"):
        value = getattr(record, name)
        if value is not None:
            out[name] = value
    if "throughput" not in out and record.iteration_time_s:
        out["throughput"] = 1.0 / record.iteration_time_s
    if record.skipped is not None:
        out["skipped"] = record.skipped
    if (record.nan_iterations or 0) > 0:
        out["nan"] = True
    return out


def follow_log(path: str | Path, *, from_start: bool = False, once: bool = False, stop: Stop | None = None,
               timeout: float | None = None, poll_s: float = FILE_POLL_S,
               stats: SourceStats | None = None, idle: bool = False) -> Iterator[dict[str, Any] | None]:
    """Step records of a training log as its lines are written. A step is released when the
    next step's line arrives, or when the log has been quiet for one poll."""
    stats = stats if stats is not None else SourceStats()
    lines = follow_lines(path, from_start=from_start, once=once, stop=stop, timeout=timeout, poll_s=poll_s,
                         stats=stats)
    return _log_records(lines, stats, idle)


def _log_records(lines: Iterator[str | None], stats: SourceStats, idle: bool = False) -> Iterator[dict[str, Any] | None]:
    reader = LineReader()
    try:
        for line in lines:
            records = reader.flush() if line is None else reader.feed(line)
            for record in records:
                stats.records += 1
                yield step_dict(record)
            if line is None and idle and not records:
                yield None
        for record in reader.flush():
            stats.records += 1
            yield step_dict(record)
    finally:
        stats.bad_lines += len(reader.gaps)  # lines that looked like steps but did not read


# --------------------------------------------------------------------------- Prometheus


def _promql_value(raw: Any) -> float | None:
    try:
        return float(raw)  # Prometheus writes "NaN", "+Inf", "-Inf": float() reads them
    except (TypeError, ValueError):
        return None


def _instant(base: str, name: str, query: str, timeout: float, token: str | None) -> tuple[float | None, float | None]:
    """(value, evaluation time) of one instant query; (None, None) for an empty result."""
    url = f"{base}/api/v1/query?" + urllib.parse.urlencode({"query": query})
    request = urllib.request.Request(url, headers={"Accept": "application/json"})
    if token:
        request.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:  # noqa: S310 - the operator's URL
            body = response.read(8 << 20)
    except urllib.error.HTTPError as exc:
        try:
            reason = json.loads(exc.read(1 << 16)).get("error") or exc.reason
        except (ValueError, AttributeError):
            reason = exc.reason
        raise InputError(f"prometheus query for {name} failed: HTTP {exc.code}: {str(reason)[:200]}") from None
    except (urllib.error.URLError, OSError) as exc:
        reason = getattr(exc, "reason", exc)
        raise InputError(f"prometheus at {base} unreachable: {str(reason)[:200]}") from None
    try:
        document = json.loads(body)
        data = document["data"]
        kind, result = data["resultType"], data["result"]
    except (ValueError, KeyError, TypeError):
        raise InputError(f"prometheus at {base} answered the {name} query with something that is not "
                         "its JSON API") from None
    if kind == "scalar":
        return _promql_value(result[1]), _promql_value(result[0])
    if kind != "vector":
        raise InputError(f"prometheus query for {name} gives a {kind}; an instant vector or scalar is needed")
    if not result:
        return None, None
    if len(result) > 1:
        raise InputError(f"prometheus query for {name} returns {len(result)} series; "
                         "add label matchers so it picks one job")
    try:
        stamp, value = result[0]["value"]
    except (KeyError, TypeError, ValueError):
        raise InputError(f"prometheus answered the {name} query without a value") from None
    return _promql_value(value), _promql_value(stamp)


def poll_prometheus(url: str, queries: Mapping[str, str], *, poll_s: float = 15.0, once: bool = False,
                    stop: Stop | None = None, timeout: float | None = None, request_timeout: float = 10.0,
                    token: str | None = None, stats: SourceStats | None = None,
                    idle: bool = False) -> Iterator[dict[str, Any] | None]:
    """One record per poll of a Prometheus server (see the module docstring). ``token``, when
    given, is sent as a Bearer token (read it from the environment, never from a file)."""
    parsed = urllib.parse.urlsplit(url or "")
    if parsed.scheme not in ("http", "https") or not parsed.netloc:
        raise InputError(f"prometheus URL must be http(s)://HOST[:PORT], not {url!r}")
    if not queries or not any(name != "step" for name in queries):
        raise InputError("no prometheus queries: give at least loss (--query loss=PROMQL or [watch.prometheus])")
    return _poll(url.rstrip("/"), dict(queries), poll_s, once, _Clock(stop, timeout), request_timeout, token,
                 stats if stats is not None else SourceStats(), idle)


def _poll(base: str, queries: dict[str, str], poll_s: float, once: bool, clock: _Clock, request_timeout: float,
          token: str | None, stats: SourceStats, idle: bool = False) -> Iterator[dict[str, Any] | None]:
    previous: tuple[Any, ...] | None = None
    while True:
        stats.polls += 1
        try:
            answers = {name: _instant(base, name, query, request_timeout, token) for name, query in queries.items()}
        except InputError as exc:
            if stats.polls == 1:
                raise
            stats.errors += 1
            stats.last_error = str(exc)
            answers = None
        record = _record(answers, stats, previous) if answers is not None else None
        if record is not None:
            previous = tuple(value for value, _ in answers.values())  # type: ignore[union-attr]
            stats.records += 1
            yield record
        elif idle:
            yield None
        if once or not clock.wait(poll_s):
            return


def _record(answers: dict[str, tuple[float | None, float | None]], stats: SourceStats,
            previous: tuple[Any, ...] | None) -> dict[str, Any] | None:
    values = tuple(value for value, _ in answers.values())
    record: dict[str, Any] = {}
    if "step" in answers:
        step = answers["step"][0]
        if step is None or not math.isfinite(step):
            return None  # the job's step is not scraped (yet): nothing to judge
        record["step"] = int(step)
    else:
        # No step query: a poll that saw exactly the previous values saw no new step.
        if previous is not None and repr(values) == repr(previous):
            return None
        record["step"] = stats.records + 1
    stamps = [stamp for _, stamp in answers.values() if stamp is not None]
    if stamps:
        record["time"] = iso(from_unix(stamps[0]))
    for name, (value, _) in answers.items():
        if name != "step" and value is not None:
            record[name] = value
    return record


def open_source(config: WatchConfig, *, metrics: str | Path | None = None, log: str | Path | None = None,
                prometheus: str | None = None, queries: Mapping[str, str] | None = None, from_start: bool = False,
                once: bool = False, stop: Stop | None = None, timeout: float | None = None,
                poll_s: float | None = None, stats: SourceStats | None = None,
                idle: bool = False) -> Iterator[dict[str, Any] | None]:
    """The one source named (a metrics file, a log, or a Prometheus URL), set up from the
    ``[watch]`` settings; ``queries`` add to (and override) ``[watch.prometheus]``; ``idle``:
    a ``None`` for every poll that found nothing new."""
    named = [name for name, value in (("metrics", metrics), ("log", log), ("prometheus", prometheus)) if value]
    if len(named) != 1:
        raise InputError("name exactly one source: a metrics.jsonl, a training log or a Prometheus URL"
                         + (f" (got {', '.join(named)})" if named else ""))
    if prometheus:
        merged = WatchConfig.from_table({"prometheus": {**config.prometheus, **(queries or {})}}).prometheus
        return poll_prometheus(prometheus, merged, poll_s=poll_s or config.poll_s, once=once, stop=stop,
                               timeout=timeout, token=os.environ.get(PROMETHEUS_TOKEN_ENV) or None, stats=stats,
                               idle=idle)
    follow = follow_metrics if metrics else follow_log
    return follow(metrics or log or "", from_start=from_start, once=once, stop=stop, timeout=timeout,
                  poll_s=poll_s or FILE_POLL_S, stats=stats, idle=idle)
