"""Evidence parsers, one module per kind of tool output.

Modules register their kinds on import; ``registry()`` imports every module in this
package once, so a new parser is picked up without editing this file.
"""

from __future__ import annotations

import importlib
import pkgutil

from spikeops.probes.base import Gap, Kind, register
from spikeops.probes.base import _registry as _raw_registry

__all__ = ["Gap", "Kind", "register", "registry", "get_kind", "detect_kind", "kind_names"]

_loaded = False


def _load_all() -> None:
    global _loaded
    if _loaded:
        return
    for module in pkgutil.iter_modules(__path__):
        if not module.name.startswith("_") and module.name != "base":
            importlib.import_module(f"{__name__}.{module.name}")
    _loaded = True


def registry() -> dict[str, Kind]:
    """Every registered kind by name (aliases included)."""
    _load_all()
    return dict(_raw_registry())


def kind_names() -> list[str]:
    """Canonical kind names, sorted, without aliases."""
    return sorted({kind.name for kind in registry().values()})


def get_kind(name: str) -> Kind | None:
    return registry().get(name)


def detect_kind(sample: str | bytes) -> list[tuple[float, Kind]]:
    """Kinds that claim ``sample``, best first; empty when nobody does. A ``bytes`` sample
    (a head that is not text) is judged by the kinds that read binary formats."""
    scored: dict[str, tuple[float, Kind]] = {}
    binary = isinstance(sample, bytes)
    for kind in registry().values():
        if kind.name in scored or (binary and kind.detect_bytes is None):
            continue
        try:
            score = float(kind.detect_bytes(sample) if binary else kind.detect(sample))  # type: ignore[misc,arg-type]
        except Exception:  # a detector bug must not hide the other kinds
            score = 0.0
        if score > 0:
            scored[kind.name] = (score, kind)
    return sorted(scored.values(), key=lambda pair: (-pair[0], pair[1].name))
