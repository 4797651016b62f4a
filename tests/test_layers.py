"""The layer rules hold (pyproject.toml's import-linter contracts): http | grpc -> frontend -> engine ->
runner -> model with nothing importing upward and the two front ends never importing each other, grpc
and the .proto in the gRPC edge alone, the runner's types reached only through the engine's,
telemetry a leaf, no torch in the front ends or the engine."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from conftest import REPO


def test_the_import_contracts_hold():
    lint = Path(sys.executable).with_name("lint-imports")
    result = subprocess.run([str(lint), "--no-cache"], cwd=REPO, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    assert "0 broken" in result.stdout
