"""Served incident runs start in an interpreter that has already imported Prefect and the flow.

Prefect's runner starts each served flow run as a ``spawn`` child: a new interpreter that imports
Prefect and the flow before it does anything, 3-4 s on a small machine (``import prefect`` alone
is 2-3 s) and more under load, paid by every alert before its first stage. ``enable`` points the
runner at a ``forkserver`` whose server process imported those modules once, when ``spikeops
serve`` started: each run is then a fork of it, ready in milliseconds.

What a run sees is what a spawned one sees. Prefect's own wrapper (``run_flow_in_subprocess``)
still builds the run's environment and settings inside the child from the runner's, exactly
as for ``spawn``; the server process was started from ``spikeops serve``'s environment, which a
spawned child inherits too. The server is single-threaded (it starts no thread of its own and
Prefect starts none at import), so a fork of it is safe where a fork of ``serve`` (an event
loop, the receiver's threads) would not be. Prefect documents the hook: the direct starter
calls its module-level ``run_flow_in_subprocess`` "-- patch the module to override".

``spikeops serve`` uses it for its served runs, and ``spikeops worker``
(``spikeops.deployments.warm_worker``) for the runs a work pool gives it, which Prefect's own
process worker would start with ``python -m prefect.engine``. ``--cold-start`` keeps Prefect's
own spawn in both.
"""

from __future__ import annotations

import multiprocessing
import types
from collections.abc import Sequence
from typing import Any

__all__ = ["PRELOAD", "enable", "enabled"]

#: What the server process imports before it forks a run: Prefect's engine, our flows, and what
#: their stages import on first use (the diagnosis and pandas alone are a second of CPU that
#: classify paid inside every incident, while the nodes were answering on the same cores).
PRELOAD = ("prefect.flow_engine", "spikeops.flows.incident_response", "spikeops.flows.baselines", "spikeops.diagnosis",
           "spikeops.diagnosis.engine", "spikeops.collect.collector", "spikeops.schedulers", "spikeops.notify",
           "spikeops.notify.report", "spikeops.notify.plot", "spikeops.replay", "spikeops.response",
           # the ledger is read before preflight: SQLAlchemy and Alembic are most of a second
           "spikeops.ledger.store", "alembic.command")

class _ForkserverModule(types.ModuleType):
    """``multiprocessing`` as ``prefect.flow_engine`` sees it: the same module, except that the
    context it asks for (``spawn``) is the forkserver's."""

    def __init__(self, context: Any) -> None:
        super().__init__("multiprocessing")
        self._context = context

    def get_context(self, method: str | None = None) -> Any:
        return self._context

    def __getattr__(self, name: str) -> Any:
        return getattr(multiprocessing, name)


def enable(preload: Sequence[str] = PRELOAD) -> bool:
    """Start the forkserver now (it imports ``preload`` once) and make the runner fork served
    runs from it. False, and Prefect's spawn kept, when this Prefect has no such hook or the
    platform no forkserver."""
    if enabled():
        return True
    try:
        from prefect import flow_engine
        from prefect.runner import _starter_direct
    except ImportError:
        return False
    if not hasattr(_starter_direct, "run_flow_in_subprocess") or not hasattr(flow_engine, "run_flow_in_subprocess") \
            or "forkserver" not in multiprocessing.get_all_start_methods():
        return False
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload([module for module in preload if _importable(module)])
    from multiprocessing import forkserver

    forkserver.ensure_running()  # the imports happen here, before the first alert, not in it
    flow_engine.multiprocessing = _ForkserverModule(context)  # type: ignore[attr-defined]
    return True


def enabled() -> bool:
    """Whether served runs are forked from the warm server process."""
    from prefect import flow_engine

    return isinstance(getattr(flow_engine, "multiprocessing", None), _ForkserverModule)


def _importable(module: str) -> bool:
    import importlib.util

    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False
