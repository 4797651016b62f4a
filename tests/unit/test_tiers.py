"""The fast tier is a folder: every module under tests/unit/ runs in `make test-unit`, however (or
whether) it writes a mark, and a run of the tier fails if one of them imports torch. Checked on a
copy of tests/conftest.py in a scratch tree, with pytest as `make test-unit` runs it (with the
repository's pyproject.toml)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def _tier(tmp_path: Path, modules: dict[str, str], path: tuple[Path, ...] = ()) -> subprocess.CompletedProcess[str]:
    (tmp_path / "tests" / "unit").mkdir(parents=True)
    shutil.copy(REPO / "tests" / "conftest.py", tmp_path / "tests" / "conftest.py")
    shutil.copy(REPO / "pyproject.toml", tmp_path / "pyproject.toml")  # pytest's options, as make runs it
    for name, text in modules.items():
        (tmp_path / "tests" / "unit" / name).write_text(text)
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "unit", "tests/unit"],
        cwd=tmp_path,
        env={"PYTHONPATH": ":".join(map(str, (*path, REPO / "tests" / "support"))), "PATH": "/usr/bin:/bin"},
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
    # A module named torch, not torch itself: the tier goes by the name in sys.modules, and the real
    # import was 4 of this test's 7 s on a slow core.
    (tmp_path / "path" / "torch").mkdir(parents=True)
    (tmp_path / "path" / "torch" / "__init__.py").write_text("def ones(n):\n    return [1.0] * n\n")
    run = _tier(
        tmp_path,
        {"test_torch.py": "import torch\n\n\ndef test_one():\n    assert torch.ones(1)\n"},
        path=(tmp_path / "path",),
    )
    assert run.returncode == 1 and "1 passed" in run.stdout, run.stdout + run.stderr
    assert "tests/inprocess/" in run.stderr
