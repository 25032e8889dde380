"""Dump PyTorch's flight recorder when the job stops making progress.

The flight recorder (``TORCH_FR_BUFFER_SIZE=N``) keeps each rank's last N collectives; the
dump is what names the rank a hung job waits for. NCCL's watchdog writes it on a collective
timeout (``TORCH_NCCL_DUMP_ON_TIMEOUT=1``), but not every job has that watchdog: torch's gloo
backend (CPU) records collectives and never dumps them by itself (it raises in the caller when
its timeout passes, and the ring is lost with the process), and an NCCL job may time out much
later than it stopped. ``FlightRecorderDump`` watches the loop's own progress from a thread
and, when no step has completed for ``after_s`` seconds, writes the dump through torch's
on-demand API (``torch._C._distributed_c10d._dump_fr_trace``, or ``_dump_fr_trace_json``:
the same calls torch's debug server and the flight recorder tutorial use) to where the NCCL
watchdog would have: ``$TORCH_FR_DUMP_TEMP_FILE`` + the global rank (torch's default
``/tmp/nccl_trace_rank_``). The bytes are torch's own; the file appears whole (temp + rename),
so a collector never reads half a dump. It dumps once per stall, again only after progress
resumed and stopped again. Every rank runs one, so every rank leaves its dump, the stuck one
included (its ring ends before the collective the others wait in).

    recorder = FlightRecorderDump(rank=dist.get_rank(), after_s=120)   # a thread; no-op without torch
    for step in ...:
        train_step()
        recorder.progress(step)
    recorder.close()

Costs the loop one attribute write per step.
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

__all__ = ["FlightRecorderDump", "DEFAULT_PREFIX", "dump_now"]

DEFAULT_PREFIX = "/tmp/nccl_trace_rank_"


def _prefix() -> str:
    return os.environ.get("TORCH_FR_DUMP_TEMP_FILE") or os.environ.get("TORCH_NCCL_DEBUG_INFO_TEMP_FILE") \
        or DEFAULT_PREFIX


def dump_now(rank: int, *, prefix: str | None = None, as_json: bool = False) -> Path:
    """Write this process's flight recorder to ``prefix`` + ``rank`` now (torch's bytes:
    pickle, or JSON). RuntimeError when torch has no flight recorder API."""
    import torch

    c10d = getattr(torch._C, "_distributed_c10d", None)
    if c10d is None:
        raise RuntimeError("this torch has no distributed support: no flight recorder")
    if as_json:
        call = getattr(c10d, "_dump_fr_trace_json", None) or getattr(c10d, "_dump_nccl_trace_json", None)
        data = call(True, False) if call is not None else None  # includeCollectives, onlyActive
    else:
        call = getattr(c10d, "_dump_fr_trace", None) or getattr(c10d, "_dump_nccl_trace", None)
        data = call(True, True, False) if call is not None else None  # ... includeStackTraces
    if data is None:
        raise RuntimeError("this torch has no flight recorder dump API (_dump_fr_trace)")
    if isinstance(data, str):
        data = data.encode()
    target = Path(f"{prefix or _prefix()}{rank}")
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    tmp.write_bytes(bytes(data))
    os.replace(tmp, target)
    return target


class FlightRecorderDump:
    """A watch thread that dumps the flight recorder once the loop stops advancing."""

    def __init__(self, rank: int, *, after_s: float = 120.0, prefix: str | None = None, as_json: bool = False,
                 poll_s: float = 1.0, start: bool = True) -> None:
        self.rank, self.after_s, self.prefix, self.as_json, self.poll_s = rank, after_s, prefix, as_json, poll_s
        self._last = time.monotonic()
        self._step: int | None = None
        self._dumped_at: int | None | bool = False  # the step a dump was made after (False: none yet)
        self._stop = threading.Event()
        self.dumps: list[Path] = []
        self.error: str | None = None
        self._thread: threading.Thread | None = None
        if start:
            self.start()

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="spikeops-fr-dump", daemon=True)
        self._thread.start()

    def progress(self, step: int) -> None:
        """A step completed (cheap: called every step)."""
        self._step = step
        self._last = time.monotonic()

    def _run(self) -> None:
        while not self._stop.wait(self.poll_s):
            if time.monotonic() - self._last < self.after_s or self._dumped_at == self._step:
                continue
            self._dumped_at = self._step
            try:
                self.dumps.append(dump_now(self.rank, prefix=self.prefix, as_json=self.as_json))
            except Exception as exc:  # a dump that fails must not take the job down
                self.error = f"{type(exc).__name__}: {exc}"

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5)
