"""The servers the benchmark starts: a child process logging to a file, always stopped on exit."""

from __future__ import annotations

import contextlib
import subprocess
from pathlib import Path


@contextlib.contextmanager
def logged_process(command: list[str], log_path: Path, grace_s: float):
    """Yields the running process (stdout and stderr into log_path); on exit terminates it, and
    kills it if it has not ended after grace_s seconds."""
    with open(log_path, "w") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
        try:
            yield process
        finally:
            process.terminate()
            try:
                process.wait(grace_s)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
