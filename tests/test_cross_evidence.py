"""Keys that join evidence from different tools agree, so the diagnosis can match them.

An Xid line names its GPU as ``PCI:0000:5d:00``; nvidia-smi as ``00000000:5D:00.0``; NCCL as
``busId 5d000``. The hardware layer convicts a node by joining them, so the two parsers'
normal forms must be identical for every spelling.
"""

from __future__ import annotations

import pytest

from spikeops.probes.kernel_log import normalize_pci
from spikeops.probes.nvidia_smi import normalise_bus_id
from spikeops.probes import kernel_log, nvidia_smi
from tests.conftest import real_text


@pytest.mark.parametrize(
    "spelling",
    ["00000000:5D:00.0", "0000:5d:00.0", "PCI:0000:5d:00", "0000:5d:00", "00000000:9B:00.0", "0000:10:1c"],
)
def test_kernel_and_nvidia_smi_pci_forms_agree(spelling):
    smi = normalise_bus_id(spelling.removeprefix("PCI:"))
    assert smi is not None
    assert normalize_pci(spelling) == smi[1]


def test_xid63_line_joins_its_gpu_in_nvidia_smi():
    xid = kernel_log.parse(real_text("xid/xid63-row-remapper-a100_ml-engineering.txt")).xids[0]
    report = nvidia_smi.parse_q(real_text("nvidia-smi/a100-sxm4-80gb-q-ecc-remap-pending_ml-engineering.txt"))
    gpu = report.gpu_by_pci(xid.pci)
    assert gpu is not None
    assert gpu.remapped_rows.pending is True
