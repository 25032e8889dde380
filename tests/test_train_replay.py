"""spikeops.train's replay side without the example: digests, the recorder's file, deterministic()."""

from __future__ import annotations

import json
import math
import multiprocessing
import os
import subprocess
import sys
from pathlib import Path

import pytest

from spikeops.replay import read_replay
from spikeops.train import ReplayRecorder, grad_digest

torch = pytest.importorskip("torch")


def _flip(tensor: torch.Tensor, index: int, bit: int) -> torch.Tensor:
    out = tensor.clone()
    flat = out.view(-1).view(torch.int32)
    flat[index] ^= 1 << bit
    return out


def test_one_flipped_bit_changes_the_digest() -> None:
    grads = [torch.randn(64, 32), torch.randn(32)]
    base = grad_digest(grads)
    assert grad_digest([g.clone() for g in grads]) == base  # the values, not the objects
    for bit in (0, 17, 30):  # the lowest mantissa bit too
        assert grad_digest([_flip(grads[0], 1000, bit), grads[1]]) != base
    assert grad_digest([grads[0].reshape(32, 64), grads[1]]) != base  # the shape counts
    assert grad_digest([grads[0], None]) != base and grad_digest(base) == base
    flat = torch.cat([g.reshape(-1) for g in grads])
    assert grad_digest(flat) == grad_digest(flat.clone()) != grad_digest(_flip(flat, 5, 3))
    assert grad_digest(torch.tensor([math.nan])) == grad_digest(torch.tensor([math.nan]))
    noncontiguous = torch.randn(4, 4)
    assert grad_digest(noncontiguous.t()) == grad_digest(noncontiguous.t().contiguous())


def test_recorder_writes_what_the_reader_reads(tmp_path: Path) -> None:
    local, reduced = [torch.ones(3)], [torch.full((3,), 0.5)]
    with ReplayRecorder(tmp_path / "replay" / "same-nodes", rank=2, node="gpu-7") as recorder:
        first = recorder.step(11, loss=torch.tensor(2.5), local_grads=local, reduced_grads=reduced, fingerprint="f1")
        recorder.step(12, loss=float("nan"), grad_norm=float("inf"), local_grads=local, reduced_grads=reduced)
        recorder.step(12, loss=1.0, local_grads=local, rank=3, node="gpu-8")
    assert first["grad_norm"] == pytest.approx(math.sqrt(3)) and first["loss"] == 2.5
    run = read_replay(tmp_path / "replay" / "same-nodes")
    assert not run.gaps and run.problem is None and set(run.records) == {(11, 2), (12, 2), (12, 3)}
    record = run.records[(11, 2)]
    assert (record.node, record.fingerprint, record.local_grad_digest) == ("gpu-7", "f1", grad_digest(local))
    assert record.reduced_grad_digest == grad_digest(reduced) != record.local_grad_digest
    assert math.isnan(run.records[(12, 2)].loss) and run.records[(12, 2)].grad_norm == math.inf
    assert run.records[(12, 3)].node == "gpu-8" and run.records[(12, 3)].reduced_grad_digest is None
    text = (tmp_path / "replay" / "same-nodes" / "replay.jsonl").read_text()
    assert "NaN" in text and "Infinity" in text  # bare tokens, as the metrics files write them
    recorder.write_meta({"run": "same-nodes", "seconds": 1.5})
    ReplayRecorder.reset(tmp_path / "replay" / "same-nodes")
    assert list((tmp_path / "replay" / "same-nodes").iterdir()) == []


def _append(directory: str, rank: int) -> None:
    recorder = ReplayRecorder(directory, rank=rank, node=f"n{rank}")
    for step in range(200):
        recorder.step(step, loss=1.0, local_grads="d" * 32, reduced_grads="r" * 32, grad_norm=0.5)
    recorder.close()


def test_ranks_share_the_file_without_torn_lines(tmp_path: Path) -> None:
    context = multiprocessing.get_context("fork")
    workers = [context.Process(target=_append, args=(str(tmp_path), rank)) for rank in range(4)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join(60)
    run = read_replay(tmp_path)
    assert not run.gaps and len(run.records) == 800 and run.placement() == {r: f"n{r}" for r in range(4)}


def test_deterministic_sets_what_it_says() -> None:
    """In a fresh interpreter (the settings are process-wide): the flags, the variables, the seed."""
    code = ("import json, os, torch\n"
            "from spikeops.train import deterministic\n"
            "applied = deterministic(7)\n"
            "first = torch.rand(3).tolist()\n"
            "deterministic(7)\n"
            "print(json.dumps({'applied': applied, 'flag': torch.are_deterministic_algorithms_enabled(),\n"
            "  'cudnn': torch.backends.cudnn.deterministic, 'bench': torch.backends.cudnn.benchmark,\n"
            "  'env': os.environ.get('CUBLAS_WORKSPACE_CONFIG'), 'nccl': os.environ.get('NCCL_ALGO'),\n"
            "  'proto': os.environ.get('NCCL_PROTO'), 'same_draw': torch.rand(3).tolist() == first}))\n")
    env = {k: v for k, v in os.environ.items() if k not in ("NCCL_ALGO", "NCCL_PROTO", "CUBLAS_WORKSPACE_CONFIG")}
    env["NCCL_PROTO"] = "LL128"  # a setting the job made itself is kept
    result = json.loads(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                                       timeout=300, env=env).stdout)
    assert result["flag"] is True and result["cudnn"] is True and result["bench"] is False
    assert result["env"] == ":4096:8" and result["nccl"] == "Ring" and result["proto"] == "LL128"
    assert result["applied"]["seed"] == 7 and result["same_draw"] is True
    assert any("NCCL" in line for line in result["applied"]["not_covered"])
