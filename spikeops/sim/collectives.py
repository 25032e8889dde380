"""What a hung job leaves on its nodes: flight recorder dumps and py-spy stacks, as bytes.

The document is the one torch writes (``spikeops.probes.flight_recorder`` describes it, the
tests read real ones from a gloo job): ``version``, ``pg_config``, ``pg_status`` and the
newest ``entries`` of each rank's ring, NCCL-style (``nccl:all_reduce``, states
``completed``/``started``/``scheduled``, ``retired``), as a protocol-2 pickle of plain dicts
and tuples (torch's default) or as JSON (``_dump_fr_trace_json``: ``pg_status`` values as
strings, no ``frames``). File names are torch's default prefix plus the global rank.
Stacks are ``py-spy dump`` text: the rank the others wait for sits in its data loader (or a
checkpoint write); the waiting ranks sit in ``all_reduce``.
"""

from __future__ import annotations

import json
import pickle
import random
from dataclasses import dataclass

__all__ = ["RankScript", "dump_bytes", "stack_text", "DUMP_PREFIX", "STUCK_FRAMES", "WAITING_FRAMES"]

#: torch's default ``TORCH_FR_DUMP_TEMP_FILE`` base name.
DUMP_PREFIX = "nccl_trace_rank_"
#: Where a rank that never reaches the collective is (innermost first).
STUCK_FRAMES = (
    (("_recv_batch", "megatron/data/loader.py", 412), ("__next__", "megatron/data/loader.py", 388),
     ("get_batch", "pretrain_gpt.py", 146), ("train_step", "megatron/training.py", 742),
     ("train", "megatron/training.py", 1104), ("<module>", "pretrain_gpt.py", 318)),
    (("_write", "torch/distributed/checkpoint/filesystem.py", 361),
     ("save_state_dict", "torch/distributed/checkpoint/state_dict_saver.py", 144),
     ("save_checkpoint", "megatron/checkpointing.py", 401), ("train", "megatron/training.py", 1151),
     ("<module>", "pretrain_gpt.py", 318)),
)
WAITING_FRAMES = (
    ("all_reduce", "torch/distributed/distributed_c10d.py", 2501), ("wrapper", "torch/distributed/c10d_logger.py", 79),
    ("allreduce_gradients", "megatron/core/distributed/distributed_data_parallel.py", 283),
    ("train_step", "megatron/training.py", 760), ("train", "megatron/training.py", 1104),
    ("<module>", "pretrain_gpt.py", 318),
)


@dataclass
class RankScript:
    """What one rank issued: collectives ``first..last`` of the default group, each
    ``(op, numel)``; ``pending`` says the last one has not finished."""

    rank: int
    first: int
    last: int
    ops: dict[int, tuple[str, int]]
    pending: bool
    started_ns: int
    step_ns: int


def _entry(script: RankScript, seq: int, record: int, world: int, timeout_ms: int, with_frames: bool) -> dict:
    op, numel = script.ops[seq]
    created = script.started_ns + (seq - script.first) * script.step_ns
    last = seq == script.last and script.pending
    entry = {
        "record_id": record, "pg_id": 0, "process_group": ("0", "default_pg"), "collective_seq_id": seq,
        "p2p_seq_id": 0, "op_id": seq, "profiling_name": f"nccl:{op}", "time_created_ns": created,
        "input_sizes": [[numel]], "input_dtypes": ["BFloat16"], "output_sizes": [[numel]],
        "output_dtypes": ["BFloat16"], "state": "started" if last else "completed",
        "time_discovered_started_ns": created + 40_000, "time_discovered_completed_ns": None if last else created + 9_000_000,
        "retired": not last, "timeout_ms": timeout_ms, "is_p2p": False,
    }
    if with_frames:
        entry["frames"] = [{"name": name, "filename": file, "line": line} for name, file, line in WAITING_FRAMES[:4]]
    return entry


def dump_bytes(script: RankScript, world: int, *, form: str, timeout_ms: int = 600_000) -> bytes:
    """One rank's dump in torch's layout, ``form`` "pickle" or "json"."""
    entries = [_entry(script, seq, i, world, timeout_ms, form == "pickle")
               for i, seq in enumerate(range(script.first, script.last + 1))]
    completed = script.last - 1 if script.pending else script.last
    status = {"last_enqueued_collective": script.last, "last_started_collective": script.last if script.pending else -1,
              "last_completed_collective": completed}
    document = {
        "version": "2.7",
        "pg_config": {"0": {"name": "0", "desc": "default_pg", "ranks": str(list(range(world)))}},
        "pg_status": {"0": status},
        "entries": entries,
    }
    if form == "pickle":
        return pickle.dumps(document, protocol=2)
    document["pg_status"] = {"0": {k: str(v) for k, v in status.items()}}
    document["entries"] = [{**e, "process_group": list(e["process_group"])} for e in entries]
    return json.dumps(document).encode()


def stack_text(pid: int, command: str, frames: tuple[tuple[str, str, int], ...], rng: random.Random) -> str:
    """``py-spy dump --pid PID`` of a training process: its main thread, and the autograd
    and data-loader helper threads a real one has."""
    lines = [f"Process {pid}: {command}", "Python v3.10.12 (/usr/bin/python3.10)", "",
             f'Thread {pid} (idle): "MainThread"']
    lines.extend(f"    {name} ({file}:{line})" for name, file, line in frames)
    helper = pid + rng.randrange(40, 400)
    lines.append(f'Thread {helper} (idle): "pt_autograd_0"')
    lines.append(f'Thread {helper + 1} (idle): "Thread-2 (_pin_memory_loop)"')
    lines.extend(["    _pin_memory_loop (torch/utils/data/_utils/pin_memory.py:53)",
                  "    run (threading.py:953)", "    _bootstrap_inner (threading.py:1016)",
                  "    _bootstrap (threading.py:973)"])
    return "\n".join(lines) + "\n"
