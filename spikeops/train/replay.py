"""The job's side of the replay gate: record a replay of the spike window, deterministically.

A silently corrupting GPU produces a spike that looks exactly like a bad batch. The replay
gate tells them apart by re-running the steps before the spike twice, from the same
checkpoint with the same data, on the original nodes and on others (``spikeops.replay``).
That only works if the job can say, per step and rank, what it computed, cheaply and
exactly: ``ReplayRecorder`` writes ``replay.jsonl`` (shared/spec/bundle.md) with a digest
of each rank's own gradients before the reduction and of the reduced ones after it, so a
single flipped bit on one rank shows as one changed digest at one step. ``deterministic()``
switches on what PyTorch offers to make two replays compute bit-identically (docs/replay.md
says what it cannot cover on GPUs).

    request = ResumeRequest.from_env()
    if request.replay:                          # SPIKEOPS_REPLAY=same-nodes ...
        deterministic(seed)
        recorder = ReplayRecorder(request.replay.directory(run_dir), rank=rank, node=node)
        ...                                     # load request.checkpoint, restore the RNG
        for step in range(ckpt_step + 1, request.replay.until + 1):
            local = compute_grads(batch)        # before all-reduce
            reduced = all_reduce(local)
            recorder.step(step, loss=loss, grad_norm=norm, local_grads=local, reduced_grads=reduced)
        # no checkpoint, no metrics of the real run

Importable without torch; torch is imported when a digest or ``deterministic`` needs it.
"""

from __future__ import annotations

import hashlib
import os
import random
import socket
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from spikeops.train.logger import _line, _number

__all__ = ["ReplayRecorder", "grad_digest", "deterministic", "REPLAY_FILE", "REPLAY_META", "NOT_COVERED"]

REPLAY_FILE = "replay.jsonl"
#: What the job says about the replay as a whole (steps, seconds, placement): an extension.
REPLAY_META = "replay.json"
#: What ``torch.use_deterministic_algorithms`` does not make deterministic (docs/replay.md).
NOT_COVERED = (
    "NCCL reductions: the order of a sum depends on the algorithm (ring/tree), the protocol and the topology",
    "kernels without a deterministic implementation raise (or warn with warn_only) instead of running",
    "cuBLAS needs CUBLAS_WORKSPACE_CONFIG before the first CUDA call in the process",
    "different GPU models, drivers, CUDA or library versions compute different bits",
    "TF32 and reduced-precision reductions are deterministic but differ from fp32 (same setting in both replays)",
    "data loader workers, asynchronous prefetch and anything outside torch (custom CUDA, Triton autotuning)",
)


def _tensor_bytes(tensor: Any) -> tuple[bytes, bytes]:
    """(header, raw bytes) of a tensor, copied to the CPU, in memory order."""
    import torch

    data = tensor.detach()
    if data.device.type != "cpu":
        data = data.cpu()
    data = data.contiguous().reshape(-1)
    header = f"{data.dtype}:{tuple(tensor.shape)};".encode()
    return header, data.view(torch.uint8).numpy().tobytes()


def grad_digest(grads: Any) -> str:
    """A BLAKE2b digest of gradients: one tensor, or a sequence of them (None entries are
    parameters without a gradient). Any flipped bit changes it; NaN payloads included."""
    if isinstance(grads, str):
        return grads
    tensors = [grads] if hasattr(grads, "detach") else list(grads)
    digest = hashlib.blake2b(digest_size=16)
    for tensor in tensors:
        if tensor is None:
            digest.update(b"none;")
            continue
        header, raw = _tensor_bytes(tensor)
        digest.update(header)
        digest.update(raw)
    return digest.hexdigest()


def _norm(grads: Any) -> float | None:
    if grads is None or isinstance(grads, str):
        return None
    import torch

    tensors = [grads] if hasattr(grads, "detach") else [g for g in grads if g is not None]
    if not tensors:
        return None
    return float(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g.detach().float())
                                                       for g in tensors])))


class ReplayRecorder:
    """Writes ``replay.jsonl`` into ``directory``: one record per step and rank, appended with
    one ``O_APPEND`` write per record, so all ranks may share the file and a replay killed
    mid-step leaves every earlier step whole. Use one per process (or pass ``rank=`` per call
    when one process plays several ranks).

    Clear an old file with ``ReplayRecorder.reset(directory)`` once, before any rank writes.
    """

    def __init__(self, directory: str | Path, rank: int = 0, node: str | None = None) -> None:
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.rank = int(rank)
        self.node = node or socket.gethostname()
        self.path = self.directory / REPLAY_FILE
        self._fd: int | None = None
        self.records = 0

    @classmethod
    def reset(cls, directory: str | Path) -> None:
        """Remove the replay files a previous attempt left (call from one process only)."""
        for name in (REPLAY_FILE, REPLAY_META):
            try:
                (Path(directory) / name).unlink()
            except FileNotFoundError:
                pass

    def step(self, step: int, *, loss: Any, local_grads: Any, reduced_grads: Any = None, grad_norm: Any = None,
             fingerprint: str | None = None, rank: int | None = None, node: str | None = None) -> dict[str, Any]:
        """Record one step of one rank. ``local_grads``: the rank's own gradients before the
        reduction (tensor(s), or a digest already computed); ``reduced_grads``: after it.
        ``grad_norm`` defaults to the norm of ``local_grads``."""
        norm = _number(grad_norm) if grad_norm is not None else _norm(local_grads)
        record = {"step": int(step), "rank": self.rank if rank is None else int(rank), "node": node or self.node,
                  "loss": _number(loss), "grad_norm": norm, "local_grad_digest": grad_digest(local_grads),
                  "reduced_grad_digest": None if reduced_grads is None else grad_digest(reduced_grads),
                  "fingerprint": fingerprint}
        data = (_line(record) + "\n").encode()
        if self._fd is None:
            self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        written = 0
        while written < len(data):
            written += os.write(self._fd, data[written:])
        self.records += 1
        return record

    def write_meta(self, meta: Mapping[str, Any]) -> Path:
        """``replay.json``: what the replay as a whole was (one process writes it)."""
        from spikeops.bundle import atomic_write
        import json

        target = self.directory / REPLAY_META
        atomic_write(target, (json.dumps(dict(meta), indent=1, default=str, allow_nan=True) + "\n").encode())
        return target

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def __enter__(self) -> ReplayRecorder:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def deterministic(seed: int | None = None, *, warn_only: bool = False, fix_nccl: bool = True) -> dict[str, Any]:
    """Everything PyTorch offers to make two runs of the same steps compute the same bits:
    deterministic algorithms (an op without one raises, or warns with ``warn_only``), cuDNN
    deterministic and not benchmarking, ``CUBLAS_WORKSPACE_CONFIG``, NCCL's algorithm and
    protocol pinned (``NCCL_ALGO=Ring``, ``NCCL_PROTO=Simple``, unless already set), and the
    seeds when ``seed`` is given. Returns what it set and what it cannot cover
    (``NOT_COVERED``). Call it before the first CUDA or NCCL call of the process."""
    applied: dict[str, Any] = {}
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    applied["CUBLAS_WORKSPACE_CONFIG"] = os.environ["CUBLAS_WORKSPACE_CONFIG"]
    if fix_nccl:
        for name, value in (("NCCL_ALGO", "Ring"), ("NCCL_PROTO", "Simple")):
            os.environ.setdefault(name, value)
            applied[name] = os.environ[name]
    import torch

    torch.use_deterministic_algorithms(True, warn_only=warn_only)
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False
    applied["use_deterministic_algorithms"] = True
    applied["cuda_initialized_before"] = bool(torch.cuda.is_available() and torch.cuda.is_initialized())
    if seed is not None:
        random.seed(seed)
        numpy = sys.modules.get("numpy")
        if numpy is not None:
            numpy.random.seed(seed % (2**32))
        torch.manual_seed(seed)  # every CUDA device too
        applied["seed"] = seed
    applied["not_covered"] = list(NOT_COVERED)
    return applied
