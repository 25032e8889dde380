"""What convicted a node, in the terms its return to service needs: which Xids, which GPUs,
and whether a reset (a reboot) can clear the fault.

A GPU reset or a reboot is the documented remedy for a class of faults, and the only way to
tell whether the hardware is really broken: NVIDIA's Xid catalogue says "reset the GPU" for
79 (fallen off the bus), 48 (a double-bit ECC error), 94/95 (contained and uncontained ECC
errors), and 63/64 leave a row remap *pending* until the GPU is reset; a GPU gone from the bus
without any Xid line (the driver could not even report it) stays gone until the node is
reset. Those are **reset-class**: the node is rebooted (into its drain) before it is
validated. Anything else (an application Xid, an ECC count that keeps growing, a flapping IB
link, a thermal problem) a reboot does not fix, and validation alone judges it.

``conviction_evidence`` reads what the incident's diagnosis said about the node: the evidence
lines of the findings that name it (the kernel log's Xid lines are quoted there), and the
node's ``nvidia-smi -q`` from the bundle (remapped rows pending). It is pure: the ledger keeps
its result with the conviction, and the lifecycle decides from that record, never by
re-reading a bundle that may have moved.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

__all__ = ["RESET_XIDS", "REMAP_XIDS", "ConvictionEvidence", "conviction_evidence", "reset_reason"]

#: Xids a GPU reset (a reboot) is the remedy for, with what each is.
RESET_XIDS = {79: "GPU fallen off the bus", 48: "double-bit ECC error", 94: "contained ECC error",
              95: "uncontained ECC error"}
#: Xids that are reset-class only while a row remap is pending (the remap needs a reset).
REMAP_XIDS = {63: "ECC page retirement or row remapping recorded", 64: "ECC page retirement or row remap failure"}
#: The words of a GPU lost without an Xid (nvidia-smi and the kernel log say it this way).
_LOST = ("fallen off the bus", "gpu is lost", "unable to determine the device handle", "gpu has fallen",
         "not responding", "reset required", "probe failed", "rminitadapter failed")
_XID_IN_TEXT = re.compile(r"NVRM: Xid \((?:PCI:)?(?P<pci>[0-9A-Fa-f:.]+)[^)]*\):\s*(?P<code>\d+)")
#: Diagnosis causes that rest on a GPU's own state.
_GPU_CAUSES = ("gpu_xid", "gpu_ecc", "thermal_throttle", "silent_data_corruption")


@dataclass(frozen=True)
class ConvictionEvidence:
    """What convicted one node in one incident (kept as the ledger conviction's ``evidence``)."""

    node: str
    cause: str | None
    xids: tuple[int, ...] = ()
    #: The GPUs named (kernel PCI form, ``0000:19:00``).
    gpus: tuple[str, ...] = ()
    #: A GPU reported lost (off the bus, not responding) with no Xid saying so.
    gpu_lost: bool = False
    #: GPUs whose remapped rows were pending a reset in the incident's nvidia-smi.
    remap_pending: tuple[str, ...] = ()
    #: The findings' own words (one line each, at most three).
    summary: tuple[str, ...] = field(default_factory=tuple)
    #: Why a reboot can clear it (None: not reset-class).
    reset: str | None = None

    def to_json(self) -> dict[str, Any]:
        return {"cause": self.cause, "xids": list(self.xids), "gpus": list(self.gpus), "gpu_lost": self.gpu_lost,
                "remap_pending": list(self.remap_pending), "summary": list(self.summary), "reset": self.reset}

    @classmethod
    def from_json(cls, node: str, document: Any) -> ConvictionEvidence:
        """Read it back from the ledger (anything unreadable is simply absent)."""
        doc = document if isinstance(document, Mapping) else {}

        def strings(key: str) -> tuple[str, ...]:
            value = doc.get(key)
            return tuple(str(v) for v in value if isinstance(v, str | int)) if isinstance(value, list) else ()

        xids = tuple(int(v) for v in doc.get("xids") or () if isinstance(v, int) and not isinstance(v, bool))
        reset = doc.get("reset") if isinstance(doc.get("reset"), str) else None
        return cls(node, doc.get("cause") if isinstance(doc.get("cause"), str) else None, xids, strings("gpus"),
                   doc.get("gpu_lost") is True, strings("remap_pending"), strings("summary"), reset)

    def describe(self) -> str:
        parts = [self.cause or "unknown cause"]
        if self.xids:
            parts.append("Xid " + ", ".join(str(x) for x in self.xids))
        if self.gpu_lost:
            parts.append("a GPU lost")
        if self.remap_pending:
            parts.append("row remap pending on " + ", ".join(self.remap_pending))
        return "; ".join(parts)


def reset_reason(xids: Iterable[int], *, gpu_lost: bool, remap_pending: bool) -> str | None:
    """Why a reboot is the remedy, or None when it is not (module docstring)."""
    codes = sorted(set(xids))
    named = [f"Xid {code} ({RESET_XIDS[code]})" for code in codes if code in RESET_XIDS]
    if named:
        return "; ".join(named) + ": a GPU reset clears it, or shows it is permanent"
    remap = [code for code in codes if code in REMAP_XIDS]
    if remap and remap_pending:
        return (f"Xid {', '.join(str(c) for c in remap)} with a row remap pending: the remap takes effect only "
                "after a GPU reset")
    if gpu_lost and not codes:
        return "a GPU lost without an Xid: it stays gone until the node is reset"
    return None


def _findings_of(node: str, diagnosis: Mapping[str, Any]) -> list[Mapping[str, Any]]:
    primary = (diagnosis.get("primary") or {}).get("cause")
    out = []
    for finding in diagnosis.get("findings") or []:
        if not isinstance(finding, Mapping) or node not in (finding.get("nodes") or []):
            continue
        if finding.get("cause") == "inconclusive" or float(finding.get("confidence") or 0) < 0.5:
            continue
        if finding.get("layer") == "hardware" or finding.get("cause") == primary:
            out.append(finding)
    return out


def conviction_evidence(node: str, diagnosis: Mapping[str, Any], smi_report: Any = None) -> ConvictionEvidence:
    """What the diagnosis convicted ``node`` on (module docstring); ``smi_report``: the node's
    ``nvidia-smi -q`` in the incident's bundle, parsed (None when there was none)."""
    from spikeops.probes.kernel_log import normalize_pci

    findings = _findings_of(node, diagnosis)
    cause = (diagnosis.get("primary") or {}).get("cause")
    if findings and cause not in {f.get("cause") for f in findings}:
        cause = findings[0].get("cause")
    xids: set[int] = set()
    gpus: set[str] = set()
    lost = False
    for finding in findings:
        texts = [str(line.get("text") or "") for line in finding.get("evidence") or [] if isinstance(line, Mapping)]
        texts.append(str(finding.get("summary") or ""))
        for text in texts:
            for match in _XID_IN_TEXT.finditer(text):
                xids.add(int(match["code"]))
                pci = normalize_pci(match["pci"])
                if pci:
                    gpus.add(pci)
            if finding.get("cause") in _GPU_CAUSES and any(word in text.lower() for word in _LOST):
                lost = True
    pending = sorted(gpu.pci for gpu in getattr(smi_report, "gpus", None) or []
                     if gpu.pci and gpu.remapped_rows is not None and gpu.remapped_rows.pending)
    # a "lost" GPU with an Xid is the Xid's story (79 says it); lost alone is its own class
    gpu_lost = lost and not xids
    summary = tuple(str(f.get("summary") or "")[:300] for f in findings[:3])
    reset = reset_reason(xids, gpu_lost=gpu_lost, remap_pending=bool(pending)) if cause in _GPU_CAUSES else None
    return ConvictionEvidence(node, cause, tuple(sorted(xids)), tuple(sorted(gpus)), gpu_lost, tuple(pending),
                              summary, reset)
