"""The contract as a product: `buf lint` and `buf breaking` pass on protos/, and both really bite.

buf comes from the PyPI package buf-bin (a `test` extra), installed next to this Python. buf.yaml
at the repository root holds the rules; protos/released.binpb is the image of the last released
contract that `buf breaking` compares against (buf.yaml says how to refresh it on a release).
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
BUF = Path(sys.executable).parent / "buf"
PROTO = Path("protos/braid/v1/generate.proto")
RELEASED = Path("protos/released.binpb")


def buf(*args: str, cwd: Path = REPO) -> subprocess.CompletedProcess[str]:
    assert BUF.exists(), f"{BUF} is missing: install the test extra (pip install -e '.[test]', buf-bin)"
    return subprocess.run([str(BUF), *args], cwd=cwd, capture_output=True, text=True, timeout=60)


@pytest.fixture
def workspace(tmp_path: Path) -> Path:
    """A scratch copy of buf.yaml and protos/, to edit without touching the repository."""
    shutil.copy(REPO / "buf.yaml", tmp_path / "buf.yaml")
    shutil.copytree(REPO / "protos", tmp_path / "protos")
    return tmp_path


def test_lint_passes():
    result = buf("lint")
    assert result.returncode == 0, result.stdout + result.stderr


def test_no_breaking_change_since_the_release():
    assert (REPO / RELEASED).is_file(), f"{RELEASED} is missing (see buf.yaml)"
    result = buf("breaking", "protos", "--against", str(RELEASED))
    assert result.returncode == 0, result.stdout + result.stderr


def test_lint_requires_comments(workspace: Path):
    proto = workspace / PROTO
    proto.write_text(
        proto.read_text().replace(
            "  string request_id = 14;\n", "  string request_id = 14;\n  bool undocumented = 999;\n"
        )
    )
    result = buf("lint", cwd=workspace)
    assert result.returncode != 0
    assert 'Field "undocumented"' in result.stdout and "comment" in result.stdout


@pytest.mark.parametrize(("edit", "expected"), [
    (("string request_id = 14;", "string request_id = 999;"), 'field "14" with name "request_id"'),
    (("bool ignore_eos = 13;", "bool skip_eos = 13;"), '"ignore_eos"'),
    (("  FINISH_REASON_ERROR = 7;\n", "\n"), 'enum value "7" on enum "FinishReason"'),
])  # fmt: skip
def test_breaking_catches_a_changed_contract(workspace: Path, edit: tuple[str, str], expected: str):
    proto = workspace / PROTO
    text = proto.read_text()
    assert edit[0] in text
    proto.write_text(text.replace(edit[0], edit[1]))
    result = buf("breaking", "protos", "--against", str(RELEASED), cwd=workspace)
    assert result.returncode != 0, "buf breaking let a breaking change through"
    assert expected in result.stdout, result.stdout
