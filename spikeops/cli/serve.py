"""``spikeops serve``, ``spikeops worker`` and ``spikeops config check``: running spikeops
on an orchestrator host (the Prefect side is imported only when one of them runs)."""

from __future__ import annotations

import argparse
from typing import Any, TextIO

from spikeops.cli.common import EXIT_OK, EXIT_USAGE

from spikeops.errors import InputError

__all__ = ["add_serve", "add_worker", "add_config"]


def _cmd_config_check(args: argparse.Namespace, out: TextIO, err: TextIO) -> int:
    from spikeops.config import check_config, load_config

    config = load_config(args.config)
    if config.path is None:
        err.write("spikeops config check: no spikeops.toml here (--config FILE or $SPIKEOPS_CONFIG)\n")
        return EXIT_USAGE
    problems = check_config(config) + ([] if config.clusters else ["no [clusters.NAME] configured"])
    for problem in problems:
        err.write(f"spikeops config check: {config.path}: {problem}\n")
    if problems:
        return EXIT_USAGE
    out.write(f"{config.path}: ok ({len(config.clusters)} cluster(s): {', '.join(config.clusters)}; "
              f"incidents in {config.incidents_dir}, at most {config.max_concurrent} at once; "
              f"receiver {config.receiver_addr})\n")
    return EXIT_OK


def _cmd_serve(args: argparse.Namespace, out: TextIO, err: TextIO) -> int:
    from spikeops.config import check_config, load_config

    config = load_config(args.config)
    if not config.clusters:
        err.write("spikeops serve: no [clusters.NAME] configured (spikeops.toml or --config; docs/flow.md)\n")
        return EXIT_USAGE
    # The receiver alone never touches a cluster: the inventories live with the workers.
    problems = [] if args.receiver_only else check_config(config)
    if problems:  # refuse now: the first alert would otherwise fail
        err.write(f"spikeops serve: {config.path}: {problems[0]}"
                  + (f" (and {len(problems) - 1} more: spikeops config check)" if len(problems) > 1 else "") + "\n")
        return EXIT_USAGE
    # The Prefect side lives outside the core (deployments/), imported only for this command.
    from spikeops.deployments.local_server import prefect_api
    from spikeops.deployments.serve import serve, serve_receiver

    def say(line: str) -> None:
        out.write(f"spikeops serve: {line}\n")
        out.flush()

    addr = args.addr or config.receiver_addr
    try:
        with prefect_api(config.prefect_home, config.prefect_port, say=say) as api:
            if args.receiver_only:
                out.write(f"serving the alert receiver on http://{addr}/alerts/...: each alert starts "
                          f"incident-response/CLUSTER on its cluster's work pool (clusters: "
                          f"{', '.join(config.clusters)}; Prefect API {api})\n")
            else:
                out.write(f"serving the incident flow and the alert receiver on http://{addr}/alerts/... "
                          f"(clusters: {', '.join(config.clusters)}; Prefect API {api})\n")
            out.flush()
            if args.receiver_only:
                serve_receiver(config, addr)
            else:
                serve(config, addr, warm_start=not args.cold_start)
    except ValueError as exc:
        err.write(f"spikeops serve: {exc}\n")
        return EXIT_USAGE
    return EXIT_OK


def _cmd_worker(args: argparse.Namespace, out: TextIO, err: TextIO) -> int:
    from spikeops.deployments.local_server import configured_api

    if not configured_api():
        err.write("spikeops worker: no PREFECT_API_URL: a worker needs the Prefect server its pool lives on\n")
        return EXIT_USAGE
    if args.limit is not None and args.limit < 1:
        raise InputError("--limit: at least 1")
    from spikeops.deployments.warm_worker import run_worker

    def say(line: str) -> None:
        out.write(f"{line}\n")
        out.flush()

    run_worker(args.pool, name=args.name, limit=args.limit, warm=not args.cold_start, say=say)
    return EXIT_OK


def add_serve(commands: Any) -> None:
    served = commands.add_parser(
        "serve",
        help="serve the incident flow's deployment and the alert receiver",
        description=(
            "Serve the incident-response deployment (prefect serve) and the alert receiver "
            "(POST /alerts/alertmanager, /alerts/grafana, /alerts/generic) in one process. "
            "Alerts are mapped to flow parameters through spikeops.toml; each alert occurrence "
            "starts one flow run. Set SPIKEOPS_RECEIVER_TOKEN or SPIKEOPS_RECEIVER_HMAC_KEY to "
            "listen beyond loopback; PREFECT_API_URL names the Prefect server."
        ),
    )
    served.add_argument("--config", help="spikeops.toml (default $SPIKEOPS_CONFIG or ./spikeops.toml)")
    served.add_argument("--addr", help="receiver HOST:PORT (default [receiver] addr or 127.0.0.1:8787)")
    served.add_argument("--receiver-only", action="store_true",
                        help="the receiver alone, no flow runner here: each alert starts its cluster's deployment "
                             "incident-response/CLUSTER, run by that cluster's workers (infra/prefect/up; "
                             "docs/scaleout.md)")
    served.add_argument("--cold-start", action="store_true",
                        help="start each incident run in a new interpreter (Prefect's spawn) instead of forking it "
                             "from a process that imported the flow when serve started (3-4 s sooner; docs/flow.md)")
    served.set_defaults(handler=_cmd_serve)


def add_worker(commands: Any) -> None:
    worker = commands.add_parser(
        "worker",
        help="a work-pool worker that starts spikeops' flows warm (the scale-out layout)",
        description=(
            "Poll a Prefect process work pool (PREFECT_API_URL) and run its flow runs, like "
            "`prefect worker start --type process`, except that runs of spikeops' own flows are "
            "forked from an interpreter that imported Prefect and the flows when the worker started, "
            "instead of `python -m prefect.engine` importing them again for every run. Other flows on "
            "the pool run as Prefect's worker runs them. SPIKEOPS_CONFIG names the configuration the "
            "flows read (docs/scaleout.md)."
        ),
    )
    worker.add_argument("--pool", required=True, help="the work pool, e.g. spikeops-east")
    worker.add_argument("--name", help="the worker's name (default: Prefect's)")
    worker.add_argument("--limit", type=int, default=None, help="flow runs this worker runs at once (default: no limit)")
    worker.add_argument("--cold-start", action="store_true", help="start every run with python -m prefect.engine")
    worker.set_defaults(handler=_cmd_worker)


def add_config(commands: Any) -> None:
    configured = commands.add_parser("config", help="check spikeops.toml",
                                     description="Check spikeops.toml: every key's type and range, each "
                                                 "cluster's inventory, what a scheduler needs. Exit 0 when it "
                                                 "is usable, 2 with one line per problem.")
    config_actions = configured.add_subparsers(dest="config_action", metavar="ACTION", required=True)
    check = config_actions.add_parser("check", help="check the file; one line per problem")
    check.add_argument("--config", help="spikeops.toml (default $SPIKEOPS_CONFIG or ./spikeops.toml)")
    check.set_defaults(handler=_cmd_config_check)
