"""A resumed job runs with its own environment, never with the orchestrator's.

The orchestrator's environment here holds unique random tokens (``SLACK_BOT_TOKEN``,
``SPIKEOPS_RECEIVER_TOKEN``), Prefect settings and its virtual environment on ``PATH``; the
job is submitted by "someone else" with variables, a ``PATH`` and a umask of its own. The
job dumps ``/proc/$$/environ`` each time it starts, and every Slurm command spikeops runs is
a wrapper that dumps its own environment before running the real one. The tests then read
the bytes: no token value anywhere, no ``PREFECT_`` variable, no orchestrator ``PATH`` entry,
the job's own variables all there and unchanged, and the remediation set. Real Slurm
(``spikeops.sim.slurmcluster``) where it can run; the pure policy everywhere.
"""

from __future__ import annotations

import os
import secrets
import shutil
import struct
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from spikeops.errors import InputError
from spikeops.schedulers import ActionLog, LocalScheduler, SlurmConfig, SlurmScheduler
from spikeops.schedulers.base import LocalRunner
from spikeops.schedulers.jobenv import (
    EnvFormatError,
    command_env,
    format_env_file,
    orchestrator_prefixes,
    parse_env_file,
    parse_slurm_state_env,
    resume_environment,
    slurm_state_env_path,
)
from spikeops.sim import slurmcluster
from tests.test_incident_flow_slurm import _wait

VENV_BIN = str(Path(sys.prefix) / "bin")
REMEDIATION = {"SPIKEOPS_LR_SCALE": "0.3", "NCCL_DEBUG": "INFO"}
#: A checkpoint path with a comma and a space: what ``sbatch --export=K=V`` cannot carry.
CHECKPOINT_NAME = "run 7,b/global_step12000"
#: What the scheduler sets afresh at each start (and so differs between the two runs).
_PER_START = ("SLURM", "HOSTNAME", "SPIKEOPS_LOCAL_JOB", "SPIKEOPS_JOB_NODES")


@pytest.fixture
def orchestrator(monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    """The flow process's environment: unique secrets, Prefect settings, its venv first on PATH.
    Returns the values that must never reach a job or a command."""
    values = {
        "SLACK_BOT_TOKEN": f"xoxb-{secrets.token_hex(16)}",
        "SPIKEOPS_RECEIVER_TOKEN": secrets.token_hex(20),
        "PREFECT_API_KEY": f"pnu_{secrets.token_hex(16)}",
        "SPIKEOPS_SLACK_API_URL": f"http://127.0.0.1:9/{secrets.token_hex(8)}/api/",
    }
    for name, value in values.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("PREFECT_LOGGING_LEVEL", "INFO")
    monkeypatch.setenv("VIRTUAL_ENV", sys.prefix)
    monkeypatch.setenv("PATH", VENV_BIN + os.pathsep + os.environ.get("PATH", "/usr/bin:/bin"))
    # sbatch/squeue input variables that would change what is submitted or printed
    monkeypatch.setenv("SBATCH_EXPORT", "NONE")
    monkeypatch.setenv("SQUEUE_FORMAT", "%all")
    return values


def _job_env(home: Path, **extra: str) -> dict[str, str]:
    """The submitting user's own environment: another PATH, another HOME, values with
    commas, spaces, '=' and a newline."""
    return {"PATH": "/opt/mytrain/bin:/usr/local/bin:/usr/bin:/bin", "HOME": str(home), "LANG": "C.UTF-8",
            "MY_TRAINING_VAR": f"lr=3e-4,warmup 2000 steps {secrets.token_hex(4)}",
            "MY_MULTILINE": "first line\nsecond line", "WANDB_MODE": "offline", **extra}


def _assert_clean(raw: bytes, secret_values: dict[str, str], what: str) -> dict[str, str]:
    """Nothing of the orchestrator in ``raw`` (an environment's bytes); returns it parsed."""
    for name, value in secret_values.items():
        assert value.encode() not in raw, f"{what}: the value of {name} leaked"
    env = parse_env_file(raw)
    assert not [n for n in env if n.startswith("PREFECT_")], f"{what}: {sorted(env)}"
    assert "VIRTUAL_ENV" not in env and "SBATCH_EXPORT" not in env and "SQUEUE_FORMAT" not in env, what
    assert VENV_BIN not in env.get("PATH", "").split(os.pathsep), f"{what}: PATH={env.get('PATH')}"
    return env


def _own(env: dict[str, str]) -> dict[str, str]:
    return {k: v for k, v in env.items() if not k.startswith(_PER_START)}


# ---------------------------------------------------------------------------- the pure policy


def test_the_command_scrub_policy_keeps_what_slurm_clients_need_and_nothing_else() -> None:
    environ = {
        "PATH": "/srv/spikeops/.venv/bin:/usr/local/bin:/usr/bin:/srv/spikeops/.venv/lib/../bin:/opt/slurm/bin",
        "HOME": "/home/ops", "USER": "ops", "LANG": "en_US.UTF-8", "LC_ALL": "C", "TZ": "UTC",
        "SLURM_CONF": "/etc/slurm/slurm.conf", "KRB5CCNAME": "FILE:/tmp/krb5cc_1",
        "SLACK_BOT_TOKEN": "xoxb-1", "SPIKEOPS_RECEIVER_TOKEN": "r", "PREFECT_API_URL": "http://x/api",
        "PREFECT__FLOW_RUN_ID": "f", "VIRTUAL_ENV": "/srv/spikeops/.venv", "SBATCH_EXPORT": "NONE",
        "SQUEUE_FORMAT": "%all", "SLURM_JOB_ID": "77", "SLURM_TIME_FORMAT": "relative", "LD_PRELOAD": "/x.so",
        "PYTHONPATH": "/srv/spikeops", "AWS_SECRET_ACCESS_KEY": "s",
    }
    scrubbed = command_env(environ, drop_path_under=orchestrator_prefixes(environ))
    assert scrubbed == {"PATH": "/usr/local/bin:/usr/bin:/opt/slurm/bin", "HOME": "/home/ops", "USER": "ops",
                        "LANG": "en_US.UTF-8", "LC_ALL": "C", "TZ": "UTC", "SLURM_CONF": "/etc/slurm/slurm.conf"}
    kept = command_env(environ, keep=["KRB5CCNAME"])
    assert kept["KRB5CCNAME"] == "FILE:/tmp/krb5cc_1" and kept["PATH"] == environ["PATH"]
    # a prefix is a directory, not a string prefix: /srv/spikeops/.venv2 is someone else's
    assert command_env({"PATH": "/v/.venv2/bin:/v/.venv/bin"}, drop_path_under=["/v/.venv"]) == {
        "PATH": "/v/.venv2/bin"}
    assert "/conda/envs/ops" in orchestrator_prefixes({"CONDA_PREFIX": "/conda/envs/ops"})


def test_the_local_runner_gives_commands_only_the_scrubbed_environment(orchestrator: dict[str, str]) -> None:
    runner = LocalRunner({"SLURM_CONF": "/etc/slurm/x.conf"})
    raw = subprocess.run(["env", "-0"], env=runner.env, capture_output=True, check=True).stdout
    env = _assert_clean(raw, orchestrator, "env run by the LocalRunner")
    assert env["SLURM_CONF"] == "/etc/slurm/x.conf" and env["PATH"]
    run = runner.run(["/bin/sh", "-c", "umask"], timeout=10, umask=0o027)
    assert run.ok and run.stdout.strip() == "0027"
    # a site can pass a variable on by name
    monkeypatched = dict(os.environ, KRB5CCNAME="FILE:/tmp/k", SPIKEOPS_PASS_ENV="KRB5CCNAME")
    assert LocalRunner(environ=monkeypatched).env["KRB5CCNAME"] == "FILE:/tmp/k"


def _slurm_env_file(records: list[bytes]) -> bytes:
    """The bytes slurmctld's ``_write_data_array_to_file`` writes."""
    return struct.pack("=I", len(records)) + b"".join(r + b"\0" for r in records)


def test_slurms_stored_environment_and_env_files_are_read_exactly() -> None:
    records = [b"PATH=/opt/a/bin:/bin", b"V=a,b c=d", b"ML=one\ntwo", b"EMPTY=", b"RAW=caf\xe9"]
    env = parse_slurm_state_env(_slurm_env_file(records))
    assert env["V"] == "a,b c=d" and env["ML"] == "one\ntwo" and env["EMPTY"] == ""
    # a byte that is not UTF-8 goes back to the job as it came
    assert format_env_file(env) == b"".join(r + b"\0" for r in records)
    assert parse_env_file(format_env_file(env)) == env
    with pytest.raises(EnvFormatError, match="says 6 variables"):
        parse_slurm_state_env(struct.pack("=I", 6) + _slurm_env_file(records)[4:])
    with pytest.raises(EnvFormatError, match="does not end"):
        parse_slurm_state_env(_slurm_env_file(records)[:-3])
    with pytest.raises(EnvFormatError, match="env -0"):
        parse_env_file(b"A=1\nB=2\n")
    with pytest.raises(EnvFormatError, match="not NAME=value"):
        parse_env_file(b"A=1\0garbage\0")
    with pytest.raises(EnvFormatError, match="NUL"):
        format_env_file({"A": "x\0y"})
    with pytest.raises(EnvFormatError, match="name"):
        format_env_file({"A-B": "x"})
    assert slurm_state_env_path("/var/spool/slurmctld/", "4417") == "/var/spool/slurmctld/hash.7/job.4417/environment"
    assert slurm_state_env_path("/s", "4418", "4410").endswith("hash.0/job.4410/environment")  # an array task
    with pytest.raises(EnvFormatError):
        slurm_state_env_path("/s", "4418+1")
    assert resume_environment({"A": "1", "SPIKEOPS_LR_SCALE": "0.5"}, {"SPIKEOPS_LR_SCALE": "0.3"}) == {
        "A": "1", "SPIKEOPS_LR_SCALE": "0.3"}


# ---------------------------------------------------------------------------- the local scheduler


def _dump_script(directory: Path) -> list[str]:
    """A job that dumps its environment and umask at each start, then waits to be stopped."""
    return ["/bin/sh", "-c", f'cat /proc/$$/environ > "{directory}/env-$SPIKEOPS_LOCAL_JOB"; '
                             f'umask > "{directory}/umask-$SPIKEOPS_LOCAL_JOB"; exec sleep 60']


def test_the_local_scheduler_resumes_a_job_with_its_own_environment(tmp_path: Path,
                                                                    orchestrator: dict[str, str]) -> None:
    scheduler = LocalScheduler(tmp_path / "sched", ActionLog(tmp_path / "actions.jsonl"), incident="inc-env-local")
    scheduler.add_nodes(["gpu-001", "gpu-002", "gpu-003"])
    own = _job_env(tmp_path / "home")
    job = scheduler.submit(_dump_script(tmp_path), ["gpu-001", "gpu-002"], environment=own, cwd=str(tmp_path))
    first = _wait("the job's first start", lambda: (tmp_path / f"env-{job}").is_file()
                  and (tmp_path / f"env-{job}").read_bytes())
    assert _own(_assert_clean(first, orchestrator, "the original job")) == own
    assert os.stat(tmp_path / "sched" / "jobs" / f"{job}.env").st_mode & 0o777 == 0o600
    assert scheduler.stop(job).outcome == "done"
    checkpoint = str(tmp_path / CHECKPOINT_NAME)
    resumed = scheduler.resume(job, checkpoint, exclude=["gpu-001"], env=REMEDIATION)
    assert resumed.outcome == "done", resumed.detail
    new = resumed.extra["new_job"]
    raw = _wait("the resumed job's start", lambda: (tmp_path / f"env-{new}").is_file()
                and (tmp_path / f"env-{new}").read_bytes())
    env = _assert_clean(raw, orchestrator, "the resumed job")
    assert _own(env) == {**own, **REMEDIATION, "SPIKEOPS_RESUME_FROM": checkpoint}
    assert env["SPIKEOPS_LOCAL_JOB"] == new and "gpu-001" not in env["SPIKEOPS_JOB_NODES"]
    scheduler.stop(new)
    for path in [tmp_path / "actions.jsonl", *sorted((tmp_path / "sched" / "jobs").glob("*.json"))]:
        for value in orchestrator.values():
            assert value not in path.read_text(), path
    # a job whose stored environment is gone is not restarted with the caller's
    (tmp_path / "sched" / "jobs" / f"{new}.env").unlink()
    refused = scheduler.resume(new, checkpoint, key="another-incident")
    assert refused.outcome == "refused" and "no stored environment" in refused.detail
    assert len(scheduler.jobs()) == 2


def test_a_local_job_submitted_without_an_environment_gets_the_submitters(tmp_path: Path) -> None:
    """``submit`` without ``environment`` exports the caller's, as sbatch does by default."""
    scheduler = LocalScheduler(tmp_path / "sched")
    scheduler.add_nodes(["gpu-001"])
    job = scheduler.submit(_dump_script(tmp_path), ["gpu-001"], env={"EXTRA_VAR": "1"})
    raw = _wait("the job's start", lambda: (tmp_path / f"env-{job}").is_file() and (tmp_path / f"env-{job}").read_bytes())
    env = parse_env_file(raw)
    assert env["EXTRA_VAR"] == "1" and env["PATH"] == os.environ["PATH"]
    scheduler.stop(job)
    with pytest.raises(InputError, match="NUL"):
        scheduler.submit(["true"], ["gpu-001"], environment={"A": "x\0y"})


# ---------------------------------------------------------------------------- real Slurm


def _require_slurm() -> None:
    why = slurmcluster.missing()
    if why:
        pytest.skip(why)


@pytest.fixture(scope="module")
def slurm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[slurmcluster.SlurmCluster]:
    _require_slurm()
    with slurmcluster.running(tmp_path_factory.mktemp("slurm") / "s", nodes=4) as cluster:
        yield cluster


def _wrappers(directory: Path) -> dict[str, str]:
    """sbatch, scontrol, scancel and squeue behind wrappers that dump the environment they
    were given (``directory/dumps/NAME.PID``) and then run the real command."""
    dumps = directory / "dumps"
    dumps.mkdir(parents=True, exist_ok=True)
    out = {}
    for name in ("sbatch", "scontrol", "scancel", "squeue"):
        real = shutil.which(name) or f"/usr/bin/{name}"
        wrapper = directory / f"{name}-wrapper"
        wrapper.write_text(f'#!/bin/sh\ncat /proc/$$/environ > "{dumps}/{name}.$$"\nexec {real} "$@"\n')
        wrapper.chmod(0o755)
        out[name] = str(wrapper)
    return out


def _check_command_dumps(directory: Path, secret_values: dict[str, str], wanted: set[str]) -> None:
    dumps = sorted((directory / "dumps").iterdir())
    assert {p.name.split(".")[0] for p in dumps} >= wanted, [p.name for p in dumps]
    for path in dumps:
        env = _assert_clean(path.read_bytes(), secret_values, f"the environment of {path.name}")
        assert not [n for n in env if n.startswith(("SBATCH_", "SQUEUE_", "SPIKEOPS_"))], (path.name, sorted(env))


def _batch_script(directory: Path, nodes: int) -> Path:
    script = directory / "train.sh"
    script.write_text(
        "#!/bin/sh\n"
        f"#SBATCH --nodes={nodes}\n"
        f"#SBATCH --output={directory}/slurm-%j.out\n"
        f'cat /proc/$$/environ > "{directory}/env-$SLURM_JOB_ID"\n'
        f'umask > "{directory}/umask-$SLURM_JOB_ID"\n'
        f'echo "$SLURM_JOB_NODELIST ${{SPIKEOPS_RESUME_FROM:-none}}" >> "{directory}/runs.txt"\n'
        f"trap 'echo $SLURM_JOB_ID >> \"{directory}/usr1.txt\"' USR1\n"
        "while true; do sleep 0.2; done\n")
    return script


def _submit_as_user(slurm: slurmcluster.SlurmCluster, directory: Path, own: dict[str, str], *options: str,
                    nodes: int = 2) -> str:
    """sbatch as the job's owner would run it: their environment, their umask (0027)."""
    done = subprocess.run(["/usr/bin/sbatch", "--parsable", f"--chdir={directory}", *options,
                           str(_batch_script(directory, nodes))],
                          env={**own, **slurm.env}, capture_output=True, text=True, timeout=20, umask=0o027)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip().split(";")[0]


def _started(directory: Path, job: str) -> bytes:
    path = directory / f"env-{job}"
    return _wait(f"job {job} started", lambda: path.is_file() and path.read_bytes() and (
        directory / f"umask-{job}").is_file() and path.read_bytes(), seconds=90)  # a loaded 2-core CI machine


def _scheduler(slurm: slurmcluster.SlurmCluster, directory: Path, **config: Any) -> SlurmScheduler:
    return SlurmScheduler(LocalRunner(slurm.env), SlurmConfig(timeout=20, signal_grace=5, **_wrappers(directory), **config),
                          ActionLog(directory / "actions.jsonl"), incident="inc-env")


def test_slurm_resumes_a_job_with_the_environment_it_was_submitted_with(
        slurm: slurmcluster.SlurmCluster, tmp_path: Path, orchestrator: dict[str, str]) -> None:
    own = _job_env(tmp_path / "home")
    job = _submit_as_user(slurm, tmp_path, own, "-w", "node[001-002]")
    original = _assert_clean(_started(tmp_path, job), orchestrator, "the original job")
    scheduler = _scheduler(slurm, tmp_path)
    bundle = tmp_path / "bundle"
    kept = scheduler.preserve(job, bundle)
    assert kept.outcome == "done" and "submission environment" in kept.detail, kept.detail
    saved = bundle / "scheduler" / f"env-{job}"
    assert os.stat(saved).st_mode & 0o777 == 0o600
    assert _own(parse_env_file(saved.read_bytes())) == own  # what the user's sbatch exported, no more
    assert scheduler.stop(job, signal="USR1", grace=1).outcome == "done"
    checkpoint = str(tmp_path / CHECKPOINT_NAME)
    resumed = scheduler.resume(job, checkpoint, exclude=["node001"], script=bundle / "scheduler" / f"batch-{job}.sh",
                               env=REMEDIATION)
    assert resumed.outcome == "done", resumed.detail
    assert resumed.extra["environment"]["source"].startswith("preserved")
    new = resumed.extra["new_job"]
    env = _assert_clean(_started(tmp_path, new), orchestrator, "the resumed job")
    # every variable of the original run, unchanged, plus the remediation and the checkpoint
    assert _own(env) == {**_own(original), **REMEDIATION, "SPIKEOPS_RESUME_FROM": checkpoint}
    assert env["PATH"] == own["PATH"] and env["MY_TRAINING_VAR"] == own["MY_TRAINING_VAR"]
    assert (tmp_path / f"umask-{new}").read_text() == (tmp_path / f"umask-{job}").read_text() == "0027\n"
    assert "node001" not in env["SLURM_JOB_NODELIST"]
    # every Slurm command spikeops ran got the scrubbed environment, sbatch included
    _check_command_dumps(tmp_path, orchestrator, {"sbatch", "scontrol", "scancel", "squeue"})
    # and no secret reached the audit log or the bundle
    for path in [tmp_path / "actions.jsonl", *sorted((bundle / "scheduler").iterdir())]:
        for value in orchestrator.values():
            assert value.encode() not in path.read_bytes(), path
    assert scheduler.resume(job, checkpoint, exclude=["node001"],
                            script=bundle / "scheduler" / f"batch-{job}.sh").outcome == "nothing-to-do"
    scheduler.stop(new)


def test_slurm_refuses_to_resume_when_the_jobs_environment_cannot_be_read(
        slurm: slurmcluster.SlurmCluster, tmp_path: Path, orchestrator: dict[str, str]) -> None:
    own = _job_env(tmp_path / "home")
    job = _submit_as_user(slurm, tmp_path, own)
    _started(tmp_path, job)
    blind = _scheduler(slurm, tmp_path, state_save_location=str(tmp_path / "not-slurms-state"))
    kept = blind.preserve(job, tmp_path / "bundle")
    assert kept.outcome == "done" and "environment not saved" in kept.detail
    assert not (tmp_path / "bundle" / "scheduler" / f"env-{job}").exists()
    assert blind.stop(job).outcome == "done"
    refused = blind.resume(job, "/ckpt/step-1", script=tmp_path / "bundle" / "scheduler" / f"batch-{job}.sh")
    assert refused.outcome == "refused" and "\n" not in refused.detail
    assert "Slurm keeps no environment" in refused.detail, refused.detail
    assert not list((tmp_path / "dumps").glob("sbatch.*"))  # nothing was submitted
    # while the job record lasts, Slurm's own copy is read at resume time (no preserve needed)
    seeing = _scheduler(slurm, tmp_path)
    resumed = seeing.resume(job, "/ckpt/step-1", env=REMEDIATION)
    assert resumed.outcome == "done", resumed.detail
    assert resumed.extra["environment"]["source"].startswith("Slurm's copy")
    env = _assert_clean(_started(tmp_path, resumed.extra["new_job"]), orchestrator, "the resumed job")
    assert env["MY_TRAINING_VAR"] == own["MY_TRAINING_VAR"] and env["SPIKEOPS_LR_SCALE"] == "0.3"
    seeing.stop(resumed.extra["new_job"])


def test_a_dry_run_resume_names_the_environment_without_writing_or_submitting(
        slurm: slurmcluster.SlurmCluster, tmp_path: Path, orchestrator: dict[str, str]) -> None:
    job = _submit_as_user(slurm, tmp_path, _job_env(tmp_path / "home"))
    _started(tmp_path, job)
    dry = SlurmScheduler(LocalRunner(slurm.env), SlurmConfig(timeout=20, **_wrappers(tmp_path)),
                         ActionLog(None), dry_run=True)
    result = dry.resume(job, "/ckpt/a,b")
    assert result.outcome == "dry-run" and "--export-file=<a 0600 file:" in result.detail
    assert "--export=ALL" in result.detail and not list((tmp_path / "dumps").glob("sbatch.*"))
    _scheduler(slurm, tmp_path).stop(job)


# ---------------------------------------------------------------------------- over SSH


@pytest.fixture
def login_node(tmp_path: Path) -> Iterator[Any]:
    """A real sshd on a loopback address with SFTP, and a paramiko client logged in to it as
    this user (the login node an ``SshRunner`` runs Slurm's commands on)."""
    import paramiko

    from spikeops.sim import cluster as simcluster
    from spikeops.sim import sshd

    if not os.access("/usr/sbin/sshd", os.X_OK) or os.geteuid() != 0:
        pytest.skip("needs /usr/sbin/sshd and root")
    address = "127.0.53.1"
    port = simcluster.free_port((address,))
    sshd.keygen(tmp_path / "host_key", "login-node")
    sshd.keygen(tmp_path / "client_key", "spikeops")
    (tmp_path / "authorized_keys").write_text((tmp_path / "client_key.pub").read_text())
    config = tmp_path / "sshd_config"
    config.write_text("\n".join([
        f"ListenAddress {address}:{port}", f"HostKey {tmp_path / 'host_key'}",
        f"AuthorizedKeysFile {tmp_path / 'authorized_keys'}", f"PidFile {tmp_path / 'sshd.pid'}",
        "StrictModes no", "UsePAM no", "PermitRootLogin prohibit-password", "PasswordAuthentication no",
        "KbdInteractiveAuthentication no", "PermitUserEnvironment no", "UseDNS no", "LogLevel ERROR",
        "Subsystem sftp internal-sftp"]) + "\n")
    sshd.ensure_privsep_dir()
    server = subprocess.Popen(["/usr/sbin/sshd", "-D", "-e", "-f", str(config)], stderr=subprocess.PIPE)
    client = paramiko.SSHClient()
    try:
        sshd.wait_listening([address], port, timeout=20)
        host_key = paramiko.PKey.from_path(tmp_path / "host_key")
        client.get_host_keys().add(f"[{address}]:{port}", host_key.get_name(), host_key)
        client.connect(address, port=port, username="root", pkey=paramiko.PKey.from_path(tmp_path / "client_key"),
                       allow_agent=False, look_for_keys=False, timeout=20)
        yield client
    finally:
        client.close()
        server.terminate()
        server.wait(10)


def test_the_ssh_runner_sends_only_its_own_variables_and_stages_files_privately(
        login_node: Any, orchestrator: dict[str, str]) -> None:
    from spikeops.schedulers.base import SshRunner

    runner = SshRunner(login_node, "login", env={"SLURM_CONF": "/etc/slurm/x.conf"})
    run = runner.run(["sh", "-c", 'umask; echo "$SLURM_CONF ${SLACK_BOT_TOKEN:-none} ${PREFECT_API_KEY:-none}"'],
                     timeout=20, umask=0o027)
    assert run.ok and run.stdout.split("\n")[:2] == ["0027", "/etc/slurm/x.conf none none"], run
    data = format_env_file({"A": "1", "B": "a,b c\nd"})
    path = runner.put_file(data, "spikeops-env-1-")
    try:
        assert os.stat(path).st_mode & 0o777 == 0o600  # the login node is this machine
        assert runner.read_file(path, 1 << 10) == data
        with pytest.raises(OSError, match="over 3 bytes"):
            runner.read_file(path, 3)
    finally:
        runner.remove_file(path)
    assert not os.path.exists(path)
    with pytest.raises(OSError):
        runner.read_file(path, 10)


# ---------------------------------------------------------------------------- through the flow


def test_the_incident_flow_resumes_a_slurm_job_with_its_own_environment(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, prefect_server: None) -> None:
    """The whole flow (collect over SSH, diagnose, approve, drain, resume) on real Slurm, with
    tokens and Prefect settings in the flow's environment and Slurm's commands wrapped."""
    _require_slurm()
    from tests import test_incident_flow_slurm as flow_slurm
    from spikeops.sim import cluster as simcluster
    from spikeops.sim.slack import SlackServer

    cause, seed, answer = flow_slurm._find(flow_slurm._hardware_nan, ("gpu_xid",))
    first, token = "127.0.51.11", f"xoxb-{secrets.token_hex(12)}"
    port = simcluster.free_port((first,))
    with simcluster.running(tmp_path / "cluster", nodes=flow_slurm.NODES, port=port, first_address=first,
                            scenario=cause, seed=seed) as cluster, \
            slurmcluster.running(tmp_path / "slurm", names=[*cluster.nodes, flow_slurm.SPARE]) as slurm, \
            SlackServer(token=token) as slack:
        secret_values = {"SLACK_BOT_TOKEN": token, "SPIKEOPS_RECEIVER_TOKEN": secrets.token_hex(20),
                         "SPIKEOPS_SLACK_API_URL": slack.api_url}
        for name, value in secret_values.items():
            monkeypatch.setenv(name, value)
        monkeypatch.setenv("PREFECT_LOGGING_LEVEL", "INFO")
        monkeypatch.setenv("VIRTUAL_ENV", sys.prefix)
        monkeypatch.setenv("PATH", VENV_BIN + os.pathsep + os.environ.get("PATH", "/usr/bin:/bin"))
        monkeypatch.setenv("SLURM_CONF", slurm.env["SLURM_CONF"])
        for name, path in _wrappers(tmp_path).items():
            monkeypatch.setenv(f"SPIKEOPS_{name.upper()}", path)
        assert [n for n in os.environ if n.startswith("PREFECT_")], "the flow has Prefect settings to keep away"
        own = _job_env(tmp_path / "home")
        job = _submit_as_user(slurm, tmp_path, own, "-w", ",".join(cluster.nodes), nodes=len(cluster.nodes))
        original = _assert_clean(_started(tmp_path, job), secret_values, "the original job")
        time.sleep(0.5)  # slurmd registers the batch step a moment after the script starts
        flow_slurm._checkpoints(tmp_path / "ckpt", cluster.scenario_bundle)
        scheduler = SlurmScheduler(LocalRunner(slurm.env), SlurmConfig(timeout=20), ActionLog(None))
        world = flow_slurm.World(cluster, slurm, slack, scheduler, job, answer, tmp_path)
        try:
            outcome = flow_slurm._run_approved(world.params("inc-env-flow", approval="always", approval_timeout_s=120))
            resumed = outcome["resumed"]
            assert resumed["outcome"] == "done", resumed
            # the environment preserved while the job ran, before the stop
            assert resumed["extra"]["environment"]["source"].startswith("preserved")
            assert (Path(outcome["bundle"]) / "scheduler" / f"env-{job}").is_file()
            new = resumed["extra"]["new_job"]
            env = _assert_clean(_started(tmp_path, new), secret_values, "the job the flow resumed")
            plan_env = resumed["extra"].get("env", {})
            assert _own(env) == {**_own(original), **plan_env,
                                 "SPIKEOPS_RESUME_FROM": outcome["diagnosis"]["resume_from"]["path"]}
            assert outcome["diagnosis"]["culprit_nodes"][0] not in env["SLURM_JOB_NODELIST"]
            _check_command_dumps(tmp_path, secret_values, {"sbatch", "scontrol", "scancel", "squeue"})
        finally:
            drained = [node.name for node in scheduler.drained()]
            if drained:
                scheduler.release(drained)
            live = subprocess.run(["squeue", "-h", "-o", "%i"], env={**os.environ, **slurm.env},
                                  capture_output=True, text=True, timeout=20).stdout.split()
            if live:
                subprocess.run(["scancel", *live], env={**os.environ, **slurm.env}, timeout=20)
