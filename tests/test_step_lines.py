"""The generic step-line reader on real lines of each format (tests/fixtures/step-lines).

Each expectation is transcribed from the fixture's own text: the step counter, the loss and
the learning rate the line prints (NaN where it prints nan/inf). A parser change that reads
another number, or none, fails here.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from spikeops.probes import step_lines, training_log

FIXTURES = Path(__file__).parent / "fixtures" / "step-lines"
NAN = math.nan

#: file -> (steps read, (first step, loss, lr), (last step, loss, lr)).
EXPECTED = {
    "maskrcnn-benchmark.log": (4, (660, 0.7677, 0.02), (720, 0.9130, 0.02)),
    "maskrcnn-iteration-losses.log": (10, (1, 39.65670394897461, None), (10, NAN, None)),
    "mmdetection-mmcv.log": (3, (50, NAN, 0.01), (150, 1.1586, 0.01)),
    "detectron2.log": (7, (19, 1.750, 0.0002), (139, 1.700, 0.001399)),
    "darknet-v3-first-iteration.log": (1, (1, 2233.523438, 0.0), (1, 2233.523438, 0.0)),
    "darknet-avg-nan.log": (1, (2267, NAN, 0.001), (2267, NAN, 0.001)),
    "darknet-quoted.log": (2, (99, 469.803864, 0.0), (100, 443.011078, 0.0)),
    "tf-object-detection-v1.log": (8, (1, 79.3501, None), (8, 57.9715, None)),
    "tf-object-detection-v2.log": (3, (4100, NAN, None), (4300, NAN, None)),
    "tf-estimator.log": (5, (63717, 0.0033215743, None), (63721, 0.05728304, None)),
    "tf-faster-rcnn.log": (4, (20, NAN, 0.01), (80, NAN, 0.01)),
    "ctpn-iter.log": (1, (4800, NAN, 0.00001), (4800, NAN, 0.00001)),
    "keras-bar.log": (6, (1, 0.6917, None), (6, 0.6623, None)),
    "keras-epochs.log": (3, (1, 0.6242, None), (3, NAN, None)),
    "lightning-bar.log": (5, (1, 10.473, None), (5, 9.847, None)),
    "fairseq-train-inner.log": (5, (100, 16.348, 1e-06), (500, 12.839, 5e-06)),
    # | epoch 010  2000 / 8223: nine epochs of 8223 before it; epoch 011 3000 / 8223 last.
    "fairseq-legacy.log": (10, (9 * 8223 + 2000, 1.27, 0.001), (10 * 8223 + 3000, 0.75, 0.001)),
    "caffe-solver.log": (3, (180, 6.55607, None), (220, NAN, 0.01)),
    "train-iter-loss-scale.log": (3, (0, 0.9443, None), (200, NAN, None)),
    "dinov2-metric-logger.log": (3, (40, math.inf, 0.0), (60, math.inf, 0.0)),
    # Epoch: [127/300][ 35/464]: 126 epochs of 464 before it.
    "epoch-iter-bracket.log": (4, (126 * 464 + 35, 2.1274, None), (126 * 464 + 185, 1.5142, None)),
    "batch-count-iter.log": (5, (220, 0.103037, None), (300, 0.104935, None)),
    # 333 154..161, then 334 1..3: epoch 334 numbered on after epoch 333's last (161).
    "epoch-batch-pairs.log": (11, (154, NAN, None), (161 + 3, NAN, None)),
    "global-step-slash.log": (1, (29003, NAN, 0.001), (29003, NAN, 0.001)),
    "rendered-cur-lr.log": (2, (1000, 2.31, 0.001), (1100, 2.27, 0.00095)),
}


def _same(got: float | None, want: float | None) -> bool:
    if want is None or got is None:
        return got is want
    if math.isnan(want):
        return math.isnan(got)
    return got == pytest.approx(want, rel=1e-9)


def _read(name: str) -> list[training_log.StepRecord]:
    log = training_log.parse((FIXTURES / name).read_text(encoding="utf-8").splitlines())
    return training_log.latest_per_step(log.records)


def test_every_fixture_has_a_source_and_an_expectation() -> None:
    sources = (FIXTURES / "SOURCES.md").read_text(encoding="utf-8")
    files = sorted(path.name for path in FIXTURES.glob("*.log"))
    assert files == sorted(EXPECTED)
    for name in files:
        assert f"`{name}`" in sources, f"{name} has no source in SOURCES.md"


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_fixture_steps_losses_and_lr(name: str) -> None:
    count, first, last = EXPECTED[name]
    records = _read(name)
    assert len(records) == count
    for record, (step, loss, lr) in ((records[0], first), (records[-1], last)):
        assert record.step == step
        assert _same(record.loss, loss), (record.step, record.loss, loss)
        assert _same(record.lr, lr), (record.step, record.lr, lr)


def test_warmup_lr_is_read_on_every_detectron2_step() -> None:
    """The LR column is what the warm-up rule judges: every step must carry it."""
    lrs = [record.lr for record in _read("detectron2.log")]
    assert lrs == sorted(lrs) and all(lr is not None for lr in lrs)


def test_darknet_reads_the_iteration_loss_not_the_running_average() -> None:
    record = _read("darknet-quoted.log")[0]
    assert record.loss == pytest.approx(469.803864)  # the average printed after it is 848.945251
    assert record.source == "darknet"


def test_fairseq_epoch_summary_and_validation_lines_are_not_steps() -> None:
    steps = [record.step for record in _read("fairseq-legacy.log")]
    assert 906 not in steps  # "words/batch 906" in the epoch summary is not a step counter
    assert all(step > 9 * 8223 for step in steps)


def test_fairseq_train_inner_carries_grad_norm_and_loss_scale() -> None:
    record = _read("fairseq-train-inner.log")[0]
    assert (record.grad_norm, record.loss_scale) == (pytest.approx(4.215), 128.0)


@pytest.mark.parametrize("line, want", [
    (" >>> lr: 0.010000", step_lines.LrLine(0.01, None)),
    ("I0425 10:13:04.672341  9167 solver.cpp:208] Iteration 200, lr = 0.01", step_lines.LrLine(0.01, 200)),
    ("Step: 1000/300000 ----- Cur_lr: 0.0010000 ----- Time: 0.53 sec.", step_lines.LrLine(0.001, 1000, header=True)),
    ("Cur_lr: 0.4", step_lines.LrLine(0.4, None)),
])
def test_lr_announcements(line: str, want: step_lines.LrLine) -> None:
    assert step_lines.read_lr_line(line) == want


@pytest.mark.parametrize("line", [
    "  lr: 0.001",  # a YAML configuration dump
    "Namespace(adam_betas='(0.9, 0.997)', clip_norm=25, lr=[0.0005], lr_scheduler='inverse_sqrt')",
    "  lr .............................................. 0.0001",  # Megatron's argument dump
    "iter: 20 / 70000, total loss: nan",  # a step line, not an announcement
    "min_lr: 1e-05",
])
def test_configuration_lines_are_not_lr_announcements(line: str) -> None:
    assert step_lines.read_lr_line(line) is None


def test_a_config_dump_lr_does_not_become_every_steps_lr() -> None:
    text = ["  lr: 0.001", "iter: 20 / 70000, total loss: 2.5", "iter: 40 / 70000, total loss: 2.4"]
    records = training_log.latest_per_step(training_log.parse(text).records)
    assert [record.lr for record in records] == [None, None]


def test_other_groups_rates_are_not_the_lr() -> None:
    found = step_lines.read_line("iter: 5 loss: 2.0 last_layer_lr: 0.5 aux_lr: 0.3")
    assert found is not None and found.lr is None


def test_epoch_counter_numbers_on_and_restarts() -> None:
    counter = step_lines.EpochCounter()
    assert [counter.step(1, i) for i in (1, 2, 3)] == [1, 2, 3]
    assert [counter.step(2, i) for i in (1, 2)] == [4, 5]
    assert counter.step(1, 2) == 2  # back to an earlier epoch: a resume, counted as before
