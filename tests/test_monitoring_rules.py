"""The shipped monitoring configuration, proven by Prometheus's and Alertmanager's own tools.

- ``promtool check rules`` and ``amtool check-config`` on the files in ``infra/monitoring/``;
- ``promtool test rules`` (the real rule engine) on runs generated with ``tests/watch_curves``
  (warmup, LR decay, 0.5-3 % noise, an fp16 scale that searches down from 2^32, checkpoint and
  eval dips, steps of 1 to 20 s), scraped as Prometheus would every 15 s (the usual setting) and
  every 1 s (the fastest sensible one): healthy runs never fire anything over hours, and a NaN,
  an infinite loss, a NaN between two scrapes, a spike, a loss-scale collapse, a throughput
  drop and a stall (a hung job: its exporter still answers, its step stands still) each fire
  their alert, with the labels the receiver maps, within a bounded delay.

"Never fires" is checked exhaustively, not at sampled times: the rule engine writes every
evaluation to the ``ALERTS`` series, and ``count_over_time(ALERTS{alertstate="firing"}[...])``
over the whole run must be empty.
"""

from __future__ import annotations

import json
import math
import shutil
import subprocess
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest

from tests.conftest import ROOT
from tests.watch_curves import Curve, healthy

MONITORING = ROOT / "infra" / "monitoring"
RULES = MONITORING / "prometheus-rules.yml"
TOKENS = 4_194_304  # tokens per step in watch_curves


def _tool(name: str) -> str:
    found = shutil.which(name)
    if found is None:  # `make test` installs them (APT_PACKAGES); say how, never skip silently
        pytest.fail(f"{name} not found: run `make apt` (or infra/apt-ensure.sh prometheus prometheus-alertmanager)")
    return found


def _run(argv: list[str], cwd: Path | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(argv, capture_output=True, text=True, timeout=600, cwd=cwd)


# ---------------------------------------------------------------------------- static checks


def test_promtool_checks_the_rules() -> None:
    result = _run([_tool("promtool"), "check", "rules", str(RULES)])
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS: 9 rules found" in result.stdout


@pytest.mark.parametrize("name", ["alertmanager.yml", "alertmanager-local.yml"])
def test_amtool_checks_the_alertmanager_configs(name: str) -> None:
    result = _run([_tool("amtool"), "check-config", str(MONITORING / name)])
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS" in result.stdout


def test_the_checks_catch_a_broken_file(tmp_path: Path) -> None:
    """The tools above would catch a mistake: a rule that does not parse, a route to a
    receiver that does not exist."""
    bad_rules = tmp_path / "rules.yml"
    bad_rules.write_text(RULES.read_text().replace("training_loss != training_loss", "training_loss !=! x", 1))
    assert _run([_tool("promtool"), "check", "rules", str(bad_rules)]).returncode != 0
    bad_am = tmp_path / "am.yml"
    bad_am.write_text((MONITORING / "alertmanager-local.yml").read_text().replace(
        "receiver: spikeops", "receiver: nobody", 1))
    assert _run([_tool("amtool"), "check-config", str(bad_am)]).returncode != 0


# ---------------------------------------------------------------------------- scraped runs


@dataclass
class Job:
    """A run as Prometheus scrapes it: its curve, where its clock starts, its labels."""

    job_id: str
    curve: Curve
    start: float = 0.0
    labels: dict[str, str] = field(default_factory=dict)
    #: A hung job: its last step is the curve's last, but its exporter answers until then
    #: (seconds of the job's own clock); None: the target goes when the last step is done.
    alive_until: float | None = None

    def series(self, interval: float, duration: float) -> list[dict[str, str]]:
        """promtool input_series: each metric sampled at every scrape; ``_`` before the job's
        first step, ``stale`` once after its last (the target is gone), then ``_``."""
        times = np.arange(0.0, duration + interval / 2, interval) - self.start
        index = np.searchsorted(self.curve.seconds, times, side="right") - 1
        ended = times > (self.alive_until if self.alive_until is not None else self.curve.seconds[-1] + interval)
        nonfinite = np.cumsum(~np.isfinite(self.curve.loss))
        # the exporter's stall gauges: when each step was logged (on Prometheus's clock), the
        # seconds per step and between records since the previous one (every step is a record)
        logged = self.curve.seconds + self.start
        gaps = np.diff(self.curve.seconds, prepend=self.curve.seconds[0] - (self.curve.seconds[1] - self.curve.seconds[0]))
        fields = {"training_step": self.curve.step.astype(float), "training_loss": self.curve.loss,
                  "training_lr": self.curve.lr, "training_grad_norm": self.curve.grad_norm,
                  "training_tokens_per_second": self.curve.throughput,
                  "training_nonfinite_loss_total": nonfinite.astype(float),
                  "training_last_step_timestamp_seconds": logged, "training_step_seconds": gaps,
                  "training_record_interval_seconds": gaps}
        if self.curve.loss_scale is not None:
            fields["training_loss_scale"] = self.curve.loss_scale
        labels = {"job_id": self.job_id, "cluster": "sim", "instance": "gpu-001:9464",
                  "job": "training", **self.labels}
        selector = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
        out = []
        for name, values in fields.items():
            words, stale = [], False
            for i, over in zip(index, ended, strict=True):
                if over:
                    words.append("_" if stale else "stale")
                    stale = True
                elif i < 0:
                    words.append("_")
                else:
                    words.append(_number(float(values[i])))
            out.append({"series": f"{name}{{{selector}}}", "values": " ".join(words)})
        return out


def _number(value: float) -> str:
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return "Inf" if value > 0 else "-Inf"
    return repr(value)


def _long_enough(seed: int, seconds: float, **kwargs) -> Curve:
    """A healthy curve that runs at least ``seconds`` (its steps take 1 to 20 s)."""
    n = 6000
    curve = healthy(seed, n, **kwargs)
    if curve.seconds[-1] < seconds:
        n = min(60_000, int(n * seconds / curve.seconds[-1]) + 50)
        curve = healthy(seed, n, **kwargs)
    return curve


def _retime(curve: Curve) -> None:
    """A step takes its tokens over its throughput: a slower step takes longer."""
    curve.seconds = np.cumsum(TOKENS / curve.throughput)


def _at(curve: Curve, seconds: float) -> int:
    return int(np.searchsorted(curve.seconds, seconds))


def _promtool_test(tmp_path: Path, name: str, interval: float, jobs: list[Job], duration: float,
                   checks: list[dict]) -> None:
    document = {
        "rule_files": [str(RULES)],
        "evaluation_interval": f"{interval:g}s",
        "tests": [{"name": name, "interval": f"{interval:g}s",
                   "input_series": [s for job in jobs for s in job.series(interval, duration)],
                   "promql_expr_test": checks}],
    }
    path = tmp_path / f"{name}.json"  # JSON is YAML: promtool reads it
    path.write_text(json.dumps(document))
    result = _run([_tool("promtool"), "test", "rules", str(path)])
    assert result.returncode == 0, f"{name}:\n{result.stdout[-6000:]}{result.stderr[-2000:]}"


def _never_fires(duration: float) -> dict:
    return {"expr": f'count_over_time(ALERTS{{alertstate="firing"}}[{int(duration) + 1}s])',
            "eval_time": f"{int(duration)}s", "exp_samples": []}


#: (scrape and evaluation interval, how long the runs are watched). promtool evaluates every
#: rule at every interval, so the 1 s setting watches a shorter stretch (its 30-minute
#: quantile windows hold 1,800 samples each).
SETTINGS = [pytest.param(15.0, 4 * 3600.0, id="15s"), pytest.param(1.0, 1800.0, id="1s")]


@pytest.mark.parametrize(("interval", "duration"), SETTINGS)
def test_healthy_runs_never_fire(tmp_path: Path, interval: float, duration: float) -> None:
    """Warmup (a falling loss, a ramping LR, slow first steps, the fp16 scale searching down
    from 2^32), decay, noise, checkpoint and eval dips, bf16 runs without a scale, a job that
    starts half-way through (no history), a job that ends (its series go stale)."""
    seeds = range(8) if interval >= 15 else range(4)
    jobs = [Job(f"h{seed}", _long_enough(seed, duration, fp16=seed % 3 != 0,
                                         schedule="cosine" if seed % 2 else "linear"))
            for seed in seeds]
    jobs.append(Job("late", _long_enough(21, duration), start=duration / 3))
    short = healthy(22, 300)
    jobs.append(Job("ended", short))
    assert short.seconds[-1] < duration - 60  # it does end inside the window
    _promtool_test(tmp_path, f"healthy-{interval:g}s", interval, jobs, duration, [_never_fires(duration)])


@dataclass
class Anomaly:
    alert: str
    #: seconds from the anomalous step's record to the alert firing, at the latest: the scrape
    #: that sees it, the evaluation, the rule's `for`, plus one interval of slack
    budget: float
    #: how long the job has run when the watched stretch begins (the anomaly comes at 60 % of
    #: it): 0 puts a 1 s-setting anomaly at minute 18 of a run, still in the loss's steep descent
    age: float = 0.0


def _anomalies(interval: float) -> dict[str, tuple[Anomaly, Callable]]:
    return {
        "nan": (Anomaly("TrainingLossNaN", 3 * interval), _nan),
        "inf": (Anomaly("TrainingLossNaN", 3 * interval), _inf),
        "nan_between_scrapes": (Anomaly("TrainingLossNaN", 3 * interval), _one_nan),
        "spike": (Anomaly("TrainingLossSpike", 45 + 3 * interval), _spike(1.5)),
        # a 25 % jump an hour or more into the run; in the steep descent of the first half hour
        # the 5-minute window's own trend hides it at a 1 s scrape (docs/monitoring.md)
        "small_spike": (Anomaly("TrainingLossSpike", 45 + 3 * interval, age=3600), _spike(1.25)),
        "scale_collapse": (Anomaly("TrainingLossScaleCollapse", 3 * interval + 60), _collapse),
        "throughput_drop": (Anomaly("TrainingThroughputDrop", 300 + 3 * interval), _drop),
    }


def _nan(curve: Curve, k: int) -> None:
    curve.loss[k:] = np.nan
    curve.grad_norm[k:] = np.nan


def _inf(curve: Curve, k: int) -> None:
    curve.loss[k:] = np.inf


def _one_nan(curve: Curve, k: int) -> None:
    """One NaN step, as short as a step gets, then finite again: the last-step gauge may never
    show it; the counter does."""
    curve.loss[k] = np.nan
    curve.throughput[k] = TOKENS / 0.2
    _retime(curve)


def _spike(factor: float) -> Callable:
    def spike(curve: Curve, k: int) -> None:
        """The loss jumps by ``factor`` and stays up for ten minutes, then recovers."""
        end = _at(curve, curve.seconds[k] + 600)
        curve.loss[k:end] *= factor

    return spike


def _collapse(curve: Curve, k: int) -> None:
    """Overflow after overflow: the scale halves on each of 12 steps and stays down."""
    for i in range(12):
        curve.loss_scale[k + i:] /= 2
        curve.grad_norm[k + i] = np.inf


def _drop(curve: Curve, k: int) -> None:
    """A slow node: 45 % of the throughput from here on."""
    curve.throughput[k:] *= 0.45
    _retime(curve)


@pytest.mark.parametrize(("interval", "duration"), SETTINGS)
def test_a_hung_job_fires_stalled_and_a_long_pause_does_not(tmp_path: Path, interval: float, duration: float) -> None:
    """A job that stops stepping with its exporter alive fires TrainingStalled once 10 step
    times (at least 5 minutes) and a record interval have passed, not before; another job
    whose steps pause for 4 minutes (a checkpoint save) and go on never fires it."""
    onset = duration * 0.6
    curve = _long_enough(5, duration + 1800)
    k = _at(curve, onset)
    step_s = float(np.median(np.diff(curve.seconds[max(1, k - 300):k + 1])))
    threshold = max(10 * step_s, 300.0) + step_s
    hung = Curve(**{name: (value[:k + 1] if isinstance(value, np.ndarray) else value)
                    for name, value in vars(curve).items()})
    last = float(hung.seconds[-1])
    pause = healthy(7, 6000)
    j = _at(pause, onset)
    pause.seconds[j:] += 240.0  # four minutes between two steps, then on as before
    jobs = [Job("hung", hung, alive_until=duration + 60), Job("pause", pause)]
    before = int((last + threshold - 2 * interval) // interval) * interval
    after = int(math.ceil((last + threshold + 3 * interval) / interval)) * interval
    labels = ('{alertname="TrainingStalled", alertstate="firing", cluster="sim", instance="gpu-001:9464", '
              'job="training", job_id="hung", severity="page", stall_factor="10", stall_min_s="300"}')
    checks = [
        {"expr": f'count_over_time(ALERTS{{alertstate="firing"}}[{int(before)}s])', "eval_time": f"{int(before)}s",
         "exp_samples": []},
        {"expr": f'max_over_time(ALERTS{{alertstate="firing", alertname="TrainingStalled"}}[{int(interval)}s])',
         "eval_time": f"{int(after)}s",
         "exp_samples": [{"labels": labels, "value": 1}]},
        {"expr": f'count_over_time(ALERTS{{alertstate="firing", job_id="pause"}}[{int(after)}s])',
         "eval_time": f"{int(after)}s", "exp_samples": []},
    ]
    assert pause.seconds[-1] > after  # the paused job is still running when the check is made
    _promtool_test(tmp_path, f"stall-{interval:g}s", interval, jobs, after + interval, checks)


@pytest.mark.parametrize(("interval", "duration"), SETTINGS)
@pytest.mark.parametrize("kind", ["nan", "inf", "nan_between_scrapes", "spike", "small_spike", "scale_collapse",
                                  "throughput_drop"])
def test_each_anomaly_fires_its_alert(tmp_path: Path, kind: str, interval: float, duration: float) -> None:
    """Nothing fires before the anomaly; its alert fires within the budget after it, with the
    labels the receiver maps (job_id, cluster) and the severity Alertmanager routes on."""
    anomaly, inject = _anomalies(interval)[kind]
    onset = duration * 0.6
    curve = _long_enough(5, anomaly.age + duration + 1800)
    k = _at(curve, anomaly.age + onset)
    inject(curve, k)
    logged = float(curve.seconds[k]) - anomaly.age  # the anomalous step's record exists once the step ends
    before = int((float(curve.seconds[k - 1]) - anomaly.age) // interval) * interval  # the last evaluation before it
    after = int(math.ceil((logged + anomaly.budget) / interval)) * interval
    severity = "warning" if anomaly.alert == "TrainingThroughputDrop" else "page"
    labels = (f'{{alertname="{anomaly.alert}", alertstate="firing", cluster="sim", instance="gpu-001:9464", '
              f'job="training", job_id="a{kind[:2]}", severity="{severity}"}}')
    job = Job(f"a{kind[:2]}", curve, start=-anomaly.age)
    checks = [
        {"expr": f'count_over_time(ALERTS{{alertstate="firing"}}[{int(before)}s])', "eval_time": f"{int(before)}s",
         "exp_samples": []},
        {"expr": f'max_over_time(ALERTS{{alertstate="firing", alertname="{anomaly.alert}"}}'
                 f'[{int(after - before)}s])',
         "eval_time": f"{int(after)}s", "exp_samples": [{"labels": labels, "value": 1}]},
    ]
    _promtool_test(tmp_path, f"{kind}-{interval:g}s", interval, [job], after + interval, checks)


# ---------------------------------------------------------------------------- a run's own texture


def _jump(curve: Curve, seconds: float, factor: float, lasting: float) -> None:
    """The loss jumps by ``factor`` at ``seconds`` into the run and stays there ``lasting``."""
    begin = _at(curve, seconds)
    end = _at(curve, seconds + lasting)
    curve.loss[begin:max(end, begin + 1)] *= factor


def test_jumps_the_run_makes_routinely_do_not_fire_but_one_that_stays_does(tmp_path: Path) -> None:
    """A run that jumps 40 % above its level for a minute and a half every twenty minutes, as a
    healthy run logged every step does on hard batches: the first such jump may page (nothing
    like it before), the ones after it do not; the same jump held for fifteen minutes pages."""
    interval = 15.0
    curve = _long_enough(11, 4 * 3600.0)
    for minute in (40, 60, 80, 100, 120):
        _jump(curve, minute * 60.0, 1.4, 90.0)
    held = 140 * 60.0
    _jump(curve, held, 1.4, 900.0)
    quiet_from, quiet_to = 50 * 60, int(held // interval) * interval
    fired_by = int(math.ceil((held + 300 + 45 + 3 * interval) / interval)) * interval
    checks = [
        {"expr": f'count_over_time(ALERTS{{alertstate="firing"}}[{int(quiet_to - quiet_from)}s])',
         "eval_time": f"{int(quiet_to)}s", "exp_samples": []},
        {"expr": f'max_over_time(ALERTS{{alertstate="firing", alertname="TrainingLossSpike"}}'
                 f'[{int(fired_by - quiet_to)}s])', "eval_time": f"{int(fired_by)}s",
         "exp_samples": [{"labels": '{alertname="TrainingLossSpike", alertstate="firing", cluster="sim", '
                                    'instance="gpu-001:9464", job="training", job_id="texture", severity="page"}',
                          "value": 1}]},
    ]
    _promtool_test(tmp_path, "texture-15s", interval, [Job("texture", curve)], fired_by + interval, checks)


def test_an_order_of_magnitude_fires_with_a_short_history(tmp_path: Path) -> None:
    """An exporter (re)started a minute and a half ago: too little history for the robust test,
    but a loss twenty times its level is an incident at once (it stays over ten times its
    5-minute median for the rule's 45 s while that median catches up)."""
    interval = 15.0
    curve = healthy(12, 400)
    jump_at = 90.0
    _jump(curve, jump_at, 20.0, 600.0)
    fired_by = int(math.ceil((jump_at + 45 + 3 * interval) / interval)) * interval
    checks = [{"expr": f'max_over_time(ALERTS{{alertstate="firing", alertname="TrainingLossSpike"}}[{int(fired_by)}s])',
               "eval_time": f"{int(fired_by)}s",
               "exp_samples": [{"labels": '{alertname="TrainingLossSpike", alertstate="firing", cluster="sim", '
                                          'instance="gpu-001:9464", job="training", job_id="late", severity="page"}',
                                "value": 1}]}]
    _promtool_test(tmp_path, "magnitude-15s", interval, [Job("late", curve)], fired_by + interval, checks)
