"""Training logs and metrics files -> one step table.

Real fixtures: Megatron-DeepSpeed/Megatron-LM iteration lines (BigScience), DeepSpeed
OVERFLOW lines, an FSDP ``srun -l`` log with NCCL lines, Hugging Face Trainer stdout.
Synthetic fixtures (tests/fixtures/synthetic/training-logs/README.md): dated Megatron-LM
with a NaN and a restart, metrics.jsonl, trainer_state.json, DeepSpeed engine lines.
"""

from __future__ import annotations

import math
from datetime import UTC, datetime

import pytest
from hypothesis import given, settings, strategies as st

from spikeops.probes import training_log as tl
from tests.conftest import real_text, synthetic_text

REAL = "training-logs/"
SYN = "training-logs/"


def by_step(log: tl.TrainingLog) -> dict[int, tl.StepRecord]:
    return {record.step: record for record in tl.latest_per_step(log.records)}


def utc(*parts: int) -> datetime:
    return datetime(*parts, tzinfo=UTC)


# --------------------------------------------------------------------------- real fixtures


def test_deepspeed_overflow_marks_next_iteration_skipped_and_dates_it():
    log = tl.parse(real_text(REAL + "104b-fp16-spike-deepspeed-overflow-skipping-step_bigscience.txt"))
    steps = by_step(log)
    assert list(steps) == list(range(17060, 17069))
    first = steps[17060]
    assert first.loss == pytest.approx(2.665295)
    assert first.lr == pytest.approx(5.948e-05)
    assert first.loss_scale == 1048576.0
    assert first.grad_norm == pytest.approx(453082.517)
    assert first.tokens == 16643457024
    assert first.throughput == pytest.approx(0.004) and first.throughput_unit == "samples/s"
    assert first.iteration_time_s == pytest.approx(573.1258)
    assert first.skipped is False and first.nan is False and first.time is None
    # The OVERFLOW line before 17062 (reducing 1048576 -> 1048576, hysteresis) skips 17062.
    assert steps[17062].skipped is True
    assert steps[17062].loss == pytest.approx(4.374269)
    assert steps[17062].time == utc(2022, 1, 19, 13, 9, 13, 305000)
    assert steps[17062].line == 4
    assert steps[17063].loss_scale == 524288.0
    assert steps[17063].time == utc(2022, 1, 19, 13, 16, 17, 683000)
    assert steps[17066].skipped is False  # no overflow line before it
    assert steps[17066].grad_norm == pytest.approx(879946.622)
    assert steps[17068].loss_scale == 32768.0 and steps[17068].skipped is True
    assert [s for s, r in steps.items() if r.skipped] == [17062, 17063, 17064, 17065, 17067, 17068]
    assert len(log.overflow_events) == 6
    assert (log.overflow_events[0].attempted, log.overflow_events[0].reduced_to) == (1048576.0, 1048576.0)
    assert (log.overflow_events[-1].attempted, log.overflow_events[-1].reduced_to) == (65536.0, 32768.0)
    assert log.overflow_events[-1].rank == 0 and log.overflow_events[-1].line == 14
    assert log.format == "megatron"
    assert log.gaps == []
    assert tl.first_loss_doubling(log.records) is None  # 2.667 -> 4.374 is not a doubling


def test_iteration_without_lm_loss_is_kept_and_read_as_non_finite():
    """Megatron prints ``lm loss`` only when its average is > 0, which NaN is not: a line
    that prints the fields after the loss (loss scale, grad norm, the counters), skipped no
    iteration, and has no loss, in a log whose other lines print one, is a NaN loss."""
    log = tl.parse(real_text(REAL + "104b-wide-fp16-diverged-missing-lm-loss_bigscience.txt"))
    assert [r.step for r in log.records] == [9026, 9027]
    assert log.records[0].loss == pytest.approx(7.02458)
    assert log.records[0].loss_scale == 16384.0
    assert log.records[0].loss_missing is False and log.records[0].nan is False
    missing = log.records[1]
    assert missing.loss is None and missing.loss_scale == 8192.0
    assert missing.grad_norm == pytest.approx(20609.78)
    assert missing.loss_missing is True and missing.nan is True and missing.skipped is False
    assert missing.line == 3
    assert log.gaps == []  # read (as a NaN), not unread; the bare 'time (ms)' lines are nothing
    assert any(line.startswith("NO LOSS PRINTED at step(s) 9027") for line in tl.summarize(log))


def test_grad_norm_and_loss_spike_lines_with_and_without_leading_space():
    log = tl.parse(real_text(REAL + "104b-wide-fp16-grad-norm-and-loss-spike_bigscience.txt"))
    steps = by_step(log)
    assert list(steps) == [8738, 8739, 8740, 8741, 8742, 8743]
    assert steps[8738].loss == pytest.approx(3.317482)  # the line without a leading space
    assert [round(steps[s].loss, 6) for s in steps] == [3.317482, 3.417051, 3.68295, 7.267764, 4.130868, 7.596509]
    assert steps[8741].grad_norm == pytest.approx(3273877.676)
    assert steps[8739].grad_norm == pytest.approx(89608.482)
    assert {r.loss_scale for r in steps.values()} == {65536.0}
    assert [r.line for r in log.records] == [1, 3, 5, 7, 9, 11]
    assert tl.first_loss_doubling(log.records) is None  # 3.683 -> 7.268 is 1.97x, not 2x
    assert log.gaps == []


def test_grad_norm_zero_means_not_computed():
    log = tl.parse(real_text(REAL + "13b-fp16-lm-loss-spike-3-to-9_bigscience.txt"))
    steps = by_step(log)
    assert list(steps) == list(range(29020, 29091, 10))
    assert all(r.grad_norm is None for r in steps.values())
    assert [r.loss_scale for r in steps.values()] == [32768.0, 32768.0, 65536.0, 8192.0, 4096.0, 4096.0, 4096.0, 4096.0]
    assert steps[29060].loss == pytest.approx(8.715872)
    assert steps[29020].lr == pytest.approx(9.85e-05)
    assert len(log.gaps) == 1
    assert "grad norm: 0.000" in log.gaps[0].reason and " 8 " in log.gaps[0].reason
    assert log.gaps[0].line == 1
    before, at = tl.first_loss_doubling(log.records)
    assert (before.step, at.step) == (29040, 29050)
    assert at.loss == pytest.approx(7.343709)
    summary = "\n".join(tl.summarize(log))
    assert "65536 -> 8192 (step 29050)" in summary
    assert "step 29050" in summary


def test_bloom_default_prefix_seconds_and_elision():
    log = tl.parse(real_text(REAL + "bloom-176b-bf16-lm-loss-spike-iter31216_bigscience.txt"))
    steps = by_step(log)
    assert list(steps) == [*range(31214, 31223), 31250, 31251]
    assert [steps[s].grad_norm for s in range(31214, 31220)] == [0.242, 0.947, 2.39, 15.886, 145.119, 960.351]
    assert steps[31219].loss == pytest.approx(5.098124)
    assert steps[31251].loss == pytest.approx(2.235667)
    assert all(r.loss_scale is None for r in steps.values())  # bf16: no loss scale printed
    assert steps[31214].iteration_time_s == pytest.approx(106.46)
    assert steps[31214].throughput == pytest.approx(19.238)
    assert steps[31214].tokens == 97829879808
    assert [(gap.line, "elided" in gap.reason) for gap in log.gaps] == [(10, True)]
    assert tl.first_loss_doubling(log.records)[1].step == 31219


def test_fsdp_srun_generic_lines_amid_nccl_and_bash_traces():
    text = real_text(REAL + "fsdp-llama3-8b-p5-srun-prefixed-with-nccl-lines_awsome-distributed-training.txt")
    log = tl.parse(text)
    assert [r.step for r in log.records] == [0, 1, 2, 3, 4, 5]
    assert [r.loss for r in log.records] == [11.61653, 11.64398, 10.58705, 15.01381, 11.78982, 14.34635]
    assert [r.line for r in log.records] == [17, 18, 19, 20, 21, 22]
    first = log.records[0]
    assert first.time == utc(2025, 6, 17, 16, 24, 52)
    assert first.lr == pytest.approx(0.0001) and log.records[4].lr == pytest.approx(0.000099)
    assert first.throughput == pytest.approx(4.88) and first.throughput_unit == "samples/sec"
    assert first.source == "generic" and log.format == "generic"
    assert [gap.line for gap in log.gaps] == [8, 11, 16]  # the author's '...' elisions
    assert tl.detect(text) >= 0.85


def test_hf_trainer_stdout_dicts_are_ordinal_steps():
    log = tl.parse(real_text(REAL + "hf-trainer-gemma-lora-normal_skypilot.txt"))
    assert log.step_is_ordinal is True
    assert log.format == "hf-trainer"
    assert [r.step for r in log.records] == list(range(1, 11))
    first, last = log.records[0], log.records[-1]
    assert (first.loss, first.grad_norm, first.lr, first.epoch) == (1.3736, 3.4177560806274414, 0.0001, 1.0)
    assert (last.loss, last.lr, last.epoch) == (0.2797, 0.0, 6.67)
    assert all(r.line <= 10 for r in log.records)  # the train_runtime summary is not a step
    assert log.gaps == []
    assert "ordinal" in tl.summarize(log)[0]


def test_raw_megatron_slurm_out_warmup_memory_and_validation():
    log = tl.parse(real_text(REAL + "megatron-raw-slurm-out-fp16-loss-scale-warmup-skipped-iters_bigscience.txt"))
    steps = by_step(log)
    assert list(steps) == list(range(10, 131, 10))
    warmup = steps[10]
    assert warmup.loss is None and warmup.skipped is True and warmup.skipped_iterations == 10
    assert warmup.loss_scale == 8388608.0 and warmup.lr == 0.0
    assert steps[20].loss == pytest.approx(12.10588) and steps[20].skipped_iterations == 8
    assert steps[20].grad_norm is None  # the field is absent on that line
    assert steps[30].loss == pytest.approx(26.48119) and steps[30].grad_norm == pytest.approx(67.033)
    assert steps[30].skipped is True and steps[40].skipped is False
    assert steps[100].loss == pytest.approx(8.085403)  # not the validation loss 8.095942
    assert len(log.records) == 13  # 'validation loss at iteration 100' is not a step
    memory = {entry.rank: entry for entry in log.rank_memory}
    assert sorted(memory) == list(range(32)) and len(log.rank_memory) == 32
    assert {entry.step for entry in log.rank_memory} == {20}
    assert memory[18].allocated_mb == pytest.approx(17694.361328125)
    assert memory[18].max_allocated_mb == pytest.approx(20045.0126953125)
    assert memory[18].reserved_mb == 24084.0 and memory[18].max_reserved_mb == 24084.0
    assert memory[27].reserved_mb == 23954.0 and memory[27].line == memory[25].line  # glued line
    assert memory[1].max_allocated_mb == pytest.approx(22112.0625)
    assert log.gaps == []


@pytest.mark.parametrize("name", [
    "104b-fp16-spike-deepspeed-overflow-skipping-step_bigscience.txt",
    "104b-wide-fp16-diverged-missing-lm-loss_bigscience.txt",
    "104b-wide-fp16-grad-norm-and-loss-spike_bigscience.txt",
    "13b-fp16-lm-loss-spike-3-to-9_bigscience.txt",
    "bloom-176b-bf16-lm-loss-spike-iter31216_bigscience.txt",
    "fsdp-llama3-8b-p5-srun-prefixed-with-nccl-lines_awsome-distributed-training.txt",
    "hf-trainer-gemma-lora-normal_skypilot.txt",
    "megatron-raw-slurm-out-fp16-loss-scale-warmup-skipped-iters_bigscience.txt",
])
def test_real_logs_are_training_logs_only(name):
    text = real_text(REAL + name)
    assert tl.detect(text) >= 0.85
    assert tl.detect_metrics_jsonl(text) == 0.0
    assert tl.detect_trainer_state(text) == 0.0


# --------------------------------------------------------------------------- synthetic fixtures


def test_megatron_dated_nan_and_restart_later_occurrence_wins():
    log = tl.parse(synthetic_text(SYN + "megatron-lm-dated-nan-restart.log"))
    assert len(log.records) == 42
    assert log.restarts == [tl.Restart(28, 120, 110, log.restarts[0].text)]
    first = log.records[0]
    assert first.step == 100 and first.time == utc(2024, 5, 1, 12, 0, 0)
    assert first.lr == pytest.approx(2.926585e-04) and first.loss == pytest.approx(2.40443)
    assert first.throughput == pytest.approx(402.9) and first.throughput_unit == "TFLOP/s/GPU"
    assert first.iteration_time_s == pytest.approx(1.5165)
    nan_first_run = [r for r in log.records if r.nan]
    assert [r.step for r in nan_first_run] == [118, 119, 120]
    assert math.isnan(nan_first_run[0].loss) and math.isnan(nan_first_run[0].grad_norm)
    assert nan_first_run[0].time == utc(2024, 5, 1, 12, 0, 27)
    assert (log.records[17].step, log.records[17].grad_norm) == (117, 187.402)  # the precursor

    frame = tl.to_frame(log.records)
    assert list(frame["step"]) == list(range(100, 131))
    row = frame.set_index("step").loc[118]
    assert row["loss"] == pytest.approx(2.340270) and not row["nan"]
    assert row["line"] == 37  # from the resumed run
    assert frame.set_index("step").loc[110, "time"] == utc(2024, 5, 1, 12, 32, 0)
    assert frame.set_index("step").loc[105, "line"] == 7  # before the resume window: first run
    assert log.rank_memory == [tl.RankMemory(110, 0, 61234.5, 70112.25, 74210.0, 74210.0, 29, log.rank_memory[0].text)]
    summary = "\n".join(tl.summarize(log))
    assert "before a restart at step(s) 118, 119, 120" in summary
    assert "step 120 -> 110" in summary
    assert log.gaps == []


def test_metrics_jsonl_both_nan_spellings_times_and_bad_line():
    log = tl.parse_metrics_jsonl(synthetic_text(SYN + "metrics.jsonl"))
    steps = by_step(log)
    assert list(steps) == [12340, 12341, 12342, 12343, 12344, 12345, 12347]
    assert [(gap.line, gap.reason.startswith("not JSON")) for gap in log.gaps] == [(7, True)]
    assert steps[12340].time == utc(2026, 11, 29, 17, 50, 0)
    assert steps[12341].time == utc(2026, 11, 29, 17, 50, 30)  # Unix seconds
    assert steps[12342].time == utc(2026, 11, 29, 17, 51, 0, 500000)  # float Unix seconds
    assert steps[12343].time == utc(2026, 11, 29, 17, 51, 30)  # +01:00 converted
    assert steps[12340].tokens == 50544148480 and steps[12340].throughput == 1843.2
    assert steps[12340].loss_scale == 65536.0 and steps[12340].lr == 0.0003
    for step in (12344, 12345):  # NaN/Infinity tokens, then "nan"/"inf" strings
        assert math.isnan(steps[step].loss) and steps[step].grad_norm == math.inf
        assert steps[step].nan is True
    assert steps[12347].loss == 2.3305 and steps[12347].line == 8
    assert log.format == "metrics-jsonl"
    assert tl.first_loss_doubling(log.records)[1].step == 12343


def test_metrics_jsonl_detected_and_readable_as_train_log():
    text = synthetic_text(SYN + "metrics.jsonl")
    assert tl.detect_metrics_jsonl(text) >= 0.9
    assert tl.detect(text) < 0.5
    assert tl.detect_trainer_state(text) == 0.0
    as_log = tl.parse(text)
    assert [r.step for r in as_log.records] == [r.step for r in tl.parse_metrics_jsonl(text).records]
    assert as_log.format == "metrics-jsonl"


def test_trainer_state_steps_eval_left_out_lines_cited():
    text = synthetic_text(SYN + "trainer_state.json")
    log = tl.parse_trainer_state(text)
    assert log.format == "trainer-state" and log.step_is_ordinal is False
    assert [r.step for r in log.records] == [5, 10, 15, 20, 25, 30, 35, 40]
    first = log.records[0]
    assert (first.loss, first.grad_norm, first.lr, first.epoch) == (1.82, 1.9, 2e-05, 0.125)
    assert first.line == 12 and '"step": 5' in first.text
    assert text.splitlines()[first.line - 1].strip() == "{"
    nan_step = by_step(log)[35]
    assert math.isnan(nan_step.grad_norm) and nan_step.loss == 1.4521 and nan_step.nan is True
    assert by_step(log)[20].loss == 1.67  # the training entry, not eval_loss 1.6021
    assert log.gaps == []
    assert tl.detect_trainer_state(text) >= 0.9
    assert tl.detect(text) == 0.0 and tl.detect_metrics_jsonl(text) == 0.0
    via_log = tl.parse(text)  # a trainer_state.json saved as train.log
    assert [(r.step, r.line) for r in via_log.records] == [(r.step, r.line) for r in log.records]


def test_trainer_state_cut_short_keeps_complete_entries():
    text = synthetic_text(SYN + "trainer_state.json")
    cut = text[: text.index('"step": 25') + 5]
    log = tl.parse_trainer_state(cut)
    assert [r.step for r in log.records] == [5, 10, 15, 20]
    assert any("not a complete JSON document" in gap.reason for gap in log.gaps)
    assert any("cut short" in gap.reason for gap in log.gaps)


def test_deepspeed_engine_and_pipeline_lines_merge_per_step():
    log = tl.parse(synthetic_text(SYN + "deepspeed-pipeline-steps.log"))
    assert log.format == "deepspeed"
    steps = by_step(log)
    assert list(steps) == [10, 20, 30, 40, 50, 60]
    ten = steps[10]
    assert (ten.loss, ten.lr, ten.skipped) == (2.3456, 7.5e-05, False)
    assert ten.throughput == 62.7 and ten.throughput_unit == "samples/s"
    assert ten.iteration_time_s == 0.51
    assert ten.time == utc(2024, 3, 4, 10, 15, 6, 20000)  # from the step= line
    assert ten.line == 3  # cites the line that carries the loss
    assert steps[30].skipped is True and steps[30].loss_scale == 32768.0
    assert steps[40].skipped is False
    fifty = steps[50]
    assert math.isnan(fifty.loss) and fifty.nan is True and fifty.skipped is True
    assert fifty.loss_scale == 8192.0  # the last overflow's reduced scale
    assert [(e.attempted, e.reduced_to) for e in log.overflow_events] == [
        (65536.0, 32768.0), (32768.0, None), (32768.0, 16384.0), (16384.0, 8192.0)]
    assert log.restarts == [] and log.gaps == []


# --------------------------------------------------------------------------- formats inline


def test_megatron_microsecond_date_rank_prefix_and_nan_spellings():
    text = (
        "[rank7]: [2024-05-01 12:00:00.123456] iteration      500/   10000 | consumed samples: 128000 |"
        " elapsed time per iteration (ms): 812.4 | learning rate: 1.000000E-04 | global batch size:   256 |"
        " lm loss: nan | loss scale: 1.0 | grad norm: inf | number of skipped iterations:   0 |"
        " number of nan iterations:   1 |\n"
        "  3: [2024-05-01 12:00:01] iteration      501/   10000 | lm loss: NaN | number of nan iterations:   0 |\n"
    )
    log = tl.parse(text)
    first, second = log.records
    assert first.step == 500 and first.time == utc(2024, 5, 1, 12, 0, 0, 123456)
    assert math.isnan(first.loss) and first.grad_norm == math.inf
    assert first.nan is True and first.nan_iterations == 1
    assert second.step == 501 and math.isnan(second.loss) and second.nan is True


def test_hf_dicts_with_bare_nan_string_values_and_tqdm_prefix():
    text = (
        " 45%|████▌     | 9/20 [00:09<00:11,  1.02s/it]{'loss': nan, 'grad_norm': inf, 'learning_rate': 1e-05, 'epoch': 0.45}\n"
        "{'loss': '1.374', 'grad_norm': '3.418', 'learning_rate': '0.0001', 'epoch': '1'}\n"
        "{'eval_loss': 1.2, 'eval_runtime': 3.1, 'epoch': 1.0}\n"
        "{'train_runtime': 7.37, 'train_loss': 0.5, 'epoch': 1.0}\n"
        "{'loss': 1.2, 'grad_norm': }\n"
    )
    log = tl.parse(text)
    # The Trainer prints no step; its bar says 9 were done when the first dict was printed.
    # The second dict has no newer bar: the step after it, and marked invented.
    assert [r.step for r in log.records] == [9, 10]
    assert log.step_is_ordinal is True
    assert math.isnan(log.records[0].loss) and log.records[0].grad_norm == math.inf
    assert log.records[0].nan is True
    assert (log.records[1].loss, log.records[1].grad_norm, log.records[1].epoch) == (1.374, 3.418, 1.0)
    assert [(gap.line, gap.reason) for gap in log.gaps] == [(5, "unreadable training log dict")]


def test_deepspeed_engine_cumulative_skipped_counter():
    text = (
        "[2024-01-01 00:00:01,000] [INFO] [logging.py:96:log_dist] [Rank 0] step=10, skipped=0, lr=[0.0001], mom=[(0.9, 0.999)]\n"
        "[2024-01-01 00:00:02,000] [INFO] [logging.py:96:log_dist] [Rank 0] step=20, skipped=2, lr=[0.0001], mom=[(0.9, 0.999)]\n"
        "[2024-01-01 00:00:03,000] [INFO] [logging.py:96:log_dist] [Rank 0] step=30, skipped=2, lr=[0.0001], mom=[(0.9, 0.999)]\n"
    )
    log = tl.parse(text)
    assert [(r.step, r.skipped, r.loss) for r in log.records] == [(10, False, None), (20, True, None), (30, False, None)]
    assert log.format == "deepspeed"


def test_apex_gradient_overflow_and_json_lines_in_a_log():
    text = (
        "Gradient overflow.  Skipping step, loss scaler 0 reducing loss scale to 32768.0\n"
        '[default0]:{"step": 7, "loss": 3.5, "lr": 0.001}\n'
    )
    log = tl.parse(text)
    assert log.overflow_events[0].reduced_to == 32768.0 and log.overflow_events[0].attempted is None
    record = log.records[0]
    assert (record.step, record.loss, record.skipped, record.loss_scale) == (7, 3.5, True, 32768.0)
    assert record.source == "metrics-jsonl"


def test_generic_key_value_shapes():
    text = (
        "step=100 loss=2.345 lr=3e-4 grad_norm=0.91 loss_scale=1024\n"
        "iter 200: loss 2.3456, time 123.45ms, mfu 45.67%\n"
        "\x1b[31mstep:  300  \x1b[32mloss:  9.1234  \x1b[33mmemory: 30.12GiB(31.70%)  \x1b[34mtps: 1,234\x1b[39m\n"
        "step 400: train loss 2.3000, val loss 2.4000\n"
        "Epoch 1 | Step 500/1000 | Loss: 1.98 | grad norm: 0.000\n"
    )
    log = tl.parse(text)
    steps = by_step(log)
    assert list(steps) == [100, 200, 300, 500]  # the eval line is not a step
    assert (steps[100].loss, steps[100].lr, steps[100].grad_norm, steps[100].loss_scale) == (2.345, 3e-4, 0.91, 1024.0)
    assert steps[200].loss == 2.3456
    assert steps[300].loss == 9.1234 and steps[300].throughput == 1234.0 and steps[300].throughput_unit == "tokens/s"
    assert steps[500].grad_norm == 0.0 and steps[500].epoch == 1.0  # only Megatron's 0.000 means "not computed"


def test_detect_nccl_only_versus_log_with_steps():
    nccl = "\n".join(
        f"gpu-001:1234:1234 [{i % 8}] NCCL INFO Channel {i:02d}/0 : 0[0] -> 1[1] via P2P/IPC" for i in range(40)
    )
    assert tl.detect(nccl) == 0.0
    steps = "\n".join(f"0: 2025-01-01 00:00:{i:02d} I [train.py:103] Batch {i} Loss: 2.{i:02d}, lr: 0.0001" for i in range(20))
    assert tl.detect(nccl + "\n" + steps + "\n") >= 0.85
    assert tl.detect("") == 0.0
    assert tl.detect("{'loss': 1.0, 'grad_norm': 2.0, 'learning_rate': 1e-05, 'epoch': 0.1}\n") >= 0.8
    assert tl.detect_trainer_state('{\n  "log_history": [\n') >= 0.9


def test_metrics_jsonl_strict_lines():
    text = (
        '{"step": 1, "loss": -Infinity, "grad_norm": "-inf"}\n'
        '{"step": 2, "lr": 0.1}\n'
        '{"loss": 2.0}\n'
        "[1, 2]\n"
        '{"step": 3.5, "loss": 1.0}\n'
        '{"step": 4, "loss": 1.0, "time": "yesterday"}\n'
    )
    log = tl.parse_metrics_jsonl(text)
    assert [(r.step, r.line) for r in log.records] == [(1, 1), (2, 2), (4, 6)]
    assert log.records[0].loss == -math.inf and log.records[0].nan is True
    assert log.records[1].loss is None  # kept, with a gap: the file promises a loss
    assert [gap.line for gap in log.gaps] == [2, 3, 4, 5, 6]


def test_json_document_without_log_history_is_read_as_lines():
    text = '{\n  "model": "x"\n}\n iteration       10/     100 | lm loss: 2.000000E+00 |\n'
    log = tl.parse(text)
    assert [(r.step, r.loss, r.line) for r in log.records] == [(10, 2.0, 4)]


def test_to_frame_columns_types_and_empty():
    log = tl.parse(real_text(REAL + "104b-fp16-spike-deepspeed-overflow-skipping-step_bigscience.txt"))
    frame = tl.to_frame(log.records)
    assert tuple(frame.columns) == tl.FRAME_COLUMNS
    assert str(frame["time"].dtype) == "datetime64[ns, UTC]"
    assert str(frame["skipped"].dtype) == "boolean" and str(frame["tokens"].dtype) == "Int64"
    assert frame["skipped"].sum() == 6
    assert frame["time"].isna().sum() == 3
    empty = tl.to_frame([])
    assert tuple(empty.columns) == tl.FRAME_COLUMNS and len(empty) == 0


def test_record_limit_keeps_latest(monkeypatch):
    monkeypatch.setattr(tl.builder, "MAX_STEPS", 5)
    text = "".join(f"step {i} loss 1.0\n" for i in range(1, 13))
    log = tl.parse(text)
    assert [r.step for r in log.records] == [8, 9, 10, 11, 12]
    assert any("7 earlier dropped" in gap.reason for gap in log.gaps)


def test_empty_and_foreign_inputs():
    for text in ("", "\n\n", "NIC statistics:\n     rx_packets: 1\n", "\x00\x01garbage"):
        log = tl.parse(text)
        assert log.records == [] and any("no training step" in gap.reason for gap in log.gaps)
    assert tl.summarize(tl.parse(""))[0].startswith("unknown: 0 lines")


# --------------------------------------------------------------------------- never raises

GOOD_A = " iteration      100/    1000 | lm loss: 2.000000E+00 | loss scale: 1024.0 | grad norm: 1.500 |"
GOOD_B = " iteration      101/    1000 | lm loss: 2.500000E+00 | loss scale: 1024.0 | grad norm: 1.600 |"


@settings(deadline=None)
@given(st.text(max_size=3000))
def test_parse_never_raises(text):
    log = tl.parse(text)
    assert isinstance(log.records, list) and isinstance(log.gaps, list)
    tl.summarize(log)
    tl.to_frame(log.records)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.text(max_size=300), max_size=8))
def test_parse_keeps_good_lines_around_bad_ones(middle):
    lines = [GOOD_A, *middle, GOOD_B]
    log = tl.parse(lines)
    at_a = [r for r in log.records if r.line == 1]
    at_b = [r for r in log.records if r.line == len(lines)]
    assert at_a and at_a[0].step == 100 and at_a[0].loss == 2.0
    assert at_b and at_b[0].step == 101 and at_b[0].loss == 2.5 and at_b[0].grad_norm == 1.6


@settings(deadline=None)
@given(st.text(max_size=3000))
def test_parse_metrics_jsonl_never_raises(text):
    log = tl.parse_metrics_jsonl(text)
    assert log.format == "metrics-jsonl"


@settings(deadline=None)
@given(st.lists(st.text(max_size=200), max_size=6))
def test_metrics_jsonl_keeps_good_lines(middle):
    lines = ['{"step": 1, "loss": 1.0}', *middle, '{"step": 99999, "loss": NaN}']
    log = tl.parse_metrics_jsonl(lines)
    assert any(r.line == 1 and r.loss == 1.0 for r in log.records)
    assert any(r.line == len(lines) and r.step == 99999 and r.nan for r in log.records)


@settings(deadline=None)
@given(st.text(max_size=3000))
def test_parse_trainer_state_never_raises(text):
    log = tl.parse_trainer_state(text)
    assert log.format == "trainer-state"


@settings(deadline=None)
@given(st.text(max_size=3000))
def test_trainer_state_prefix_never_raises(text):
    full = synthetic_text(SYN + "trainer_state.json")
    log = tl.parse_trainer_state(full[: len(text) % (len(full) + 1)] + text)
    assert isinstance(log.records, list)


@settings(deadline=None)
@given(st.text(max_size=3000))
def test_detectors_never_raise(text):
    for detector in (tl.detect, tl.detect_metrics_jsonl, tl.detect_trainer_state):
        assert 0.0 <= detector(text) <= 1.0
