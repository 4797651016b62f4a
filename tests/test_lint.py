"""ruff's lint and formatter over braid's Python ([tool.ruff] in pyproject.toml): a lint error, or a
file `ruff format` would change, fails the suite."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
RUFF = Path(sys.executable).with_name("ruff")


PATHS = ["server", "tests", "clients/python/src", "benchmarks", "load", "deploy", "setup.py"]


def test_ruff_finds_nothing():
    out = subprocess.run(
        [str(RUFF), "check", "--output-format", "concise", *PATHS],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stdout + out.stderr


def test_ruff_format_changes_nothing():
    out = subprocess.run(
        [str(RUFF), "format", "--check", *PATHS], cwd=REPO, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stdout + out.stderr
