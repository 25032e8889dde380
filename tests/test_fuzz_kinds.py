"""Every registered parser, detector and summary survives arbitrary input.

Each parser module fuzzes itself too; this sweep catches a kind whose author forgot, and
checks the contract the CLI and the diagnosis rely on: ``parse`` returns a result with a
``gaps`` list, ``detect`` a score in [0, 1], and ``summarize`` a list of strings, whatever
the bytes were (binary garbage decoded as Latin-1, truncated lines, control characters).
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from spikeops.probes import kind_names, registry

KINDS = kind_names()

garbage = st.one_of(
    st.text(max_size=3000),
    st.binary(max_size=3000).map(lambda raw: raw.decode("latin-1")),
    st.lists(
        st.sampled_from([
            "NVRM: Xid (PCI:0000:", " iteration 5/ 10 | lm loss: nan |", "NCCL WARN", "CA 'mlx5_0'",
            "NIC statistics:", "GPU 00000000:19:00.0", "    ECC Errors", "{\"step\": 1, \"loss\":",
            "NodeName=", "| GPU Memory | Fail - GPU: 0 |", "\t\tState: Active", "[12.5] ", "> ",
            "==============NVSMI LOG==============", "<nvidia_smi_log>", "<gpu id=", "REASON ", ":", "\x00",
        ]),
        max_size=60,
    ).map("\n".join),
)


@pytest.mark.parametrize("name", KINDS)
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(text=garbage)
def test_parse_detect_summarize_never_raise(name, text):
    kind = registry()[name]
    score = kind.detect(text)
    assert 0.0 <= float(score) <= 1.0
    source = iter(text.splitlines()) if kind.streaming else text
    result = kind.parse(source)
    assert isinstance(getattr(result, "gaps", []), list)
    summary = kind.summarize(result)
    assert isinstance(summary, list) and all(isinstance(line, str) for line in summary)
