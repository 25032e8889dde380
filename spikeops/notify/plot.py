"""The incident plot: the training curves around the spike, with what the diagnosis found.

One PNG, four stacked panels sharing the step axis (loss, grad norm, learning rate, loss
scale; a panel whose series was not logged is left out), the onset, the spike and the
chosen checkpoint marked on every panel, so a person sees in one glance whether the trouble
started before the spike and where the run will resume. Rendered headless (Agg).
"""

from __future__ import annotations

import io
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

__all__ = ["plot_incident", "metrics_frame", "WINDOW"]

#: Steps shown before the onset and after the spike.
WINDOW = 200


def metrics_frame(bundle: Any) -> Any | None:
    """The bundle's step table (pandas), or None when it has no readable metrics."""
    from spikeops.probes.training_log import to_frame

    reading = bundle.metrics()
    if reading is None or not getattr(reading.result, "records", None):
        return None
    return to_frame(reading.result.records)


def _window(frame: Any, diagnosis: Mapping[str, Any]) -> Any:
    steps = [s for s in (diagnosis.get("onset_step"), diagnosis.get("spike_step"),
                         (diagnosis.get("resume_from") or {}).get("step")) if isinstance(s, int)]
    if not steps:
        return frame.tail(4 * WINDOW)
    low, high = min(steps) - WINDOW, max(steps) + WINDOW
    return frame[(frame["step"] >= low) & (frame["step"] <= high)]


def plot_incident(frame: Any, diagnosis: Mapping[str, Any], *, title: str = "",
                  path: str | Path | None = None) -> bytes:
    """Render the plot; returns the PNG bytes (and writes them to ``path`` when given)."""
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    view = _window(frame, diagnosis)
    series = [(col, label) for col, label in (("loss", "loss"), ("grad_norm", "grad norm"), ("lr", "learning rate"),
                                              ("loss_scale", "loss scale"))
              if col in view and view[col].notna().any()]
    if not series:
        series = [("loss", "loss")]
    fig, axes = plt.subplots(len(series), 1, sharex=True, figsize=(9, 1.9 * len(series) + 0.8), dpi=110,
                             squeeze=False)
    marks = [("onset", diagnosis.get("onset_step"), "#e67e22", "--"),
             ("spike", diagnosis.get("spike_step"), "#c0392b", "-"),
             ("resume checkpoint", (diagnosis.get("resume_from") or {}).get("step"), "#27ae60", ":")]
    for axis, (column, label) in zip(axes[:, 0], series):
        values = view[column].astype(float) if column in view else []
        finite = [v for v in values if isinstance(v, float) and math.isfinite(v)]
        axis.plot(view["step"], values, lw=1.0, color="#2c3e50")
        if column == "loss" and "nan" in view:
            nan_steps = view.loc[view["nan"].fillna(False).astype(bool), "step"]
            if len(nan_steps):
                top = max(finite) if finite else 1.0
                axis.scatter(nan_steps, [top] * len(nan_steps), marker="x", color="#c0392b", s=14, label="NaN")
        if column in ("loss_scale", "lr") and finite and min(finite) > 0 and max(finite) / min(finite) > 100:
            axis.set_yscale("log")
        axis.set_ylabel(label, fontsize=8)
        axis.tick_params(labelsize=7)
        axis.grid(alpha=0.25)
        for name, step, color, style in marks:
            if isinstance(step, int):
                axis.axvline(step, color=color, ls=style, lw=1.1, label=name)
    handles, labels = axes[0, 0].get_legend_handles_labels()
    if handles:
        axes[0, 0].legend(handles, labels, fontsize=7, loc="upper left", ncol=4)
    axes[-1, 0].set_xlabel("step", fontsize=8)
    primary = diagnosis.get("primary") or {}
    fig.suptitle(title or f"{diagnosis.get('symptom', '')}: {primary.get('cause', '')}", fontsize=10)
    fig.tight_layout()
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png")
    plt.close(fig)
    data = buffer.getvalue()
    if path is not None:
        from spikeops.bundle import atomic_write

        atomic_write(Path(path), data)
    return data
