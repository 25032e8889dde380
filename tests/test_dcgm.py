"""dcgmi diag: the table (wrapped messages, per-GPU results, cut excerpts) and the -j JSON."""

from __future__ import annotations

from hypothesis import given, strategies as st

from spikeops.probes import dcgm
from tests.conftest import real_text, synthetic_text

THERMAL = "dcgm/dcgmi-diag-r2-gpu-memory-fail-thermal_ml-engineering.txt"
ROW_REMAP = "dcgm/dcgmi-diag-deployment-row-remap-pending_ml-engineering.txt"
ALL_PASS = "dcgm/dcgmi-diag-r2-p4de-a100-all-pass_awsome-distributed-training.txt"
PCIE_FAIL = "dcgm/dcgmi-diag-r2-pcie-fail-cuda-driver-mismatch-8x-rtx3090_nolebase.txt"


def _test(diag: dcgm.DcgmDiag, name: str) -> dcgm.DcgmTest:
    return next(t for t in diag.tests if t.name == name)


def test_thermal_excerpt_rejoins_mid_word_wraps():
    diag = dcgm.parse_diag(real_text(THERMAL))
    memory = _test(diag, "GPU Memory")
    assert memory.section is None  # the excerpt starts mid-table, under no section header
    assert memory.line == 1
    assert [(r.status, r.gpus) for r in memory.results] == [("Pass", [1, 2, 3, 4, 5, 6, 7]), ("Fail", [0])]
    assert memory.status == "Fail"
    assert memory.messages == [
        "GPU 0 Thermal violations totaling 13.3 seconds started at 9.7 seconds into the test for "
        "GPU 0 Verify that the cooling on this machine is functional, including external, thermal "
        "material interface, fans, and any other components."
    ]
    warning = memory.message_details[0]
    assert (warning.kind, warning.line, warning.gpus) == ("Warning", 3, [0])
    assert diag.failed_gpus() == {0: ["GPU Memory", memory.messages[0]]}
    # the excerpt's last row lost its closing '|': read, and said so
    assert [g.line for g in diag.gaps] == [8]


def test_standalone_deployment_error_row():
    diag = dcgm.parse_diag(real_text(ROW_REMAP))
    assert len(diag.tests) == 1
    error = diag.tests[0]
    assert error.section == "Deployment"
    assert error.standalone
    assert [(r.status, r.gpus) for r in error.results] == [("Error", [3])]
    assert error.messages == ["GPU 3 has uncorrectable memory errors and row remappings are pending"]
    assert error.line == 5
    assert diag.failed_gpus() == {3: ["GPU 3 has uncorrectable memory errors and row remappings are pending"]}
    assert diag.gaps == []


def test_p4de_all_pass_metadata_and_sections():
    diag = dcgm.parse_diag(real_text(ALL_PASS))
    assert diag.dcgm_version == "3.3.3"
    assert diag.driver_version == "535.104.12"
    assert diag.gpu_device_ids == ["20b2"] * 8
    assert diag.sections == ["Metadata", "Deployment", "Integration", "Hardware", "Stress"]
    deployment = [t for t in diag.tests if t.section == "Deployment"]
    assert len(deployment) == 9
    assert deployment[0].name == "Denylist" and deployment[-1].name == "Inforom"
    assert all(t.results[0].status == "Pass" and t.results[0].gpus == "all" for t in deployment)
    assert _test(diag, "PCIe").results[0].text == "Pass - All"
    assert _test(diag, "GPU Memory").section == "Hardware"
    assert not any(t.section == "Stress" for t in diag.tests)
    assert len(diag.tests) == 11
    assert diag.failed_gpus() == {}
    assert diag.gaps == []


def test_pcie_fail_all_with_wrapped_cuda_warning():
    diag = dcgm.parse_diag(real_text(PCIE_FAIL))  # begins with a shell prompt line
    assert (diag.dcgm_version, diag.driver_version) == ("3.3.0", "530.30.02")
    assert diag.gpu_device_ids == ["2204"] * 8
    pcie = _test(diag, "PCIe")
    assert pcie.section == "Integration" and pcie.line == 21
    assert [(r.status, r.gpus) for r in pcie.results] == [("Fail", "all")]
    message = pcie.messages[0]
    # slices end in a space ("errors. " / "Reset") and mid-token ("00000" / "000:1B:00.0")
    assert "cudaDeviceGetByPCIBusId Check DCGM and system logs for errors. Reset GPU." in message
    assert message.endswith("'system has unsupported display driver / cuda driver combination' "
                            "for GPU 0, bus ID = 00000000:1B:00.0")
    assert _test(diag, "GPU Memory").results[0].status == "Skip"
    failed = diag.failed_gpus()
    assert sorted(failed) == list(range(8))  # "Fail - All" on an 8-GPU node
    assert failed[0] == ["PCIe", message]  # the warning names GPU 0 only
    assert failed[5] == ["PCIe"]
    assert diag.gaps == []


def test_synthetic_gpu2_memory_failure():
    diag = dcgm.parse_diag(synthetic_text("dcgm/dcgmi-diag-r2-h100-gpu-memory-fail-gpu2.txt"))
    memory = _test(diag, "GPU Memory")
    assert memory.section == "Hardware"
    assert [(r.status, r.gpus) for r in memory.results] == [("Pass", [0, 1, 3, 4, 5, 6, 7]), ("Fail", [2])]
    assert memory.messages == ["Found 2 faulty memory elements on GPU 2 Run a field diagnostic on the GPU."]
    assert diag.failed_gpus() == {2: ["GPU Memory", memory.messages[0]]}
    assert diag.gaps == []
    summary = dcgm.summarize(diag)
    assert summary[0].startswith("dcgmi diag (table): DCGM 3.3.5, driver 535.161.08, 8 GPUs")
    assert "  Hardware: 1 fail" in summary
    assert "  Stress: no tests run" in summary
    assert any(line.startswith("  FAIL Hardware/GPU Memory: GPU 2") for line in summary)


def test_synthetic_json_form():
    diag = dcgm.parse_diag(synthetic_text("dcgm/dcgmi-diag-r1-j-row-remap-pending-gpu3.json"))
    assert diag.form == "json"
    assert (diag.dcgm_version, diag.driver_version) == ("3.3.5", "535.161.08")
    assert diag.gpu_device_ids == ["20b5"] * 4
    remap = _test(diag, "Page Retirement/Row Remap")
    assert remap.section == "Deployment"
    assert [(r.status, r.gpus) for r in remap.results] == [("Fail", [3])]
    assert remap.message_details[0].kind == "Error"
    memory = _test(diag, "GPU Memory")
    assert [r.gpus for r in memory.results if r.status == "Fail"] == [[3]]
    assert memory.line > remap.line > 0
    assert diag.failed_gpus() == {3: [
        "Page Retirement/Row Remap",
        "GPU 3 has uncorrectable memory errors and row remappings are pending",
        "GPU Memory",
        "Found 4 faulty memory elements on GPU 3",
    ]}
    assert diag.gaps == []


_STENCIL = "| {:<25} | {:<46} |"


def test_cut_gpu_list_and_warn_rows():
    # ReplaceTag cuts a value longer than the 46-wide cell to 43 characters + "..."
    def cut(failed: tuple[int, ...]) -> str:
        full = "Pass - GPUs: " + ", ".join(str(i) for i in range(16) if i not in failed) + "   "
        return full[:43] + "..."

    assert cut((3,)).endswith(" 10,...") and cut((3, 5, 7)).endswith(" 11, 1...")
    text = "\n".join([
        _STENCIL.format("Targeted Power", cut((3,))),
        _STENCIL.format("Memtest", cut((3, 5, 7))),
        _STENCIL.format("", "Warn - GPU: 15"),
        _STENCIL.format("Info", "GPU 15 power capped"),
    ])
    diag = dcgm.parse_diag(text)
    power, memtest = diag.tests[0], diag.tests[1]
    assert power.results[0].gpus == [0, 1, 2, 4, 5, 6, 7, 8, 9, 10]  # "10," is whole
    assert power.results[0].truncated
    assert memtest.results[0].gpus == [0, 1, 2, 4, 6, 8, 9, 10, 11]  # the "1" before "..." is not
    assert memtest.results[1].status == "Warn" and memtest.results[1].gpus == [15]
    assert (power.status, memtest.status) == ("Pass", "Warn")
    assert memtest.message_details[0].kind == "Info"
    assert memtest.message_details[0].gpus == [15]
    assert diag.failed_gpus() == {}  # a warning is not a failure
    assert any("cut by dcgmi" in gap.reason for gap in diag.gaps)


def test_dcgmi_error_instead_of_table_is_a_gap():
    diag = dcgm.parse_diag("Error: Unable to complete diagnostic for group 0. Return: (-3) Timeout.\n")
    assert diag.tests == []
    assert any("Unable to complete diagnostic" in gap.reason for gap in diag.gaps)


def test_detect():
    assert dcgm.detect(real_text(ALL_PASS)) > 0.9
    assert dcgm.detect(real_text(PCIE_FAIL)) > 0.9
    assert dcgm.detect(real_text(ROW_REMAP)) > 0.9
    assert 0.5 < dcgm.detect(real_text(THERMAL)) < 0.9  # headerless excerpt: rows only
    assert dcgm.detect(synthetic_text("dcgm/dcgmi-diag-r1-j-row-remap-pending-gpu3.json")) > 0.9
    assert dcgm.detect("| GPU  Name        Persistence-M | Bus-Id   Disp.A |") == 0.0
    assert dcgm.detect("NIC statistics:\n rx_packets: 1\n") == 0.0


@given(st.text(max_size=2000))
def test_never_raises(text):
    result = dcgm.parse_diag(text)
    assert isinstance(result.tests, list)
    dcgm.summarize(result)
    result.failed_gpus()


_ROW_TEXT = st.text(alphabet=st.characters(blacklist_categories=("Cs", "Cc")), max_size=90)


@given(_ROW_TEXT, st.sampled_from(["| ", "+", "|", "{", ""]))
def test_bad_row_keeps_the_good_rows_around_it(junk, lead):
    good = real_text(ALL_PASS).splitlines()
    text = "\n".join(good[:12] + [lead + junk] + good[12:])
    diag = dcgm.parse_diag(text)
    assert diag.dcgm_version == "3.3.3"
    names = [t.name for t in diag.tests]
    assert "Denylist" in names and "GPU Memory" in names and "PCIe" in names


@given(st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(
        st.sampled_from(["DCGM GPU Diagnostic", "test_categories", "category", "tests", "name", "results",
                         "status", "gpu_id", "warnings", "warning", "info", "version", "GPU Device IDs"]),
        inner, max_size=5),
    max_leaves=30,
))
def test_json_of_any_shape_never_raises(value):
    import json

    diag = dcgm.parse_diag(json.dumps({"DCGM GPU Diagnostic": value}))
    assert diag.form == "json"
    dcgm.summarize(diag)
    diag.failed_gpus()
