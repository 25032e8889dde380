"""Prefect flows: the incident pipeline (protect, snapshot, collect, diagnose, isolate,
resume, notify), composed from ``tasks``. Empty until the incident flow issue."""

__all__: list[str] = []
