"""`make test-unit` (pytest -m unit): only the modules marked unit are even imported, and none of
them may bring torch in (the engine and the edge are torch-free; a unit test that needs torch
belongs to the full suite)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

_MARK = "pytestmark = pytest.mark.unit"


def _unit_run(config) -> bool:
    return config.getoption("markexpr", "") == "unit"


def pytest_ignore_collect(collection_path: Path, config) -> bool | None:
    if _unit_run(config) and collection_path.suffix == ".py" and collection_path.name.startswith("test_"):
        return _MARK not in collection_path.read_text()
    return None


def pytest_sessionfinish(session, exitstatus) -> None:
    if _unit_run(session.config) and "torch" in sys.modules:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
        print("\nmake test-unit: a unit test imported torch (unit tests are torch-free)", file=sys.stderr)
