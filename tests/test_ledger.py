"""The ledger on SQLite: its URL, its migrations, entries, lineages, the restart budget under
two processes at once, lost time, the import from bundles, the spool, and the command line's
JSON shapes (shared/spec/ledger.md). PostgreSQL: tests/test_ledger_postgres.py."""

from __future__ import annotations

import io
import json
import multiprocessing
import shutil
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest

from spikeops.cli import main as cli
from spikeops.history import history_document, parse_history
from spikeops.ledger import LedgerError, default_url, ledger_url, mask_url
from spikeops.ledger.entry import entry_from_bundle
from spikeops.ledger.lost import lost_time, step_seconds
from spikeops.ledger.spool import pending, replay, spool_entry
from spikeops.ledger.store import HEAD, Ledger, stamp
from spikeops.ledger.summary import summarize, views
from spikeops.schedulers import ActionLog, ActionResult
from spikeops.sim import build_bundle

INCIDENT_KEYS = {"incident_id", "cluster", "job_id", "lineage", "opened", "symptom", "cause", "culprit_nodes",
                 "recurrence_of", "resumed_as", "resumed_from", "auto_resumes_in_window", "held_for_person", "times",
                 "lost"}
TIME_KEYS = {"spike", "alert", "stopped", "diagnosed", "approved", "resumed_running"}
LOST_KEYS = {"steps_rolled_back", "step_seconds", "gpus", "downtime_s", "gpu_hours"}


class _Out(io.StringIO):
    def isatty(self) -> bool:
        return False


def _cli(*argv: str) -> tuple[int, str, str]:
    out, err = _Out(), _Out()
    code = cli(list(argv), out=out, err=err)
    return code, out.getvalue(), err.getvalue()


@pytest.fixture
def url(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    value = f"sqlite:///{tmp_path / 'ledger.db'}"
    monkeypatch.setenv("SPIKEOPS_LEDGER_URL", value)
    monkeypatch.delenv("SPIKEOPS_CONFIG", raising=False)
    monkeypatch.chdir(tmp_path)
    return value


# ---------------------------------------------------------------------------- where it is


def test_the_url_comes_from_the_config_then_the_environment_then_xdg_state_home(tmp_path: Path) -> None:
    env = {"XDG_STATE_HOME": str(tmp_path / "state")}
    assert default_url(env) == f"sqlite:///{tmp_path}/state/spikeops/ledger.db"
    assert ledger_url(None, env) == default_url(env)
    assert ledger_url(None, {**env, "SPIKEOPS_LEDGER_URL": "sqlite:////x/y.db"}) == "sqlite:////x/y.db"
    assert ledger_url("postgresql://a@h/db", {**env, "SPIKEOPS_LEDGER_URL": "sqlite:////x/y.db"}) \
        == "postgresql+psycopg://a@h/db"
    assert default_url({"HOME": "/home/u"}).endswith("/.local/state/spikeops/ledger.db")
    with pytest.raises(LedgerError, match="only SQLite and PostgreSQL"):
        ledger_url("mysql://u:pw@h/db", {})
    with pytest.raises(LedgerError) as caught:
        ledger_url("mysql://u:topsecret@h/db", {})
    assert "topsecret" not in str(caught.value)


def test_a_password_is_masked_wherever_it_is() -> None:
    assert mask_url("postgresql://u:s3cr%40t@h:5/db") == "postgresql://u:***@h:5/db"
    assert mask_url("postgresql://h/db?user=u&password=s3cret&sslmode=x") == "postgresql://h/db?user=u&password=***&sslmode=x"
    assert mask_url("sqlite:////var/lib/x.db") == "sqlite:////var/lib/x.db"


def test_a_config_file_names_the_ledger_and_a_bad_url_is_one_line(tmp_path: Path) -> None:
    from spikeops.config import load_config
    from spikeops.errors import InputError

    path = tmp_path / "spikeops.toml"
    path.write_text('[ledger]\nurl = "sqlite:////tmp/somewhere.db"\n')
    assert load_config(path).ledger_url == "sqlite:////tmp/somewhere.db"
    path.write_text('[ledger]\nurl = "not a url"\n')
    with pytest.raises(InputError, match=r"\[ledger\] url"):
        load_config(path)
    path.write_text('[ledger]\nuri = "sqlite:///x"\n')
    with pytest.raises(InputError, match="unknown key 'uri'"):
        load_config(path)


def test_restart_budget_keys_are_checked(tmp_path: Path) -> None:
    from spikeops.config import load_config, parse_duration
    from spikeops.errors import InputError

    base = f'[clusters.sim]\ninventory = "{tmp_path}/i.toml"\nrun_dir = "/r/{{job}}"\n'
    path = tmp_path / "spikeops.toml"
    path.write_text(base + 'max_auto_resumes = 3\nrecurrence_window = "90m"\noncall = "<@U01>"\n')
    config = load_config(path)
    params = config.flow_parameters("4412", "sim")
    assert params["max_auto_resumes"] == 3 and params["recurrence_window_s"] == 5400 and params["oncall"] == "<@U01>"
    assert load_config(path).flow_parameters("4413", "sim", lineage="4412")["run_dir"] == "/r/4413"
    path.write_text(base.replace("{job}", "{lineage}"))
    assert load_config(path).flow_parameters("4413", "sim", lineage="4412")["run_dir"] == "/r/4412"
    assert load_config(path).flow_parameters("4413", "sim")["run_dir"] == "/r/4413"  # its own lineage
    assert load_config(path).flow_parameters("4413", "sim")["max_auto_resumes"] == 2  # the default
    for bad, key in (('recurrence_window = "a day"', "recurrence_window"), ("max_auto_resumes = -1", "max_auto_resumes"),
                     ('oncall = "a\\nb"', "oncall")):
        path.write_text(base + bad + "\n")
        with pytest.raises(InputError, match=key):
            load_config(path)
    assert parse_duration("24h") == 86400 and parse_duration(60) == 60
    with pytest.raises(ValueError):
        parse_duration("0h")


# ---------------------------------------------------------------------------- schema


def test_the_migrations_create_exactly_the_schema(url: str) -> None:
    from alembic.autogenerate import compare_metadata
    from alembic.migration import MigrationContext

    from spikeops.ledger import schema

    with Ledger(url) as ledger:
        assert ledger.revision() == HEAD
        with ledger.engine.connect() as conn:
            differences = compare_metadata(MigrationContext.configure(conn), schema.metadata)
        assert differences == [], differences
        assert ledger.counts() == dict.fromkeys(("incidents", "jobs", "lineages", "resumes", "node_events"), 0)
    code, out, err = _cli("ledger", "upgrade")
    assert code == 0 and f"schema {HEAD}" in out, err


def test_an_unreachable_or_unwritable_ledger_is_one_line_without_its_password(tmp_path: Path) -> None:
    with pytest.raises(LedgerError) as caught:
        Ledger("postgresql://spikeops:pa55word@127.0.0.1:9/spikeops")
    text = str(caught.value)
    assert "pa55word" not in text and "***" in text and "\n" not in text
    (tmp_path / "file").write_text("")
    with pytest.raises(LedgerError, match="cannot open"):
        Ledger(f"sqlite:///{tmp_path / 'file' / 'ledger.db'}")


# ---------------------------------------------------------------------------- entries


def _entry(incident: str, job: str, lineage: str, *, opened: str, cluster: str = "c", cause: str = "gpu_xid",
           resumed_as: str | None = None, checkpoint: tuple[int, str] | None = None, spike: int = 1200,
           excluded: tuple[str, ...] = (), auto: bool = True, culprits: tuple[str, ...] = ()) -> dict[str, Any]:
    row = {"incident_id": incident, "cluster": cluster, "job_id": job, "lineage": lineage, "opened": opened,
           "symptom": "instant_nan", "cause": cause, "spike_step": spike, "onset_step": spike,
           "culprit_nodes": list(culprits), "t_alert": opened, "gpus": 16}
    entry: dict[str, Any] = {"incident": row, "jobs": [{"cluster": cluster, "job_id": job, "lineage": lineage}],
                             "resume": None, "node_events": []}
    if resumed_as:
        plan = {"excluded": list(excluded), "env": {}}
        row.update(resumed_as=resumed_as, resumed_from={"step": checkpoint[0], "path": checkpoint[1]}, plan=plan,
                   auto_resumed=auto)
        entry["resume"] = {"incident_id": incident, "cluster": cluster, "lineage": lineage, "job_id": job,
                           "new_job": resumed_as, "time": opened, "auto": auto, "status": "done",
                           "checkpoint_step": checkpoint[0], "checkpoint_path": checkpoint[1], "plan": plan}
        entry["jobs"].append({"cluster": cluster, "job_id": resumed_as, "lineage": lineage, "parent_job": job,
                              "incident_id": incident, "checkpoint_step": checkpoint[0],
                              "checkpoint_path": checkpoint[1], "plan": plan, "checkpoint_root": "/ckpt/1",
                              "run_dir": "/runs/1"})
    return entry


def test_a_lineage_is_its_jobs_incidents_in_history_json_shape(url: str) -> None:
    with Ledger(url) as ledger:
        assert ledger.apply(_entry("inc-1", "1", "1", opened="2026-11-29T18:00:00Z", resumed_as="2",
                                   checkpoint=(1000, "/ckpt/1/step-1000"), excluded=("gpu-2",), culprits=("gpu-2",)))
        assert ledger.apply(_entry("inc-2", "2", "1", opened="2026-11-29T19:00:00Z", cause="poisoned_checkpoint"))
        assert not ledger.apply(_entry("inc-2", "2", "1", opened="2026-11-29T19:00:00Z",
                                       cause="poisoned_checkpoint"))  # idempotent
        ledger.apply(_entry("inc-x", "9", "9", opened="2026-11-29T19:30:00Z"))  # another lineage
        child = ledger.job("c", "2")
        assert child["lineage"] == "1" and child["parent_job"] == "1" and child["checkpoint_root"] == "/ckpt/1"
        rows = ledger.lineage_incidents("c", "1", exclude="inc-2")
        assert ledger.lineage_count("c", "1") == 2 and ledger.incident("inc-2")["cause"] == "poisoned_checkpoint"
    history = history_document(rows)
    assert history == [{"incident_id": "inc-1", "job_id": "1", "opened": "2026-11-29T18:00:00Z",
                        "symptom": "instant_nan", "spike_step": 1200, "onset_step": 1200, "cause": "gpu_xid",
                        "culprit_nodes": ["gpu-2"], "resumed_as": "2",
                        "resumed_from": {"step": 1000, "path": "/ckpt/1/step-1000"},
                        "plan": {"excluded": ["gpu-2"], "env": {}, "skipped": {"steps": [], "ranks": []}}}]
    parsed, gaps = parse_history(json.dumps(history))
    assert gaps == [] and parsed[0].resumed_as == "2" and parsed[0].plan.excluded == ("gpu-2",)


def test_an_entry_never_erases_what_the_ledger_knows(url: str) -> None:
    with Ledger(url) as ledger:
        ledger.apply(_entry("inc-1", "1", "1", opened="2026-11-29T18:00:00Z", resumed_as="2", checkpoint=(5, "/c/5")))
        ledger.apply({"incident": {"incident_id": "inc-1", "cluster": "c", "job_id": "1", "lineage": "1",
                                   "opened": "2026-11-29T18:00:00Z", "cause": None, "outcome": "resumed"}})
        row = ledger.incident("inc-1")
    assert row["cause"] == "gpu_xid" and row["resumed_as"] == "2" and row["outcome"] == "resumed"


def test_the_restart_budget_counts_automatic_resumes_in_the_window(url: str) -> None:
    now = datetime(2026, 11, 30, 12, tzinfo=UTC)
    with Ledger(url) as ledger:
        ask = dict(cluster="c", lineage="L", job_id="1", limit=2, window_s=86400, now=now)
        old = ledger.reserve_resume(incident_id="old", **{**ask, "now": now - timedelta(days=2)})
        assert old.granted
        first = ledger.reserve_resume(incident_id="i1", **ask)
        assert first.granted and first.used == 1  # two days ago is outside the window
        assert ledger.reserve_resume(incident_id="i2", **ask).granted
        third = ledger.reserve_resume(incident_id="i3", **ask)
        assert not third.granted and third.used == 2 and [s["incident_id"] for s in third.spent] == ["i1", "i2"]
        assert ledger.reserve_resume(incident_id="i2", **ask).granted  # a rerun finds its own
        # an incident that did not resume gives its reservation back
        ledger.apply({"incident": {"incident_id": "i2", "cluster": "c", "job_id": "1", "lineage": "L"},
                      "resume": {"incident_id": "i2", "cluster": "c", "lineage": "L", "job_id": "1",
                                 "time": stamp(now), "auto": True, "status": "not-resumed"}})
        assert ledger.reserve_resume(incident_id="i3", **ask).granted
        # two incidents of one job that made one resume (the second found it done) spend one
        for incident in ("i4", "i5"):
            ledger.apply({"incident": {"incident_id": incident, "cluster": "c", "job_id": "7", "lineage": "M"},
                          "resume": {"incident_id": incident, "cluster": "c", "lineage": "M", "job_id": "7",
                                     "new_job": "8", "time": stamp(now), "auto": True, "status": "done"}})
        assert ledger.budget(cluster="c", lineage="M", limit=2, window_s=86400, now=now).used == 1


def _writer(url: str, name: str, count: int, results: Any) -> None:
    """One worker: ``count`` incidents of lineage L, each also asking for an automatic resume."""
    with Ledger(url) as ledger:
        granted = 0
        for index in range(count):
            ledger.apply(_entry(f"inc-{name}-{index}", f"{name}{index}", "L",
                                opened=stamp(datetime.now(UTC)), cluster="c"))
            budget = ledger.reserve_resume(cluster="c", lineage="L", incident_id=f"inc-{name}-{index}",
                                           job_id=f"{name}{index}", limit=5, window_s=3600)
            granted += int(budget.granted)
    results.put(granted)


def test_two_processes_writing_one_lineage_lose_no_update(url: str) -> None:
    Ledger(url).close()  # migrated once; the two writers race on the rows, not the schema
    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    workers = [context.Process(target=_writer, args=(url, name, 15, results)) for name in ("a", "b")]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join(180)
        assert worker.exitcode == 0
    granted = results.get(timeout=5) + results.get(timeout=5)
    with Ledger(url) as ledger:
        assert ledger.lineage_count("c", "L") == 30 and len(ledger.lineage_incidents("c", "L")) == 30
        assert granted == 5 and ledger.budget(cluster="c", lineage="L", limit=5, window_s=3600).used == 5


# ---------------------------------------------------------------------------- cost


def test_lost_time_is_the_rolled_back_compute_and_the_downtime() -> None:
    row = {"spike_step": 1345, "resumed_from": {"step": 1000, "path": "/c"}, "gpus": 512, "step_seconds": 4.0,
           "t_spike": "2026-11-29T18:00:00Z", "t_alert": "2026-11-29T18:01:00Z", "t_stopped": "2026-11-29T18:02:00Z",
           "t_resumed_running": "2026-11-29T18:10:00Z"}
    lost = lost_time(row)
    assert lost["steps_rolled_back"] == 345 and lost["downtime_s"] == 600.0
    assert lost["gpu_hours"] == pytest.approx(512 * (345 * 4.0 + 600) / 3600)
    now = datetime(2026, 11, 29, 19, tzinfo=UTC)  # stopped, never resumed: down until now...
    down = lost_time({**row, "t_resumed_running": None, "resumed_from": None}, now=now)
    assert down["downtime_s"] == 3600.0 and down["steps_rolled_back"] is None and down["still_down"]
    # ... or until the next incident of its lineage, when there is one
    assert lost_time({**row, "t_resumed_running": None}, now=now, next_opened="2026-11-29T18:30:00Z")["downtime_s"] == 1800
    assert lost_time({**row, "t_stopped": None, "t_resumed_running": None})["downtime_s"] == 0  # it kept running
    assert lost_time({**row, "gpus": None})["gpu_hours"] is None
    # a spike logged a year before the alert is a clock, not a detection delay
    assert lost_time({**row, "t_spike": "2025-11-29T18:00:00Z"})["downtime_s"] == 540.0


def test_step_seconds_is_the_median_rate_before_the_spike() -> None:
    start = datetime(2026, 1, 1, tzinfo=UTC)
    points = [(s, start + timedelta(seconds=4 * s)) for s in range(0, 100, 10)] + [(200, start + timedelta(days=1))]
    assert step_seconds(points, 95) == 4.0
    assert step_seconds([(1, None), (2, None)], 2) is None


# ---------------------------------------------------------------------------- from bundles


def _bundle(root: Path, name: str, job: str, *, cluster_dir: Path | None = None, resumed_as: str | None = None,
            culprit: str | None = None, created: str) -> Path:
    """A diagnosed bundle with the actions a flow would have logged."""
    from spikeops.diagnosis import diagnose

    bundle = root / name
    build_bundle(bundle, "gpu_xid", seed=1, nodes=4, distractors=False)
    incident = json.loads((bundle / "incident.json").read_text())
    incident.update(incident_id=name, created=created)
    incident["job"]["id"] = job
    incident["alert"] = {"source": "alertmanager", "received": created, "payload": {}}
    (bundle / "incident.json").write_text(json.dumps(incident))
    diagnosis = diagnose(bundle).to_json()
    (bundle / "diagnosis.json").write_text(json.dumps(diagnosis))
    log = ActionLog(bundle / "actions.jsonl")
    log.append(ActionResult("stop", job, "done", "cancelled", incident=name))
    log.append(ActionResult("approval", job, "approved", "isolate: policy", incident=name,
                            extra={"gate": "isolate", "approver": "policy", "asked": False}))
    if culprit:
        log.append(ActionResult("drain", culprit, "done", "drained", incident=name))
    if resumed_as:
        log.append(ActionResult("resume", job, "done", f"resubmitted as job {resumed_as}", incident=name,
                                extra={"checkpoint": diagnosis["resume_from"]["path"], "exclude": culprit or "",
                                       "new_job": resumed_as, "env": {"NCCL_DEBUG": "INFO"}}))
    return bundle


def test_import_rebuilds_lineages_costs_and_node_records_from_bundles(url: str, tmp_path: Path) -> None:
    incidents = tmp_path / "incidents"
    first = _bundle(incidents, "inc-b1", "4412", resumed_as="4413", culprit="ip-10-45-4-69", created="2026-11-29T18:03:12Z")
    _bundle(incidents, "inc-b2", "4413", created="2026-11-29T20:03:12Z")
    (incidents / "not-a-bundle").mkdir()
    (incidents / "broken").mkdir()
    (incidents / "broken" / "incident.json").write_text("{ torn")
    code, out, err = _cli("ledger", "import", str(incidents), "--cluster", "sim")
    assert code == 1 and "2 incident(s) imported" in out and "skipped broken" in err, (out, err)
    assert "[1/3] broken: skipped" in out or "broken: skipped" in out
    code, out, _ = _cli("incidents", "list", "--json", "--since", "all")
    listed = json.loads(out)
    assert [i["incident_id"] for i in listed] == ["inc-b2", "inc-b1"]  # newest first
    for item in listed:
        assert INCIDENT_KEYS <= set(item) and set(item["times"]) == TIME_KEYS and set(item["lost"]) >= LOST_KEYS
    second, first_view = listed
    assert first_view["lineage"] == second["lineage"] == "4412" and first_view["resumed_as"] == "4413"
    assert first_view["resumed_from"]["path"] == json.loads((first / "diagnosis.json").read_text())["resume_from"]["path"]
    assert first_view["lost"]["gpus"] == 32 and first_view["lost"]["gpu_hours"] > 0
    assert first_view["culprit_nodes"] == ["ip-10-45-4-69"] and first_view["cluster"] == "sim"
    # a second import changes nothing
    code, out, _ = _cli("ledger", "import", str(incidents), "--cluster", "sim", "--json")
    assert json.loads(out)["new"] == 0
    code, out, _ = _cli("nodes", "history", "ip-10-45-4-69", "--json")
    record = json.loads(out)
    assert set(record) == {"node", "cluster", "state", "convictions", "events"} and record["state"] == "drained"
    conviction = record["convictions"][0]
    assert {k: conviction[k] for k in ("incident_id", "cause")} == {"incident_id": "inc-b1", "cause": "gpu_xid"}
    assert conviction["time"] and conviction["evidence"]["xids"]  # the extension: what convicted it (docs/ledger.md)
    assert record["events"][0]["kind"] == "drain" and set(record["events"][0]) == {"time", "kind", "result", "by",
                                                                                   "detail", "incident"}
    assert record["events"][0]["incident"] == "inc-b1"
    code, out, _ = _cli("incidents", "show", "inc-b2", "--json")
    assert json.loads(out)["lineage_incidents"] == ["inc-b1", "inc-b2"]
    code, out, err = _cli("incidents", "show", "inc-nope")
    assert code == 2 and "no incident 'inc-nope'" in err
    code, out, _ = _cli("incidents", "report", "--since", "all")
    assert "by cause" in out and "repeat lineages" in out and "4412" in out and "GPU-hours lost" in out
    code, out, _ = _cli("incidents", "list", "--since", "all")
    assert "inc-b1" in out and "incidents (2)" in out


def test_the_report_groups_by_cause_and_cluster_with_mttr() -> None:
    base = {"symptom": "instant_nan", "gpus": 8, "step_seconds": 1.0, "spike_step": 100,
            "resumed_from": {"step": 90, "path": "/c"}}
    rows = [{**base, "incident_id": "a", "cluster": "x", "lineage": "1", "job_id": "1", "cause": "gpu_xid",
             "opened": "2026-11-29T10:00:00Z", "t_alert": "2026-11-29T10:00:00Z", "t_spike": "2026-11-29T10:00:00Z",
             "t_resumed_running": "2026-11-29T10:10:00Z", "resumed_as": "2"},
            {**base, "incident_id": "b", "cluster": "x", "lineage": "1", "job_id": "2",
             "cause": "poisoned_checkpoint", "opened": "2026-11-29T11:00:00Z", "t_alert": "2026-11-29T11:00:00Z",
             "t_spike": "2026-11-29T11:00:00Z", "t_resumed_running": "2026-11-29T11:20:00Z", "resumed_as": "3",
             "recurrence_of": "a"}]
    report = summarize(views(rows))
    assert report["total"]["incidents"] == 2 and report["total"]["mttr_s"] == 900.0
    assert report["total"]["gpu_hours"] == pytest.approx(8 * (10 + 600) / 3600 + 8 * (10 + 1200) / 3600, abs=0.01)
    assert [c["cause"] for c in report["by_cause"]] == ["gpu_xid", "poisoned_checkpoint"]
    assert report["repeat_lineages"] == [{"cluster": "x", "lineage": "1", "incidents": 2, "jobs": ["1", "2"],
                                          "causes": ["gpu_xid", "poisoned_checkpoint"], "recurrences": 1,
                                          "gpu_hours": report["total"]["gpu_hours"], "held_for_person": False,
                                          "last_opened": "2026-11-29T11:00:00Z"}]


# ---------------------------------------------------------------------------- the spool


def test_spooled_entries_are_written_once_the_ledger_answers(url: str, tmp_path: Path) -> None:
    incidents = tmp_path / "incidents"
    spool_entry(incidents, _entry("inc-s1", "5", "5", opened="2026-11-29T18:00:00Z"))
    (incidents / ".ledger-spool" / "junk.json").write_text("[1, 2]")
    with Ledger(url) as ledger:
        done = replay(ledger, incidents)
        assert done.written == ["inc-s1"] and done.failed == ["junk.json: not a ledger entry"]
        assert ledger.incident("inc-s1")["job_id"] == "5"
    assert [p.name for p in pending(incidents)] == ["junk.json"]  # reported, never deleted
    with pytest.raises(ValueError):
        spool_entry(incidents, {"incident": {"incident_id": "../escape"}})


def test_entry_from_a_bundle_that_is_not_one(tmp_path: Path) -> None:
    with pytest.raises(LedgerError, match="not an incident bundle"):
        entry_from_bundle(tmp_path)
    shutil.rmtree(tmp_path)
