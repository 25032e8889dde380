"""`spikeops parse`: exit codes, one-line errors, JSON output, bundles and directories."""

from __future__ import annotations

import io
import json
import subprocess
import sys

import pytest

from spikeops.cli import main
from tests.conftest import ROOT, real


def run(*argv: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    code = main(list(argv), out=out, err=err)
    return code, out.getvalue(), err.getvalue()


def test_parse_detects_and_summarizes():
    code, out, err = run("parse", str(real("ethtool/mlx5-cx-xdp-kernel-5.15-rx-discards-pause_netdev-ml.txt")))
    assert code == 0, err
    assert ": ethtool" in out
    assert "rx_out_of_buffer: 990,473,555" in out


def test_parse_json_is_valid_and_complete():
    code, out, _ = run("parse", "--json", str(real("ethtool/intel-i40e-style-crc-errors_showmax.txt")))
    assert code == 0
    document = json.loads(out)
    assert document["kind"] == "ethtool"
    assert document["result"]["counters"]["rx_crc_errors"] == 223
    assert document["detected"] is True


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (b"", "empty"),
        (bytes(range(256)) * 10, "binary"),
        (b"just some prose that no tool prints\nanother line\n", "not a kind of output"),
    ],
)
def test_bad_input_is_one_line_exit_2(tmp_path, content, message):
    path = tmp_path / "input.txt"
    path.write_bytes(content)
    code, out, err = run("parse", str(path))
    assert code == 2
    assert out == ""
    assert message in err
    assert err.count("\n") == 1
    assert "Traceback" not in err


def test_missing_file_and_unknown_kind(tmp_path):
    code, _, err = run("parse", str(tmp_path / "nope.log"))
    assert code == 2 and "no such file" in err
    code, _, err = run("parse", "--kind", "tea-leaves", str(real("ethtool/bnxt_en-10g-per-queue-format_showmax.txt")))
    assert code == 2 and "unknown kind" in err


def test_forced_wrong_kind_says_nothing_reads(tmp_path):
    path = tmp_path / "prose.txt"
    path.write_text("hello\nworld\n")
    code, _, err = run("parse", "--kind", "ethtool", str(path))
    assert code == 2
    assert "nothing in it reads as ethtool" in err


def test_list_kinds_names_every_registered_kind():
    from spikeops.probes import kind_names

    code, out, _ = run("parse", "--list-kinds")
    assert code == 0
    listed = {line.split()[0] for line in out.splitlines()}
    assert listed == set(kind_names())


def test_bundle_directory_is_described():
    code, out, err = run("parse", str(ROOT / "examples" / "bundle-xid79"))
    assert code == 0, err
    assert "incident inc-20261129T180312Z-4412" in out
    assert "node gpu-004: UNREACHABLE" in out
    assert "nodes/gpu-004: unreachable" in out
    assert ("nodes/gpu-003/nvidia-smi-q: command-failed (Unable to determine the device handle "
            "for GPU0000:5D:00.0: Unknown Error)") in out


def test_bundle_json(tmp_path):
    code, out, _ = run("parse", "--json", str(ROOT / "examples" / "bundle-xid79"))
    assert code == 0
    document = json.loads(out)
    assert [node["node"] for node in document["nodes"]] == ["gpu-001", "gpu-002", "gpu-003", "gpu-004"]


def test_broken_bundle_is_one_line(tmp_path):
    (tmp_path / "incident.json").write_text("[1, 2")
    code, _, err = run("parse", str(tmp_path))
    assert code == 2
    assert "incident.json" in err and err.count("\n") == 1


def test_gzip_input(tmp_path):
    import gzip

    path = tmp_path / "ethtool.txt.gz"
    path.write_bytes(gzip.compress(real("ethtool/intel-i40e-style-crc-errors_showmax.txt").read_bytes()))
    code, out, _ = run("parse", str(path))
    assert code == 0 and "ethtool" in out


def test_console_script_help_runs_as_a_module():
    proc = subprocess.run([sys.executable, "-m", "spikeops", "parse", "--help"], capture_output=True, text=True)
    assert proc.returncode == 0
    assert "--kind" in proc.stdout and "Exit status" in proc.stdout


def test_every_command_listed_for_help_is_the_one_built_in_full() -> None:
    """``spikeops --help`` lists each command by a one-line entry (``COMMANDS``) without
    importing it; the command's own parser must say the same, or the two drift apart."""
    from spikeops.cli import COMMANDS, build_parser

    def helps(parser):
        action = next(a for a in parser._actions if a.dest == "command")
        return {choice.dest: choice.help for choice in action._choices_actions}

    stubs, full = helps(build_parser()), helps(build_parser(full=True))
    assert list(stubs) == [name for name, _, _ in COMMANDS] == list(full)
    assert stubs == full
    for name, _, _ in COMMANDS:  # each command builds alone, in full: with its handler
        action = next(a for a in build_parser(name)._actions if a.dest == "command")
        sub = action.choices[name]
        assert callable(sub._defaults.get("handler")) or any(
            callable(getattr(a, "choices", {}) and next(iter(a.choices.values()))._defaults.get("handler"))
            for a in sub._actions if a.dest in ("action", "config_action")), name


def test_a_checkpoint_verify_imports_only_what_it_needs(tmp_path) -> None:
    """The start-up a verify pays: no other command's modules, no pandas, no Prefect."""
    import subprocess
    import sys

    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / "model.pt").write_bytes(b"x" * 4096)
    code = ("import sys\nfrom spikeops.cli import main\n"
            f"assert main(['checkpoint', 'manifest', {str(tmp_path / 'ckpt')!r}]) == 0\n"
            f"assert main(['checkpoint', 'verify', {str(tmp_path / 'ckpt')!r}]) == 0\n"
            "print(' '.join(sorted(sys.modules)))\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    loaded = set(done.stdout.split())
    for heavy in ("pandas", "prefect", "rich", "spikeops.diagnosis", "spikeops.watch", "spikeops.baselines",
                  "spikeops.cli.serve", "spikeops.cli.scheduler", "spikeops.probes.nvidia_smi"):
        assert heavy not in loaded, heavy
    assert "spikeops.cli.checkpoint" in loaded and "blake3" in loaded
