"""The Xid/SXid catalog agrees with the diagnosis spec and NVIDIA's meanings."""

from __future__ import annotations

from hypothesis import given, strategies as st

from spikeops.probes import xid_catalog as cat

SPEC_GPU_IMPLICATING = {48, 62, 64, 74, 79, 92, 94, 95, 119, 120, 140}
SPEC_MEMORY_CLASS = {48, 63, 64, 92, 94, 95, 140}
SPEC_APPLICATION_CLASS = {13, 31, 43}
REQUIRED_CODES = {
    8, 13, 31, 32, 38, 43, 44, 45, 48, 56, 57, 58, 61, 62, 63, 64, 65, 68, 69, 73, 74, 79, 80,
    81, 92, 94, 95, 109, 110, 119, 120, 121, 122, 123, 136, 137, 140, 143, *range(144, 151),
    154, 155,
}


def test_sets_match_the_diagnosis_spec():
    assert cat.GPU_IMPLICATING == SPEC_GPU_IMPLICATING
    assert cat.MEMORY_CLASS == SPEC_MEMORY_CLASS
    assert cat.APPLICATION_CLASS == SPEC_APPLICATION_CLASS
    assert not cat.APPLICATION_CLASS & cat.GPU_IMPLICATING  # the job's fault never convicts a node


def test_table_covers_the_required_codes_once_each():
    codes = [row.code for row in cat.XID_TABLE]
    assert len(codes) == len(set(codes))
    assert REQUIRED_CODES <= set(codes)
    assert codes == sorted(codes)


def test_every_row_is_well_formed():
    for row in cat.XID_TABLE:
        assert row.category in cat.CATEGORIES - {"unknown"}, row
        assert row.name and row.description and row.action, row
        # memory category and the spec's memory class are the same rows
        assert (row.category == "memory") == row.memory_related, row


def test_key_meanings():
    assert cat.lookup(79).name == "GPU has fallen off the bus"
    assert cat.lookup(79).category == "hardware" and cat.lookup(79).action == "RESTART_BM"
    assert cat.lookup(48).name == "Double Bit ECC Error"
    assert cat.lookup(63).memory_related and not cat.lookup(63).implicates_gpu
    assert cat.lookup(74).category == "nvlink" and cat.lookup(74).implicates_gpu
    assert cat.lookup(119).name == "GSP RPC Timeout" and cat.lookup(119).action == "RESET_GPU"
    assert cat.lookup(13).category == "application" and not cat.lookup(13).implicates_gpu
    assert cat.lookup(54).category == "thermal_power"
    assert cat.lookup(80).category == "system"
    assert all(cat.lookup(code).category == "nvlink" for code in range(144, 151))


def test_unknown_codes_implicate_nothing():
    info = cat.lookup(4242)
    assert info.code == 4242
    assert info.category == "unknown"
    assert not info.implicates_gpu and not info.memory_related


def test_sxid_table():
    codes = [row.code for row in cat.SXID_TABLE]
    assert len(codes) == len(set(codes))
    assert {11004, 12028, 20034, 22013, 24007} <= set(codes)
    assert cat.lookup_sxid(20034).name == "LTSSM Fault Up"
    assert 20034 in cat.SXID_FATAL and 24007 in cat.SXID_FATAL
    assert {22013, 12028, 11004, 11012} <= cat.SXID_NON_FATAL
    assert cat.SXID_FATAL.isdisjoint(cat.SXID_NON_FATAL)
    assert cat.lookup_sxid(12020).always_fatal
    unknown = cat.lookup_sxid(99999)
    assert not unknown.fatal and unknown.name == "SXid 99999"


@given(st.integers())
def test_lookup_never_raises(code):
    assert cat.lookup(code).code == code
    assert cat.lookup_sxid(code).code == code
