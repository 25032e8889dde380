"""A process work-pool worker whose runs of spikeops' flows start warm (``spikeops worker``).

Prefect's process worker starts every flow run with ``python -m prefect.engine``: a new
interpreter that imports Prefect (2-3 s of CPU on a small machine), loads the flow from its
entrypoint and only then runs the first stage. That is the scale-out layout's start-up cost on
every alert, paid on the cores the collection needs next.

``WarmProcessWorker`` is that same worker (it serves ordinary ``process`` pools, with their job
templates, limits, heartbeats and cancellation) with one change: a run of a deployment whose
entrypoint is one of spikeops' own flows, by module (``spikeops.flows.…``), is started the way
``spikeops serve`` starts its served runs. The flow object is taken from the worker's memory
and the run is forked from a ``forkserver`` that imported Prefect's engine and the flows when
the worker started (``spikeops.deployments.warm_start``), through Prefect's own
``run_flow_in_subprocess``, which builds the run's environment and settings in the child as for
any subprocess run. The job's environment (the pool's ``env`` job variable and the worker's
environment) reaches the run as it would through the engine command. Anything else (another
team's flow on the same pool, a job template with its own ``command``, a platform without a
forkserver) goes through Prefect's own path unchanged.
"""

from __future__ import annotations

import contextlib
import tempfile
import warnings
from collections.abc import Callable
from typing import Any

import anyio
import anyio.abc
from prefect.flow_engine import run_flow_in_subprocess
from prefect.runner._flow_run_executor import FlowRunExecutionResult, FlowRunExecutorContext
from prefect.runner._process_manager import ProcessHandle
from prefect.workers.process import ProcessJobConfiguration, ProcessWorker, ProcessWorkerResult

__all__ = ["WarmProcessWorker", "WarmStarter", "our_flow", "run_worker", "FLOW_PREFIX"]

#: The entrypoints a warm worker starts itself: spikeops' own flows, named by module.
FLOW_PREFIX = "spikeops.flows."


def our_flow(entrypoint: str | None) -> Any:
    """The flow object of a spikeops entrypoint (``spikeops.flows.m.f`` or ``spikeops.flows.m:f``),
    imported in this process; None for any other entrypoint or one that does not load."""
    import importlib

    entrypoint = (entrypoint or "").strip()
    if not entrypoint.startswith(FLOW_PREFIX):
        return None
    module, colon, name = entrypoint.rpartition(":")
    if not colon:
        module, _, name = entrypoint.rpartition(".")
    try:
        flow = getattr(importlib.import_module(module), name, None)
    except Exception:  # noqa: BLE001 - not ours to start warm: Prefect's own path reports it
        return None
    return flow if hasattr(flow, "fn") and hasattr(flow, "name") else None


class WarmStarter:
    """Starts one flow run as a child of the warm forkserver (Prefect's ``run_flow_in_subprocess``),
    with the job's environment, the deployment's name, and the worker's control channel for
    cancellation: what Prefect's direct starter does for served runs, plus the job's env."""

    def __init__(self, *, flow: Any, env: dict[str, str | None], deployment_name: str | None,
                 control_channel: Any = None) -> None:
        self._flow, self._env, self._deployment_name = flow, env, deployment_name
        self._control_channel = control_channel

    async def start(self, flow_run: Any,
                    task_status: anyio.abc.TaskStatus[ProcessHandle] = anyio.TASK_STATUS_IGNORED) -> None:
        env: dict[str, str | None] = {**self._env, "PREFECT__DEPLOYMENT_NAME": self._deployment_name}
        registered = False
        if self._control_channel is not None:
            try:
                port, token = self._control_channel.register(flow_run.id)
                env.update({"PREFECT__CONTROL_PORT": str(port), "PREFECT__CONTROL_TOKEN": token})
                registered = True
            except RuntimeError:  # no loopback listener: Prefect's kill-only cancellation
                pass
        handed_off = False
        try:
            process = run_flow_in_subprocess(self._flow, flow_run=flow_run, env=env)
            handle = ProcessHandle(process)
            task_status.started(handle)
            handed_off = True
            await anyio.to_thread.run_sync(process.join)
        except BaseException:
            if registered and not handed_off:
                self._control_channel.unregister(flow_run.id)
            raise


class WarmProcessWorker(ProcessWorker):
    """A ``process`` worker that starts spikeops' own flows warm (module docstring)."""

    type = "process"
    _description = "Process worker that forks runs of spikeops' flows from a warm interpreter."

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._entrypoints: dict[Any, tuple[str | None, str | None]] = {}
        self.warm = False

    async def _deployment_of(self, flow_run: Any) -> tuple[str | None, str | None]:
        """(entrypoint, deployment name) of the run's deployment, read once per deployment."""
        if flow_run.deployment_id is None:
            return None, None
        if flow_run.deployment_id not in self._entrypoints:
            try:
                deployment = await self.client.read_deployment(flow_run.deployment_id)
                self._entrypoints[flow_run.deployment_id] = (deployment.entrypoint, deployment.name)
            except Exception:  # noqa: BLE001 - unknown: Prefect's own path
                return None, None
        return self._entrypoints[flow_run.deployment_id]

    async def run(self, flow_run: Any, configuration: ProcessJobConfiguration,
                  task_status: anyio.abc.TaskStatus[int] | None = None) -> ProcessWorkerResult:
        entrypoint, deployment_name = await self._deployment_of(flow_run)
        flow = our_flow(entrypoint) if self.warm and not configuration._command_configured else None
        if flow is None:
            return await super().run(flow_run, configuration, task_status)
        if task_status is None:
            task_status = anyio.TASK_STATUS_IGNORED
        self._logger.info(f"Starting flow run {flow_run.id} warm ({entrypoint}, forked from the worker's forkserver)")
        working_dir = (tempfile.TemporaryDirectory(suffix="spikeops") if not configuration.working_dir
                       else contextlib.nullcontext(configuration.working_dir))
        execution: FlowRunExecutionResult | None = None
        with working_dir, warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            async with FlowRunExecutorContext() as ctx:
                starter = WarmStarter(flow=flow, env=dict(configuration.env), deployment_name=deployment_name,
                                      control_channel=ctx.control_channel)

                async def resolve(_run: Any) -> Any:
                    return flow

                executor = ctx.create_executor(flow_run, starter, resolve_flow=resolve, propose_submitting=False)

                async def execute(*, task_status: anyio.abc.TaskStatus[ProcessHandle] = anyio.TASK_STATUS_IGNORED
                                  ) -> None:
                    nonlocal execution
                    execution = await executor.submit(task_status=task_status)

                async with anyio.create_task_group() as group:
                    handle = await group.start(execute)
                    if handle.pid is None:
                        raise RuntimeError("Flow run process has no PID")
                    task_status.started(handle.pid)
        if execution is None or execution.status_code is None:
            raise RuntimeError("Failed to start flow run process.")
        return ProcessWorkerResult(status_code=execution.status_code, identifier=str(execution.handle.pid))


def run_worker(pool: str, *, name: str | None = None, limit: int | None = None, warm: bool = True,
               say: Callable[[str], None] = print) -> None:
    """Run a ``WarmProcessWorker`` on ``pool`` until it is stopped (SIGINT/SIGTERM). With ``warm``
    the forkserver is started first, importing Prefect's engine and spikeops' flows once."""
    import asyncio
    import signal

    from prefect.settings import PREFECT_WORKER_HEARTBEAT_SECONDS

    from spikeops.deployments import warm_start

    started = warm and warm_start.enable()
    if warm and not started:
        say("spikeops worker: this Prefect or platform has no forkserver hook; runs start cold")

    async def main() -> None:
        async with WarmProcessWorker(name=name, work_pool_name=pool, limit=limit,
                                     heartbeat_interval_seconds=int(PREFECT_WORKER_HEARTBEAT_SECONDS.value()),
                                     create_pool_if_not_found=False) as worker:
            worker.warm = started
            say(f"spikeops worker {worker.name!r} polling pool {pool!r}; runs of spikeops' flows start "
                + ("warm (forked from the worker's forkserver)" if started else "cold (python -m prefect.engine)"))
            await worker.start(printer=say)

    def stop(_signum: int, _frame: Any) -> None:
        raise KeyboardInterrupt  # asyncio.run cancels the worker's loops; the runs' children are its own

    signal.signal(signal.SIGTERM, stop)
    try:
        asyncio.run(main())
    except (KeyboardInterrupt, asyncio.CancelledError):
        say("spikeops worker: stopped")
