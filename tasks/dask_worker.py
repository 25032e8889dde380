"""What a Dask worker needs before it runs collection shards: its statistical profiler off.

On Python 3.11 a Dask worker running the shards can deadlock for good (CPython gh-106883,
reported to Dask as dask/distributed#8616; not fixed in 3.11, not seen on 3.12). The worker's
profiler (``distributed.worker.profile``, on by default) calls ``sys._current_frames()``
every 10 ms on the worker's event loop while a task runs. In 3.11 that call holds the
interpreter's thread-list lock (``HEAD_LOCK``) while it makes a frame object for each
thread; that allocation can start a garbage collection, the collection calls distributed's
own gc callback (Python code), and Python code may hand the GIL to another thread, the lock
still held. A shard starts and ends threads all the time (for every node paramiko's
transport thread and its handshake timer, plus the shard's fan-out pool), and starting or
ending a thread takes that lock with the GIL held. So the thread that got the GIL waits for
the lock, the event loop waits for the GIL, and every other thread of the worker waits for
the GIL behind them: no node finishes, no deadline fires, and the worker stops answering.

Seen in ``bench/bench_scaleout.py`` as the second 1,024-node collection hanging on a reused
worker (``docs/scaleout.md``); it is a race, so a first collection can hang too. The worker
process's own thread dump shows it: the event loop thread in ``take_gil`` under
``invoke_gc_callback`` under ``_PyThread_CurrentFrames``, one thread in ``new_threadstate``
(``Thread.start``) waiting for ``HEAD_LOCK``, and all the others in ``take_gil``.

``NoProfiler`` stops the profiler's periodic callback on every worker of the cluster, those
that join later included (``Client.register_plugin``); ``spikeops.tasks.collect.shard_runner``
registers it before the first shard is submitted. Dask's profile page then stays empty for
those workers. ``sys._current_frames()`` is also behind the dashboard's "call stack" of a
running task, which a person could still click during a collection: rare, and on request.
"""

from __future__ import annotations

import sys
from typing import Any

from distributed.diagnostics.plugin import WorkerPlugin

__all__ = ["NoProfiler", "PROFILER_CALLBACK"]

#: The worker's periodic callback that samples every thread's stack (``Worker.trigger_profile``).
PROFILER_CALLBACK = "profile"


class NoProfiler(WorkerPlugin):
    """Stops the worker's statistical profiler where the interpreter has gh-106883 (< 3.12)."""

    name = "spikeops-no-profiler"
    idempotent = True

    def setup(self, worker: Any) -> None:
        # Runs on the worker's event loop, where its periodic callbacks run: no race with one.
        if sys.version_info >= (3, 12):
            return
        callback = worker.periodic_callbacks.get(PROFILER_CALLBACK)
        if callback is not None:
            callback.stop()
