"""The fast tier is a folder: every module under tests/unit/ runs in `make test-unit`, however (or
whether) it writes a mark, and a run of the tier fails if one of them imports torch. Checked on a
copy of tests/conftest.py in a scratch tree, with pytest as `make test-unit` runs it."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def _tier(tmp_path: Path, modules: dict[str, str]) -> subprocess.CompletedProcess[str]:
    (tmp_path / "tests" / "unit").mkdir(parents=True)
    shutil.copy(REPO / "tests" / "conftest.py", tmp_path / "tests" / "conftest.py")
    for name, text in modules.items():
        (tmp_path / "tests" / "unit" / name).write_text(text)
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "unit", "tests/unit"],
        cwd=tmp_path,
        env={"PYTHONPATH": str(REPO / "tests" / "support"), "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_a_module_under_tests_unit_runs_in_the_tier_with_no_mark_written(tmp_path):
    run = _tier(
        tmp_path,
        {
            "test_plain.py": "def test_one():\n    pass\n",
            "test_marked_otherwise.py": "import pytest\n\n\n@pytest.mark.unit\ndef test_two():\n    pass\n",
        },
    )
    assert run.returncode == 0 and "2 passed" in run.stdout, run.stdout + run.stderr


def test_a_module_under_tests_unit_that_imports_torch_fails_the_tier(tmp_path):
    run = _tier(tmp_path, {"test_torch.py": "import torch\n\n\ndef test_one():\n    assert torch.ones(1)\n"})
    assert run.returncode == 1 and "1 passed" in run.stdout, run.stdout + run.stderr
    assert "tests/inprocess/" in run.stderr
