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

    python examples/train_tiny.py --out /tmp/run [--steps 80] [--inject-overlong 60]
        [--resume-from /tmp/run/ckpt/step-40] [--no-restore-rng] [--seed 0]
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import random
import shutil
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
    filter_samples,
    load_state,
    on_checkpoint_saved,
    restore_state,
)

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


def draw_indices() -> list[list[int]]:
    """The sampler: each rank's micro-batch drawn from the global torch RNG (so it is the
    RNG state saved with a checkpoint that decides the data order after a resume)."""
    flat = torch.randint(0, DATASET_SIZE, (WORLD * MICRO_BATCH,)).tolist()
    return [flat[r * MICRO_BATCH:(r + 1) * MICRO_BATCH] for r in range(WORLD)]


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
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse(argv)
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    started = datetime.now(UTC)
    log = logging.getLogger("spikeops.train.example")
    warnings.filterwarnings("ignore", message="Anomaly Detection has been enabled", category=UserWarning)

    torch.manual_seed(args.seed)
    random.seed(args.seed)
    dataset = make_dataset(args.seed)
    model = TinyLM()
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0)

    # What the incident flow asked of this run (spikeops.remediation), when it resubmitted it.
    request = ResumeRequest.from_env()
    if args.resume_from is None and request.checkpoint:
        args.resume_from = Path(request.checkpoint)
    if request.strict_rng and args.no_restore_rng:
        raise SystemExit("SPIKEOPS_RESTORE_RNG=strict: refusing --no-restore-rng")
    if request.remediated:
        log.warning("spikeops remediation: %s", request.describe())
    first_step = 1
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
        if reference.is_file():
            (out / "reference").mkdir(exist_ok=True)
            shutil.copyfile(reference, out / "reference" / "batches.jsonl")
        check = FingerprintCheck(out / "reference" / "batches.jsonl", steps=20)
        locator = AnomalyLocator(steps=max(args.locate_steps, request.detect_anomaly_steps), reraise=False, log=log)

    metrics = MetricsLogger(out, flush_every=20)
    grad_guard = GradGuard(max_norm=1.0)
    nan_guard = NanGuard(out / "nan.json", job=f"train-tiny-{args.seed}")
    filter_stats = FilterStats()
    budget = MICRO_BATCH * args.max_length  # the fixed token budget the summed loss is divided by
    manifests = []
    losses: dict[int, float] = {}
    norms: dict[int, float] = {}
    order_warnings: list[str] = []

    skipped: list[int] = []
    for step in range(first_step, args.steps + 1):
        if any(request.skips(step, rank) for rank in range(WORLD)):
            draw_indices()  # the sampler still advances: the data order after the skip is unchanged
            skipped.append(step)
            log.warning("step %d: batch skipped (spikeops remediation)", step)
            continue
        for group in optimizer.param_groups:
            group["lr"] = request.scale_lr(lr_at(step, args.steps))
        optimizer.zero_grad(set_to_none=True)
        grads = [torch.zeros_like(p) for p in model.parameters()]
        rank_losses = []
        tokens_trained = 0
        for rank, indices in enumerate(draw_indices()):
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
            record = metrics.batch(step, sample_ids=[s["id"] for s in batch], token_counts=counts,
                                   source=batch[0]["shard"], rank=rank)
            if check is not None:
                with warnings.catch_warnings(record=True) as caught:
                    warnings.simplefilter("always", DataOrderWarning)
                    check.observe(step, record["fingerprint"], rank)
                for item in caught:
                    order_warnings.append(str(item.message))
                    warnings.warn_explicit(item.message, item.category, item.filename, item.lineno)

            current, previous, targets = collate(batch)
            tokens_trained += int((targets != -100).sum())
            with locator.step(step):
                logits = model(current, previous)
                loss_sum = nn.functional.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1),
                                                       ignore_index=-100, reduction="sum")
                rank_loss = loss_sum / budget
                rank_grads = torch.autograd.grad(rank_loss, list(model.parameters()))
            rank_norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in rank_grads]))
            for acc, g in zip(grads, rank_grads, strict=True):
                acc.add_(g, alpha=1.0 / WORLD)
            rank_losses.append(float(rank_loss.detach()))
            metrics.rank_row(step, loss=float(rank_loss.detach()), grad_norm=float(rank_norm), rank=rank)

        for p, g in zip(model.parameters(), grads, strict=True):
            p.grad = g
        loss = sum(rank_losses) / WORLD
        nan_guard.check(step, loss)
        clip = grad_guard.clip(model.parameters(), step)
        if math.isfinite(loss):
            optimizer.step()
        losses[step], norms[step] = loss, clip.norm
        metrics.step(step, loss=loss, lr=optimizer.param_groups[0]["lr"], grad_norm=clip.norm, tokens=tokens_trained)

        if step % args.ckpt_every == 0:
            directory = out / "ckpt" / f"step-{step}"
            directory.mkdir(parents=True, exist_ok=True)
            torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "step": step},
                       directory / "model.pt")
            manifests.append(on_checkpoint_saved(directory, step, sampler_position=step,
                                                 extra={"batches": str((out / "batches.jsonl").resolve())}))

    metrics.close()
    for pending in manifests:  # the background manifests must be on disk before they are verified
        if hasattr(pending, "result"):
            pending.result()

    checkpoints = []
    if (out / "ckpt").is_dir():
        for candidate in find_checkpoints(out / "ckpt"):
            report = verify(candidate.path) if candidate.has_manifest else None
            checkpoints.append({
                "step": candidate.step, "path": str(candidate.path.resolve()), "time": candidate.time,
                "manifest": str((candidate.path / "MANIFEST.json").resolve()) if candidate.has_manifest else None,
                "verified": None if report is None else report.ok,
                "problem": None if report is None or report.ok else report.summary()})
    (out / "checkpoints.json").write_text(json.dumps(checkpoints, indent=1) + "\n")

    ended = datetime.now(UTC)
    incident = {
        "format": "spikeops-bundle/1",
        "incident_id": f"inc-{ended.strftime('%Y%m%dT%H%M%SZ')}-train-tiny-{args.seed}",
        "created": iso(ended),
        "alert": {"source": "spikeops.train", "received": iso(ended),
                  "payload": {"grad_alarms": [[s, round(v, 4)] for s, v, _ in grad_guard.alarms],
                              "nan_step": nan_guard.first_step}},
        "job": {"id": f"train-tiny-{args.seed}", "scheduler": "local", "name": "train-tiny", "nodes": ["localhost"],
                "gpus_per_node": WORLD, "max_length": args.max_length, "started": iso(started),
                "resumed_from": resumed_from},
        "window": {"start": iso(started), "end": iso(ended + timedelta(seconds=1))},
    }
    (out / "incident.json").write_text(json.dumps(incident, indent=1) + "\n")

    summary = {
        "out": str(out), "first_step": first_step, "last_step": args.steps, "losses": losses, "grad_norms": norms,
        "grad_alarms": grad_guard.alarms, "nan_step": nan_guard.first_step,
        "filter": {"seen": filter_stats.seen, "kept": filter_stats.kept, "truncated": filter_stats.truncated,
                   "duplicate": filter_stats.duplicate, "empty": filter_stats.empty},
        "fingerprints": None if check is None else {"matched": check.matched, "mismatches": len(check.mismatches),
                                                    "ok": check.ok},
        "order_warnings": order_warnings, "anomaly": locator.summary(), "checkpoints": checkpoints, "skipped": skipped,
        "seconds": round(time.time() - started.timestamp(), 3),
    }
    (out / "train-summary.json").write_text(json.dumps(summary, indent=1, default=str) + "\n")
    return summary


if __name__ == "__main__":
    result = main()
    fp = result["fingerprints"]
    print(f"steps {result['first_step']}..{result['last_step']} in {result['seconds']} s; "
          f"loss {result['losses'][result['first_step']]:.3f} -> {result['losses'][result['last_step']]:.3f}; "
          f"grad alarms at {[s for s, _, _ in result['grad_alarms']]}; checkpoints "
          f"{[(c['step'], c['verified']) for c in result['checkpoints']]}"
          + (f"; fingerprints matched {fp['matched']}, mismatched {fp['mismatches']}" if fp else "")
          + f"\nbundle: {result['out']} (spikeops diagnose {result['out']})")
