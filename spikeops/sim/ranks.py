"""Per-rank rows (``ranks.jsonl``) and batch descriptors (``batches.jsonl``, ``reference/``).

The benchmark asks for ~2,000,000 rows of each, so both are generators of ready-made lines:
one format string per row, no dict, no ``json.dumps``.

Data order is a pure function of (data seed, step, rank): the sample ids of a rank's batch
come from the sample's position in the data stream, mixed with the seed. That is what makes
``reference/batches.jsonl`` honest: the run before a resume and the run after it produce the
same fingerprints for the same step exactly when they use the same data seed, which is the
whole of what ``rng_not_restored`` is about. Token counts are read off the fingerprint's
hash, so they too repeat with the data.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Iterator

from spikeops.sim.metrics import healthy_grad, healthy_loss
from spikeops.sim.plan import Plan, sub_rng

__all__ = ["sample_ids", "batch_fields", "iter_rank_lines", "iter_batch_lines", "data_seed_at"]

_MASK = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15


def sample_ids(data_seed: int, step: int, rank: int, ranks: int, per_rank: int,
               corpus_size: int, shard_size: int) -> list[str]:
    """Ids (``shard-00042:1881``) of the samples a rank draws at a step, in order."""
    ids = []
    base = (step * ranks + rank) * per_rank
    for j in range(per_rank):
        mixed = (((base + j) ^ data_seed) * _GOLDEN) & _MASK
        mixed ^= mixed >> 29
        index = mixed % corpus_size
        ids.append(f"shard-{index // shard_size:05d}:{index % shard_size}")
    return ids


def batch_fields(ids: list[str], max_length: int) -> tuple[str, int, int]:
    """(fingerprint, max_tokens, min_tokens) of a batch, all derived from its ids.

    ``max_tokens`` is counted before truncation: about a third of healthy batches hold a
    document a little longer than ``max_length`` (up to 1.5x) that the loader truncated.
    """
    digest = hashlib.blake2b("\x1f".join(ids).encode(), digest_size=16).digest()
    fingerprint = digest.hex()
    a = int.from_bytes(digest[:4], "little")
    b = int.from_bytes(digest[4:8], "little")
    c = int.from_bytes(digest[8:12], "little")
    if a % 3 == 0:
        longest = int(max_length * (1.0 + (b % 5000) / 10000.0))
    else:
        longest = int(max_length * (0.25 + (b % 7500) / 10000.0))
    shortest = longest if len(ids) == 1 else min(longest, 16 + c % max(1, longest // 2))
    return fingerprint, longest, shortest


def data_seed_at(plan: Plan, step: int) -> int:
    """The data seed a step ran with in the current run (changed after a broken resume)."""
    resume = plan.resume
    if resume is not None and resume.data_changed and step > resume.step:
        return plan.world.data_seed ^ 0x5DEECE66D
    return plan.world.data_seed


def _num(value: float, fmt: str) -> str:
    if value != value:
        return "NaN"
    if value in (math.inf, -math.inf):
        return "Infinity" if value > 0 else "-Infinity"
    return fmt % value


def iter_rank_lines(plan: Plan, start: int, end: int) -> Iterator[str]:
    """``ranks.jsonl`` lines for plan indices ``start..end-1``, every rank each step.

    A healthy rank's loss is the healthy global loss times a small per-rank bias and noise
    (its micro-batch is a small sample); its grad norm is the local, pre-AllReduce norm,
    larger than the global one; memory is flat per pipeline stage. The plan's all-ranks
    factors move everyone; its overrides move one rank.
    """
    world, curve = plan.world, plan.world.curve
    rng = sub_rng(plan.cause, plan.seed, "ranks")
    gauss = rng.gauss
    ranks = world.ranks
    bias = [1.0 + gauss(0.0, 0.004) for _ in range(ranks)]
    gscale = [curve.rank_grad_scale * (1.0 + gauss(0.0, 0.05)) for _ in range(ranks)]
    stages = max(1, min(8, world.gpus_per_node))
    mem = [curve.mem_gb + 2.1 * ((r % stages) - stages / 2) + gauss(0.0, 0.15) for r in range(ranks)]
    noise, gnoise = curve.rank_noise, curve.grad_noise * 1.5
    overrides = plan.rank_overrides
    for i in range(start, end):
        step = plan.first_step + i
        factor = plan.rank_loss_factor.get(i, plan.loss_factor.get(i, 1.0))
        gfactor = plan.rank_grad_factor.get(i, plan.grad_factor.get(i, 1.0))
        loss_level = healthy_loss(curve, step) * factor
        grad_level = healthy_grad(curve, step) * gfactor
        nan = plan.rank_nan_from is not None and i >= plan.rank_nan_from
        head = f'{{"step": {step}, "rank": '
        for r in range(ranks):
            loss = loss_level * bias[r] * (1.0 + gauss(0.0, noise))
            grad = grad_level * gscale[r] * (1.0 + gauss(0.0, gnoise))
            memory = mem[r] + gauss(0.0, 0.03)
            if overrides:
                special = overrides.get((i, r))
                if special is not None:
                    if special.loss is not None:
                        loss = special.loss
                    if special.grad is not None:
                        grad = special.grad
                    memory += special.mem_add
            if nan:
                yield (f'{head}{r}, "loss": NaN, "grad_norm": NaN, "mem_allocated_gb": {memory:.2f}}}\n')
            elif loss == loss and grad == grad and loss < 1e300 and grad < 1e300:
                yield (f'{head}{r}, "loss": {loss:.4f}, "grad_norm": {grad:.5g}, '
                       f'"mem_allocated_gb": {memory:.2f}}}\n')
            else:
                yield (f'{head}{r}, "loss": {_num(loss, "%.4f")}, "grad_norm": {_num(grad, "%.5g")}, '
                       f'"mem_allocated_gb": {memory:.2f}}}\n')


def iter_batch_lines(plan: Plan, start_step: int, end_step: int, *, reference: bool = False) -> Iterator[str]:
    """``batches.jsonl`` lines for steps ``start_step..end_step-1`` (every rank).

    ``reference`` renders the run before the resume: the original data seed and none of the
    current run's planted batch faults.
    """
    world = plan.world
    ranks, per_rank = world.ranks, world.micro_batch
    corpus, shard_size, corpus_size = world.corpus, world.shard_size, world.corpus_size
    max_length = world.max_length
    overrides = {} if reference else plan.batch_overrides
    for step in range(start_step, end_step):
        seed = world.data_seed if reference else data_seed_at(plan, step)
        i = step - plan.first_step
        for r in range(ranks):
            special = overrides.get((i, r)) if overrides else None
            ids_rank, ids_step = r, step
            if special is not None and "same_as" in special:
                ids_step, ids_rank = special["same_as"]  # type: ignore[misc]
            ids = sample_ids(seed, ids_step, ids_rank, ranks, per_rank, corpus_size, shard_size)
            fingerprint, longest, shortest = batch_fields(ids, max_length)
            empty = 0
            if special is not None:
                longest = int(special.get("max_tokens", longest))  # type: ignore[arg-type]
                shortest = int(special.get("min_tokens", shortest))  # type: ignore[arg-type]
                empty = int(special.get("num_empty", 0))  # type: ignore[arg-type]
            shard = int(ids[0][6:11])
            quoted = '", "'.join(ids)
            yield (
                f'{{"step": {step}, "rank": {r}, "fingerprint": "{fingerprint}", "num_samples": {per_rank}, '
                f'"max_tokens": {longest}, "min_tokens": {shortest}, "num_empty": {empty}, '
                f'"sample_ids": ["{quoted}"], "source": "{corpus.format(shard=shard)}"}}\n'
            )
