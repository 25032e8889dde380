"""Shared test helpers: where the real fixtures live, and golden-file comparison.

Golden files (tests/golden/...) pin each real fixture's full parse so any change in what
spikeops reads shows up as a diff; regenerate them deliberately with
``pytest --update-golden`` and review the diff before committing.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from hypothesis import settings

# Parsers are fuzzed on a 2-core CI machine: a slow first example (imports, pandas) must not
# turn into a flaky DeadlineExceeded. Correctness, not speed, is what the fuzz tests assert.
settings.register_profile("spikeops", deadline=None)
settings.load_profile("spikeops")

ROOT = Path(__file__).resolve().parents[1]
TESTS = ROOT / "tests"
SYNTHETIC = TESTS / "fixtures" / "synthetic"
GOLDEN = TESTS / "golden"


def _find_real() -> Path:
    candidates = [
        os.environ.get("SPIKEOPS_REAL_FIXTURES", ""),
        str(ROOT.parent / "shared" / "fixtures" / "real"),
        "/work/shared/fixtures/real",
    ]
    for candidate in candidates:
        if candidate and Path(candidate, "SOURCES.md").is_file():
            return Path(candidate)
    raise RuntimeError(
        "real fixtures not found: set SPIKEOPS_REAL_FIXTURES to shared/fixtures/real"
    )


REAL = _find_real()


def real(relative: str) -> Path:
    """Path of a file under shared/fixtures/real (fails loudly when it is missing)."""
    path = REAL / relative
    assert path.exists(), f"missing real fixture {relative}"
    return path


def real_text(relative: str) -> str:
    return real(relative).read_text(encoding="utf-8")


def synthetic(relative: str) -> Path:
    path = SYNTHETIC / relative
    assert path.exists(), f"missing synthetic fixture {relative}"
    return path


def synthetic_text(relative: str) -> str:
    return synthetic(relative).read_text(encoding="utf-8")


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--update-golden", action="store_true", default=False,
        help="rewrite tests/golden/* from the current parsers instead of comparing",
    )


@pytest.fixture
def golden(request: pytest.FixtureRequest):
    """Compare a JSON-able value to tests/golden/<name>.json (or rewrite it)."""
    update = request.config.getoption("--update-golden")

    def check(name: str, value: object) -> None:
        path = GOLDEN / f"{name}.json"
        text = json.dumps(value, indent=2, sort_keys=True, ensure_ascii=False, allow_nan=True) + "\n"
        if update or not path.exists():
            if not update:
                pytest.fail(f"no golden file {path.relative_to(ROOT)}; run pytest --update-golden")
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text, encoding="utf-8")
            return
        expected = path.read_text(encoding="utf-8")
        # Compared as text: NaN != NaN would make an equal parse of a NaN loss "differ".
        assert text == expected, f"parse differs from {path.relative_to(ROOT)}"

    return check


@pytest.fixture(autouse=True)
def own_ledger(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every test gets a ledger of its own (every incident flow writes one; docs/ledger.md):
    never the user's ~/.local/state/spikeops/ledger.db, never another test's lineages and
    restart budgets."""
    monkeypatch.setenv("SPIKEOPS_LEDGER_URL", f"sqlite:///{tmp_path_factory.mktemp('ledger') / 'ledger.db'}")


@pytest.fixture(scope="session")
def prefect_server():
    """One temporary Prefect server (SQLite in a temp dir) for every test that runs a flow:
    starting one costs ~15 s here, so the tests share it."""
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness(server_startup_timeout=90):
        yield
