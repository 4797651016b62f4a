"""What a GGUF file costs braid on the way in: its first conversion (seconds, CPU seconds, the
converted folder's bytes) and later starts (seconds to health SERVING, resident memory after the
first call), each start a fresh `braid serve` on the folder the conversion made.

    .venv/bin/python benchmarks/conversion.py [--model FILE.gguf] [--starts 3] [--threads 2]

Prints one JSON object. The conversion goes into a fresh --cache-dir (removed after), so it leaves
~/.cache/braid alone. Timings on a shared machine are noisy: compare builds alternated, in one run.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "support"))
from braid_testing.process import BRAID, free_port  # noqa: E402

from braid.client import Client  # noqa: E402


def folder_bytes(folder: Path) -> dict[str, int]:
    return {p.name: p.stat().st_size for p in sorted(folder.iterdir()) if p.is_file()}


def convert(model: list[str], cache: Path) -> dict:
    """`braid warmup` into cache: its wall and CPU seconds, and what it wrote."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    started = time.perf_counter()
    subprocess.run([str(BRAID), "warmup", *model, "--cache-dir", str(cache)], check=True, capture_output=True)
    wall = time.perf_counter() - started
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    (folder,) = (cache / "models").iterdir()
    files = folder_bytes(folder)
    return {
        "convert_s": round(wall, 1),
        "convert_cpu_s": round(after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime, 1),
        "folder_bytes": sum(files.values()),
        "files": files,
    }


def _status(pid: int) -> dict[str, int]:
    """VmRSS and VmHWM (the peak), in MiB."""
    fields = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines() if ":" in line)
    return {k: int(fields[k].split()[0]) // 1024 for k in ("VmRSS", "VmHWM")}


def _cpu_s(pid: int) -> float:
    """The process's CPU seconds so far (user + system): less noisy than wall time on shared cores."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return round((int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK"), 1)


def start(model: list[str], cache: Path, threads: int) -> dict:
    """One `braid serve`: seconds (and its CPU seconds) to health SERVING, then one 8-token call,
    then its memory."""
    port = free_port()
    argv = [str(BRAID), "serve", *model, "--cache-dir", str(cache), "--port", str(port), "--threads", str(threads)]
    started = time.perf_counter()
    server = subprocess.Popen([*argv, "--log-level", "warning"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        with Client(f"127.0.0.1:{port}") as client:
            while True:
                if server.poll() is not None:
                    raise RuntimeError(f"braid serve exited with {server.returncode}")
                try:
                    if client.health(timeout=1) == "SERVING":
                        break
                except Exception:
                    time.sleep(0.1)
            serving, cpu = time.perf_counter() - started, _cpu_s(server.pid)
            client.generate("The capital of France is", max_new_tokens=8, ignore_eos=True)
            return {"start_s": round(serving, 1), "start_cpu_s": cpu, **_status(server.pid)}
    finally:
        server.terminate()
        server.wait(60)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="a .gguf file (default: the embedded model)")
    parser.add_argument("--starts", type=int, default=3, help="later starts; medians are quoted")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument(
        "--keep", type=Path, help="convert into this cache dir and keep it (converted already: starts only)"
    )
    args = parser.parse_args()
    model = ["--model", args.model] if args.model else []
    cache = args.keep or Path(tempfile.mkdtemp(prefix="braid-conversion-"))
    try:
        done = list((cache / "models").iterdir()) if (cache / "models").is_dir() else []
        result = {"files": folder_bytes(done[0])} if done else convert(model, cache)
        starts = [start(model, cache, args.threads) for _ in range(args.starts)]
    finally:
        if args.keep is None:
            shutil.rmtree(cache, ignore_errors=True)
    for key in ("start_s", "start_cpu_s", "VmRSS", "VmHWM"):
        result[key] = statistics.median(s[key] for s in starts)
    result["starts"] = starts
    result["load"] = os.getloadavg()[0]
    print(json.dumps(result))


if __name__ == "__main__":
    main()
