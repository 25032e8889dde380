"""The shapes real training logs come in (issue 14, classes 4, 5, 6, 7), read line by line.

Real text first: the real-incident corpus (tests/fixtures/real-incidents, verbatim excerpts of
public chronicles and issue threads, see its SOURCES.md) and shared/fixtures/real. Where a
format has no real sample there, the line is written here exactly as the tool prints it (the
issue quotes them), marked as such.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from spikeops.probes import job_errors, kernel_log, nccl_log
from spikeops.probes import training_log as tl
from tests.conftest import ROOT

CORPUS = ROOT / "tests" / "fixtures" / "real-incidents"


def corpus(case: str, name: str = "train.log") -> str:
    path = CORPUS / case / name
    if not path.is_file():
        pytest.skip(f"corpus case {case} not present")
    return path.read_text(encoding="utf-8")


def steps(log: tl.TrainingLog) -> dict[int, tl.StepRecord]:
    return {record.step: record for record in tl.latest_per_step(log.records)}


# ------------------------------------------------------------------------------ Megatron


def test_megatron_lines_wrapped_over_three_physical_lines_are_joined():
    log = tl.parse(corpus("bloom176b-throughput-drop-wrapped-lines"))
    got = steps(log)
    assert list(got) == [42780, 42781, 42782, 42783, 42784]
    first = got[42780]
    assert first.loss == pytest.approx(2.117073) and first.lr == pytest.approx(4.475e-05)
    assert first.nan_iterations == 0 and first.nan is False and first.line == 1
    assert got[42784].throughput == pytest.approx(18.428)
    assert not log.gaps


def test_megatron_bridge_record_printed_as_pipe_terminated_pieces():
    log = tl.parse(corpus("megatron-bridge-wrapped-record-grad-norm-nan"))
    got = steps(log)
    assert 5 in got
    record = got[5]
    assert record.lr == pytest.approx(1.35e-4) and record.loss_scale == 1.0
    assert math.isnan(record.grad_norm) and record.nan is True
    assert record.skipped_iterations == 0 and record.nan_iterations == 0


def test_lm_loss_that_vanishes_is_a_nan_loss_only_where_the_run_prints_one():
    log = tl.parse(corpus("megatron-llm-falcon40b-lm-loss-vanishes"))
    got = steps(log)
    assert got[3384].loss == pytest.approx(0.7072597) and got[3384].nan is False
    assert got[3385].loss is None and got[3385].loss_missing and got[3385].nan is True
    # A fork whose lines never print a loss says nothing by leaving it out.
    never = tl.parse(corpus("megatron-ds-grad-norm-nan-no-lm-loss"))
    assert not any(record.loss_missing for record in never.records)
    assert all(record.nan for record in never.records)  # grad norm: nan on every line
    assert any("no iteration line prints a loss" in gap.reason for gap in never.gaps)


def test_all_iterations_skipped_is_not_a_missing_loss():
    text = (" iteration       10/    1000 | consumed samples:           40 | learning rate: 0.000E+00 | "
            "global batch size:     4 | loss scale: 8388608.0 | number of skipped iterations:  10 | "
            "number of nan iterations:   0 |\n"
            " iteration       20/    1000 | consumed samples:           80 | learning rate: 3.750E-05 | "
            "global batch size:     4 | lm loss: 1.210588E+01 | loss scale: 32768.0 | "
            "number of skipped iterations:   8 | number of nan iterations:   0 |\n")
    got = steps(tl.parse(text))
    assert got[10].skipped is True and got[10].loss_missing is False and got[10].nan is False


def test_iteration_colon_form_and_validation_lines():
    # ``iteration: N/M |`` (as the issue quotes it) reads like Megatron's; validation is not a step.
    text = ("iteration: 120/5000 | loss: 2.513 | lr: 3.0E-04 | grad_norm: 0.82 | loss_scale: 4096 |\n"
            " validation loss at iteration 120 | lm loss value: 2.91 | lm loss PPL: 18.4 |\n"
            "Evaluation result for step 120: loss = 2.9 ; perplexity = 18.3\n")
    log = tl.parse(text)
    assert [(r.step, r.loss, r.lr, r.grad_norm, r.loss_scale) for r in log.records] == [
        (120, 2.513, 3.0e-4, 0.82, 4096.0)]


# ------------------------------------------------------------------------------ other trainers


def test_fairseq_num_updates_is_the_step_and_its_overflow_notes_are_scale_evidence():
    log = tl.parse(corpus("fairseq-overflow-to-min-loss-scale"))
    got = steps(log)
    assert list(got) == [10198]  # the valid line is not a training step
    record = got[10198]
    assert (record.loss, record.grad_norm, record.loss_scale, record.perplexity) == (6.343, 0.39, 0.5, 31.65)
    scales = [event.reduced_to for event in log.overflow_events]
    assert scales[0] == 0.25 and scales[-1] == pytest.approx(0.0001220703125) and len(scales) == 12


def test_hf_trainer_step_comes_from_the_progress_bar_and_overflows_from_the_bar_before_them():
    log = tl.parse(corpus("deepspeed-hf-loss-scale-to-minimum"))
    (record,) = log.records
    assert record.step == 380 and record.loss == pytest.approx(2.0491) and not log.step_is_ordinal
    assert [(e.step, e.attempted, e.reduced_to) for e in log.overflow_events] == [
        (379, 64, 32), (380, 32, 16), (381, 16, 8), (382, 8, 4), (383, 4, 2)]


def test_deepspeed_overflow_lines_alone_are_read():
    log = tl.parse(corpus("cogvideo-deepspeed-overflow-startup"))
    assert log.records == []
    assert [e.reduced_to for e in log.overflow_events][:2] == [2147483648, 1073741824]
    stuck = tl.parse(corpus("deepspeed-fp16-stuck-at-loss-scale-one"))
    assert stuck.overflow_events and all(e.reduced_to == 1 for e in stuck.overflow_events)


def test_scale_at_its_minimum_is_an_event():
    text = ("[2023-06-07 22:26:58,001] [INFO] [loss_scaler.py:183:update_scale] Current loss scale already at "
            "minimum - cannot decrease scale anymore. Exiting run.\n"
            "FloatingPointError: Minimum loss scale reached (0.0001). Your loss is probably exploding.\n")
    events = tl.parse(text).overflow_events
    assert [(e.minimum, e.reduced_to) for e in events] == [(True, None), (True, 0.0001)]


def test_loss_keys_with_prefixes_and_suffixes_and_other_step_shapes():
    # Imitations of the shapes the issue lists (DLLogger, '=> STEP', bare-number tables,
    # prefixed/suffixed keys), one per line, each printed as its tool prints it.
    text = (
        "DLL 2020-06-19 21:39:51.127358 - Training Epoch: 0 Training Iteration: 100  average_loss : 7.9627 "
        "step_loss : 7.2563  learning_rate : 0.0005 loss_scale : 65536.0\n"
        "=> STEP 200 | total_loss 3.1 | lr 2.0e-04\n"
        "1220 | loss 3.2969 | lr 2.64e-04 | 13880ms\n"
        "[0]:LOG Wed Dec 21 00:12:27 2022 - (0, 1300) step_loss : 11.2500 learning_rate : 2.80e-06 throughput : 6497.86\n"
        "step 1400 per_token_loss=2.75 grad-norm 1.1\n"
        "INFO:tensorflow:loss = 2.5, step = 1500\n"
    )
    got = [(r.step, r.loss) for r in tl.parse(text).records]
    assert got == [(100, 7.2563), (200, 3.1), (1220, 3.2969), (1300, 11.25), (1400, 2.75), (1500, 2.5)]


def test_mmengine_and_keras_epoch_logs():
    log = tl.parse(corpus("xtuner-mmengine-grad-norm-nan"))
    got = steps(log)
    assert list(got) == [200, 210, 220, 230, 240, 250]  # [epoch][i/n], not the date in front
    assert math.isnan(got[240].grad_norm) and got[240].loss == pytest.approx(2.5128)
    assert not log.restarts
    keras = steps(tl.parse(corpus("deepj-keras-epoch-loss-jump")))
    assert list(keras) == list(range(60, 68))
    assert keras[65].loss == pytest.approx(0.0612)


def test_nanogpt_eval_summary_is_not_a_step_and_quoted_lines_are_read():
    log = tl.parse(corpus("nanogpt-fp16-nan-after-checkpoint-quoted"))
    got = steps(log)
    assert got[3000].loss == pytest.approx(4.2490)  # the iteration's, not 'step 3000: train loss ...'
    assert math.isnan(got[3010].loss) and got[3010].nan
    assert not log.restarts


def test_a_nan_announced_without_a_step_is_the_step_after_the_last():
    text = ("INFO:tensorflow:loss = 11.2, step = 1\n"
            "ERROR:tensorflow:Model diverged with loss = NaN.\n"
            "E0606 09:34:26.659411 46912496659904 basic_session_run_hooks.py:760] Model diverged with loss = NaN.\n")
    log = tl.parse(text)
    assert [(r.step, r.source) for r in log.records] == [(1, "generic"), (2, "nan-message")]
    assert math.isnan(log.records[1].loss) and log.records[1].nan


def test_same_step_printed_again_is_one_step_not_a_restart():
    text = "step 10 loss 2.0\nstep 10 loss 2.1\nstep 20 loss 1.9\nstep 15 loss 2.2\n"
    log = tl.parse(text)
    assert [r.step for r in log.records] == [10, 20, 15]
    assert [(r.from_step, r.to_step) for r in log.restarts] == [(20, 15)]


def test_wrapped_trainer_dict_is_joined():
    text = "{'loss': 1.25, 'grad_norm': 0.5,\n 'learning_rate': 1e-05, 'epoch': 0.5}\n{'loss': 1.2}\n"
    log = tl.parse(text)
    assert [(r.step, r.loss, r.lr) for r in log.records] == [(1, 1.25, 1e-05), (2, 1.2, None)]


def test_following_a_log_releases_a_held_megatron_line_on_flush():
    reader = tl.LineReader()
    line = (" iteration       20/    1000 | lm loss: 1.2E+01 | loss scale: 32768.0 | "
            "number of skipped iterations:   0 | number of nan iterations:   0 |")
    assert reader.feed(line) == []
    released = reader.flush()
    assert [(r.step, r.loss) for r in released] == [(20, 12.0)]
    assert reader.flush() == []


# ------------------------------------------------------------------------------ job errors


@pytest.mark.parametrize("case, kind, where", [
    ("jade-node-uncorrectable-ecc", "ecc_uncorrectable", {}),
    ("semseg-cuda-runtime-error-39-ecc", "ecc_uncorrectable", {}),
    ("deepfacelab-tf-ecc-uncorrectable", "ecc_uncorrectable", {"device": 0}),
    ("torch-watchdog-ecc-multinode-rank-prefix", "ecc_uncorrectable", {"rank": 12, "local_rank": 0}),
    ("nccl-ib-port-error-flapping-link", "ib_port_error", {}),
])
def test_hardware_errors_the_job_printed(case, kind, where):
    result = job_errors.parse(corpus(case))
    event = result.of(kind)[0]
    for name, value in where.items():
        assert getattr(event, name) == value
    if not where:
        assert (event.rank, event.device, event.host) == (None, None, None)


def test_node_failure_and_echoed_xid_lines():
    text = ("srun: error: Node failure on jean-zay-iam37\n"
            "slurmstepd: error: *** JOB 1528763 ON jean-zay-iam01 CANCELLED AT 2022-05-01T03:56:11 DUE TO NODE FAILURE ***\n"
            "[rank3]: NVRM: Xid (PCI:0000:3b:00): 79, pid=1234, GPU has fallen off the bus.\n"
            "gpu-a:1234:1290 [5] NCCL WARN Cuda failure 'unspecified launch failure'\n")
    result = job_errors.parse(text)
    failures = result.of("node_failure")
    assert [e.host for e in failures] == ["jean-zay-iam37", "jean-zay-iam01"]
    assert [e.details["named"] for e in failures] == [True, False]
    (xid,) = result.of("xid")
    assert (xid.code, xid.pci, xid.rank) == (79, "0000:3b:00", 3)
    (launch,) = result.of("cuda_launch_failure")
    assert (launch.host, launch.device) == ("gpu-a", 5)


def test_job_errors_never_raise_on_junk():
    result = job_errors.parse("\x00\x01 ECC \ufffd\n" + "x" * 10000 + "\nGPU 999999999999 lost\n")
    assert isinstance(result.events, list)


# ------------------------------------------------------------------------------ NCCL, kernel


def test_nccl_lines_quoted_without_their_prefix_still_parse():
    log = nccl_log.parse(corpus("nccl-ib-port-error-flapping-link"))
    (event,) = log.events
    assert event.kind == "ib_port_error" and event.host is None
    log = nccl_log.parse("NCCL WARN NET/IB : Got completion from peer 10.0.0.5<1234> with error 12, "
                         "opcode 0, len 0, vendor err 129\n")
    (event,) = log.events
    assert event.kind == "ib_completion_error" and event.details["vendor_err"] == 129
    assert not log.gaps


def test_pcie_fatal_error_on_a_gpu_and_reltime_dmesg():
    log = kernel_log.parse(corpus("returnn-gpu-pcie-aer-fatal", "nodes/node-0/kernel.log"))
    assert {(lost.reason, lost.pci) for lost in log.gpu_lost} == {("pcie_fatal", "0000:03:00")}
    assert all(lost.time is None for lost in log.gpu_lost)
    assert kernel_log.detect(corpus("returnn-gpu-pcie-aer-fatal", "nodes/node-0/kernel.log")) >= 0.5


def test_bare_step_loss_table():
    log = tl.parse(corpus("yanmtt-bare-step-table-nan-reload"))
    got = steps(log)
    assert got[76970].loss == pytest.approx(2.6265104)
    assert math.isnan(got[76980].loss) and got[76980].nan and got[77010].nan
    assert all(record.source == "table" for record in log.records)


def test_a_slurm_out_whose_first_iteration_is_past_the_first_64_kib_is_a_training_log(tmp_path):
    from spikeops.reading import read_evidence

    init = [f"r7i4n1:3468:3905 [{i % 8}] NCCL INFO Channel {i % 32:02d}/32 :    0   1   2   3 via P2P/IPC"
            for i in range(1500)]
    steps_text = [f" iteration {it:8d}/    1000 | lm loss: {8 - it / 100:.6E} | loss scale: 16384.0 | "
                  "grad norm: 3.1 | number of skipped iterations:   0 | number of nan iterations:   0 |"
                  for it in range(10, 200, 10)]
    path = tmp_path / "slurm-1234.out"
    path.write_text("\n".join(init + steps_text) + "\n")
    assert len("\n".join(init)) > 64 * 1024
    reading = read_evidence(path)
    assert reading.kind.name == "training-log" and reading.detected
    assert [r.step for r in reading.result.records][:2] == [10, 20]


def test_steps_counted_within_their_epoch_become_a_global_count():
    # As the PyTorch tutorials, timm and the MNIST example print them.
    text = ("Epoch [1/5], Step [100/600], Loss: 0.2345\n"
            "Epoch [1/5], Step [200/600], Loss: 0.2000\n"
            "Epoch [2/5], Step [100/600], Loss: 0.1500\n"
            "Train Epoch: 3 [2560/60000 (4%)]\tLoss: 0.327\n"
            "Epoch: [4]  [ 100/1251]  eta: 0:10:00  lr: 0.000100  loss: 6.9123 (6.9500)  time: 0.3\n")
    log = tl.parse(text)
    assert [(r.step, r.loss) for r in log.records] == [
        (100, 0.2345), (200, 0.2), (700, 0.15), (122560, 0.327), (3853, 6.9123)]
    assert [(r.from_step, r.to_step) for r in log.restarts] == [(122560, 3853)]


def test_health_checks_and_misconfigurations_are_not_hardware_errors():
    text = ("Volatile uncorrectable ECC errors: 0\n"
            "DCGM health: uncorrectable ECC errors detected 0\n"
            "RuntimeError: No CUDA GPUs are available\n"
            "eth0: link is down\n"
            "the optimizer state needs to be reset after loading\n")
    assert job_errors.parse(text).events == []
    assert nccl_log.parse("eth0: link is down\n").events == []


def test_keras_epoch_bar_with_a_validation_loss_is_still_the_epochs_training_loss():
    text = ("Epoch 3/10\n10954/10954 [==============================] - 659s - loss: 0.0475 - val_loss: 0.0512\n"
            "Epoch 4/10\n10954/10954 [==============================] - 659s - loss: 0.0471 - val_loss: 0.0510\n")
    assert [(r.step, r.loss) for r in tl.parse(text).records] == [(3, 0.0475), (4, 0.0471)]
