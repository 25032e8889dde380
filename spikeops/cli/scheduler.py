"""``spikeops nodes`` and ``spikeops job``: acting on the scheduler, with NHC's safety rules."""

from __future__ import annotations

import argparse
import json
import shlex
from typing import Any, TextIO

from spikeops.cli.common import EXIT_OK, EXIT_USAGE

from spikeops.errors import InputError

__all__ = ["add_nodes", "add_job", "scheduler_options", "SAFETY"]

EXIT_REFUSED = 1
SAFETY = ("Safety: a node is drained only with a reason starting 'spikeops:', never over a reason "
          "someone else wrote, never from an unknown state; only nodes spikeops drained are released. "
          "Exit status: 0 done or nothing to do, 1 refused for safety (the reason is printed), "
          "2 bad input or a scheduler error.")


def _scheduler(args: argparse.Namespace):
    from pathlib import Path as _Path

    from spikeops.schedulers import SlurmConfig, open_scheduler
    from spikeops.schedulers.base import default_log_path

    log = _Path(args.bundle) / "actions.jsonl" if args.bundle else default_log_path()
    config = SlurmConfig(signal_grace=getattr(args, "grace", None) or 30.0,
                         resume_env=getattr(args, "env_var", None) or "SPIKEOPS_RESUME_FROM",
                         timeout=args.timeout)
    return open_scheduler(args.scheduler or "slurm", log_path=log, dry_run=args.dry_run, incident=args.incident,
                          state_dir=args.state_dir, config=config)


def _report_actions(results: list[Any], out: TextIO, as_json: bool) -> int:
    if as_json:
        out.write(json.dumps([r.to_json() for r in results], indent=2) + "\n")
    else:
        for result in results:
            out.write(result.line() + "\n")
            if result.outcome == "dry-run":
                for command in result.commands:
                    if not command.ran:
                        out.write("  would run: " + shlex.join(command.argv) + "\n")
    if any(r.outcome == "failed" for r in results):
        return EXIT_USAGE
    return EXIT_REFUSED if any(r.outcome == "refused" for r in results) else EXIT_OK


def _cmd_nodes(args: argparse.Namespace, out: TextIO, err: TextIO) -> int:
    from spikeops.inventory import expand_nodes

    if args.action == "history":  # the ledger's record, not the scheduler's
        from spikeops.ledger.cli import run_nodes_history

        return run_nodes_history(args, out, err)
    if args.action in ("validate", "reboot", "release", "list"):  # the lifecycle (docs/lifecycle.md)
        from spikeops.lifecycle import cli as lifecycle

        return {"validate": lifecycle.run_validate, "reboot": lifecycle.run_reboot, "release": lifecycle.run_release,
                "list": lifecycle.run_list}[args.action](args, out, err)
    from spikeops.lifecycle.cli import open_life, record_drains

    with open_life(args) as life:  # the configured cluster's scheduler, or the flags'
        results = life.scheduler.drain(expand_nodes(args.nodes), args.reason, args.incident)
        status = _report_actions(results, out, args.json)
        if not args.dry_run:
            record_drains(life, args, results, err)
    return status


def _cmd_job(args: argparse.Namespace, out: TextIO, err: TextIO) -> int:
    from spikeops.collect.plan import check_job_id
    from spikeops.inventory import expand_nodes

    check_job_id(args.job)
    scheduler = _scheduler(args)
    if args.action == "stop":
        result = scheduler.stop(args.job, signal=args.signal, mode=args.mode, grace=args.grace)
    elif args.action == "preserve":
        if not args.bundle:
            err.write("spikeops job preserve: --bundle DIR is required (where the job's record goes)\n")
            return EXIT_USAGE
        result = scheduler.preserve(args.job, args.bundle, checkpoint=args.keep)
    else:
        exclude = expand_nodes(args.exclude) if args.exclude else []
        env = {}
        for pair in args.set_env or ():
            name, sep, value = pair.partition("=")
            if not sep:
                raise InputError(f"--set-env {pair!r}: expected NAME=VALUE")
            env[name] = value
        result = scheduler.resume(args.job, args.checkpoint or "", exclude=exclude, requeue=args.requeue,
                                  script=args.script, env=env)
    return _report_actions([result], out, args.json)


def scheduler_options() -> argparse.ArgumentParser:
    """The options every scheduler action takes (a parent parser)."""
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--scheduler", choices=("slurm", "local"), default=None,
                        help="slurm (the default without a configured cluster; its commands on this machine, "
                             "SLURM_CONF honoured) or local")
    common.add_argument("--state-dir", help="the local scheduler's state directory")
    common.add_argument("--dry-run", action="store_true", help="print exactly what would run; change nothing")
    common.add_argument("--bundle", metavar="DIR",
                        help="incident bundle: actions are appended to DIR/actions.jsonl "
                             "(default: ~/.local/state/spikeops/actions.jsonl)")
    common.add_argument("--incident", metavar="ID", help="incident id written into drain reasons and the log")
    common.add_argument("--timeout", type=float, default=30.0, help="seconds each scheduler command may take")
    common.add_argument("--json", action="store_true", help="print the results as JSON")
    return common


LIFECYCLE = ("A node spikeops drained comes back only with a passing validation recorded since its drain "
             "(docs/lifecycle.md); a repeat offender is marked for replacement. --cluster/--config name the "
             "cluster of spikeops.toml (its scheduler, inventory and policy; the only one by default).")


def _cluster_options() -> argparse.ArgumentParser:
    options = argparse.ArgumentParser(add_help=False)
    options.add_argument("--cluster", help="the cluster of spikeops.toml (default: the only one)")
    options.add_argument("--config", help="spikeops.toml (default $SPIKEOPS_CONFIG or ./spikeops.toml)")
    return options


def add_nodes(commands: Any) -> None:
    common = scheduler_options()
    cluster = _cluster_options()
    nodes = commands.add_parser("nodes", help="drain, reboot, validate, release and list the nodes spikeops isolated",
                                description="Isolate nodes the way NHC does, and bring them back only when they have "
                                "proven healthy. " + SAFETY + " " + LIFECYCLE)
    node_actions = nodes.add_subparsers(dest="action", metavar="ACTION", required=True)
    drain = node_actions.add_parser("drain", parents=[common, cluster], help="drain nodes with a spikeops reason",
                                    description="scontrol update NodeName=N State=DRAIN Reason='spikeops: TEXT ID'; "
                                    "recorded in the ledger. " + SAFETY)
    drain.add_argument("nodes", nargs="+", metavar="NODE", help="node names or node sets (gpu-[001-004])")
    drain.add_argument("--reason", required=True, help="why (the cause); 'spikeops:' and the incident are added")
    reboot = node_actions.add_parser("reboot", parents=[common, cluster],
                                     help="reboot nodes spikeops drained, into the drained state",
                                     description="scontrol reboot reason='spikeops: ...' NODES on nodes that carry "
                                     "spikeops' drain (no ASAP, no nextstate: the node comes back drained, to be "
                                     "validated). Recorded in the ledger. " + SAFETY)
    reboot.add_argument("nodes", nargs="+", metavar="NODE", help="node names or node sets")
    reboot.add_argument("--why", help="a note for the ledger (default: the conviction's reset class)")
    validate = node_actions.add_parser("validate", parents=[common, cluster],
                                       help="run the cluster's validation checks on drained nodes over SSH",
                                       description="Checks each node spikeops drained over SSH, each with its "
                                       "timeout: nvidia-smi -q against the drain-time capture, dcgmi diag -r 2 where "
                                       "installed, the healthy-run control, all_reduce_perf with an idle peer where "
                                       "installed, and the evidence that convicted it. Every result goes into the "
                                       "ledger; a node that cannot be reached or checked has not passed. Exit 0 "
                                       "when every node passed, 1 when one failed or was refused.")
    validate.add_argument("nodes", nargs="+", metavar="NODE", help="node names or node sets")
    release = node_actions.add_parser("release", parents=[common, cluster],
                                      help="resume nodes spikeops drained, once they passed validation",
                                      description="scontrol update NodeName=N State=RESUME, for nodes spikeops "
                                      "drained whose last validation since the drain passed; a repeat offender "
                                      "marked for replacement is refused. --force --reason overrides, recorded as "
                                      "force-release with who and why. " + SAFETY)
    release.add_argument("nodes", nargs="+", metavar="NODE", help="node names or node sets")
    release.add_argument("--force", action="store_true", help="release without a passing validation (needs --reason)")
    release.add_argument("--reason", help="why the validation is overridden (recorded with your name)")
    node_actions.add_parser("list", parents=[common, cluster],
                            help="the nodes spikeops has drained: reason, lifecycle state, next step")
    from spikeops.ledger.cli import add_history_parser  # its parser only: the ledger loads when it runs

    add_history_parser(node_actions)
    nodes.set_defaults(handler=_cmd_nodes)


def add_job(commands: Any) -> None:
    common = scheduler_options()
    job = commands.add_parser("job", help="stop, preserve and resume a job",
                              description="Act on a job. Exit status: 0 done or nothing to do, 1 refused, "
                              "2 bad input or a scheduler error (unknown job, controller down).")
    job_actions = job.add_subparsers(dest="action", metavar="ACTION", required=True)
    stop = job_actions.add_parser("stop", parents=[common], help="signal (optional), then cancel/requeue/hold",
                                  description="Signal the batch script first when asked (scancel --signal=SIG "
                                  "--batch: plain --signal reaches only the steps), wait --grace seconds for it "
                                  "to save and exit, then cancel (default), requeue or hold it.")
    stop.add_argument("job", metavar="JOB")
    stop.add_argument("--signal", help="signal for the batch script first, e.g. USR1")
    stop.add_argument("--mode", choices=("cancel", "requeue", "hold"), default="cancel")
    stop.add_argument("--grace", type=float, default=30.0, help="seconds between the signal and the stop")
    keep = job_actions.add_parser("preserve", parents=[common], help="save the job record, batch script, node list",
                                  description="scontrol show job -d and scontrol write batch_script into "
                                  "BUNDLE/scheduler/, before anything changes them.")
    keep.add_argument("job", metavar="JOB")
    keep.add_argument("--keep", metavar="CHECKPOINT",
                      help="also keep this checkpoint from the job's retention (hard links in .spikeops-keep/)")
    resume = job_actions.add_parser("resume", parents=[common], help="resubmit from a checkpoint, excluding nodes",
                                    description="Resubmit the job's batch script (recorded, or from Slurm) with "
                                    "--exclude and the checkpoint in an environment variable, or requeue it. "
                                    "Idempotent: a second resume of the same incident submits nothing.")
    resume.add_argument("job", metavar="JOB")
    resume.add_argument("--from", dest="checkpoint", metavar="CHECKPOINT", help="checkpoint to resume from")
    resume.add_argument("--exclude", metavar="NODES", help="node set to keep the job off")
    resume.add_argument("--requeue", action="store_true", help="requeue the job itself (ExcNodeList) instead")
    resume.add_argument("--script", help="batch script to resubmit (default: the job's own, from Slurm)")
    resume.add_argument("--env-var", default="SPIKEOPS_RESUME_FROM",
                        help="environment variable that carries the checkpoint (default SPIKEOPS_RESUME_FROM)")
    resume.add_argument("--set-env", action="append", metavar="NAME=VALUE",
                        help="a remediation for the resumed job, e.g. SPIKEOPS_LR_SCALE=0.3 or NCCL_DEBUG=INFO "
                        "(repeatable; SPIKEOPS_* and NCCL debug variables only; docs/flow.md)")
    job.set_defaults(handler=_cmd_job)
