#!/usr/bin/env python3
"""A tiny real PyTorch training loop instrumented with every piece of spikeops.train.

A small causal LM (an embedding of the current and previous token, a 2-layer MLP, the next
token's logits; vocab 256) trains on CPU on synthetic token sequences from a seeded generator
(a noisy Markov chain; lengths 8..48; ids like ``shard-0003:1881``). A fake world of 4 ranks
each takes a micro-batch of 8 samples per step; their gradients are averaged as DDP would.

- ``filter_samples`` truncates every sample to ``--max-length`` (32) and drops empty ones and
  duplicates; ``MetricsLogger`` writes metrics.jsonl (``step``), ranks.jsonl (``rank_row``,
  per rank: its own loss and gradient norm) and batches.jsonl (``batch``, token counts BEFORE
  truncation);
- ``GradGuard.clip`` clips at 1.0 and raises the z-score alarm; ``NanGuard`` records a NaN loss;
- every ``--ckpt-every`` steps: ``torch.save`` of model and optimizer into OUT/ckpt/step-N/,
  then ``on_checkpoint_saved`` (RNG and sampler state, MANIFEST.json in the background);
- ``--resume-from CKPT_DIR``: weights and optimizer loaded, ``restore_state`` (skipped with
  ``--no-restore-rng``), ``FingerprintCheck`` against the batches.jsonl of the run that wrote
  the checkpoint (copied to OUT/reference/batches.jsonl), ``AnomalyLocator`` for the first
  steps after the resume;
- ``--inject-overlong STEP``: at that step rank ``--inject-rank`` gets a sample 50x
  max_length long that bypasses the filter (a broken filter). The loss is a SUM over tokens
  divided by a fixed token budget (micro-batch x max_length), as some codebases do, so the
  sample makes the loss and the gradient norm spike for real.

At the end OUT is an incident bundle (incident.json, checkpoints.json beside the logs):
``spikeops diagnose OUT``.

Multi-process (``--launch``/``--nodes``, ``--distributed``): one process per (simulated)
node, ``torch.distributed`` with the gloo backend on CPU, world size = number of nodes, each
rank a micro-batch of 8; the local gradients are averaged with an all-reduce. ``--nodes
a,b,c`` starts the processes itself (like torchrun; the local scheduler's
``$SPIKEOPS_JOB_NODES`` when ``--launch`` is given alone); ``--distributed`` is one rank of a
job started by someone else: ``RANK``/``WORLD_SIZE``/``MASTER_ADDR``/``MASTER_PORT``
(torchrun), or ``srun`` one task per node (``SLURM_PROCID``, ``SLURM_NTASKS``,
``SLURMD_NODENAME``; the port from ``SLURM_JOB_ID``). ``$SPIKEOPS_RANK_NODES`` (``a:b:c``)
places rank i on the i-th node: under srun a rank is the index of its node there.

- ``--inject-flip NODE_OR_RANK --flip-from STEP [--flip-once]``: a silently corrupting
  GPU. From STEP on (or at STEP only), one element of the first matmul's output on that
  node (or rank) gets a high exponent bit flipped (``--flip-bit``, 30: x becomes x*2^128),
  so the loss goes to NaN or explodes. Keyed by the node the process runs on: a replay
  elsewhere computes right, a replay on that node is corrupted again (persistently); a
  ``--flip-once`` upset never recurs in a replay.
- ``--inject-hang NODE_OR_RANK --hang-at STEP``: that rank's data loader never returns at
  STEP, so it never enters the step's gradient all-reduce and every other rank waits in it
  (a hang: no NaN, no spike, the step counter stops). ``--inject-mismatch NODE_OR_RANK
  --mismatch-at STEP``: that rank broadcasts its gradients where the others all-reduce them
  (a collective mismatch). With ``TORCH_FR_BUFFER_SIZE`` set, each rank dumps torch's flight
  recorder to ``$TORCH_FR_DUMP_TEMP_FILE<rank>`` once no step has completed for
  ``--fr-dump-after`` seconds (``spikeops.train.FlightRecorderDump``: gloo has no watchdog
  that dumps; ``--fr-json`` for torch's JSON form). ``--collective-timeout`` is gloo's (a hung
  collective raises after it). ``--spawn`` starts each rank as its own program (as srun
  does) instead of forking it, so its environment (``SPIKEOPS_NODE``, ``RANK``) is what
  ``/proc/PID/environ`` shows: how the collector finds a node's processes.
- The replay gate (``SPIKEOPS_REPLAY=RUN``, ``SPIKEOPS_REPLAY_UNTIL=STEP``,
  ``SPIKEOPS_REPLAY_OUT=DIR``, checkpoint in ``SPIKEOPS_RESUME_FROM``): restores the
  checkpoint, the RNG and so the data order, runs deterministically through STEP and writes
  DIR/replay.jsonl (``ReplayRecorder``: per step and rank the loss, grad norm, a digest of the
  local and of the all-reduced gradients, the batch fingerprint) and DIR/replay.json; no
  checkpoint, metrics or bundle file of the real run is written.

    python examples/train_tiny.py --out /tmp/run [--steps 80] [--inject-overlong 60]
        [--resume-from /tmp/run/ckpt/step-40] [--no-restore-rng] [--seed 0]
    python examples/train_tiny.py --out /tmp/run --nodes n1,n2,n3,n4 --steps 30 --ckpt-every 10 \
        --inject-flip n3 --flip-from 25
    SPIKEOPS_REPLAY=other-nodes SPIKEOPS_REPLAY_UNTIL=25 SPIKEOPS_REPLAY_OUT=/tmp/run/replay/other-nodes \
    SPIKEOPS_RESUME_FROM=/tmp/run/ckpt/step-20 SPIKEOPS_RANK_NODES=n2:n3:n4:n1 \
        python examples/train_tiny.py --out /tmp/run --nodes n1,n2,n3,n4 --steps 30 --ckpt-every 10 \
        --inject-flip n3 --flip-from 25
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import random
import shutil
import socket
import subprocess
import sys
import time
import warnings
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent
if str(ROOT.parent) not in sys.path:
    sys.path.insert(0, str(ROOT.parent))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch import nn  # noqa: E402

from spikeops.checkpoints import find_checkpoints, verify  # noqa: E402
from spikeops.train import (  # noqa: E402
    AnomalyLocator,
    DataOrderWarning,
    FilterStats,
    FingerprintCheck,
    GradGuard,
    MetricsLogger,
    NanGuard,
    ResumeRequest,
    batch_record,
    filter_samples,
    load_state,
    on_checkpoint_saved,
    restore_state,
)
from spikeops.train.flight_recorder import FlightRecorderDump  # noqa: E402
from spikeops.train.replay import ReplayRecorder, deterministic  # noqa: E402
from spikeops.train.remedies import ENV_RANK_NODES  # noqa: E402

VOCAB = 256
WORLD = 4
MICRO_BATCH = 8
MAX_LENGTH = 32
DATASET_SIZE = 4096
SHARDS = 8
OVERLONG_FACTOR = 50
LR = 3e-3
WARMUP = 5


# ---------------------------------------------------------------------------- data
def make_dataset(seed: int) -> list[dict[str, Any]]:
    """Token sequences of a noisy Markov chain (learnable), lengths 8..48, from a local
    generator: the same seed gives the same data whatever the global RNG does."""
    rng = random.Random(seed)
    samples = []
    for index in range(DATASET_SIZE):
        shard = index % SHARDS
        length = rng.randint(8, 48)
        token = rng.randrange(VOCAB)
        tokens = [token]
        for _ in range(length - 1):
            token = (token * 5 + 17) % VOCAB if rng.random() < 0.8 else rng.randrange(VOCAB)
            tokens.append(token)
        samples.append({"id": f"shard-{shard:04d}:{index}", "shard": f"synthetic://corpus/shard-{shard:04d}",
                        "tokens": tokens})
    return samples


def overlong_sample(seed: int, step: int, rank: int, length: int) -> dict[str, Any]:
    rng = random.Random(f"{seed}-overlong-{step}-{rank}")
    return {"id": f"shard-9999:overlong-{step}", "shard": "synthetic://corpus/shard-9999",
            "tokens": [rng.randrange(VOCAB) for _ in range(length)]}


def draw_indices(world: int = WORLD) -> list[list[int]]:
    """The sampler: each rank's micro-batch drawn from the global torch RNG (so it is the
    RNG state saved with a checkpoint that decides the data order after a resume). Every
    process of a distributed run draws the whole global batch and keeps its rank's slice."""
    flat = torch.randint(0, DATASET_SIZE, (world * MICRO_BATCH,)).tolist()
    return [flat[r * MICRO_BATCH:(r + 1) * MICRO_BATCH] for r in range(world)]


def collate(samples: list[dict[str, Any]]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    width = max(len(s["tokens"]) for s in samples)
    current = torch.zeros((len(samples), width), dtype=torch.long)
    previous = torch.zeros((len(samples), width), dtype=torch.long)
    targets = torch.full((len(samples), width), -100, dtype=torch.long)
    for i, sample in enumerate(samples):
        seq = torch.tensor(sample["tokens"], dtype=torch.long)
        n = len(seq) - 1
        current[i, :n] = seq[:-1]
        previous[i, 1:n] = seq[:-2] if n > 1 else previous[i, 1:n]
        targets[i, :n] = seq[1:]
    return current, previous, targets


# ---------------------------------------------------------------------------- model
class TinyLM(nn.Module):
    def __init__(self, dim: int = 64, hidden: int = 128) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, dim)
        self.embed_prev = nn.Embedding(VOCAB, dim)
        self.mlp = nn.Sequential(nn.Linear(dim, hidden), nn.GELU(), nn.Linear(hidden, hidden), nn.GELU(),
                                 nn.Linear(hidden, VOCAB))

    def forward(self, current: torch.Tensor, previous: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.embed(current) + self.embed_prev(previous))


def lr_at(step: int, total: int) -> float:
    if step <= WARMUP:
        return LR * step / WARMUP
    return LR * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, (step - WARMUP) / max(1, total - WARMUP)))))


def iso(moment: datetime) -> str:
    return moment.astimezone(UTC).isoformat(timespec="seconds").replace("+00:00", "Z")


# ---------------------------------------------------------------------------- fault injection
def flip_bit(output: torch.Tensor, bit: int) -> torch.Tensor:
    """``output`` with ``bit`` flipped in one element of every sample (the first element in
    (0, 1) whose bit is clear: for the exponent's high bit, 30, x becomes x*2^128), as a
    failing ALU lane would do to every row it computes. One element alone can land where it
    changes nothing (a padded token, or the target's own logit); one per sample cannot.
    The wrong values flow on through the graph as the right ones would have."""
    rows = output.detach().reshape(output.shape[0], -1)
    mask = 1 << bit
    bits = rows.view(torch.int32)
    candidates = ((bits & mask) == 0) & (rows > 0) & (rows < 1)
    delta = torch.zeros_like(rows)
    for row in torch.nonzero(candidates.any(dim=1)).flatten().tolist():
        index = int(candidates[row].to(torch.int8).argmax())
        flipped = (bits[row, index:index + 1] ^ mask).view(torch.float32)[0]
        delta[row, index] = flipped - rows[row, index]
    return output + delta.view_as(output)


class BitFlip:
    """A GPU that computes wrong numbers: flips ``bit`` in the first matmul's output of the
    ranks running on ``target`` (a node name, or a rank number), from ``from_step`` on, or at
    ``from_step`` only (``once``: an upset that a replay never meets again).

    (Plain classes in this file: the tests load it without registering it as a module,
    where dataclasses cannot resolve their annotations.)"""

    def __init__(self, target: str | None, from_step: int | None, once: bool = False, bit: int = 30,
                 replaying: bool = False) -> None:
        self.target, self.from_step, self.once, self.bit, self.replaying = target, from_step, once, bit, replaying
        self.flips: list[tuple[int, int, str]] = []
        self._armed: tuple[int, int, str] | None = None

    def arm(self, step: int, rank: int, node: str) -> None:
        hit = self.target is not None and self.from_step is not None and (
            self.target == node or (self.target.isdigit() and int(self.target) == rank))
        if hit and self.once:
            hit = step == self.from_step and not self.replaying
        elif hit:
            hit = step >= (self.from_step or 0)
        self._armed = (step, rank, node) if hit else None

    def disarm(self) -> None:
        self._armed = None

    def hook(self, _module: nn.Module, _inputs: Any, output: torch.Tensor) -> torch.Tensor | None:
        if self._armed is None:
            return None
        self.flips.append(self._armed)
        return flip_bit(output, self.bit)


class Fault:
    """A rank that hangs in its data loader at a step, or issues another collective there.
    Keyed like ``BitFlip``: a node name, or a rank number."""

    def __init__(self, target: str | None, at: int | None) -> None:
        self.target, self.at = target, at

    def due(self, step: int, rank: int, node: str) -> bool:
        return self.target is not None and self.at == step and (
            self.target == node or (self.target.isdigit() and int(self.target) == rank))


def wait_for_shard(shard: str) -> None:
    """The data loader of a rank whose storage stopped answering: it never returns (the
    process stays alive, as a hung job's do, until it is stopped)."""
    while True:
        time.sleep(1.0)


# ---------------------------------------------------------------------------- the world
class World:
    """The ranks this process computes and how their gradients meet: the 4 fake ranks of one
    process averaged in place, or one rank of a gloo job averaged with an all-reduce."""

    def __init__(self, size: int, ranks: list[int], nodes: dict[int, str], distributed: bool = False) -> None:
        self.size, self.ranks, self.nodes, self.distributed = size, ranks, nodes, distributed

    @property
    def lead(self) -> bool:
        """The process that writes the job-wide files (rank 0's)."""
        return 0 in self.ranks

    def reduce(self, local: dict[int, list[torch.Tensor]], odd: bool = False) -> list[torch.Tensor]:
        """``odd``: this rank broadcasts where its peers all-reduce (a collective mismatch)."""
        if not self.distributed:
            grads = [torch.zeros_like(g) for g in local[self.ranks[0]]]
            for rank in self.ranks:
                for acc, g in zip(grads, local[rank], strict=True):
                    acc.add_(g, alpha=1.0 / self.size)
            return grads
        mine = local[self.ranks[0]]
        flat = torch.cat([g.reshape(-1) for g in mine])
        if odd:
            dist.broadcast(flat, src=0)
        else:
            dist.all_reduce(flat, op=dist.ReduceOp.SUM)
        flat.div_(self.size)
        out, offset = [], 0
        for g in mine:
            out.append(flat[offset:offset + g.numel()].view_as(g))
            offset += g.numel()
        return out

    def mean_loss(self, losses: dict[int, float]) -> float:
        if not self.distributed:
            return sum(losses[r] for r in self.ranks) / self.size
        total = torch.tensor([sum(losses.values())], dtype=torch.float64)
        dist.all_reduce(total, op=dist.ReduceOp.SUM)
        return float(total) / self.size

    def gather(self, value: Any) -> list[Any]:
        if not self.distributed:
            return [value]
        out: list[Any] = [None] * self.size
        dist.all_gather_object(out, value)
        return out

    def barrier(self) -> None:
        if self.distributed:
            dist.barrier()


def _expand(nodes: str) -> list[str]:
    from spikeops.inventory import expand_nodes

    return expand_nodes(nodes) if nodes else []


def _node_name() -> str:
    return os.environ.get("SPIKEOPS_NODE") or os.environ.get("SLURMD_NODENAME") or socket.gethostname()


def join_world() -> World:
    """This process's rank in a torch.distributed job: RANK/WORLD_SIZE (torchrun, --launch),
    else its node's index in $SPIKEOPS_RANK_NODES, else srun's SLURM_PROCID/SLURM_NTASKS."""
    env = os.environ
    node = _node_name()
    placement = [n for n in env.get(ENV_RANK_NODES, "").split(":") if n]
    if env.get("RANK") and env.get("WORLD_SIZE"):
        rank, size = int(env["RANK"]), int(env["WORLD_SIZE"])
    elif placement and placement.count(node) == 1:
        rank, size = placement.index(node), len(placement)
    elif env.get("SLURM_PROCID") and env.get("SLURM_NTASKS"):
        rank, size = int(env["SLURM_PROCID"]), int(env["SLURM_NTASKS"])
    else:
        raise SystemExit("--distributed: no rank (set RANK and WORLD_SIZE, run under srun, or name this node "
                         f"({node}) once in {ENV_RANK_NODES})")
    if placement and len(placement) != size:
        raise SystemExit(f"{ENV_RANK_NODES} names {len(placement)} nodes for a world of {size}")
    if "MASTER_ADDR" not in env:
        os.environ["MASTER_ADDR"] = env.get("SLURM_LAUNCH_NODE_IPADDR", "127.0.0.1")
    if "MASTER_PORT" not in env:
        if not env.get("SLURM_JOB_ID", "").isdigit():
            raise SystemExit("--distributed: set MASTER_PORT (or run under Slurm, which gives a job id to derive it from)")
        os.environ["MASTER_PORT"] = str(10000 + int(env["SLURM_JOB_ID"]) % 20000)
    torch.set_num_threads(1)  # one process per node here: no oversubscription, and a fixed reduction order
    timeout = float(env.get("SPIKEOPS_COLLECTIVE_TIMEOUT") or 120)
    dist.init_process_group("gloo", rank=rank, world_size=size, timeout=timedelta(seconds=timeout))
    nodes = dict(enumerate(_gather_nodes(node, size)))
    return World(size, [rank], nodes, distributed=True)


def _gather_nodes(node: str, size: int) -> list[str]:
    out: list[Any] = [None] * size
    dist.all_gather_object(out, node)
    return [str(n) for n in out]


# ---------------------------------------------------------------------------- the launcher
def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def _worker_argv(argv: list[str]) -> list[str]:
    out, skip = [], False
    for item in argv:
        if skip:
            skip = False
            continue
        if item in ("--launch", "--spawn"):
            continue
        if item == "--nodes":
            skip = True
            continue
        if item.startswith("--nodes="):
            continue
        out.append(item)
    return [*out, "--distributed"]


class _Spawned:
    """A rank started as its own program, with the few methods ``launch`` uses of a Process."""

    def __init__(self, popen: Any) -> None:
        self.popen = popen

    @property
    def exitcode(self) -> int | None:
        return self.popen.poll()

    def is_alive(self) -> bool:
        return self.popen.poll() is None

    def terminate(self) -> None:
        self.popen.terminate()

    def join(self) -> None:
        self.popen.wait()


def _worker(argv: list[str], env: dict[str, str]) -> None:
    os.environ.update(env)
    result = main(argv)
    if result.get("lead"):
        _print_result(result)


def launch(argv: list[str], nodes_arg: str | None, spawn: bool = False) -> int:
    """Start one process per node (rank i on the i-th node) and wait for all of them; the
    first failure stops the others. Nodes: $SPIKEOPS_RANK_NODES (a replay's placement), else
    --nodes, else the local scheduler's $SPIKEOPS_JOB_NODES. The processes are forked from
    this one, which has imported torch already: four fresh interpreters importing torch at
    once cost more than the whole tiny run."""
    import multiprocessing

    placement = [n for n in os.environ.get(ENV_RANK_NODES, "").split(":") if n]
    nodes = placement or _expand(nodes_arg or "") or _expand(os.environ.get("SPIKEOPS_JOB_NODES", ""))
    if not nodes:
        raise SystemExit("--launch: no nodes (give --nodes, or run under a scheduler that sets SPIKEOPS_JOB_NODES)")
    port = _free_port()
    context = multiprocessing.get_context("fork")
    processes: list[Any] = []
    for rank, node in enumerate(nodes):
        env = {"RANK": str(rank), "WORLD_SIZE": str(len(nodes)), "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
               "MASTER_PORT": str(port), "SPIKEOPS_NODE": node}
        if spawn:
            processes.append(_Spawned(subprocess.Popen([sys.executable, str(Path(__file__).resolve()),
                                                        *_worker_argv(argv)], env={**os.environ, **env})))
            continue
        process = context.Process(target=_worker, args=(_worker_argv(argv), env), name=f"rank{rank}@{node}")
        process.start()
        processes.append(process)
    failed: int | None = None
    while any(p.is_alive() for p in processes):
        codes = [p.exitcode for p in processes if p.exitcode not in (None, 0)]
        if codes and failed is None:
            failed = codes[0]
            time.sleep(5)  # the others' own error first, then stop whoever waits for the dead rank
            for p in processes:
                if p.is_alive():
                    p.terminate()
        time.sleep(0.05)
    for p in processes:
        p.join()
    return failed if failed is not None else next((p.exitcode for p in processes if p.exitcode), 0)


# ---------------------------------------------------------------------------- run
def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--steps", type=int, default=80, help="last step to train (default 80)")
    parser.add_argument("--inject-overlong", type=int, default=None, metavar="STEP")
    parser.add_argument("--inject-rank", type=int, default=2)
    parser.add_argument("--resume-from", type=Path, default=None, metavar="CKPT_DIR")
    parser.add_argument("--no-restore-rng", action="store_true")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--ckpt-every", type=int, default=20)
    parser.add_argument("--max-length", type=int, default=MAX_LENGTH)
    parser.add_argument("--locate-steps", type=int, default=5, help="steps under detect_anomaly after a resume")
    group = parser.add_argument_group("multi-process (one process per node, gloo on CPU)")
    group.add_argument("--launch", action="store_true",
                       help="start one process per node and wait: nodes from $SPIKEOPS_RANK_NODES, --nodes, or "
                            "$SPIKEOPS_JOB_NODES (the local scheduler)")
    group.add_argument("--nodes", default=None, metavar="NODES", help="node names, rank order (a,b or n[1-4]); implies --launch")
    group.add_argument("--distributed", action="store_true",
                       help="be one rank of a torch.distributed job (RANK/WORLD_SIZE, srun, or $SPIKEOPS_RANK_NODES)")
    group.add_argument("--spawn", action="store_true",
                       help="with --launch/--nodes: start each rank as its own program (as srun does) instead of a fork")
    group.add_argument("--collective-timeout", type=float, default=None, metavar="S",
                       help="gloo's collective timeout (default 120 s; $SPIKEOPS_COLLECTIVE_TIMEOUT)")
    group.add_argument("--fr-dump-after", type=float, default=60.0, metavar="S",
                       help="with TORCH_FR_BUFFER_SIZE: dump the flight recorder after S seconds without a step")
    group.add_argument("--fr-json", action="store_true", help="dump the flight recorder as JSON (default: pickle)")
    group = parser.add_argument_group("fault injection (a hung or misaligned collective)")
    group.add_argument("--inject-hang", default=None, metavar="NODE_OR_RANK",
                       help="this rank's data loader never returns at --hang-at: the others wait in the all-reduce")
    group.add_argument("--hang-at", type=int, default=None, metavar="STEP")
    group.add_argument("--inject-mismatch", default=None, metavar="NODE_OR_RANK",
                       help="this rank broadcasts its gradients at --mismatch-at where the others all-reduce them")
    group.add_argument("--mismatch-at", type=int, default=None, metavar="STEP")
    group = parser.add_argument_group("fault injection (a silently corrupting GPU)")
    group.add_argument("--inject-flip", default=None, metavar="NODE_OR_RANK",
                       help="flip a bit in the first matmul's output on this node (or rank number)")
    group.add_argument("--flip-from", type=int, default=None, metavar="STEP", help="from this step on (persistent)")
    group.add_argument("--flip-once", action="store_true", help="at --flip-from only, never in a replay (transient)")
    group.add_argument("--flip-bit", type=int, default=30, choices=range(31), metavar="0-30",
                       help="which bit of the float32 (default 30, the exponent's high bit)")
    args = parser.parse_args(argv)
    if args.inject_flip is not None and args.flip_from is None:
        parser.error("--inject-flip needs --flip-from STEP")
    if (args.inject_hang is None) != (args.hang_at is None):
        parser.error("--inject-hang and --hang-at go together")
    if (args.inject_mismatch is None) != (args.mismatch_at is None):
        parser.error("--inject-mismatch and --mismatch-at go together")
    if args.collective_timeout is not None:
        os.environ["SPIKEOPS_COLLECTIVE_TIMEOUT"] = f"{args.collective_timeout:g}"
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse(argv)
    # What the incident flow asked of this run (spikeops.remediation), when it resubmitted it.
    request = ResumeRequest.from_env()
    replay = request.replay
    if replay is not None and replay.problem:  # never train for real when a replay was asked for
        raise SystemExit(f"spikeops replay: {replay.problem}")
    if args.resume_from is None and request.checkpoint:
        args.resume_from = Path(request.checkpoint)
    if replay is not None and args.resume_from is None:
        raise SystemExit("spikeops replay: no checkpoint to replay from (SPIKEOPS_RESUME_FROM or --resume-from)")
    if (args.launch or args.nodes) and not args.distributed:
        deterministic()  # its lazy imports (seconds) once here, not once per forked rank
        code = launch(list(sys.argv[1:] if argv is None else argv), args.nodes, spawn=args.spawn)
        if code:
            raise SystemExit(code)
        return {"lead": False, "launched": True}  # rank 0's process has printed the run's summary
    out: Path = args.out
    started = datetime.now(UTC)
    clock = time.monotonic()
    log = logging.getLogger("spikeops.train.example")
    warnings.filterwarnings("ignore", message="Anomaly Detection has been enabled", category=UserWarning)
    if request.strict_rng and args.no_restore_rng:
        raise SystemExit("SPIKEOPS_RESTORE_RNG=strict: refusing --no-restore-rng")
    if replay is not None and args.no_restore_rng:
        log.warning("spikeops replay: --no-restore-rng ignored (a replay restores the RNG exactly)")
        args.no_restore_rng = False
    if request.remediated:
        log.warning("spikeops remediation: %s", request.describe())
    determinism = deterministic() if replay is not None or args.distributed else None

    world = join_world() if args.distributed else World(WORLD, list(range(WORLD)), dict.fromkeys(range(WORLD),
                                                                                                 "localhost"))
    if world.lead and replay is None:
        out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(args.seed)
    random.seed(args.seed)
    dataset = make_dataset(args.seed)
    model = TinyLM()
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0)
    flip = BitFlip(args.inject_flip, args.flip_from, args.flip_once, args.flip_bit, replaying=replay is not None)
    model.mlp[0].register_forward_hook(flip.hook)

    first_step = 1
    last_step = args.steps
    resumed_from = None
    check: FingerprintCheck | None = None
    locator = AnomalyLocator(steps=0, reraise=False, log=log)
    if args.resume_from is not None:
        ckpt = args.resume_from.resolve()
        saved = torch.load(ckpt / "model.pt", weights_only=True)
        model.load_state_dict(saved["model"])
        optimizer.load_state_dict(saved["optimizer"])
        state = load_state(ckpt)
        if state is None:
            raise SystemExit(f"{ckpt}: no spikeops resume state")
        ckpt_step = int(saved["step"])
        if not args.no_restore_rng:
            restore_state(state)
        first_step = ckpt_step + 1
        resumed_from = {"step": ckpt_step, "path": str(ckpt)}
        reference = Path(state["extra"].get("batches", ckpt.parent.parent / "batches.jsonl"))
        if replay is not None:  # compare with the original run's own record; write nothing into its folder
            check = FingerprintCheck(reference, steps=max(1, (replay.until or 0) - ckpt_step))
        else:
            if reference.is_file() and world.lead:
                (out / "reference").mkdir(exist_ok=True)
                shutil.copyfile(reference, out / "reference" / "batches.jsonl")
            world.barrier()
            check = FingerprintCheck(out / "reference" / "batches.jsonl", steps=20)
            locator = AnomalyLocator(steps=max(args.locate_steps, request.detect_anomaly_steps), reraise=False,
                                     log=log)
    if replay is not None:
        last_step = min(args.steps, replay.until or 0)
        if last_step < first_step:
            raise SystemExit(f"spikeops replay: step {replay.until} is not after the checkpoint's step "
                             f"{first_step - 1} (or past the run's last step {args.steps})")

    hang = Fault(args.inject_hang, args.hang_at)
    mismatch = Fault(args.inject_mismatch, args.mismatch_at)
    recorder_dump = None
    if world.distributed and replay is None and os.environ.get("TORCH_FR_BUFFER_SIZE", "0") not in ("", "0"):
        recorder_dump = FlightRecorderDump(world.ranks[0], after_s=args.fr_dump_after, as_json=args.fr_json)
    if world.distributed and world.lead and replay is None:
        # the job's own description from the start, so an incident opened while it runs (or
        # hangs) knows which rank runs where; the final one below replaces it
        early = {"job": {"id": f"train-tiny-{args.seed}", "scheduler": "slurm" if os.environ.get("SLURM_JOB_ID")
                         else "local", "name": "train-tiny", "nodes": list(dict.fromkeys(world.nodes[r]
                                                                                 for r in sorted(world.nodes))),
                         "gpus_per_node": 1, "max_length": args.max_length, "started": iso(started),
                         "ranks": {str(r): n for r, n in sorted(world.nodes.items())}, "resumed_from": resumed_from}}
        (out / "incident.json").write_text(json.dumps(early, indent=1) + "\n")
    metrics = None if replay is not None else MetricsLogger(out, flush_every=20, rank=min(world.ranks))
    recorder = None
    if replay is not None:
        directory = Path(replay.directory(out))
        if world.lead:
            ReplayRecorder.reset(directory)
        world.barrier()
        recorder = ReplayRecorder(directory, rank=world.ranks[0], node=world.nodes[world.ranks[0]])
    grad_guard = GradGuard(max_norm=1.0)
    nan_guard = NanGuard(out / "nan.json" if world.lead and replay is None else None, job=f"train-tiny-{args.seed}")
    filter_stats = FilterStats()
    budget = MICRO_BATCH * args.max_length  # the fixed token budget the summed loss is divided by
    manifests = []
    losses: dict[int, float] = {}
    norms: dict[int, float] = {}
    order_warnings: list[str] = []

    skipped: list[int] = []
    for step in range(first_step, last_step + 1):
        if any(request.skips(step, rank) for rank in range(world.size)):
            draw_indices(world.size)  # the sampler still advances: the data order after the skip is unchanged
            skipped.append(step)
            log.warning("step %d: batch skipped (spikeops remediation)", step)
            continue
        for group in optimizer.param_groups:
            group["lr"] = request.scale_lr(lr_at(step, args.steps))
        optimizer.zero_grad(set_to_none=True)
        local: dict[int, list[torch.Tensor]] = {}
        rank_losses: dict[int, float] = {}
        rank_norms: dict[int, float] = {}
        fingerprints: dict[int, str] = {}
        tokens_trained = 0
        for rank, indices in enumerate(draw_indices(world.size)):
            if rank not in world.ranks:
                continue
            if hang.due(step, rank, world.nodes[rank]):
                if metrics is not None:
                    metrics.close()  # what it logged so far is on disk, as a real job's would be
                log.warning("rank %d: the data loader does not return at step %d (injected hang)", rank, step)
                wait_for_shard(dataset[indices[0]]["shard"])
            raw = [dataset[i] for i in indices]
            batch = list(filter_samples(raw, max_length=args.max_length, tokens=lambda s: s["tokens"],
                                        set_tokens=lambda s, cut: {**s, "tokens": cut}, key=lambda s: s["id"],
                                        stats=filter_stats))
            before = {s["id"]: len(s["tokens"]) for s in raw}
            counts = [before[s["id"]] for s in batch]  # token counts BEFORE truncation
            if step == args.inject_overlong and rank == args.inject_rank:
                long = overlong_sample(args.seed, step, rank, OVERLONG_FACTOR * args.max_length)
                batch.append(long)  # the broken filter: appended after filtering, never truncated
                counts.append(len(long["tokens"]))
            ids = [s["id"] for s in batch]
            if metrics is not None:
                record = metrics.batch(step, sample_ids=ids, token_counts=counts, source=batch[0]["shard"], rank=rank)
            else:
                record = batch_record(step, rank, ids, counts, batch[0]["shard"])
            fingerprints[rank] = record["fingerprint"]
            if check is not None:
                with warnings.catch_warnings(record=True) as caught:
                    warnings.simplefilter("always", DataOrderWarning)
                    check.observe(step, record["fingerprint"], rank)
                for item in caught:
                    order_warnings.append(str(item.message))
                    warnings.warn_explicit(item.message, item.category, item.filename, item.lineno)

            current, previous, targets = collate(batch)
            tokens_trained += int((targets != -100).sum())
            flip.arm(step, rank, world.nodes[rank])
            with locator.step(step):
                logits = model(current, previous)
                loss_sum = nn.functional.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1),
                                                       ignore_index=-100, reduction="sum")
                rank_loss = loss_sum / budget
                rank_grads = torch.autograd.grad(rank_loss, list(model.parameters()))
            flip.disarm()
            rank_norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in rank_grads]))
            local[rank] = list(rank_grads)
            rank_losses[rank], rank_norms[rank] = float(rank_loss.detach()), float(rank_norm)
            if metrics is not None:
                metrics.rank_row(step, loss=rank_losses[rank], grad_norm=rank_norms[rank], rank=rank)

        grads = world.reduce(local, odd=any(mismatch.due(step, r, world.nodes[r]) for r in world.ranks))
        if recorder is not None:
            reduced = torch.cat([g.reshape(-1) for g in grads])
            for rank in world.ranks:
                recorder.step(step, loss=rank_losses[rank], grad_norm=rank_norms[rank],
                              local_grads=torch.cat([g.reshape(-1) for g in local[rank]]), reduced_grads=reduced,
                              fingerprint=fingerprints[rank], rank=rank, node=world.nodes[rank])
        for p, g in zip(model.parameters(), grads, strict=True):
            p.grad = g
        loss = world.mean_loss(rank_losses)
        nan_guard.check(step, loss)
        clip = grad_guard.clip(model.parameters(), step)
        if math.isfinite(loss) and math.isfinite(clip.norm):
            optimizer.step()
        losses[step], norms[step] = loss, clip.norm
        if recorder_dump is not None:
            recorder_dump.progress(step)
        if metrics is not None:
            metrics.step(step, loss=loss, lr=optimizer.param_groups[0]["lr"], grad_norm=clip.norm,
                         tokens=tokens_trained)

        if replay is None and step % args.ckpt_every == 0 and world.lead:
            directory = out / "ckpt" / f"step-{step}"
            directory.mkdir(parents=True, exist_ok=True)
            torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "step": step},
                       directory / "model.pt")
            manifests.append(on_checkpoint_saved(directory, step, sampler_position=step,
                                                 extra={"batches": str((out / "batches.jsonl").resolve())}))

    if metrics is not None:
        metrics.close()
    if recorder_dump is not None:
        recorder_dump.close()
    for pending in manifests:  # the background manifests must be on disk before they are verified
        if hasattr(pending, "result"):
            pending.result()

    fingerprint_summary = None if check is None else {"matched": check.matched, "mismatches": len(check.mismatches),
                                                      "ok": check.ok}
    if replay is not None and recorder is not None:
        recorder.close()
        everyone = world.gather({"rank": world.ranks, "flips": flip.flips, "fingerprints": fingerprint_summary})
        seconds = round(time.monotonic() - clock, 3)
        meta = {"run": replay.run, "checkpoint": resumed_from, "first_step": first_step, "last_step": last_step,
                "steps": last_step - first_step + 1, "seconds": seconds, "world_size": world.size,
                "ranks": {str(r): n for r, n in sorted(world.nodes.items())}, "deterministic": determinism,
                "flips": [f for part in everyone for f in part["flips"]],
                "fingerprints": {str(part["rank"][0] if len(part["rank"]) == 1 else "all"): part["fingerprints"]
                                 for part in everyone},
                "losses": losses}
        if world.lead:
            recorder.write_meta(meta)
        world.barrier()
        if world.distributed:
            dist.destroy_process_group()
        return {**meta, "out": str(recorder.directory), "replay": True, "lead": world.lead}

    checkpoints = []
    if world.lead and (out / "ckpt").is_dir():
        for candidate in find_checkpoints(out / "ckpt"):
            report = verify(candidate.path) if candidate.has_manifest else None
            checkpoints.append({
                "step": candidate.step, "path": str(candidate.path.resolve()), "time": candidate.time,
                "manifest": str((candidate.path / "MANIFEST.json").resolve()) if candidate.has_manifest else None,
                "verified": None if report is None else report.ok,
                "problem": None if report is None or report.ok else report.summary()})
    everyone = world.gather({"flips": flip.flips, "nan_step": nan_guard.first_step})
    ended = datetime.now(UTC)
    node_names = list(dict.fromkeys(world.nodes[r] for r in sorted(world.nodes)))
    job: dict[str, Any] = {"id": f"train-tiny-{args.seed}", "scheduler": "local", "name": "train-tiny",
                           "nodes": node_names, "gpus_per_node": WORLD if not world.distributed else 1,
                           "max_length": args.max_length, "started": iso(started), "resumed_from": resumed_from}
    if world.distributed:
        job["ranks"] = {str(r): n for r, n in sorted(world.nodes.items())}
        if os.environ.get("SLURM_JOB_ID"):
            job["scheduler"] = "slurm"
    incident = {
        "format": "spikeops-bundle/1",
        "incident_id": f"inc-{ended.strftime('%Y%m%dT%H%M%SZ')}-train-tiny-{args.seed}",
        "created": iso(ended),
        "alert": {"source": "spikeops.train", "received": iso(ended),
                  "payload": {"grad_alarms": [[s, round(v, 4)] for s, v, _ in grad_guard.alarms],
                              "nan_step": nan_guard.first_step}},
        "job": job,
        "window": {"start": iso(started), "end": iso(ended + timedelta(seconds=1))},
    }
    summary = {
        "out": str(out), "first_step": first_step, "last_step": args.steps, "losses": losses, "grad_norms": norms,
        "grad_alarms": grad_guard.alarms, "nan_step": nan_guard.first_step,
        "filter": {"seen": filter_stats.seen, "kept": filter_stats.kept, "truncated": filter_stats.truncated,
                   "duplicate": filter_stats.duplicate, "empty": filter_stats.empty},
        "fingerprints": fingerprint_summary,
        "order_warnings": order_warnings, "anomaly": locator.summary(), "checkpoints": checkpoints, "skipped": skipped,
        "seconds": round(time.time() - started.timestamp(), 3),
    }
    if world.distributed:
        summary.update(ranks=job["ranks"], flips=[f for part in everyone for f in part["flips"]],
                       nan_steps=sorted({p["nan_step"] for p in everyone if p["nan_step"] is not None}))
    if world.lead:
        (out / "checkpoints.json").write_text(json.dumps(checkpoints, indent=1) + "\n")
        (out / "incident.json").write_text(json.dumps(incident, indent=1) + "\n")
        (out / "train-summary.json").write_text(json.dumps(summary, indent=1, default=str) + "\n")
    world.barrier()
    if world.distributed:
        dist.destroy_process_group()
    return {**summary, "lead": world.lead}


def _print_result(result: dict[str, Any]) -> None:
    if result.get("replay"):
        print(f"replay {result['run']}: steps {result['first_step']}..{result['last_step']} ({result['steps']} steps) "
              f"in {result['seconds']} s on {len(set(result['ranks'].values()))} node(s); "
              f"loss at {result['last_step']}: {result['losses'].get(result['last_step'])}"
              f"\nreplay.jsonl: {result['out']}", flush=True)
        return
    fp = result["fingerprints"]
    print(f"steps {result['first_step']}..{result['last_step']} in {result['seconds']} s; "
          f"loss {result['losses'][result['first_step']]:.3f} -> {result['losses'][result['last_step']]:.3f}; "
          f"grad alarms at {[s for s, _, _ in result['grad_alarms']]}; checkpoints "
          f"{[(c['step'], c['verified']) for c in result['checkpoints']]}"
          + (f"; fingerprints matched {fp['matched']}, mismatched {fp['mismatches']}" if fp else "")
          + f"\nbundle: {result['out']} (spikeops diagnose {result['out']})", flush=True)


if __name__ == "__main__":
    logging.basicConfig(format="%(levelname)s %(message)s")
    result = main()
    if result["lead"]:
        _print_result(result)
