"""The README stays true: every `braid serve` flag and its environment variable are documented, and
its two commands set up what it says they do, saying what they are doing."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

from braid.server.cli import build_parser, env_name
from conftest import REPO


def _serve_flags() -> list[str]:
    serve = build_parser()._subparsers._group_actions[0].choices["serve"]
    return [a.option_strings[0] for a in serve._actions if a.option_strings and a.option_strings[0] != "-h"]


def test_every_serve_flag_and_env_var_is_in_the_readme():
    readme = (REPO / "README.md").read_text()
    documented = set(re.findall(r"`(--[a-z-]+)`", readme))
    for flag in _serve_flags():
        assert flag in documented, f"{flag} is missing from the README's flag table"
        assert env_name(flag[2:].replace("-", "_")) in readme, f"{flag}'s environment variable is missing"


def test_the_readme_names_the_two_commands():
    readme = (REPO / "README.md").read_text()
    assert "make serve" in readme and "make test" in readme


def make_commands(target: str, venv: Path) -> list[str]:
    """The commands `make TARGET` runs from a fresh clone (every target out of date), not run."""
    dry = subprocess.run(
        ["make", "--no-print-directory", "-n", "-B", target, f"VENV={venv}"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    return dry.stdout.splitlines()


def make_echoes(target: str, venv: Path, *variables: str) -> list[str]:
    """What make itself prints for `make TARGET` from a fresh clone: each command is handed to a
    shell that does nothing, so only the lines make echoes are left (not the recipes' own output)."""
    run = subprocess.run(
        ["make", "--no-print-directory", "-B", target, f"VENV={venv}", "SHELL=/bin/true", *variables],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    return run.stdout.splitlines()


def test_make_serve_installs_what_serving_needs_and_make_test_adds_the_test_extra(tmp_path):
    serve, test = make_commands("serve", tmp_path), make_commands("test", tmp_path)
    assert not [line for line in serve if "[test]" in line], "make serve installs the test extra"
    assert [line for line in test if "pip install" in line and "[test]" in line]
    assert set(serve) - set(test) == {
        f"{tmp_path}/bin/braid serve --http-port 8000 "
    }  # make test: the same set-up, and more


def test_make_echoes_no_comment_and_no_set_up_command(tmp_path):
    assert make_echoes("serve", tmp_path) == [f"{tmp_path}/bin/braid serve --http-port 8000 "]
    # (make_echoes' shell does nothing, so TEST_WORKERS, which asks a shell, is named here)
    assert make_echoes("test", tmp_path, "TEST_WORKERS=3") == [
        f"{tmp_path}/bin/python -m pytest -q -n 3 --dist loadfile"
    ]


def test_make_test_runs_a_worker_per_core_and_one_more(tmp_path, monkeypatch):
    """Whatever OMP_NUM_THREADS the caller has (the suite's own workers run under 1)."""
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    workers = min(len(os.sched_getaffinity(0)) + 1, 8)
    assert f"{tmp_path}/bin/python -m pytest -q -n {workers} --dist loadfile" in make_commands("test", tmp_path)


def test_make_says_what_it_installs_before_the_long_steps(tmp_path):
    commands = make_commands("serve", tmp_path)
    for long_step in ("pip install --quiet torch", "pip install --quiet -e clients/python -e ."):
        (at,) = [i for i, line in enumerate(commands) if long_step in line]
        assert re.fullmatch(r'echo "braid: installing .*minute.*"', commands[at - 1]), commands[at - 1]  # how long
