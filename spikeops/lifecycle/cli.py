"""``spikeops nodes`` with the lifecycle (docs/lifecycle.md): ``validate``, ``reboot``, the
gated ``release`` and ``list`` with each drained node's state; ``drain`` and ``release`` are
recorded in the ledger.

Which cluster: ``--cluster`` (or the only one of spikeops.toml); its scheduler, inventory and
policy come from the file, ``--scheduler``/``--state-dir`` override the scheduler. Without a
configured cluster, the scheduler flags alone work for ``drain``, ``release`` and ``list``,
and the ledger's records are those of the cluster ``default`` (what a flow run without a
cluster records). Exit status: 0 done (or passed), 1 refused or a validation failed,
2 bad input or a scheduler error.
"""

from __future__ import annotations

import argparse
import json
from typing import Any, TextIO

from spikeops.errors import InputError

__all__ = ["open_life", "run_validate", "run_reboot", "run_release", "run_list", "record_drains"]

EXIT_OK, EXIT_REFUSED, EXIT_USAGE = 0, 1, 2


def open_life(args: argparse.Namespace, *, need_inventory: bool = False) -> Any:
    """The ``ClusterLife`` the command acts through (module docstring)."""
    from pathlib import Path

    from spikeops.config import ClusterConfig, load_config
    from spikeops.ledger.entry import DEFAULT_CLUSTER
    from spikeops.lifecycle.service import ClusterLife, choose_cluster, who
    from spikeops.schedulers import SlurmConfig, open_scheduler
    from spikeops.schedulers.base import default_log_path

    config = load_config(getattr(args, "config", None))
    named = getattr(args, "cluster", None)
    if named or len(config.clusters) == 1:
        cluster = choose_cluster(config, named)
    elif need_inventory:
        raise InputError("this needs a cluster of spikeops.toml (its inventory): --cluster NAME, --config FILE"
                         + (f" (configured: {', '.join(config.clusters)})" if config.clusters else ""))
    else:
        cluster = ClusterConfig(DEFAULT_CLUSTER, inventory="", run_dir="")
    scheduler = None
    if getattr(args, "scheduler", None) or getattr(args, "state_dir", None) or cluster.inventory == "":
        kind = getattr(args, "scheduler", None) or (cluster.scheduler if cluster.inventory else "slurm")
        log = Path(args.bundle) / "actions.jsonl" if getattr(args, "bundle", None) else default_log_path()
        scheduler = open_scheduler(kind, log_path=log, dry_run=args.dry_run, incident=getattr(args, "incident", None),
                                   state_dir=getattr(args, "state_dir", None) or cluster.scheduler_state_dir,
                                   config=SlurmConfig(timeout=getattr(args, "timeout", 30.0)))
    log_path = Path(args.bundle) / "actions.jsonl" if getattr(args, "bundle", None) else None
    return ClusterLife(config, cluster, by=who(), dry_run=args.dry_run, scheduler=scheduler, log_path=log_path)


def _print(outcomes: list[Any], out: TextIO, as_json: bool) -> None:
    if as_json:
        out.write(json.dumps([o.to_json() for o in outcomes], indent=2) + "\n")
        return
    for outcome in outcomes:
        out.write(outcome.line() + "\n")
        if outcome.validation is not None:
            for check in outcome.validation.checks:
                out.write(f"  {check.name:12} {check.verdict:11} {check.detail}\n")


def _status(outcomes: list[Any]) -> int:
    if any(o.outcome == "failed" and o.action != "validate" for o in outcomes):
        return EXIT_USAGE
    return EXIT_REFUSED if any(o.outcome in ("refused", "failed") for o in outcomes) else EXIT_OK


def run_validate(args: argparse.Namespace, out: TextIO, err: TextIO) -> int:
    """``spikeops nodes validate NODE...``: the cluster's checks, each recorded."""
    from spikeops.inventory import expand_nodes

    names = expand_nodes(args.nodes)
    with open_life(args, need_inventory=True) as life:
        say = None if args.json else (lambda line: (err.write(line + "\n"), err.flush()))
        outcomes = life.validate(names, say=say)
    _print(outcomes, out, args.json)
    return _status(outcomes)


def run_reboot(args: argparse.Namespace, out: TextIO, err: TextIO) -> int:
    """``spikeops nodes reboot NODE...``: into the drain, nodes spikeops drained only."""
    from spikeops.inventory import expand_nodes

    with open_life(args) as life:
        outcomes = life.reboot(expand_nodes(args.nodes), why=args.why or "")
    _print(outcomes, out, args.json)
    return _status(outcomes)


def run_release(args: argparse.Namespace, out: TextIO, err: TextIO) -> int:
    """``spikeops nodes release NODE... [--force --reason R]``: only after a passing validation."""
    from spikeops.inventory import expand_nodes

    if args.reason and not args.force:
        raise InputError("--reason goes with --force (a release without --force needs a passing validation)")
    with open_life(args) as life:
        outcomes = life.release(expand_nodes(args.nodes), force=args.force, reason=args.reason)
    _print(outcomes, out, args.json)
    return _status(outcomes)


def record_drains(life: Any, args: argparse.Namespace, results: list[Any], err: TextIO) -> None:
    """A drain made at the command line goes into the ledger (a ledger that cannot be reached
    is said in one line: the drain itself is done)."""
    try:
        for result in results:
            if result.outcome == "done":
                life.note(result.target, "drain", "done", result.detail, incident=args.incident, cause=args.reason)
    except Exception as exc:  # noqa: BLE001 - the drain stands; its record is what failed
        err.write(f"spikeops nodes drain: not recorded in the ledger: {str(exc).splitlines()[0][:300]}\n")


def run_list(args: argparse.Namespace, out: TextIO, err: TextIO) -> int:
    """``spikeops nodes list``: the nodes spikeops drained, each with its lifecycle state and
    next step (the scheduler's list alone, said so, when the ledger cannot be read)."""
    from datetime import UTC, datetime

    from spikeops.ledger.url import LedgerError
    from spikeops.lifecycle.plan import incident_of_reason

    now = datetime.now(UTC)
    with open_life(args) as life:
        try:
            views = life.survey(now=now)
            rows = [view.to_json(now) for view in views]
        except LedgerError as exc:  # the scheduler's answer is still worth printing
            err.write(f"spikeops nodes list: no lifecycle states ({str(exc).splitlines()[0][:300]})\n")
            rows = [{"node": n.name, "scheduler_state": n.state, "reason": n.reason, "lifecycle": None, "next": None}
                    for n in life.scheduler.drained()]
    for row in rows:
        row["state"] = row["scheduler_state"]  # the field's name before the lifecycle
        row["incident"] = incident_of_reason(row.get("reason"))
    if args.json:
        out.write(json.dumps(rows, indent=2) + "\n")
    elif not rows:
        out.write("no node is drained by spikeops\n")
    else:
        for row in rows:
            step = row.get("next") or {}
            out.write(f"{row['node']:20} {row['scheduler_state']:24} {row['lifecycle'] or '-':18} "
                      f"{step.get('action') or '-':13} {row['reason']}\n")
            if step.get("why"):
                out.write(f"{'':20} next: {step['action']}: {step['why']}\n")
    return EXIT_OK
