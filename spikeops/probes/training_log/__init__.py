"""Training logs and metrics files, read into one table of steps.

A loss spike is first seen in the job's own numbers: the loss, the gradient norm, the fp16
loss scale, skipped steps. Jobs print them in many shapes, often several in one file, so the
log parser recognises each line on its own, whatever launcher prefix (``[default7]:``,
``srun -l``'s ``0: ``, ``[rank0]:``) or timestamp sits in front of it:

- Megatron-LM / Megatron-DeepSpeed ``iteration N/ M | key: value | ...`` lines, with or
  without the leading ``[2024-05-01 12:00:00(.ffffff)]`` newer Megatron-LM prints;
- DeepSpeed ``OVERFLOW! ... Skipping step. Attempted loss scale: A, reducing to B`` lines
  (the *next* step record is the skipped one), the engine's ``[Rank 0] step=N, skipped=K,
  lr=[...]`` and the pipeline engine's ``steps: N loss: X iter time (s): T samples/sec: S``;
- Hugging Face Trainer stdout dicts ``{'loss': 1.37, 'grad_norm': 3.4, ...}`` (no step
  number is printed, so steps are numbered 1..n and ``step_is_ordinal`` is set);
- JSON lines in the bundle's ``metrics.jsonl`` shape;
- generic ``step/iter/Batch N ... loss: X ... lr: Y`` key-value lines.

Two more entry points read the whole-file forms: ``parse_metrics_jsonl`` (the bundle's
canonical file, every line must be a metrics object) and ``parse_trainer_state`` (Hugging
Face ``trainer_state.json``). All three return a ``TrainingLog``; ``to_frame`` turns its
records into one pandas row per step, where a step logged twice (a job resumed from a
checkpoint re-logs the steps after it) keeps its *later* occurrence.

Values stay as printed; only the quirks that would mislead are normalised: Megatron prints
``grad norm: 0.000`` when it did not compute the norm (None here), and non-finite values
(``NAN``, ``nan``, ``inf``, ``Infinity``, ``"-inf"``) become float NaN/inf, never dropped.

One module per concern: ``model`` (the step table and shared helpers), ``builder`` (records
as lines come), ``formats`` (the format readers, over the generic ``step_lines`` reader),
``files`` (the entry points and tables), ``detect``, ``summary``, ``follow`` (a growing
log). This module registers the three kinds and re-exports the API.
"""

from __future__ import annotations

from spikeops.probes.base import Kind, RemoteProbe, register, register_remote
from spikeops.probes.training_log.model import MAX_STEPS, FRAME_COLUMNS, StepRecord, RankMemory, OverflowEvent, Restart, TrainingLog
from spikeops.probes.training_log.files import parse, parse_metrics_jsonl, parse_trainer_state, latest_per_step, to_frame, first_loss_doubling
from spikeops.probes.training_log.detect import detect, detect_metrics_jsonl, detect_trainer_state
from spikeops.probes.training_log.summary import summarize
from spikeops.probes.training_log.follow import LineReader

__all__ = [
    "REMOTE",
    "LineReader",
    "StepRecord",
    "RankMemory",
    "OverflowEvent",
    "Restart",
    "TrainingLog",
    "parse",
    "parse_metrics_jsonl",
    "parse_trainer_state",
    "to_frame",
    "latest_per_step",
    "first_loss_doubling",
    "detect",
    "detect_metrics_jsonl",
    "detect_trainer_state",
    "summarize",
    "FRAME_COLUMNS",
    "MAX_STEPS",
    "KIND",
    "METRICS_KIND",
    "TRAINER_STATE_KIND",
]

# --------------------------------------------------------------------------- registration

KIND = register(
    Kind(
        name="training-log",
        description="the job's own log: Megatron/DeepSpeed/HF Trainer/generic step lines -> step table",
        command="the job's stdout/stderr log",
        parse=parse,
        detect=detect,
        summarize=summarize,
        streaming=True,
    )
)

METRICS_KIND = register(
    Kind(
        name="metrics-jsonl",
        description="the bundle's canonical metrics.jsonl: one JSON object per step (step, loss, ...)",
        command=None,
        parse=parse_metrics_jsonl,
        detect=detect_metrics_jsonl,
        summarize=summarize,
        streaming=True,
    )
)

TRAINER_STATE_KIND = register(
    Kind(
        name="trainer-state",
        description="Hugging Face trainer_state.json: log_history steps (eval entries left out)",
        command=None,
        parse=parse_trainer_state,
        detect=detect_trainer_state,
        summarize=summarize,
        streaming=False,
    )
)

#: The job's own log lines from this node's ranks (the inventory's ``[job] train_log``).
REMOTE = register_remote(RemoteProbe(
    name="train", filename="train.log", command="cat {files}",
    kind="training-log", order=80, max_bytes=64 << 20, keep="tail", needs="train_log",
))


