"""The docs stay true: figures quoted from the benchmarks are the benchmarks', versions agree, and the
README's `braid-client` commands run as written against a real server."""

from __future__ import annotations

import concurrent.futures
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

from conftest import REPO

BENCHMARKS = (REPO / "docs" / "benchmarks.md").read_text()
README = (REPO / "README.md").read_text()
BIN = Path(sys.executable).parent


def test_load_readme_quotes_only_figures_from_the_benchmarks():
    figures = re.findall(r"(\d[\d,]*(?:\.\d+)?) (?:tok/s|tokens/s|ms)\b", (REPO / "load" / "README.md").read_text())
    for figure in figures:
        assert re.search(rf"(?<![\d.,]){re.escape(figure)}(?![\d])", BENCHMARKS), (
            f"load/README.md quotes {figure}, which docs/benchmarks.md does not have"
        )


def test_the_readme_pins_the_torch_of_the_makefile_and_the_dockerfile():
    makefile = re.search(r"^TORCH\s*\?=\s*torch==(\S+)", (REPO / "Makefile").read_text(), re.M)[1]
    dockerfile = re.search(r"^ARG TORCH_VERSION=(\S+)", (REPO / "Dockerfile").read_text(), re.M)[1]
    assert makefile == dockerfile
    assert re.findall(r"torch==([\w.+]+)", README) and set(re.findall(r"torch==([\w.+]+)", README)) == {makefile}


def readme_client_commands() -> list[list[str]]:
    """Each `.venv/bin/braid-client ...` line of the README, its comment dropped; a line of
    alternatives (`--info | --status`) is one command per alternative."""
    commands = []
    for line in re.findall(r"^\s+\.venv/bin/braid-client (.+)$", README, re.M):
        line = re.sub(r"\s+#.*$", "", line)
        for alternative in re.split(r" \| ", line) if " | " in line else [line]:
            commands.append([str(BIN / "braid-client"), *shlex.split(alternative)])
    return commands


def test_the_readme_client_commands_run_against_a_server(smol):
    commands = readme_client_commands()
    assert len(commands) >= 5, "the README's braid-client examples were not found"
    env = {**os.environ, "BRAID_TARGET": smol.target}
    # all at once, as many users would: the server batches their generations
    with concurrent.futures.ThreadPoolExecutor(len(commands)) as pool:
        results = list(
            pool.map(lambda c: subprocess.run(c, env=env, capture_output=True, text=True, timeout=180), commands)
        )
    for command, result in zip(commands, results):
        assert result.returncode == 0, f"{shlex.join(command[1:])}: {result.stderr[-2000:]}"
        assert result.stdout.strip(), f"{shlex.join(command[1:])} printed nothing"


def test_a_new_benchmark_run_keeps_every_section_it_does_not_write(monkeypatch):
    """bench.py rewrites docs/benchmarks.md; a fixed list of the sections to keep lost each new one
    (issue 15's and 18's, written by hand)."""
    monkeypatch.syspath_prepend(str(REPO / "benchmarks"))
    import report

    written = "# braid benchmarks\n\n## How to reproduce\nthis run\n\n## Results\nthis run's tables\n"
    page = report.with_others_kept(written, BENCHMARKS)
    assert report.section(page, "## Results") == "## Results\nthis run's tables\n"
    assert [h for h in report.headings(BENCHMARKS) if h not in report.headings(page)] == []
    for heading in report.headings(BENCHMARKS):
        if heading not in ("## How to reproduce", "## Results"):
            assert report.section(page, heading) == report.section(BENCHMARKS, heading), heading


def test_the_readmes_python_example_answers_what_its_comment_says_with_the_defaults(smol):
    """The README's first example, run as written against the default server (int8 rows): it answers
    right, word for word as the README shows it. Its question was "What is the capital of France?",
    which the default answers "L'Étoile, ..." (a near-tie that int8 rows flip)."""
    block = re.search(r"^```python\n(from braid\.client import Client\n.*?)^```$", README, re.M | re.S)[1]
    answer = re.search(r"^# (.+)\n\Z", block, re.M)[1]
    run = subprocess.run(
        [sys.executable, "-c", block.replace("localhost:50051", smol.target)],
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.strip() == answer
