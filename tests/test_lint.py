"""ruff's lint over braid's Python ([tool.ruff] in pyproject.toml): a lint error fails the suite."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
RUFF = Path(sys.executable).with_name("ruff")


def test_ruff_finds_nothing():
    out = subprocess.run([str(RUFF), "check", "--output-format", "concise", "server", "tests", "clients/python/src",
                          "benchmarks", "load", "deploy"], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
