"""The fast tier is a folder: every module under tests/unit/ runs in `make test-unit`, however (or
whether) it writes a mark, and a run of the tier fails if one of them imports torch. Checked on a
copy of tests/conftest.py in a scratch tree, with pytest as `make test-unit` runs it (with the
repository's pyproject.toml)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def tier(tmp_path_factory: pytest.TempPathFactory) -> subprocess.CompletedProcess[str]:
    """One run of the tier over a scratch tests/unit/ of three modules: one with no mark, one that
    marks its test another way, and one that imports torch. A module named torch, not torch itself:
    the tier goes by the name in sys.modules, and the real import was 4 of 7 s on a slow core."""
    root = tmp_path_factory.mktemp("tier")
    (root / "path" / "torch").mkdir(parents=True)
    (root / "path" / "torch" / "__init__.py").write_text("def ones(n):\n    return [1.0] * n\n")
    (root / "tests" / "unit").mkdir(parents=True)
    shutil.copy(REPO / "tests" / "conftest.py", root / "tests" / "conftest.py")
    shutil.copy(REPO / "pyproject.toml", root / "pyproject.toml")  # pytest's options, as make runs it
    modules = {
        "test_plain.py": "def test_one():\n    pass\n",
        "test_marked_otherwise.py": "import pytest\n\n\n@pytest.mark.unit\ndef test_two():\n    pass\n",
        "test_torch.py": "import torch\n\n\ndef test_three():\n    assert torch.ones(1)\n",
    }
    for name, text in modules.items():
        (root / "tests" / "unit" / name).write_text(text)
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "unit", "tests/unit"],
        cwd=root,
        env={"PYTHONPATH": ":".join(map(str, (root / "path", REPO / "tests" / "support"))), "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_a_module_under_tests_unit_runs_in_the_tier_with_no_mark_written(tier):
    assert "3 passed" in tier.stdout and "failed" not in tier.stdout and "error" not in tier.stdout, (
        tier.stdout + tier.stderr
    )


def test_a_module_under_tests_unit_that_imports_torch_fails_the_tier(tier):
    assert tier.returncode == 1 and "3 passed" in tier.stdout, tier.stdout + tier.stderr
    assert "tests/inprocess/" in tier.stderr
